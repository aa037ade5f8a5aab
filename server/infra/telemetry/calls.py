"""The SERVER span of one call, made by the pipeline (uibus.edge.pipeline) for every transport alike.

Named and attributed by the OpenTelemetry RPC semantic conventions (`rpc.system` grpc,
`rpc.service`, `rpc.method`, `rpc.grpc.status_code`), plus the transport the call came by and, for
the HTTP-based ones, `http.route`. The caller's W3C context (traceparent, tracestate, baggage) is
read from the call's metadata, which every transport fills from its own headers (gRPC metadata,
gRPC-Web and HTTP headers, MCP requests, the CodeBolt WebSocket upgrade), so continuing the trace
is done here once. A stream's span ends when the stream does, with why (`uibus.call.end`).
"""

from __future__ import annotations

from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, StatusCode

from uibus.infra import telemetry

# Server-side statuses that are the server's failure (the RPC conventions; the rest are the caller's).
_SERVER_ERRORS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"})
_CODES = {code.name: code.value[0] for code in grpc.StatusCode}
_ENDS = {"OK": "completed", "CANCELLED": "cancelled", "DEADLINE_EXCEEDED": "deadline"}


class CallSpans:
    """Starts and ends the span of each call of one method."""

    __slots__ = ("attributes", "name", "tracer")

    def __init__(self, tracer: trace.Tracer, label: str) -> None:
        self.tracer = tracer
        path = label.lstrip("/")
        service, _, method = path.rpartition("/")
        self.name = path
        self.attributes: dict[str, Any] = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}

    def start(self, context: Any) -> tuple[Span, Context]:
        """The call's span, child of the caller's trace if it sent one, and the context to run in."""
        metadata = context.invocation_metadata() or ()
        parent = telemetry.extract(metadata)
        transport = getattr(context, "transport", "grpc")
        attributes = {**self.attributes, "uibus.transport": transport}
        route = getattr(context, "route", None)
        if route:
            attributes["http.route"] = route
        for key, value in metadata:
            if key == "x-uibus-session" and isinstance(value, str):
                attributes["uibus.session"] = value[:200]
                break
        span = self.tracer.start_span(self.name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
        ctx = trace.set_span_in_context(span, parent)
        return span, otel_context.set_value(telemetry.CALLER_KEY, [transport, ""], ctx)

    @staticmethod
    def identify(span: Span, who: str) -> None:
        """The caller its token named (`enduser.id`), also for what this call answers (dialogs)."""
        span.set_attribute("enduser.id", who)
        caller = telemetry.caller()
        if caller is not None:
            caller[1] = who

    @staticmethod
    def end(span: Span, code: str, exc: BaseException | None = None) -> None:
        span.set_attributes({"rpc.grpc.status_code": _CODES.get(code, 2), "uibus.call.end": _ENDS.get(code, "error")})
        if code in _SERVER_ERRORS:
            if exc is not None and not isinstance(exc, grpc.aio.AbortError):
                span.record_exception(exc)
            span.set_status(StatusCode.ERROR, code)
        span.end()


def call_spans(label: str) -> CallSpans | None:
    """The span maker of one method, or None while tracing is off (decided when it is wrapped)."""
    t = telemetry.tracer
    return None if t is None else CallSpans(t, label)

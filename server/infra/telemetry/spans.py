"""The spans inside a call: chat turns, agent tool calls, dialogs, agent processes, HTTP requests.

Each helper is a no-op (one `is None` test) while tracing is off, and makes spans only under a
span that is being recorded: uibus never starts a trace of its own from the inside, so a trace is
a caller's call and what it caused.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, StatusCode

from uibus.infra import telemetry

# ---- chat turns --------------------------------------------------------------------------------


def traced_turn(turn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """Decorates Chat.turn: one span per turn (agent, backend, filter, pieces, outcome), current
    while the turn makes each piece, so what the turn causes (the agent's process start, its tool
    calls, its dialogs, its HTTP requests) are the turn's children."""

    @functools.wraps(turn)
    def wrapper(chat: Any, session: str, agent: str, request: Any, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        stream = turn(chat, session, agent, request, *args, **kw)
        if telemetry.tracer is None or not telemetry.recording():
            return stream
        try:
            backend = chat.spec(agent).backend
        except Exception:  # an unknown agent: the turn itself says so
            backend = ""
        attributes = {"uibus.agent": agent, "uibus.session": session, "uibus.agent.backend": backend,
                      "uibus.chat.filter": int(request.chat_filter.chat_filter_type)}
        return _turn(stream, f"chat turn {agent}", attributes, agent)
    return wrapper


async def _turn(stream: AsyncIterator[Any], name: str, attributes: dict[str, Any], agent: str) -> AsyncIterator[Any]:
    span = telemetry.start_span(name, attributes=attributes)
    if span is None:
        async with aclosing(stream) as pieces:  # type: ignore[type-var]
            async for piece in pieces:
                yield piece
        return
    ctx = trace.set_span_in_context(span)
    count, outcome, last = 0, "cancelled", None
    token = otel_context.attach(ctx)  # current while the turn makes a piece, not between (other tasks)
    try:
        async with aclosing(stream) as pieces:  # type: ignore[type-var]
            async for piece in pieces:
                otel_context.detach(token)
                token = None
                count += 1
                last = piece
                yield piece
                token = otel_context.attach(ctx)
        outcome = "completed"
        text = last.response.text if last is not None and last.HasField("response") else ""
        if text.startswith(f"Error from {agent}:"):  # an agent failure is the turn's answer (Chat.turn)
            outcome = "agent_error"
            span.set_status(StatusCode.ERROR, text[:200])
    except GeneratorExit:
        raise
    except BaseException as exc:
        if not isinstance(exc, Exception):
            raise
        outcome = "failed"
        telemetry.error(span, exc)
        raise
    finally:
        if token is not None:
            otel_context.detach(token)
        span.set_attribute("uibus.chat.pieces", count)
        span.set_attribute("uibus.chat.outcome", outcome)
        span.end()


# ---- agent tool calls --------------------------------------------------------------------------


class ToolSpans:
    """One span per tool call of one turn, from the agent's own events: the turn's pieces that say
    `tool_start` / `tool_end` (pi's tool_execution_*, ACP's tool_call / tool_call_update)."""

    def __init__(self) -> None:
        self.parent = telemetry.current()
        self.open: dict[str, tuple[Span, float]] = {}

    def piece(self, piece: Any) -> None:
        structure = getattr(piece, "structure", None)
        if structure is None or not piece.HasField("structure"):
            return
        kind = structure.fields.get("kind")
        if kind is None:
            return
        what = kind.string_value
        ident = structure.fields["tool_call_id"].string_value if "tool_call_id" in structure.fields else ""
        tool = structure.fields["tool"].string_value if "tool" in structure.fields else ""
        if what == "tool_start":
            span = telemetry.start_span(f"tool {tool}", ctx=self.parent, attributes={
                "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": tool, "gen_ai.tool.call.id": ident})
            if span is not None:
                self.open[ident] = (span, time.monotonic())
        elif what == "tool_end":
            found = self.open.pop(ident, None)
            if found is None:
                return
            span, started = found
            failed = "is_error" in structure.fields and structure.fields["is_error"].bool_value
            status = structure.fields["status"].string_value if "status" in structure.fields else ""
            span.set_attribute("uibus.tool.status", status or ("failed" if failed else "completed"))
            span.set_attribute("uibus.tool.duration_s", round(time.monotonic() - started, 6))
            if failed:
                span.set_status(StatusCode.ERROR, "the tool failed")
            span.end()

    def close(self) -> None:
        """Tool calls the turn left running (cancelled, or the agent died) end now."""
        for span, started in self.open.values():
            span.set_attribute("uibus.tool.status", "unfinished")
            span.set_attribute("uibus.tool.duration_s", round(time.monotonic() - started, 6))
            span.end()
        self.open.clear()


def tool_spans() -> ToolSpans | None:
    """The tool spans of the turn running now, or None (tracing off, or no turn being traced)."""
    if telemetry.tracer is None or not telemetry.recording():
        return None
    return ToolSpans()


# ---- dialogs -----------------------------------------------------------------------------------

OUTCOMES = {"ANSWERED": "answered", "TIMED_OUT": "timed_out"}  # every other way is "cancelled"


def dialog_start(kind: str, session: str, dialog_id: str, timeout_ms: int) -> Span | None:
    """The span of one dialog, from the ask to its end, in the asking call's trace."""
    return telemetry.start_span(f"dialog {kind}", attributes={
        "uibus.dialog.kind": kind, "uibus.dialog.id": dialog_id, "uibus.session": session,
        "uibus.dialog.timeout_ms": timeout_ms})


def dialog_end(span: Span, reason: str, wait_s: float, answered_by: list[str] | None) -> None:
    """`reason`: the DialogOutcome's name without its prefix (ANSWERED, TIMED_OUT, CANCELLED, …)."""
    span.set_attribute("uibus.dialog.outcome", OUTCOMES.get(reason, "cancelled"))
    span.set_attribute("uibus.dialog.reason", reason.lower())
    span.set_attribute("uibus.dialog.wait_s", round(wait_s, 6))
    if answered_by is not None:
        span.set_attribute("uibus.dialog.answered_via", answered_by[0])
        if answered_by[1]:
            span.set_attribute("uibus.dialog.answered_by", answered_by[1])
    span.end()


def outcome_name(reason: str) -> str:
    return OUTCOMES.get(reason, "cancelled")


# ---- agent processes and HTTP backends ---------------------------------------------------------


@asynccontextmanager
async def process_start(agent: str, command: str) -> AsyncIterator[Span | None]:
    """The span of starting one hosted agent's process (its pid is added once known)."""
    span = telemetry.start_span(f"agent process start {agent}", attributes={
        "uibus.agent": agent, "process.executable.name": command})
    try:
        yield span
    except BaseException as exc:
        if span is not None:
            telemetry.error(span, exc)
        raise
    finally:
        if span is not None:
            span.end()


@asynccontextmanager
async def http_request(url: str, headers: dict[str, str]) -> AsyncIterator[Span | None]:
    """A CLIENT span for one backend request; `headers` gain its traceparent, so an instrumented
    backend (a model server, a neuro-san) continues the trace."""
    span = telemetry.start_span("POST", SpanKind.CLIENT, attributes={"http.request.method": "POST", "url.full": url})
    if span is None:
        yield None
        return
    telemetry.inject(headers, trace.set_span_in_context(span))
    try:
        yield span
    except BaseException as exc:
        if isinstance(exc, Exception):
            telemetry.error(span, exc)
        raise
    finally:
        span.end()


# ---- the bus between replicas ------------------------------------------------------------------


def published(session: str, kind: str) -> str | None:
    """One PRODUCER span per event a traced call publishes to the other replicas (not one per
    delivery): its traceparent travels in the envelope (uibus.infra.redis.codec)."""
    span = telemetry.start_span(f"publish {kind}", SpanKind.PRODUCER, attributes={
        "messaging.system": "redis", "messaging.operation.type": "publish", "messaging.destination.name": kind,
        "uibus.session": session})
    if span is None:
        return None
    value = telemetry.traceparent(trace.set_span_in_context(span))
    span.end()
    return value


class received:
    """The CONSUMER span of one envelope delivered on this replica, child of the publisher's."""

    __slots__ = ("span", "token")

    def __init__(self, traceparent: str, session: str, kind: str, origin: str) -> None:
        t = telemetry.tracer
        self.span = None if t is None else t.start_span(
            f"receive {kind}", context=telemetry.from_traceparent(traceparent), kind=SpanKind.CONSUMER, attributes={
                "messaging.system": "redis", "messaging.operation.type": "receive",
                "messaging.destination.name": kind, "uibus.session": session, "uibus.bus.origin": origin})
        self.token: Any = None

    def __enter__(self) -> Span | None:
        if self.span is not None:
            self.token = otel_context.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, *exc: object) -> None:
        if self.span is not None:
            otel_context.detach(self.token)
            self.span.end()


# ---- the Redis store ---------------------------------------------------------------------------


def store_op(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorates a RedisStore operation `(self, session, …)`: a CLIENT span per call made inside a
    traced call (the store is the one part that leaves the process per call besides the bus)."""

    def decorate(op: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(op)
        async def traced(self: Any, session: str, *args: Any, **kw: Any) -> Any:
            if telemetry.tracer is None:
                return await op(self, session, *args, **kw)
            span = telemetry.start_span(f"redis {name}", SpanKind.CLIENT, attributes={
                "db.system.name": "redis", "db.operation.name": name, "uibus.session": session})
            if span is None:
                return await op(self, session, *args, **kw)
            try:
                return await op(self, session, *args, **kw)
            except Exception as exc:
                telemetry.error(span, exc)
                raise
            finally:
                span.end()
        return traced
    return decorate

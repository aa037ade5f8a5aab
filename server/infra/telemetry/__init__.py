"""OpenTelemetry traces: off unless the standard `OTEL_*` environment configures them.

Why a package of our own: every part of uibus that makes a span (the pipeline, the chat turn, the
dialogs, the hosted agents, the Redis bus) asks here, and here alone decides whether tracing is on.
When it is off `tracer` is None: no span objects, no propagator work — each hook is one `is None`
test (bench/instructions.py measures that it costs nothing). When it is on, the SDK reads its own
settings (sampler, resource attributes, batch processor, exporter endpoint, headers, protocol);
uibus adds only what the standard leaves to the service: `service.name` "uibus" when none is set,
and a `service.instance.id` per process (the pod's name where Kubernetes gives one, plus the
worker index or the pid), so replicas and workers are told apart.

The provider is one per process (a replica is a process); Apps in one process (tests) share it:
the first `acquire` builds it, the last `release` flushes and shuts it down.

Context: OpenTelemetry's current context lives in a contextvar. uibus's handlers are async
generators, resumed from different tasks (the call driver takes a stream's first message in a task
of its own), so a span is made current only for one resumption at a time (the pipeline and the
chat turn attach it before each step and detach it before each yield), owned background tasks
start outside any trace (uibus.infra.tasks), and work that runs in a task of its own for a turn (an
agent's dialog) adopts the turn's context (`adopted`).
"""

from __future__ import annotations

import contextvars
import logging
import os
import socket
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Span, SpanKind, Tracer

from uibus.infra.errors import ConfigError

log = logging.getLogger("uibus.infra.telemetry")

T = TypeVar("T")

# None while tracing is off: every hook tests this first, and does nothing more.
tracer: Tracer | None = None
_provider: Any = None
_users = 0
_w3c_only = True  # OTEL_PROPAGATORS is the default (W3C trace context and baggage)

SERVICE_NAME = "uibus"
# The OpenTelemetry context key of the call being served: (transport, caller identity or "").
CALLER_KEY = otel_context.create_key("uibus.caller")


def configured(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard environment asks for traces: an OTLP endpoint, or an explicit traces
    exporter other than `none`; never with OTEL_SDK_DISABLED=true."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER")
    if exporters is not None:
        return exporters.strip().lower() not in ("", "none")
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def instance_id(worker: int | None = None, env: Mapping[str, str] = os.environ) -> str:
    """This process's `service.instance.id`: the pod's name (POD_NAME from the downward API, else
    HOSTNAME, which Kubernetes sets to it), then the worker index or the pid."""
    host = env.get("POD_NAME") or env.get("HOSTNAME") or socket.gethostname()
    return f"{host}/worker-{worker}" if worker is not None else f"{host}/{os.getpid()}"


def _build(worker: int | None) -> Any:
    """A TracerProvider from the standard environment (the SDK reads it; see the module docstring)."""
    from opentelemetry.sdk._configuration import _get_exporter_entry_point, _get_exporter_names, _import_exporters
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    detected = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    ours: dict[str, str] = {}
    if str(detected.attributes.get("service.name", "")).startswith("unknown_service"):
        ours["service.name"] = SERVICE_NAME
    # The SDK makes up a random id; the operator's own (OTEL_RESOURCE_ATTRIBUTES) wins over ours.
    if "service.instance.id" not in OTELResourceDetector().detect().attributes:
        ours["service.instance.id"] = instance_id(worker)
    provider = TracerProvider(resource=detected.merge(Resource(ours)))  # sampler: OTEL_TRACES_SAMPLER(_ARG)
    # OTEL_TRACES_EXPORTER (default otlp), by OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL (grpc, http/protobuf).
    names = _get_exporter_names("traces") or [_get_exporter_entry_point("otlp", "traces")]
    exporters, _, _ = _import_exporters(names, [], [])
    for exporter in exporters.values():
        provider.add_span_processor(BatchSpanProcessor(exporter()))  # OTEL_BSP_*, OTEL_EXPORTER_OTLP_*
    return provider


def acquire(worker: int | None = None) -> bool:
    """Turns tracing on for this process if the environment configures it (once: later callers
    share the provider). True when tracing is on. Pair each call with `release`."""
    global tracer, _provider, _users, _w3c_only
    if _provider is None:
        if not configured():
            return False
        try:
            _provider = _build(worker)
        except Exception as exc:  # an unknown exporter or protocol, a bad sampler argument: say which
            raise ConfigError("OTEL_* (tracing)", f"the OpenTelemetry settings do not work: {exc}") from None
        _w3c_only = _default_propagators()
        tracer = _provider.get_tracer("uibus")
    _users += 1
    return True


def summary() -> dict[str, Any] | None:
    """What the "serving" log line says of tracing: this process's service and instance, or None."""
    if _provider is None:
        return None
    attributes = _provider.resource.attributes
    return {key: attributes.get(key) for key in ("service.name", "service.instance.id")}


def release() -> None:
    """The last user gone: spans still queued are exported, then tracing is off again."""
    global tracer, _provider, _users
    if _provider is None:
        return
    _users -= 1
    if _users > 0:
        return
    provider, _provider, tracer = _provider, None, None
    try:
        provider.shutdown()
    except Exception as exc:  # an exporter that cannot reach its collector must not fail the exit
        log.warning("trace export at exit failed", extra={"fields": {"error": str(exc)[:200]}})


# ---- propagation ------------------------------------------------------------------------------

class _MetadataGetter(Getter[Iterable[tuple[str, Any]]]):
    """Reads W3C headers from gRPC metadata or HTTP headers as pairs (keys already lowercase)."""

    def get(self, carrier: Iterable[tuple[str, Any]], key: str) -> list[str] | None:
        found = [v for k, v in carrier if k == key and isinstance(v, str)]
        return found or None

    def keys(self, carrier: Iterable[tuple[str, Any]]) -> list[str]:
        return [k for k, _ in carrier]


METADATA = _MetadataGetter()


_W3C = frozenset({"traceparent", "baggage"})  # what the default propagators start from
_EMPTY = Context()


def _default_propagators() -> bool:
    value = os.environ.get("OTEL_PROPAGATORS")
    return value is None or {p.strip() for p in value.split(",")} <= {"tracecontext", "baggage"}


def extract(metadata: Iterable[tuple[str, Any]]) -> Context:
    """The caller's trace context (traceparent, tracestate, baggage) from a call's metadata, by the
    configured propagators (OTEL_PROPAGATORS; W3C trace context and baggage by default). With the
    default ones, a call that sent neither header costs one scan of its keys, not a propagation."""
    pairs = tuple(metadata or ())
    if _w3c_only and not any(k in _W3C for k, _ in pairs):
        return _EMPTY
    return propagate.extract(pairs, getter=METADATA, context=Context())


def inject(headers: dict[str, str], ctx: Context | None = None) -> dict[str, str]:
    """`headers` with the current (or `ctx`'s) trace context added, for an outgoing request."""
    propagate.inject(headers, context=ctx)
    return headers


def traceparent(ctx: Context | None = None) -> str | None:
    """The W3C traceparent of a recording span in `ctx` (default: the current one), else None."""
    span = trace.get_current_span(ctx)
    if not span.is_recording():
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier.get("traceparent")


def from_traceparent(value: str) -> Context:
    return propagate.extract({"traceparent": value}, context=Context())


# ---- the current span -------------------------------------------------------------------------

def current() -> Context:
    return otel_context.get_current()


def recording(ctx: Context | None = None) -> bool:
    """Whether a sampled span is current (children are worth making): a recording one of ours, or
    a sampled remote one adopted as the parent (a turn another replica forwarded, `adopted`)."""
    return _traced(trace.get_current_span(ctx))


def _traced(span: Span) -> bool:
    if span.is_recording():
        return True
    sc = span.get_span_context()
    return sc.is_valid and sc.is_remote and sc.trace_flags.sampled


def caller() -> list[str] | None:
    """[transport, identity] of the call being served, when tracing is on (identity "" until
    the call's token named one)."""
    return otel_context.get_value(CALLER_KEY)  # type: ignore[return-value]


def untraced() -> contextvars.Context:
    """A copy of the current contextvars with no OpenTelemetry context: for a task of its own."""
    ctx = contextvars.copy_context()
    ctx.run(otel_context.attach, Context())
    return ctx


class as_caller:
    """Runs a block as if serving the call of `transport` / `identity` (an answer another replica
    forwarded: the dialog's span names the UI that gave it). Nothing while tracing is off or
    the forwarder said nothing."""

    __slots__ = ("token", "value")

    def __init__(self, transport: str, identity: str) -> None:
        self.value = [transport, identity] if transport and tracer is not None else None
        self.token: Any = None

    def __enter__(self) -> None:
        if self.value is not None:
            self.token = otel_context.attach(otel_context.set_value(CALLER_KEY, self.value))

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            otel_context.detach(self.token)


async def adopted(ctx: Context | None, coro: Coroutine[Any, Any, T]) -> T:
    """Runs `coro` (in a task of its own) with `ctx` current: work an agent's turn started."""
    if ctx is None:
        return await coro
    token = otel_context.attach(ctx)
    try:
        return await coro
    finally:
        otel_context.detach(token)


def start_span(name: str, kind: SpanKind = SpanKind.INTERNAL, ctx: Context | None = None,
               attributes: dict[str, Any] | None = None) -> Span | None:
    """A span child of `ctx` (default: the current context) when a recording span is there to be
    its parent; None when tracing is off or nothing is being traced (no root spans from inside)."""
    t = tracer
    if t is None or not _traced(trace.get_current_span(ctx)):
        return None
    return t.start_span(name, context=ctx, kind=kind, attributes=attributes)


def annotate(attributes: dict[str, Any]) -> None:
    """Adds `attributes` to the current span (the call being served) when it is recorded: what a
    call means beyond its method (trackIntent's action) goes on the call's own span, not a new one."""
    if tracer is None:
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(attributes)


def error(span: Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200])


def ids() -> dict[str, str] | None:
    """trace_id/span_id of the current span for a log line, or None."""
    if tracer is None:
        return None
    sc = trace.get_current_span().get_span_context()
    if not sc.is_valid:
        return None
    return {"trace_id": format(sc.trace_id, "032x"), "span_id": format(sc.span_id, "016x")}


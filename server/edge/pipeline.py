"""The one handler pipeline: the policies every call runs through, whichever way it came in.

Every method handler uibus serves is wrapped here once, when it is registered, and every
transport runs the wrapped handler: the grpc.aio server, gRPC-Web, the neuro-san HTTP API, the
CodeBolt WebSocket and in-process channels. A transport only translates framing (and hands over
a `Rejected` for input it could not decode), so the same request gets the same status on each.

The policies, outermost first:

0. tracing (only when OTEL_* configures it: uibus.infra.telemetry) — one SERVER span per call, continuing
   the caller's W3C trace context from its metadata, current while the handler runs (for a
   stream: while it makes each message), ended with the call's status and how it ended;
1. metrics — the call is timed and counted under its final status and its transport;
2. errors — a domain error (uibus.infra.errors) becomes its status with its message; an unexpected
   exception becomes INTERNAL with a short message and one log line, never a traceback to the client;
3. authentication and authorization — with tokens configured (uibus.infra.auth), `authorization:
   Bearer <token>` (health stays open for probes, which send no metadata); a call that names a
   session (the `x-uibus-session` key; "default" when absent) must use one its token may use,
   else PERMISSION_DENIED; calls about no session (reflection, agent descriptions) need any valid
   token, process-wide ones (bus statistics) an all-sessions token; a token minted for a
   hosted agent makes only the calls an agent needs (`agent_check`: default-deny, PERMISSION_DENIED);
   without tokens on a loopback bind, the caller's socket must be uibus's own user's (uibus.infra.peers),
   else UNAUTHENTICATED. HTTP doors that run no call (the page, /metrics, /acp) ask `check_bearer`;
   a person's call (or a less-than-owner token's) also needs its method's least role (uibus.edge.calls.roles);
   Then a unary call takes its tenant's token and slot (uibus.edge.calls.admission: fair shares);
4. decoding and limits — a `Rejected` request (undecodable bytes, broken framing, over a limit)
   gets its error's status before the handler runs, with one short log line;
5. liveness — a stream that yields `uibus.infra.bus.LIVE` (its subscription is registered) has its
   response headers sent then, so "headers received" means "subscribed" on every transport. The
   headers carry the pipeline's own metadata, if any (a worker of `uibus serve --workers` sends
   `x-uibus-worker`, so a client can tell which worker answered).

They run in one wrapper per handler, not one wrapper per policy: on streams every extra wrapper
layer costs an extra hop per message, which is most of what a delivery costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any

import grpc
import grpc.aio
from opentelemetry import context as otel_context

from uibus.edge.calls import CallContext, Rejected, decode
from uibus.edge.calls.access import (
    ALL_SESSIONS,
    ITS_SESSION,
    OPEN,
    OWN_USER,
    access_of,
    authorization_of,
    every_session,
)
from uibus.edge.calls.acting import admitted
from uibus.edge.calls.admission import Admission, tenant_here
from uibus.edge.calls.roles import Deferred, RoleCheck, checked
from uibus.edge.calls.scope import agent_check, agent_refusal, agent_tool
from uibus.edge.metrics import Metrics
from uibus.infra.actor import acting, current, snapshot
from uibus.infra.auth import Grant, Tokens, bearer
from uibus.infra.bus import LIVE
from uibus.infra.errors import PermissionDenied, UibusError, Unauthenticated
from uibus.infra.logs import Throttle
from uibus.infra.peers import OwnUserOnly
from uibus.infra.proto_check import json_checker
from uibus.infra.quotas import ANONYMOUS, Quotas
from uibus.infra.session import session_from_metadata
from uibus.infra.telemetry.calls import call_spans

log = logging.getLogger("uibus.edge.calls")

REVOKE_RETRY_S = 0.05  # a revoked stream whose cancel was lost is cancelled again this often ...
REVOKE_RETRIES = 100  # ... this many times at most (5 s)

_STATUS = {code.name: code for code in grpc.StatusCode}
_BY_VALUE = {code.value[0]: code.name for code in grpc.StatusCode}
_BEHAVIORS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")

Behavior = Callable[..., Any]


def shape(handler: grpc.RpcMethodHandler) -> str:
    """The field of `handler` that holds its behaviour: unary_unary, unary_stream, …"""
    return _BEHAVIORS[handler.request_streaming * 2 + handler.response_streaming]


def rebuild(handler: grpc.RpcMethodHandler, behavior: Behavior,
            request_deserializer: Callable[[bytes], Any] | None = None) -> grpc.RpcMethodHandler:
    """A handler of the same shape and codecs as `handler`, running `behavior` instead."""
    changes: dict[str, Any] = {shape(handler): behavior}
    if request_deserializer is not None:
        changes["request_deserializer"] = request_deserializer
    return handler._replace(**changes)  # type: ignore[attr-defined, no-any-return]


def tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """A deserializer that never raises: undecodable bytes become a `Rejected` request (grpc.aio
    would otherwise answer UNKNOWN and log a traceback for every such call). A message that
    decodes but holds what JSON cannot carry (a Struct number that is NaN or infinite: valid
    protobuf, poison for the store and every JSON client) is `Rejected` here too, so no handler
    meets it (uibus.infra.proto_check; only for message types that can hold a Struct)."""
    if deserializer is None:
        return None
    check = json_checker(getattr(deserializer, "__self__", None))

    def deserialize(data: bytes) -> Any:
        return decode(deserializer, data, "request message")

    if check is None:
        return deserialize

    def deserialize_checked(data: bytes) -> Any:
        request = decode(deserializer, data, "request message")
        return request if request.__class__ is Rejected else decode(check, request, "request message")
    return deserialize_checked


def code_name(context: Any) -> str:
    """The status a context recorded (abort / set_code), as a name; OK when none."""
    code = context.code()
    if code is None:
        return "OK"
    if isinstance(code, grpc.StatusCode):
        return code.name
    try:  # grpc.aio may report the raw integer
        return _BY_VALUE.get(int(code), "UNKNOWN")
    except (TypeError, ValueError):
        return "UNKNOWN"


class Pipeline:
    def __init__(self, metrics: Metrics | None = None, tokens: Tokens | str | None = None,
                 headers: Sequence[tuple[str, str]] = (), quotas: Quotas | None = None,
                 own_user: OwnUserOnly | None = None) -> None:
        """`tokens`: the tokens in force (a plain string is one all-sessions token); none = open, or,
        with `own_user` (a loopback bind), open to uibus's own user only (uibus.infra.peers).
        `headers`: response metadata every call sends once admitted (none: nothing is added, and the
        calls cost what they did). `quotas`: the per-tenant quotas every door asks (uibus.infra.quotas)."""
        self.metrics = metrics
        self.quotas = quotas if quotas is not None else Quotas()
        # Streams open with a token (grpc.aio's and the HTTP transports' call tasks), so a reload
        # that revokes the token ends them UNAUTHENTICATED (`revoke`); in-process calls are their
        # caller's (/acp closes its own connections).
        self._streams: dict[asyncio.Task[Any], Any] = {}
        self._revoked: dict[asyncio.Task[Any], int] = {}  # revoked streams' tasks -> the cancels sent them
        self.headers = tuple(headers)
        self.tokens = Tokens(auth_token=tokens) if isinstance(tokens, str) else tokens or Tokens()
        self.own_user = own_user if not self.tokens.enabled else None  # tokens, when configured, decide
        self._rejected_log = Throttle()
        self._failed_log = Throttle()
        self.tokens.on_reload.append(self.revoke)
        self.roles = RoleCheck()  # a person's role on a session (uibus.edge.calls.roles); team adds members
        self.admission: Admission | None = None  # fair shares of unary calls by tenant; set before `wrap`

    def revoke(self) -> int:
        """Ends every open stream whose token the reload removed (UNAUTHENTICATED); how many."""
        n = 0
        for task, authorization in list(self._streams.items()):
            if task not in self._revoked and not task.done() and self.tokens.revoked(authorization):
                self._revoked[task] = 1
                task.cancel("its token was revoked")
                n += 1
        if n:
            with contextlib.suppress(RuntimeError):  # no loop: nothing runs that could lose the cancel
                asyncio.get_running_loop().call_later(REVOKE_RETRY_S, self._press, REVOKE_RETRIES)
        return n

    def _press(self, tries: int) -> None:
        """Cancels again the revoked streams whose cancel was lost (Python 3.11's asyncio.wait_for
        drops a cancel that lands as its inner wait completes, gh-86296: a watch woken by the very
        change the revocation made), until each has ended."""
        left = [task for task in self._revoked if not task.done()]
        for task in left:
            self._revoked[task] += 1
            task.cancel("its token was revoked")
        if left and tries > 1:
            asyncio.get_running_loop().call_later(REVOKE_RETRY_S, self._press, tries - 1)

    # ---- the policies -------------------------------------------------------------------------

    def authenticate(self, metadata: Any) -> Grant:
        """The grant of the call's `authorization: Bearer <token>`; Unauthenticated without one."""
        for key, value in metadata or ():
            if key == "authorization" and (grant := self.tokens.grant(bearer(value))) is not None:
                return grant
        raise Unauthenticated("missing or wrong bearer token (metadata `authorization: Bearer <token>`)")

    def authorize(self, access: str, metadata: Any) -> Grant:
        """Policy 3: raises what refuses the call (no token, or a token bound to other sessions);
        the token's grant otherwise (its name is the caller's identity in traces)."""
        grant = self.authenticate(metadata)
        if access == ITS_SESSION:
            session = session_from_metadata(metadata)
            if not grant.allows(session) and not grant.person:  # a person's: membership decides (`roles`)
                raise PermissionDenied(f"this token may not use session {session!r} (it may use: "
                                       f"{' '.join(grant.patterns)})")
        elif access == ALL_SESSIONS and not grant.all_sessions:
            raise PermissionDenied("this call covers every session: it needs a token that may use all "
                                   "sessions (`*`)")
        return grant

    def tenant_of(self, metadata: Any) -> str:
        """The caller's tenant (`Grant.tenant`: its tokens-file line's name, see uibus.infra.auth), for the
        quotas; `anonymous` without tokens."""
        if not self.tokens.enabled:
            return ANONYMOUS
        return self.authenticate(metadata).tenant

    def visible_sessions(self, metadata: Any) -> Callable[[str], bool]:
        """Which sessions a call that spans sessions (SessionService/ListSessions) may see: those its
        token's grant allows; every session when no tokens are configured."""
        if not self.tokens.enabled:
            return every_session
        grant = self.authenticate(metadata)
        return self.roles.visible(grant) if checked(grant) else grant.allows  # type: ignore[return-value]

    def tools_for(self, metadata: Any) -> Callable[[str], bool]:
        """Which MCP tools a caller may call at all (MCP's tools/list shows those): all of them, but
        for an agent's minted token the ones an agent's calls allow (uibus.edge.calls.scope)."""
        grant = self.tokens.grant(bearer(authorization_of(metadata))) if self.tokens.enabled else None
        if grant is None or not grant.minted:
            return lambda _name: True
        return lambda name: agent_tool(grant, name)

    def _rejected(self, method: str, request: Rejected) -> UibusError:
        skipped = self._rejected_log.allow()
        if skipped is not None:
            fields: dict[str, Any] = {"method": method, "code": request.error.code, "why": str(request.error)[:200]}
            if skipped:
                fields["not_logged_before"] = skipped
            log.warning("request refused", extra={"fields": fields})
        return request.error

    def _unexpected(self, method: str, exc: BaseException) -> str:
        skipped = self._failed_log.allow()
        if skipped is not None:
            fields: dict[str, Any] = {"method": method, "error": f"{type(exc).__name__}: {exc}"[:500]}
            if skipped:
                fields["not_logged_before"] = skipped
            log.error("handler failed", exc_info=exc, extra={"fields": fields})
        return f"internal error in {method} ({type(exc).__name__}); see the server log"

    def _classify(self, label: str, exc: BaseException, context: Any) -> tuple[str, str | None]:
        """Policy 2: the status name of a failure, and the message to abort the call with (None:
        the exception goes on as it is — the status is already set, or the call is cancelled)."""
        if isinstance(exc, grpc.aio.AbortError):  # the handler set its own status
            return code_name(context), None
        if isinstance(exc, UibusError):
            return exc.code, str(exc)
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # the client went away, or shutdown
            return "CANCELLED", None
        if isinstance(exc, NotImplementedError):  # a generated servicer's stub
            return "UNIMPLEMENTED", "Method not implemented!"
        if isinstance(exc, Exception):
            return "INTERNAL", self._unexpected(label, exc)
        return "UNKNOWN", None  # KeyboardInterrupt, SystemExit: not ours to stop

    # ---- wrapping -----------------------------------------------------------------------------

    def wrap(self, method: str, handler: grpc.RpcMethodHandler, label: str | None = None) -> grpc.RpcMethodHandler:
        """`handler` with every policy applied; `label` names it in metrics (default `method`)."""
        field = shape(handler)
        behavior = getattr(handler, field)
        if self.tokens.enabled:
            access = access_of(method)
        else:
            access = OWN_USER if self.own_user is not None and access_of(method) != OPEN else OPEN
        # A streaming behaviour is an async generator function, or a plain function that returns the
        # stream it serves (no pass-through generator of its own: one hop less per message).
        streams = inspect.isasyncgenfunction(behavior) or (
            handler.response_streaming and not inspect.iscoroutinefunction(behavior))
        wrapped = self._wrap_behavior(label or method, behavior, handler.request_streaming, access, streams,
                                      method)
        return rebuild(handler, wrapped, tolerant(handler.request_deserializer))

    def _wrap_behavior(self, label: str, behavior: Behavior, request_streaming: bool, access: str,
                       streams: bool, method: str = "") -> Behavior:
        """One wrapper of the behaviour's own kind (grpc.aio picks its calling convention by it):
        an async generator for streams (`streams`: the behaviour yields, or returns the stream it
        serves), a coroutine for unary calls and `write()` streams."""
        metrics = self.metrics
        observe = metrics.observe if metrics is not None else None
        authorize = self.authorize
        needs_auth = access != OPEN
        rejected = self._rejected
        classify = self._classify
        status = _STATUS
        extra = self.headers
        # Tracing (uibus.infra.telemetry): decided here, once; off, no call pays more than this None.
        spans = call_spans(label)
        quotas = self.quotas
        tenant_of = self.tenant_of
        open_streams = self._streams
        revoked = self._revoked
        gate = self.admission if self.admission is not None and self.admission.covers(method or label) else None

        async def attach(context: Any) -> None:
            """The pipeline's own headers, to go out with the response's first message: grpc.aio sends
            them then; an in-process transport keeps them for when it starts its response (sending
            would tell it the call is open and waiting)."""
            if isinstance(context, CallContext):
                context.attach_initial_metadata(extra)
            else:
                await context.send_initial_metadata(extra)

        agent_may = agent_check(method or label)
        role_on = access == ITS_SESSION  # a person's (or a less-than-owner) call: its role on the session too
        own_user = self.own_user if access == OWN_USER else None

        def check_peer(context: Any) -> None:
            """No tokens, loopback: the caller's socket must be uibus's own user's (uibus.infra.peers). An
            in-process call is made by uibus itself for a caller its door admitted (/acp), maybe on a
            connection long closed since: not checked again."""
            if not isinstance(context, CallContext) or context.transport != "inprocess":
                own_user.check(context.peer())  # type: ignore[union-attr]

        def scoped(grant: Grant, request: Any) -> None:
            """An agent's minted token makes the calls an agent needs, nothing else (`agent_check`)."""
            if grant.minted and (why := agent_may(grant, request)) is not None:
                raise agent_refusal(grant, method or label, why)

        def admit(request: Any, context: Any) -> Any:
            """Policies 3 and 4: raises what refuses the call; the (checked) request otherwise."""
            deferred = None
            if own_user is not None:  # no tokens, loopback: uibus's own user alone (uibus.infra.peers)
                check_peer(context)
                admitted(None, context)  # the actor the audit log names (uibus.edge.calls.acting)
            elif needs_auth:
                grant = authorize(access, context.invocation_metadata())
                admitted(grant, context)
                scoped(grant, request)
                deferred = grant if role_on and checked(grant) else None
            else:
                admitted(None, context)
            if request.__class__ is Rejected:  # a message, or a whole client stream (broken framing)
                raise rejected(label, request)
            if request_streaming:
                request = _checked_requests(request, label, rejected)
            return request if deferred is None else Deferred(deferred, request)  # its role: `settle`

        def admit_traced(request: Any, context: Any, span: Any) -> Any:
            """`admit`, naming the caller in the call's span when its token has a name."""
            deferred = None
            if own_user is not None:
                check_peer(context)
                admitted(None, context)
            elif needs_auth:
                grant = authorize(access, context.invocation_metadata())
                admitted(grant, context)
                spans.identify(span, grant.name)  # type: ignore[union-attr]
                scoped(grant, request)
                deferred = grant if role_on and checked(grant) else None
            if request.__class__ is Rejected:  # a message, or a whole client stream (broken framing)
                raise rejected(label, request)
            if request_streaming:
                request = _checked_requests(request, label, rejected)
            return request if deferred is None else Deferred(deferred, request)  # its role: `settle`

        def settle(request: Deferred, context: Any) -> Any:  # a person's call: its role (uibus.edge.calls.roles)
            return request.settle(self.roles, method or label, context.invocation_metadata())

        def done(context: Any, code: str, started: float) -> None:
            if observe is not None:
                transport = context.transport if isinstance(context, CallContext) else "grpc"
                observe(label, code, time.perf_counter() - started, transport)

        if streams:
            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                started = time.perf_counter()
                code = "OK"
                span = failure = token = ctx = lease = task = None
                before = snapshot()  # the actor, restored at the end: an in-process call runs in its caller's task
                try:
                    if needs_auth and (not isinstance(context, CallContext) or context.transport != "inprocess"):
                        task = asyncio.current_task()
                        if task is not None:
                            open_streams[task] = authorization_of(context.invocation_metadata())
                    if spans is None:
                        admitted = admit(request, context)
                        if admitted.__class__ is Deferred:
                            admitted = await settle(admitted, context)
                        lease = quotas.hold("streams", tenant_of(context.invocation_metadata()))
                        source = behavior(admitted, context)
                    else:  # the span is current while the handler makes each message (not between)
                        span, ctx = spans.start(context)
                        token = otel_context.attach(ctx)
                        admitted = admit_traced(request, context, span)
                        if admitted.__class__ is Deferred:
                            admitted = await settle(admitted, context)
                        lease = quotas.hold("streams", tenant_of(context.invocation_metadata()))
                        source = behavior(admitted, context)
                        if not span.is_recording():  # not sampled: no child will be either
                            otel_context.detach(token)
                            token = ctx = None
                    async with aclosing(source) as messages:
                        headers = False  # sent: by LIVE, or with the first message
                        async for message in messages:
                            if message is LIVE:  # subscribed: the headers say so (uibus.infra.bus.LIVE)
                                if not headers:
                                    headers = True
                                    await context.send_initial_metadata(extra)
                                continue
                            if not headers:
                                headers = True
                                if extra:  # else grpc sends the headers with the first message
                                    await attach(context)
                            if ctx is not None:  # traced: the next resumption may be in another task
                                otel_context.detach(token)  # type: ignore[arg-type]
                                token = None
                            yield message
                            if ctx is not None:
                                token = otel_context.attach(ctx)
                    code = code_name(context)
                except BaseException as exc:
                    failure = exc
                    if task is not None and task in revoked and isinstance(exc, asyncio.CancelledError):
                        for _ in range(min(revoked.pop(task), task.cancelling())):
                            task.uncancel()  # the revocation's cancels, answered as such
                        if task.cancelling():  # cancelled for another reason too: that one goes on
                            raise
                        code, details = "UNAUTHENTICATED", "this stream's token was revoked (--tokens-file reloaded)"
                    else:
                        code, details = classify(label, exc, context)
                        if details is None:
                            raise
                    await context.abort(status[code], details)
                finally:
                    acting(before)
                    if task is not None:
                        open_streams.pop(task, None)
                        revoked.pop(task, None)
                    if lease is not None:
                        lease.release()
                    done(context, code, started)
                    if span is not None:
                        if token is not None:
                            otel_context.detach(token)
                        spans.end(span, code, failure)  # type: ignore[union-attr]
            return stream

        async def call(request: Any, context: Any) -> Any:
            started = time.perf_counter()
            code = "OK"
            span = token = failure = tenant = None
            before = snapshot()
            try:
                if spans is None:
                    request = admit(request, context)
                    if request.__class__ is Deferred:
                        request = await settle(request, context)
                else:  # one task runs a coroutine to its end: the span is current throughout
                    span, ctx = spans.start(context)
                    token = otel_context.attach(ctx)
                    request = admit_traced(request, context, span)
                    if request.__class__ is Deferred:
                        request = await settle(request, context)
                if gate is not None:  # the tenant's turn (uibus.edge.calls.admission)
                    tenant = await gate.take(tenant_here(current().tenant, tenant_of, context.invocation_metadata()))
                if extra:  # before the handler runs: a `write()` stream sends its headers with its first write
                    await attach(context)
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    result = await result
                code = code_name(context)
                return result
            except BaseException as exc:
                failure = exc
                code, details = classify(label, exc, context)
                if details is None:
                    raise
                await context.abort(status[code], details)
            finally:
                acting(before)
                if tenant is not None:
                    gate.leave(tenant)  # type: ignore[union-attr]
                done(context, code, started)
                if span is not None:
                    otel_context.detach(token)  # type: ignore[arg-type]
                    spans.end(span, code, failure)  # type: ignore[union-attr]
        return call


async def _checked_requests(requests: Any, label: str,
                            rejected: Callable[[str, Rejected], UibusError]) -> AsyncIterator[Any]:
    """A client stream whose undecodable messages end the call with their status."""
    async for request in requests:
        if request.__class__ is Rejected:
            raise rejected(label, request)
        yield request

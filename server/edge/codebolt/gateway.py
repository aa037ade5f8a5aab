"""The CodeBolt agent-to-app protocol engine: one `AgentConnection` per agent socket, fed text frames.

Every frame runs as a call through the handler pipeline: its action is a method
(`/codebolt.AgentToApp/<family>.<action>`, see `handlers`), so a frame gets the same policies as
any gRPC call — a frame that does not parse or breaks a limit is refused with INVALID_ARGUMENT or
RESOURCE_EXHAUSTED, an unreachable store is UNAVAILABLE, a bug is INTERNAL, each counted under
transport "websocket" — and the failure goes back as `success:false` with that status `code`.

A user message of the session (CodeBoltService.SendUserMessage: a chat entry addressed to no
neuro-san agent) that no wait of a connection takes is pushed to that connection as codeboltjs's
`messageResponse`, which the library hands to the agent's `chat.onActionMessage()` handler: the
entry point of an agent built on it. Each connection follows the session's chat history for that.

Immediate actions run in frame order and answer before the next frame is read. Waiting actions
(waitforReply, confirmationRequest) run as tasks so one connection can wait for a user and keep
talking; each connection bounds how many it has in flight. Closing a connection cancels its
waits at once: their bus subscriptions are dropped by a done-callback (which runs even for a task
cancelled before it started) and an open confirmation dialog closes for every UI. At shutdown the
waits end by themselves (the bus and the dialogs close first) with an UNAVAILABLE reply, then
every socket closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from uibus.domain.core import Core
from uibus.edge.calls import CallContext, Metadata, Rejected, decode, unary
from uibus.edge.codebolt import actions, protocol
from uibus.edge.codebolt.actions import Reply
from uibus.edge.codebolt.protocol import Request
from uibus.infra.bus import Subscription
from uibus.infra.errors import InvalidArgument, ResourceExhausted, Unavailable, Unimplemented
from uibus.infra.quotas import ANONYMOUS, Lease, Quotas
from uibus.infra.session import session_of
from uibus.infra.tasks import Tasks, cancel_all

# Closes the agent's socket: with a WebSocket close code and reason (default: going away, shutdown).
Close = Callable[..., Awaitable[None]]
REVOKED = 4401  # the close code of a socket whose token a reload revoked

log = logging.getLogger("uibus.edge.codebolt")

MAX_MESSAGE_BYTES = 1024 * 1024
MAX_WAITS = 64  # waitforReply + confirmationRequest in flight per connection
# A wait reads the session's chat entries up to the first user message after it began: room for
# a burst (the bus drops the oldest at the bound) so that later entries cannot push it out.
USER_QUEUE = 64
SHUTDOWN_WAIT_S = 2.0  # how long shutdown lets waits answer before it cancels them
SERVICE = "codebolt.AgentToApp"  # the method prefix of frames in the pipeline (metrics, logs)
CONNECT = f"/{SERVICE}/connect"
FRAME = f"/{SERVICE}/frame"  # a frame that did not parse: it has no action
Send = Callable[[str], Awaitable[None]]


def method_of(name: str) -> str:
    return f"/{SERVICE}/{name}"


@dataclass(slots=True)
class Upgrade:
    """The request of CONNECT: how to talk to the socket being opened."""

    send: Send
    close: Close


@dataclass(slots=True)
class Frame:
    """What an action handler gets besides its request (`CallContext.state`)."""

    connection: AgentConnection
    sub: Subscription | None = None  # the user-message subscription of a wait, taken up front


class Gateway:
    """The open agent connections of an app, and the pipeline-wrapped handlers frames run.

    `methods()` gives the protocol's method handlers; whoever builds the gateway wraps them with
    the app's pipeline (`wrap`) before any connection opens.
    """

    def __init__(self, core: Core, wrap: Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler],
                 max_message_bytes: int = MAX_MESSAGE_BYTES, max_waits: int = MAX_WAITS,
                 quotas: Quotas | None = None, tenant_of: Callable[[Metadata], str] | None = None) -> None:
        """`quotas` and `tenant_of`: a tenant's `codebolt_connections` quota (uibus.infra.quotas)."""
        self.core = core
        self.quotas = quotas if quotas is not None else Quotas()
        self.tenant_of = tenant_of or (lambda _metadata: ANONYMOUS)
        self.max_message_bytes = max_message_bytes
        self.max_waits = max_waits
        self.connections: set[AgentConnection] = set()
        self.closing = False
        self._closers = Tasks("codebolt-shutdown")  # joined by `aclose`, the installer's teardown
        self.handlers: Mapping[str, grpc.RpcMethodHandler] = {m: wrap(m, h) for m, h in self.methods().items()}

    def methods(self) -> dict[str, grpc.RpcMethodHandler]:
        """Every method of the protocol: CONNECT, FRAME, and one per action of the AsyncAPI
        document (served ones run the action; the rest answer UNIMPLEMENTED naming it)."""

        async def connect(request: Upgrade, context: grpc.aio.ServicerContext) -> AgentConnection:
            session = session_of(context)
            # The session's shard heard before the connection exists (nothing to undo if the socket goes
            # meanwhile): a user message sent on any replica from the open on reaches it.
            await self.core.bus.ready(session)
            return self.connect(session, context.invocation_metadata(), context.peer(), request.send, request.close)

        async def frame(request: Any, context: grpc.aio.ServicerContext) -> Reply:
            raise Unimplemented("a frame is answered by its action")  # a parsed frame never comes here

        def action(name: str) -> Callable[..., Awaitable[Reply]]:
            immediate = actions.IMMEDIATE.get(name)
            waiting = actions.WAITING.get(name)

            async def run(request: Request, context: grpc.aio.ServicerContext) -> Reply:
                state: Frame = context.state  # type: ignore[attr-defined]
                ctx = actions.Context(self.core, state.connection.session)
                if immediate is not None:
                    return await immediate(ctx, request)
                if waiting is not None:
                    return await waiting[0](ctx, request, state.sub)
                raise Unimplemented(protocol.unsupported(request))
            return run

        out = {CONNECT: grpc.unary_unary_rpc_method_handler(connect),
               FRAME: grpc.unary_unary_rpc_method_handler(frame)}
        for family, names in protocol.FAMILIES.items():
            for name in names:
                out[method_of(f"{family}.{name}")] = grpc.unary_unary_rpc_method_handler(action(f"{family}.{name}"))
        return out

    async def open(self, metadata: Metadata, peer: str, send: Send, close: Close
                   ) -> tuple[AgentConnection | None, grpc.StatusCode, str]:
        """Opens a connection through the pipeline (auth, session, shutdown); on refusal, why."""
        ctx = CallContext(metadata, peer, "websocket")
        conn = await unary(self.handlers[CONNECT], Upgrade(send, close), ctx)
        code, details = ctx.status()
        return conn, code, details

    def connect(self, session: str, metadata: Metadata, peer: str, send: Send,
                close: Close) -> AgentConnection:
        if self.closing:
            raise Unavailable("uibus is shutting down")
        lease = self.quotas.hold("codebolt_connections", self.tenant_of(metadata))
        try:
            conn = AgentConnection(self, session, metadata, peer, send, close)
            conn.follow_user(self.core.history.follow(session, USER_QUEUE))  # refused at the stream cap
        except BaseException:
            lease.release()
            raise
        conn.lease = lease
        self.connections.add(conn)
        return conn

    def revoke(self, revoked: Callable[[Any], bool]) -> None:
        """Closes the connections whose token a reload revoked (`revoked(authorization)`): code
        4401, UNAUTHENTICATED; their waits end as at any close."""
        for conn in list(self.connections):
            authorization = next((v for k, v in conn.metadata if k == "authorization"), None)
            if not conn.closed and revoked(authorization) and not self._closers.closed:
                self._closers.spawn(conn.revoked(), name="uibus-codebolt-revoked")

    def pending(self, session: str | None = None) -> int:
        return sum(len(c.waits) for c in self.connections if session is None or c.session == session)

    def user_waiters(self, session: str) -> int:
        """Waits of `session` that the next user message answers."""
        return sum(len(c.user_subs) for c in self.connections if c.session == session)

    def reached(self, session: str) -> int:
        """Agent requests and connections of `session` that the next user message reaches: every
        wait that a user message answers, and every connection with none (the push)."""
        return sum(len(c.user_subs) or 1 for c in self.connections if c.session == session)

    def count(self, session: str | None = None) -> int:
        return sum(1 for c in self.connections if session is None or c.session == session)

    def shutdown(self) -> None:
        """Shutdown hook: no new connections; every socket closes once its waits have answered."""
        self.closing = True
        for conn in list(self.connections):
            if not self._closers.closed:
                self._closers.spawn(conn.shutdown(), name="uibus-codebolt-close")

    async def aclose(self) -> None:
        """Teardown: the closings `shutdown` started end (each is bounded by SHUTDOWN_WAIT_S and one
        socket close); whatever still runs after that, and every connection left open, is cancelled."""
        self.closing = True
        if self._closers:
            await asyncio.wait(list(self._closers), timeout=SHUTDOWN_WAIT_S + 1.0)
        await self._closers.aclose()
        for conn in list(self.connections):
            await conn.close()


class AgentConnection:
    def __init__(self, gateway: Gateway, session: str, metadata: Metadata, peer: str, send: Send,
                 close: Close) -> None:
        self.gateway = gateway
        self.session = session
        self.metadata = metadata
        self.peer = peer
        self._send = send
        self._close_socket = close
        self._send_lock = asyncio.Lock()
        self.waits = Tasks("codebolt-waits")  # waitforReply / confirmationRequest in flight
        self.user_subs: set[Subscription] = set()  # of the waits that a user message answers
        self.answered: deque[int] = deque(maxlen=USER_QUEUE)  # ts of user messages a wait took
        self._pusher: asyncio.Task[None] | None = None
        self.closed = False
        self.lease: Lease | None = None  # the tenant's codebolt_connections, given back at close

    def follow_user(self, sub: Subscription) -> None:
        self._pusher = asyncio.ensure_future(self._push_user_messages(sub))  # stopped by `close`

    async def _push_user_messages(self, sub: Subscription) -> None:
        """Sends each user message that no wait of this connection takes as `messageResponse`.
        A wait holds its subscription in `user_subs` until its reply is built, and its answer's ts
        is in `answered` from then on, so a message is never both an answer and a push."""
        try:
            async for entry in sub:
                if entry.get("role") != "user" or entry.get("agent") or self.user_subs:
                    continue
                if entry.get("ts") in self.answered:
                    continue
                with contextlib.suppress(Exception):  # the socket may be gone: close() ends this task
                    await self.send(protocol.push_user_message(entry["text"], entry["ts"]))
        finally:
            self.gateway.core.bus.unsubscribe(sub)

    async def send(self, text: str) -> None:
        """Serialises writes: wait tasks and the frame loop share the socket."""
        async with self._send_lock:
            await self._send(text)

    async def receive_bytes(self, data: bytes) -> None:
        """A binary frame: UTF-8 JSON text is read as a text frame."""
        text = decode(bytes.decode, data, "frame")
        if isinstance(text, Rejected):
            await self._call(FRAME, Rejected(InvalidArgument("a binary frame must hold UTF-8 JSON text")), None)
            return
        await self.receive(text)

    async def receive(self, text: str) -> None:
        """Handles one text frame; every problem is answered with success:false and its code."""
        gateway = self.gateway
        size = len(text) if text.isascii() else len(text.encode())
        if size > gateway.max_message_bytes:
            req: Request | Rejected = Rejected(ResourceExhausted(
                f"message is {size} bytes; the limit is {gateway.max_message_bytes}"))
        else:
            req = decode(protocol.parse, text, "frame")
        if isinstance(req, Rejected):
            await self._call(FRAME, req, None)
            return
        method = method_of(req.name)
        wait = actions.WAITING.get(req.name)
        if wait is None:
            await self._call(method, req, req)
            return
        if self.waits.closed:  # the connection is closing (uibus shuts down): no new waits
            await self._call(method, Rejected(Unavailable("uibus is shutting down")), req)
            return
        if len(self.waits) >= gateway.max_waits:
            refused = Rejected(ResourceExhausted(f"this connection already has {len(self.waits)} requests waiting "
                                                 f"for a user (limit {gateway.max_waits})"))
            await self._call(method, refused, req)
            return
        sub: Subscription | None = None
        if wait[1](req):
            try:  # taken now, before any await: a user message sent from here on is seen
                sub = gateway.core.history.follow(self.session, USER_QUEUE)
            except (Unavailable, ResourceExhausted) as exc:  # shutting down; too many streams
                await self._call(method, Rejected(exc), req)
                return
        task = self.waits.spawn(self._call(method, req, req, sub), name="uibus-codebolt-wait")
        if sub is not None:
            self.user_subs.add(sub)
        task.add_done_callback(self._waited(sub))

    def _waited(self, sub: Subscription | None) -> Callable[[asyncio.Task[None]], None]:
        def done(_task: asyncio.Task[None]) -> None:
            if sub is not None:
                self.user_subs.discard(sub)
                self.gateway.core.bus.unsubscribe(sub)
        return done

    async def _call(self, method: str, request: Request | Rejected, req: Request | None,
                    sub: Subscription | None = None) -> None:
        """Runs one frame's handler through the pipeline and answers the agent. `req` is the parsed
        envelope (None when the frame did not parse), `sub` a wait's user-message subscription."""
        ctx = CallContext(self.metadata, self.peer, "websocket", state=Frame(self, sub))
        reply = await unary(self.gateway.handlers[method], request, ctx)
        if sub is not None and reply is not None and isinstance(reply.data, dict) and "ts" in reply.data:
            self.answered.append(reply.data["ts"])  # before the wait lets go of `sub`: see the push
        code, details = ctx.status()
        if req is not None:  # the reply the agent's function waits for (see uibus.edge.codebolt.protocol)
            rid, reply_type, shape = req.request_id, req.reply_type, req.reply_fields()
        else:  # an envelope error still names the requestId when it could be read
            rid, reply_type, shape = getattr(getattr(request, "error", None), "request_id", ""), "error", {}
        text = None
        if code == grpc.StatusCode.OK and reply is not None:
            if reply.success and req is not None and not req.wants_reply:
                return
            text, code, details = self._bounded(lambda: protocol.response(
                rid, reply.success, reply.data, reply.error, reply.reply_type or reply_type,
                **{**shape, **reply.extra}), req)
        if text is None:
            error = f"{req.name}: {details}" if req is not None and not details.startswith(req.name) else details
            text = protocol.response(rid, False, error=error, reply_type=reply_type, code=code.name, **shape)
        with contextlib.suppress(Exception):  # the socket may be gone; nothing else to tell
            await self.send(text)

    def _bounded(self, build: Callable[[], str], req: Request | None) -> tuple[str | None, grpc.StatusCode, str]:
        """The reply text, or (None, status, why) when it cannot go out: replies are bounded like
        requests (an agent's socket library has a frame limit too, and one reply must not cost the
        server a copy of everything stored), and are always JSON that UTF-8 can carry."""
        limit = self.gateway.max_message_bytes
        try:
            text = build()
            size = len(text) if text.isascii() else len(text.encode())
        except ValueError as exc:  # nothing poisonous gets in (uibus.infra.json_input): a bug if it happens
            log.error("codebolt reply not encodable", extra={"fields": {"action": req.name if req else "",
                                                                        "error": str(exc)[:200]}})
            return None, grpc.StatusCode.INTERNAL, "the reply could not be written as JSON; see the server log"
        if size > limit:
            return None, grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"the reply would be {size} bytes, over the frame limit of {limit}: read fewer entries "
                "(getChatHistory `limit`) or keep less state")
        return text, grpc.StatusCode.OK, ""

    async def close(self) -> None:
        """The socket is gone: cancel every wait and forget the connection, before returning."""
        self.closed = True
        try:
            await cancel_all([*self.waits, self._pusher], patience=5.0, what="codebolt connection")
            await self.waits.aclose()  # none is left; no new one may start
        finally:  # counted until its waits are really gone, so stats never under-report
            self.gateway.connections.discard(self)
            if self.lease is not None:
                self.lease.release()

    async def revoked(self) -> None:
        """Its token was revoked: the socket is closed (4401); the transport's loop then closes it."""
        with contextlib.suppress(Exception):
            await self._close_socket(REVOKED, "UNAUTHENTICATED: the token was revoked")

    async def shutdown(self) -> None:
        """Lets the waits answer (the bus and the dialogs are closed by now), then closes."""
        if self.waits:
            await asyncio.wait(list(self.waits), timeout=SHUTDOWN_WAIT_S)
        await self.waits.aclose()  # the late ones are cancelled
        with contextlib.suppress(Exception):
            await self._close_socket()

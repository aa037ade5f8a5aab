"""The transport-agnostic gateway: one `AgentConnection` per agent socket, fed text frames.

Immediate actions run in frame order and answer before the next frame is read. Waiting actions
(waitforReply, confirmationRequest) run as tasks so one connection can wait for a user and keep
talking; each connection bounds how many it has in flight. Closing a connection cancels its
waits at once: their bus subscriptions are dropped by a done-callback (which runs even for a task
cancelled before it started) and an open confirmation dialog closes for every UI.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from uibus import chat_history
from uibus.bus import BusClosed, Subscription, SubscriptionLimit
from uibus.codebolt import actions, protocol
from uibus.codebolt.actions import BadRequest, Context, Reply
from uibus.codebolt.inprocess import CallFailed, InProcess
from uibus.codebolt.protocol import EnvelopeError, Request
from uibus.services.common import Runtime

log = logging.getLogger("uibus.codebolt")

MAX_MESSAGE_BYTES = 1024 * 1024
MAX_WAITS = 64  # waitforReply + confirmationRequest in flight per connection
# A wait reads the session's chat entries up to the first user message after it began: room for
# a burst (the bus drops the oldest at the bound) so that later entries cannot push it out.
USER_QUEUE = 64
Send = Callable[[str], Awaitable[None]]


class Gateway:
    def __init__(self, rt: Runtime, calls: InProcess, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_waits: int = MAX_WAITS) -> None:
        self.rt = rt
        self.calls = calls
        self.max_message_bytes = max_message_bytes
        self.max_waits = max_waits
        self.connections: set[AgentConnection] = set()
        self.closing = False
        rt.on_shutdown.append(self.shutdown)

    def connect(self, session: str, send: Send, close: Callable[[], Awaitable[None]]) -> AgentConnection:
        conn = AgentConnection(self, session, send, close)
        self.connections.add(conn)
        return conn

    def pending(self, session: str | None = None) -> int:
        return sum(len(c.waits) for c in self.connections if session is None or c.session == session)

    def user_waiters(self, session: str) -> int:
        """Waits of `session` that the next user message answers."""
        return sum(len(c.user_subs) for c in self.connections if c.session == session)

    def count(self, session: str | None = None) -> int:
        return sum(1 for c in self.connections if session is None or c.session == session)

    def shutdown(self) -> None:
        """Shutdown hook: waits end with a "shutting down" reply and every socket closes."""
        self.closing = True
        for conn in list(self.connections):
            conn.shutdown()


class AgentConnection:
    def __init__(self, gateway: Gateway, session: str, send: Send, close: Callable[[], Awaitable[None]]) -> None:
        self.gateway = gateway
        self.session = session
        self.ctx = Context(gateway.rt, gateway.calls, session)
        self._send = send
        self._close_socket = close
        self._send_lock = asyncio.Lock()
        self.waits: set[asyncio.Task[None]] = set()
        self.user_subs: set[Subscription] = set()  # of the waits that a user message answers
        self._tasks: set[asyncio.Task[None]] = set()  # shutdown's socket close
        self.closed = False

    async def send(self, text: str) -> None:
        """Serialises writes: wait tasks and the frame loop share the socket."""
        async with self._send_lock:
            await self._send(text)

    async def receive(self, text: str) -> None:
        """Handles one text frame; every problem is answered with success:false."""
        size = len(text) if text.isascii() else len(text.encode())
        if size > self.gateway.max_message_bytes:
            await self.send(protocol.response("", False, error=f"message is {size} bytes; the limit is "
                                              f"{self.gateway.max_message_bytes}", reply_type="error"))
            return
        try:
            req = protocol.parse(text)
        except EnvelopeError as exc:
            await self.send(protocol.response(exc.request_id, False, error=str(exc), reply_type="error"))
            return
        if req.name in actions.WAITING:
            await self._start_wait(req)
            return
        action = actions.IMMEDIATE.get(req.name)
        if action is None:
            await self._reply(req, actions.fail(protocol.unsupported(req)))
            return
        await self._reply(req, await self._run(action(self.ctx, req), req))

    async def _run(self, work: Awaitable[Reply], req: Request) -> Reply:
        try:
            return await work
        except BadRequest as exc:
            return actions.fail(f"{req.name}: {exc}")
        except CallFailed as exc:
            return actions.fail(f"{req.name}: {exc}")
        except (asyncio.CancelledError, StopAsyncIteration):
            raise
        except Exception as exc:  # a bug or a store failure: answer, keep the connection
            log.exception("codebolt action failed", extra={"fields": {"action": req.name}})
            return actions.fail(f"{req.name}: internal error ({type(exc).__name__}); see the server log")

    async def _reply(self, req: Request, reply: Reply) -> None:
        if reply.success and not req.wants_reply:
            return
        await self.send(protocol.response(req.request_id, reply.success, reply.data, reply.error,
                                          reply.reply_type or req.reply_type, **reply.extra))

    async def _start_wait(self, req: Request) -> None:
        if len(self.waits) >= self.gateway.max_waits:
            await self._reply(req, actions.fail(f"{req.name}: this connection already has {len(self.waits)} requests "
                                                f"waiting for a user (limit {self.gateway.max_waits})"))
            return
        work, wants_user = actions.WAITING[req.name]
        sub: Subscription | None = None
        if wants_user(req):
            try:  # taken now, before any await: a user message sent from here on is seen
                sub = self.gateway.rt.bus.subscribe(self.session, chat_history.CHAT_MESSAGE, maxsize=USER_QUEUE)
            except (BusClosed, SubscriptionLimit) as exc:
                await self._reply(req, actions.fail(f"{req.name}: {exc}"))
                return
        task = asyncio.ensure_future(self._wait(work, req, sub))
        self.waits.add(task)
        if sub is not None:
            self.user_subs.add(sub)
        task.add_done_callback(self._waited(sub))

    def _waited(self, sub: Subscription | None) -> Callable[[asyncio.Task[None]], None]:
        def done(task: asyncio.Task[None]) -> None:
            self.waits.discard(task)
            if sub is not None:
                self.user_subs.discard(sub)
                self.gateway.rt.bus.unsubscribe(sub)
        return done

    async def _wait(self, work: actions.Waiting, req: Request, sub: Subscription | None) -> None:
        try:
            reply = await self._run(work(self.ctx, req, sub), req)
        except asyncio.CancelledError:
            if self.gateway.closing and not self.closed:
                with contextlib.suppress(Exception):
                    await self._reply(req, actions.fail(f"{req.name}: uibus is shutting down"))
            raise
        except StopAsyncIteration:  # the bus closed the subscription: shutdown
            reply = actions.fail(f"{req.name}: uibus is shutting down")
        with contextlib.suppress(Exception):  # the socket may be gone; nothing else to tell
            await self._reply(req, reply)

    async def close(self) -> None:
        """The socket is gone: cancel every wait and forget the connection, before returning."""
        self.closed = True
        waits = list(self.waits)
        for task in waits:
            task.cancel()
        try:
            if waits:
                await asyncio.gather(*waits, return_exceptions=True)
        finally:  # counted until its waits are really gone, so stats never under-report
            self.gateway.connections.discard(self)

    def shutdown(self) -> None:
        for task in list(self.waits):
            task.cancel()
        closer = asyncio.ensure_future(self._shutdown_close())
        self._tasks.add(closer)
        closer.add_done_callback(self._tasks.discard)

    async def _shutdown_close(self) -> None:
        if self.waits:
            await asyncio.gather(*self.waits, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._close_socket()

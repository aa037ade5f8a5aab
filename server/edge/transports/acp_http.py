"""`/acp` over HTTP: ACP's Streamable HTTP transport as the SDK's `createHttpStream`
(@agentclientprotocol/sdk/experimental/http-client) speaks it, beside the WebSocket one on the same
route. Framing only, around the same `Editor` `uibus acp` and the WebSocket run.

The wire, as the SDK's own server (`AcpServer`, experimental/server) answers it:

* `POST` of `initialize` (no `Acp-Connection-Id`) opens a connection: the answer is the initialize
  response itself, with the connection's `Acp-Connection-Id` header;
* every later message is a `POST` with that header (and `Acp-Session-Id` when it concerns a
  session: required for session methods, equal to `params.sessionId`), answered `202`; what the
  agent says comes on SSE streams the client holds open with `GET` (`Accept: text/event-stream`):
  one for the connection, one per session (`Acp-Session-Id`). Every event has an `id:`; a client
  whose stream broke reconnects with `GET` and `Last-Event-ID` and gets exactly the events after
  it, once, in order, then live (uibus.edge.transports.sse keeps the recent ones: an id older than that
  is 410, one the stream never gave 404, never a silent hole). A response goes where its request
  came from (`session/load`'s to the connection, as the SDK routes it), a request or notification
  naming a session to that session's stream, the rest to the connection's. What waits for a reader
  is kept (bounded: a connection that lets more pile up is closed);
* `DELETE` ends the connection.

Behind the browser policy (Host, Origin) like every route. With tokens, every request carries
`Authorization: Bearer` and a connection answers only the token that opened it (others get 404, as
for an unknown connection: its id is not a capability). Connections whose client went away
(no stream open, nothing posted for IDLE_S) are closed at the next request; all at shutdown.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from typing import Any

from uibus.edge.editors.account import Identity
from uibus.edge.editors.agent import Editor
from uibus.edge.editors.cursor import CURSOR_KEY
from uibus.edge.editors.uplink import Uplink
from uibus.edge.transports import sse
from uibus.edge.transports.asgi import (
    GRANT,
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    respond,
    respond_json,
    wait_disconnect,
)
from uibus.edge.transports.grpcweb import Lookup, client_of, metadata_of, peer_of
from uibus.edge.transports.inprocess import Channel
from uibus.infra.auth import Tokens
from uibus.infra.jsonrpc import INVALID_REQUEST, QUOTA_EXCEEDED, RpcError, read
from uibus.infra.quotas import ANONYMOUS, Lease, QuotaExceeded, Quotas
from uibus.infra.session import SESSION_KEY
from uibus.infra.tasks import Tasks

log = logging.getLogger("uibus.acp")

CONNECTION = b"acp-connection-id"
SESSION = b"acp-session-id"
MAX_CONNECTIONS = 256  # HTTP connections open at once; more are refused 503
MAX_BUFFERED_BYTES = 8 * 1024 * 1024  # bytes of events waiting for a reader on one connection; more cut it
MAX_REPLAY_BYTES = 4 * 1024 * 1024  # bytes of sent events one connection's streams keep for a resume (each 1 MiB)
MAX_SESSION_STREAMS = 128  # session streams one connection keeps (with their replay logs)
MAX_ROUTES = 128  # requests of one connection awaiting their answer (the Editor runs at most 64 at once)
MAX_GONE = 256  # connections cut for not reading, remembered to tell their next request why
IDLE_S = 300.0  # a connection with no stream open and nothing posted this long is closed
LOAD_DELIVERY_S = 2.0  # the longest a session/load's answer waits for its replay to be read
LOAD_SETTLE_S = 0.02  # and then, for the last update's write to land ahead of the answer
INITIALIZE_S = 30.0  # how long an initialize may take to be answered
KEEPALIVE_S = 15.0  # an SSE comment this often keeps proxies from closing an idle stream
MAX_BODY = 16 * 1024 * 1024
# The methods the SDK's client sends with Acp-Session-Id (and its server requires it for).
SESSION_METHODS = frozenset({"session/cancel", "session/close", "session/delete", "session/fork", "session/load",
                             "session/prompt", "session/resume", "session/set_config_option", "session/set_mode",
                             "session/set_model"})


def _key(ident: Any) -> tuple[str, Any]:
    """A request id as a map key, taken from the message itself (never from its serialized text):
    1 and "1" are different ids."""
    return (type(ident).__name__, ident)


class HttpConnection:
    """One editor's ACP connection over HTTP: its `Editor` and its streams (uibus.edge.transports.sse
    queues, bounded together in bytes by the connection's `Budget`)."""

    def __init__(self, ident: str, authorization: str, uplink: Uplink, prefix: str, lease: Lease | None = None,
                 max_buffered: int = MAX_BUFFERED_BYTES, identity: Identity | None = None) -> None:
        self.id = ident
        self.lease = lease  # the tenant's acp_connections quota, given back at close
        self.authorization = authorization
        self.editor = Editor(uplink, _unused_write, prefix=prefix, write_message=self.write, identity=identity)
        self.budget = sse.Budget(max_buffered)
        self.replay = sse.Replay(MAX_REPLAY_BYTES)  # what its streams keep for a client resuming one
        self.outbox = sse.Queue(self.budget, replay=self.replay)  # the connection's stream
        self.sessions: dict[str, sse.Queue] = {}
        # A client request's id -> the session its answer goes to; keyed when the request is taken
        # and popped by its answer (every request the Editor takes is answered once, with its id).
        self.routes: dict[tuple[str, Any], str | None] = {}
        self.loading: dict[tuple[str, Any], str] = {}  # a session/load's id -> its session (see `write`)
        self.initial: asyncio.Future[tuple[dict[str, Any], str]] | None = None
        self.initial_id: tuple[str, Any] | None = None
        self.touched = time.monotonic()

    @property
    def overflowed(self) -> str:
        return self.budget.overflowed

    def stream(self, session: str | None) -> sse.Queue:
        if session is None:
            return self.outbox
        found = self.sessions.get(session)
        if found is None:
            if len(self.sessions) >= MAX_SESSION_STREAMS:  # the oldest read-out one goes (its replay log with it)
                old = next((k for k, q in self.sessions.items() if not q.reading and not q.queue), None)
                if old is not None:
                    self.replay.remove(self.sessions.pop(old))
            found = self.sessions[session] = sse.Queue(self.budget, replay=self.replay)
        return found

    def idle(self, now: float) -> bool:
        reading = self.outbox.reading or any(s.reading for s in self.sessions.values())
        return not reading and now - self.touched > IDLE_S

    async def write(self, message: dict[str, Any], text: str) -> None:
        """The Editor's output, routed by the message to the stream its client reads it from."""
        if "method" not in message:  # a response: where its request came from
            key = _key(message.get("id"))
            if self.initial is not None and not self.initial.done() and key == self.initial_id:
                self.initial.set_result((message, text))
                return
            route = self.routes.pop(key, None)
            loaded = self.loading.pop(key, None)
            if loaded is not None:
                await self._delivered(loaded)
        else:
            params = message.get("params")
            found = params.get("sessionId") if isinstance(params, dict) else None
            route = found if isinstance(found, str) else None
        try:
            self.stream(route).push(text.encode())
        except sse.Overflow:  # the client stopped reading: cut (its streams end, its next request is told why)
            self._cut()

    def _cut(self) -> None:
        for stream in (self.outbox, *self.sessions.values()):
            stream.drop()
            stream.close()

    async def _delivered(self, session: str) -> None:
        """Waits (bounded) until the session's stream has handed its reader the replay a
        session/load sent: the answer goes on the connection's stream (as the SDK routes it), and
        two SSE streams keep no order between them, so answering at once could overtake the
        history it answers after. A few milliseconds more let the last update's write land first."""
        deadline = time.monotonic() + LOAD_DELIVERY_S
        while time.monotonic() < deadline:
            stream = self.sessions.get(session)
            if stream is None or stream.closed or (stream.reading and not stream.queue):
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(LOAD_SETTLE_S)

    async def aclose(self) -> None:
        if self.lease is not None:
            self.lease.release()
        self._cut()
        await self.editor.aclose()


async def _unused_write(text: str) -> None:  # pragma: no cover - HttpConnection routes by write_message
    raise AssertionError("an HTTP connection's Editor writes through write_message")


def _route(message: dict[str, Any], session: str) -> tuple[str | None, str]:
    """(the session a client message concerns, or None; why it cannot be taken, or "")."""
    params = message.get("params")
    named = params.get("sessionId") if isinstance(params, dict) else None
    named = named if isinstance(named, str) else None
    method = message.get("method")
    if (method in SESSION_METHODS or named is not None) and not session:
        return None, "Missing Acp-Session-Id"
    if session and named is not None and session != named:
        return None, "Mismatched Acp-Session-Id"
    return session or named, ""


class AcpHttp:
    """The HTTP side of `/acp` (the WebSocket side hands it every plain HTTP request)."""

    def __init__(self, lookup: Lookup, tokens: Tokens, max_message_bytes: int = 0,
                 quotas: Quotas | None = None) -> None:
        self.lookup = lookup
        self.tokens = tokens
        self.max_message_bytes = max_message_bytes
        self.quotas = quotas if quotas is not None else Quotas()
        self.open: dict[str, HttpConnection] = {}
        self.gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # cut connections: why
        self._closing = Tasks("acp revoked connections")

    def count(self) -> int:
        return len(self.open)

    def revoke(self) -> None:
        """Ends the connections whose token a reload removed: their event streams end at once, the
        connection (its Editor, its sessions' feeds) closes, and its next request is 401."""
        for ident, conn in list(self.open.items()):
            if self.tokens.revoked(conn.authorization):
                conn._cut()
                del self.open[ident]
                self._closing.spawn(conn.aclose(), name="acp revoked connection")

    async def aclose(self) -> None:
        await self._closing.aclose(patience=5.0)
        errors = []
        for ident in list(self.open):
            try:
                await self.open.pop(ident).aclose()
            except Exception as exc:  # every connection is closed; the first error is raised after
                errors.append(exc)
        if errors:
            raise errors[0]

    async def _sweep(self) -> None:
        now = time.monotonic()
        for ident, conn in list(self.open.items()):
            if conn.overflowed:
                log.warning("ACP connection cut", extra={"fields": {"why": conn.overflowed}})
                self.gone[ident] = conn.overflowed
                while len(self.gone) > MAX_GONE:
                    self.gone.popitem(last=False)
            if conn.overflowed or conn.idle(now):
                await self.open.pop(ident).aclose()

    def _find(self, scope: Scope) -> HttpConnection | None:
        conn = self.open.get(header(scope, CONNECTION))
        if conn is None or (self.tokens.enabled and header(scope, b"authorization") != conn.authorization):
            return None
        conn.touched = time.monotonic()
        return conn

    async def _connection(self, scope: Scope, send: Send) -> HttpConnection | None:
        """The connection a POST or GET names, or None once the client has been told why not (the
        header missing is a malformed request, 400; an unknown or not-its-owner's id is 404)."""
        if not header(scope, CONNECTION):
            await respond(send, 400, "Missing Acp-Connection-Id")
            return None
        conn = self._find(scope)
        if conn is None:
            why = self.gone.get(header(scope, CONNECTION))
            await respond(send, 410 if why else 404, why or "Unknown Acp-Connection-Id")
        return conn

    async def __call__(self, scope: Scope, receive: Receive, send: Send, *, agent: str, prefix: str) -> None:
        method = scope.get("method", "GET")
        await self._sweep()  # the token was checked at the door (the route table: uibus.edge.transports.routes)
        if method == "POST":
            await self._post(scope, receive, send, agent, prefix)
        elif method == "GET":
            await self._get(scope, receive, send)
        elif method == "DELETE":
            conn = self._find(scope)
            if conn is None:
                await respond(send, 404, "Unknown Acp-Connection-Id")
                return
            self.open.pop(conn.id, None)
            await conn.aclose()
            await respond(send, 202, b"")
        else:
            await respond(send, 405, "Method Not Allowed", headers=[(b"allow", b"GET, POST, DELETE")])

    async def _post(self, scope: Scope, receive: Receive, send: Send, agent: str, prefix: str) -> None:
        if header(scope, b"content-type").split(";", 1)[0].strip().lower() != "application/json":
            await respond(send, 415, "Unsupported Media Type: POST application/json")
            return
        try:
            body = await read_body(receive, MAX_BODY)
        except BodyTooLarge as exc:
            await respond(send, 413, str(exc))
            return
        except ClientGone:
            return
        try:  # the one JSON-RPC reader: hostile JSON, `jsonrpc` and `id` are refused before anything waits
            message = read(body)
        except RpcError as exc:
            await respond_json(send, 400, exc.answer())
            return
        if message.get("method") == "initialize" and "id" in message:
            if header(scope, CONNECTION):
                await respond(send, 400, "Initialize not allowed on existing connection")
                return
            await self._initialize(scope, send, message, agent, prefix)
            return
        conn = await self._connection(scope, send)
        if conn is None:
            return
        if "method" in message:
            session, problem = _route(message, header(scope, SESSION))
            if problem:
                await respond(send, 400, problem)
                return
            if "id" in message:  # its answer goes to the stream of its session (session/load's: the connection's)
                key = _key(message["id"])
                if len(conn.routes) >= MAX_ROUTES and key not in conn.routes:
                    await respond_json(send, 429, RpcError(INVALID_REQUEST, f"{MAX_ROUTES} requests of this "
                                                           "connection await their answers: wait for them",
                                                           ident=message["id"]).answer())
                    return
                conn.routes[key] = None if message["method"] == "session/load" else session
                if message["method"] == "session/load" and session:
                    conn.loading[key] = session
        await conn.editor.handle(message)
        await respond(send, 202, b"")

    async def _initialize(self, scope: Scope, send: Send, message: dict[str, Any], agent: str, prefix: str) -> None:
        if message["id"] is None:
            await respond(send, 400, "Initialize request must include an ID")
            return
        grant = scope.get(GRANT)  # the door's (uibus.edge.transports.routes)
        try:  # the tenant's own share first: one tenant never fills the door for the others
            lease = self.quotas.hold("acp_connections", grant.tenant if grant is not None else ANONYMOUS)
        except QuotaExceeded as exc:
            await respond_json(send, 429, RpcError(QUOTA_EXCEEDED, str(exc), {"quota": exc.quota},
                                                   ident=message["id"]).answer())
            return
        if len(self.open) >= MAX_CONNECTIONS:
            lease.release()
            await respond(send, 503, f"{MAX_CONNECTIONS} ACP connections are open: try again later")
            return
        metadata = tuple(metadata_of(scope))
        channel = Channel(self.lookup, tuple((k, v) for k, v in metadata if k != SESSION_KEY), peer_of(scope),
                          self.max_message_bytes, door="acp", client=client_of(scope))
        conn = HttpConnection(secrets.token_urlsafe(18), header(scope, b"authorization"), Uplink(channel, agent),
                              prefix, lease, identity=Identity(grant is not None,
                                                               grant.tenant if grant is not None else None))
        conn.initial, conn.initial_id = asyncio.get_running_loop().create_future(), _key(message["id"])
        self.open[conn.id] = conn
        try:
            await conn.editor.handle(message)
            answered, answer = await asyncio.wait_for(conn.initial, INITIALIZE_S)
        except BaseException:
            self.open.pop(conn.id, None)
            await conn.aclose()
            raise
        if "error" in answered:  # refused (a bad protocolVersion...): no connection stays open
            self.open.pop(conn.id, None)
            await conn.aclose()
        await respond(send, 200, answer, "application/json", headers=[(CONNECTION, conn.id.encode())])

    async def _get(self, scope: Scope, receive: Receive, send: Send) -> None:
        if "text/event-stream" not in header(scope, b"accept").lower():
            await respond(send, 406, "Not Acceptable: GET with Accept: text/event-stream")
            return
        conn = await self._connection(scope, send)
        if conn is None:
            return
        session = header(scope, SESSION) or None
        stream = conn.stream(session)
        resumed = header(scope, b"last-event-id")
        # A client that resumes says it lost its reader, whose end the server may not have seen yet.
        if not await stream.take_over() if resumed else stream.reading:
            await respond(send, 409, "Outbound stream already has an active receiver")
            return
        if resumed:  # the client lost this stream: exactly what it missed first (uibus.edge.transports.sse)
            try:
                stream.resume(resumed)
            except sse.ResumeError as exc:
                await respond(send, 410 if isinstance(exc, sse.TooOld) else 404,
                              f"{exc}: session/load the session, or session/resume it with "
                              f"_meta {{\"{CURSOR_KEY}\": <the last seq you have>}}")
                return
        stop = stream.begin_reading()
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": sse.HEADERS})
            await sse.pump(stream, send, gone, KEEPALIVE_S, stop)
        finally:
            stream.end_reading()
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            # A stream that never carried an event goes (any header makes one); one that did stays
            # with the connection, its ids and replay log kept for a client that resumes it.
            if session is not None and not stream.ids.last and conn.sessions.get(session) is stream:
                conn.replay.remove(conn.sessions.pop(session))
            conn.touched = time.monotonic()


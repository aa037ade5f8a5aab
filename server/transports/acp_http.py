"""`/acp` over HTTP: ACP's Streamable HTTP transport as the SDK's `createHttpStream`
(@agentclientprotocol/sdk/experimental/http-client) speaks it, beside the WebSocket one on the same
route. Framing only, around the same `Editor` `uibus acp` and the WebSocket run.

The wire, as the SDK's own server (`AcpServer`, experimental/server) answers it:

* `POST` of `initialize` (no `Acp-Connection-Id`) opens a connection: the answer is the initialize
  response itself, with the connection's `Acp-Connection-Id` header;
* every later message is a `POST` with that header (and `Acp-Session-Id` when it concerns a
  session: required for session methods, equal to `params.sessionId`), answered `202`; what the
  agent says comes on SSE streams the client holds open with `GET` (`Accept: text/event-stream`):
  one for the connection, one per session (`Acp-Session-Id`). A response goes where its request
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
import json
import secrets
import time
from typing import Any

import grpc

from uibus.auth import Tokens, bearer
from uibus.editors.agent import Editor
from uibus.editors.uplink import Uplink
from uibus.jsonrpc import QUOTA_EXCEEDED, RpcError, read
from uibus.quotas import ANONYMOUS, Lease, QuotaExceeded, Quotas
from uibus.session import SESSION_KEY
from uibus.transports.asgi import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    error_body,
    header,
    read_body,
    respond,
    respond_json,
    wait_disconnect,
)
from uibus.transports.grpcweb import Lookup, metadata_of, peer_of
from uibus.transports.inprocess import Channel

CONNECTION = b"acp-connection-id"
SESSION = b"acp-session-id"
MAX_CONNECTIONS = 256  # HTTP connections open at once; more are refused 503
MAX_BUFFERED = 4096  # messages waiting for a reader on one connection (all its streams); more close it
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


class Outbox:
    """What one stream (the connection's, or a session's) has to say until its reader takes it."""

    def __init__(self) -> None:
        self.queue: collections.deque[str] = collections.deque()
        self.more = asyncio.Event()
        self.reading = False
        self.closed = False

    def push(self, text: str) -> None:
        self.queue.append(text)
        self.more.set()

    def close(self) -> None:
        self.closed = True
        self.more.set()

    async def take(self, patience: float) -> str | None:
        """The next message; "" after `patience` seconds of nothing; None once closed."""
        if not self.queue and not self.closed:
            self.more.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.more.wait(), patience)
        if self.queue:
            return self.queue.popleft()
        return None if self.closed else ""


class HttpConnection:
    """One editor's ACP connection over HTTP: its `Editor` and its streams."""

    def __init__(self, ident: str, authorization: str, uplink: Uplink, prefix: str, lease: Lease | None = None) -> None:
        self.id = ident
        self.lease = lease  # the tenant's acp_connections quota, given back at close
        self.authorization = authorization
        self.editor = Editor(uplink, self.write, prefix=prefix)
        self.outbox = Outbox()  # the connection's stream
        self.sessions: dict[str, Outbox] = {}
        self.routes: dict[str, str | None] = {}  # a client request's id (JSON) -> the session its answer goes to
        self.loading: dict[str, str] = {}  # a session/load's id (JSON) -> its session (see `write`)
        self.initial: asyncio.Future[str] | None = None
        self.initial_id = ""
        self.touched = time.monotonic()
        self.overflowed = False

    def stream(self, session: str | None) -> Outbox:
        if session is None:
            return self.outbox
        found = self.sessions.get(session)
        if found is None:
            found = self.sessions[session] = Outbox()
        return found

    def buffered(self) -> int:
        return len(self.outbox.queue) + sum(len(s.queue) for s in self.sessions.values())

    def idle(self, now: float) -> bool:
        reading = self.outbox.reading or any(s.reading for s in self.sessions.values())
        return not reading and now - self.touched > IDLE_S

    async def write(self, text: str) -> None:
        """The Editor's output, routed to the stream its client reads it from."""
        message = json.loads(text)
        if "method" not in message:  # a response: where its request came from
            key = json.dumps(message.get("id"))
            if self.initial is not None and not self.initial.done() and key == self.initial_id:
                self.initial.set_result(text)
                return
            route = self.routes.pop(key, None)
            loaded = self.loading.pop(key, None)
            if loaded is not None:
                await self._delivered(loaded)
        else:
            params = message.get("params")
            found = params.get("sessionId") if isinstance(params, dict) else None
            route = found if isinstance(found, str) else None
        if self.buffered() >= MAX_BUFFERED:
            self.overflowed = True  # the client stopped reading: the connection is closed at the next request
            return
        self.stream(route).push(text)

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
        self.outbox.close()
        for stream in self.sessions.values():
            stream.close()
        await self.editor.aclose()


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

    def count(self) -> int:
        return len(self.open)

    async def aclose(self) -> None:
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
            await respond(send, 404, "Unknown Acp-Connection-Id")
        return conn

    async def __call__(self, scope: Scope, receive: Receive, send: Send, *, agent: str, prefix: str) -> None:
        method = scope.get("method", "GET")
        await self._sweep()
        if self.tokens.enabled and self.tokens.grant(bearer(header(scope, b"authorization"))) is None:
            await respond_json(send, 401, error_body(grpc.StatusCode.UNAUTHENTICATED,
                                                     "/acp needs `Authorization: Bearer <token>`"),
                               headers=[(b"www-authenticate", b'Bearer realm="uibus"')])
            return
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
                conn.routes[json.dumps(message["id"])] = None if message["method"] == "session/load" else session
                if message["method"] == "session/load" and session:
                    conn.loading[json.dumps(message["id"])] = session
        await conn.editor.handle(message)
        await respond(send, 202, b"")

    async def _initialize(self, scope: Scope, send: Send, message: dict[str, Any], agent: str, prefix: str) -> None:
        if message["id"] is None:
            await respond(send, 400, "Initialize request must include an ID")
            return
        grant = self.tokens.grant(bearer(header(scope, b"authorization")))
        try:  # the tenant's own share first: one tenant never fills the door for the others
            lease = self.quotas.hold("acp_connections", grant.name if grant is not None else ANONYMOUS)
        except QuotaExceeded as exc:
            await respond_json(send, 429, {"jsonrpc": "2.0", "id": message["id"], "error": {
                "code": QUOTA_EXCEEDED, "message": str(exc), "data": {"quota": exc.quota}}})
            return
        if len(self.open) >= MAX_CONNECTIONS:
            lease.release()
            await respond(send, 503, f"{MAX_CONNECTIONS} ACP connections are open: try again later")
            return
        metadata = tuple(metadata_of(scope))
        channel = Channel(self.lookup, tuple((k, v) for k, v in metadata if k != SESSION_KEY), peer_of(scope),
                          self.max_message_bytes)
        conn = HttpConnection(secrets.token_urlsafe(18), header(scope, b"authorization"), Uplink(channel, agent),
                              prefix, lease)
        conn.initial, conn.initial_id = asyncio.get_running_loop().create_future(), json.dumps(message["id"])
        self.open[conn.id] = conn
        try:
            await conn.editor.handle(message)
            answer = await asyncio.wait_for(conn.initial, INITIALIZE_S)
        except BaseException:
            self.open.pop(conn.id, None)
            await conn.aclose()
            raise
        if "error" in json.loads(answer):  # refused (a bad protocolVersion...): no connection stays open
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
        if stream.reading:
            await respond(send, 409, "Outbound stream already has an active receiver")
            return
        stream.reading = True
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
            while not gone.done():
                taking = asyncio.ensure_future(stream.take(KEEPALIVE_S))
                await asyncio.wait((taking, gone), return_when=asyncio.FIRST_COMPLETED)
                if gone.done():  # the client went away: what it did not take stays for the next reader
                    taking.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await taking
                    if taking.done() and not taking.cancelled() and taking.result():
                        stream.queue.appendleft(taking.result())
                    break
                text = taking.result()
                if text is None:
                    break
                await send({"type": "http.response.body", "more_body": True,
                            "body": f"data: {text}\n\n".encode() if text else b":\n\n"})
            if not gone.done():
                await send({"type": "http.response.body", "body": b""})
        finally:
            stream.reading = False
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            if session is not None and not stream.queue and conn.sessions.get(session) is stream:
                conn.sessions.pop(session, None)
            conn.touched = time.monotonic()


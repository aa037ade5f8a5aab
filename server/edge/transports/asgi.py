"""The few ASGI plumbing pieces every HTTP module here needs (kept out of the protocol code)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import grpc

from uibus.edge.calls import Rejected, decode
from uibus.infra.errors import ResourceExhausted
from uibus.infra.json_input import dump_json

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
# What a 401 carries on every route (RFC 6750): the client is to send `Authorization: Bearer`.
CHALLENGE = (b"www-authenticate", b'Bearer realm="uibus"')
# The scope key under which the route table's gate (uibus.edge.transports.routes) hands a route that
# takes a token the grant it admitted (None: tokens are off), so no route reads the token again.
GRANT = "uibus.grant"


class BodyTooLarge(ResourceExhausted):
    """The request body is over the message size limit."""


class ClientGone(Exception):
    """The client disconnected before the request body was read."""


def header(scope: Scope, name: bytes, default: str = "") -> str:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return default


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; raises BodyTooLarge past `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def read_request(receive: Receive, limit: int, parse: Callable[[bytes], Any], what: str = "body") -> Any:
    """The request an HTTP API call's body carries, for the call driver: `parse(body)`, or a
    `Rejected` saying why not (over `limit`, or not decodable as `what`), so the pipeline answers a
    bad body as it answers one over gRPC; None when the client went away first (nothing to answer).
    One place, so every HTTP API treats an oversized or malformed body the same way."""
    try:
        body = await read_body(receive, limit)
    except ClientGone:
        return None
    except BodyTooLarge as exc:
        return Rejected(exc)
    return decode(parse, body, what)


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client goes away (what is left of the request body is read and dropped):
    the `gone` of a call the driver runs (uibus.edge.calls.drive)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# The HTTP status of each gRPC status, for the transports that answer in HTTP (the neuro-san API,
# a refused WebSocket upgrade); the JSON body always names the gRPC status too.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.UNIMPLEMENTED: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.ABORTED: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_status(code: grpc.StatusCode) -> int:
    return _HTTP_STATUS.get(code, 500)


def error_body(code: grpc.StatusCode, details: str) -> dict[str, Any]:
    return {"error": details or code.name, "code": code.name}


async def respond(send: Send, status: int, body: bytes | str, content_type: str = "text/plain; charset=utf-8",
                  headers: Headers | None = None, prefix: str = "") -> None:
    """A whole response; `prefix="websocket."` sends it as a refused WebSocket upgrade."""
    data = body.encode() if isinstance(body, str) else body
    await send({"type": prefix + "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": prefix + "http.response.body", "body": data})


async def respond_json(send: Send, status: int, obj: Any, prefix: str = "", headers: Headers | None = None) -> None:
    await respond(send, status, dump_json(obj), "application/json", headers, prefix=prefix)


async def wrong_method(send: Send, method: str, path: str, allowed: str) -> None:
    """405 with `Allow` (RFC 9110 requires it) and the JSON error every API answer is."""
    await respond_json(send, 405, {"error": f"{method[:16]} {path[:200]}: use {allowed}",
                                   "code": "UNIMPLEMENTED"}, headers=[(b"allow", allowed.encode())])


async def refuse(scope: Scope, send: Send, status: int, body: bytes | str,
                 content_type: str = "text/plain; charset=utf-8", headers: Headers | None = None) -> None:
    """Answers an HTTP request, or refuses a WebSocket upgrade, with `status` and `body`: as an HTTP
    response to the upgrade where the server can send one (uvicorn can), else with a close before
    accept, which clients see as HTTP 403."""
    if scope["type"] != "websocket":
        await respond(send, status, body, content_type, headers)
    elif "websocket.http.response" in scope.get("extensions", {}):
        await respond(send, status, body, content_type, headers, prefix="websocket.")
    else:
        await send({"type": "websocket.close", "code": 1008})  # policy violation


# How long an answer given before the request body was read waits for the rest of that body.
DRAIN_S = 2.0
_DISCONNECT: Message = {"type": "http.disconnect"}


class _Body:
    """What has arrived of one request's body; the receive side of `drain_first`."""

    __slots__ = ("_lock", "_receive", "done", "gone", "limit")

    def __init__(self, receive: Receive, limit: int) -> None:
        self._receive = receive
        self._lock = asyncio.Lock()  # one reader at a time: the route's, or the drain
        self.limit = limit
        self.done = False  # the whole body has arrived (or the client has gone)
        self.gone = False

    async def receive(self) -> Message:
        if self.gone:  # the drain read the disconnect: the route must learn it too
            return _DISCONNECT
        async with self._lock:
            if self.gone:
                return _DISCONNECT
            message = await self._receive()
        self._note(message)
        return message

    def _note(self, message: Message) -> None:
        if message["type"] != "http.request":
            self.done = self.gone = True
        elif not message.get("more_body", False):
            self.done = True

    async def drain(self) -> None:
        """Reads (and drops) what is left of the body: at most `limit` bytes, for at most `DRAIN_S`."""
        drained = 0
        with contextlib.suppress(TimeoutError):  # only our own timeout: a cancel still propagates
            async with asyncio.timeout(DRAIN_S):
                while not self.done and drained <= self.limit:
                    async with self._lock:  # a route's reader (its disconnect watch) may hold it
                        if self.done:
                            return
                        message = await self._receive()
                    self._note(message)
                    drained += len(message.get("body", b""))


def drain_first(app: ASGIApp, limit: int) -> ASGIApp:
    """`app`, but no HTTP answer starts before the request's body has arrived.

    Why: a route that answers without reading the body (an unknown path or method, a refused
    origin, a bad header) leaves the body to arrive after the answer; when the connection then
    closes (`Connection: close`, or uvicorn giving up on it), the kernel answers those late bytes
    with a TCP reset, which destroys the answer on its way: the client sees a network error
    instead of the 404 or UNIMPLEMENTED (about 1 time in 16 for a browser's gRPC-Web POST). One
    place for every route: the body is read and dropped right before the answer starts, bounded
    by the body limit and `DRAIN_S`. A client that waits for `100 Continue` has sent no body and
    is answered at once.
    """

    async def drained(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or header(scope, b"expect").lower() == "100-continue":
            await app(scope, receive, send)
            return
        body = _Body(receive, limit)

        def answer(message: Message) -> Awaitable[None]:
            # A plain function handing back the server's own awaitable: no coroutine of ours per
            # message of a stream, only before the answer starts.
            if not body.done and message["type"] == "http.response.start":
                return _drained_then(body, send, message)
            return send(message)

        await app(scope, body.receive, answer)

    return drained


async def _drained_then(body: _Body, send: Send, message: Message) -> None:
    await body.drain()
    await send(message)

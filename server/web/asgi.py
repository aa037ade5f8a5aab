"""The few ASGI plumbing pieces every HTTP module here needs (kept out of the protocol code)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]


class BodyTooLarge(Exception):
    pass


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


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client goes away (the request body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def respond(send: Send, status: int, body: bytes | str, content_type: str = "text/plain; charset=utf-8",
                  headers: Headers | None = None) -> None:
    data = body.encode() if isinstance(body, str) else body
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


async def respond_json(send: Send, status: int, obj: Any) -> None:
    await respond(send, status, json.dumps(obj), "application/json")


def bearer_ok(token: str, authorization: str | bytes | None) -> bool:
    """The same check as the gRPC interceptor (server.auth), for calls that bypass it."""
    if not token:
        return True
    if authorization is None:
        return False
    got = authorization.encode() if isinstance(authorization, str) else authorization
    return hmac.compare_digest(got, f"Bearer {token}".encode())


async def until_disconnect(work: Awaitable[None], receive: Receive) -> bool:
    """Runs `work` until it ends or the client goes away (then cancels it); True if abandoned.

    Cancelling is what lets a handler's `finally` remove its bus subscription the moment a
    browser closes the page or aborts a fetch.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        return not task.done()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        gone.cancel()

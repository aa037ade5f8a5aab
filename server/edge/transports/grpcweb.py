"""gRPC-Web (`application/grpc-web[+proto]` and `application/grpc-web-text`) over HTTP/1.1.

Each call runs the same pipeline-wrapped method handler the native server runs, in-process, with
a `CallContext`; this module only translates framing. A body that cannot be unframed or decoded,
or is over the size limit, goes to the handler as a `Rejected` request, so the pipeline answers it
exactly as it answers the native server. Response messages are framed and flushed as they are
produced; the status goes in a trailer frame, or in the headers when nothing was sent
(trailers-only, so an empty stream or an early error needs no body). A `grpc-timeout` becomes the
call's deadline; the driver (uibus.edge.calls.drive) enforces it and cancels the handler of a client
that goes away, so its `finally` (e.g. the bus unsubscribe) runs at once.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any
from urllib.parse import quote

import grpc

from uibus.edge.calls import CallContext, Metadata, Rejected, decode, drive
from uibus.edge.transports.asgi import (
    BodyTooLarge,
    ClientGone,
    Headers,
    Receive,
    Scope,
    Send,
    read_body,
    wait_disconnect,
)
from uibus.infra.errors import InvalidArgument

Lookup = Callable[[str, Sequence[tuple[str, str | bytes]]], grpc.RpcMethodHandler | None]
_TRAILER_FLAG = 0x80
HEADERS_AFTER = 0.05  # seconds a stream may take to produce or end before its headers go out
_HEADER = struct.Struct(">BI")
_TIMEOUT = re.compile(r"(\d{1,8})([HMSmun])")
_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
# Request headers that are HTTP/transport plumbing, not call metadata.
_NOT_METADATA = frozenset({
    "host", "connection", "content-length", "content-type", "accept", "accept-encoding", "accept-language",
    "origin", "referer", "user-agent", "x-grpc-web", "x-user-agent", "grpc-timeout", "te", "cookie",
    "cache-control", "pragma", "priority", "keep-alive", "transfer-encoding", "upgrade",
})
_B64_SEGMENT = re.compile(rb"[A-Za-z0-9+/]*={0,2}")


def is_grpc_web(content_type: str) -> bool:
    return content_type.startswith("application/grpc-web")


def parse_timeout(value: str) -> float | None:
    """Seconds of a `grpc-timeout` header (e.g. `250m`), None when absent; ValueError when bad."""
    if not value:
        return None
    m = _TIMEOUT.fullmatch(value.strip())
    if not m:
        raise ValueError(f"grpc-timeout {value!r} is not 1-8 digits followed by one of H M S m u n")
    return int(m.group(1)) * _UNITS[m.group(2)]


def metadata_of(scope: Scope) -> Metadata:
    """Request headers as gRPC invocation metadata (`-bin` values base64-decoded)."""
    out: list[tuple[str, str | bytes]] = []
    for raw_key, raw_value in scope["headers"]:
        key = raw_key.decode("latin-1").lower()
        if key in _NOT_METADATA or key.startswith(("sec-", "access-control-", ":")):
            continue
        if key.endswith("-bin"):
            try:
                out.append((key, base64.b64decode(raw_value + b"=" * (-len(raw_value) % 4))))
            except (binascii.Error, ValueError):
                continue
        else:
            out.append((key, raw_value.decode("latin-1")))
    return tuple(out)


def client_of(scope: Scope) -> str:
    """The caller's name for itself (its user-agent), which the metadata leaves out: for the audit log."""
    for key, value in scope["headers"]:
        if key == b"user-agent":
            return value.decode("latin-1")[:120]
    return ""


def peer_of(scope: Scope) -> str:
    """The client address in grpc's `peer()` form."""
    client = scope.get("client")
    if not client:
        return "unknown"
    host, port = client[0], client[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def decode_text(body: bytes) -> bytes:
    """grpc-web-text body: base64, possibly several padded chunks one after another."""
    body = b"".join(body.split())
    out = []
    for seg in _B64_SEGMENT.findall(body):
        if seg:
            out.append(base64.b64decode(seg + b"=" * (-len(seg) % 4)))
    if sum(len(s) for s in _B64_SEGMENT.findall(body)) != len(body):
        raise ValueError("grpc-web-text body is not base64")
    return b"".join(out)


def split_frames(data: bytes) -> list[bytes]:
    """The message payloads of a framed body; ValueError when the framing is broken."""
    frames = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < 5:
            raise ValueError("truncated gRPC-Web frame header")
        flag, length = _HEADER.unpack_from(data, pos)
        pos += 5
        if len(data) - pos < length:
            raise ValueError(f"gRPC-Web frame says {length} bytes but {len(data) - pos} follow")
        if flag & 0x01:
            raise ValueError("compressed gRPC-Web frames are not supported (send grpc-encoding identity)")
        if not flag & _TRAILER_FLAG:
            frames.append(data[pos:pos + length])
        pos += length
    return frames


def _meta_headers(pairs: Metadata) -> Headers:
    out = []
    for key, value in pairs:
        if key.endswith("-bin"):
            value = base64.b64encode(value if isinstance(value, bytes) else value.encode()).decode()
        out.append((key.lower().encode("latin-1"), str(value).encode("latin-1", "replace")))
    return out


def _status_headers(code: grpc.StatusCode, details: str) -> Headers:
    headers = [(b"grpc-status", str(code.value[0]).encode())]
    if details:
        headers.append((b"grpc-message", quote(details, safe=" !#$&'()*+,/:;=?@[]~").encode()))
    return headers


class _Response:
    """One gRPC-Web response (the call's `Sink`): headers once, then frames, then the trailers."""

    __slots__ = ("content_type", "ctx", "encode", "headers_after", "send", "started", "text")

    def __init__(self, send: Send, text: bool, ctx: CallContext, handler: grpc.RpcMethodHandler | None = None) -> None:
        self.send = send
        self.text = text
        self.ctx = ctx
        self.started = False
        self.content_type = b"application/grpc-web-text+proto" if text else b"application/grpc-web+proto"
        self.encode = handler.response_serializer if handler is not None else None
        streaming = handler is not None and handler.response_streaming
        self.headers_after = HEADERS_AFTER if streaming else None

    async def start(self) -> None:
        """Sends the response headers, once: when the handler sends its metadata, when the first
        message goes out, or early for a stream that is slow to start (then metadata sent later
        cannot go out any more, and is dropped rather than failing the call)."""
        await self._open(())

    async def _open(self, extra: Headers) -> None:
        if self.started:
            return
        self.started = True
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", self.content_type), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
            *_meta_headers(self.ctx.initial_metadata), *extra]})

    def _frame(self, flag: int, payload: bytes) -> bytes:
        frame = _HEADER.pack(flag, len(payload)) + payload
        return base64.b64encode(frame) if self.text else frame

    async def message(self, payload: bytes) -> None:
        if not self.ctx.initial_metadata_sent:  # from the first message on, as in grpc.aio
            self.ctx.initial_metadata_sent = True
            await self._open(())
        await self.send({"type": "http.response.body", "body": self._frame(0, payload), "more_body": True})

    async def finish(self, code: grpc.StatusCode, details: str, trailing: Metadata = ()) -> None:
        status = _status_headers(code, details) + _meta_headers(trailing)
        if not self.started:  # trailers-only: the status travels in the headers
            await self._open(status)
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        block = b"".join(k + b": " + v + b"\r\n" for k, v in status)
        await self.send({"type": "http.response.body", "body": self._frame(_TRAILER_FLAG, block), "more_body": False})


class GrpcWeb:
    """The ASGI app that answers every gRPC-Web POST."""

    def __init__(self, lookup: Lookup, max_message_bytes: int = 4 * 1024 * 1024) -> None:
        self.lookup = lookup
        self.max_body = max_message_bytes + 5 * 16  # a few frame headers on top of one message

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        content_type = next((v for k, v in scope["headers"] if k == b"content-type"), b"").decode("latin-1")
        text = content_type.startswith("application/grpc-web-text")
        metadata = metadata_of(scope)
        ctx = CallContext(metadata, peer_of(scope), "grpc-web", route=path)
        ctx.client = client_of(scope)
        if scope["method"] != "POST":  # refusals run no handler: nothing to finish but the answer
            await _Response(send, text, ctx).finish(
                grpc.StatusCode.UNIMPLEMENTED, f"gRPC-Web calls are POST requests, not {scope['method']}")
            return
        handler = self.lookup(path, metadata)
        if handler is None:
            await _Response(send, text, ctx).finish(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {path}")
            return
        try:
            timeout = parse_timeout(next((v for k, v in scope["headers"] if k == b"grpc-timeout"), b"").decode())
        except ValueError as exc:
            timeout, request = None, Rejected(InvalidArgument(str(exc)))
        else:
            try:
                request = self._request(handler, await read_body(receive, self.max_body), text)
            except ClientGone:
                return
            except BodyTooLarge as exc:
                request = Rejected(exc)
        ctx.set_timeout(timeout)
        await drive(handler, request, ctx, _Response(send, text, ctx, handler), gone=lambda: wait_disconnect(receive))

    @staticmethod
    def _request(handler: grpc.RpcMethodHandler, body: bytes, text: bool) -> Any:
        """The request of a framed body: a message (a `Rejected` one if undecodable), or an async
        iterator of them for client-streaming methods; `Rejected` if the framing is broken."""
        frames = decode(lambda b: split_frames(decode_text(b) if text else b), body, "gRPC-Web body")
        if isinstance(frames, Rejected):
            return frames
        deserialize = handler.request_deserializer or (lambda f: f)
        requests = [deserialize(f) for f in frames]
        if handler.request_streaming:
            return _aiter(requests)
        if len(requests) != 1:
            return Rejected(InvalidArgument(f"a unary request needs exactly one message, got {len(requests)}"))
        return requests[0]


async def _aiter(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


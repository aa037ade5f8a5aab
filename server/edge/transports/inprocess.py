"""In-process calls: a channel to an app in the same process, without a socket.

For Python code that embeds uibus (an IDE extension host, a test, a tool) and wants to call its
services as a gRPC client would, at function-call cost: `app.channel()` gives a `Channel` with
the `unary_unary` / `unary_stream` / `stream_unary` / `stream_stream` of a grpc.aio channel.
Calls run the same pipeline-wrapped handlers as every transport (token, decoding, store outages,
metrics under transport "inprocess"), and a non-OK status raises `grpc.aio.AioRpcError`, so
client code cannot tell it from a network channel. uibus's own parts never call each other this
way: services call the domain core.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import grpc
import grpc.aio

from uibus.edge.calls import CallContext, Metadata, drive, stream

Lookup = Callable[[str, Sequence[tuple[str, str | bytes]]], grpc.RpcMethodHandler | None]
Serializer = Callable[[Any], bytes] | None
Deserializer = Callable[[bytes], Any] | None
_NONE = object()


def _error(code: grpc.StatusCode, details: str, trailing: Metadata = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class Channel:
    """A grpc.aio-like channel whose calls run in this process; `metadata` goes on every call."""

    def __init__(self, lookup: Lookup, metadata: Iterable[tuple[str, str | bytes]] = (),
                 peer: str = "inprocess", max_message_bytes: int = 0, *, door: str = "inprocess",
                 client: str = "") -> None:
        """`max_message_bytes` (0: none): the bound a gRPC server puts on each request message
        (--max-message-bytes), for doors that call through here on a client's behalf (`/acp`), so
        a message refused over gRPC is refused the same way here (RESOURCE_EXHAUSTED)."""
        self._lookup = lookup
        self._metadata = tuple(metadata)
        self._peer = peer
        self.max_message_bytes = max_message_bytes
        self.door, self.client = door, client  # whose calls these are, for the audit log (`/acp`'s editor)

    def unary_unary(self, method: str, request_serializer: Serializer = None,
                    response_deserializer: Deserializer = None) -> _Unary:
        return _Unary(self, method, request_serializer, response_deserializer, streaming=False)

    def stream_unary(self, method: str, request_serializer: Serializer = None,
                     response_deserializer: Deserializer = None) -> _Unary:
        return _Unary(self, method, request_serializer, response_deserializer, streaming=True)

    def unary_stream(self, method: str, request_serializer: Serializer = None,
                     response_deserializer: Deserializer = None) -> _Stream:
        return _Stream(self, method, request_serializer, response_deserializer, streaming=False)

    def stream_stream(self, method: str, request_serializer: Serializer = None,
                      response_deserializer: Deserializer = None) -> _Stream:
        return _Stream(self, method, request_serializer, response_deserializer, streaming=True)

    async def close(self) -> None:
        """Nothing to release; here so code written for grpc.aio channels works unchanged."""

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- one call -----------------------------------------------------------------------------

    def _start(self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None,
               timeout: float | None) -> tuple[grpc.RpcMethodHandler, CallContext]:
        md = (*self._metadata, *(metadata or ()))
        handler = self._lookup(method, md)
        if handler is None:
            raise _error(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {method}")
        ctx = CallContext(md, self._peer, "inprocess", timeout)
        ctx.door, ctx.client = self.door, self.client
        return handler, ctx


class _Method:
    def __init__(self, channel: Channel, method: str, serializer: Serializer, deserializer: Deserializer,
                 streaming: bool) -> None:
        self._channel = channel
        self._method = method
        self._serialize = serializer
        self._deserialize = deserializer
        self._streaming = streaming

    def _request(self, handler: grpc.RpcMethodHandler, request: Any) -> Any:
        """What the handler gets: each message serialized and decoded again, as over a wire
        (so a caller's message is never shared with the server), or the raw bytes decoded."""
        decode = handler.request_deserializer
        limit = self._channel.max_message_bytes

        def one(message: Any) -> Any:
            data = self._serialize(message) if self._serialize is not None else message
            if limit and isinstance(data, bytes) and len(data) > limit:
                raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the request message is {len(data)} bytes; the "
                             f"limit is {limit} (--max-message-bytes)")
            return decode(data) if decode is not None else data

        if not self._streaming:
            return one(request)

        async def many() -> AsyncIterator[Any]:
            if hasattr(request, "__aiter__"):
                async for message in request:
                    yield one(message)
            else:
                for message in request:
                    yield one(message)
        return many()

    def _encoder(self, handler: grpc.RpcMethodHandler) -> Callable[[Any], Any] | None:
        """A response message as the caller gets it: serialized and decoded again, as over a wire."""
        encode = handler.response_serializer
        decode = self._deserialize
        if encode is None or decode is None:
            return encode or decode
        return lambda message: decode(encode(message))


class _Answer:
    """The call's `Sink`: the reply is kept (unary), and a failed status is raised as a network
    channel raises it."""

    headers_after = None

    def __init__(self, encode: Callable[[Any], Any] | None) -> None:
        self.encode = encode
        self.reply: Any = _NONE

    async def start(self) -> None:
        pass  # nothing goes out before a message

    async def message(self, data: Any) -> None:
        self.reply = data

    async def finish(self, code: grpc.StatusCode, details: str, trailing: Metadata) -> None:
        if code != grpc.StatusCode.OK:
            raise _error(code, details, trailing)


class _Unary(_Method):
    async def __call__(self, request: Any, *, timeout: float | None = None,
                       metadata: Sequence[tuple[str, str | bytes]] | None = None) -> Any:
        handler, ctx = self._channel._start(self._method, metadata, timeout)
        answer = _Answer(self._encoder(handler))
        await drive(handler, self._request(handler, request), ctx, answer)
        if answer.reply is _NONE:
            raise _error(grpc.StatusCode.INTERNAL, "the handler returned no response message", ctx.trailing)
        return answer.reply


class _Stream(_Method):
    def __call__(self, request: Any, *, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str | bytes]] | None = None) -> AsyncIterator[Any]:
        """The responses, pulled by the caller straight from the driver (no generator of our own
        in between, so no hop per message more than before); a failure to start is raised when
        iterated, as a network channel raises it."""
        try:
            handler, ctx = self._channel._start(self._method, metadata, timeout)
            prepared = self._request(handler, request)
        except Exception as exc:
            return _raising(exc)
        return stream(handler, prepared, ctx, _Answer(self._encoder(handler)))


async def _raising(exc: Exception) -> AsyncIterator[Any]:
    raise exc
    yield  # an async generator, like a call's stream

"""The answer to one `POST /mcp` (uibus.edge.transports.mcp_http): a JSON body, or an event
stream that opens once the call is admitted, kept for a client that resumes it; and the error a
call gets when it fails before any answer went out, at the HTTP status MCP clients act on.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from uibus.edge.calls import Metadata
from uibus.edge.mcp import era, protocol
from uibus.edge.mcp.protocol import Call, ProtocolError, Reply
from uibus.edge.transports import sse
from uibus.edge.transports.asgi import CHALLENGE, Headers, Send, http_status, respond
from uibus.edge.transports.mcp_resume import SharedStream, new_stream_name
from uibus.infra.errors import UibusError
from uibus.infra.json_input import dump_json_bytes
from uibus.infra.tasks import cancel_and_wait

MAX_BUFFERED_BYTES = 8 * 1024 * 1024  # events of one call waiting for a reader; more and the call is cut
_AUTH_STATUS = {grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403}


def dump(obj: Any) -> bytes:
    # One line (neuro-san's client reads the answer as JSON lines), RFC 8259 only.
    return dump_json_bytes(obj)


class Exchange:
    """The answer to one POST (the call's `Sink`): a JSON body, or an event stream opened when the
    call is admitted (the handler sends its initial metadata then). The stream's events go through
    a uibus.edge.transports.sse queue, so a client that loses the POST's stream resumes it with a GET."""

    encode = None
    headers_after = None
    modern = False  # a request of the stateless era: its errors take the era's HTTP statuses

    def __init__(self, send: Send, ident: Any, streamable: bool, keepalive_s: float, call: Call,
                 rejection: UibusError | None, posted_gone: asyncio.Future[Any]) -> None:
        self.send = send
        self.ident = ident
        self.streamable = streamable
        self.keepalive_s = keepalive_s
        self.call = call
        self.session_id = call.session_id
        self.rejection = rejection  # why the transport could not read the input, if it could not
        self.posted_gone = posted_gone  # the POST's client went away
        self.authorization = ""  # the POST's, which a resuming GET must carry too
        self.registry: dict[str, Exchange] = {}
        self.replay_bytes = sse.REPLAY_BYTES
        self.replay: sse.Replay | None = None
        self.share: Any = None  # with replicas: makes the stream's SharedStream, given its name (McpHttp._sharing)
        self.shared: SharedStream | None = None
        self._watching: asyncio.Task[None] | None = None  # remote readers' notices (they keep the call going)
        self.reply: Reply | None = None
        self.streaming = False
        self.done = False
        self.stream: sse.Queue | None = None
        self.ended_at: float | None = None  # when the call's last event was queued
        self._readers = asyncio.Event()  # a reader came or went, or the stream was cut
        self.was_cut = asyncio.Event()
        self._pumping: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """The call was admitted and is about to wait: start the event stream (when the client takes
        one), with its priming event (an id and no data: resumable from the first moment)."""
        if not self.streamable or self.streaming:
            return
        self.streaming = True
        self.stream = sse.Queue(sse.Budget(MAX_BUFFERED_BYTES), new_stream_name(), self.replay_bytes, self.replay)
        self.registry[self.stream.name] = self
        if self.share is not None:
            self.shared = self.share(self.stream.name)
            self._watching = asyncio.create_task(self.shared.watch_readers(self._readers.set),
                                                 name="uibus-mcp-readers")
        self._push(b"")
        await self.send({"type": "http.response.start", "status": 200, "headers": sse.HEADERS})
        self._pumping = asyncio.create_task(self.read(self.send, self.posted_gone), name="uibus-mcp-stream")

    async def read(self, send: Send, gone: asyncio.Future[Any]) -> None:
        """One reader of the stream (the POST, or a GET resuming it) until it ends or its client goes."""
        assert self.stream is not None
        stop = self.stream.begin_reading()
        self._readers.set()
        try:
            await sse.pump(self.stream, send, gone, self.keepalive_s, stop)
        finally:
            self.stream.end_reading()
            self._readers.set()

    async def abandoned(self, patience: float) -> None:
        """Returns once the stream has had no reader for `patience` seconds (or was cut)."""
        while not self.was_cut.is_set():
            self._readers.clear()
            if self.stream is not None and self.stream.reading:
                await self._readers.wait()
                continue
            try:
                await asyncio.wait_for(self._readers.wait(), patience)
            except TimeoutError:
                return

    def cut(self) -> None:
        """The stream cannot go on (its client stopped reading, or asked for events no longer
        kept): it ends, and the call with it."""
        self.was_cut.set()
        self._readers.set()
        if self.stream is not None:
            if self.shared is not None and not self.stream.closed:  # a remote reader ends here too
                self.shared.record(self.stream.ids.last + 1, b"", end=True)
            self.stream.drop()
            self.stream.close()

    def _push(self, message: dict[str, Any] | bytes, end: bool = False) -> None:
        """Queues one event (b"": the priming one, an id and no data); `end`: the stream's last."""
        assert self.stream is not None
        try:
            n, framed = (self.stream.push(message) if isinstance(message, bytes)
                         else self.stream.push(dump(message), "message"))
        except sse.Overflow:
            self.cut()
            return
        if self.shared is not None:
            self.shared.record(n, framed, end)

    async def message(self, item: Reply | dict[str, Any]) -> None:
        """The method's result, or a notification for the client on the way to it."""
        if isinstance(item, Reply):
            self.reply = item
        else:
            await self.event(item)

    async def event(self, message: dict[str, Any]) -> None:
        """A notification for the client: sent on the stream; without one there is no way to send it."""
        if self.streaming:
            self._push(message)

    def _end(self, message: dict[str, Any] | None) -> None:
        self.done = True
        if message is not None:
            self._push(message, end=True)
        elif self.shared is not None and self.stream is not None and not self.stream.closed:
            self.shared.record(self.stream.ids.last + 1, b"", end=True)  # ended without a last event
        if self.stream is not None:
            self.stream.close()
        self.ended_at = time.monotonic()

    async def finish(self, code: grpc.StatusCode, details: str, trailing: Metadata = ()) -> None:
        """The response: the result, 202 for a notification, or the error (`rejection`: why the
        transport could not read the input, which the pipeline answered unless it refused the token)."""
        reply, call, rejection = self.reply, self.call, self.rejection
        if code == grpc.StatusCode.OK and reply is None and call.message.is_request:
            code, details = grpc.StatusCode.INTERNAL, "the method gave no result"
        if code == grpc.StatusCode.OK:
            if reply is None:  # a notification or a client's response: accepted, nothing to say
                await self._whole(202, b"", ())
                return
            body = protocol.response(self.ident, reply.result)
            extra: Headers = [(b"mcp-session-id", call.new_session.encode())] if call.new_session else []
        else:
            if not self.streaming:
                await refuse_call(self.send, self.ident, code, details, rejection, self.modern)
                self.done = True
                return
            body = protocol.error(self.ident, code.name, details)
            extra = []
        if self.streaming:
            self._end(body)
        else:
            await self._whole(200, dump(body), extra)

    async def cancelled(self) -> None:
        """The client cancelled the request: it waits for no answer (the spec says to send none), but
        the HTTP exchange must still end, so a stream just ends and a plain POST gets the error."""
        if self.streaming:
            self._end(None)
        else:
            await self._whole(200, dump(protocol.error(self.ident, "CANCELLED", "cancelled by the client")), ())

    async def _whole(self, status: int, data: bytes, extra: Headers) -> None:
        self.done = True
        await respond(self.send, status, data, "application/json", list(extra))

    async def close(self) -> None:
        """The call is over: the POST's reader gets what is left (while its client stays), the
        stream stays registered for a late resume (`McpHttp._sweep` forgets it)."""
        if self.stream is not None and not self.stream.closed:  # abandoned: a late resume learns it
            self._end(protocol.error(self.ident, "CANCELLED", "the call's event stream broke and no reader resumed "
                                     "it in time: the call was cancelled"))
        if self.ended_at is None:  # (a stream that was cut): forgotten like any other
            self.ended_at = time.monotonic()
        await cancel_and_wait(self._watching)
        if self._pumping is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._pumping), self.keepalive_s)
            except TimeoutError:  # a client that does not read: what it did not take stays for a resume
                pass
            finally:
                await cancel_and_wait(self._pumping)


async def refuse_call(send: Send, ident: Any, code: grpc.StatusCode, details: str, rejection: UibusError | None,
                  modern: bool = False) -> None:
    """A failure before any answer went out: the JSON-RPC error, at the HTTP status MCP clients act on
    (`modern`: a stateless-era request, whose protocol errors have statuses of their own)."""
    ours = rejection is not None and code.name == rejection.code  # the pipeline answered the transport's Rejected
    rpc_code = protocol.rpc_code_of_error(rejection) if ours and rejection is not None else None
    data = rejection.rpc_data if ours and isinstance(rejection, ProtocolError) else None
    status = _AUTH_STATUS.get(code) or (http_status(code) if ours else 200)
    if modern and code not in _AUTH_STATUS:
        status = era.HTTP_STATUS.get(rpc_code if rpc_code is not None else protocol.rpc_code_of(code.name), 200)
    body = protocol.error(ident, code.name, details, rpc_code, data)
    headers: Headers = [CHALLENGE] if status == 401 else []
    await respond(send, status, dump(body), "application/json", headers)

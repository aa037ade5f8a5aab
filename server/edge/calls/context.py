"""The context a call that does not arrive as native gRPC runs with, and how a transport hands the
pipeline a request it could not read.

Every transport other than the grpc.aio server (gRPC-Web, the neuro-san HTTP API, the CodeBolt
WebSocket, in-process channels) runs the very same pipeline-wrapped handlers with a `CallContext`,
which offers what grpc.aio's ServicerContext offers (metadata, abort, deadlines, done callbacks),
so a handler cannot tell one transport from another. `Rejected` is how a transport hands the
pipeline a request it could not decode or that broke a limit: the pipeline, not the transport,
decides what that costs the caller.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import grpc
import grpc.aio

from uibus.infra.errors import InvalidArgument, UibusError

Metadata = tuple[tuple[str, str | bytes], ...]


class Rejected:
    """A request that never became a message: undecodable bytes, broken framing, over a limit.

    Transports pass it to the handler in place of the request; the pipeline answers it with its
    error's status before the handler runs.
    """

    __slots__ = ("error",)

    def __init__(self, error: UibusError) -> None:
        self.error = error


def decode(parse: Callable[[Any], Any], data: Any, what: str = "request") -> Any:
    """`parse(data)`, or a `Rejected` that says why it could not be parsed."""
    try:
        return parse(data)
    except UibusError as exc:
        return Rejected(exc)
    except Exception as exc:  # a parser's own error type (DecodeError, ParseError, ValueError, …)
        return Rejected(InvalidArgument(f"the {what} could not be decoded: {exc or type(exc).__name__}"))


class Aborted(grpc.aio.AbortError):
    """Raised by `abort`; the transport reads the recorded status (as grpc.aio does)."""


def text_metadata(context: Any) -> dict[str, str]:
    """A call's text metadata as a dict (what a chat turn may forward to its agent; binary values
    are left out)."""
    return {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}


class CallContext(grpc.aio.ServicerContext):  # type: ignore[type-arg]
    """A `grpc.aio.ServicerContext` for calls that arrive any other way than native gRPC."""

    def __init__(self, metadata: Metadata, peer: str, transport: str, timeout: float | None = None,
                 state: Any = None, route: str | None = None) -> None:
        self.transport = transport  # the metrics label: grpc-web, http, websocket, inprocess
        self.state = state  # what a transport hands its own handlers (the CodeBolt connection)
        self.route = route  # an HTTP transport's route template (`http.route` of the call's span)
        self.door = transport  # the door the audit log names (an in-process call: the door that made it, /acp)
        self.client = ""  # the caller's user-agent when its transport strips it from the metadata (HTTP doors)
        self._metadata = metadata
        self._peer = peer
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.initial_metadata: Metadata = ()
        self.initial_metadata_sent = False
        self.trailing: Metadata = ()
        self._cancelled = False
        self._done = False
        self._callbacks: list[Callable[[Any], None]] = []
        # Set by the driver when a handler streams with `context.write()` instead of yielding.
        self.writes: asyncio.Queue[Any] | None = None
        # Called when the handler sends initial metadata, so headers can go out before a message.
        self.on_initial_metadata: Callable[[], Any] | None = None

    # --- status ---------------------------------------------------------------------------------
    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Sequence[tuple[str, str | bytes]] = ()) -> NoReturn:
        if code == grpc.StatusCode.OK:
            code = grpc.StatusCode.UNKNOWN  # grpc.aio refuses to abort with OK as well
        self._code = code
        self._details = details
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise Aborted(details)

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        await self.abort(status.code, status.details, status.trailing_metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:  # type: ignore[override]
        return self._code

    def details(self) -> str:  # type: ignore[override]
        return self._details

    def status(self) -> tuple[grpc.StatusCode, str]:
        return self._code or grpc.StatusCode.OK, self._details

    # --- metadata -------------------------------------------------------------------------------
    def invocation_metadata(self) -> Metadata:  # type: ignore[override]
        return self._metadata

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str | bytes]]) -> None:
        """As grpc.aio's: the headers go out now (the transport's `on_initial_metadata`; a transport
        that already opened its response on its own keeps what it sent). Once, as in grpc.aio."""
        if self.initial_metadata_sent:
            raise grpc.aio.UsageError("initial metadata was already sent")
        self.initial_metadata_sent = True
        self.initial_metadata = tuple(initial_metadata)
        if self.on_initial_metadata is not None:
            await self.on_initial_metadata()

    def attach_initial_metadata(self, initial_metadata: Sequence[tuple[str, str | bytes]]) -> None:
        """Headers that go out whenever the transport starts its response, without starting it: the
        pipeline's own headers (`x-uibus-worker`) ride with the first message, and sending them would
        tell the transport the call is open and waiting (MCP answers with an event stream then)."""
        if not self.initial_metadata_sent:
            self.initial_metadata = tuple(initial_metadata)

    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self.trailing = tuple(trailing_metadata)

    def trailing_metadata(self) -> Metadata:  # type: ignore[override]
        return self.trailing

    # --- streaming ------------------------------------------------------------------------------
    async def write(self, message: Any) -> None:
        if self.writes is None:
            raise grpc.aio.UsageError("write() is only for server-streaming handlers")
        await self.writes.put(message)

    async def read(self) -> Any:
        raise grpc.aio.UsageError("read() is not supported here; handlers get a request iterator")

    # --- call state -----------------------------------------------------------------------------
    def peer(self) -> str:
        return self._peer

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def set_compression(self, compression: grpc.Compression) -> None:
        pass  # messages here are never compressed per message

    def disable_next_message_compression(self) -> None:
        pass

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def set_timeout(self, timeout: float | None) -> None:
        """Starts the deadline clock (`grpc-timeout` is known only once the request is read)."""
        self._deadline = None if timeout is None else time.monotonic() + timeout

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._done:
            callback(self)
        else:
            self._callbacks.append(callback)

    def finish(self, cancelled: bool = False) -> None:
        """Marks the call over and runs the done callbacks once (the driver calls it)."""
        if self._done:
            return
        self._done = True
        self._cancelled = cancelled
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

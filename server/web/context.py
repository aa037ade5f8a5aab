"""A `grpc.aio.ServicerContext` for calls that arrive over HTTP and run in-process.

Servicers are written against grpc.aio's context (abort, metadata, deadlines, done callbacks);
this class gives them the same surface so a handler cannot tell gRPC-Web from native gRPC.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import grpc
import grpc.aio

Metadata = tuple[tuple[str, str | bytes], ...]


class Aborted(grpc.aio.AbortError):
    """Raised by `abort`; the adapter turns it into the recorded status (as grpc.aio does)."""


class HttpServicerContext(grpc.aio.ServicerContext):  # type: ignore[type-arg]
    def __init__(self, metadata: Metadata, peer: str, timeout: float | None = None) -> None:
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
        # Set by the adapter when a handler streams with `context.write()` instead of yielding.
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
        if self.initial_metadata_sent:
            raise grpc.aio.UsageError("initial metadata was already sent")
        self.initial_metadata = tuple(initial_metadata)
        if self.on_initial_metadata is not None:
            await self.on_initial_metadata()

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
        raise grpc.aio.UsageError("read() is not supported over HTTP; handlers get a request iterator")

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
        pass  # HTTP/1.1 responses here are never compressed per message

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
        """Marks the call over and runs the done callbacks once (the adapter calls it)."""
        if self._done:
            return
        self._done = True
        self._cancelled = cancelled
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

"""The one driver of calls that do not arrive as native gRPC: it runs a pipeline-wrapped method
handler of any shape to its messages and status, and hands them to a transport's `Sink`.

Why one: gRPC-Web, the neuro-san HTTP API, MCP, in-process channels and the CodeBolt gateway used
to drive calls by hand, and drifted (a call the HTTP API abandoned skipped its done callbacks; only
two of them honoured deadlines). Everything a call's life means is decided here, once, for all of
them: a deadline is DEADLINE_EXCEEDED "Deadline Exceeded"; a client that goes away cancels the
handler at once (so its `finally`, e.g. a bus unsubscribe, runs now); a message that cannot be
encoded is INTERNAL; and `ctx.finish` (the done callbacks) runs exactly once, in a `finally`, with
`cancelled=True` when the handler did not end by itself. A transport keeps only its framing: a
`Sink` that sends headers, one message, and the status.

The native grpc.aio server does not come here: grpc.aio drives its own calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import grpc

from uibus.edge.calls.context import Aborted, CallContext, Metadata
from uibus.infra.tasks import cancel_all, cancel_and_wait

_END = object()
_DONE = object()
DEADLINE_DETAILS = "Deadline Exceeded"  # grpc's own wording, which clients match


class Sink(Protocol):
    """Where one call's answer goes: a transport's framing and nothing else.

    `encode` turns a response message into what `message` takes (framed bytes, a JSON line, a
    copy); None passes it as is. It runs inside the driver so that its failure is the call's
    INTERNAL status, the same on every transport.

    `headers_after` (seconds, streaming responses only): when the first message takes longer,
    the driver calls `start()` anyway, so the client of a live subscription learns at once that
    it is open (gRPC-Web); None waits for the first message (the HTTP API's status line does).
    """

    encode: Callable[[Any], Any] | None
    headers_after: float | None

    async def start(self) -> None:
        """Headers may go out now: the handler sent its initial metadata, or the first message of
        a stream is slow. Called any number of times; a sink that waits for a message ignores it."""

    async def message(self, data: Any) -> None:
        """One response message, encoded."""

    async def finish(self, code: grpc.StatusCode, details: str, trailing: Metadata) -> None:
        """The status, once, when the handler has ended (not when the client went away)."""


class Outcome(enum.Enum):
    COMPLETED = "completed"  # the handler ended and the sink has the status
    ABANDONED = "abandoned"  # the client went away: the handler was cancelled, no status sent
    CANCELLED = "cancelled"  # someone else cancelled the call (MCP's notifications/cancelled)


class _Unencodable(Exception):
    pass


def _encoded(encode: Callable[[Any], Any], message: Any) -> Any:
    try:
        return encode(message)
    except Exception as exc:  # the handler produced a message of the wrong type, or one its encoder refuses
        raise _Unencodable from exc


class _Ending:
    """How the handler's run ended, as the call's status: a deadline is DEADLINE_EXCEEDED, an
    unencodable message INTERNAL; both drivers (push and pull) map them here, once."""

    __slots__ = ("ctx", "ended")

    def __init__(self, ctx: CallContext) -> None:
        self.ctx = ctx
        self.ended = False  # the handler ended by itself (not cut short by a deadline or a cancel)

    def __enter__(self) -> _Ending:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if kind is None:
            self.ended = True
        elif issubclass(kind, TimeoutError):
            self.ctx.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            self.ctx.set_details(DEADLINE_DETAILS)
        elif issubclass(kind, _Unencodable):
            self.ctx.set_code(grpc.StatusCode.INTERNAL)
            self.ctx.set_details(f"could not serialize the response: {exc.__cause__ if exc else ''}")
            self.ended = True
        else:
            return False
        return True


async def drive(handler: grpc.RpcMethodHandler, request: Any, ctx: CallContext, sink: Sink, *,
                gone: Callable[[], Awaitable[Any]] | None = None,
                within: Callable[[], AbstractContextManager[Any]] | None = None) -> Outcome:
    """Runs the call to its end and hands its answer to `sink`.

    `gone` returns when the client has gone away (an ASGI disconnect); the handler is then
    cancelled. Without it, cancelling the awaiting task is the client going away. `within` is
    entered in the task the handler runs in (MCP registers that task so a client's cancel
    notification can cancel it). Exceptions of the sink propagate.
    """
    ctx.on_initial_metadata = sink.start
    try:
        if gone is None:
            await _answer(handler, request, ctx, sink, within)
            return Outcome.COMPLETED
        call = asyncio.ensure_future(_answer(handler, request, ctx, sink, within))
        watch = asyncio.ensure_future(gone())
        try:
            await asyncio.wait((call, watch), return_when=asyncio.FIRST_COMPLETED)
            abandoned = not call.done()
        finally:
            await cancel_all((call, watch))
        if abandoned:
            return Outcome.ABANDONED
        if call.cancelled():
            return Outcome.CANCELLED
        call.result()  # the sink's failure, if any
        return Outcome.COMPLETED
    finally:
        # A no-op when `_answer` got to its own `finally`; not when it was cancelled before it ran.
        ctx.finish(cancelled=True)


async def _answer(handler: grpc.RpcMethodHandler, request: Any, ctx: CallContext, sink: Sink,
                  within: Callable[[], AbstractContextManager[Any]] | None) -> None:
    """The call's messages into the sink, then its status; `ctx.finish` however it ends."""
    ending = _Ending(ctx)
    try:
        with within() if within is not None else contextlib.nullcontext():
            encode = sink.encode
            send = sink.message
            with ending:
                async with asyncio.timeout(ctx.time_remaining()):
                    async with contextlib.aclosing(responses(handler, request, ctx)) as stream:
                        if handler.response_streaming and sink.headers_after is not None:
                            message = await _first(stream, sink, sink.headers_after)
                        else:
                            message = await anext(stream, _END)
                        while message is not _END:
                            await send(message if encode is None else _encoded(encode, message))
                            message = await anext(stream, _END)
            code, details = ctx.status()
            await sink.finish(code, details, ctx.trailing)
    finally:
        ctx.finish(cancelled=not ending.ended)


async def _first(stream: AsyncIterator[Any], sink: Sink, after: float) -> Any:
    """The first message of a stream; the sink is told to start if it does not come at once.

    A stream that ends or fails straight away still gets an answer with its status alone, while
    a live subscription that waits for events tells its client at once that it is open.
    """
    first = asyncio.ensure_future(anext(stream, _END))
    try:
        done, _ = await asyncio.wait((first,), timeout=after)
        if not done:
            await sink.start()
        return await first
    finally:  # cancelled meanwhile: the generator must be idle before it is closed
        await cancel_and_wait(first)


async def stream(handler: grpc.RpcMethodHandler, request: Any, ctx: CallContext, sink: Sink) -> AsyncIterator[Any]:
    """`drive` for a caller that pulls the messages (an in-process channel): yields each encoded
    message instead of handing it to `sink.message`, then hands the status to `sink.finish` (which
    may raise it). Closing the generator early is the client going away."""
    ctx.on_initial_metadata = sink.start
    encode = sink.encode
    ending = _Ending(ctx)
    try:
        with ending:
            async with asyncio.timeout(ctx.time_remaining()):
                async with contextlib.aclosing(responses(handler, request, ctx)) as messages:
                    async for message in messages:
                        yield message if encode is None else _encoded(encode, message)
        code, details = ctx.status()
        await sink.finish(code, details, ctx.trailing)
    finally:
        ctx.finish(cancelled=not ending.ended)


class _Reply:
    """The sink of `unary`: keeps the one message; the status stays on the context."""

    encode = None
    headers_after = None

    def __init__(self) -> None:
        self.reply: Any = None

    async def start(self) -> None:
        pass

    async def message(self, data: Any) -> None:
        self.reply = data

    async def finish(self, code: grpc.StatusCode, details: str, trailing: Metadata) -> None:
        pass


async def unary(handler: grpc.RpcMethodHandler, request: Any, ctx: CallContext) -> Any:
    """The reply of a unary-response handler, or None with the failure's status on `ctx`.

    For callers inside uibus (the CodeBolt gateway, MCP's session end) that build their answer
    from the reply; cancelling the awaiting task cancels the handler, as a client going away would.
    """
    sink = _Reply()
    await drive(handler, request, ctx, sink)
    return sink.reply


async def responses(handler: grpc.RpcMethodHandler, request: Any, ctx: CallContext) -> AsyncIterator[Any]:
    """Yields the handler's response messages; the final status is left on `ctx`.

    `request` is a message (or `Rejected`), or an async iterator of them for client-streaming
    methods. The handler must come from the pipeline (the app's registry), which turns every
    failure into an abort, so nothing but `Aborted` and cancellation can come out of it.
    Cancellation propagates; the caller must `aclose()` this generator (use
    `contextlib.aclosing`) so the handler's own `finally` runs at once.
    """
    try:
        if handler.response_streaming:
            behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
            result = behavior(request, ctx)
            if hasattr(result, "__aiter__"):
                async with contextlib.aclosing(result):
                    async for message in result:
                        yield message
            else:
                async for message in _written(result, ctx):
                    yield message
        else:
            behavior = handler.stream_unary if handler.request_streaming else handler.unary_unary
            message = await behavior(request, ctx)
            if ctx.status()[0] == grpc.StatusCode.OK:
                if message is None:
                    ctx.set_code(grpc.StatusCode.INTERNAL)
                    ctx.set_details("the handler returned no response message")
                else:
                    yield message
    except Aborted:
        pass


async def _written(coro: Any, ctx: CallContext) -> AsyncIterator[Any]:
    """Messages of a handler that streams with `await context.write(msg)`."""
    queue: asyncio.Queue[Any] = asyncio.Queue()  # unbounded: a sentinel must never block
    ctx.writes = queue

    async def run() -> None:
        try:
            if inspect.isawaitable(coro):
                await coro
        finally:
            queue.put_nowait(_DONE)

    task = asyncio.ensure_future(run())
    try:
        while (message := await queue.get()) is not _DONE:
            yield message
        await task  # re-raises the handler's Aborted, if any
    finally:
        # Closed early (the client went away): the writer is stopped; an abort it ended with is
        # the status already on `ctx`, and a cancel of our caller still propagates.
        await cancel_and_wait(task)

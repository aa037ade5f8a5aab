"""Runs one grpc method handler in-process and turns its outcome into messages plus a status.

Both HTTP transports (gRPC-Web and the neuro-san JSON API) use this, so every handler shape
(unary or streaming response, async generator or `context.write()`) and every way a call ends
(return, abort, set_code, unexpected exception) is handled in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from uibus.web.context import Aborted, HttpServicerContext

log = logging.getLogger("uibus.web")
_DONE = object()


async def responses(handler: grpc.RpcMethodHandler, request: Any,
                    ctx: HttpServicerContext) -> AsyncIterator[Any]:
    """Yields the handler's response messages; the final status is left on `ctx`.

    `request` is a message, or an async iterator of messages for client-streaming methods.
    Cancellation (client gone, deadline) propagates; the caller must `aclose()` this generator
    (use `contextlib.aclosing`) so the handler's own `finally` runs at once.
    """
    try:
        if handler.response_streaming:
            behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
            result = behavior(request, ctx)
            if hasattr(result, "__aiter__"):
                async with contextlib.aclosing(result):
                    async for message in result:
                        yield message
            elif inspect.isawaitable(result):
                async for message in _written(result, ctx):
                    yield message
            else:  # a synchronous generator handler
                for message in result:
                    yield message
        else:
            behavior = handler.stream_unary if handler.request_streaming else handler.unary_unary
            result = behavior(request, ctx)
            message = await result if inspect.isawaitable(result) else result
            code, _ = ctx.status()
            if code == grpc.StatusCode.OK:
                if message is None:
                    ctx.set_code(grpc.StatusCode.INTERNAL)
                    ctx.set_details("the handler returned no response message")
                else:
                    yield message
    except Aborted:
        pass
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:
        log.exception("handler failed")
        ctx.set_code(grpc.StatusCode.UNKNOWN)
        ctx.set_details(f"Unexpected {type(exc).__name__}: {exc}")


async def _written(coro: Any, ctx: HttpServicerContext) -> AsyncIterator[Any]:
    """Messages of a handler that streams with `await context.write(msg)`."""
    queue: asyncio.Queue[Any] = asyncio.Queue()  # unbounded: a sentinel must never block
    ctx.writes = queue

    async def run() -> None:
        try:
            await coro
        finally:
            queue.put_nowait(_DONE)

    task = asyncio.ensure_future(run())
    try:
        while (message := await queue.get()) is not _DONE:
            yield message
        await task  # re-raises the handler's exception, if any
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

"""Turns "the shared store is unreachable" into gRPC UNAVAILABLE instead of UNKNOWN.

A networked store (Redis) can be down while uibus itself is fine. Clients and their retry policies
read UNAVAILABLE as "try again shortly", which is exactly right; UNKNOWN would say uibus broke.
Installed as a server interceptor so no servicer has to catch store errors itself.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from uibus.store import StoreUnavailable


class StoreUnavailableInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        return wrap_handler(handler) if handler is not None else handler


def _abort(context: grpc.aio.ServicerContext, exc: StoreUnavailable) -> Awaitable[None]:
    return context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


def _wrap(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in behavior(request, context):
                    yield item
            except StoreUnavailable as exc:
                await _abort(context, exc)
        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except StoreUnavailable as exc:
            await _abort(context, exc)
    return call


def wrap_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The same handler, answering UNAVAILABLE when its behaviour meets an unreachable store."""
    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_wrap(handler.stream_stream), **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_wrap(handler.stream_unary), **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_wrap(handler.unary_stream), **kw)
    return grpc.unary_unary_rpc_method_handler(_wrap(handler.unary_unary), **kw)

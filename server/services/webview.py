"""uibus.v1.WebviewService: every cline.UiService subscription of a webview over one stream.

Browsers keep at most six HTTP/1.1 connections per server and a gRPC-Web stream holds one, so the
webview page cannot open UiService's eleven streams. This service runs the very same UiService
subscribe handlers (looked up in the handler registry) and multiplexes their messages, so
behaviour (current theme first, provider-type filtering, targeted focus) cannot drift apart.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import webview_pb2, webview_pb2_grpc
from uibus.services.common import Runtime

Lookup = Callable[[str, Sequence[tuple[str, str | bytes]]], grpc.RpcMethodHandler | None]
_EMPTY = common_pb2.EmptyRequest()
_SIGNALS = ("subscribeToChatButtonClicked", "subscribeToAccountButtonClicked", "subscribeToRelinquishControl",
            "subscribeToDidBecomeVisible")
_BY_PROVIDER = ("subscribeToMcpButtonClicked", "subscribeToHistoryButtonClicked",
                "subscribeToSettingsButtonClicked")
_END = object()


def _event(source: str, message: Any) -> webview_pb2.WebviewEvent:
    if isinstance(message, ui_pb2.ClineMessage):
        return webview_pb2.WebviewEvent(source=source, partial_message=message)
    if isinstance(message, common_pb2.String):
        return webview_pb2.WebviewEvent(source=source, text=message.value)
    return webview_pb2.WebviewEvent(source=source, signal=common_pb2.Empty())


class WebviewService(webview_pb2_grpc.WebviewServiceServicer):
    def __init__(self, rt: Runtime, lookup: Lookup) -> None:
        self.rt = rt
        self.lookup = lookup

    async def Subscribe(self, request: webview_pb2.WebviewSubscribeRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[webview_pb2.WebviewEvent]:
        if not request.client_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "client_id is required (it targets subscribeToFocusChatInput)")
        provider = ui_pb2.WebviewProviderTypeRequest(provider_type=request.provider_type)
        calls: list[tuple[str, Any]] = [
            ("subscribeToTheme", _EMPTY), ("subscribeToPartialMessage", _EMPTY), ("subscribeToAddToInput", _EMPTY),
            ("subscribeToFocusChatInput", common_pb2.StringRequest(value=request.client_id)),
            *((name, _EMPTY) for name in _SIGNALS), *((name, provider) for name in _BY_PROVIDER)]
        queue: asyncio.Queue[Any] = asyncio.Queue(self.rt.config.queue_size)
        metadata = tuple(context.invocation_metadata() or ())

        async def pump(name: str, req: Any) -> None:
            handler = self.lookup(f"/cline.UiService/{name}", metadata)
            assert handler is not None and handler.unary_stream is not None
            try:
                async with contextlib.aclosing(handler.unary_stream(req, context)) as stream:
                    async for message in stream:
                        await queue.put(_event(name, message))
            except BaseException as exc:  # an abort in one stream ends the whole call
                await queue.put(exc)
                raise
            await queue.put(_END)

        tasks = [asyncio.ensure_future(pump(name, req)) for name, req in calls]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is _END:
                    running -= 1
                elif isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        running -= 1
                        continue
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def install(registry: Any, rt: Runtime) -> list[str]:
    """Installer for server.app: the service needs the registry to find the UiService handlers."""
    webview_pb2_grpc.add_WebviewServiceServicer_to_server(WebviewService(rt, registry.lookup), registry)
    return [webview_pb2.DESCRIPTOR.services_by_name["WebviewService"].full_name]

"""cline.UiService: the 22 RPCs a Cline webview calls (the first 16 and six upstream added later),
wire-compatible with Cline's proto.

Behaviour follows Cline's controller (Cline's `src/core/controller/ui/`, the
handlers of the `cline/ui.proto` this serves) with the differences uibus needs as a
multi-client server: state lives per session in the store, events come from the bus, and what
Cline would do on the host machine (open a URL or the walkthrough, scroll) becomes a host request,
and trackIntent (Cline's telemetry) is counted on /metrics and marked on the call's span. The fourteen
`subscribeTo*` methods are made from the feed's one table of UI streams.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from uibus.domain.feed import UI_STREAMS, UiFeed, UiStream
from uibus.infra import telemetry
from uibus.infra.session import session_of, since_of
from uibus.infra.webview import webview_html
from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc


def _subscribe(stream: UiStream) -> Callable[..., AsyncIterator[Any]]:
    def handler(self: UiService, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        # The feed's own stream, not a generator around it: every event would pay one more hop
        # (the pipeline serves a function that returns a stream as it serves a generator).
        return self.feed.events(session_of(context), stream, stream.target_of(request), since=since_of(context))

    handler.__name__ = handler.__qualname__ = stream.rpc
    return handler


class UiService(ui_pb2_grpc.UiServiceServicer):
    def __init__(self, feed: UiFeed) -> None:
        self.feed = feed

    async def scrollToSettings(self, request: common_pb2.StringRequest,
                               context: grpc.aio.ServicerContext) -> common_pb2.KeyValuePair:
        self.feed.scroll_to_settings(session_of(context), request.value)
        return common_pb2.KeyValuePair(key="scrollToSettings", value=request.value)

    async def onDidShowAnnouncement(self, request: common_pb2.EmptyRequest,
                                    context: grpc.aio.ServicerContext) -> common_pb2.Boolean:
        await self.feed.announcement_shown(session_of(context))
        return common_pb2.Boolean(value=False)  # as Cline: the announcement has now been shown

    async def initializeWebview(self, request: common_pb2.EmptyRequest,
                                context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        await self.feed.initialize_webview(session_of(context))
        return common_pb2.Empty()

    async def getWebviewHtml(self, request: common_pb2.EmptyRequest,
                             context: grpc.aio.ServicerContext) -> common_pb2.String:
        return common_pb2.String(value=webview_html())

    async def openUrl(self, request: common_pb2.StringRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        await self.feed.open_url(session_of(context), request.value)
        return common_pb2.Empty()

    async def openWalkthrough(self, request: common_pb2.EmptyRequest,
                              context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        await self.feed.open_walkthrough(session_of(context))
        return common_pb2.Empty()

    async def setTerminalExecutionMode(self, request: common_pb2.BooleanRequest,
                                       context: grpc.aio.ServicerContext) -> common_pb2.KeyValuePair:
        mode = await self.feed.set_terminal_execution_mode(session_of(context), request.value)
        return common_pb2.KeyValuePair(key="terminalExecutionModeSet", value=mode)  # as Cline answers

    async def trackIntent(self, request: ui_pb2.IntentEvent, context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        action = self.feed.track_intent(request)
        telemetry.annotate({"uibus.intent.action": action, "uibus.intent.source": request.source[:64],
                            "uibus.intent.has_text": request.has_text, "uibus.intent.has_images": request.has_images,
                            "uibus.intent.has_files": request.has_files,
                            "uibus.intent.has_active_task": request.has_active_task,
                            "uibus.intent.text_length": request.text_length})
        return common_pb2.Empty()


for _stream in UI_STREAMS:
    setattr(UiService, _stream.rpc, _subscribe(_stream))

SERVICE = ui_pb2.DESCRIPTOR.services_by_name["UiService"].full_name


def add_to(registry: Any, feed: UiFeed) -> str:
    """Registers the service; returns its name."""
    ui_pb2_grpc.add_UiServiceServicer_to_server(UiService(feed), registry)
    return SERVICE

"""cline.UiService: the 16 RPCs a Cline webview calls, wire-compatible with Cline's proto.

Behaviour follows Cline's controller (SPEC.md §1) with the differences uibus needs as a
multi-client server: state lives per session in the store, events come from the bus, and what
Cline would do on the host machine (open a URL, scroll) becomes a host request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import grpc

from uibus import topics
from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc
from uibus.pb.uibus.v1 import host_pb2
from uibus.services.common import Runtime, stream_topic
from uibus.session import session_of

MAX_URL_CHARS = 2048
_PROVIDER_TYPES = frozenset(ui_pb2.WebviewProviderType.values())


def check_url(url: str) -> str | None:
    """Why `url` may not be opened, or None. Only absolute http(s) URLs reach the host."""
    if not url:
        return "url is required"
    if len(url) > MAX_URL_CHARS:
        return f"url is {len(url)} characters long; the limit is {MAX_URL_CHARS}"
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        return "url contains whitespace or control characters"
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError as exc:
        return f"url is malformed: {exc}"
    if parts.scheme.lower() not in ("http", "https"):
        return f"only http and https URLs can be opened, not {parts.scheme or 'a relative URL'}:"
    if not host:
        return "url has no host"
    return None


def host_request(**kind: Any) -> host_pb2.HostRequest:
    return host_pb2.HostRequest(id=uuid.uuid4().hex, ts=int(time.time() * 1000), **kind)


def _provider_target(request: ui_pb2.WebviewProviderTypeRequest) -> str | None:
    if request.provider_type not in _PROVIDER_TYPES:
        return None
    return ui_pb2.WebviewProviderType.Name(request.provider_type)


def _topic_rpc(kind: str, by_provider: bool = False) -> Callable[..., AsyncIterator[Any]]:
    """Builds a subscribeTo* handler for `kind`; `by_provider` filters by WebviewProviderType."""

    async def handler(self: UiService, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        session = await session_of(context)
        target = ""
        if by_provider:
            target = _provider_target(request) or ""
            if not target:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"provider_type {request.provider_type} is not a WebviewProviderType "
                                    "(SIDEBAR=0, TAB=1)")
        async for item in stream_topic(self.rt.bus, context, session, kind, target):
            yield item

    handler.__name__ = f"subscribe_{kind}"
    return handler


class UiService(ui_pb2_grpc.UiServiceServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def scrollToSettings(self, request: common_pb2.StringRequest,
                               context: grpc.aio.ServicerContext) -> common_pb2.KeyValuePair:
        session = await session_of(context)
        self.rt.bus.publish(session, topics.HOST_REQUEST, host_request(
            scroll_to_settings=host_pb2.ScrollToSettings(section=request.value)))
        return common_pb2.KeyValuePair(key="scrollToSettings", value=request.value)

    async def onDidShowAnnouncement(self, request: common_pb2.EmptyRequest,
                                    context: grpc.aio.ServicerContext) -> common_pb2.Boolean:
        session = await session_of(context)
        state = await self.rt.store.get(session, topics.ANNOUNCEMENT_KEY) or {}
        state["last_shown"] = state.get("latest", "")
        await self.rt.store.put(session, topics.ANNOUNCEMENT_KEY, state)
        return common_pb2.Boolean(value=False)  # as Cline: the announcement has now been shown

    subscribeToAddToInput = _topic_rpc(topics.ADD_TO_INPUT)
    subscribeToMcpButtonClicked = _topic_rpc(topics.MCP_BUTTON, by_provider=True)
    subscribeToHistoryButtonClicked = _topic_rpc(topics.HISTORY_BUTTON, by_provider=True)
    subscribeToChatButtonClicked = _topic_rpc(topics.CHAT_BUTTON)
    subscribeToAccountButtonClicked = _topic_rpc(topics.ACCOUNT_BUTTON)
    subscribeToSettingsButtonClicked = _topic_rpc(topics.SETTINGS_BUTTON, by_provider=True)
    subscribeToPartialMessage = _topic_rpc(topics.PARTIAL_MESSAGE)
    subscribeToRelinquishControl = _topic_rpc(topics.RELINQUISH_CONTROL)
    subscribeToDidBecomeVisible = _topic_rpc(topics.DID_BECOME_VISIBLE)

    async def subscribeToTheme(self, request: common_pb2.EmptyRequest,
                               context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.String]:
        """Current theme first (from the store), then each change, as Cline does."""
        session = await session_of(context)
        theme = await self.rt.store.get(session, topics.THEME_KEY)
        first = (common_pb2.String(value=theme),) if theme is not None else ()
        async for item in stream_topic(self.rt.bus, context, session, topics.THEME, first=first):
            yield item

    async def subscribeToFocusChatInput(self, request: common_pb2.StringRequest,
                                        context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.Empty]:
        """Events for one client id only; Cline refuses an empty id."""
        session = await session_of(context)
        if not request.value:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Client ID is required")
        async for item in stream_topic(self.rt.bus, context, session, topics.FOCUS_CHAT_INPUT, request.value):
            yield item

    async def initializeWebview(self, request: common_pb2.EmptyRequest,
                                context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        """Tells the host, and replays the current theme so every stream of the session is fresh."""
        session = await session_of(context)
        bus = self.rt.bus
        bus.publish(session, topics.HOST_REQUEST, host_request(webview_initialized=host_pb2.WebviewInitialized()))
        theme = await self.rt.store.get(session, topics.THEME_KEY)
        if theme is not None:
            bus.publish(session, topics.THEME, common_pb2.String(value=theme))
        return common_pb2.Empty()

    async def getWebviewHtml(self, request: common_pb2.EmptyRequest,
                             context: grpc.aio.ServicerContext) -> common_pb2.String:
        from uibus.webview import webview_html

        return common_pb2.String(value=webview_html())

    async def openUrl(self, request: common_pb2.StringRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        """A server cannot open a browser on the user's machine: the host does, if one listens."""
        session = await session_of(context)
        problem = check_url(request.value)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        n = self.rt.bus.publish(session, topics.HOST_REQUEST,
                                host_request(open_url=host_pb2.OpenUrl(url=request.value)))
        if n == 0:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no host is subscribed to host requests of session {session!r}; "
                                "nothing can open the URL")
        return common_pb2.Empty()

"""uibus.v1.HostService: the sending side of the Cline UI streams (SPEC.md §3).

An IDE extension or agent host publishes UI events here; webviews receive them through
cline.UiService. Validation happens before publishing so a bad event never reaches a webview.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc

from uibus import topics
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2, host_pb2_grpc
from uibus.services.common import Runtime, stream_topic
from uibus.session import session_of

MAX_THEME_CHARS = 256 * 1024
_EMPTY = common_pb2.Empty()
_BUTTON_KINDS = {
    host_pb2.BUTTON_MCP: topics.MCP_BUTTON,
    host_pb2.BUTTON_HISTORY: topics.HISTORY_BUTTON,
    host_pb2.BUTTON_CHAT: topics.CHAT_BUTTON,
    host_pb2.BUTTON_ACCOUNT: topics.ACCOUNT_BUTTON,
    host_pb2.BUTTON_SETTINGS: topics.SETTINGS_BUTTON,
}
_BY_PROVIDER = {topics.MCP_BUTTON, topics.HISTORY_BUTTON, topics.SETTINGS_BUTTON}
# The valid numbers of each enum field, computed once: `EnumTypeWrapper.values()` builds a new list
# per call, which was most of what a publish cost in uibus's own code (bench/README.md).
_ENUMS = tuple((name, enum, frozenset(enum.values())) for name, enum in (
    ("type", ui_pb2.ClineMessageType), ("ask", ui_pb2.ClineAsk), ("say", ui_pb2.ClineSay)))
_PROVIDER_TYPES = frozenset(ui_pb2.WebviewProviderType.values())


def check_cline_message(msg: ui_pb2.ClineMessage) -> str | None:
    """Why a ClineMessage cannot be shown, or None."""
    if msg.ts <= 0:
        return "ts is required: a webview identifies a message by its ts (Unix milliseconds)"
    for name, enum, valid in _ENUMS:
        value = getattr(msg, name)
        if value not in valid:
            return f"{name}={value} is not a valid {enum.DESCRIPTOR.name}"
    return None


def reply(n: int) -> host_pb2.PublishReply:
    return host_pb2.PublishReply(subscribers=n)


class HostService(host_pb2_grpc.HostServiceServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def PublishAddToInput(self, request: host_pb2.TextEvent,
                                context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        session = await session_of(context)
        return reply(self.rt.bus.publish(session, topics.ADD_TO_INPUT, common_pb2.String(value=request.text)))

    async def PublishButtonClick(self, request: host_pb2.ButtonClick,
                                 context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        session = await session_of(context)
        kind = _BUTTON_KINDS.get(request.button)
        if kind is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"button={request.button} is not one of MCP, HISTORY, CHAT, ACCOUNT, SETTINGS")
        target = None
        if request.HasField("provider_type"):
            if request.provider_type not in _PROVIDER_TYPES:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"provider_type={request.provider_type} is not SIDEBAR (0) or TAB (1)")
            if kind in _BY_PROVIDER:
                target = ui_pb2.WebviewProviderType.Name(request.provider_type)
        return reply(self.rt.bus.publish(session, kind, _EMPTY, target=target))

    async def PublishPartialMessage(self, request: ui_pb2.ClineMessage,
                                    context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        session = await session_of(context)
        problem = check_cline_message(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        return reply(self.rt.bus.publish(session, topics.PARTIAL_MESSAGE, request, key=request.ts))

    async def SetTheme(self, request: host_pb2.TextEvent,
                       context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        """Cline sends the theme as a JSON document; anything else would break its webview."""
        session = await session_of(context)
        if len(request.text) > MAX_THEME_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"theme is {len(request.text)} characters; the limit is {MAX_THEME_CHARS}")
        try:
            json.loads(request.text)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"theme must be a JSON document: {exc}")
        await self.rt.store.put(session, topics.THEME_KEY, request.text)
        return reply(self.rt.bus.publish(session, topics.THEME, common_pb2.String(value=request.text)))

    async def PublishRelinquishControl(self, request: common_pb2.Empty,
                                       context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        session = await session_of(context)
        return reply(self.rt.bus.publish(session, topics.RELINQUISH_CONTROL, _EMPTY))

    async def PublishFocusChatInput(self, request: host_pb2.FocusChatInput,
                                    context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        session = await session_of(context)
        return reply(self.rt.bus.publish(session, topics.FOCUS_CHAT_INPUT, _EMPTY,
                                         target=request.client_id or None))

    async def PublishDidBecomeVisible(self, request: common_pb2.Empty,
                                      context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        session = await session_of(context)
        return reply(self.rt.bus.publish(session, topics.DID_BECOME_VISIBLE, _EMPTY))

    async def SetAnnouncement(self, request: host_pb2.AnnouncementState,
                              context: grpc.aio.ServicerContext) -> host_pb2.AnnouncementState:
        session = await session_of(context)
        state = await self.rt.store.get(session, topics.ANNOUNCEMENT_KEY) or {}
        state["latest"] = request.latest_announcement_id
        await self.rt.store.put(session, topics.ANNOUNCEMENT_KEY, state)
        return host_pb2.AnnouncementState(latest_announcement_id=state["latest"],
                                          last_shown_announcement_id=state.get("last_shown", ""))

    async def GetSessionState(self, request: common_pb2.Empty,
                              context: grpc.aio.ServicerContext) -> host_pb2.SessionState:
        session = await session_of(context)
        store = self.rt.store
        ann = await store.get(session, topics.ANNOUNCEMENT_KEY) or {}
        return host_pb2.SessionState(
            session=session, theme=await store.get(session, topics.THEME_KEY) or "",
            announcement=host_pb2.AnnouncementState(latest_announcement_id=ann.get("latest", ""),
                                                    last_shown_announcement_id=ann.get("last_shown", "")))

    async def SubscribeHostRequests(self, request: common_pb2.Empty,
                                    context: grpc.aio.ServicerContext) -> AsyncIterator[host_pb2.HostRequest]:
        session = await session_of(context)
        async for item in stream_topic(self.rt.bus, context, session, topics.HOST_REQUEST):
            yield item

    async def GetBusStats(self, request: common_pb2.Empty,
                          context: grpc.aio.ServicerContext) -> host_pb2.BusStats:
        bus = self.rt.bus
        kinds = [host_pb2.KindStats(kind=k, subscriptions=c.subscriptions, published=c.published,
                                    delivered=c.delivered, dropped=c.dropped, coalesced=c.coalesced)
                 for k, c in sorted(bus.counters.items())]
        return host_pb2.BusStats(kinds=kinds, subscriptions=bus.count())

"""uibus.v1.HostService: the sending side of the Cline UI streams (protos/uibus/v1/host.proto;
docs/protocols/cline.md).

An IDE extension or agent host publishes UI events here; webviews receive them through
cline.UiService. The feed validates before publishing, so a bad event never reaches a webview.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from uibus.domain.feed import UiFeed
from uibus.infra.bus import Bus
from uibus.infra.session import session_of, since_of
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2, host_pb2_grpc


def reply(n: int, bus: Bus) -> host_pb2.PublishReply:
    """What a publish reached; `bus.last_replicated` is read before any await (see Bus)."""
    return host_pb2.PublishReply(subscribers=n, replicated=bus.last_replicated)


class HostService(host_pb2_grpc.HostServiceServicer):
    def __init__(self, feed: UiFeed, bus: Bus) -> None:
        self.feed = feed
        self.bus = bus

    async def PublishAddToInput(self, request: host_pb2.TextEvent,
                                context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        return reply(self.feed.add_to_input(session_of(context), request.text), self.bus)

    async def PublishButtonClick(self, request: host_pb2.ButtonClick,
                                 context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        provider = request.provider_type if request.HasField("provider_type") else None
        return reply(self.feed.click(session_of(context), request.button, provider), self.bus)

    async def PublishPartialMessage(self, request: ui_pb2.ClineMessage,
                                    context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        session = session_of(context)
        if not self.feed.log.prepared(session):  # once per session and process: no await on every publish
            await self.feed.prepare(session)
        answer = reply(self.feed.publish_message(session, request), self.bus)
        if not request.partial:  # acknowledged is durable: a final state is in the log before its host has the reply,
            await self.feed.durable(session)  # so a UI resuming on another replica right after misses nothing
        return answer

    async def SetTheme(self, request: host_pb2.TextEvent,
                       context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        return reply(await self.feed.set_theme(session_of(context), request.text), self.bus)

    async def PublishRelinquishControl(self, request: common_pb2.Empty,
                                       context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        return reply(self.feed.relinquish_control(session_of(context)), self.bus)

    async def PublishFocusChatInput(self, request: host_pb2.FocusChatInput,
                                    context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        return reply(self.feed.focus_chat_input(session_of(context), request.client_id), self.bus)

    async def PublishDidBecomeVisible(self, request: common_pb2.Empty,
                                      context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        return reply(self.feed.did_become_visible(session_of(context)), self.bus)

    async def PublishShowWebview(self, request: ui_pb2.ShowWebviewEvent,
                                 context: grpc.aio.ServicerContext) -> host_pb2.PublishReply:
        return reply(self.feed.show_webview(session_of(context), request.preserve_editor_focus), self.bus)

    async def SetAnnouncement(self, request: host_pb2.AnnouncementState,
                              context: grpc.aio.ServicerContext) -> host_pb2.AnnouncementState:
        state = await self.feed.set_announcement(session_of(context), request.latest_announcement_id)
        return host_pb2.AnnouncementState(latest_announcement_id=state.latest,
                                          last_shown_announcement_id=state.last_shown)

    async def GetSessionState(self, request: common_pb2.Empty,
                              context: grpc.aio.ServicerContext) -> host_pb2.SessionState:
        session = session_of(context)
        ann = await self.feed.announcement(session)
        return host_pb2.SessionState(
            session=session, theme=await self.feed.theme(session) or "",
            announcement=host_pb2.AnnouncementState(latest_announcement_id=ann.latest,
                                                    last_shown_announcement_id=ann.last_shown),
            terminal_execution_mode=await self.feed.terminal_execution_mode(session))

    async def SubscribeHostRequests(self, request: common_pb2.Empty,
                                    context: grpc.aio.ServicerContext) -> AsyncIterator[host_pb2.HostRequest]:
        async for item in self.feed.host_requests(session_of(context), since_of(context)):
            yield item

    async def GetBusStats(self, request: common_pb2.Empty,
                          context: grpc.aio.ServicerContext) -> host_pb2.BusStats:
        bus = self.bus
        kinds = [host_pb2.KindStats(kind=k, subscriptions=c.subscriptions, published=c.published,
                                    delivered=c.delivered, dropped=c.dropped, coalesced=c.coalesced,
                                    overflowed=c.overflowed)
                 for k, c in sorted(bus.counters.items())]
        return host_pb2.BusStats(kinds=kinds, subscriptions=bus.count())


SERVICE = host_pb2.DESCRIPTOR.services_by_name["HostService"].full_name


def add_to(registry: Any, feed: UiFeed, bus: Bus) -> str:
    host_pb2_grpc.add_HostServiceServicer_to_server(HostService(feed, bus), registry)
    return SERVICE

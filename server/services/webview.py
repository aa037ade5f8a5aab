"""uibus.v1.WebviewService: every cline.UiService subscription of a webview over one stream.

Browsers keep at most six HTTP/1.1 connections per server and a gRPC-Web stream holds one, so the
webview page cannot open UiService's fourteen streams. This service reads the very same feed streams
UiService serves (the feed's one table, `UI_STREAMS`) and multiplexes their messages, so behaviour
(current theme first, provider-type filtering, targeted focus) cannot drift apart.

One difference, for a page opened (or reloaded) mid-conversation: its partial-message stream
starts with the session's recent messages (the feed's `replay`), read after the subscription is
registered so nothing is missed or sent twice; those and the current theme are marked `replayed`.
cline.UiService's subscribeToPartialMessage stays live only, as in Cline. A client that asks
(`mark_replay_end`) gets one `replay_complete` event once every stream has sent what it starts
with, so it knows the history is whole without waiting for quiet.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from uibus.bus import LIVE
from uibus.domain.feed import GAP, REPLAY_END, UI_STREAMS, Replayed, UiFeed, UiStream
from uibus.errors import InvalidArgument
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import webview_pb2, webview_pb2_grpc
from uibus.session import session_of, since_of
from uibus.tasks import cancel_all

_END = object()


def _event(source: str, message: Any) -> webview_pb2.WebviewEvent:
    if isinstance(message, Replayed):
        event = _event(source, message.item)
        event.replayed = True
        return event
    if isinstance(message, ui_pb2.ClineMessage):
        return webview_pb2.WebviewEvent(source=source, partial_message=message)
    if isinstance(message, ui_pb2.ShowWebviewEvent):
        return webview_pb2.WebviewEvent(source=source, show_webview=message)
    if isinstance(message, common_pb2.String):
        return webview_pb2.WebviewEvent(source=source, text=message.value)
    return webview_pb2.WebviewEvent(source=source, signal=common_pb2.Empty())


def _targets(request: webview_pb2.WebviewSubscribeRequest) -> list[tuple[UiStream, str]]:
    """Each UI stream with the target this webview subscribes it with (validated up front)."""
    as_request = {"provider": ui_pb2.WebviewProviderTypeRequest(provider_type=request.provider_type),
                  "client_id": common_pb2.StringRequest(value=request.client_id), "": None}
    return [(stream, stream.target_of(as_request[stream.target])) for stream in UI_STREAMS]


class WebviewService(webview_pb2_grpc.WebviewServiceServicer):
    def __init__(self, feed: UiFeed) -> None:
        self.feed = feed

    async def Subscribe(self, request: webview_pb2.WebviewSubscribeRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[webview_pb2.WebviewEvent]:
        session = session_of(context)
        since = since_of(context)
        if not request.client_id:
            raise InvalidArgument("client_id is required (it targets subscribeToFocusChatInput)")
        targets = _targets(request)
        # Small on purpose: the backlog of a slow webview stays in the bus mailboxes, which are
        # bounded in bytes (a stalled stream is ended there), not in a second queue here.
        queue: asyncio.Queue[Any] = asyncio.Queue(len(targets))

        async def pump(stream: UiStream, target: str) -> None:
            try:
                async with contextlib.aclosing(self.feed.events(session, stream, target, replay=True,
                                                                mark_end=True, since=since)) as events:
                    async for message in events:
                        if message is GAP:
                            await queue.put(webview_pb2.WebviewEvent(source=stream.rpc, gap=True))
                            continue
                        plain = message is LIVE or message is REPLAY_END
                        await queue.put(message if plain else _event(stream.rpc, message))
            except asyncio.CancelledError:  # the call ended
                raise
            except Exception as exc:  # a failure of one stream ends the whole call, with its status
                await queue.put(exc)
                return
            await queue.put(_END)

        tasks = [asyncio.ensure_future(pump(stream, target)) for stream, target in targets]
        try:
            running = len(tasks)
            waiting = len(tasks)  # streams not yet subscribed; the call is live when all are
            early: list[Any] = []  # what came before that (the current theme), sent after the headers
            replaying = len(tasks)  # streams still sending what they start with
            while running:
                item = await queue.get()
                if item is REPLAY_END:
                    # A stream's REPLAY_END follows its LIVE in the queue, so when the last one comes
                    # every stream is live and `early` has been sent: the marker comes after all of it.
                    replaying -= 1
                    if not replaying and request.mark_replay_end:
                        yield webview_pb2.WebviewEvent(replay_complete=True)
                elif item is LIVE:
                    waiting -= 1
                    if not waiting:
                        yield LIVE
                        for message in early:
                            yield message
                        early.clear()
                elif item is _END:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                elif waiting:
                    early.append(item)
                else:
                    yield item
        finally:
            await cancel_all(tasks)


SERVICE = webview_pb2.DESCRIPTOR.services_by_name["WebviewService"].full_name


def add_to(registry: Any, feed: UiFeed) -> str:
    webview_pb2_grpc.add_WebviewServiceServicer_to_server(WebviewService(feed), registry)
    return SERVICE

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

On request it carries two more feeds beside them, so a page open in several tabs holds one
connection per tab instead of one per kind: the session's extension-UI events (`extension_ui`,
the domain's `Dialogs.events`, as ExtensionUiService/Subscribe) and the sessions listing
(`sessions`, the domain's `Sessions.watch_held`, as SessionService/WatchSessions: the sessions the
call's token may see, held against its tenant's `watches` quota). Each is one more pump into the
same queue; the cursor (`x-uibus-since`) resumes the extension-UI events too, because they are
stamped in the same session log as the partial messages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc

from uibus.domain.dialogs import Dialogs
from uibus.domain.feed import GAP, REPLAY_END, UI_STREAMS, Replayed, UiFeed, UiStream
from uibus.domain.sessions import Sessions
from uibus.infra.bus import LIVE
from uibus.infra.errors import InvalidArgument, Unimplemented
from uibus.infra.quotas import ANONYMOUS, Quotas
from uibus.infra.session import session_of, since_of
from uibus.infra.tasks import cancel_all
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import webview_pb2, webview_pb2_grpc

_END = object()
EXTENSION_UI, SESSIONS = "extension_ui", "sessions"  # the `source` of the opt-in feeds' events
Visible = Callable[[Any], Callable[[str], bool]]  # call metadata -> which sessions it may see


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


async def _extension_ui(dialogs: Dialogs, session: str, since: int | None) -> AsyncGenerator[Any, None]:
    async with contextlib.aclosing(dialogs.events(session, since, mark_end=True)) as events:
        async for event in events:
            plain = event is LIVE or event is REPLAY_END
            yield event if plain else webview_pb2.WebviewEvent(source=EXTENSION_UI, extension_ui=event)


async def _listing(watch: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    """The listing has no subscription to wait for: it is live once its first list is made (the
    `watches` quota held, so a refusal comes before the headers), which is all it starts with."""
    async with contextlib.aclosing(watch) as listings:
        first = await anext(listings)
        yield LIVE
        yield webview_pb2.WebviewEvent(source=SESSIONS, sessions=first)
        yield REPLAY_END
        async for listed in listings:
            yield webview_pb2.WebviewEvent(source=SESSIONS, sessions=listed)


class WebviewService(webview_pb2_grpc.WebviewServiceServicer):
    def __init__(self, feed: UiFeed, dialogs: Dialogs | None = None, sessions: Sessions | None = None,
                 visible_of: Visible | None = None, tenant_of: Callable[[Any], str] | None = None,
                 quotas: Quotas | None = None) -> None:
        """`dialogs`, `sessions`: the domain feeds of the opt-in `extension_ui` and `sessions`;
        `visible_of`, `tenant_of`, `quotas`: the scoping SessionService's watch gets (the
        pipeline's), so the listing here shows no more than there."""
        self.feed = feed
        self.dialogs = dialogs
        self.sessions = sessions
        self.visible_of = visible_of
        self.tenant_of = tenant_of or (lambda _metadata: ANONYMOUS)
        self.quotas = quotas if quotas is not None else Quotas()

    def _sources(self, request: webview_pb2.WebviewSubscribeRequest, context: grpc.aio.ServicerContext,
                 session: str, since: int | None) -> list[AsyncGenerator[Any, None]]:
        """Every feed this call follows, each yielding LIVE once subscribed, REPLAY_END once it has
        sent what it starts with, then its live events (already WebviewEvents, or GAP)."""
        sources: list[AsyncGenerator[Any, None]] = [
            self._ui(session, stream, target, since) for stream, target in _targets(request)]
        if request.extension_ui:
            if self.dialogs is None:
                raise Unimplemented("this server has no extension UI to carry (extension_ui)")
            sources.append(_extension_ui(self.dialogs, session, since))
        if request.sessions:
            if self.sessions is None or self.visible_of is None:
                raise Unimplemented("this server has no sessions listing to carry (sessions)")
            metadata = context.invocation_metadata()
            visible, tenant = self.visible_of(metadata), self.tenant_of(metadata)
            sources.append(_listing(self.sessions.watch_held(visible, self.quotas, tenant)))
        return sources

    async def _ui(self, session: str, stream: UiStream, target: str,
                  since: int | None) -> AsyncGenerator[Any, None]:
        async with contextlib.aclosing(self.feed.events(session, stream, target, replay=True, mark_end=True,
                                                        since=since)) as events:
            async for message in events:
                if message is GAP:
                    yield webview_pb2.WebviewEvent(source=stream.rpc, gap=True)
                else:
                    yield message if message is LIVE or message is REPLAY_END else _event(stream.rpc, message)

    async def Subscribe(self, request: webview_pb2.WebviewSubscribeRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[webview_pb2.WebviewEvent]:
        session = session_of(context)
        since = since_of(context)
        if not request.client_id:
            raise InvalidArgument("client_id is required (it targets subscribeToFocusChatInput)")
        sources = self._sources(request, context, session, since)
        # Small on purpose: the backlog of a slow webview stays in the bus mailboxes, which are
        # bounded in bytes (a stalled stream is ended there), not in a second queue here.
        queue: asyncio.Queue[Any] = asyncio.Queue(len(sources))

        async def pump(source: AsyncGenerator[Any, None]) -> None:
            try:
                async with contextlib.aclosing(source) as items:
                    async for item in items:
                        await queue.put(item)
            except asyncio.CancelledError:  # the call ended
                raise
            except Exception as exc:  # a failure of one stream ends the whole call, with its status
                await queue.put(exc)
                return
            await queue.put(_END)

        tasks = [asyncio.ensure_future(pump(source)) for source in sources]
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


def add_to(registry: Any, feed: UiFeed, dialogs: Dialogs | None = None, sessions: Sessions | None = None,
           visible_of: Visible | None = None, tenant_of: Callable[[Any], str] | None = None,
           quotas: Quotas | None = None) -> str:
    servicer = WebviewService(feed, dialogs, sessions, visible_of, tenant_of, quotas)
    webview_pb2_grpc.add_WebviewServiceServicer_to_server(servicer, registry)
    return SERVICE

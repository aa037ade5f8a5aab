"""uibus.v1.WebviewService over native gRPC: one stream carrying every UiService subscription."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.conftest import wait_for
from tests.redisproc import RedisProcess, redis_server
from tests.test_sessions_api import auth, tenants
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.domain.feed import UI_STREAMS
from uibus.infra.bus import LIVE
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc as ext_grpc
from uibus.pb.uibus.v1 import host_pb2, sessions_pb2, sessions_pb2_grpc, webview_pb2, webview_pb2_grpc

STREAMS = len(UI_STREAMS)  # every UiService stream, multiplexed
__all__ = ["redis_server", "tenants"]  # the fixtures, imported to be used here


async def test_one_stream_carries_every_ui_event(app, connect) -> None:
    conn = connect(session="wv")
    await conn.host.SetTheme(host_pb2.TextEvent(text='{"name": "t"}'))
    stub = webview_pb2_grpc.WebviewServiceStub(conn.channel)
    call = stub.Subscribe(webview_pb2.WebviewSubscribeRequest(client_id="c1", provider_type=ui_pb2.TAB),
                          metadata=(("x-uibus-session", "wv"),))
    first = await asyncio.wait_for(call.read(), 2)
    assert (first.source, first.text) == ("subscribeToTheme", '{"name": "t"}')  # current theme first
    await wait_for(lambda: app.bus.count(session="wv") == STREAMS, what="all UiService subscriptions")

    host = conn.host
    await host.PublishPartialMessage(ui_pb2.ClineMessage(ts=7, type=ui_pb2.SAY, text="hi", partial=True))
    await host.PublishAddToInput(host_pb2.TextEvent(text="added"))
    await host.PublishButtonClick(host_pb2.ButtonClick(button=host_pb2.BUTTON_SETTINGS, provider_type=ui_pb2.TAB))
    await host.PublishButtonClick(host_pb2.ButtonClick(button=host_pb2.BUTTON_SETTINGS,
                                                       provider_type=ui_pb2.SIDEBAR))  # not for a TAB webview
    await host.PublishFocusChatInput(host_pb2.FocusChatInput(client_id="other"))  # not for c1
    await host.PublishFocusChatInput(host_pb2.FocusChatInput(client_id="c1"))
    await host.PublishRelinquishControl(common_pb2.Empty())
    await host.PublishButtonClick(host_pb2.ButtonClick(button=host_pb2.BUTTON_WORKTREES))
    await host.PublishShowWebview(ui_pb2.ShowWebviewEvent(preserve_editor_focus=True))
    got = [await asyncio.wait_for(call.read(), 2) for _ in range(7)]
    assert [g.source for g in got] == ["subscribeToPartialMessage", "subscribeToAddToInput",
                                       "subscribeToSettingsButtonClicked", "subscribeToFocusChatInput",
                                       "subscribeToRelinquishControl", "subscribeToWorktreesButtonClicked",
                                       "subscribeToShowWebview"]
    assert got[0].partial_message.text == "hi" and got[1].text == "added" and got[2].HasField("signal")
    assert got[6].show_webview.preserve_editor_focus
    call.cancel()
    await wait_for(lambda: app.bus.count() == 0, what="every inner subscription removed")


async def test_client_id_required(connect) -> None:
    stub = webview_pb2_grpc.WebviewServiceStub(connect().channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Subscribe(webview_pb2.WebviewSubscribeRequest()).read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "client_id" in err.value.details()


def _subscribe(conn: Connection, session: str, client_id: str = "c1", provider_type: int = ui_pb2.SIDEBAR) -> Any:
    stub = webview_pb2_grpc.WebviewServiceStub(conn.channel)
    return stub.Subscribe(webview_pb2.WebviewSubscribeRequest(client_id=client_id, provider_type=provider_type),
                          metadata=(("x-uibus-session", session),))


def _say(ts: int, text: str, partial: bool = False) -> ui_pb2.ClineMessage:
    return ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=ui_pb2.TEXT, text=text, partial=partial)


async def test_stream_starts_with_the_recent_messages_then_live(app, connect) -> None:
    """What was published before the webview subscribed comes first (marked replayed, oldest ts
    first, each message in its latest state), then live events; nothing twice."""
    session = "replay"
    host = connect(session=session).host
    await host.PublishPartialMessage(_say(20, "second", partial=False))
    await host.PublishPartialMessage(_say(10, "fir", partial=True))
    await host.PublishPartialMessage(_say(10, "first", partial=False))  # replaces its earlier state
    call = _subscribe(connect(session=session), session)
    got = [await asyncio.wait_for(call.read(), 2) for _ in range(2)]
    assert [(g.partial_message.ts, g.partial_message.text, g.replayed) for g in got] == [
        (10, "first", True), (20, "second", True)]
    await wait_for(lambda: app.bus.count(session=session) == STREAMS, what="all UiService subscriptions")

    await host.PublishPartialMessage(_say(30, "live"))
    await host.PublishPartialMessage(_say(10, "first, edited"))
    got = [await asyncio.wait_for(call.read(), 2) for _ in range(2)]
    assert [(g.partial_message.ts, g.partial_message.text, g.replayed) for g in got] == [
        (30, "live", False), (10, "first, edited", False)]
    with pytest.raises(asyncio.TimeoutError):  # nothing else: no message arrives twice
        await asyncio.wait_for(call.read(), 0.3)
    call.cancel()

    again = _subscribe(connect(session=session), session, client_id="c2")  # a reload sees the newest states
    got = [await asyncio.wait_for(again.read(), 2) for _ in range(3)]
    assert [(g.partial_message.ts, g.partial_message.text) for g in got] == [
        (10, "first, edited"), (20, "second"), (30, "live")]
    again.cancel()


async def test_messages_published_while_subscribing_are_sent_once(app, connect) -> None:
    """A publisher racing the subscription: every message arrives, in its final state, exactly
    once (replayed or live), whatever the interleaving."""
    session = "race"
    host = connect(session=session).host
    done = asyncio.Event()

    async def publish() -> None:
        for ts in range(1, 41):
            await host.PublishPartialMessage(_say(ts, f"m{ts}"))
        done.set()

    publisher = asyncio.ensure_future(publish())
    await asyncio.sleep(0.01)
    call = _subscribe(connect(session=session), session)
    await done.wait()
    await publisher
    seen: list[int] = []
    while len(set(seen)) < 40:
        event = await asyncio.wait_for(call.read(), 2)
        seen.append(event.partial_message.ts)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(call.read(), 0.3)
    assert sorted(seen) == list(range(1, 41)), seen  # none twice, none missing
    call.cancel()


async def test_recent_messages_are_a_view_of_the_log(app, connect) -> None:
    """The session log keeps the latest state of each message (one entry per ts, the newest seq);
    the recent messages a webview starts with are its newest 200, read from the store alone after
    a flush (a fresh SessionLog over the same store has nothing in memory)."""
    from uibus.domain.recent import MAX_RECENT, RecentMessages
    from uibus.domain.session_log import MESSAGE, SessionLog

    session = "bound"
    host = connect(session=session).host
    for ts in range(1, 251):
        await host.PublishPartialMessage(_say(ts, f"m{ts}-partial", partial=True))
    await host.PublishPartialMessage(_say(250, "m250 final"))
    await app.core.feed.recent.flush()
    rows = (await app.store.log_read(session, kind=MESSAGE)).entries
    assert [int(e.key) for e in rows] == list(range(1, 251))  # coalesced: one entry per message
    assert [e.seq for e in rows] == sorted({e.seq for e in rows}) and len({e.epoch for e in rows}) == 1
    stored = await RecentMessages(SessionLog(app.store)).read(session)
    assert list(stored) == list(range(51, 251))  # the newest 200
    assert stored[250].text == "m250 final" and not stored[250].partial and stored[250].seq == rows[-1].seq
    assert stored[249].text == "m249-partial" and stored[249].partial

    call = _subscribe(connect(session=session), session)
    got = [await asyncio.wait_for(call.read(), 2) for _ in range(MAX_RECENT)]
    assert [g.partial_message.ts for g in got] == list(range(51, 251)) and all(g.replayed for g in got)
    assert got[-1].partial_message.text == "m250 final"
    call.cancel()


async def test_ui_service_does_not_replay(app, connect) -> None:
    """cline.UiService/subscribeToPartialMessage stays live only, as in Cline."""
    from tests.conftest import Reader

    session = "cline"
    conn = connect(session=session)
    await conn.host.PublishPartialMessage(_say(1, "before"))
    reader = Reader(conn.ui.subscribeToPartialMessage(common_pb2.EmptyRequest()))
    await wait_for(lambda: app.bus.count(session=session) == 1, what="subscribed")
    await conn.host.PublishPartialMessage(_say(2, "after"))
    assert (await reader.next()).text == "after"
    reader.cancel()


async def test_published_between_subscribing_and_reading_is_replayed_once(app) -> None:
    """The window the gRPC tests can only race: messages published after the subscription is
    registered (LIVE) but before the stored ones are read are queued in the mailbox and also noted;
    they are replayed once, in their latest state, and not sent again live."""
    from uibus.domain.feed import UI_STREAMS, Replayed

    feed = app.core.feed
    stream = next(s for s in UI_STREAMS if s.rpc == "subscribeToPartialMessage")
    events = feed.events("window", stream, replay=True)
    try:
        assert await anext(events) is LIVE
        feed.publish_message("window", _say(2, "b"))
        feed.publish_message("window", _say(1, "a", partial=True))
        feed.publish_message("window", _say(1, "a!"))
        got = [await anext(events) for _ in range(2)]
        assert all(isinstance(g, Replayed) for g in got)
        assert [(g.item.ts, g.item.text) for g in got] == [(1, "a!"), (2, "b")]
        feed.publish_message("window", _say(3, "c"))
        live = await asyncio.wait_for(anext(events), 1)
        assert not isinstance(live, Replayed) and live.ts == 3  # nothing of the window came again
    finally:
        await events.aclose()


async def test_recent_messages_are_written_without_being_asked(app, connect) -> None:
    """Write-behind: a burst of states is written at once, then at most every LOG_WRITE_S, and
    the latest state of each message reaches the store on its own (no flush)."""
    from uibus.domain.recent import RecentMessages
    from uibus.domain.session_log import LOG_WRITE_S, SessionLog

    session = "behind"
    host = connect(session=session).host
    for i in range(30):
        await host.PublishPartialMessage(_say(5, "x" * (i + 1), partial=i < 29))
    await host.PublishPartialMessage(_say(6, "still growing", partial=True))
    from_store = RecentMessages(SessionLog(app.store))
    deadline = asyncio.get_running_loop().time() + 4 * LOG_WRITE_S + 1
    while True:
        stored = await from_store.read(session)
        if stored.get(5) is not None and stored[5].text == "x" * 30 and 6 in stored:
            break
        assert asyncio.get_running_loop().time() < deadline, stored
        await asyncio.sleep(0.02)
    assert not stored[5].partial and stored[6].partial


async def test_a_webview_on_another_replica_starts_with_the_recent_messages(redis_server: RedisProcess,
                                                                            tmp_path: Path) -> None:
    """With Redis, the recent messages are in the shared store: a webview subscribing on replica B
    starts with what was published on replica A, then gets A's live messages once."""
    from tests.conftest import start_app
    from uibus.infra.config import Config

    apps = [await start_app(Config(host="127.0.0.1", port=0, http_port=0, store=str(tmp_path / f"{name}.db"),
                                   redis_url=redis_server.url, grace_seconds=1.0)) for name in ("a", "b")]
    conns: list[Connection] = []
    try:
        a, b = apps
        await wait_for(lambda: all(getattr(app.bus, "connected", False) for app in apps), what="both on redis")
        conns.append(Connection(f"127.0.0.1:{a.port}", session="shared"))
        conns.append(Connection(f"127.0.0.1:{b.port}", session="shared"))
        await conns[0].host.PublishPartialMessage(_say(1, "done on a"))
        await conns[0].host.PublishPartialMessage(_say(2, "growing on a", partial=True))
        await a.core.feed.recent.flush()  # B reads the store, not A's memory
        call = _subscribe(conns[1], "shared")
        got = [await asyncio.wait_for(call.read(), 2) for _ in range(2)]
        assert [(g.partial_message.text, g.replayed) for g in got] == [("done on a", True), ("growing on a", True)]
        await wait_for(lambda: b.bus.count(session="shared") == STREAMS, what="B's webview subscribed")
        await conns[0].host.PublishPartialMessage(_say(2, "finished on a"))
        live = await asyncio.wait_for(call.read(), 2)
        assert (live.partial_message.text, live.replayed) == ("finished on a", False)
        call.cancel()
    finally:
        for conn in conns:
            await conn.close()
        for app in apps:
            await app.aclose(grace=0.5)


async def test_replay_complete_marker_follows_the_whole_replay_when_asked(app, connect) -> None:
    """With `mark_replay_end` the stream sends one `replay_complete` event (no source, no payload)
    after the theme and every recent message, and what follows it is live; without it (the tests
    above) no such event is sent."""
    session = "marked"
    conn = connect(session=session)
    await conn.host.SetTheme(host_pb2.TextEvent(text='{"name": "m"}'))
    for ts in range(1, 121):
        await conn.host.PublishPartialMessage(_say(ts, f"m{ts}"))
    stub = webview_pb2_grpc.WebviewServiceStub(conn.channel)
    call = stub.Subscribe(webview_pb2.WebviewSubscribeRequest(client_id="c1", mark_replay_end=True),
                          metadata=(("x-uibus-session", session),))
    got = [await asyncio.wait_for(call.read(), 2) for _ in range(122)]
    assert all(g.replayed for g in got[:121])
    assert [g.text for g in got[:121] if g.source == "subscribeToTheme"] == ['{"name": "m"}']
    assert [g.partial_message.ts for g in got[:121] if g.HasField("partial_message")] == list(range(1, 121))
    marker = got[121]
    assert marker.replay_complete and not marker.replayed and marker.source == "" and marker.WhichOneof("event") is None
    await conn.host.PublishPartialMessage(_say(121, "right after"))
    live = await asyncio.wait_for(call.read(), 2)
    assert (live.partial_message.text, live.replayed, live.replay_complete) == ("right after", False, False)
    with pytest.raises(asyncio.TimeoutError):  # the marker is sent once
        await asyncio.wait_for(call.read(), 0.3)
    call.cancel()

    plain = _subscribe(connect(session=session), session, client_id="c2")
    got = [await asyncio.wait_for(plain.read(), 2) for _ in range(122)]
    assert not any(g.replay_complete for g in got) and max(g.partial_message.ts for g in got) == 121
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(plain.read(), 0.3)
    plain.cancel()
    await wait_for(lambda: app.bus.count(session=session) == 0, what="every inner subscription removed")


async def _until(call: Any, found: Any, timeout: float = 3) -> list[webview_pb2.WebviewEvent]:
    """Every event read up to and including the first for which `found` is true."""
    got: list[webview_pb2.WebviewEvent] = []
    while not got or not found(got[-1]):
        got.append(await asyncio.wait_for(call.read(), timeout))
    return got


async def _create(api: Any, token: str, session: str) -> None:
    await api.CreateSession(sessions_pb2.CreateSessionRequest(), metadata=auth(token, session))


async def test_the_page_follows_dialogs_and_the_listing_over_the_one_stream(tenants: App) -> None:
    """With `extension_ui` and `sessions` the one stream also carries the session's dialogs (answered
    with Respond, they reach the agent that asked) and the sessions listing, scoped by the call's
    token exactly as SessionService's watch: team a's page never lists team b's sessions."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tenants.port}") as ch:
        api = sessions_pb2_grpc.SessionServiceStub(ch)
        await _create(api, "team-a-token", "team-a-2")
        await _create(api, "team-b-token", "team-b-1")
        md = auth("team-a-token", "team-a-1")
        call = webview_pb2_grpc.WebviewServiceStub(ch).Subscribe(webview_pb2.WebviewSubscribeRequest(
            client_id="c1", extension_ui=True, sessions=True, mark_replay_end=True), metadata=md)
        start = await _until(call, lambda e: e.replay_complete)
        listings = [e.sessions for e in start if e.HasField("sessions")]
        assert [e.source for e in start if e.HasField("sessions")] == ["sessions"]
        assert [s.session for s in listings[0].sessions] == ["team-a-2"]  # team b's is not there
        watch = api.WatchSessions(sessions_pb2.ListSessionsRequest(), metadata=md)
        assert await watch.read() == listings[0]  # the same listing SessionService's watch sends
        watch.cancel()

        agent = ext_grpc.ExtensionUiServiceStub(ch)
        asking = asyncio.ensure_future(agent.Confirm(ext_pb2.ConfirmRequest(title="Deploy?"), metadata=md))
        got = await _until(call, lambda e: e.HasField("extension_ui") and e.extension_ui.HasField("request"))
        asked = got[-1]
        assert asked.source == "extension_ui" and asked.extension_ui.request.confirm.title == "Deploy?"
        assert asked.extension_ui.seq > 0
        # the listing follows: team-a-1 now has a dialog waiting
        await _until(call, lambda e: any(s.session == "team-a-1" and s.waiting_dialogs == 1
                                         for s in e.sessions.sessions))
        await agent.Respond(ext_pb2.RespondRequest(id=asked.extension_ui.request.id, confirmed=True), metadata=md)
        assert (await asyncio.wait_for(asking, 3)).confirmed
        await _until(call, lambda e: e.extension_ui.closed.id == asked.extension_ui.request.id)
        await _create(api, "team-b-token", "team-b-2")
        await _create(api, "team-a-token", "team-a-3")
        later = await _until(call, lambda e: any(s.session == "team-a-3" for s in e.sessions.sessions))
        assert not any(s.session.startswith("team-b") for e in later for s in e.sessions.sessions)
        team_a = tenants.tokens.grant(b"team-a-token").tenant  # type: ignore[union-attr]
        assert tenants.quotas.in_use("watches", team_a) == 1  # the listing counts as a watch
        call.cancel()
    await wait_for(lambda: tenants.bus.count() == 0, what="every inner subscription removed")
    await wait_for(lambda: tenants.quotas.in_use("watches", team_a) == 0, what="the watch released")


async def test_one_cursor_resumes_the_messages_and_the_extension_ui(app, connect) -> None:
    """Partial messages and extension-UI events are stamped in the one session log, so the highest
    seq a page saw resumes both: it gets exactly what came after, in one stream, no snapshot."""
    session = "one-cursor"
    conn = connect(session=session)
    md = (("x-uibus-session", session),)
    agent = ext_grpc.ExtensionUiServiceStub(conn.channel)
    await conn.host.PublishPartialMessage(_say(1, "before"))
    await agent.SetStatus(ext_pb2.SetStatusRequest(key="k", text="old"), metadata=md)
    request = webview_pb2.WebviewSubscribeRequest(client_id="c1", extension_ui=True, mark_replay_end=True)
    stub = webview_pb2_grpc.WebviewServiceStub(conn.channel)
    call = stub.Subscribe(request, metadata=md)
    start = await _until(call, lambda e: e.replay_complete)
    assert [e.partial_message.text for e in start if e.HasField("partial_message")] == ["before"]
    assert [e.extension_ui.request.set_status.text for e in start if e.HasField("extension_ui")] == ["old"]
    cursor = max(max(e.partial_message.seq, e.extension_ui.seq) for e in start)
    call.cancel()

    await agent.SetStatus(ext_pb2.SetStatusRequest(key="k", text="new"), metadata=md)  # while away
    await conn.host.PublishPartialMessage(_say(2, "while away"))
    await agent.Notify(ext_pb2.NotifyRequest(message="hello"), metadata=md)
    again = stub.Subscribe(request, metadata=(*md, ("x-uibus-since", str(cursor))))
    got = await _until(again, lambda e: e.replay_complete)
    assert not any(e.gap or e.extension_ui.gap for e in got)
    assert [e.partial_message.text for e in got if e.HasField("partial_message")] == ["while away"]
    ext = [e.extension_ui for e in got if e.HasField("extension_ui")]
    assert [e.request.WhichOneof("method") for e in ext] == ["set_status", "notify"]
    assert ext[0].request.set_status.text == "new" and all(e.seq > cursor for e in ext)
    again.cancel()
    await wait_for(lambda: app.bus.count(session=session) == 0, what="every inner subscription removed")

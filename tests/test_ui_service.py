"""Every cline.UiService RPC over a real loopback channel, fed by the host API."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.conftest import Reader, next_message, wait_for
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2

EMPTY_REQ = common_pb2.EmptyRequest()
SIDEBAR, TAB = ui_pb2.SIDEBAR, ui_pb2.TAB


async def subscribed(app, stream, kind: str, session: str = "default", n: int = 1):
    """Waits until the server has registered `n` subscriptions of `kind` in `session`."""
    stream = Reader(stream) if stream is not None else None
    await wait_for(lambda: app.bus.count(kind, session) >= n, what=f"{n} {kind} subscription(s)")
    return stream


async def assert_quiet(stream, sentinel_publish, sentinel) -> None:
    """Proves nothing else is queued: the very next event is the sentinel we publish now."""
    await sentinel_publish()
    assert await next_message(stream) == sentinel


def msg(ts: int, text: str, partial: bool = True) -> ui_pb2.ClineMessage:
    return ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=ui_pb2.TEXT, text=text, partial=partial)


async def test_scroll_to_settings_replies_and_tells_the_host(app, connect):
    conn = connect()
    host_stream = await subscribed(app, conn.host.SubscribeHostRequests(common_pb2.Empty()), "host_request")
    reply = await conn.ui.scrollToSettings(common_pb2.StringRequest(value="browser"))
    assert (reply.key, reply.value) == ("scrollToSettings", "browser")
    req = await next_message(host_stream)
    assert req.WhichOneof("request") == "scroll_to_settings"
    assert req.scroll_to_settings.section == "browser" and req.id and req.ts > 0


async def test_on_did_show_announcement_marks_latest_shown(connect):
    conn = connect("s-ann")
    await conn.host.SetAnnouncement(host_pb2.AnnouncementState(latest_announcement_id="v3.2"))
    before = await conn.host.GetSessionState(common_pb2.Empty())
    assert before.announcement.last_shown_announcement_id == ""
    assert (await conn.ui.onDidShowAnnouncement(EMPTY_REQ)).value is False
    after = await conn.host.GetSessionState(common_pb2.Empty())
    assert after.announcement.latest_announcement_id == "v3.2"
    assert after.announcement.last_shown_announcement_id == "v3.2"
    other = await connect("s-other").host.GetSessionState(common_pb2.Empty())
    assert other.announcement.last_shown_announcement_id == ""


async def test_add_to_input_in_order_and_nothing_else(app, connect):
    conn = connect()
    stream = await subscribed(app, conn.ui.subscribeToAddToInput(EMPTY_REQ), "add_to_input")
    texts = [f"line {i}" for i in range(20)]
    for t in texts:
        reply = await conn.host.PublishAddToInput(host_pb2.TextEvent(text=t))
        assert (reply.subscribers, reply.replicated) == (1, False)  # one process: nothing to replicate
    assert [(await next_message(stream)).value for _ in texts] == texts
    await assert_quiet(stream, lambda: conn.host.PublishAddToInput(host_pb2.TextEvent(text="end")),
                       common_pb2.String(value="end"))


@pytest.mark.parametrize("rpc,button", [
    ("subscribeToMcpButtonClicked", host_pb2.BUTTON_MCP),
    ("subscribeToHistoryButtonClicked", host_pb2.BUTTON_HISTORY),
    ("subscribeToSettingsButtonClicked", host_pb2.BUTTON_SETTINGS),
])
async def test_provider_type_filtering(app, connect, rpc, button):
    """Untyped clicks reach every webview; typed clicks only webviews of that type; unset = SIDEBAR."""
    conn = connect()
    kind = {host_pb2.BUTTON_MCP: "mcp_button", host_pb2.BUTTON_HISTORY: "history_button",
            host_pb2.BUTTON_SETTINGS: "settings_button"}[button]
    sidebar = Reader(getattr(conn.ui, rpc)(ui_pb2.WebviewProviderTypeRequest()))  # unset -> SIDEBAR
    tab1 = Reader(getattr(conn.ui, rpc)(ui_pb2.WebviewProviderTypeRequest(provider_type=TAB)))
    tab2 = Reader(getattr(conn.ui, rpc)(ui_pb2.WebviewProviderTypeRequest(provider_type=TAB)))
    await subscribed(app, None, kind, n=3)

    async def click(provider=None):
        req = host_pb2.ButtonClick(button=button)
        if provider is not None:
            req.provider_type = provider
        return (await conn.host.PublishButtonClick(req)).subscribers

    assert await click() == 3
    assert await click(TAB) == 2
    assert await click(SIDEBAR) == 1
    for _ in range(2):
        await next_message(sidebar)
    for tab in (tab1, tab2):
        for _ in range(2):
            await next_message(tab)
    # Exactly two events each: a fresh SIDEBAR click reaches only the sidebar, and is its next event.
    assert await click(SIDEBAR) == 1
    await next_message(sidebar)
    assert await click(TAB) == 2
    await next_message(tab1)
    await next_message(tab2)
    with pytest.raises(asyncio.TimeoutError):
        await next_message(sidebar, timeout=0.2)


@pytest.mark.parametrize("rpc,kind,publish", [
    ("subscribeToChatButtonClicked", "chat_button",
     lambda h: h.PublishButtonClick(host_pb2.ButtonClick(button=host_pb2.BUTTON_CHAT))),
    ("subscribeToAccountButtonClicked", "account_button",
     lambda h: h.PublishButtonClick(host_pb2.ButtonClick(button=host_pb2.BUTTON_ACCOUNT))),
    ("subscribeToRelinquishControl", "relinquish_control", lambda h: h.PublishRelinquishControl(common_pb2.Empty())),
    ("subscribeToDidBecomeVisible", "did_become_visible", lambda h: h.PublishDidBecomeVisible(common_pb2.Empty())),
])
async def test_empty_event_streams(app, connect, rpc, kind, publish):
    conn, other = connect("s1"), connect("s2")
    stream = await subscribed(app, getattr(conn.ui, rpc)(EMPTY_REQ), kind, "s1")
    elsewhere = await subscribed(app, getattr(other.ui, rpc)(EMPTY_REQ), kind, "s2")
    for _ in range(3):
        assert (await publish(conn.host)).subscribers == 1
    for _ in range(3):
        assert await next_message(stream) == common_pb2.Empty()
    with pytest.raises(asyncio.TimeoutError):  # nothing crossed into session s2
        await next_message(elsewhere, timeout=0.2)


async def test_partial_messages_in_order_per_session(app, connect):
    a, b = connect("sa"), connect("sb")
    sa = await subscribed(app, a.ui.subscribeToPartialMessage(EMPTY_REQ), "partial_message", "sa")
    sb = await subscribed(app, b.ui.subscribeToPartialMessage(EMPTY_REQ), "partial_message", "sb")
    updates = [msg(1000, "Hel"), msg(1000, "Hello"), msg(1000, "Hello world", partial=False), msg(1001, "next")]
    for m in updates:
        await a.host.PublishPartialMessage(m)
    await b.host.PublishPartialMessage(msg(5, "only b"))
    got = [await next_message(sa) for _ in updates]
    seqs = [m.seq for m in got]
    assert seqs == sorted(set(seqs)) and seqs[0] > 0 and {m.epoch for m in got} == {seqs[0]}  # stamped
    for m in got:
        m.ClearField("seq")
        m.ClearField("epoch")
    assert got == updates
    only_b = await next_message(sb)
    assert only_b.seq > 0 and only_b.epoch == only_b.seq  # its own session, its own conversation
    only_b.ClearField("seq")
    only_b.ClearField("epoch")
    assert only_b == msg(5, "only b")
    await a.host.PublishPartialMessage(msg(2000, "end"))
    end = await next_message(sa)
    assert (end.ts, end.text, end.seq > seqs[-1], end.epoch) == (2000, "end", True, seqs[0])


async def test_theme_current_value_first_then_changes(app, connect):
    conn = connect("themed")
    await conn.host.SetTheme(host_pb2.TextEvent(text='{"kind":"dark"}'))
    stream = Reader(conn.ui.subscribeToTheme(EMPTY_REQ))
    assert (await next_message(stream)).value == '{"kind":"dark"}'
    await subscribed(app, None, "theme", "themed")
    await conn.host.SetTheme(host_pb2.TextEvent(text='{"kind":"light"}'))
    assert (await next_message(stream)).value == '{"kind":"light"}'
    fresh = Reader(connect("unthemed").ui.subscribeToTheme(EMPTY_REQ))  # no theme yet: nothing is invented
    with pytest.raises(asyncio.TimeoutError):
        await next_message(fresh, timeout=0.2)


async def test_initialize_webview_tells_host_and_replays_theme(app, connect):
    conn = connect()
    await conn.host.SetTheme(host_pb2.TextEvent(text='{"kind":"hc"}'))
    theme = Reader(conn.ui.subscribeToTheme(EMPTY_REQ))
    assert (await next_message(theme)).value == '{"kind":"hc"}'
    host_stream = await subscribed(app, conn.host.SubscribeHostRequests(common_pb2.Empty()), "host_request")
    await subscribed(app, None, "theme")
    assert await conn.ui.initializeWebview(EMPTY_REQ) == common_pb2.Empty()
    assert (await next_message(host_stream)).WhichOneof("request") == "webview_initialized"
    assert (await next_message(theme)).value == '{"kind":"hc"}'


async def test_focus_chat_input_targets_client_id(app, connect):
    conn = connect()
    c1 = Reader(conn.ui.subscribeToFocusChatInput(common_pb2.StringRequest(value="client-1")))
    c2 = Reader(conn.ui.subscribeToFocusChatInput(common_pb2.StringRequest(value="client-2")))
    await subscribed(app, None, "focus_chat_input", n=2)
    assert (await conn.host.PublishFocusChatInput(host_pb2.FocusChatInput(client_id="client-2"))).subscribers == 1
    await next_message(c2)
    with pytest.raises(asyncio.TimeoutError):
        await next_message(c1, timeout=0.2)
    assert (await conn.host.PublishFocusChatInput(host_pb2.FocusChatInput())).subscribers == 2  # everyone
    await next_message(c1)
    await next_message(c2)


async def test_focus_chat_input_requires_client_id(connect):
    conn = connect()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await next_message(conn.ui.subscribeToFocusChatInput(common_pb2.StringRequest()))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "Client ID is required"


async def test_get_webview_html_is_a_page(connect):
    html = (await connect().ui.getWebviewHtml(EMPTY_REQ)).value
    assert html.lstrip().lower().startswith("<!doctype html")
    assert "</html>" in html.lower()


async def test_open_url_goes_to_the_host(app, connect):
    conn = connect()
    with pytest.raises(grpc.aio.AioRpcError) as err:  # nobody can open it yet
        await conn.ui.openUrl(common_pb2.StringRequest(value="https://example.com/docs"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    host_stream = await subscribed(app, conn.host.SubscribeHostRequests(common_pb2.Empty()), "host_request")
    await conn.ui.openUrl(common_pb2.StringRequest(value="https://example.com/docs?q=1#x"))
    req = await next_message(host_stream)
    assert req.open_url.url == "https://example.com/docs?q=1#x"

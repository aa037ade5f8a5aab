"""Bad input gets a precise status and a message that says what was wrong; nothing else breaks."""

from __future__ import annotations

import grpc
import pytest

from tests.conftest import Reader, next_message, wait_for
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2

INVALID = grpc.StatusCode.INVALID_ARGUMENT


async def status_of(awaitable) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        result = await awaitable
        if hasattr(result, "read"):
            await result.read()
    return err.value.code(), err.value.details() or ""


@pytest.mark.parametrize("url,why", [
    ("javascript:alert(1)", "only http and https"),
    ("file:///etc/passwd", "only http and https"),
    ("JAVASCRIPT:alert(1)", "only http and https"),
    ("data:text/html,<script>", "only http and https"),
    ("https://example.com/" + "a" * 10_000, "limit is 2048"),
    ("", "url is required"),
    ("https:///nohost", "no host"),
    ("/relative/path", "relative URL"),
    ("https://exa mple.com", "whitespace"),
    ("https://example.com/\x00", "control"),
    ("http://[::1", "malformed"),
])
async def test_open_url_rejects(connect, url, why):
    code, details = await status_of(connect().ui.openUrl(common_pb2.StringRequest(value=url)))
    assert code == INVALID and why in details


async def test_unknown_provider_type_enum(connect):
    conn = connect()
    for rpc in ("subscribeToMcpButtonClicked", "subscribeToHistoryButtonClicked",
                "subscribeToSettingsButtonClicked"):
        call = getattr(conn.ui, rpc)(ui_pb2.WebviewProviderTypeRequest(provider_type=7))
        code, details = await status_of(call.read())
        assert code == INVALID and "provider_type 7" in details


async def test_unset_or_unknown_button(connect):
    conn = connect()
    code, details = await status_of(conn.host.PublishButtonClick(host_pb2.ButtonClick()))
    assert code == INVALID and "button=0" in details
    code, details = await status_of(conn.host.PublishButtonClick(host_pb2.ButtonClick(button=42)))
    assert code == INVALID and "button=42" in details
    code, details = await status_of(conn.host.PublishButtonClick(
        host_pb2.ButtonClick(button=host_pb2.BUTTON_HISTORY, provider_type=9)))
    assert code == INVALID and "provider_type=9" in details


@pytest.mark.parametrize("fields,why", [
    ({"ts": 0}, "ts is required"),
    ({"ts": 1, "type": 5}, "type=5 is not a valid ClineMessageType"),
    ({"ts": 1, "say": 99}, "say=99 is not a valid ClineSay"),
    ({"ts": 1, "ask": 77}, "ask=77 is not a valid ClineAsk"),
])
async def test_bad_partial_message(connect, fields, why):
    code, details = await status_of(connect().host.PublishPartialMessage(ui_pb2.ClineMessage(**fields)))
    assert code == INVALID and why in details


async def test_theme_must_be_json(connect):
    code, details = await status_of(connect().host.SetTheme(host_pb2.TextEvent(text="{not json")))
    assert code == INVALID and "JSON" in details


@pytest.mark.parametrize("session", ["", "has space", "x" * 200, "semi;colon", "star*"])
async def test_bad_session_name(app, session):
    from uibus.clients.connection import Connection

    async with Connection(f"127.0.0.1:{app.port}") as conn:
        md = (("x-uibus-session", session),)
        code, details = await status_of(conn.host.GetSessionState(common_pb2.Empty(), metadata=md))
        assert code == INVALID and "session name" in details
        code, _ = await status_of(conn.ui.subscribeToTheme(common_pb2.EmptyRequest(), metadata=md).read())
        assert code == INVALID
    assert app.bus.count() == 0


async def test_oversized_message(app, connect):
    big = "x" * (app.config.max_message_bytes + 10)
    code, details = await status_of(connect().host.PublishAddToInput(host_pb2.TextEvent(text=big)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details


async def test_server_keeps_serving_after_bad_input(app, connect):
    conn = connect()
    stream = Reader(conn.ui.subscribeToAddToInput(common_pb2.EmptyRequest()))
    await wait_for(lambda: app.bus.count("add_to_input") == 1)
    for bad in (conn.host.PublishButtonClick(host_pb2.ButtonClick(button=99)),
                conn.ui.openUrl(common_pb2.StringRequest(value="file:///")),
                conn.host.PublishAddToInput(host_pb2.TextEvent(text="x" * (app.config.max_message_bytes + 1)))):
        await status_of(bad)
    await conn.host.PublishAddToInput(host_pb2.TextEvent(text="ok"))
    assert (await next_message(stream)).value == "ok"
    reply = await connect().ui.scrollToSettings(common_pb2.StringRequest(value="x"))
    assert reply.key == "scrollToSettings"


async def test_unknown_method_is_unimplemented(app):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
        call = ch.unary_unary("/cline.UiService/noSuchRpc")
        code, _ = await status_of(call(b""))
        assert code == grpc.StatusCode.UNIMPLEMENTED

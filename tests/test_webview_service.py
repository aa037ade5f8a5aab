"""uibus.v1.WebviewService over native gRPC: one stream carrying every UiService subscription."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.conftest import wait_for
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2, webview_pb2, webview_pb2_grpc

STREAMS = 11


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
    got = [await asyncio.wait_for(call.read(), 2) for _ in range(5)]
    assert [g.source for g in got] == ["subscribeToPartialMessage", "subscribeToAddToInput",
                                       "subscribeToSettingsButtonClicked", "subscribeToFocusChatInput",
                                       "subscribeToRelinquishControl"]
    assert got[0].partial_message.text == "hi" and got[1].text == "added" and got[2].HasField("signal")
    call.cancel()
    await wait_for(lambda: app.bus.count() == 0, what="every inner subscription removed")


async def test_client_id_required(connect) -> None:
    stub = webview_pb2_grpc.WebviewServiceStub(connect().channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Subscribe(webview_pb2.WebviewSubscribeRequest()).read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "client_id" in err.value.details()

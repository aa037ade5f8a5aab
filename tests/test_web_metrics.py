"""/metrics: valid Prometheus text whose numbers follow what the bus and the RPCs did."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import httpx
import pytest

from tests.conftest import wait_for
from tests.support import scrape
from tests.webclient import call_stream
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra import kinds
from uibus.infra.config import Config
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2


@pytest.fixture
def web_config(web_config: Config) -> Config:
    return replace(web_config, queue_size=2)


def get(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_follow_events_and_rpcs(web: App) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{web.http_port}", timeout=10) as client, \
            Connection(f"127.0.0.1:{web.port}", session="m") as conn:
        before = await scrape(client)
        assert get(before, "uibus_subscriptions", kind="partial_message") == 0

        native = conn.ui.subscribeToPartialMessage(common_pb2.EmptyRequest(), metadata=(("x-uibus-session", "m"),))
        first = asyncio.ensure_future(native.read())  # starts the call
        stream = call_stream(client, "/cline.UiService/subscribeToAddToInput", b"", headers={"x-uibus-session": "m"})
        await anext(stream)
        await wait_for(lambda: web.bus.count(session="m") == 2, what="native and gRPC-Web subscriptions")
        mid = await scrape(client)
        assert get(mid, "uibus_subscriptions", kind="partial_message") == 1
        assert get(mid, "uibus_subscriptions", kind="add_to_input") == 1
        assert get(mid, "uibus_subscriptions_total_open") == 2

        for i in range(6):
            await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=5, type=ui_pb2.SAY, text=f"v{i}",
                                                                      partial=True))
        await conn.host.PublishAddToInput(host_pb2.TextEvent(text="x"))
        # a burst faster than any reader: the subscriber's queue (bound 2) coalesces by ts
        for i in range(6):
            web.bus.publish("m", kinds.PARTIAL_MESSAGE, ui_pb2.ClineMessage(ts=6, text=f"b{i}"), key=6)
        after = await scrape(client)
        assert get(after, "uibus_events_published_total", kind="partial_message") == 12
        assert get(after, "uibus_events_delivered_total", kind="partial_message") == 12
        assert get(after, "uibus_events_coalesced_total", kind="partial_message") >= 3
        assert get(after, "uibus_events_published_total", kind="add_to_input") == 1
        method = "/uibus.v1.HostService/PublishPartialMessage"
        assert get(after, "uibus_rpc_duration_seconds_count", method=method, code="OK", transport="grpc") == 6

        # an error status is counted under its code, and gRPC-Web calls under their transport
        bad = conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=0))
        with pytest.raises(grpc.aio.AioRpcError):
            await bad
        native.cancel()
        first.cancel()
        await stream.aclose()
        await wait_for(lambda: web.bus.count() == 0, what="streams closed")
        final = await scrape(client)
        assert get(final, "uibus_rpc_duration_seconds_count", method=method, code="INVALID_ARGUMENT",
                   transport="grpc") == 1
        assert get(final, "uibus_rpc_duration_seconds_count", method="/cline.UiService/subscribeToAddToInput",
                   code="CANCELLED", transport="grpc-web") == 1
        assert get(final, "uibus_subscriptions", kind="partial_message") == 0


async def test_service_gauges_follow_pending_work(web: App, web_connect) -> None:
    """Pending extension-UI dialogs and CodeBolt connections are exported, read at scrape time."""
    from uibus.pb.uibus.v1 import extension_ui_pb2, extension_ui_pb2_grpc

    agent = extension_ui_pb2_grpc.ExtensionUiServiceStub(web_connect("g").channel)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{web.http_port}", timeout=10) as client:
        before = await scrape(client)
        assert get(before, "uibus_extension_ui_pending_dialogs") == 0
        assert get(before, "uibus_codebolt_connections") == 0
        calls = [agent.Confirm(extension_ui_pb2.ConfirmRequest(title=f"t{i}", message="m")) for i in range(3)]
        for _ in range(200):
            if get(await scrape(client), "uibus_extension_ui_pending_dialogs") == 3:
                break
            await asyncio.sleep(0.01)
        assert get(await scrape(client), "uibus_extension_ui_pending_dialogs") == 3
        for call in calls:
            call.cancel()
        for _ in range(200):
            if get(await scrape(client), "uibus_extension_ui_pending_dialogs") == 0:
                break
            await asyncio.sleep(0.01)
        assert get(await scrape(client), "uibus_extension_ui_pending_dialogs") == 0

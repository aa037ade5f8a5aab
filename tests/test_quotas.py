"""Per-tenant quotas (docs/security/quotas.md): tenant A at every quota, tenant B's calls still succeed.
Real server with a tokens file, real sockets: /acp over HTTP and WebSocket, WatchSessions over native
gRPC, CreateSession; the refusals name the quota and count on /metrics per tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.conftest import require, start_app, wait_for
from tests.pikit import hosting, turn_of
from tests.support import scrape
from tests.test_acp_agent import ACP_DIR, fixture_agent
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config
from uibus.infra.jsonrpc import QUOTA_EXCEEDED
from uibus.infra.quotas import MAX_TENANT_LABELS, OTHER, QuotaExceeded, Quotas
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc as ext_grpc
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc

pytestmark = pytest.mark.timeout(90)
TOKENS = "a-token (team-a) team-a-*\nb-token (team-b) team-b-*\nadmin-token *\n"
A, B = "team-a", "team-b"  # the tenants the lines name (uibus.infra.auth's Grant.tenant)
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}}


async def metrics(app: App) -> Any:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", headers=bearer("admin-token")) as http:
        return await scrape(http)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def tenants(web_config: Config, tmp_path: Path) -> AsyncIterator[App]:
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    app = await start_app(replace(web_config, tokens_file=str(path), quota_acp_connections=3, quota_watches=2,
                                  quota_sessions_per_minute=3))
    try:
        yield app
    finally:
        await app.aclose(grace=0.5)


async def test_acp_connections_http_and_websocket_count_per_tenant(tenants: App) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{tenants.http_port}", timeout=10) as http:
        opened = []
        for _ in range(3):
            r = await http.post("/acp", json=INIT, headers=bearer("a-token"))
            assert r.status_code == 200, r.text
            opened.append(r.headers["acp-connection-id"])
        refused = await http.post("/acp", json=INIT, headers=bearer("a-token"))
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == QUOTA_EXCEEDED and error["data"] == {"quota": "acp_connections"}
        assert "quota acp_connections" in error["message"] and "--quota-acp-connections" in error["message"]
        with pytest.raises(InvalidStatus) as ws_refused:  # the WebSocket door counts against the same quota
            async with connect(f"ws://127.0.0.1:{tenants.http_port}/acp", additional_headers=bearer("a-token")):
                pass
        assert ws_refused.value.response.status_code == 429
        # B and the admin are not refused because of A
        for token in ("b-token", "admin-token"):
            assert (await http.post("/acp", json=INIT, headers=bearer(token))).status_code == 200
        async with connect(f"ws://127.0.0.1:{tenants.http_port}/acp", additional_headers=bearer("b-token")) as ws:
            await ws.send('{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}')
            assert '"protocolVersion":1' in await asyncio.wait_for(ws.recv(), 10)
        # A lets one go: A may open one again
        gone = await http.delete("/acp", headers={**bearer("a-token"), "Acp-Connection-Id": opened[0]})
        assert gone.status_code == 202
        assert (await http.post("/acp", json=INIT, headers=bearer("a-token"))).status_code == 200
    samples = await metrics(tenants)
    assert samples[("uibus_quota_refused_total", (("quota", "acp_connections"), ("tenant", A)))] == 2
    assert ("uibus_quota_refused_total", (("quota", "acp_connections"), ("tenant", B))) not in samples


async def _code(call: Any) -> str:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    return "OK"


def md(token: str, session: str | None = None) -> tuple[tuple[str, str], ...]:
    out = (("authorization", f"Bearer {token}"),)
    return (*out, ("x-uibus-session", session)) if session else out


async def test_the_pages_listing_is_a_watch_of_its_tenant(tenants: App) -> None:
    """A page follows the sessions listing on its one WebviewService stream (`sessions`): it is held
    against the same `watches` quota as WatchSessions, refused when the tenant is at its limit, and
    the same stream without the listing is not refused."""
    from uibus.pb.uibus.v1 import webview_pb2, webview_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{tenants.port}") as ch:
        api = sessions_pb2_grpc.SessionServiceStub(ch)
        webview = webview_pb2_grpc.WebviewServiceStub(ch)
        page = webview.Subscribe(webview_pb2.WebviewSubscribeRequest(client_id="p1", sessions=True),
                                 metadata=md("a-token", "team-a-1"))
        assert (await asyncio.wait_for(page.read(), 10)).HasField("sessions")
        watch = api.WatchSessions(pb.ListSessionsRequest(), metadata=md("a-token"))
        await asyncio.wait_for(watch.read(), 10)
        assert tenants.quotas.in_use("watches", A) == 2
        refused = webview.Subscribe(webview_pb2.WebviewSubscribeRequest(client_id="p2", sessions=True),
                                    metadata=md("a-token", "team-a-1"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(refused.read(), 10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota watches" in (err.value.details() or "")
        plain = webview.Subscribe(webview_pb2.WebviewSubscribeRequest(client_id="p3"),
                                  metadata=md("a-token", "team-a-1"))
        await asyncio.wait_for(plain.initial_metadata(), 10)  # subscribed: no listing, no watch
        for call in (page, watch, plain):
            call.cancel()
    await wait_for(lambda: tenants.quotas.in_use("watches", A) == 0, timeout=5, what="the watches given back")


async def test_watches_and_sessions_per_minute_per_tenant(tenants: App) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tenants.port}") as ch:
        api = sessions_pb2_grpc.SessionServiceStub(ch)
        watches = [api.WatchSessions(pb.ListSessionsRequest(), metadata=md("a-token")) for _ in range(2)]
        for w in watches:
            await asyncio.wait_for(w.read(), 10)  # each got its first listing
        third = api.WatchSessions(pb.ListSessionsRequest(), metadata=md("a-token"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(third.read(), 10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "quota watches" in (refused.value.details() or "")
        b_watch = api.WatchSessions(pb.ListSessionsRequest(), metadata=md("b-token"))
        await asyncio.wait_for(b_watch.read(), 10)  # B is not refused because of A
        assert (await api.ListSessions(pb.ListSessionsRequest(), metadata=md("b-token"))).sessions == []
        watches[0].cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await watches[0].read()
        again = None
        for _ in range(50):  # the lease is given back when the handler ends
            again = api.WatchSessions(pb.ListSessionsRequest(), metadata=md("a-token"))
            try:
                await asyncio.wait_for(again.read(), 10)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("A's released watch was not given back")
        for call in (*watches[1:], b_watch, again):
            call.cancel()

        for i in range(3):
            assert await _code(api.CreateSession(pb.CreateSessionRequest(), metadata=md("a-token", f"team-a-{i}"))) \
                == "OK"
        code = await _code(api.CreateSession(pb.CreateSessionRequest(), metadata=md("a-token", "team-a-9")))
        assert code.startswith("RESOURCE_EXHAUSTED") and "quota sessions_per_minute" in code, code
        assert await _code(api.CreateSession(pb.CreateSessionRequest(), metadata=md("b-token", "team-b-1"))) == "OK"
    samples = await metrics(tenants)
    assert samples[("uibus_quota_refused_total", (("quota", "watches"), ("tenant", A)))] >= 1
    assert samples[("uibus_quota_refused_total", (("quota", "sessions_per_minute"), ("tenant", A)))] == 1


def test_quota_labels_are_bounded_and_limits_can_be_turned_off() -> None:
    quotas = Quotas({"watches": 1, "dialogs": 0})
    for i in range(MAX_TENANT_LABELS + 10):
        quotas.hold("watches", f"t{i}")
        with pytest.raises(QuotaExceeded):
            quotas.hold("watches", f"t{i}")
    assert {label for _, label in quotas.refused} == {*(f"t{i}" for i in range(MAX_TENANT_LABELS)), OTHER}
    assert quotas.refused[("watches", OTHER)] == 10
    for _ in range(1000):
        quotas.hold("dialogs", "t0")  # 0: off
    quotas.tick("sessions_per_minute", "x", now=0.0)
    with quotas.hold("acp_connections", "y") as lease:
        assert quotas.in_use("acp_connections", "y") == 1
    lease.release()  # once only
    assert quotas.in_use("acp_connections", "y") == 0


async def test_grpc_streams_per_tenant(web_config: Config, tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    app = await start_app(replace(web_config, tokens_file=str(path), quota_streams=2))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            ui = ext_grpc.ExtensionUiServiceStub(ch)
            held = [ui.Subscribe(ext.SubscribeRequest(), metadata=md("a-token", f"team-a-{i}")) for i in range(2)]
            for call in held:
                await asyncio.wait_for(call.initial_metadata(), 10)
            refused = ui.Subscribe(ext.SubscribeRequest(), metadata=md("a-token", "team-a-3"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(refused.read(), 10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota streams" in err.value.details()
            b = ui.Subscribe(ext.SubscribeRequest(), metadata=md("b-token", "team-b-1"))
            await asyncio.wait_for(b.initial_metadata(), 10)  # B is not refused because of A
            for call in (*held, b):
                call.cancel()
        samples = await metrics(app)
        assert samples[("uibus_quota_refused_total", (("quota", "streams"), ("tenant", A)))] == 1
    finally:
        await app.aclose(grace=0.5)


async def test_codebolt_connections_per_tenant(web_config: Config, tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    app = await start_app(replace(web_config, tokens_file=str(path), quota_codebolt_connections=1))
    url = f"ws://127.0.0.1:{app.http_port}/agent-to-app?session="
    try:
        async with connect(url + "team-a-1", additional_headers=bearer("a-token")):
            with pytest.raises(InvalidStatus) as refused:
                async with connect(url + "team-a-2", additional_headers=bearer("a-token")):
                    pass
            assert refused.value.response.status_code == 429
            assert b"quota codebolt_connections" in refused.value.response.body
            async with connect(url + "team-b-1", additional_headers=bearer("b-token")):
                pass  # B is not refused because of A
        for _ in range(100):  # A's connection closed: its lease is back
            try:
                async with connect(url + "team-a-2", additional_headers=bearer("a-token")):
                    break
            except InvalidStatus:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("A's closed connection was not given back")
        samples = await metrics(app)
        assert samples[("uibus_quota_refused_total", (("quota", "codebolt_connections"), ("tenant", A)))] >= 1
    finally:
        await app.aclose(grace=0.5)


async def test_dialogs_open_per_tenant(web_config: Config, tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    app = await start_app(replace(web_config, tokens_file=str(path), quota_dialogs=1))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            ui = ext_grpc.ExtensionUiServiceStub(ch)
            first = ui.Confirm(ext.ConfirmRequest(title="ok?"), metadata=md("a-token", "team-a-1"))
            await wait_for(lambda: app.core.dialogs.count() == 1, 10, what="A's dialog open")
            code = await _code(ui.Confirm(ext.ConfirmRequest(title="again?"), metadata=md("a-token", "team-a-2")))
            assert code.startswith("RESOURCE_EXHAUSTED") and "quota dialogs" in code, code
            second = ui.Confirm(ext.ConfirmRequest(title="b?"), metadata=md("b-token", "team-b-1"))
            await wait_for(lambda: app.core.dialogs.count() == 2, 10, what="B's dialog open despite A")
            first.cancel()
            second.cancel()
            await wait_for(lambda: app.core.dialogs.count() == 0, 10, what="dialogs closed")
            later = ui.Confirm(ext.ConfirmRequest(title="now?"), metadata=md("a-token", "team-a-3"))
            await wait_for(lambda: app.core.dialogs.count() == 1, 10, what="A's lease given back")
            later.cancel()
        samples = await metrics(app)
        assert samples[("uibus_quota_refused_total", (("quota", "dialogs"), ("tenant", A)))] == 1
    finally:
        await app.aclose(grace=0.5)


@pytest.mark.node
async def test_an_agents_idle_processes_never_refuse_another_tenants_first_turn(
        config: Config, tmp_path: Path) -> None:
    """A's three short turns (max_processes = 3) used to refuse B's first turn RESOURCE_EXHAUSTED for
    idle_seconds (900). Now the least recently used idle process is closed to make room."""
    require("the ACP SDK (npm ci --prefix tests/acp)", (ACP_DIR / "node_modules" / "@agentclientprotocol").is_dir(),
            "node")
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    async with hosting(config, tmp_path, [fixture_agent(tmp_path, max_processes=3)], tokens_file=str(path)) as app:
        target = f"127.0.0.1:{app.port}"
        for i in range(3):
            async with Connection(target, session=f"team-a-{i}", token="a-token") as a:
                assert (await turn_of(a, "acp", "hello"))[-1].response.text == "Turn 1: hello"
        assert app.core.agent_sessions.count() == 3  # all three idle, kept for idle_seconds
        async with Connection(target, session="team-b-1", token="b-token") as b:
            assert (await turn_of(b, "acp", "me too"))[-1].response.text == "Turn 1: me too"
        assert app.core.agent_sessions.count() == 3 and app.core.agent_sessions.closed_reclaimed == 1
        live = {s for s in ("team-a-0", "team-a-1", "team-a-2", "team-b-1")
                if app.core.agent_sessions.live_agents(s)}
        assert live == {"team-a-1", "team-a-2", "team-b-1"}  # the least recently used one went


@pytest.mark.node
async def test_a_tenant_at_its_agent_processes_gives_way_to_itself_and_no_one_else_is_refused(
        web_config: Config, tmp_path: Path) -> None:
    """The quota agent_processes (docs/security/quotas.md): A at its share of an agent closes its own
    least recently used idle process; with all of its own running, A is refused naming the quota,
    while B (under the same max_processes) is served."""
    require("the ACP SDK (npm ci --prefix tests/acp)", (ACP_DIR / "node_modules" / "@agentclientprotocol").is_dir(),
            "node")
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    async with hosting(web_config, tmp_path, [fixture_agent(tmp_path, max_processes=4)], tokens_file=str(path),
                       quota_agent_processes=2) as app:
        sessions, target = app.core.agent_sessions, f"127.0.0.1:{app.port}"

        def live() -> set[str]:
            return {s for s in (*(f"team-a-{i}" for i in range(4)), "team-b-1") if sessions.live_agents(s)}

        for i in range(3):
            async with Connection(target, session=f"team-a-{i}", token="a-token") as a:
                assert (await turn_of(a, "acp", "hello"))[-1].response.text == "Turn 1: hello"
        # The third was A's own at its share of 2 (max_processes 4 had room): its oldest idle one went.
        assert live() == {"team-a-1", "team-a-2"} and sessions.closed_reclaimed == 1
        async with Connection(target, session="team-a-1", token="a-token") as a1, \
                Connection(target, session="team-a-2", token="a-token") as a2:
            slow = [asyncio.ensure_future(turn_of(a, "acp", "slow")) for a in (a1, a2)]
            await wait_for(lambda: sessions.running("team-a-1", "acp") and sessions.running("team-a-2", "acp"),
                           timeout=30, what="A's two turns running")
            async with Connection(target, session="team-a-3", token="a-token") as a3:
                code = await _code(turn_of(a3, "acp", "hello"))
            assert code.startswith("RESOURCE_EXHAUSTED: quota agent_processes exceeded: tenant 'team-a' is at its "
                                   "limit of 2 agent processes"), code
            assert "of agent 'acp'" in code and "--quota-agent-processes" in code
            async with Connection(target, session="team-b-1", token="b-token") as b:
                assert (await turn_of(b, "acp", "me too"))[-1].response.text == "Turn 1: me too"
            assert live() == {"team-a-1", "team-a-2", "team-b-1"} and sessions.closed_reclaimed == 1
            for s in ("team-a-1", "team-a-2"):
                assert sessions.stop(s, "acp")
            for done in await asyncio.gather(*slow, return_exceptions=True):
                assert isinstance(done, grpc.aio.AioRpcError) and done.code() == grpc.StatusCode.CANCELLED
        samples = await metrics(app)
        assert samples[("uibus_quota_refused_total", (("quota", "agent_processes"), ("tenant", A)))] == 1
        assert ("uibus_quota_refused_total", (("quota", "agent_processes"), ("tenant", B))) not in samples

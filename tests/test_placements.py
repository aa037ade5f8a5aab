"""One behaviour suite against both placements (uibus.replicas.placement): a hosted agent's turns,
steering, the sessions listing and an extension-UI dialog, driven from two sides — one uibus
alone (LocalPlacement: both sides are the same process) and two replicas on a real redis-server
(LeasedPlacement: the side that did not start the agent reaches it at its owner over the bus).
The callers see the same thing either way: one conversation, one agent process, steering acting on
it, the listing showing it, a dialog asked on one side answered on the other."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.chatkit import write_agents
from tests.conftest import Reader, start_app
from tests.hostkit import need_fixture
from tests.redisproc import RedisProcess, redis_server
from tests.replicakit import final, replicas, started
from tests.test_acp_agent import fixture_agent
from tests.test_steering_replicas import api, listed_until
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.replicas.placement import LeasedPlacement, LocalPlacement

__all__ = ["redis_server"]  # the fixture

pytestmark = [pytest.mark.node, pytest.mark.timeout(120)]


@pytest.fixture(params=["local", pytest.param("leased", marks=pytest.mark.redis)])
async def sides(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[list[App]]:
    """[here, there]: the same app twice (alone), or two replicas on Redis."""
    need_fixture()
    if request.param == "local":
        app = await start_app(Config(host="127.0.0.1", port=0, http_port=0, store=str(tmp_path / "one.db"),
                                     grace_seconds=1.0, agents=write_agents(tmp_path, [fixture_agent(tmp_path)])))
        try:
            assert isinstance(app.placement, LocalPlacement)
            yield [app, app]
        finally:
            await app.aclose(grace=0.5)
        assert app.core.agent_sessions.count() == 0 and app.bus.count() == 0
        return
    redis: RedisProcess = request.getfixturevalue("redis_server")
    async with replicas(tmp_path, redis, [fixture_agent(tmp_path)], n=2) as apps:
        assert all(isinstance(a.placement, LeasedPlacement) for a in apps)
        yield apps


async def test_one_behaviour_whatever_the_placement(sides: list[App]) -> None:
    here, there = sides
    apps = list({id(a): a for a in sides}.values())
    async with Connection(f"127.0.0.1:{here.port}", session="p") as on_here, \
            Connection(f"127.0.0.1:{there.port}", session="p") as on_there:
        # one conversation, continued from either side, held by one agent process
        assert await final(on_here, "acp", "one") == "Turn 1: one"
        assert await final(on_there, "acp", "two") == "Turn 2: two"
        assert started(apps, "acp") == 1
        assert sum(a.placement.forwarded for a in apps) == len(apps) - 1  # leased: the second turn went over

        # steering from the other side acts on that agent; its errors keep their status
        assert (await api(on_there).StopTurn(pb.AgentRequest(agent="acp"))).stopped is False
        state = await api(on_there).SetMode(pb.SetModeRequest(agent="acp", mode_id="plan"))
        assert state.agent == "acp" and state.current_mode == "plan"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await api(on_there).SetMode(pb.SetModeRequest(agent="acp", mode_id="yolo"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # and the listing on either side shows it
        for conn in (on_here, on_there):
            seen = await listed_until(conn, "p", lambda e: bool(e.agents) and e.agents[0].current_mode == "plan")
            assert [a.agent for a in seen.agents] == ["acp"] and list(seen.running) == []

        # a dialog asked on one side is seen and answered on the other
        ui = Reader(extension_ui_pb2_grpc.ExtensionUiServiceStub(on_there.channel).Subscribe(ext_pb.SubscribeRequest()))
        try:
            await asyncio.wait_for(ui.call.initial_metadata(), 10)
            asked = asyncio.ensure_future(extension_ui_pb2_grpc.ExtensionUiServiceStub(on_here.channel).Confirm(
                ext_pb.ConfirmRequest(title="Go?", timeout_ms=20_000)))
            event = await ui.next(timeout=10)
            while not event.HasField("request"):
                event = await ui.next(timeout=10)
            await extension_ui_pb2_grpc.ExtensionUiServiceStub(on_there.channel).Respond(
                ext_pb.RespondRequest(id=event.request.id, confirmed=True), timeout=10)
            result = await asyncio.wait_for(asked, 10)
            assert result.outcome == ext_pb.DIALOG_OUTCOME_ANSWERED and result.confirmed
            with pytest.raises(grpc.aio.AioRpcError) as err:  # answered: said so on either side
                await extension_ui_pb2_grpc.ExtensionUiServiceStub(on_there.channel).Respond(
                    ext_pb.RespondRequest(id=event.request.id, cancelled=True), timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            ui.call.cancel()

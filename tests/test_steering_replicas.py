"""Steering a hosted agent across replicas (issues 35 and 37 meet): three replicas on one real
redis-server, the ACP fixture agent hosted by one of them (its lease owner, A). A turn sent to B runs
at A; a StopTurn sent to C reaches A over the bus: B's caller gets CANCELLED with the "stopped from
a UI" message and the agent gets `session/cancel`. SetMode, SetModel and NewConversation sent to C
act at A and answer with A's result or A's error; the listing served by C shows A's agent state."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.chatkit import MAXIMAL, Agent, request
from tests.conftest import wait_for
from tests.redisproc import RedisProcess, redis_server
from tests.test_acp_agent import fixture_agent, fixture_log
from tests.test_agent_ownership import final, need_fixture, owner_of, replicas, started
from uibus import kinds
from uibus.clients.connection import Connection
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc

__all__ = ["redis_server"]  # the fixture

pytestmark = [pytest.mark.redis, pytest.mark.node, pytest.mark.timeout(120)]


def api(conn: Connection) -> Any:
    return sessions_pb2_grpc.SessionServiceStub(conn.channel)


async def test_steering_sent_to_a_third_replica_acts_at_the_owner(tmp_path: Path, redis_server: RedisProcess) -> None:
    need_fixture()
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)], n=3) as apps:
        a, b, c = apps
        async with Connection(f"127.0.0.1:{a.port}", session="x") as on_a, \
                Connection(f"127.0.0.1:{b.port}", session="x") as on_b, \
                Connection(f"127.0.0.1:{c.port}", session="x") as on_c:
            assert await final(on_a, "acp", "one") == "Turn 1: one"
            assert owner_of(apps, "x", "acp") is a
            # nothing runs: the owner says so
            assert (await api(on_c).StopTurn(pb.AgentRequest(agent="acp"))).stopped is False

            call = Agent(on_b, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
            assert (await asyncio.wait_for(call.read(), 20)).response.text == "Working "
            assert (await api(on_c).StopTurn(pb.AgentRequest(agent="acp"))).stopped is True
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.CANCELLED
            assert "stopped from a UI" in (err.value.details() or "")
            await wait_for(lambda: sum("cancelled" in e for e in fixture_log(tmp_path)) == 1, timeout=10,
                           what="session/cancel at the agent, on A")

            state = await api(on_c).SetMode(pb.SetModeRequest(agent="acp", mode_id="plan"))
            assert state.current_mode == "plan" and state.agent == "acp"
            assert any(e.get("session/set_mode", {}).get("modeId") == "plan" for e in fixture_log(tmp_path))
            # the owner's errors come back with their status and message
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await api(on_c).SetMode(pb.SetModeRequest(agent="acp", mode_id="yolo"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "default, plan" in (err.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await api(on_b).SetModel(pb.SetModelRequest(agent="acp", model_id="x"))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert err.value.details() == "acp offers no model choice"

            old = state.conversation
            state = await api(on_b).NewConversation(pb.AgentRequest(agent="acp"))
            assert state.conversation != old and list(state.conversations) == [old]
            assert await final(on_c, "acp", "hello") == "Turn 1: hello"  # the fresh conversation, at A
            assert started(apps, "acp") == 1
            assert all(x.bus.count(kinds.AGENT_TURN_REPLY) == 0 for x in (b, c))

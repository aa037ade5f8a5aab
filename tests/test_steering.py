"""Steering hosted agents from any UI (uibus.v1.SessionService): a second client stops a turn a
first one started (the first sees CANCELLED, the agent got its protocol's cancel), a mode change
reaches the ACP agent and shows at another UI's watch, pi's models and commands are listed and its
model set, a new conversation keeps the old one listed, and what an agent lacks is refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.chatkit import MAXIMAL, Agent, request
from tests.conftest import free_port, require, wait_for
from tests.hostkit import fixture_and_pi, stop_a_hung_pi_turn
from tests.pikit import Model, Reply, hosting, turn_of
from tests.test_acp_agent import fixture_log
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc

pytestmark = [pytest.mark.timeout(40), pytest.mark.node]


@pytest.fixture
async def hosted(config: Config, tmp_path: Path) -> AsyncIterator[tuple[App, Model]]:
    async with fixture_and_pi(config, tmp_path) as hosted:
        yield hosted


def api(conn: Connection) -> Any:
    return sessions_pb2_grpc.SessionServiceStub(conn.channel)


async def entry(conn: Connection, session: str) -> pb.SessionEntry:
    listed = await api(conn).ListSessions(pb.ListSessionsRequest(prefix=session))
    return next(s for s in listed.sessions if s.session == session)


def agent_state(e: pb.SessionEntry, name: str) -> pb.AgentState:
    return next(a for a in e.agents if a.agent == name)


async def test_a_second_client_stops_an_acp_turn_the_first_started(hosted: tuple[App, Model], tmp_path: Path) -> None:
    app, _ = hosted
    async with Connection(f"127.0.0.1:{app.port}", session="stop-acp") as first, \
            Connection(f"127.0.0.1:{app.port}", session="stop-acp") as second:
        call = Agent(first, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
        assert (await asyncio.wait_for(call.read(), 30)).response.text == "Working "
        seen = await entry(second, "stop-acp")
        assert list(seen.running) == ["acp"] and agent_state(seen, "acp").running
        assert (await api(second).StopTurn(pb.AgentRequest(agent="acp"))).stopped is True
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert "stopped from a UI" in (err.value.details() or "")
        await wait_for(lambda: any("cancelled" in e for e in fixture_log(tmp_path)), timeout=10,
                       what="session/cancel at the agent")
        assert list((await entry(second, "stop-acp")).running) == []
        # the same agent process answers the next turn
        assert (await turn_of(first, "acp", "again"))[-1].response.text == "Turn 2: again"


async def test_a_second_client_stops_a_pi_turn(hosted: tuple[App, Model]) -> None:
    app, model = hosted
    model.script(Reply(text="Thinking very hard ", hang=True), Reply(text="Recovered."))
    async with Connection(f"127.0.0.1:{app.port}", session="stop-pi") as first, \
            Connection(f"127.0.0.1:{app.port}", session="stop-pi") as second:
        await stop_a_hung_pi_turn(first, second, model)  # pi saw `abort`: it dropped its model request
        assert (await turn_of(first, "pi", "are you there?"))[-1].response.text == "Recovered."


async def test_acp_modes_commands_title_and_a_new_conversation(hosted: tuple[App, Model], tmp_path: Path) -> None:
    app, _ = hosted
    async with Connection(f"127.0.0.1:{app.port}", session="modes") as ui, \
            Connection(f"127.0.0.1:{app.port}", session="other-ui") as watcher_conn:
        await turn_of(ui, "acp", "diff")  # edits, then a session_info_update title and available commands
        assert (await entry(ui, "modes")).title == "Editing notes"
        acp = agent_state(await entry(ui, "modes"), "acp")
        assert [m.id for m in acp.modes] == ["default", "plan"] and acp.current_mode == "default"
        assert [(c.name, c.input_hint) for c in acp.commands] == [("review", ""), ("test", "which tests")]
        assert set(acp.can) == {"stop", "set_mode", "new_conversation"}
        watch = api(watcher_conn).WatchSessions(pb.ListSessionsRequest(prefix="modes"))
        assert agent_state((await asyncio.wait_for(watch.read(), 10)).sessions[0], "acp").current_mode == "default"

        state = await api(ui).SetMode(pb.SetModeRequest(agent="acp", mode_id="plan"))
        assert state.current_mode == "plan"
        assert any(e.get("session/set_mode", {}).get("modeId") == "plan" for e in fixture_log(tmp_path))
        seen = await asyncio.wait_for(watch.read(), 10)  # the other UI sees it
        assert agent_state(seen.sessions[0], "acp").current_mode == "plan"

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await api(ui).SetMode(pb.SetModeRequest(agent="acp", mode_id="yolo"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "default, plan" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await api(ui).SetModel(pb.SetModelRequest(agent="acp", model_id="x"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details() == "acp offers no model choice"

        old = agent_state(await entry(ui, "modes"), "acp").conversation
        state = await api(ui).NewConversation(pb.AgentRequest(agent="acp"))
        assert state.conversation != old and list(state.conversations) == [old]
        assert (await turn_of(ui, "acp", "hello"))[-1].response.text == "Turn 1: hello"  # a fresh conversation
        watch.cancel()


async def test_pi_models_commands_and_a_new_session(hosted: tuple[App, Model]) -> None:
    app, model = hosted
    model.script(Reply(text="Hi."))
    async with Connection(f"127.0.0.1:{app.port}", session="pi-steer") as ui:
        await turn_of(ui, "pi", "hello")
        pi = agent_state(await entry(ui, "pi-steer"), "pi")
        assert [m.id for m in pi.models] == ["scripted"] and pi.current_model == "scripted"
        assert "summarize" in [c.name for c in pi.commands]
        assert pi.modes == [] and "set_mode" not in pi.can
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await api(ui).SetMode(pb.SetModeRequest(agent="pi", mode_id="plan"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "pi offers no modes" in err.value.details()
        assert (await api(ui).SetModel(pb.SetModelRequest(agent="pi", model_id="scripted"))).current_model == "scripted"
        state = await api(ui).NewConversation(pb.AgentRequest(agent="pi"))
        assert state.live and len(state.conversations) == 1


async def test_claude_codes_modes_and_commands_and_a_mode_set_from_a_ui(config: Config, tmp_path: Path) -> None:
    """The real Claude Code (its ACP adapter, offline on the scripted model): its modes and models
    arrive in session/new and are listed; a mode and a model set through the sessions API reach it
    (it answers session/set_mode and session/set_model), and the conversation goes on.
    (Offline, Claude Code sends no available_commands_update; the fixture's cover commands.)"""
    from tests.scripted_models import Say, claude_model
    from tests.test_acp_agent import CLAUDE_ACP, claude_agent

    require("Claude Code's ACP adapter (npm ci --prefix tests/acp)", CLAUDE_ACP.exists(), "node")
    async with claude_model() as model, \
            hosting(config, tmp_path, [claude_agent(tmp_path, model)], http_port=free_port()) as app, \
            Connection(f"127.0.0.1:{app.port}", session="cc-modes") as ui:
        model.script(Say("Hello."))
        await turn_of(ui, "claude", "hi")
        state = agent_state(await entry(ui, "cc-modes"), "claude")
        modes = [m.id for m in state.modes]
        assert "plan" in modes and state.current_mode in modes and "set_mode" in state.can
        assert "haiku" in [m.id for m in state.models] and "set_model" in state.can
        state = await api(ui).SetMode(pb.SetModeRequest(agent="claude", mode_id="plan"))  # Claude Code answers it
        assert state.current_mode == "plan"
        assert (await api(ui).SetModel(pb.SetModelRequest(agent="claude", model_id="haiku"))).current_model == "haiku"
        # the agent goes on after both (the same process and conversation)
        model.script(Say("Planned."))
        assert (await turn_of(ui, "claude", "plan it"))[-1].response.text == "Planned."
        assert app.core.chat.agents.backends["claude"].started == 1

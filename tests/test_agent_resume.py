"""Conversations that outlive their process and their host (docs/hosting/durable.md).

uibus keeps each hosted agent's conversation handle in the session store (ACP: sessionId and cwd,
pi: its sessionFile); a new process of the same (session, agent) — after an idle close, after
`uibus serve` was stopped with SIGTERM or killed with SIGKILL — resumes it. The agents are the real
ones (pi 0.73 in RPC mode, claude-code-acp 0.16 against the scripted model server) and the ACP
fixture agent (tests/acp/fixture-agent.mjs, which with $ACP_FIXTURE_STATE advertises and implements
`session/load`, replaying the transcript as a real agent does). No agent outlives its uibus.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.chatkit import AI, MAXIMAL, Agent, request, write_agents
from tests.conftest import ServerProcess, free_port, require, wait_for
from tests.ext_ui_helpers import open_uis, read
from tests.pikit import PI, Reply, agent_pids, hosting, pi_agent, scripted_model, turn_of
from tests.scripted_models import Say, claude_model, responses_model
from tests.support import scrape_by_name
from tests.test_acp_agent import ACP_DIR, CLAUDE_ACP, CODEX, claude_agent, codex_agent, fixture_agent, fixture_log
from uibus.clients.connection import Connection
from uibus.domain.agent_handles import HANDLE
from uibus.infra.config import Config
from uibus.pb.cline import ui_pb2
from uibus.pb.uibus.v1 import webview_pb2, webview_pb2_grpc

pytestmark = [pytest.mark.timeout(180), pytest.mark.node]


def _need_acp() -> None:
    require("the ACP SDK (npm ci --prefix tests/acp)", (ACP_DIR / "node_modules" / "@agentclientprotocol").is_dir(),
            "node")


def loading_fixture(tmp_path: Path, **options: Any) -> dict[str, Any]:
    """The fixture agent keeping its conversations in tmp_path/acp-state: it offers session/load."""
    entry = fixture_agent(tmp_path, **options)
    state = tmp_path / "acp-state"
    state.mkdir(exist_ok=True)
    entry["options"]["env"]["ACP_FIXTURE_STATE"] = str(state)
    return entry


def pi_with_sessions(tmp_path: Path, model: Any, **options: Any) -> dict[str, Any]:
    """pi as the example config runs it: keeping its session files (no --no-session)."""
    entry = pi_agent(tmp_path, model, **options)
    entry["options"]["command"] = [a for a in entry["options"]["command"] if a != "--no-session"]
    return entry


async def webview_messages(target: str, session: str, *, quiet_s: float = 0.6) -> list[ui_pb2.ClineMessage]:
    """What a webview opened now is sent (the recent messages, replayed, then anything live) until
    nothing comes for `quiet_s`."""
    async with Connection(target, session=session) as conn:
        stub = webview_pb2_grpc.WebviewServiceStub(conn.channel)
        call = stub.Subscribe(webview_pb2.WebviewSubscribeRequest(client_id="after", provider_type=ui_pb2.SIDEBAR),
                              metadata=(("x-uibus-session", session),))
        got: list[ui_pb2.ClineMessage] = []
        for _ in range(500):
            try:
                event = await asyncio.wait_for(call.read(), quiet_s)
            except TimeoutError:
                break
            if event.HasField("partial_message"):
                got.append(event.partial_message)
        call.cancel()
        return got


def infos(messages: list[ui_pb2.ClineMessage]) -> list[str]:
    return [m.text for m in messages if m.say == ui_pb2.INFO]


def group_alive(pgid: int) -> list[int]:
    """The processes of group `pgid` still running (zombies waiting for a reaper are gone)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


async def final(target: str, session: str, agent: str, text: str) -> str:
    async with Connection(target, session=session) as conn:
        return (await turn_of(conn, agent, text))[-1].response.text


async def stop(server: ServerProcess, how: signal.Signals) -> None:
    if how == signal.SIGKILL:
        await asyncio.sleep(0.6)  # the recent messages are written behind (RECENT_WRITE_S)
    server.proc.send_signal(how)
    await asyncio.to_thread(server.proc.wait, 30)
    server.stop()


# ---- one `uibus serve` on its SQLite store, stopped and started again ----


async def test_pi_continues_its_conversation_across_restarts(spawn: Any, tmp_path: Path) -> None:
    async with scripted_model() as model:
        model.script(Reply(text="First answer."), Reply(text="Second answer."), Reply(text="Third answer."))
        agents = write_agents(tmp_path, [pi_with_sessions(tmp_path, model)])
        server = spawn("--agents", agents)
        await server.wait_ready()
        assert await final(server.target, "s", "pi", "remember the word walnut") == "First answer."
        work = tmp_path / "work"
        (first,) = agent_pids(work)
        await stop(server, signal.SIGTERM)
        assert agent_pids(work) == []

        server = spawn("--agents", agents)
        await server.wait_ready()
        assert await final(server.target, "s", "pi", "which word?") == "Second answer."
        seen = json.dumps(model.requests[1])  # the new process read the old conversation
        assert "remember the word walnut" in seen and "First answer." in seen
        (second,) = agent_pids(work)
        pgid = os.getpgid(second)
        await stop(server, signal.SIGKILL)
        await wait_for(lambda: group_alive(pgid) == [], timeout=10, what="the killed server's pi group to go")

        server = spawn("--agents", agents)
        await server.wait_ready()
        shown = await webview_messages(server.target, "s")  # before the next turn: the transcript, once each
        texts = [m.text for m in shown]
        assert texts.count("First answer.") == 1 and texts.count("Second answer.") == 1, texts
        assert infos(shown) == []
        assert await final(server.target, "s", "pi", "and now?") == "Third answer."
        seen = json.dumps(model.requests[2])
        assert "walnut" in seen and "which word?" in seen and "Second answer." in seen
        assert first != second


async def test_claude_code_continues_its_conversation_across_restarts(spawn: Any, tmp_path: Path) -> None:
    require("Claude Code's ACP adapter (npm ci --prefix tests/acp)", CLAUDE_ACP.exists(), "node")
    async with claude_model() as model:
        model.script(Say("Noted: walnut."), Say("The word was walnut."), Say("Still walnut."))
        agents = write_agents(tmp_path, [claude_agent(tmp_path, model)])
        server = spawn("--agents", agents)
        await server.wait_ready()
        assert await final(server.target, "cc", "claude", "remember walnut") == "Noted: walnut."
        await stop(server, signal.SIGTERM)

        server = spawn("--agents", agents)
        await server.wait_ready()
        async with Connection(server.target, session="cc") as conn:  # MAXIMAL: the load's replay is no piece
            responses = await turn_of(conn, "claude", "which word?", maximal=True)
        assert "".join(r.response.text for r in responses if r.response.type == AI) == "The word was walnut."
        assert "Noted: walnut." not in json.dumps([r.response.text for r in responses[:-1]])
        seen = json.dumps(model.requests[-1]["messages"])
        assert "remember walnut" in seen and "Noted: walnut." in seen
        await stop(server, signal.SIGKILL)

        server = spawn("--agents", agents)
        await server.wait_ready()
        shown = await webview_messages(server.target, "cc")
        texts = [m.text for m in shown]
        assert texts.count("Noted: walnut.") == 1 and texts.count("The word was walnut.") == 1, texts
        assert infos(shown) == []
        assert await final(server.target, "cc", "claude", "and now?") == "Still walnut."
        seen = json.dumps(model.requests[-1]["messages"])
        assert "remember walnut" in seen and "which word?" in seen


async def test_sigterm_cancels_a_running_turn_after_the_grace_and_the_agent_keeps_it(spawn: Any,
                                                                                      tmp_path: Path) -> None:
    """The drain waits the grace period for the running turn, then cancels it: the agent gets
    session/cancel and records the cut-off turn before it is stopped; the handle stays, so the next
    uibus resumes the conversation with that turn in it."""
    _need_acp()
    entry = loading_fixture(tmp_path)
    entry["options"]["env"]["ACP_FIXTURE_CANCEL_MS"] = "1500"  # longer than SETTLE_S: the close waits for it
    agents = write_agents(tmp_path, [entry])
    server = spawn("--agents", agents, "--grace-seconds", "1")
    await server.wait_ready()
    assert await final(server.target, "t", "acp", "one") == "Turn 1: one"
    async with Connection(server.target, session="t") as conn:
        call = Agent(conn, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
        await asyncio.wait_for(call.read(), 30)  # running
        server.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for _ in call:
                pass
        assert await asyncio.to_thread(server.proc.wait, 30) == 0
    server.stop()
    assert [e for e in fixture_log(tmp_path) if "cancelled" in e]  # the agent saw the cancel
    server = spawn("--agents", agents)
    await server.wait_ready()
    assert await final(server.target, "t", "acp", "three") == "Turn 3: three"  # turn 2 was kept


# ---- in one process: idle close, load replay, fresh starts, the option, the handle's life ----


async def test_an_idle_agent_is_closed_and_the_next_turn_resumes_it_with_no_replay(config: Config,
                                                                                   tmp_path: Path) -> None:
    _need_acp()
    async with hosting(config, tmp_path, [loading_fixture(tmp_path, idle_seconds=0.3)], http_port=free_port()) as app:
        sessions = app.core.agent_sessions
        async with Connection(f"127.0.0.1:{app.port}", session="idle") as conn:
            assert (await turn_of(conn, "acp", "one"))[-1].response.text == "Turn 1: one"
            assert (await turn_of(conn, "acp", "two"))[-1].response.text == "Turn 2: two"
            await wait_for(lambda: sessions.closed_idle == 1 and sessions.count() == 0, timeout=10,
                           what="the idle close")
            webview = asyncio.ensure_future(webview_messages(f"127.0.0.1:{app.port}", "idle", quiet_s=1.5))
            await asyncio.sleep(0.3)
            responses = await turn_of(conn, "acp", "three", maximal=True)
            shown = await webview
        assert responses[-1].response.text == "Turn 3: three"  # the conversation went on
        assert "".join(r.response.text for r in responses if r.response.type == AI) == "Turn 3: three"
        loads = [e for e in fixture_log(tmp_path) if "session/load" in e]
        assert len(loads) == 1 and loads[0]["replayed"] == 2  # the replay reached no caller stream ...
        live = [m.text for m in shown]  # ... and no webview: each reply once, no INFO
        assert live.count("Turn 1: one") == 1 and live.count("Turn 2: two") == 1 and live.count("Turn 3: three") == 1
        assert infos(shown) == []
        assert (sessions.handles.resumed, sessions.handles.resume_failed) == (1, 0)
        metrics = await scrape_by_name(app)
        assert (metrics["uibus_agent_conversations_resumed_total"], metrics["uibus_agent_resumes_failed_total"]) \
            == (1.0, 0.0)


async def _fresh_after_idle(config: Config, tmp_path: Path, entry: dict[str, Any], first: str,
                            second: str) -> tuple[Any, list[ui_pb2.ClineMessage], str, list[str]]:
    """Two turns with an idle close between them; what a webview opened afterwards is sent, and the
    notifies an extension UI open meanwhile got."""
    async with hosting(config, tmp_path, [entry]) as app:
        sessions = app.core.agent_sessions
        name = entry["name"]
        async with Connection(f"127.0.0.1:{app.port}", session="fresh") as conn:
            assert (await turn_of(conn, name, "one"))[-1].response.text == first
            await wait_for(lambda: sessions.closed_idle == 1, timeout=10, what="the idle close")
            (ui,) = await open_uis(app, conn, 1, "fresh")
            answer = (await turn_of(conn, name, "two"))[-1].response.text
            notified = []
            with contextlib.suppress(TimeoutError):
                for _ in range(10):
                    event = await read(ui, 0.5)
                    if event.HasField("request") and event.request.HasField("notify"):
                        notified.append(event.request.notify.message)
            ui.cancel()
        await app.core.feed.recent.flush()
        shown = await webview_messages(f"127.0.0.1:{app.port}", "fresh")  # what a webview opened now is sent
        assert answer == second
        handle = await app.store.get("fresh", HANDLE + name)
        return sessions.handles, shown, json.dumps(handle), notified


async def test_an_acp_agent_without_load_session_starts_fresh_and_says_so_once(config: Config,
                                                                              tmp_path: Path) -> None:
    _need_acp()
    handles, shown, _, notified = await _fresh_after_idle(
        config, tmp_path, fixture_agent(tmp_path, idle_seconds=0.3), "Turn 1: one", "Turn 1: two")
    (info,) = infos(shown)
    assert "acp starts a new conversation" in info and "neither session/load nor session/resume" in info
    assert notified == [info]  # and once at the extension UIs
    assert (handles.resumed, handles.resume_failed) == (0, 1)


async def test_pi_without_a_session_file_starts_fresh_and_says_so_once(config: Config, tmp_path: Path) -> None:
    require("pi (npm ci --prefix tests/pi)", PI.exists(), "node")
    async with scripted_model() as model:
        model.script(Reply(text="First."), Reply(text="Fresh."))
        handles, shown, handle, notified = await _fresh_after_idle(
            config, tmp_path, pi_agent(tmp_path, model, idle_seconds=0.3), "First.", "Fresh.")
        assert "First." not in json.dumps(model.requests[1])
    (info,) = infos(shown)
    assert "pi starts a new conversation" in info and "--no-session" in info
    assert notified == [info]
    assert (handles.resumed, handles.resume_failed) == (0, 1)
    assert handle == '{"sessionFile": null}'


async def test_pi_whose_session_file_is_gone_starts_fresh_and_says_so_once(config: Config, tmp_path: Path) -> None:
    """pi would take a missing session file for a new, empty session and say success."""
    require("pi (npm ci --prefix tests/pi)", PI.exists(), "node")
    async with scripted_model() as model:
        model.script(Reply(text="First."), Reply(text="Fresh."))
        entry = pi_with_sessions(tmp_path, model, idle_seconds=0.3)
        async with hosting(config, tmp_path, [entry]) as app:
            async with Connection(f"127.0.0.1:{app.port}", session="gone") as conn:
                assert (await turn_of(conn, "pi", "one"))[-1].response.text == "First."
                await wait_for(lambda: app.core.agent_sessions.closed_idle == 1, timeout=10, what="the idle close")
                handle = await app.store.get("gone", HANDLE + "pi")
                Path(handle["sessionFile"]).unlink()  # the storage was lost (no shared volume)
                assert (await turn_of(conn, "pi", "two"))[-1].response.text == "Fresh."
            await app.core.feed.recent.flush()
            (info,) = infos(await webview_messages(f"127.0.0.1:{app.port}", "gone"))
            assert f"its session file {handle['sessionFile']} is gone" in info
            assert app.core.agent_sessions.handles.resume_failed == 1
        assert "First." not in json.dumps(model.requests[1])


async def test_resume_false_starts_fresh_silently_and_keeps_no_handle(config: Config, tmp_path: Path) -> None:
    _need_acp()
    handles, shown, handle, notified = await _fresh_after_idle(
        config, tmp_path, loading_fixture(tmp_path, idle_seconds=0.3, resume=False), "Turn 1: one", "Turn 1: two")
    assert infos(shown) == [] and notified == [] and handle == "null"
    assert (handles.resumed, handles.resume_failed) == (0, 0)
    assert [e for e in fixture_log(tmp_path) if "session/load" in e] == []


async def test_a_failed_load_starts_fresh_and_says_so_once(config: Config, tmp_path: Path) -> None:
    _need_acp()
    entry = loading_fixture(tmp_path, idle_seconds=0.3)
    async with hosting(config, tmp_path, [entry]) as app:
        async with Connection(f"127.0.0.1:{app.port}", session="lost") as conn:
            assert (await turn_of(conn, "acp", "one"))[-1].response.text == "Turn 1: one"
            await wait_for(lambda: app.core.agent_sessions.closed_idle == 1, timeout=10, what="the idle close")
            for kept in (tmp_path / "acp-state").iterdir():  # the agent lost its storage (no shared volume)
                kept.unlink()
            assert (await turn_of(conn, "acp", "two"))[-1].response.text == "Turn 1: two"
        shown = await webview_messages(f"127.0.0.1:{app.port}", "lost")
        (info,) = infos(shown)
        assert "session/load failed: Invalid params: Session not found (JSON-RPC -32602)" in info
        assert app.core.agent_sessions.handles.resume_failed == 1


async def test_the_handle_is_deleted_with_its_session(config: Config, tmp_path: Path) -> None:
    _need_acp()
    async with hosting(replace(config, max_sessions=1), tmp_path, [loading_fixture(tmp_path)]) as app:
        async with Connection(f"127.0.0.1:{app.port}", session="a") as a:
            await turn_of(a, "acp", "one")
        assert (await app.store.get("a", HANDLE + "acp"))["sessionId"].startswith("fixture-")
        async with Connection(f"127.0.0.1:{app.port}", session="b") as b:
            await turn_of(b, "acp", "one")  # session a is evicted (max_sessions = 1), its handle with it
        assert await app.store.get("a", HANDLE + "acp") is None
        await wait_for(lambda: app.core.agent_sessions.closed_evicted == 1, timeout=15, what="a's agent closed")


# ---- no orphans ----


async def test_a_sigkilled_uibus_takes_every_agent_group_with_it(spawn: Any, tmp_path: Path) -> None:
    """claude-code-acp 0.16.2 and codex-acp 0.16 ignore the end of their input; the fixture agent
    is the control."""
    _need_acp()
    require("Claude Code's ACP adapter (npm ci --prefix tests/acp)", CLAUDE_ACP.exists(), "node")
    require("codex-acp with its linux-x64 binary (npm ci --prefix tests/acp)", CODEX.exists(), "node")
    async with claude_model() as model, responses_model() as codex_model:
        model.script(Say("Here."))
        codex_model.script(Say("Codex here."))
        claude = claude_agent(tmp_path, model)
        codex = codex_agent(tmp_path, codex_model)
        fixture = fixture_agent(tmp_path)
        dirs = [tmp_path / "work", tmp_path / "other", tmp_path / "codex-work"]
        for where in dirs[1:]:
            where.mkdir()
        fixture["options"]["cwd"], codex["options"]["cwd"] = str(dirs[1]), str(dirs[2])
        server = spawn("--agents", write_agents(tmp_path, [claude, fixture, codex]))
        await server.wait_ready()
        assert await final(server.target, "o", "claude", "hi") == "Here."
        assert await final(server.target, "o", "acp", "hi") == "Turn 1: hi"
        assert await final(server.target, "o", "codex", "hi") == "Codex here."
        groups = {os.getpgid(pid) for where in dirs for pid in agent_pids(where)}
        assert len(groups) == 3 and all(group_alive(g) for g in groups)
        server.proc.kill()
        await asyncio.to_thread(server.proc.wait, 10)
        await wait_for(lambda: all(group_alive(g) == [] for g in groups), timeout=5,
                       what="every agent group to go with its uibus")


def test_the_resume_option_is_checked(tmp_path: Path) -> None:
    from uibus.agents.config import load_agents

    bad = write_agents(tmp_path, [{"name": "x", "backend": "acp", "options": {"command": ["sh"], "resume": "yes"}}])
    with pytest.raises(ValueError, match="option 'resume' must be bool"):
        load_agents(bad)


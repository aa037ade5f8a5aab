"""uibus served to editors over ACP: the official SDK's client app (tests/acp/editor.mjs, on
`@agentclientprotocol/sdk` pinned by tests/acp/package-lock.json) attached the two ways an editor
attaches — spawning `uibus acp` (stdio), and over `/acp` on the HTTP port (the SDK's WebSocket
transport) — to a running uibus hosting the real pi on the scripted model (tests/pikit.py) and the
ACP fixture agent (tests/acp/fixture-agent.mjs). The session's other UIs are the real ones: a
neuro-san StreamingChat client, ExtensionUiService UI streams.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO, free_port, require, running, wait_for
from tests.ext_ui_helpers import open_uis, read
from tests.pikit import PI, Model, Reply, hosting, pi_agent, scripted_model, turn_of
from tests.support import ext, needs
from tests.test_acp_agent import fixture_agent, fixture_log
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.domain.recent import MAX_RECENT
from uibus.infra import kinds
from uibus.infra.config import Config
from uibus.pb.cline import ui_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2, sessions_pb2_grpc

pytestmark = [pytest.mark.timeout(120), pytest.mark.node]
EDITOR = REPO / "tests" / "acp" / "editor.mjs"
UIBUS = str(Path(sys.executable).parent / "uibus")
CWD = "/tmp"


class EditorProc:
    """One editor (the SDK's client app) and what it saw."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: list[dict[str, Any]] = []
        self.times: list[float] = []  # when each event arrived (loop time)
        self._new = asyncio.Event()
        self._tag = 0
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            event = json.loads(line)
            result = event.get("result")
            if isinstance(result, dict) and "_meta" in result:  # the session-log cursor (uibus/seq), kept apart:
                event["meta"] = result.pop("_meta")  # the tests compare the answers themselves
            self.events.append(event)
            self.times.append(asyncio.get_running_loop().time())
            self._new.set()

    def send(self, **op: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(op) + "\n").encode())

    async def until(self, predicate: Any, timeout: float = 30, what: str = "event") -> dict[str, Any]:
        """The first event (from the start) that `predicate` accepts."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        seen = 0
        while True:
            for event in self.events[seen:]:
                if predicate(event):
                    return event
            seen = len(self.events)
            self._new.clear()
            left = end - loop.time()
            if left <= 0:
                raise AssertionError(f"no {what} in {timeout}s; saw {self.events[-12:]}")
            try:
                await asyncio.wait_for(self._new.wait(), left)
            except TimeoutError:
                pass

    def start(self, method: str, params: dict[str, Any]) -> int:
        self._tag += 1
        self.send(op="request", tag=self._tag, method=method, params=params)
        return self._tag

    async def answer_of(self, tag: int, timeout: float = 30) -> dict[str, Any]:
        return await self.until(lambda e: e.get("tag") == tag, timeout, f"answer to request {tag}")

    async def call(self, method: str, params: dict[str, Any], timeout: float = 30) -> Any:
        event = await self.answer_of(self.start(method, params), timeout)
        assert event["ev"] == "response", event
        return event["result"]

    async def fails(self, method: str, params: dict[str, Any]) -> tuple[int, str]:
        event = await self.answer_of(self.start(method, params))
        assert event["ev"] == "error", event
        return event["code"], event["message"]

    def updates(self, session: str, start: int = 0) -> list[dict[str, Any]]:
        return [e["params"]["update"] for e in self.events[start:]
                if e["ev"] == "update" and e["params"]["sessionId"] == session]

    def text(self, session: str, kind: str = "agent_message_chunk", start: int = 0) -> str:
        return "".join(u["content"]["text"] for u in self.updates(session, start) if u["sessionUpdate"] == kind)

    async def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        await self._reader


async def editor(*args: str) -> EditorProc:
    node = shutil.which("node") or "node"
    proc = await asyncio.create_subprocess_exec(node, str(EDITOR), *args, cwd=EDITOR.parent,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    return EditorProc(proc)


async def spawned(app: App, agent: str, *extra: str) -> EditorProc:
    """An editor that spawns `uibus acp --agent AGENT` against `app`, initialized."""
    ed = await editor("stdio", UIBUS, "acp", "--agent", agent, "--target", f"127.0.0.1:{app.port}", *extra)
    await ed.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
    return ed


def need_sdk() -> None:
    require("the pinned pi agent and ACP SDK (npm ci --prefix tests/pi, tests/acp)",
            PI.exists() and (EDITOR.parent / "node_modules" / "@agentclientprotocol" / "sdk").exists(), "node")


@pytest.fixture
@needs("node")
async def model() -> AsyncIterator[Model]:
    need_sdk()
    async with scripted_model() as m:
        yield m


@pytest.fixture
async def app(config: Config, model: Model, tmp_path: Path) -> AsyncIterator[App]:
    async with hosting(config, tmp_path, [pi_agent(tmp_path, model), fixture_agent(tmp_path)]) as app:
        yield app


async def test_initialize_new_session_and_a_prompt_streaming_pis_reply(app: App, model: Model) -> None:
    model.script(Reply(thinking="Let me think. ", text="Hello from pi, over ACP."))
    ed = await editor("stdio", UIBUS, "acp", "--agent", "pi", "--target", f"127.0.0.1:{app.port}")
    try:
        init = await ed.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        assert init["protocolVersion"] == 1 and init["agentCapabilities"]["loadSession"] is True
        assert set(init["agentCapabilities"]["sessionCapabilities"]) >= {"resume", "close"}
        session = (await ed.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
        answer = await ed.call("session/prompt", {"sessionId": session, "prompt": [{"type": "text", "text": "hi"}]})
        assert answer == {"stopReason": "end_turn"}
        assert ed.text(session) == "Hello from pi, over ACP."
        assert ed.text(session, "agent_thought_chunk") == "Let me think. "
        chunks = [u for u in ed.updates(session) if u["sessionUpdate"] == "agent_message_chunk"]
        assert len(chunks) > 1  # streamed as it came, not as one answer at the end
        # one connection, several sessions: each its own conversation (its own pi process)
        model.script(Reply(text="A fresh start."))
        other = (await ed.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
        assert other != session
        assert (await ed.call("session/prompt", prompt(other, "who?")))["stopReason"] == "end_turn"
        assert ed.text(other) == "A fresh start." and ed.text(session) == "Hello from pi, over ACP."
        assert [m["role"] for m in model.requests[-1]["messages"]] in (["user"], ["system", "user"])
    finally:
        await ed.close()


def streams(app: App, session: str) -> tuple[int, int]:
    """The session's feed (partial-message) and dialog subscriptions: one each per attached editor."""
    return app.bus.count(kinds.PARTIAL_MESSAGE, session), app.bus.count(kinds.EXTENSION_UI, session)


def prompt(session: str, text: str) -> dict[str, Any]:
    return {"sessionId": session, "prompt": [{"type": "text", "text": text}]}


def asks(ed: EditorProc) -> list[dict[str, Any]]:
    return [e for e in ed.events if e["ev"] == "ask"]


async def test_pis_permission_gate_reaches_the_editor_and_the_other_uis_and_block_is_honoured(
        app: App, model: Model, tmp_path: Path) -> None:
    victim = tmp_path / "work" / "victim"
    victim.mkdir(parents=True)
    blocked = "rm -rf victim && echo gone"
    model.script(Reply(text="Let me clean up. ", tool=("bash", {"command": blocked})), Reply(text="It was blocked."))
    ed = await spawned(app, "pi")
    try:
        session = (await ed.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
        async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:
            (ui,) = await open_uis(app, conn, 1, session)
            tag = ed.start("session/prompt", prompt(session, "clean up"))
            question = await ed.until(lambda e: e["ev"] == "ask", what="permission request")
            assert question["method"] == "session/request_permission"
            params = question["params"]
            assert params["sessionId"] == session and params["toolCall"]["title"] == f"Dangerous command: {blocked}"
            assert [(o["optionId"], o["name"], o["kind"]) for o in params["options"]] == [
                ("Allow", "Allow", "allow_once"), ("Block", "Block", "reject_once")]
            shown = (await read(ui, 10)).request  # the same question at the session's other UI, meanwhile
            assert shown.select.title == f"Dangerous command: {blocked}"
            ed.send(op="answer", id=question["id"], result={"outcome": {"outcome": "selected", "optionId": "Block"}})
            assert (await read(ui, 10)).closed.reason == pb.DIALOG_OUTCOME_ANSWERED
            assert (await ed.answer_of(tag))["result"] == {"stopReason": "end_turn"}
        assert victim.is_dir()  # the command never ran
        calls = [u for u in ed.updates(session) if u["sessionUpdate"] in ("tool_call", "tool_call_update")]
        assert calls[0]["sessionUpdate"] == "tool_call" and calls[0]["kind"] == "execute"
        assert calls[0]["title"] == blocked and calls[-1]["status"] == "failed"
        assert "Blocked by user" in calls[-1]["content"][0]["content"]["text"]
        assert ed.text(session) == "Let me clean up. \n\nIt was blocked."
        later = await spawned(app, "pi")  # the transcript shows the tool call too
        try:
            await later.call("session/load", {"sessionId": session, "cwd": CWD, "mcpServers": []})
            replayed = [u for u in later.updates(session) if u["sessionUpdate"] in ("tool_call", "tool_call_update")]
            assert (replayed[0]["sessionUpdate"], replayed[0]["kind"], replayed[0]["title"]) == (
                "tool_call", "execute", blocked)
            assert "Blocked by user" in replayed[-1]["content"][0]["content"]["text"]
            assert later.text(session, "user_message_chunk") == "clean up"
        finally:
            await later.close()
    finally:
        await ed.close()


async def test_a_neuro_san_turn_shows_live_and_a_second_editor_loads_the_session_and_continues_it(
        app: App, model: Model) -> None:
    model.script(Reply(text="First answer."), Reply(text="Answer to another UI."), Reply(text="Continued here."))
    first = await spawned(app, "pi")
    second = None
    try:
        session = (await first.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
        assert (await first.call("session/prompt", prompt(session, "hello")))["stopReason"] == "end_turn"
        mark = len(first.events)
        async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:
            answer = (await turn_of(conn, "pi", "from elsewhere"))[-1].response.text
        assert answer == "Answer to another UI."
        await first.until(lambda _: first.text(session, start=mark) == "Answer to another UI.", 10,
                          "the other UI's turn, live")
        live = [(u["sessionUpdate"], u["content"]["text"]) for u in first.updates(session, mark) if "content" in u]
        assert live[0] == ("user_message_chunk", "from elsewhere")  # the question too, before its answer
        assert first.text(session, "user_message_chunk") == "from elsewhere"  # its own question not echoed

        second = await spawned(app, "pi")
        listed = {s["sessionId"]: s for s in (await second.call("session/list", {}))["sessions"]}
        assert listed[session]["title"] == "hello" and listed[session]["updatedAt"].endswith("Z")
        start = len(second.events)
        assert await second.call("session/load", {"sessionId": session, "cwd": CWD, "mcpServers": []}) == {}
        replay = second.updates(session, start)  # all of it came before the answer
        said = [(u["sessionUpdate"], u["content"]["text"]) for u in replay if "content" in u]
        assert said == [("user_message_chunk", "hello"), ("agent_message_chunk", "First answer."),
                        ("user_message_chunk", "from elsewhere"), ("agent_message_chunk", "Answer to another UI.")]

        mark, mark2 = len(first.events), len(second.events)
        assert (await second.call("session/prompt", prompt(session, "and now?")))["stopReason"] == "end_turn"
        assert second.text(session, start=mark2) == "Continued here."
        asked = [m["content"] for m in model.requests[-1]["messages"] if m["role"] == "user"]
        assert [a if isinstance(a, str) else a[0]["text"] for a in asked] == ["hello", "from elsewhere", "and now?"]
        await first.until(lambda _: first.text(session, start=mark) == "Continued here.", 10, "the turn, live")
        assert first.text(session, "user_message_chunk", start=mark) == "and now?"
        await asyncio.sleep(0.3)
        assert second.text(session, start=mark2) == "Continued here."  # its own turn not shown twice
        assert second.text(session, "user_message_chunk", start=mark2) == ""
    finally:
        await first.close()
        if second is not None:
            await second.close()


async def test_session_cancel_stops_a_running_turn_and_the_hosted_agent_sees_it(app: App, tmp_path: Path) -> None:
    ed = await spawned(app, "acp")
    try:
        session = (await ed.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
        tag = ed.start("session/prompt", prompt(session, "slow"))
        await ed.until(lambda _: ed.text(session) == "Working ", 30, "the first chunk")
        ed.send(op="notify", method="session/cancel", params={"sessionId": session})
        assert (await ed.answer_of(tag, 10))["result"] == {"stopReason": "cancelled"}
        await wait_for(lambda: any("cancelled" in line for line in fixture_log(tmp_path)), 10,
                       what="the agent's cancel")
        # the session goes on: the next prompt is a new turn
        assert (await ed.call("session/prompt", prompt(session, "again")))["stopReason"] == "end_turn"
        assert ed.text(session).endswith("Turn 2: again")
        # the editor withdraws its prompt ($/cancel_request): -32800, and the turn stops the same way
        tag = ed.start("session/prompt", prompt(session, "slow"))
        await ed.until(lambda _: ed.text(session).endswith("Working "), 30, "the first chunk")
        ed.send(op="withdraw", tag=tag)
        answer = await ed.answer_of(tag, 10)
        assert (answer["ev"], answer["code"]) == ("error", -32800), answer
        await wait_for(lambda: sum("cancelled" in line for line in fixture_log(tmp_path)) == 2, 10,
                       what="the agent's second cancel")
        assert (await ed.call("session/prompt", prompt(session, "and again")))["stopReason"] == "end_turn"
        # a turn another UI stops (SessionService.StopTurn) ends the editor's prompt `cancelled` too
        tag = ed.start("session/prompt", prompt(session, "slow"))
        await ed.until(lambda _: ed.text(session).endswith("Working "), 30, "the first chunk")
        async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:
            stop = conn.channel.unary_unary("/uibus.v1.SessionService/StopTurn",
                                            request_serializer=sessions_pb2.AgentRequest.SerializeToString,
                                            response_deserializer=sessions_pb2.StopTurnReply.FromString)
            assert (await stop(sessions_pb2.AgentRequest(agent="acp"))).stopped
        assert (await ed.answer_of(tag, 10))["result"] == {"stopReason": "cancelled"}
    finally:
        await ed.close()


async def test_the_losing_editors_permission_request_is_withdrawn_when_another_ui_answers_first(app: App) -> None:
    one, two = await spawned(app, "acp"), await spawned(app, "acp")
    try:
        session = (await one.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
        assert await two.call("session/resume", {"sessionId": session, "cwd": CWD, "mcpServers": []}) == {}
        tag = one.start("session/prompt", prompt(session, "tour"))
        q1 = await one.until(lambda e: e["ev"] == "ask", what="the question at editor one")
        q2 = await two.until(lambda e: e["ev"] == "ask", what="the question at editor two")
        assert [o["name"] for o in q1["params"]["options"]] == ["Always Allow", "Allow", "Reject"]
        assert [o["kind"] for o in q2["params"]["options"]] == ["allow_always", "allow_once", "reject_once"]
        async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:
            (ui,) = await open_uis(app, conn, 1, session)
            pending = (await read(ui, 10)).request  # waiting dialogs come first to a UI that joins
            await ext(conn).Respond(pb.RespondRequest(id=pending.id, value="Allow"))
            ui.cancel()
        await one.until(lambda e: e == {"ev": "withdrawn", "id": q1["id"]}, 10, "editor one's request withdrawn")
        await two.until(lambda e: e == {"ev": "withdrawn", "id": q2["id"]}, 10, "editor two's request withdrawn")
        assert (await one.answer_of(tag))["result"] == {"stopReason": "end_turn"}
        assert one.text(session).endswith("Permission: allow.")
        await two.until(lambda _: two.text(session).endswith("Permission: allow."), 10, "the turn at editor two")
        # session/close detaches editor two only: its streams end, editor one's go on
        await wait_for(lambda: streams(app, session) == (2, 2), 5, what="both editors' feed and dialog streams")
        assert await two.call("session/close", {"sessionId": session}) == {}
        await wait_for(lambda: streams(app, session) == (1, 1), 5, what="editor two's streams ended")
        mark = len(one.events)
        assert (await one.call("session/prompt", prompt(session, "still here?")))["stopReason"] == "end_turn"
        assert one.text(session, start=mark) == "Turn 2: still here?"
    finally:
        await one.close()
        await two.close()
    await wait_for(lambda: streams(app, session) == (0, 0), 5, what="every stream of the editors ended")


async def test_an_attached_editor_gets_the_agents_modes_and_commands_and_sets_a_mode(app: App, tmp_path: Path) -> None:
    one, two = await spawned(app, "acp"), await spawned(app, "acp")
    try:
        session = (await one.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
        assert (await one.call("session/prompt", prompt(session, "diff")))["stopReason"] == "end_turn"
        resumed = await two.call("session/resume", {"sessionId": session, "cwd": CWD, "mcpServers": []})
        assert resumed["modes"]["currentModeId"] == "default"
        assert [m["id"] for m in resumed["modes"]["availableModes"]] == ["default", "plan"]
        offered = [u for u in two.updates(session) if u["sessionUpdate"] == "available_commands_update"]
        assert [c["name"] for c in offered[-1]["availableCommands"]] == ["review", "test"]
        assert await two.call("session/set_mode", {"sessionId": session, "modeId": "plan"}) == {}
        assert {"sessionUpdate": "current_mode_update", "currentModeId": "plan"} in two.updates(session)
        assert any(line.get("session/set_mode", {}).get("modeId") == "plan" for line in fixture_log(tmp_path))
        assert (await two.fails("session/set_mode", {"sessionId": session, "modeId": "nope"}))[0] == -32602
        # the other editor hears of the mode an editor set, and of the commands its own turn brought
        await one.until(lambda e: e.get("params", {}).get("update") == {
            "sessionUpdate": "current_mode_update", "currentModeId": "plan"}, 5, what="the mode set elsewhere")
        offered = [u for u in one.updates(session) if u["sessionUpdate"] == "available_commands_update"]
        assert [c["name"] for c in offered[-1]["availableCommands"]] == ["review", "test"]
        # a mode set through the sessions API (the page, a phone) reaches every attached editor
        marks = len(one.events), len(two.events)
        async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:
            state = await sessions_pb2_grpc.SessionServiceStub(conn.channel).SetMode(
                sessions_pb2.SetModeRequest(agent="acp", mode_id="default"))
        assert state.current_mode == "default"
        news = {"sessionUpdate": "current_mode_update", "currentModeId": "default"}
        for ed, mark in zip((one, two), marks, strict=True):
            await ed.until(lambda _, ed=ed, mark=mark: news in ed.updates(session, mark), 5,
                           what="the mode the sessions API set")
        await asyncio.sleep(0.3)
        for ed, mark in zip((one, two), marks, strict=True):  # once each, and the commands not sent again
            assert ed.updates(session, mark) == [news]
    finally:
        await one.close()
        await two.close()


async def test_bad_input_gets_the_acp_error_and_the_sessions_other_uis_keep_working(app: App, model: Model) -> None:
    ed = await spawned(app, "acp")
    try:
        session = (await ed.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
        assert (await ed.fails("session/prompt", prompt("acp-nobody", "hi")))[0] == -32002
        assert (await ed.fails("session/load", {"sessionId": "acp-never-used", "cwd": CWD, "mcpServers": []}))[0] \
            == -32002
        assert (await ed.fails("session/load", {"sessionId": "bad name!", "cwd": CWD}))[0] == -32602
        assert (await ed.fails("session/new", {"mcpServers": []}))[0] == -32602
        assert (await ed.fails("session/prompt", {"sessionId": session, "prompt": "hi"}))[0] == -32602
        assert (await ed.fails("session/prompt", {"sessionId": session, "prompt": [{"type": "image", "data": "",
                                                                                     "mimeType": "image/png"}]}))[0] \
            == -32602
        assert (await ed.fails("session/fly", {}))[0] == -32601
        tag = ed.start("session/prompt", prompt(session, "slow"))
        await ed.until(lambda _: ed.text(session) == "Working ", 30, "the first chunk")
        code, message = await ed.fails("session/prompt", prompt(session, "meanwhile"))
        assert code == -32600 and "already running" in message
        async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:  # another UI, meanwhile
            model.script(Reply(text="pi still answers."))
            assert (await turn_of(conn, "pi", "hello"))[-1].response.text == "pi still answers."
        ed.send(op="notify", method="session/cancel", params={"sessionId": session})
        assert (await ed.answer_of(tag, 10))["result"] == {"stopReason": "cancelled"}
        # the hosted agent's refusal is the editor's `refusal`; its failure an answer that says so
        assert (await ed.call("session/prompt", prompt(session, "refuse"))) == {"stopReason": "refusal"}
        mark = len(ed.events)  # the hosted agent's other stop reasons pass through as they are
        assert (await ed.call("session/prompt", prompt(session, "limit"))) == {"stopReason": "max_tokens"}
        assert ed.text(session, start=mark) == "Cut short "
        async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:  # in the final message's structure
            for said, reason in (("limit", "max_tokens"), ("refuse", "refusal"), ("hello", "end_turn")):
                final = (await turn_of(conn, "acp", said))[-1].response
                assert final.structure.fields["stop_reason"].string_value == reason, (said, final)
            assert final.text.startswith("Turn ")
        mark = len(ed.events)
        assert (await ed.call("session/prompt", prompt(session, "fail"))) == {"stopReason": "end_turn"}
        assert "the fixture was told to fail" in ed.text(session, start=mark)
    finally:
        await ed.close()


async def test_a_tenants_editor_names_its_sessions_so_its_token_may_use_them(
        config: Config, model: Model, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("team-a-token team-a-*\n")
    model.script(Reply(text="Hello, team A."))
    async with hosting(config, tmp_path, [pi_agent(tmp_path, model)], tokens_file=str(tokens)) as app:
        ed = await spawned(app, "pi", "--token", "team-a-token")  # the default prefix (acp-) is not theirs
        try:
            code, message = await ed.fails("session/new", {"cwd": CWD, "mcpServers": []})
            assert code == -32000 and message.startswith("uibus: PERMISSION_DENIED"), message
        finally:
            await ed.close()
        ed = await spawned(app, "pi", "--token", "team-a-token", "--session-prefix", "team-a-")
        try:
            session = (await ed.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
            assert session.startswith("team-a-")
            assert (await ed.call("session/prompt", prompt(session, "hi")))["stopReason"] == "end_turn"
            assert ed.text(session) == "Hello, team A."
            listed = [s["sessionId"] for s in (await ed.call("session/list", {}))["sessions"]]
            assert listed == [session]  # only the tenant's sessions
            code, _ = await ed.fails("session/resume", {"sessionId": "team-b-1", "cwd": CWD, "mcpServers": []})
            assert code == -32000
        finally:
            await ed.close()


async def test_an_unreachable_uibus_is_the_editors_error_not_a_dead_session() -> None:
    need_sdk()
    ed = await editor("stdio", UIBUS, "acp", "--agent", "pi", "--target", f"127.0.0.1:{free_port()}")
    try:
        await ed.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        code, message = await ed.fails("session/new", {"cwd": CWD, "mcpServers": []})
        assert code == -32603 and message.startswith("uibus: UNAVAILABLE"), message
    finally:
        await ed.close()


async def test_garbage_on_stdin_is_answered_and_the_connection_goes_on(app: App) -> None:
    proc = await asyncio.create_subprocess_exec(UIBUS, "acp", "--agent", "acp", "--target", f"127.0.0.1:{app.port}",
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(b'{"not json\n[1,2]\n{"jsonrpc":"2.0","id":true,"method":"initialize"}\n'
                         b'{"jsonrpc":"2.0","id":7,"method":"initialize","params":{"protocolVersion":1}}\n')
        answers = [json.loads(await asyncio.wait_for(proc.stdout.readline(), 10)) for _ in range(4)]
        assert [(a.get("id"), a.get("error", {}).get("code")) for a in answers] == [
            (None, -32700), (None, -32600), (None, -32600), (7, None)]
        assert answers[3]["result"]["agentCapabilities"]["loadSession"] is True
    finally:
        proc.stdin.close()
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_the_same_over_acp_websocket_with_a_token_and_refused_from_a_foreign_origin(
        config: Config, model: Model, tmp_path: Path) -> None:
    model.script(Reply(text="Hello over the socket."), Reply(text="Seen by the gRPC client too."))
    async with hosting(config, tmp_path, [pi_agent(tmp_path, model)], auth_token="s3cret",
                       http_port=free_port()) as app:
        url = f"ws://127.0.0.1:{app.http_port}/acp?agent=pi"
        ed = await editor("ws", url, json.dumps({"Authorization": "Bearer s3cret"}))
        try:
            await ed.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            session = (await ed.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
            assert (await ed.call("session/prompt", prompt(session, "hi")))["stopReason"] == "end_turn"
            assert ed.text(session) == "Hello over the socket."
            mark = len(ed.events)
            async with Connection(f"127.0.0.1:{app.port}", session=session, token="s3cret") as conn:
                assert (await turn_of(conn, "pi", "and you?"))[-1].response.text == "Seen by the gRPC client too."
            await ed.until(lambda _: ed.text(session, start=mark) == "Seen by the gRPC client too.", 10,
                           "the gRPC client's turn, live over the socket")
        finally:
            await ed.close()
        again = await editor("ws", url, json.dumps({"Authorization": "Bearer s3cret"}))  # the transcript too
        try:
            await again.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            await again.call("session/load", {"sessionId": session, "cwd": CWD, "mcpServers": []})
            assert [(u["sessionUpdate"], u["content"]["text"]) for u in again.updates(session) if "content" in u] == [
                ("user_message_chunk", "hi"), ("agent_message_chunk", "Hello over the socket."),
                ("user_message_chunk", "and you?"), ("agent_message_chunk", "Seen by the gRPC client too.")]
        finally:
            await again.close()
        stdio = await spawned(app, "pi", "--token", "wrong")  # `uibus acp` hears uibus's refusal as ACP's
        try:
            code, message = await stdio.fails("session/new", {"cwd": CWD, "mcpServers": []})
            assert code == -32000 and message.startswith("uibus: UNAUTHENTICATED"), message
        finally:
            await stdio.close()
        for headers, status in (({}, "401"), ({"Authorization": "Bearer wrong"}, "401"),
                                ({"Authorization": "Bearer s3cret", "Origin": "https://evil.example"}, "403")):
            refused = await editor("ws", url, json.dumps(headers))
            try:
                refused.start("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
                error = await refused.until(lambda e: e["ev"] == "socket_error", 10, "the refusal")
                assert error["message"] == f"Unexpected server response: {status}", (headers, error)
                await refused.until(lambda e: e["ev"] == "closed", 10, "the connection closed")
                assert not [e for e in refused.events if e["ev"] == "response"]
            finally:
                await refused.close()


async def test_the_same_over_acp_streamable_http_with_a_token_and_refused_from_a_foreign_origin(
        config: Config, model: Model, tmp_path: Path) -> None:
    model.script(Reply(text="Hello over HTTP."), Reply(text="Seen by the gRPC client too."))
    async with hosting(config, tmp_path, [pi_agent(tmp_path, model)], auth_token="s3cret",
                       http_port=free_port()) as app:
        url = f"http://127.0.0.1:{app.http_port}/acp?agent=pi"
        token = json.dumps({"Authorization": "Bearer s3cret"})
        ed = await editor("http", url, token)
        try:
            init = await ed.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            assert init["agentCapabilities"]["loadSession"] is True
            session = (await ed.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
            assert (await ed.call("session/prompt", prompt(session, "hi")))["stopReason"] == "end_turn"
            assert ed.text(session) == "Hello over HTTP."  # the session's stream (SSE) carried the reply
            mark = len(ed.events)
            async with Connection(f"127.0.0.1:{app.port}", session=session, token="s3cret") as conn:
                assert (await turn_of(conn, "pi", "and you?"))[-1].response.text == "Seen by the gRPC client too."
            await ed.until(lambda _: ed.text(session, start=mark) == "Seen by the gRPC client too.", 10,
                           "the gRPC client's turn, live over HTTP")
            assert ed.text(session, "user_message_chunk", start=mark) == "and you?"
            assert streams(app, session) == (1, 1)
        finally:
            await ed.close()
        await wait_for(lambda: streams(app, session) == (0, 0), 5, what="the closed connection's streams ended")
        again = await editor("http", url, token)  # the transcript, replayed before session/load's answer
        try:
            await again.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            assert await again.call("session/load", {"sessionId": session, "cwd": CWD, "mcpServers": []}) == {}
            assert [(u["sessionUpdate"], u["content"]["text"]) for u in again.updates(session) if "content" in u] == [
                ("user_message_chunk", "hi"), ("agent_message_chunk", "Hello over HTTP."),
                ("user_message_chunk", "and you?"), ("agent_message_chunk", "Seen by the gRPC client too.")]
            assert (await again.fails("session/prompt", prompt("acp-nobody", "hi")))[0] == -32002
        finally:
            await again.close()
        for headers in ({}, {"Authorization": "Bearer wrong"},
                        {"Authorization": "Bearer s3cret", "Origin": "https://evil.example"}):
            refused = await editor("http", url, json.dumps(headers))
            try:
                event = await refused.answer_of(refused.start("initialize", {"protocolVersion": 1,
                                                                             "clientCapabilities": {}}), 10)
                assert event["ev"] == "error", (headers, event)
                status = 403 if "Origin" in headers else 401
                assert event["message"].startswith(f"ACP initialize failed: {status}"), (headers, event)
            finally:
                await refused.close()


async def test_inputs_reach_an_editor_that_can_elicit_and_confirms_reach_every_editor(app: App) -> None:
    ed = await editor("stdio", UIBUS, "acp", "--agent", "acp", "--target", f"127.0.0.1:{app.port}")
    try:
        await ed.call("initialize", {"protocolVersion": 1, "clientCapabilities": {"elicitation": {"form": {}}}})
        session = (await ed.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
        async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:  # an agent asking, over gRPC
            asking = asyncio.ensure_future(ext(conn).Input(pb.InputRequest(title="Branch name?", placeholder="main")))
            question = await ed.until(lambda e: e["ev"] == "ask", what="the elicitation")
            assert question["method"] == "elicitation/create" and question["params"]["mode"] == "form"
            field = question["params"]["requestedSchema"]["properties"]["value"]
            assert (field["title"], field["description"]) == ("Branch name?", "main")
            ed.send(op="answer", id=question["id"], result={"action": "accept", "content": {"value": "dev"}})
            result = await asyncio.wait_for(asking, 10)
            assert (result.outcome, result.value) == (pb.DIALOG_OUTCOME_ANSWERED, "dev")

            asking = asyncio.ensure_future(ext(conn).Confirm(pb.ConfirmRequest(title="Push?", message="to origin")))
            question = await ed.until(lambda e: e["ev"] == "ask" and e["params"].get("toolCall"), what="the confirm")
            assert question["params"]["toolCall"]["title"] == "Push?\n\nto origin"
            ed.send(op="answer", id=question["id"], result={"outcome": {"outcome": "selected", "optionId": "yes"}})
            assert (await asyncio.wait_for(asking, 10)).confirmed is True
    finally:
        await ed.close()


PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


async def test_initialize_passes_the_hosted_agents_prompt_capabilities_and_images_become_attachments(
        app: App, tmp_path: Path) -> None:
    first = await editor("stdio", UIBUS, "acp", "--agent", "acp", "--target", f"127.0.0.1:{app.port}")
    pi = await editor("stdio", UIBUS, "acp", "--agent", "pi", "--target", f"127.0.0.1:{app.port}")
    second = None
    try:
        init = await first.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        # the ACP agent never started here: uibus's own baseline (text, embedded text inlined)
        assert init["agentCapabilities"]["promptCapabilities"] == {"image": False, "audio": False,
                                                                   "embeddedContext": True}
        init = await pi.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        assert init["agentCapabilities"]["promptCapabilities"]["image"] is True  # pi's prompt takes images
        session = (await first.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
        image = {"type": "image", "mimeType": "image/png", "data": PNG}
        code, message = await first.fails("session/prompt", {"sessionId": session, "prompt": [
            {"type": "text", "text": "look"}, image]})
        assert code == -32602 and "takes no images" in message  # not advertised: refused, nothing sent
        assert (await first.call("session/prompt", prompt(session, "hello")))["stopReason"] == "end_turn"

        second = await editor("stdio", UIBUS, "acp", "--agent", "acp", "--target", f"127.0.0.1:{app.port}")
        init = await second.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        # what the fixture's initialize said (image: true, embeddedContext: false), embedded text inlined
        assert init["agentCapabilities"]["promptCapabilities"] == {"image": True, "audio": False,
                                                                   "embeddedContext": True}
        await second.call("session/resume", {"sessionId": session, "cwd": CWD, "mcpServers": []})
        answer = await second.call("session/prompt", {"sessionId": session, "prompt": [
            {"type": "text", "text": "what is this?"}, image]})
        assert answer == {"stopReason": "end_turn"}
        assert {"attached": [{"type": "image", "mimeType": "image/png", "bytes": len(PNG)}]} in fixture_log(tmp_path)
        blob = {"type": "resource", "resource": {"uri": "file:///a.bin", "mimeType": "application/zip",
                                                 "blob": "UEsDBA=="}}
        code, message = await second.fails("session/prompt", {"sessionId": session, "prompt": [
            {"type": "text", "text": "unzip"}, blob]})
        assert code == -32602 and "takes no attached files" in message
        code, message = await second.fails("session/prompt", {"sessionId": session, "prompt": [
            {"type": "text", "text": "x"}, {**image, "data": "not base64!"}]})
        assert code == -32602 and "base64" in message
    finally:
        for ed in (first, pi, second):
            if ed is not None:
                await ed.close()


async def test_acp_over_http_refuses_what_the_transport_does_not_allow(config: Config) -> None:
    """The Streamable HTTP framing's own errors, as the SDK's server gives them, over raw HTTP."""
    tokens = replace(config, http_port=free_port(), auth_token="s3cret")
    async with running(tokens) as app, httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}") as http:
        auth = {"Authorization": "Bearer s3cret"}
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}}
        assert (await http.post("/acp", content=json.dumps(init), headers=auth)).status_code == 415
        assert (await http.post("/acp", json=init)).status_code == 401
        opened = await http.post("/acp", json=init, headers=auth)
        assert opened.status_code == 200 and opened.json()["result"]["protocolVersion"] == 1
        conn = {**auth, "Acp-Connection-Id": opened.headers["acp-connection-id"]}
        assert (await http.post("/acp", json=init, headers=conn)).status_code == 400  # initialize once
        new = {"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": CWD, "mcpServers": []}}
        assert (await http.post("/acp", json=new, headers=auth)).status_code == 400  # no connection named
        assert (await http.post("/acp", json=new, headers={**auth, "Acp-Connection-Id": "nope"})).status_code == 404
        prompting = {"jsonrpc": "2.0", "id": 3, "method": "session/prompt", "params": prompt("s1", "hi")}
        missing = await http.post("/acp", json=prompting, headers=conn)
        assert (missing.status_code, missing.text) == (400, "Missing Acp-Session-Id")
        mismatched = await http.post("/acp", json=prompting, headers={**conn, "Acp-Session-Id": "s2"})
        assert (mismatched.status_code, mismatched.text) == (400, "Mismatched Acp-Session-Id")
        assert (await http.post("/acp", json=[new], headers=conn)).json()["error"]["code"] == -32600
        assert (await http.get("/acp", headers=conn)).status_code == 406  # not asking for SSE
        assert (await http.put("/acp", headers=conn)).status_code == 405
        async with http.stream("GET", "/acp", headers={**conn, "Accept": "text/event-stream"}) as events:
            assert events.status_code == 200
            again = await http.get("/acp", headers={**conn, "Accept": "text/event-stream"})
            assert again.status_code == 409  # one reader per stream
            assert (await http.post("/acp", json=new, headers=conn)).status_code == 202
            lines = events.aiter_lines()
            assert await asyncio.wait_for(anext(lines), 10) == "id: 1"  # each event has its id (resumption)
            line = await asyncio.wait_for(anext(lines), 10)
            assert json.loads(line.removeprefix("data: "))["result"]["sessionId"].startswith("acp-")
        assert app.bus.count(kinds.PARTIAL_MESSAGE) == 1  # the session stays attached while its connection lives
        assert (await http.delete("/acp", headers=conn)).status_code == 202
        await wait_for(lambda: app.bus.count(kinds.PARTIAL_MESSAGE) == 0, 5, what="the connection's session detached")
        assert (await http.post("/acp", json=new, headers=conn)).status_code == 404  # gone


LONG = MAX_RECENT  # the longest transcript the feed keeps (200 messages): the replay takes a while to stream


async def test_session_load_answers_right_after_the_whole_replay_without_a_quiet_wait(
        config: Config, model: Model, tmp_path: Path) -> None:
    """The feed marks the end of its replay (WebviewEvent.replay_complete), so session/load answers
    right after the last replayed update (no quiet spell: that was 0.25 s over stdio, 0.5 s over
    /acp), with all of a long transcript before it; a message published right after is live."""
    async with hosting(config, tmp_path, [pi_agent(tmp_path, model)], http_port=free_port()) as app:
        session = "acp-long"
        async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:
            for ts in range(1, LONG + 1):
                say = ui_pb2.USER_FEEDBACK if ts % 2 else ui_pb2.TEXT
                await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=say,
                                                                          text=f"m{ts}"))
            await app.core.feed.recent.flush()
            kept = [f"m{ts}" for ts in range(1, LONG + 1)]  # the transcript the feed keeps, oldest first
            ways = (("stdio", UIBUS), ("ws", f"ws://127.0.0.1:{app.http_port}/acp?agent=pi"))
            for ts, (how, where) in enumerate(ways, LONG + 1):
                args = ("stdio", UIBUS, "acp", "--agent", "pi", "--target", f"127.0.0.1:{app.port}") \
                    if how == "stdio" else ("ws", where, "{}")
                ed = await editor(*args)
                try:
                    await ed.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
                    start = len(ed.events)
                    tag = ed.start("session/load", {"sessionId": session, "cwd": CWD, "mcpServers": []})
                    answer = await ed.answer_of(tag)
                    assert answer["ev"] == "response", answer
                    at = ed.events.index(answer)
                    said = [u["content"]["text"] for u in ed.updates(session, start)[: at - start]]
                    assert said == kept, (how, said[:3], said[-3:])
                    last = max(i for i in range(start, at) if ed.events[i]["ev"] == "update")
                    gap = ed.times[at] - ed.times[last]
                    print(f"{how}: replay of {LONG} messages in {ed.times[at] - ed.times[start]:.3f}s, "
                          f"answer {gap * 1000:.1f} ms after its last update")
                    assert gap < 0.2, (how, gap)  # the quiet wait alone was 0.25 s (0.5 s over /acp)

                    live = f"right after, {how}"
                    await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(
                        ts=ts, type=ui_pb2.SAY, say=ui_pb2.TEXT, text=live))
                    await ed.until(lambda _, ed=ed, at=at, live=live: ed.text(session, start=at) == live, 10,
                                   "the live message")
                    kept = [*kept[1:], live]  # the newest 200 by ts
                finally:
                    await ed.close()


async def test_an_acp_image_over_the_websocket_is_held_to_max_message_bytes_as_over_grpc(
        config: Config, model: Model, tmp_path: Path) -> None:
    """Seen by a tenant: an 11 MiB image reached the agent over /acp while gRPC refuses 5 MiB. Now each call
    an /acp editor makes is held to --max-message-bytes (here 1 MiB) as a gRPC client's is."""
    model.script(Reply(text="small enough"))
    async with hosting(config, tmp_path, [pi_agent(tmp_path, model)], http_port=free_port(),
                       max_message_bytes=1024 * 1024, chat_context_bytes=256 * 1024) as app:
        ed = await editor("ws", f"ws://127.0.0.1:{app.http_port}/acp?agent=pi", "{}")
        try:
            init = await ed.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            assert init["agentCapabilities"]["promptCapabilities"]["image"] is True
            session = (await ed.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
            big = base64.b64encode(b"\x89PNG" + bytes(2 * 1024 * 1024)).decode()
            code, message = await ed.fails("session/prompt", {"sessionId": session, "prompt": [
                {"type": "text", "text": "look"}, {"type": "image", "mimeType": "image/png", "data": big}]})
            assert "RESOURCE_EXHAUSTED" in message and "--max-message-bytes" in message, (code, message)
            assert model.requests == []  # nothing reached the agent
            assert (await ed.call("session/prompt", prompt(session, "and now?")))["stopReason"] == "end_turn"
        finally:
            await ed.close()

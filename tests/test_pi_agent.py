"""The real pi coding agent hosted by uibus (`backend = "rpc"`), driven through uibus's own ways in.

pi is the pinned package (tests/pi/package-lock.json, installed by `.ci/setup`) with two test
extensions (tests/pi/ui-tour.ts: every extension-UI method; examples/pi/gate.ts: the example permission gate on
`rm -rf`), its model a scripted OpenAI-compatible server on loopback (tests/pikit.py). Turns go in as
neuro-san StreamingChat calls; dialogs are answered at ExtensionUiService UIs and at `uibus
ext-ui-stdio`; the webview side is read from Cline's partial-message stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.chatkit import AI, FRAMEWORK, MAXIMAL, Agent, request, write_agents
from tests.conftest import REPO, chat_on_page, free_port, require, shots, start_app, wait_for
from tests.ext_ui_helpers import ext, open_uis, read
from tests.pikit import PI, Model, Reply, agent_pids, hosting, pi_agent, scripted_model, turn_of
from tests.redisproc import RedisProcess, redis_server
from tests.support import needs
from uibus.agents.turns import StdioSession
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra import kinds
from uibus.infra.config import Config
from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc
from uibus.pb.neuro_san.api.grpc import chat_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

pytestmark = pytest.mark.timeout(120)
__all__ = ["redis_server"]  # the fixture
AGENT_MSG, TOOL_RESULT = chat_pb2.ChatMessage.AGENT, chat_pb2.ChatMessage.AGENT_TOOL_RESULT


@pytest.fixture
@needs("node")
async def model() -> AsyncIterator[Model]:
    require("the pinned pi agent (npm ci --prefix tests/pi)", PI.exists(), "node")
    async with scripted_model() as m:
        yield m


@pytest.fixture
async def pi_app(config: Config, model: Model, tmp_path: Path) -> AsyncIterator[App]:
    async with hosting(config, tmp_path, [pi_agent(tmp_path, model)]) as app:
        yield app


async def turn(conn: Connection, text: str, *, maximal: bool = False) -> list[Any]:
    return await turn_of(conn, "pi", text, maximal=maximal)


async def test_every_pi_dialog_and_ui_method_reaches_the_session_uis(pi_app: App) -> None:
    async with Connection(f"127.0.0.1:{pi_app.port}", session="tour") as conn:
        ui, other = await open_uis(pi_app, conn, 2, "tour")
        chat = asyncio.ensure_future(turn(conn, "/ui-tour"))
        select = (await read(ui, 30)).request
        assert select.WhichOneof("method") == "select"
        assert (select.select.title, list(select.select.options), select.select.timeout_ms) == (
            "Allow dangerous command?", ["Allow", "Block"], 10000)
        assert (await read(other)).request.id == select.id  # every UI of the session sees it
        await ext(conn).Respond(pb.RespondRequest(id=select.id, value="Allow"))
        assert (await read(ui)).closed.reason == pb.DIALOG_OUTCOME_ANSWERED

        confirm = (await read(ui, 10)).request  # left to pi's own 400 ms timeout: it closes at the UIs
        assert (confirm.confirm.title, confirm.confirm.message, confirm.confirm.timeout_ms) == (
            "Clear session?", "All messages will be lost.", 400)
        # pi gives up on it itself after 400 ms and asks the next thing at once; uibus's timer for the
        # same 400 ms started when it showed the dialog, so the close and the next request race.
        first, second = await read(ui, 5), await read(ui, 5)
        closed, typed_event = (first, second) if first.WhichOneof("event") == "closed" else (second, first)
        assert (closed.closed.id, closed.closed.reason) == (confirm.id, pb.DIALOG_OUTCOME_TIMED_OUT)

        typed = typed_event.request
        assert (typed.input.title, typed.input.placeholder) == ("Enter a value", "type something...")
        await ext(conn).Respond(pb.RespondRequest(id=typed.id, value="a\u2028b \u2029 c"))
        await read(ui)
        editor = (await read(ui, 5)).request
        assert (editor.editor.title, editor.editor.prefill) == ("Edit some text", "Line 1\nLine 2")
        await ext(conn).Respond(pb.RespondRequest(id=editor.id, cancelled=True))
        assert (await read(ui)).closed.reason == pb.DIALOG_OUTCOME_CANCELLED

        fired = [(await read(ui, 5)).request for _ in range(6)]
        assert [f.WhichOneof("method") for f in fired] == ["notify", "set_status", "set_status", "set_widget",
                                                           "set_title", "set_editor_text"]
        assert (fired[0].notify.message, fired[0].notify.notify_type) == ("Command blocked by user",
                                                                         pb.NOTIFY_TYPE_WARNING)
        assert (fired[1].set_status.key, fired[1].set_status.text) == ("my-ext", "Turn 3 running...")
        assert fired[2].set_status.key == "my-ext" and not fired[2].set_status.HasField("text")
        assert (fired[3].set_widget.key, list(fired[3].set_widget.lines), fired[3].set_widget.placement) == (
            "my-ext", ["--- My Widget ---", "Line 1"], pb.WIDGET_PLACEMENT_BELOW_EDITOR)
        assert fired[4].set_title.title == "atomic - my project"
        assert fired[5].set_editor_text.text == "prefilled text for the user"
        report = (await read(ui, 5)).request.notify
        assert json.loads(report.message) == {"picked": "Allow", "confirmed": False, "typed": "a\u2028b \u2029 c",
                                              "edited": None}
        responses = await asyncio.wait_for(chat, 10)
        assert responses[-1].response.type == FRAMEWORK  # the command's turn ended at its response
        assert pi_app.core.agent_sessions.count() == 1


async def test_a_prompt_template_is_a_model_turn_not_a_command(pi_app: App, model: Model) -> None:
    """`/summarize` names a prompt template (tests/pikit.py puts one in pi's prompts): pi answers the
    prompt at once and then runs the model, so this turn ends at agent_end, with the model's reply."""
    model.script(Reply(text="All done in one line."))
    async with Connection(f"127.0.0.1:{pi_app.port}", session="template") as conn:
        assert (await turn(conn, "/summarize"))[-1].response.text == "All done in one line."
        assert "Summarize the work so far in one line." in json.dumps(model.requests[0]["messages"])


async def partials(conn: Connection) -> Any:
    return ui_pb2_grpc.UiServiceStub(conn.channel).subscribeToPartialMessage(common_pb2.EmptyRequest())


async def collect_messages(stream: Any, until: Any, timeout: float = 20) -> dict[int, ui_pb2.ClineMessage]:
    """The latest state of each ClineMessage by ts, read until `until(messages)` holds."""
    seen: dict[int, ui_pb2.ClineMessage] = {}
    async with asyncio.timeout(timeout):
        while not until(seen):
            m = await stream.read()
            seen[m.ts] = m
    return seen


async def test_a_model_turn_streams_under_maximal_and_continues_in_the_session_only(pi_app: App, model: Model) -> None:
    model.script(Reply(thinking="The user greets me. ", text="Hello there, I am pi."),
                 Reply(text="You said hello before."), Reply(text="Fresh start."))
    async with Connection(f"127.0.0.1:{pi_app.port}", session="chat") as conn, \
            Connection(f"127.0.0.1:{pi_app.port}", session="elsewhere") as other:
        webview = await partials(conn)
        await wait_for(lambda: pi_app.bus.count(kinds.PARTIAL_MESSAGE, "chat") == 1, what="webview")
        responses = await turn(conn, "hello", maximal=True)
        kinds_seen = [r.response.type for r in responses]
        assert kinds_seen[-1] == FRAMEWORK and AI in kinds_seen and AGENT_MSG in kinds_seen
        thinking = [r.response for r in responses if r.response.type == AGENT_MSG]
        assert "".join(m.text for m in thinking) == "The user greets me. "
        assert all(m.structure["kind"] == "thinking" for m in thinking)
        assert "".join(r.response.text for r in responses if r.response.type == AI) == "Hello there, I am pi."
        assert responses[-1].response.text == "Hello there, I am pi."
        shown = await collect_messages(webview, lambda s: any(
            m.say == ui_pb2.TEXT and not m.partial and m.text == "Hello there, I am pi." for m in s.values()))
        reasoning = [m for m in shown.values() if m.say == ui_pb2.REASONING]
        assert reasoning and reasoning[-1].text == "The user greets me. " and not reasoning[-1].partial
        text = next(m for m in shown.values() if m.say == ui_pb2.TEXT)
        assert reasoning[-1].ts < text.ts  # the reasoning is shown above the answer it led to

        minimal = await turn(conn, "what did I say?")
        assert [r.response.type for r in minimal] == [FRAMEWORK]
        assert minimal[-1].response.text == "You said hello before."
        # The same pi process kept the conversation: the second request carries the first turn.
        second = [m.get("content") for m in model.requests[1]["messages"]]
        assert "hello" in json.dumps(second) and "Hello there, I am pi." in json.dumps(second)
        # Another session is another process, with a conversation of its own.
        await turn(other, "who are you?")
        third = json.dumps(model.requests[2]["messages"])
        assert "hello" not in third and "who are you?" in third
        assert pi_app.core.agent_sessions.count() == 2
        assert pi_app.core.chat.agents.backends["pi"].started == 2


async def test_a_tool_call_gated_by_the_extension_is_answered_at_a_ui(pi_app: App, model: Model,
                                                                      tmp_path: Path) -> None:
    victim = tmp_path / "work" / "victim"
    victim.mkdir(parents=True)
    (victim / "keep.txt").write_text("x")
    blocked = "rm -rf victim && echo gone"
    allowed = "rm -rf nothing-here && printf 'line 1\\nline 2\\n'"
    model.script(Reply(text="Let me clean up. ", tool=("bash", {"command": blocked})), Reply(text="It was blocked."),
                 Reply(tool=("bash", {"command": allowed})), Reply(text="Cleaned."))
    async with Connection(f"127.0.0.1:{pi_app.port}", session="gate") as conn:
        (ui,) = await open_uis(pi_app, conn, 1, "gate")
        webview = await partials(conn)
        await wait_for(lambda: pi_app.bus.count(kinds.PARTIAL_MESSAGE, "gate") == 1, what="webview")
        chat = asyncio.ensure_future(turn(conn, "clean up", maximal=True))
        done, _ = await asyncio.wait([chat], timeout=3)
        if done:
            print([r.response.text for r in chat.result()])
        gate = (await read(ui, 30)).request
        assert (gate.select.title, list(gate.select.options)) == (f"Dangerous command: {blocked}", ["Allow", "Block"])
        await ext(conn).Respond(pb.RespondRequest(id=gate.id, value="Block"))
        assert (await read(ui)).closed.reason == pb.DIALOG_OUTCOME_ANSWERED
        responses = await asyncio.wait_for(chat, 30)
        assert victim.is_dir()  # the command never ran
        ends = [r.response for r in responses if r.response.type == TOOL_RESULT]
        assert len(ends) == 1 and ends[0].structure["is_error"] and "Blocked by user" in ends[0].text
        assert responses[-1].response.text == "Let me clean up. \n\nIt was blocked."

        chat = asyncio.ensure_future(turn(conn, "again"))
        gate = (await read(ui, 30)).request
        await ext(conn).Respond(pb.RespondRequest(id=gate.id, value="Allow"))
        assert (await asyncio.wait_for(chat, 30))[-1].response.text == "Cleaned."
        shown = await collect_messages(webview, lambda s: any(
            m.say == ui_pb2.TEXT and m.text == "Cleaned." and not m.partial for m in s.values()))
        commands = [m for m in shown.values() if m.say == ui_pb2.COMMAND_SAY]
        assert [m.text for m in commands] == [blocked, allowed]
        outputs = [m for m in shown.values() if m.say == ui_pb2.COMMAND_OUTPUT_SAY]
        assert outputs[-1].text == "line 1\nline 2\n" and not outputs[-1].partial
        assert "Blocked by user" in outputs[0].text


async def test_pi_dialogs_answered_from_ext_ui_stdio(pi_app: App) -> None:
    """pi's own stdio UI protocol: pi's request comes out as its JSON line (uibus's id), the
    answer typed there goes back to pi with pi's id."""
    before = pi_app.bus.count(kinds.EXTENSION_UI, "stdio")
    bridge = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "clients.cli", "ext-ui-stdio", "--target", f"127.0.0.1:{pi_app.port}",
        "--session", "stdio", cwd=REPO, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert bridge.stdin is not None and bridge.stdout is not None
    try:
        await wait_for(lambda: pi_app.bus.count(kinds.EXTENSION_UI, "stdio") == before + 1, timeout=30,
                       what="the bridge to subscribe")

        async def line() -> dict[str, Any]:
            raw = await asyncio.wait_for(bridge.stdout.readline(), 30)  # type: ignore[union-attr]
            assert raw.endswith(b"\n"), raw
            return json.loads(raw)  # type: ignore[no-any-return]

        async def answer(obj: dict[str, Any]) -> None:
            bridge.stdin.write(json.dumps(obj).encode() + b"\n")  # type: ignore[union-attr]
            await bridge.stdin.drain()  # type: ignore[union-attr]

        async with Connection(f"127.0.0.1:{pi_app.port}", session="stdio") as conn:
            chat = asyncio.ensure_future(turn(conn, "/ui-tour"))
            select = await line()
            assert (select["method"], select["title"], select["options"], select["timeout"]) == (
                "select", "Allow dangerous command?", ["Allow", "Block"], 10000)
            await answer({"type": "extension_ui_response", "id": select["id"], "value": "Block"})
            confirm = await line()
            assert (confirm["method"], confirm["timeout"]) == ("confirm", 400)  # left to pi's timeout
            typed = await line()
            assert typed["method"] == "input"
            await answer({"type": "extension_ui_response", "id": typed["id"], "value": "x\u2028y\u2029z"})
            editor = await line()
            assert (editor["method"], editor["prefill"]) == ("editor", "Line 1\nLine 2")
            await answer({"type": "extension_ui_response", "id": editor["id"], "value": "edited\ntext"})
            fired = [await line() for _ in range(6)]
            assert [f["method"] for f in fired] == ["notify", "setStatus", "setStatus", "setWidget", "setTitle",
                                                    "set_editor_text"]
            assert fired[0]["notifyType"] == "warning" and "statusText" not in fired[2]
            assert (fired[3]["widgetKey"], fired[3]["widgetPlacement"]) == ("my-ext", "belowEditor")
            report = await line()
            assert json.loads(report["message"]) == {"picked": "Block", "confirmed": False, "typed": "x\u2028y\u2029z",
                                                     "edited": "edited\ntext"}
            await asyncio.wait_for(chat, 10)
    finally:
        if bridge.returncode is None:
            bridge.kill()
            await bridge.wait()


async def test_cancelling_a_turn_aborts_the_agent_and_its_model_request(pi_app: App, model: Model) -> None:
    model.script(Reply(text="Thinking very hard ", hang=True), Reply(text="Recovered."))
    async with Connection(f"127.0.0.1:{pi_app.port}", session="cancel") as conn:
        call = Agent(conn, "pi").StreamingChat(request("take forever", filter_type=MAXIMAL))
        first = await asyncio.wait_for(call.read(), 30)
        assert first.response.text == "Thinking "
        await wait_for(lambda: model.open_requests == 1, timeout=10, what="the model request")
        call.cancel()
        await wait_for(lambda: model.open_requests == 0, timeout=10, what="the model request to be dropped")
        assert model.cancelled == 1
        # The same process takes the next turn once its aborted run has ended; nothing of the
        # cancelled turn was kept on uibus's side.
        final = (await turn(conn, "are you there?"))[-1].response
        assert final.text == "Recovered."
        assert pi_app.core.chat.agents.backends["pi"].started == 1
        stored = await pi_app.history.load_context("cancel", "pi") if hasattr(pi_app, "history") else None
        assert stored is None or "take forever" not in str(stored)


async def test_a_killed_agent_ends_its_turn_at_once_and_the_next_turn_starts_another(pi_app: App, model: Model,
                                                                                    tmp_path: Path) -> None:
    model.script(Reply(text="Working ", hang=True), Reply(text="I am new."))
    async with Connection(f"127.0.0.1:{pi_app.port}", session="kill") as conn:
        (ui,) = await open_uis(pi_app, conn, 1, "kill")
        call = Agent(conn, "pi").StreamingChat(request("work", filter_type=MAXIMAL))
        await asyncio.wait_for(call.read(), 30)
        pids = agent_pids(tmp_path / "work")
        assert len(pids) == 1
        os.kill(pids[0], signal.SIGKILL)
        rest = [r async for r in call]
        assert rest[-1].response.type == FRAMEWORK
        assert "the agent process exited (code -9) during the turn" in rest[-1].response.text
        final = (await turn(conn, "hello again"))[-1].response
        assert final.text == "I am new."
        assert pi_app.core.chat.agents.backends["pi"].started == 2
        assert len(agent_pids(tmp_path / "work")) == 1
        del ui


async def test_a_dialog_closes_at_every_ui_when_its_turn_is_cancelled(pi_app: App, model: Model) -> None:
    model.script(Reply(tool=("bash", {"command": "rm -rf nothing"})), Reply(text="after"))
    async with Connection(f"127.0.0.1:{pi_app.port}", session="gone") as conn:
        (ui,) = await open_uis(pi_app, conn, 1, "gone")
        call = Agent(conn, "pi").StreamingChat(request("do it"))
        gate = (await read(ui, 30)).request
        assert gate.select.title.startswith("Dangerous command:")
        call.cancel()
        closed = await read(ui, 5)
        assert (closed.closed.id, closed.closed.reason) == (gate.id, pb.DIALOG_OUTCOME_CALLER_CANCELLED)
        assert pi_app.core.dialogs.count("gone") == 0


async def test_limits_and_idle_close(config: Config, model: Model, tmp_path: Path) -> None:
    path = write_agents(tmp_path, [pi_agent(tmp_path, model, max_processes=1, idle_seconds=1)])
    app = await start_app(replace(config, agents=path))
    try:
        async with Connection(f"127.0.0.1:{app.port}", session="one") as one, \
                Connection(f"127.0.0.1:{app.port}", session="two") as two:
            model.script(Reply(text="hi one"))
            assert (await turn(one, "hello"))[-1].response.text == "hi one"
            # At max_processes with one's process idle: it is closed (least recently used idle) to
            # make room, so another session's turn is never refused for an idle process (docs/security/quotas.md).
            model.script(Reply(text="hi two"))
            assert (await turn(two, "hello"))[-1].response.text == "hi two"
            assert app.core.agent_sessions.closed_reclaimed == 1
            # Idle for idle_seconds: the process is stopped.
            await wait_for(lambda: app.core.agent_sessions.count() == 0, timeout=10, what="the idle close")
            assert agent_pids(tmp_path / "work") == []
            model.script(Reply(text="hi again"))
            assert (await turn(two, "hello"))[-1].response.text == "hi again"
            page = app.metrics.render().decode()  # type: ignore[union-attr]
            assert "uibus_agent_sessions 1.0" in page and "uibus_agent_processes_started_total 3.0" in page
            assert "uibus_agent_sessions_closed_idle_total 1.0" in page
            assert "uibus_agent_sessions_closed_reclaimed_total 1.0" in page
    finally:
        await app.aclose()
    assert agent_pids(tmp_path / "work") == []


def broken_agent(**options: Any) -> dict[str, Any]:
    script = REPO / "tests" / "scripts" / "rpc_misbehaving.py"
    return {"name": "broken", "backend": "rpc", "options": {"command": [sys.executable, str(script)], **options}}


async def test_faults_of_an_agent_are_clear_errors_and_bounded_logs(config: Config, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = write_agents(tmp_path, [broken_agent(max_line_bytes=1024 * 1024, turn_timeout_seconds=1,
                                                stop_timeout_seconds=1)])
    app = await start_app(replace(config, agents=path))
    backend = app.core.chat.agents.backends["broken"]
    try:
        async with Connection(f"127.0.0.1:{app.port}", session="faults") as conn:
            ask = Agent(conn, "broken").StreamingChat

            async def final(text: str) -> str:
                return [r async for r in ask(request(text))][-1].response.text

            with caplog.at_level("WARNING", logger="uibus.agents.rpc"):
                assert await final("garbage") == "survived garbage"
                assert await final("stderr") == "survived stderr"
            messages = [r.getMessage() for r in caplog.records if r.name == "uibus.agents.rpc"]
            # 52 unparsable lines (50 not JSON, one nested too deep, one an array): one log line, the rest counted
            assert messages.count("agent line is not JSON; ignored") == 1
            assert "agent line is not a JSON object; ignored" not in messages
            assert messages.count("unknown agent event; ignored") == 1
            assert messages.count("unknown extension_ui_request method; ignored") == 1
            assert 1 <= messages.count("agent stderr") <= 2  # 2,000 lines of it
            assert await final("refuse") == "Error from broken: no model configured"
            assert backend.started == 1  # a refused prompt is an answer, the process stays
            too_long = await final("long")
            assert too_long.startswith("Error from broken: the agent wrote a line over 1048576 bytes "
                                       "(option max_line_bytes); it was stopped")
            assert await final("hi") == "echo: hi"  # a new process
            assert backend.started == 2 and backend.processes == 1
            assert await final("hang") == ("Error from broken: the turn did not end within 1 s "
                                           "(option turn_timeout_seconds)")
            # It never ends the run it was told to abort: the next turn waits stop_timeout_seconds for
            # it, then stops the process and says so; the one after gets a new process.
            assert (await final("hi")).startswith("Error from broken: the agent did not end its cancelled run "
                                                  "within 1 s (option stop_timeout_seconds)")
            # Gone from the moment it was killed, not from when its exit is seen (seconds later on a
            # loaded machine): else the next turn is handed to the dying process and fails with it.
            stopped = app.core.agent_sessions.live_agent("faults", "broken")
            assert stopped is not None and not stopped.alive
            assert await final("hi again") == "echo: hi again"
            assert backend.started == 3
    finally:
        await app.aclose()
    assert backend.processes == 0 and app.core.agent_sessions.count() == 0


async def test_a_cancelled_shutdown_still_kills_every_agent_group_and_propagates_a_plain_cancel(
        config: Config, tmp_path: Path) -> None:
    """The app's teardown cancelled while agents stop (here: agents that ignore SIGTERM, each with a
    child in its group): every agent session is still closed, every group killed, and the cancel
    comes out as a plain CancelledError, never a group holding one (the teardown splits on that)."""
    work = tmp_path / "work"
    work.mkdir()
    stubborn = broken_agent(cwd=str(work), env={"RPC_STUBBORN": "1"}, stop_timeout_seconds=30)
    app = await start_app(replace(config, agents=write_agents(tmp_path, [stubborn])))
    sessions = app.core.agent_sessions
    try:
        for session in ("one", "two"):
            async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:
                assert [r async for r in Agent(conn, "broken").StreamingChat(request("hi"))][-1] \
                    .response.text == "echo: hi"
        await wait_for(lambda: len(agent_pids(work)) == 4)  # two agents, each with its child
        agents = [sessions.live_agent(session, "broken") for session in ("one", "two")]
        procs = [agent.process.proc for agent in agents if isinstance(agent, StdioSession)]
        assert len(procs) == 2 and all(p is not None and p.returncode is None for p in procs)
        closing = asyncio.ensure_future(sessions.aclose())
        await asyncio.sleep(0.5)  # both wait (stop_timeout_seconds = 30) for a SIGTERM they ignore
        assert not closing.done()
        closing.cancel()
        async with asyncio.timeout(10):
            with pytest.raises(asyncio.CancelledError):
                await closing
        # The agents, uibus's children, are reaped before the close ends; their children (`sleep 120`)
        # are not uibus's to wait for: they die of the same SIGKILL to the group once the kernel runs
        # them, which on a loaded machine can be after the close returned (seen: both still there).
        assert sessions.count() == 0 and all(p is not None and p.returncode == -signal.SIGKILL for p in procs)
        await wait_for(lambda: agent_pids(work) == [], timeout=5, what="the agents' children killed with the group")
    finally:
        await app.aclose()


async def test_a_caller_without_a_session_gets_an_agent_for_its_turn_only(config: Config, tmp_path: Path) -> None:
    path = write_agents(tmp_path, [broken_agent()])
    app = await start_app(replace(config, agents=path))
    backend = app.core.chat.agents.backends["broken"]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            call = channel.unary_stream("/broken.AgentService/StreamingChat",
                                        request_serializer=chat_request_bytes,
                                        response_deserializer=chat_response)
            responses = [r async for r in call(request("anyone?"))]
            assert responses[-1].response.text == "echo: anyone?"
        assert backend.started == 1 and backend.processes == 0 and app.core.agent_sessions.count() == 0
    finally:
        await app.aclose()


def chat_request_bytes(message: Any) -> bytes:
    return message.SerializeToString()  # type: ignore[no-any-return]


def chat_response(data: bytes) -> Any:
    from uibus.pb.neuro_san.api.grpc import agent_pb2
    return agent_pb2.ChatResponse.FromString(data)


async def test_an_evicted_session_takes_its_agent_with_it(config: Config, tmp_path: Path) -> None:
    path = write_agents(tmp_path, [broken_agent()])
    app = await start_app(replace(config, agents=path, max_sessions=1))
    app.core.agent_sessions.sweep_s = 0.1
    backend = app.core.chat.agents.backends["broken"]
    try:
        async with Connection(f"127.0.0.1:{app.port}", session="first") as first:
            assert [r async for r in Agent(first, "broken").StreamingChat(request("a"))][-1].response.text == "echo: a"
            assert backend.processes == 1
            # A second session goes over --max-sessions 1: the first is evicted, its agent stopped.
            await app.store.put("second", "x", 1)
            await wait_for(lambda: backend.processes == 0, timeout=10, what="the evicted session's agent to stop")
            assert app.core.agent_sessions.closed_evicted == 1
    finally:
        await app.aclose()


async def test_sigterm_leaves_no_agent_process(spawn: Any, model: Model, tmp_path: Path) -> None:
    """`uibus serve` as an operator runs it, with pi agents in two sessions, one mid-turn: SIGTERM
    stops the server within its grace and every agent process with it."""
    path = write_agents(tmp_path, [pi_agent(tmp_path, model)])
    server = spawn("--agents", path, "--grace-seconds", "2")
    await server.wait_ready()
    model.script(Reply(text="idle one"), Reply(text="busy ", hang=True))
    work = tmp_path / "work"
    async with Connection(server.target, session="a") as a, Connection(server.target, session="b") as b:
        assert (await turn(a, "hello"))[-1].response.text == "idle one"
        busy = Agent(b, "pi").StreamingChat(request("work", filter_type=MAXIMAL))
        await asyncio.wait_for(busy.read(), 30)
        assert len(agent_pids(work)) == 2
        server.proc.send_signal(signal.SIGTERM)
        code = await asyncio.get_running_loop().run_in_executor(None, lambda: server.proc.wait(20))
        assert code == 0, server.log.read_text()[-3000:]
        busy.cancel()
    assert agent_pids(work) == []
    assert "agent process stopped" in server.log.read_text()


async def test_a_killed_server_leaves_no_agent_behind(spawn: Any, model: Model, tmp_path: Path) -> None:
    """SIGKILL gives uibus no chance to stop anything: its end of the agent's stdin closes with it,
    and an agent in RPC mode exits at the end of its input (pi does)."""
    path = write_agents(tmp_path, [pi_agent(tmp_path, model)])
    server = spawn("--agents", path)
    await server.wait_ready()
    model.script(Reply(text="here"))
    async with Connection(server.target, session="a") as a:
        assert (await turn(a, "hello"))[-1].response.text == "here"
    work = tmp_path / "work"
    assert len(agent_pids(work)) == 1
    server.proc.kill()
    server.proc.wait(10)
    await wait_for(lambda: agent_pids(work) == [], timeout=15, what="the orphaned agent to exit")


async def test_a_pi_dialog_answered_by_a_click_on_the_page(config: Config, model: Model, browser: Any,
                                                           tmp_path: Path) -> None:
    """The person at the browser page chats with pi, allows its gated command with a click, and
    sees the reasoning, the command, its output and the markdown answer (screenshot: pi-agent.png)."""
    path = write_agents(tmp_path, [pi_agent(tmp_path, model)])
    app = await start_app(replace(config, agents=path, http_port=free_port()))
    command = "rm -rf build-cache && printf 'removed build-cache\\n'"
    model.script(Reply(thinking="The cache is stale; removing it is safe. ", text="Cleaning up. ",
                       tool=("bash", {"command": command})),
                 Reply(text="**Done**: the cache is gone.\n\n- removed `build-cache`"))
    page = await chat_on_page(browser, app.http_port, "page", "pi", "please clean the build cache")
    try:
        dialog = '.dialog[data-kind="select"]'
        await page.wait_for_selector(dialog, timeout=30_000)
        assert f"Dangerous command: {command}" in (await page.text_content(dialog) or "")
        await page.click(f'{dialog} button:text("Allow")')
        await page.wait_for_selector(dialog, state="detached", timeout=5000)
        await page.wait_for_function("() => document.querySelector('.msg.agent.done strong')?.textContent === 'Done'",
                                     timeout=30_000)
        assert await page.text_content('[data-say="command"] pre.command code') == command
        await page.wait_for_function("() => document.querySelector('[data-say=\"command_output\"] pre.output')"
                                     "?.textContent === 'removed build-cache\\n'", timeout=5000)
        reasoning = await page.text_content('[data-say="reasoning"] details .text')
        assert reasoning == "The cache is stale; removing it is safe. "
        answer = await page.text_content(".msg.agent.done .text")
        assert answer is not None and "the cache is gone" in answer and "removed build-cache" in answer
        await page.click('[data-say="reasoning"] summary')
        await page.screenshot(path=str(shots(tmp_path) / "pi-agent.png"), full_page=True)
    finally:
        await page.close()
        await app.aclose()
    assert app.core.agent_sessions.count() == 0 and agent_pids(tmp_path / "work") == []



@pytest.mark.node  # pi, on PATH from tests/pi: a command not found fails the start
async def test_the_example_config_loads_and_its_echo_agent_asks_at_a_ui(config: Config,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/pi-agent.toml as docs/hosting/pi.md gives it (pi found on PATH, as after `npm i -g`), and its
    minimal RPC agent (examples/rpc_echo_agent.py) driven through uibus."""
    from uibus.agents.config import load_agents

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PATH", f"{PI.parent}{os.pathsep}{os.environ['PATH']}")
    example = str(REPO / "examples" / "pi-agent.toml")
    table = load_agents(example)
    assert [(s.name, s.backend) for s in table.specs.values()] == [("pi", "rpc"), ("echo_rpc", "rpc")]
    app = await start_app(replace(config, agents=example))
    try:
        async with Connection(f"127.0.0.1:{app.port}", session="echo") as conn:
            (ui,) = await open_uis(app, conn, 1, "echo")
            call = asyncio.ensure_future(_final(conn, "echo_rpc", "ask me"))
            confirm = (await read(ui, 10)).request
            assert (confirm.confirm.title, confirm.confirm.message) == ("Go ahead?", "ask me")
            await ext(conn).Respond(pb.RespondRequest(id=confirm.id, confirmed=True))
            assert (await asyncio.wait_for(call, 10)).strip() == "You said: ask me (you said yes)"
    finally:
        await app.aclose()


async def _final(conn: Connection, agent: str, text: str) -> str:
    return [r async for r in Agent(conn, agent).StreamingChat(request(text))][-1].response.text


async def test_an_mcp_call_of_pi_and_its_cancel(config: Config, model: Model, tmp_path: Path) -> None:
    """pi as an MCP tool (the agents are tools at /mcp): a call answers; `notifications/cancelled`
    aborts the agent and drops its model request, and the next call is answered by the same process."""
    from tests.test_mcp import chat_args, rpc

    path = write_agents(tmp_path, [pi_agent(tmp_path, model)])
    app = await start_app(replace(config, agents=path, http_port=free_port()))
    try:
        init = await rpc(app, {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                               "params": {"protocolVersion": "2025-06-18", "capabilities": {}}})
        headers = {"mcp-session-id": init.headers["mcp-session-id"], "mcp-protocol-version": "2025-06-18",
                   "x-uibus-session": "mcp-pi"}
        model.script(Reply(text="From pi over MCP."), Reply(text="slow ", hang=True), Reply(text="Back again."))
        answer = await rpc(app, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                 "params": {"name": "pi", "arguments": chat_args("hello")}}, headers)
        assert "From pi over MCP." in json.dumps(answer.json()["result"])
        slow = asyncio.ensure_future(rpc(app, {"jsonrpc": "2.0", "id": "slow", "method": "tools/call",
                                               "params": {"name": "pi", "arguments": chat_args("go slow")}}, headers))
        await wait_for(lambda: model.open_requests == 1, timeout=30, what="the model request")
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "slow"}}
        assert (await rpc(app, cancel, headers)).status_code == 202
        assert (await asyncio.wait_for(slow, 10)).json()["error"]["data"]["status"] == "CANCELLED"
        await wait_for(lambda: model.open_requests == 0, timeout=10, what="the model request to be dropped")
        again = await rpc(app, {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                                "params": {"name": "pi", "arguments": chat_args("still there?")}}, headers)
        assert "Back again." in json.dumps(again.json()["result"])
        assert app.core.chat.agents.backends["pi"].started == 1
    finally:
        await app.aclose()


async def test_a_pi_dialog_is_answered_at_a_ui_on_another_replica(model: Model, tmp_path: Path,
                                                                  redis_server: RedisProcess) -> None:
    """Two replicas on one redis-server: pi runs on A (where the turn came in), its dialog is shown
    to a UI on B and answered there; the answer reaches pi through A."""
    path = write_agents(tmp_path, [pi_agent(tmp_path, model)])
    apps = [await start_app(Config(host="127.0.0.1", port=0, http_port=0, store=str(tmp_path / f"{n}.db"),
                                   redis_url=redis_server.url, grace_seconds=1.0, agents=path)) for n in "ab"]
    a, b = apps
    try:
        await wait_for(lambda: a.bus.connected and b.bus.connected, what="both replicas on redis")
        async with Connection(f"127.0.0.1:{a.port}", session="multi") as on_a, \
                Connection(f"127.0.0.1:{b.port}", session="multi") as on_b:
            (ui,) = await open_uis(b, on_b, 1, "multi")
            chat = asyncio.ensure_future(turn(on_a, "/ui-tour"))
            select = (await read(ui, 30)).request
            assert select.select.title == "Allow dangerous command?"
            await ext(on_b).Respond(pb.RespondRequest(id=select.id, value="Block"))
            events = []
            while True:  # the confirm times out at pi; then the input, which B answers too
                event = await read(ui, 10)
                events.append(event)
                if event.WhichOneof("event") == "request" and event.request.WhichOneof("method") == "input":
                    break
            await ext(on_b).Respond(pb.RespondRequest(id=event.request.id, value="typed on b"))
            editor = None
            while editor is None:
                event = await read(ui, 10)
                if event.WhichOneof("event") == "request" and event.request.WhichOneof("method") == "editor":
                    editor = event.request
            await ext(on_b).Respond(pb.RespondRequest(id=editor.id, cancelled=True))
            report = None
            while report is None:
                event = await read(ui, 10)
                if event.WhichOneof("event") == "request" and event.request.notify.message.startswith("{"):
                    report = json.loads(event.request.notify.message)
            assert report == {"picked": "Block", "confirmed": False, "typed": "typed on b", "edited": None}
            await asyncio.wait_for(chat, 10)
            assert a.core.agent_sessions.count() == 1 and b.core.agent_sessions.count() == 0
    finally:
        for app in apps:
            await app.aclose(grace=0.5)


def test_an_agents_oversized_dialog_is_shown_cut_not_refused() -> None:
    """A refused dialog would block the agent's tool until it gives up, so what it asks is fitted
    into the dialogs' limits: cut (and marked), a timeout beyond a day left to the agent."""
    from uibus.agents.rpc import RpcSession
    from uibus.infra import dialog_limits as checks

    select = RpcSession.dialog_request("select", {"title": "rm -rf " + "x" * 5000, "options": ["o"] * 1200,
                                                  "timeout": 10**12})
    assert (len(select.title), select.title[-1], len(select.options)) == (checks.MAX_TITLE, "…", checks.MAX_OPTIONS)
    assert not select.HasField("timeout_ms") and checks.check_select(select) is None
    untitled = RpcSession.dialog_request("input", {"placeholder": 7})
    assert (untitled.title, untitled.HasField("placeholder"), checks.check_input(untitled)) == ("input", False, None)
    status = RpcSession.fire_request({"method": "setStatus", "statusKey": "k" * 300, "statusText": "t"})
    assert len(status.key) == checks.MAX_KEY and checks.check_status(status) is None


async def test_an_agent_that_cannot_start_is_the_turns_clear_error(config: Config, tmp_path: Path) -> None:
    """A program that is not an RPC agent, and one that went missing after start-up: each turn's
    answer names the option to fix; nothing is left running."""
    vanishing = tmp_path / "agent.sh"
    vanishing.write_text("#!/bin/sh\nexec sleep 60\n")
    vanishing.chmod(0o755)
    path = write_agents(tmp_path, [
        {"name": "mute", "backend": "rpc", "options": {"command": ["sleep", "60"], "start_timeout_seconds": 0.5}},
        {"name": "gone", "backend": "rpc", "options": {"command": [str(vanishing)]}}])
    app = await start_app(replace(config, agents=path))
    vanishing.unlink()
    try:
        async with Connection(f"127.0.0.1:{app.port}", session="bad") as conn:
            assert await _final(conn, "mute", "hello") == (
                "Error from mute: the agent did not answer get_state within 0.5 s (option start_timeout_seconds); "
                "is command an agent in RPC mode?")
            answer = await _final(conn, "gone", "hello")
            assert answer.startswith(f"Error from gone: cannot start the agent (option command = ['{vanishing}']): ")
            assert "No such file or directory" in answer
            backends = app.core.chat.agents.backends
            assert backends["mute"].processes == 0 and backends["gone"].processes == 0
            assert app.core.agent_sessions.count() == 0
    finally:
        await app.aclose()

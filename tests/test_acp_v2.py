"""The ACP v2 draft served to editors that negotiate it: the official SDK's experimental v2 client
(tests/acp/editor-v2.mjs on `@agentclientprotocol/sdk/experimental/v2`, unmodified, which checks
every message it reads against its v2 schema) attached over `/acp` (WebSocket) and by spawning
`uibus acp` (stdio) to a running uibus hosting the real pi on the scripted model (tests/pikit.py),
next to v1 editors and a neuro-san client of the same session.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, free_port
from tests.pikit import Model, Reply, hosting, pi_agent, scripted_model, turn_of
from tests.support import needs
from tests.test_acp_serve import CWD, EditorProc, need_sdk, spawned
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config

pytestmark = [pytest.mark.timeout(120), pytest.mark.node]
EDITOR_V2 = REPO / "tests" / "acp" / "editor-v2.mjs"
UIBUS = str(Path(sys.executable).parent / "uibus")
INIT = {"protocolVersion": 2, "info": {"name": "uibus-tests", "version": "1"}, "capabilities": {}}


@pytest.fixture
@needs("node")
async def model() -> AsyncIterator[Model]:
    need_sdk()
    async with scripted_model() as m:
        yield m


@pytest.fixture
async def app(config: Config, model: Model, tmp_path: Path) -> AsyncIterator[App]:
    async with hosting(config, tmp_path, [pi_agent(tmp_path, model)], http_port=free_port()) as app:
        yield app


class V2(EditorProc):
    """The v2 editor: EditorProc's driver, with the SDK's session helpers."""

    async def start_session(self) -> str:
        self._tag += 1
        self.send(op="start", tag=self._tag, cwd=CWD)
        event = await self.answer_of(self._tag)
        assert event["ev"] == "response", event
        return event["result"]["sessionId"]

    def prompt(self, session: str, text: str) -> int:
        self._tag += 1
        self.send(op="prompt", tag=self._tag, sessionId=session, text=text)
        return self._tag

    def nexts(self, session: str, start: int = 0) -> list[dict[str, Any]]:
        """What the SDK's ActiveSession.nextUpdate() read, in order."""
        return [e for e in self.events[start:] if e["ev"] == "next" and e["sessionId"] == session]

    def invalid(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["ev"] == "invalid"]

    async def stopped(self, session: str, start: int, timeout: float = 30) -> dict[str, Any]:
        """The first `stop` (an idle state_update) the session's reader got from event `start` on."""
        return await self.until(lambda e: e["ev"] == "next" and e["sessionId"] == session and e["kind"] == "stop"
                                and self.events.index(e) >= start, timeout, "the idle state_update")


async def v2_editor(*args: str) -> V2:
    node = shutil.which("node") or "node"
    proc = await asyncio.create_subprocess_exec(node, str(EDITOR_V2), *args, cwd=EDITOR_V2.parent,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    return V2(proc)


async def over_ws(app: App) -> V2:
    ed = await v2_editor("ws", f"ws://127.0.0.1:{app.http_port}/acp?agent=pi", "{}")
    init = await ed.call("initialize", INIT)
    assert init["protocolVersion"] == 2 and init["info"]["name"] == "uibus", init
    return ed


async def over_stdio(app: App) -> V2:
    ed = await v2_editor("stdio", UIBUS, "acp", "--agent", "pi", "--target", f"127.0.0.1:{app.port}")
    assert (await ed.call("initialize", INIT))["protocolVersion"] == 2
    return ed


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["update"]["sessionUpdate"] for e in events]


def said(events: list[dict[str, Any]], kind: str) -> str:
    return "".join(e["update"]["content"]["text"] for e in events if e["update"]["sessionUpdate"] == kind)


def raw(ed: EditorProc, session: str, start: int = 0) -> list[dict[str, Any]]:
    """Every session/update of `session` as the SDK's notification handler got it (params)."""
    return [e["params"] for e in ed.events[start:] if e["ev"] == "update" and e["params"]["sessionId"] == session]


def state_in(ed: EditorProc, session: str, start: int = 0) -> bool:
    """Whether `ed` got a state_update of `session` from event `start` on (the SDK may hand a
    notification to its handler after the answer that followed it on the wire)."""
    return any(p["update"]["sessionUpdate"] == "state_update" for p in raw(ed, session, start))


async def test_v2_is_negotiated_a_prompt_is_acknowledged_at_once_and_its_end_is_an_idle_state(
        app: App, model: Model) -> None:
    model.script(Reply(thinking="Let me see. ", text="I will run it.", tool=("bash", {"command": "echo from-v2"}),
                       delay_s=0.05),
                 Reply(text="It printed from-v2, all done.", delay_s=0.05))
    ed = await over_ws(app)
    v1 = await spawned(app, "pi")  # a v1 editor of the same server is unchanged
    try:
        caps = (await ed.call("initialize", INIT))["capabilities"]  # a repeat is answered the same
        assert caps["session"]["prompt"] == {"embeddedContext": {}, "image": {}}, caps
        session = await ed.start_session()
        tag = ed.prompt(session, "run echo")
        ack = await ed.answer_of(tag)
        assert ack["ev"] == "response" and isinstance(ack["result"]["messageId"], str), ack
        stop = await ed.stopped(session, 0)
        assert ed.events.index(ack) < ed.events.index(stop)  # answered on insertion, long before the end
        assert stop["stopReason"] == "end_turn" and stop["meta"]["uibus/seq"] > 0
        got = ed.nexts(session)
        assert got[0]["update"] == {"sessionUpdate": "user_message", "messageId": ack["result"]["messageId"],
                                    "content": [{"type": "text", "text": "run echo"}]}
        assert got[1]["update"] == {"sessionUpdate": "state_update", "state": "running"}
        assert got[-1] is stop and [e["kind"] for e in got].count("stop") == 1
        updates = got[2:-1]
        assert said(updates, "agent_thought_chunk") == "Let me see. "
        text = said(updates, "agent_message_chunk")
        assert text.startswith("I will run it.") and text.endswith("It printed from-v2, all done."), text
        ids = [(e["update"]["sessionUpdate"], e["update"]["messageId"]) for e in updates if "messageId" in e["update"]]
        assert all(k.endswith("_chunk") for k, _ in ids) and len(ids) == len(
            [e for e in updates if e["update"]["sessionUpdate"].endswith("_chunk")])  # every piece names its message
        runs = [i for n, (k, i) in enumerate(ids) if n == 0 or ids[n - 1] != (k, i)]
        assert len(set(runs)) == len(runs) == 3  # thought, then text, then the text after the tool: 3 messages
        tools = [e["update"] for e in updates if e["update"]["sessionUpdate"].startswith("tool_call")]
        assert tools and {t["sessionUpdate"] for t in tools} == {"tool_call_update"}  # v2: upserts only
        assert tools[0]["kind"] == "execute" and tools[-1]["status"] == "completed"
        assert "tool_call" not in kinds(updates) and "plan" not in kinds(updates)
        # the same session over v1: the v1 shapes, untouched
        await v1.call("session/resume", {"sessionId": session, "cwd": CWD, "_meta": {"uibus/since": 0}})
        v1_kinds = {u["sessionUpdate"] for u in v1.updates(session)}
        assert {"user_message_chunk", "agent_message_chunk", "tool_call"} <= v1_kinds, v1_kinds
        assert "state_update" not in v1_kinds and not [u for u in v1.updates(session) if "messageId" in u]
        assert ed.invalid() == []  # the SDK took every message as v2
    finally:
        await ed.close()
        await v1.close()


async def test_a_second_observer_sees_the_first_ones_turn_and_every_ui_resumes_from_its_own_cursor(
        app: App, model: Model) -> None:
    model.script(Reply(text="First answer.", delay_s=0.05), Reply(text="Answer to another UI.", delay_s=0.05))
    first = await over_ws(app)
    second = await over_stdio(app)
    third = None
    try:
        session = await first.start_session()
        answer = await second.call("session/resume", {"sessionId": session, "cwd": CWD})
        assert answer == {}  # no replay asked, nothing offered yet
        await second.until(lambda _: raw(second, session), 10, "the state after resume")
        assert [p["update"] for p in raw(second, session)] == [{"sessionUpdate": "state_update", "state": "idle"}]
        mark = len(second.events)
        ack = await first.answer_of(first.prompt(session, "hello"))
        await first.stopped(session, 0)
        # the observer saw the first editor's turn as another UI's: running, the question, the answer, idle
        await second.until(lambda _: [p["update"].get("state") for p in raw(second, session, mark)][-1:] == ["idle"],
                           15, "the observer's idle")
        seen = [p["update"] for p in raw(second, session, mark)]
        assert seen[0] == {"sessionUpdate": "state_update", "state": "running"}
        assert seen[-1] == {"sessionUpdate": "state_update", "state": "idle"}
        texts = [(u["sessionUpdate"], u["content"]["text"]) for u in seen if "content" in u]
        assert "".join(t for k, t in texts if k == "user_message_chunk") == "hello"
        assert "".join(t for k, t in texts if k == "agent_message_chunk") == "First answer."
        assert all(isinstance(u["messageId"], str) for u in seen if "content" in u)
        assert ack["result"]["messageId"] not in {u.get("messageId") for u in seen}  # ids are each connection's
        # a neuro-san client's turn reaches both editors, outside any prompt of theirs
        marks = len(first.events), len(second.events)
        async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:
            assert (await turn_of(conn, "pi", "from elsewhere"))[-1].response.text == "Answer to another UI."
        for ed, start in zip((first, second), marks, strict=True):
            await ed.until(lambda _, ed=ed, start=start: [p["update"].get("state") for p in raw(ed, session, start)
                                                          if p["update"]["sessionUpdate"] == "state_update"]
                           == ["running", "idle"], 15, "the other UI's turn, running then idle")
            got = [p["update"] for p in raw(ed, session, start)]
            assert "".join(u["content"]["text"] for u in got if u["sessionUpdate"] == "agent_message_chunk") \
                == "Answer to another UI."
        stop = [e for e in first.nexts(session, marks[0]) if e["kind"] == "stop"]
        assert len(stop) == 1 and stop[0]["stopReason"] is None  # the SDK's reader saw it end too
        # each resumes from its own cursor: the seq of the first update it wants again, inclusive
        seqs = [p["_meta"]["uibus/seq"] for p in raw(second, session, marks[1]) if "_meta" in p]
        assert seqs, "the observer's updates carry their log positions"
        third = await over_ws(app)
        answer = await third.call("session/resume", {"sessionId": session, "cwd": CWD,
                                                     "replayFrom": {"type": "_uibus/seq", "seq": seqs[0]}})
        assert answer == {}
        await third.until(lambda _: state_in(third, session), 10, "the state after the replay")
        replay = [p["update"] for p in raw(third, session)]
        assert replay[-1] == {"sessionUpdate": "state_update", "state": "idle"}  # after the replay, before the answer
        assert next(u for u in replay if u["sessionUpdate"] == "user_message_chunk")["content"]["text"] \
            == "from elsewhere"  # not the first turn: it is before the cursor
        assert "First answer." not in said([{"update": u} for u in replay if "content" in u], "agent_message_chunk")
        mark3 = len(third.events)
        await third.call("session/resume", {"sessionId": session, "cwd": CWD, "replayFrom": {"type": "start"}})
        await third.until(lambda _: state_in(third, session, mark3), 10, "the state after the whole replay")
        whole = [{"update": p["update"]} for p in raw(third, session, mark3) if "content" in p["update"]]
        assert said(whole, "user_message_chunk") == "hellofrom elsewhere"
        assert said(whole, "agent_message_chunk") == "First answer.Answer to another UI."
        code, message = await third.fails("session/resume", {"sessionId": session, "cwd": CWD,
                                                             "replayFrom": {"type": "_elsewhere"}})
        assert code == -32602 and "_elsewhere" in message
        assert (await third.fails("session/load", {"sessionId": session, "cwd": CWD}))[0] == -32601  # v1's only
        for ed in (first, second, third):
            assert ed.invalid() == []
    finally:
        await first.close()
        await second.close()
        if third is not None:
            await third.close()


async def test_cancel_ends_the_turn_idle_cancelled_and_close_says_it_before_answering(
        app: App, model: Model) -> None:
    model.script(Reply(text="Working and working", hang=True), Reply(text="Next turn.", delay_s=0.02),
                 Reply(text="Slow again", hang=True))
    ed = await over_ws(app)
    try:
        session = await ed.start_session()
        ack = await ed.answer_of(ed.prompt(session, "slow"))
        assert ack["ev"] == "response", ack
        await ed.until(lambda _: said(ed.nexts(session), "agent_message_chunk").startswith("Working"), 30,
                       "the first piece")
        ed.send(op="notify", method="session/cancel", params={"sessionId": session})
        stop = await ed.stopped(session, 0, 15)
        assert stop["stopReason"] == "cancelled"
        mark = len(ed.events)
        assert (await ed.answer_of(ed.prompt(session, "again")))["ev"] == "response"  # the session goes on
        assert (await ed.stopped(session, mark))["stopReason"] == "end_turn"
        assert said(ed.nexts(session, mark), "agent_message_chunk") == "Next turn."
        # session/close of a running turn: its idle `cancelled` comes before the close's answer
        mark = len(ed.events)
        await ed.answer_of(ed.prompt(session, "slow again"))
        await ed.until(lambda _: said(ed.nexts(session, mark), "agent_message_chunk").startswith("Slow"), 30,
                       "the first piece")
        closed = await ed.answer_of(ed.start("session/close", {"sessionId": session}), 15)
        assert closed["ev"] == "response", closed
        stops = [e for e in ed.events[mark:] if e["ev"] == "next" and e["kind"] == "stop"]
        assert [s["stopReason"] for s in stops] == ["cancelled"]
        assert ed.events.index(stops[0]) < ed.events.index(closed)
        assert ed.invalid() == []
    finally:
        await ed.close()

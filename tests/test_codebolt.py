"""The CodeBolt gateway end to end: a real WebSocket client (the test plays the CodeBolt agent)
on a real App's HTTP port, and real gRPC clients playing the UIs (Cline webview, extension UI,
the user sending chat messages)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import grpc
import httpx
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.conftest import REPO, Reader, free_port, next_message, wait_for
from tests.support import ext
from uibus.app import App
from uibus.app.installers import CODEBOLT
from uibus.clients.connection import Connection
from uibus.edge.transports.codebolt_ws import PATH
from uibus.infra import kinds
from uibus.infra.config import Config
from uibus.infra.kinds import CHAT_MESSAGE
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2
from uibus.pb.uibus.v1 import codebolt_pb2 as cpb
from uibus.pb.uibus.v1 import codebolt_pb2_grpc
from uibus.pb.uibus.v1 import extension_ui_pb2 as xpb


@pytest.fixture
def app(web: App) -> App:
    """Every test here needs the HTTP port: `app` is conftest's `web`."""
    return web


@pytest.fixture
def connect(web_connect: Callable[..., Connection]) -> Callable[..., Connection]:
    return web_connect


class Agent:
    """The CodeBolt agent's side of the socket."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws

    async def send(self, obj: Any) -> None:
        await self.ws.send(obj if isinstance(obj, str | bytes) else json.dumps(obj))

    async def recv(self, timeout: float = 3.0) -> dict[str, Any]:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))  # type: ignore[no-any-return]

    async def call(self, obj: Any) -> dict[str, Any]:
        await self.send(obj)
        return await self.recv()


@pytest.fixture
async def agent(app: App) -> AsyncIterator[Callable[..., Any]]:
    opened: list[ClientConnection] = []

    async def open_(session: str | None = "s1", headers: dict[str, str] | None = None) -> Agent:
        query = f"?session={session}" if session is not None else ""
        ws = await ws_connect(f"ws://127.0.0.1:{app.http_port}{PATH}{query}", additional_headers=headers or {})
        opened.append(ws)
        return Agent(ws)

    yield open_
    for ws in opened:
        await ws.close()


def codebolt(conn: Connection) -> codebolt_pb2_grpc.CodeBoltServiceStub:
    return codebolt_pb2_grpc.CodeBoltServiceStub(conn.channel)


async def pending(conn: Connection) -> int:
    return (await codebolt(conn).GetStats(cpb.CodeBoltStatsRequest())).session_pending_waits


async def wait_pending(conn: Connection, n: int) -> None:
    for _ in range(400):
        if await pending(conn) == n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"pending waits never became {n}")


def spec(action: str, rid: str, family: str = "chatEvent", **message: Any) -> dict[str, Any]:
    return {"type": family, "action": action, "requestId": rid, "message": message}


# ---------------------------------------------------------------------------------------------

async def test_spec_send_message_reaches_webview_and_history(app: App, agent: Any, connect: Any) -> None:
    webview = Reader(connect("s1").ui.subscribeToPartialMessage(common_pb2.EmptyRequest()))
    other = Reader(connect("s2").ui.subscribeToPartialMessage(common_pb2.EmptyRequest()))
    await wait_for(lambda: app.bus.count(kinds.PARTIAL_MESSAGE) == 2, what="webview subscriptions")
    a = await agent("s1")

    reply = await a.call(spec("sendMessage", "req-1", message="Hello from the agent"))
    assert reply["requestId"] == "req-1" and reply["success"] is True, reply
    assert reply["timestamp"].endswith("Z") and "error" not in reply
    msg = await next_message(webview)
    assert (msg.type, msg.say, msg.text, msg.partial) == (ui_pb2.SAY, ui_pb2.TEXT, "Hello from the agent", False)
    assert msg.ts == reply["data"]["ts"] and reply["data"]["subscribers"] == 1
    with pytest.raises(asyncio.TimeoutError):  # sessions never cross
        await next_message(other, timeout=0.2)

    history = await a.call(spec("getChatHistory", "req-2"))
    assert history["success"] is True
    assert [(e["role"], e["text"], e["source"]) for e in history["data"]] == [
        ("assistant", "Hello from the agent", "codebolt")]
    assert history["data"][0]["ts"] == msg.ts


async def test_flat_form_as_codeboltjs_sends_it(app: App, agent: Any, connect: Any) -> None:
    webview = Reader(connect("s1").ui.subscribeToPartialMessage(common_pb2.EmptyRequest()))
    await wait_for(lambda: app.bus.count(kinds.PARTIAL_MESSAGE, "s1") == 1, what="webview subscription")
    a = await agent("s1")
    # Fire-and-forget (no requestId): no reply, or codeboltjs would take it for a user message.
    await a.send({"type": "sendMessage", "message": "first", "payload": {"x": 1}})
    await a.send({"type": "sendMessage", "message": "second"})
    assert (await next_message(webview)).text == "first"
    assert (await next_message(webview)).text == "second"
    reply = await a.call({"type": "getChatHistory", "threadId": "t1", "requestId": "req_1_1700000000000"})
    assert reply["type"] == "getChatHistoryResponse" and reply["requestId"] == "req_1_1700000000000"
    assert [e["text"] for e in reply["data"]] == ["first", "second"]  # nothing else was sent before it
    # The old codeboltjs (no requestId on calls) matches by type: getters are answered anyway.
    reply = await a.call({"type": "getChatHistory"})
    assert reply["type"] == "getChatHistoryResponse" and reply["success"] is True and reply["requestId"] == ""


async def test_session_from_header(app: App, agent: Any) -> None:
    a = await agent(None, headers={"x-uibus-session": "from-header"})
    assert (await a.call(spec("sendMessage", "r", message="hi")))["success"] is True
    history = await a.call(spec("getChatHistory", "r2"))
    assert [e["text"] for e in history["data"]] == ["hi"]
    b = await agent(None)  # no session named: "default", which has no such message
    assert (await b.call(spec("getChatHistory", "r3")))["data"] == []


async def test_wait_for_reply_resolves_on_user_message(app: App, agent: Any, connect: Any) -> None:
    ui = connect("s1")
    webview = Reader(ui.ui.subscribeToPartialMessage(common_pb2.EmptyRequest()))
    await wait_for(lambda: app.bus.count(kinds.PARTIAL_MESSAGE, "s1") == 1, what="webview subscription")
    a = await agent("s1")
    await a.send({"type": "waitforReply", "message": "Which database?", "requestId": "req_7_1"})
    assert (await next_message(webview)).text == "Which database?"  # the prompt is shown
    await wait_pending(ui, 1)

    sent = await codebolt(ui).SendUserMessage(cpb.UserMessage(text="Postgres, please"))
    assert sent.answered == 1
    reply = await a.recv()
    assert reply["type"] == "waitFormessageResponse" and reply["requestId"] == "req_7_1"
    assert reply["success"] is True and reply["message"]["userMessage"] == "Postgres, please"
    assert reply["data"] == {"text": "Postgres, please", "ts": sent.ts, "source": "ui"}
    shown = await next_message(webview)
    assert (shown.say, shown.text, shown.ts) == (ui_pb2.USER_FEEDBACK, "Postgres, please", sent.ts)
    await wait_pending(ui, 0)
    assert app.bus.count(CHAT_MESSAGE) == 1  # the wait's subscription is gone; the connection's own push stays
    with pytest.raises(asyncio.TimeoutError):  # an answer is never pushed as well
        await a.recv(timeout=0.3)

    history = await a.call({"type": "getChatHistory", "requestId": "h"})
    assert [(e["role"], e["text"]) for e in history["data"]] == [
        ("assistant", "Which database?"), ("user", "Postgres, please")]
    # A message no wait takes is pushed as codeboltjs's messageResponse (its onActionMessage).
    assert (await codebolt(ui).SendUserMessage(cpb.UserMessage(text="later"))).answered == 1
    pushed = await a.recv()
    assert pushed["type"] == "messageResponse" and pushed["message"]["userMessage"] == "later"
    assert pushed["data"] == {"text": "later"} and "requestId" not in pushed
    await a.ws.close()
    await wait_for(lambda: app.bus.count(CHAT_MESSAGE) == 0, what="the connection's push subscription to go")
    # With no agent connected, a message is kept in the history only.
    assert (await codebolt(ui).SendUserMessage(cpb.UserMessage(text="later still"))).answered == 0


async def test_user_message_from_the_cli(app: App, agent: Any, connect: Any) -> None:
    a = await agent("cli-s")
    await a.send(spec("waitforReply", "w1"))
    await wait_pending(connect("cli-s"), 1)
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "clients.cli", "call", "SendUserMessage", '{"text": "from the cli"}',
                         "--target", f"127.0.0.1:{app.port}", "--session", "cli-s"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["answered"] == 1
    reply = await a.recv()
    assert reply["requestId"] == "w1" and reply["data"]["text"] == "from the cli"


async def test_bad_user_message_is_invalid_argument(app: App, connect: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await codebolt(connect("s1")).SendUserMessage(cpb.UserMessage(text="  "))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text is required" in err.value.details()


async def test_confirmation_answered_by_extension_ui(app: App, agent: Any, connect: Any) -> None:
    ui = connect("s1")
    events = ext(ui).Subscribe(xpb.SubscribeRequest())
    await wait_for(lambda: app.bus.count(kinds.EXTENSION_UI, "s1") == 1, what="extension UI stream")
    a = await agent("s1")

    await a.send(spec("confirmationRequest", "c1", message="Deploy to production?", buttons=["Deploy", "Cancel"]))
    event = await asyncio.wait_for(events.read(), 3)
    assert event.request.select.title == "Deploy to production?"
    assert list(event.request.select.options) == ["Deploy", "Cancel"]
    await ext(ui).Respond(xpb.RespondRequest(id=event.request.id, value="Deploy"))
    reply = await a.recv()
    assert reply["requestId"] == "c1" and reply["success"] is True and reply["type"] == "confirmationResponse"
    assert reply["message"] == reply["answer"] == "Deploy"  # codeboltjs's ConfirmationResponse
    assert reply["data"] == {"button": "Deploy", "dialogId": event.request.id}
    closed = await asyncio.wait_for(events.read(), 3)
    assert closed.closed.id == event.request.id and closed.closed.reason == xpb.DIALOG_OUTCOME_ANSWERED

    # codeboltjs form, default Yes/No buttons; the user dismisses it.
    await a.send({"type": "confirmationRequest", "message": "Delete it?", "requestId": "req_2_1"})
    event = await asyncio.wait_for(events.read(), 3)
    assert list(event.request.select.options) == ["Yes", "No"]
    await ext(ui).Respond(xpb.RespondRequest(id=event.request.id, cancelled=True))
    reply = await a.recv()
    assert reply["requestId"] == "req_2_1" and reply["success"] is False and "dismissed" in reply["error"]
    assert (await asyncio.wait_for(events.read(), 3)).closed.reason == xpb.DIALOG_OUTCOME_CANCELLED

    # withFeedback: a chat message from the user answers first; the dialog closes for every UI.
    await a.send({"type": "confirmationRequest", "message": "Proceed?", "buttons": ["Go"], "withFeedback": True,
                  "requestId": "req_3_1"})
    event = await asyncio.wait_for(events.read(), 3)
    sent = await codebolt(ui).SendUserMessage(cpb.UserMessage(text="Wait, use staging"))
    assert sent.answered == 1
    reply = await a.recv()
    assert reply["type"] == "feedbackResponse" and reply["success"] is True
    assert reply["message"] == reply["feedback"] == "Wait, use staging"  # its FeedbackResponse
    closed = await asyncio.wait_for(events.read(), 3)
    assert closed.closed.id == event.request.id and closed.closed.reason == xpb.DIALOG_OUTCOME_CALLER_CANCELLED
    await wait_pending(ui, 0)
    events.cancel()


async def test_notification_and_process_status(app: App, agent: Any, connect: Any) -> None:
    ui = connect("s1")
    events = ext(ui).Subscribe(xpb.SubscribeRequest())
    await wait_for(lambda: app.bus.count(kinds.EXTENSION_UI, "s1") == 1, what="extension UI stream")
    a = await agent("s1")
    await a.send({"type": "notificationEvent", "message": "Build passed", "eventType": "terminal"})
    await a.send({"type": "processStarted"})
    assert (await asyncio.wait_for(events.read(), 3)).request.notify.message == "Build passed"
    status = (await asyncio.wait_for(events.read(), 3)).request.set_status
    assert (status.key, status.text) == ("codebolt", "running")
    reply = await a.call(spec("processFinished", "p1"))
    assert reply["success"] is True and reply["data"]["status"] == "finished"
    status = (await asyncio.wait_for(events.read(), 3)).request.set_status
    assert status.text == "finished"
    events.cancel()
    # A UI that joins later gets the kept status first.
    late = ext(connect("s1")).Subscribe(xpb.SubscribeRequest())
    first = await asyncio.wait_for(late.read(), 3)
    assert first.request.replayed and first.request.set_status.text == "finished"
    late.cancel()


async def test_state_and_memory_round_trip_and_persist(web_config: Config, agent: Any, app: App) -> None:
    a = await agent("mem")
    reply = await a.call({"type": "agentStateEvent", "action": "addToAgentState",
                          "payload": {"key": "plan", "value": "step 2"}, "requestId": "req_1"})
    assert reply["type"] == "addToAgentStateResponse" and reply["payload"] == {"success": True}
    reply = await a.call(spec("addToAgentState", "s2", family="stateEvent", key="mode", value="fast"))
    assert reply["success"] is True
    reply = await a.call({"type": "agentStateEvent", "action": "getAgentState", "requestId": "req_3"})
    assert reply["type"] == "getAgentStateResponse" and reply["payload"] == {"mode": "fast", "plan": "step 2"}
    reply = await a.call(spec("updateProjectState", "s4", family="stateEvent", key="branch", value="main"))
    assert reply["success"] is True
    reply = await a.call({"type": "projectStateEvent", "action": "getAppState", "requestId": "req_5"})
    assert reply["type"] == "getAppStateResponse"
    assert reply["data"]["agentState"]["plan"] == "step 2" and reply["data"]["projectState"] == {"branch": "main"}

    value = {"files": ["a.py", "b.py"], "n": 2}
    reply = await a.call(spec("memorySet", "m1", family="memoryEvent", key="ctx", value=value))
    assert reply["success"] is True and reply["data"] == {"key": "ctx"}
    reply = await a.call({"type": "memoryEvent", "action": "set", "key": "note", "value": "remember", "requestId": "q"})
    assert reply["type"] == "memorySetResponse" and reply["success"] is True
    reply = await a.call(spec("memoryGet", "m2", family="memoryEvent", key="ctx"))
    assert reply["data"] == {"key": "ctx", "value": value, "found": True}
    reply = await a.call({"type": "memoryEvent", "action": "get", "key": "missing", "requestId": "q2"})
    assert reply["type"] == "memoryGetResponse" and reply["data"]["found"] is False and reply["value"] is None
    # The values live in the session store, and survive a restart on the same file.
    assert await app.store.get("mem", "codebolt/memory/ctx") == value
    other = await agent("other")
    assert (await other.call(spec("memoryGet", "o", family="memoryEvent", key="ctx")))["data"]["found"] is False

    await app.aclose(grace=0.5)
    second = App(replace(web_config, http_port=free_port()))
    await second.start()
    try:
        async with ws_connect(f"ws://127.0.0.1:{second.http_port}{PATH}?session=mem") as ws:
            b = Agent(ws)
            assert (await b.call(spec("memoryGet", "m", family="memoryEvent", key="ctx")))["data"]["value"] == value
            state = await b.call({"type": "agentStateEvent", "action": "getAgentState", "requestId": "g"})
            assert state["payload"] == {"mode": "fast", "plan": "step 2"}
    finally:
        await second.aclose(grace=0.5)


@pytest.mark.parametrize(("family", "action"), [
    ("fsEvent", "createFile"), ("gitEvent", "gitCommit"), ("terminalEvent", "executeCommand"),
    ("browserEvent", "goToPage"), ("llmEvent", "inference")])
async def test_unsupported_actions_name_the_action(app: App, agent: Any, family: str, action: str) -> None:
    a = await agent("s1")
    reply = await a.call(spec(action, "u1", family=family, command="rm -rf /", url="https://example.com"))
    assert reply["requestId"] == "u1" and reply["success"] is False
    assert f"{family}.{action}" in reply["error"] and "does not execute" in reply["error"]
    # codeboltjs's own spellings of other families are refused by name too, with their reply type.
    reply = await a.call({"type": "inference", "message": {"messages": []}, "requestId": "u2"})
    assert reply["success"] is False and "llmEvent.inference" in reply["error"]
    assert reply["type"] == "llmResponse" and reply["code"] == "UNIMPLEMENTED"
    # A type nobody defines is still refused by name.
    reply = await a.call({"type": "teleport", "requestId": "u3"})
    assert reply["success"] is False and "'teleport'" in reply["error"] and reply["type"] == "error"
    assert (await a.call(spec("getChatHistory", "ok")))["success"] is True  # still usable


@pytest.mark.parametrize(("frame", "rid", "expect"), [
    ("{not json", "", "malformed JSON"),
    ("[1, 2]", "", "got a JSON array"),
    ('{"action": "sendMessage", "requestId": "r1"}', "r1", "non-empty string `type`"),
    ('{"type": "chatEvent", "requestId": "r2", "message": {}}', "r2", "needs a non-empty string `action`"),
    ('{"type": "chatEvent", "action": "fly", "requestId": "r3", "message": {}}', "r3", "'fly' is not an action"),
    ('{"type": "chatEvent", "action": "sendMessage", "requestId": "r4", "message": "hi"}', "r4",
     "`message` must be a JSON object"),
    ('{"type": "chatEvent", "action": "sendMessage", "requestId": 7, "message": {}}', "", "requestId must be a string"),
    ("[" * 50000 + "]" * 50000, "", "malformed JSON"),  # nested too deep to read: refused, not a crash
    ('{"type": "chatEvent", "action": "sendMessage", "requestId": "r5", "message": {}}', "r5", "`message` is required"),
    ('{"type": "memoryEvent", "action": "set", "requestId": "r6", "value": 1}', "r6", "`key` is required"),
    ('{"type": "chatEvent", "action": "confirmationRequest", "requestId": "r7", "message": {"message": "ok?", '
     '"buttons": "Yes"}}', "r7", "`buttons` must be a list"),
    ('{"type": "chatEvent", "action": "getChatHistory", "requestId": "r8", "message": {"limit": 0}}', "r8",
     "`limit` must be an integer"),
])
async def test_bad_envelopes_answered_and_connection_stays(app: App, agent: Any, frame: str, rid: str,
                                                           expect: str) -> None:
    a = await agent("s1")
    reply = await a.call(frame)
    assert reply["success"] is False and reply["requestId"] == rid and expect in reply["error"], reply
    assert (await a.call(spec("sendMessage", "after", message="still here")))["success"] is True


async def test_a_frame_without_request_id_is_answered_by_type(app: App, agent: Any) -> None:
    """codeboltjs never sends a requestId and matches replies by `type`: the AsyncAPI form without
    one is answered the same way (and an unsupported action still names itself)."""
    a = await agent("s1")
    reply = await a.call({"type": "fsEvent", "action": "grepSearch", "message": {"pattern": "x"}})
    assert (reply["type"], reply["requestId"], reply["success"]) == ("grepSearchResponse", "", False)
    assert reply["error"].startswith("fsEvent.grepSearch: uibus does not execute file-system actions")
    reply = await a.call({"type": "browserEvent", "action": "getUrl"})  # the library reads `event` here
    assert reply["event"] == "getUrlResponse" and reply["success"] is False
    reply = await a.call({"type": "agentEvent", "action": "startAgent", "agentId": "a-7", "task": "t"})
    assert (reply["type"], reply["agentId"]) == ("taskCompletionResponse", "a-7")  # the library compares it


async def test_oversized_and_binary_frames(app: App, agent: Any) -> None:
    a = await agent("s1")
    limit = app[CODEBOLT].max_message_bytes
    reply = await a.call(json.dumps(spec("sendMessage", "big", message="x" * limit)))
    assert reply["success"] is False and f"the limit is {limit}" in reply["error"]
    reply = await a.call(b"\xff\xfe")
    assert reply["success"] is False and "UTF-8" in reply["error"]
    reply = await a.call(json.dumps(spec("getChatHistory", "bin")).encode())  # UTF-8 JSON in a binary frame is fine
    assert reply["success"] is True and reply["data"] == []


async def test_closing_mid_wait_leaves_nothing(app: App, agent: Any, connect: Any) -> None:
    ui = connect("s1")
    events = ext(ui).Subscribe(xpb.SubscribeRequest())
    await wait_for(lambda: app.bus.count(kinds.EXTENSION_UI, "s1") == 1, what="extension UI stream")
    a = await agent("s1")
    await a.send(spec("waitforReply", "w1"))
    await a.send(spec("confirmationRequest", "c1", message="Sure?", withFeedback=True))
    dialog = await asyncio.wait_for(events.read(), 3)
    await wait_pending(ui, 2)
    stats = await ext(ui).GetStats(xpb.StatsRequest())
    # Two waits' subscriptions and the connection's own (the messageResponse push).
    assert stats.session_pending_dialogs == 1 and app.bus.count(CHAT_MESSAGE, "s1") == 3
    assert app[CODEBOLT].count() == 1

    await a.ws.close()
    await wait_for(lambda: app[CODEBOLT].count() == 0 and app[CODEBOLT].pending() == 0, what="gateway cleanup")
    assert app.bus.count(CHAT_MESSAGE) == 0
    assert (await ext(ui).GetStats(xpb.StatsRequest())).pending_dialogs == 0
    closed = await asyncio.wait_for(events.read(), 3)
    assert closed.closed.id == dialog.request.id and closed.closed.reason == xpb.DIALOG_OUTCOME_CALLER_CANCELLED
    assert (await codebolt(ui).SendUserMessage(cpb.UserMessage(text="too late"))).answered == 0
    events.cancel()


async def test_waits_per_connection_are_bounded(app: App, agent: Any, connect: Any) -> None:
    app[CODEBOLT].max_waits = 2
    a = await agent("s1")
    for rid in ("w1", "w2"):
        await a.send(spec("waitforReply", rid))
    await wait_pending(connect("s1"), 2)
    reply = await a.call(spec("waitforReply", "w3"))
    assert reply["requestId"] == "w3" and reply["success"] is False and "limit 2" in reply["error"]
    assert (await a.call(spec("memoryGet", "m", family="memoryEvent", key="k")))["success"] is True


async def test_bad_session_name_is_refused_on_the_socket(app: App, agent: Any) -> None:
    a = await agent("bad%20name!")
    reply = await a.recv()
    assert reply["success"] is False and "session name" in reply["error"]
    with pytest.raises(ConnectionClosed) as closed:
        await a.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


async def test_token_required_when_configured(web_config: Config) -> None:
    app = App(replace(web_config, auth_token="s3cret"))
    await app.start()
    try:
        url = f"ws://127.0.0.1:{app.http_port}{PATH}?session=t"
        with pytest.raises(InvalidStatus) as refused:
            await ws_connect(url)
        # As on the HTTP API: 401 with the status in the body.
        assert refused.value.response.status_code == 401
        assert json.loads(refused.value.response.body)["code"] == "UNAUTHENTICATED"
        async with ws_connect(url, additional_headers={"authorization": "Bearer s3cret"}) as ws:
            assert (await Agent(ws).call(spec("getChatHistory", "r")))["success"] is True
    finally:
        await app.aclose(grace=0.5)


async def test_shutdown_answers_waits_and_closes(app: App, agent: Any, connect: Any) -> None:
    a = await agent("s1")
    await a.send(spec("waitforReply", "w1"))
    await wait_pending(connect("s1"), 1)
    await app.aclose(grace=1.0)
    reply = await a.recv()
    assert reply["requestId"] == "w1" and reply["success"] is False and "shutting down" in reply["error"]
    with pytest.raises(ConnectionClosed):
        await a.recv()
    assert app[CODEBOLT].count() == 0 and app.bus.count(CHAT_MESSAGE) == 0


async def test_a_wait_gets_the_first_of_a_burst(app: App, agent: Any, connect: Any) -> None:
    a = await agent("s1")
    await a.send(spec("waitforReply", "w1"))
    await wait_pending(connect("s1"), 1)
    # In one loop tick, all queued before the wait reads any: an agent's own entry, then users'.
    for role, text in (("assistant", "zero"), ("user", "one"), ("user", "two"), ("user", "three")):
        app.bus.publish("s1", CHAT_MESSAGE, {"role": role, "text": text, "ts": 1, "source": "ui"})
    reply = await a.recv()
    assert reply["requestId"] == "w1" and reply["data"]["text"] == "one"


async def test_a_streaming_chat_turn_answers_a_wait(app: App, agent: Any, connect: Any) -> None:
    """A user chatting with a neuro-san agent in the same session is a user message too."""
    a = await agent("s1")
    await a.send({"type": "waitforReply", "message": "Anything else?", "requestId": "req_9_1"})
    conn = connect("s1")
    await wait_pending(conn, 1)
    chat = conn.channel.unary_stream("/hello_world.AgentService/StreamingChat",
                                     request_serializer=agent_pb2.ChatRequest.SerializeToString,
                                     response_deserializer=agent_pb2.ChatResponse.FromString)
    answers = [r async for r in chat(agent_pb2.ChatRequest(
        user_message=chat_pb2.ChatMessage(type=chat_pb2.ChatMessage.HUMAN, text="ship it")))]
    assert answers and answers[-1].response.text  # the neuro-san agent answered as usual
    reply = await a.recv()
    assert reply["requestId"] == "req_9_1" and reply["message"]["userMessage"] == "ship it"
    assert reply["data"]["source"] == "neuro-san"
    history = await a.call({"type": "getChatHistory", "requestId": "h"})
    assert [e["role"] for e in history["data"]] == ["assistant", "user", "assistant"]


async def test_codeboltjs_connection_path(app: App) -> None:
    """codeboltjs connects to /codebolt?id=…&agentId=… with no session: it joins "default"."""
    async with ws_connect(f"ws://127.0.0.1:{app.http_port}/codebolt?id=conn-1&agentId=a1") as ws:
        a = Agent(ws)
        await a.send({"type": "sendMessage", "message": "via the codeboltjs path"})
        reply = await a.call({"type": "getChatHistory", "requestId": "req_1_1"})
        assert [e["text"] for e in reply["data"]] == ["via the codeboltjs path"]
        assert app[CODEBOLT].count("default") == 1


async def test_plain_http_is_told_to_upgrade(app: App) -> None:
    async with httpx.AsyncClient() as client:
        reply = await client.get(f"http://127.0.0.1:{app.http_port}{PATH}")
    assert reply.status_code == 426 and "WebSocket endpoint" in reply.text

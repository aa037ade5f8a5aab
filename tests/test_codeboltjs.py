"""The real CodeBolt agent library, `@codebolt/codeboltjs` (pinned in tests/codeboltjs/), unmodified,
against a real uibus: nothing it calls may hang.

* The table (tests/codeboltjs/codeboltjs-table.json) is what the library sends and waits for, read
  off the installed library by extract.js; the first test proves the committed table is still
  what the library does.
* Every frame of the table, parsed by the gateway, is answered with a reply the library's own
  function accepts (static, exhaustive).
* drive.js calls every function once through the library; this test plays the UI side over real
  gRPC (webview stream, extension-UI dialogs, SendUserMessage) and checks each call settled within
  a second with the right data, then that the app's user-message push reaches the agent's
  onActionMessage handler, and that nothing is left open after the agent disconnects.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, Reader, next_message, require, wait_for
from tests.support import ext
from uibus.app import App
from uibus.app.installers import CODEBOLT
from uibus.edge.codebolt import protocol
from uibus.infra import kinds
from uibus.pb.cline import common_pb2
from uibus.pb.uibus.v1 import codebolt_pb2 as cpb
from uibus.pb.uibus.v1 import codebolt_pb2_grpc
from uibus.pb.uibus.v1 import extension_ui_pb2 as xpb

HERE = REPO / "tests" / "codeboltjs"
TABLE = json.loads((HERE / "codeboltjs-table.json").read_text())
SESSION = "default"  # where the library's /codebolt?id=… lands
ROWS = [r for r in TABLE["calls"] if r["kind"] != "listener"]


def _node() -> str:
    node = shutil.which("node")
    require("node", node is not None, "node")
    require("the pinned codeboltjs (bash .ci/setup)", (HERE / "node_modules/@codebolt/codeboltjs").is_dir(), "node")
    assert node is not None
    return node


def _served(row: dict[str, Any]) -> bool:
    return bool(row["sends"]) and protocol.parse(json.dumps(row["sends"][0])).family in protocol.SERVED_FAMILIES


@pytest.mark.node
async def test_table_is_what_the_installed_library_does() -> None:
    proc = await asyncio.create_subprocess_exec(_node(), "extract.js", cwd=HERE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0
    fresh = json.loads(out)
    assert fresh["version"] == TABLE["version"] == "1.1.99"
    assert fresh == TABLE, "the library changed: run `node extract.js > codeboltjs-table.json` in tests/codeboltjs"


@pytest.mark.parametrize("row", [r for r in ROWS if r["sends"]], ids=lambda r: r["call"])
def test_every_frame_gets_the_reply_its_function_waits_for(row: dict[str, Any]) -> None:
    frame = row["sends"][0]
    req = protocol.parse(json.dumps(frame))
    settling = {(w["key"], w["value"]) for w in row["waits"] if w.get("settles")}
    if not settling:  # fire-and-forget: it waits for nothing, so it must get no success reply
        assert row["kind"] in ("none", "process"), row
        return
    fields = {"type": req.reply_type, **req.reply_fields()}
    assert any(fields.get(key) == value for key, value in settling), (row["call"], fields, settling)
    for w in row["waits"]:  # and whatever else the library compares is echoed from the frame
        for name, arg in w["match"].items():
            assert fields.get(name) == frame.get(name, arg), (row["call"], name)


@pytest.mark.node
async def test_the_real_library_never_hangs(web: App, web_connect: Any, tmp_path: Path) -> None:
    node = _node()
    app = web
    gateway = app[CODEBOLT]
    ui = web_connect(SESSION)
    webview = Reader(ui.ui.subscribeToPartialMessage(common_pb2.EmptyRequest()))
    dialogs = ext(ui).Subscribe(xpb.SubscribeRequest())
    await wait_for(lambda: app.bus.count(kinds.PARTIAL_MESSAGE, SESSION) == 1
                   and app.bus.count(kinds.EXTENSION_UI, SESSION) == 1, what="UI streams")
    user = codebolt_pb2_grpc.CodeBoltServiceStub(ui.channel)

    (tmp_path / "codeboltagent.yaml").write_text("unique_connectionid: uibus-test\n")
    proc = await asyncio.create_subprocess_exec(
        node, str(HERE / "drive.js"), cwd=tmp_path, env={**os.environ, "SOCKET_PORT": str(app.http_port)},
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    results: dict[str, dict[str, Any]] = {}
    pushed: list[dict[str, Any]] = []
    events: list[xpb.ServerEvent] = []

    async def dialog_event() -> xpb.ServerEvent:
        while True:
            event = await asyncio.wait_for(dialogs.read(), 3)
            events.append(event)
            if event.HasField("request") and event.request.HasField("select"):
                return event

    async def go_on() -> None:
        assert proc.stdin is not None
        proc.stdin.write(b"\n")
        await proc.stdin.drain()

    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line, (await proc.stderr.read()).decode()[-3000:] if proc.stderr else "drive.js ended"
            msg = json.loads(line)
            kind = msg["event"]
            if kind == "ready":
                await wait_for(lambda: gateway.count(SESSION) == 1, what="the library's connection")
                # No wait is pending: the user's message goes to the agent's onActionMessage handler.
                sent = await user.SendUserMessage(cpb.UserMessage(text="Build the login page"))
                assert sent.answered == 1
            elif kind == "pushed":
                pushed.append(msg["value"])
                await go_on()
            elif kind == "call" and msg["call"] == "chat.waitforReply":
                await wait_for(lambda: gateway.user_waiters(SESSION) == 1, what="waitforReply")
                assert (await user.SendUserMessage(cpb.UserMessage(text="Postgres, please"))).answered == 1
            elif kind == "call" and msg["call"] in ("chat.sendConfirmationRequest", "chat.askQuestion"):
                event = await dialog_event()
                await ext(ui).Respond(xpb.RespondRequest(id=event.request.id, value=event.request.select.options[0]))
            elif kind == "call":
                pass
            elif kind == "result":
                results[msg["call"]] = msg
            elif kind == "done":
                await go_on()
                break
            else:
                raise AssertionError(msg)
        _, err = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, err.decode()[-3000:]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        pass

    # Every function settled within a second; stubs of the library itself are the only exceptions.
    expected = {r["call"] for r in ROWS if r["sends"] or r["kind"] != "promise" or r.get("local")}
    assert expected <= set(results), sorted(expected - set(results))
    slow = {c: r for c, r in results.items() if not r["settled"] and c in expected}
    assert not slow, slow
    assert max(r["ms"] for r in results.values()) < 1000

    by_call = {r["call"]: r for r in ROWS}
    for call, result in results.items():
        row = by_call[call]
        value = result.get("value")
        if _served(row):
            if isinstance(value, dict):
                assert value.get("success") is not False, (call, value)
            if "valid" in result:
                assert result["valid"] == "ok", (call, result["valid"])
        elif row["sends"] and isinstance(value, dict) and "success" in value:
            name = protocol.parse(json.dumps(row["sends"][0])).name
            assert value["success"] is False and name in value["error"] and "does not execute" in value["error"], \
                (call, value)
            assert value["code"] == "UNIMPLEMENTED"

    # Served data, round trips through the UI side.
    assert results["dbmemory.addKnowledge"]["value"]["type"] == "memorySetResponse"
    got = results["dbmemory.getKnowledge"]["value"]
    assert (got["type"], got["key"], got["value"]) == ("memoryGetResponse", "k1", {"v": 1})
    assert results["cbstate.getAgentState"]["value"]["payload"] == {"k1": "v1"}
    assert results["cbstate.getProjectState"]["value"]["projectState"] == {}  # called before the update
    assert results["cbstate.updateProjectState"]["value"]["state"] == {"k1": "v1"}
    history = [(m["role"], m["content"]) for m in results["chat.getChatHistory"]["value"]["messages"]]
    assert history == [("user", "Build the login page"), ("assistant", "agent got: Build the login page")]
    reply = results["chat.waitforReply"]["value"]
    assert reply["type"] == "waitFormessageResponse" and reply["message"]["userMessage"] == "Postgres, please"
    assert results["chat.sendConfirmationRequest"]["value"]["answer"] == "Yes"
    assert results["chat.askQuestion"]["value"]["answer"] == "A"
    assert results["fs.readFile"]["value"]["type"] == "readFileResponse"
    assert results["git.status"]["value"]["type"] == "StatusResponse"
    assert results["terminal.executeCommand"]["value"]["type"] == "commandError"
    assert results["agent.startAgent"]["value"]["agentId"] == "agent-1"
    assert results["codeutils.getJsTree"]["value"]["event"] == "GetJsTreeResponse"  # the library parsed it itself

    # What the fire-and-forget calls did, as the UIs saw it.
    shown = [(await next_message(webview)).text for _ in range(5)]
    assert shown == ["Build the login page", "agent got: Build the login page", "hello from the agent",
                     "your turn", "Postgres, please"]
    while True:  # the status and notice events that came after the last dialog
        try:
            events.append(await asyncio.wait_for(dialogs.read(), 0.3))
        except TimeoutError:
            break
    statuses = [e.request.set_status.text for e in events if e.HasField("request")
                and e.request.HasField("set_status")]
    notes = [e.request.notify.message for e in events if e.HasField("request") and e.request.HasField("notify")]
    # onActionMessage's answer is processStoped; then processStarted, stopProcess, processFinished.
    assert notes == ["note"] and statuses == ["stopped", "running", "stopped", "finished"], (notes, statuses)

    # The push: the user's message reached onActionMessage, in the shape the library's types give.
    assert [p["message"]["userMessage"] for p in pushed] == ["Build the login page"]
    assert pushed[0]["type"] == "messageResponse" and pushed[0]["sender"]["senderType"] == "user"
    await wait_for(lambda: gateway.count() == 0, what="the library's connection to close")

    # Nothing left open: no connection, no wait, no bus subscription but the test's own UI streams.
    assert gateway.pending() == 0 and gateway.count() == 0
    assert app.bus.count(kinds.CHAT_MESSAGE) == 0
    dialogs.cancel()
    webview.cancel()
    await wait_for(lambda: app.bus.count(kinds.PARTIAL_MESSAGE) == 0 and app.bus.count(kinds.EXTENSION_UI) == 0,
                   what="UI streams to close")

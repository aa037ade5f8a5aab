"""`uibus ext-ui-stdio` as a subprocess: pi's RPC extension-UI JSON lines, both ways, over a real server."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tests.conftest import REPO, wait_for
from tests.ext_ui_helpers import ext, open_uis, read
from uibus.app import App
from uibus.infra import kinds
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

# The nine request examples of pi's RPC docs ("Extension UI Protocol" in `docs/rpc.md` of the npm package
# @mariozechner/pi-coding-agent, tests/pi/node_modules/…), verbatim.
SEED_REQUESTS: list[dict[str, Any]] = [
    {"type": "extension_ui_request", "id": "uuid-1", "method": "select", "title": "Allow dangerous command?",
     "options": ["Allow", "Block"], "timeout": 10000},
    {"type": "extension_ui_request", "id": "uuid-2", "method": "confirm", "title": "Clear session?",
     "message": "All messages will be lost.", "timeout": 5000},
    {"type": "extension_ui_request", "id": "uuid-3", "method": "input", "title": "Enter a value",
     "placeholder": "type something..."},
    {"type": "extension_ui_request", "id": "uuid-4", "method": "editor", "title": "Edit some text",
     "prefill": "Line 1\nLine 2\nLine 3"},
    {"type": "extension_ui_request", "id": "uuid-5", "method": "notify", "message": "Command blocked by user",
     "notifyType": "warning"},
    {"type": "extension_ui_request", "id": "uuid-6", "method": "setStatus", "statusKey": "my-ext",
     "statusText": "Turn 3 running..."},
    {"type": "extension_ui_request", "id": "uuid-7", "method": "setWidget", "widgetKey": "my-ext",
     "widgetLines": ["--- My Widget ---", "Line 1", "Line 2"], "widgetPlacement": "aboveEditor"},
    {"type": "extension_ui_request", "id": "uuid-8", "method": "setTitle", "title": "atomic - my project"},
    {"type": "extension_ui_request", "id": "uuid-9", "method": "set_editor_text",
     "text": "prefilled text for the user"},
]
# The same nine, as the agent side asks them over gRPC.
AGENT_CALLS: list[tuple[str, Any]] = [
    ("Select", pb.SelectRequest(title="Allow dangerous command?", options=["Allow", "Block"], timeout_ms=10000)),
    ("Confirm", pb.ConfirmRequest(title="Clear session?", message="All messages will be lost.", timeout_ms=5000)),
    ("Input", pb.InputRequest(title="Enter a value", placeholder="type something...")),
    ("Editor", pb.EditorRequest(title="Edit some text", prefill="Line 1\nLine 2\nLine 3")),
    ("Notify", pb.NotifyRequest(message="Command blocked by user", notify_type=pb.NOTIFY_TYPE_WARNING)),
    ("SetStatus", pb.SetStatusRequest(key="my-ext", text="Turn 3 running...")),
    ("SetWidget", pb.SetWidgetRequest(key="my-ext", lines=["--- My Widget ---", "Line 1", "Line 2"],
                                      placement=pb.WIDGET_PLACEMENT_ABOVE_EDITOR)),
    ("SetTitle", pb.SetTitleRequest(title="atomic - my project")),
    ("SetEditorText", pb.SetEditorTextRequest(text="prefilled text for the user")),
]
# The three response examples, verbatim except for the id placeholder.
SEED_RESPONSES = [
    '{"type": "extension_ui_response", "id": "%s", "value": "Allow"}',
    '{"type": "extension_ui_response", "id": "%s", "confirmed": true}',
    '{"type": "extension_ui_response", "id": "%s", "cancelled": true}',
]


class BridgeProcess:
    """`python -m clients.cli ext-ui-stdio` with pipes for stdin and stdout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.raw: list[bytes] = []

    async def line(self, timeout: float = 5.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        assert raw.endswith(b"\n"), f"bridge ended its output: {raw!r}"
        self.raw.append(raw)
        obj = json.loads(raw)
        assert isinstance(obj, dict)
        return obj

    async def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        await self.proc.stdin.drain()

    async def close_stdin(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return await asyncio.wait_for(self.proc.wait(), 10)


@pytest.fixture
async def bridge(app: App) -> AsyncIterator[Callable[..., Any]]:
    procs: list[asyncio.subprocess.Process] = []

    async def start(session: str = "default", *args: str) -> BridgeProcess:
        before = app.bus.count(kinds.EXTENSION_UI, session)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "clients.cli", "ext-ui-stdio", "--target", f"127.0.0.1:{app.port}",
            "--session", session, *args, cwd=REPO, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE)
        procs.append(proc)
        await wait_for(lambda: app.bus.count(kinds.EXTENSION_UI, session) == before + 1 or
                       proc.returncode is not None, timeout=30, what="the bridge to subscribe")
        assert proc.returncode is None, "the bridge exited"
        return BridgeProcess(proc)

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_seed_examples_round_trip(app, connect, bridge):
    b = await bridge()
    agent = ext(connect())
    calls: list[asyncio.Future[pb.DialogResult]] = []
    ids = []
    for (rpc, request), expected in zip(AGENT_CALLS, SEED_REQUESTS, strict=True):
        if rpc in ("Select", "Confirm", "Input", "Editor"):
            calls.append(asyncio.ensure_future(getattr(agent, rpc)(request)))
        else:
            await getattr(agent, rpc)(request)
        line = await b.line()
        assert line["id"] and line["id"] not in ids
        ids.append(line["id"])
        assert {**line, "id": expected["id"]} == expected
        assert list(line) == list(expected)  # same field order as pi's, too

    for form, dialog_id in zip(SEED_RESPONSES, ids, strict=False):
        await b.send((form % dialog_id).encode() + b"\n")
    select, confirm, input_ = await asyncio.wait_for(asyncio.gather(*calls[:3]), 5)
    assert (select.outcome, select.value) == (pb.DIALOG_OUTCOME_ANSWERED, "Allow")
    assert (confirm.outcome, confirm.confirmed) == (pb.DIALOG_OUTCOME_ANSWERED, True)
    assert (input_.outcome, input_.HasField("value")) == (pb.DIALOG_OUTCOME_CANCELLED, False)

    # the editor is still open; its agent gives up, and the strict framing prints nothing for it
    calls[3].cancel()
    await wait_for(lambda: app.core.dialogs.count() == 0, what="the editor dialog to close")
    await agent.SetTitle(pb.SetTitleRequest(title="next"))
    assert (await b.line())["title"] == "next"
    assert await b.close_stdin() == 0


async def test_framing_cr_u2028_and_malformed_lines(app, connect, bridge):
    b = await bridge()
    agent = ext(connect())
    call = asyncio.ensure_future(agent.Input(pb.InputRequest(title="a\u2028b\u2029c")))
    line = await b.line()
    assert line["title"] == "a\u2028b\u2029c"
    assert b"\\u2028" in b.raw[-1] and "\u2028".encode() not in b.raw[-1]  # escaped on the way out

    bad_lines = [
        (b"not json\n", "not JSON"),
        (b"[1, 2]\n", "JSON object"),
        (b'{"type": "extension_ui_request", "id": "x"}\n', "extension_ui_response"),
        (b'{"type": "extension_ui_response", "value": "v"}\n', "id must be"),
        (b'{"type": "extension_ui_response", "id": "x"}\n', "needs value, confirmed or cancelled"),
        (b'{"type": "extension_ui_response", "id": "x", "confirmed": "yes"}\n', "true or false"),
        (b"\xff\xfe\n", "not UTF-8"),
    ]
    for data, message in bad_lines:
        await b.send(data)
        err = await b.line()
        assert err["type"] == "extension_ui_error" and message in err["error"], err
    await b.send(b'{"type": "extension_ui_response", "id": "nope", "cancelled": true}\n')
    err = await b.line()
    assert (err["type"], err["id"], err["code"]) == ("extension_ui_error", "nope", "NOT_FOUND")
    await b.send(b"\n\r\n")  # blank lines are skipped silently

    # CRLF, and raw U+2028/U+2029 inside the JSON string: one line, one answer
    answer = json.dumps({"type": "extension_ui_response", "id": line["id"], "value": "x\u2028y\u2029z"},
                        ensure_ascii=False).encode()
    assert "\u2028".encode() in answer
    await b.send(answer + b"\r\n")
    result = await asyncio.wait_for(call, 5)
    assert (result.outcome, result.value) == (pb.DIALOG_OUTCOME_ANSWERED, "x\u2028y\u2029z")

    # answering twice: an error line, and the bridge keeps going
    await b.send(answer + b"\n")
    err = await b.line()
    assert (err["id"], err["code"]) == (line["id"], "FAILED_PRECONDITION")
    call = asyncio.ensure_future(agent.Confirm(pb.ConfirmRequest(title="still there?")))
    dialog_id = (await b.line())["id"]
    await b.send(b'{"type":"extension_ui_response","id":"%s","confirmed":false}\n' % dialog_id.encode())
    assert (await call).outcome == pb.DIALOG_OUTCOME_ANSWERED
    assert b.proc.returncode is None
    assert await b.close_stdin() == 0


async def test_late_bridge_gets_state_and_waiting_dialogs_and_close_events(app, connect, bridge):
    agent = ext(connect())
    await agent.SetStatus(pb.SetStatusRequest(key="my-ext", text="Turn 3 running..."))
    await agent.SetStatus(pb.SetStatusRequest(key="gone", text="x"))
    await agent.SetStatus(pb.SetStatusRequest(key="gone"))
    await agent.SetWidget(pb.SetWidgetRequest(key="w", lines=["l1"]))
    waiting = asyncio.ensure_future(agent.Select(pb.SelectRequest(title="pick", options=["a", "b"],
                                                                  timeout_ms=20_000)))
    await wait_for(lambda: app.core.dialogs.count() == 1, what="the dialog to open")

    b = await bridge("default", "--close-events")
    status, widget, dialog = await b.line(), await b.line(), await b.line()
    assert {**status, "id": ""} == {"type": "extension_ui_request", "id": "", "method": "setStatus",
                                    "statusKey": "my-ext", "statusText": "Turn 3 running..."}
    assert {**widget, "id": ""} == {"type": "extension_ui_request", "id": "", "method": "setWidget",
                                    "widgetKey": "w", "widgetLines": ["l1"]}  # placement unset: omitted
    assert (dialog["method"], dialog["title"], dialog["timeout"]) == ("select", "pick", 20_000)

    # another UI answers first: the bridge is told the dialog closed
    (other,) = await open_uis(app, connect(), 1)
    for _ in range(3):
        await read(other)
    await ext(connect()).Respond(pb.RespondRequest(id=dialog["id"], value="b"))
    assert (await waiting).value == "b"
    assert await b.line() == {"type": "extension_ui_closed", "id": dialog["id"], "reason": "answered"}
    # and a timeout
    await agent.Confirm(pb.ConfirmRequest(title="quick", timeout_ms=50))
    asked = await b.line()
    assert (asked["method"], asked["timeout"]) == ("confirm", 50)
    assert await b.line() == {"type": "extension_ui_closed", "id": asked["id"], "reason": "timed_out"}
    # clearing a status: statusText absent
    await agent.SetStatus(pb.SetStatusRequest(key="my-ext"))
    cleared = await b.line()
    assert "statusText" not in cleared and cleared["statusKey"] == "my-ext"
    assert await b.close_stdin() == 0


async def test_bridge_exits_when_server_stops(app, bridge):
    b = await bridge()
    await app.aclose(grace=1.0)
    assert await asyncio.wait_for(b.proc.wait(), 10) == 1


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_split_lines_is_strict_lf_and_bounded(chunk):
    import os
    import threading

    from uibus.clients.ext_ui_stdio import TOO_LONG, split_lines

    data = ("ab\ncd\r\n" + "x" * 20 + "\nu\u2028v\u2029w\n\nok\n" + "y" * 30 + "\ntail").encode()
    read_fd, write_fd = os.pipe()
    got: list[bytes | None] = []
    reader = threading.Thread(target=split_lines, args=(read_fd, got.append, 10))
    reader.start()
    for i in range(0, len(data), chunk):
        os.write(write_fd, data[i:i + chunk])
    os.close(write_fd)
    reader.join(5)
    os.close(read_fd)
    assert got == [b"ab", b"cd\r", TOO_LONG, "u\u2028v\u2029w".encode(), b"", b"ok", TOO_LONG, b"tail", None]

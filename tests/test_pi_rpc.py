"""The real pi coding agent's RPC mode, as uibus will host it (the extension-UI seed): a contract
test of the protocol itself, against the pinned package (tests/pi/package-lock.json, installed by
`.ci/setup`), before any uibus code depends on it.

It pins what the agent backend has to bridge: framing (one JSON object per `\\n`-terminated line),
an extension command sent as a `prompt` runs with no model or credentials, every dialog and
fire-and-forget method comes out with pi's documented fields, a dialog blocks until the
`extension_ui_response` with its id, `cancelled` and the agent-side `timeout` resolve it, a value
carrying U+2028 arrives intact, and the prompt's `response` comes when the command has finished.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, require

PI = REPO / "tests" / "pi" / "node_modules" / ".bin" / "pi"
EXTENSION = REPO / "tests" / "pi" / "ui-tour.ts"

pytestmark = [pytest.mark.timeout(60), pytest.mark.node]


class Pi:
    """`pi --mode rpc` in its own process group, fed and read line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
        await self.proc.stdin.drain()

    async def next(self, timeout: float = 15) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        assert line.endswith(b"\n"), f"pi ended its output: {line!r}"
        return json.loads(line)  # type: ignore[no-any-return]


@pytest.fixture
async def pi(tmp_path: Path) -> Any:
    require("the pinned pi agent (npm ci --prefix tests/pi)", PI.exists(), "node")
    home = tmp_path / "home"
    home.mkdir()
    proc = await asyncio.create_subprocess_exec(
        str(PI), "--mode", "rpc", "--no-session", "-e", str(EXTENSION), cwd=tmp_path,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "HOME": str(home)}, start_new_session=True)
    try:
        yield Pi(proc)
    finally:
        if proc.returncode is None:  # the whole group: whatever pi started goes with it
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()


async def test_every_extension_ui_method_as_the_seed_shows(pi: Pi) -> None:
    await pi.send({"type": "prompt", "message": "/ui-tour", "id": "p1"})
    select = await pi.next()
    assert {k: v for k, v in select.items() if k != "id"} == {
        "type": "extension_ui_request", "method": "select", "title": "Allow dangerous command?",
        "options": ["Allow", "Block"], "timeout": 10000}
    await pi.send({"type": "extension_ui_response", "id": "not-" + select["id"], "value": "Block"})  # ignored
    await pi.send({"type": "extension_ui_response", "id": select["id"], "value": "Allow"})

    confirm = await pi.next()  # left unanswered: pi resolves it itself after its timeout, telling nobody
    assert (confirm["method"], confirm["title"], confirm["message"], confirm["timeout"]) == (
        "confirm", "Clear session?", "All messages will be lost.", 400)

    typed = await pi.next(timeout=5)
    assert (typed["method"], typed["title"], typed["placeholder"]) == ("input", "Enter a value", "type something...")
    assert "timeout" not in typed
    await pi.send({"type": "extension_ui_response", "id": typed["id"], "value": "a\u2028b \u2029 c"})

    editor = await pi.next()
    assert (editor["method"], editor["title"], editor["prefill"]) == ("editor", "Edit some text", "Line 1\nLine 2")
    await pi.send({"type": "extension_ui_response", "id": editor["id"], "cancelled": True})

    fired = [await pi.next() for _ in range(6)]
    assert [{k: v for k, v in f.items() if k not in ("type", "id")} for f in fired] == [
        {"method": "notify", "message": "Command blocked by user", "notifyType": "warning"},
        {"method": "setStatus", "statusKey": "my-ext", "statusText": "Turn 3 running..."},
        {"method": "setStatus", "statusKey": "my-ext"},  # statusText absent: clear
        {"method": "setWidget", "widgetKey": "my-ext", "widgetLines": ["--- My Widget ---", "Line 1"],
         "widgetPlacement": "belowEditor"},
        {"method": "setTitle", "title": "atomic - my project"},
        {"method": "set_editor_text", "text": "prefilled text for the user"},
    ]
    assert len({f["id"] for f in [select, confirm, typed, editor, *fired]}) == 10  # every request its own id

    report = await pi.next()
    assert report["method"] == "notify" and report["notifyType"] == "info"
    assert json.loads(report["message"]) == {"picked": "Allow", "confirmed": False, "typed": "a\u2028b \u2029 c",
                                             "edited": None}
    response = await pi.next()
    assert (response["type"], response["id"], response["command"], response["success"]) == (
        "response", "p1", "prompt", True)

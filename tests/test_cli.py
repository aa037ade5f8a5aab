"""The `uibus` command as a person types it, against a live server."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from tests.conftest import wait_for

UIBUS = str(Path(sys.executable).parent / "uibus")


async def run(*args: str, target: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(UIBUS, *args, "--target", target, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_subscribe_prints_json_lines_until_ctrl_c(app):
    target = f"127.0.0.1:{app.port}"
    sub = await asyncio.create_subprocess_exec(UIBUS, "subscribe", "partialMessage", "--session", "cli",
                                               "--target", target, stdout=asyncio.subprocess.PIPE)
    await wait_for(lambda: app.bus.count("partial_message", "cli") == 1, timeout=20, what="CLI subscription")
    for text in ("Hel", "Hello"):
        rc, out, err = await run("publish", "partial-message",
                                 json.dumps({"ts": 7, "type": "SAY", "say": "TEXT", "text": text, "partial": True}),
                                 "--session", "cli", target=target)
        assert rc == 0, err
        assert json.loads(out) == {"subscribers": 1}
    lines = [json.loads(await asyncio.wait_for(sub.stdout.readline(), 10)) for _ in range(2)]
    assert [line["text"] for line in lines] == ["Hel", "Hello"]
    assert lines[0]["ts"] == "7" and lines[0]["say"] == "TEXT"
    sub.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(sub.wait(), 10) == 130
    await wait_for(lambda: app.bus.count() == 0, what="subscription gone after Ctrl-C")


async def test_publish_and_call(app):
    target = f"127.0.0.1:{app.port}"
    rc, out, err = await run("publish", "theme", '{"kind":"dark"}', "--session", "c2", target=target)
    assert rc == 0, err
    rc, out, err = await run("call", "GetSessionState", "--session", "c2", target=target)
    assert rc == 0, err
    assert json.loads(out)["theme"] == '{"kind":"dark"}'
    rc, out, err = await run("call", "scrollToSettings", '{"value": "x"}', target=target)
    assert json.loads(out) == {"key": "scrollToSettings", "value": "x"}


async def test_cli_errors_are_clear(app):
    target = f"127.0.0.1:{app.port}"
    rc, _, err = await run("call", "openUrl", '{"value": "file:///etc"}', target=target)
    assert rc == 1 and "INVALID_ARGUMENT" in err and "only http and https" in err
    rc, _, err = await run("call", "noSuchRpc", target=target)
    assert rc == 2 and "no uibus method is called 'noSuchRpc'" in err
    rc, _, err = await run("publish", "button", "nope", target=target)
    assert rc == 2 and "mcp" in err
    rc, _, err = await run("call", "scrollToSettings", "{not json", target=target)
    assert rc == 2

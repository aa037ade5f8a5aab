"""The `uibus` command as a person types it, against a live server."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.conftest import wait_for

UIBUS = str(Path(sys.executable).parent / "uibus")
# Runs argv[1:] with SIGINT at its default, as a terminal's Ctrl-C finds it, even when this test runs
# under a parent that ignores SIGINT (children inherit SIG_IGN, and Python then never raises
# KeyboardInterrupt). An exec wrapper rather than preexec_fn, which is unsafe in this threaded process.
SIGINT_DEFAULT = (sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execv(sys.argv[1], sys.argv[1:])")


async def run(*args: str, target: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(UIBUS, *args, "--target", target, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_subscribe_prints_json_lines_until_ctrl_c(app):
    target = f"127.0.0.1:{app.port}"
    sub = await asyncio.create_subprocess_exec(*SIGINT_DEFAULT, UIBUS, "subscribe", "partialMessage", "--session",
                                               "cli", "--target", target, stdout=asyncio.subprocess.PIPE)
    try:
        await wait_for(lambda: app.bus.count("partial_message", "cli") == 1, timeout=20, what="CLI subscription")
        for text in ("Hel", "Hello"):
            rc, out, err = await run("publish", "partial-message",
                                     json.dumps({"ts": 7, "type": "SAY", "say": "TEXT", "text": text, "partial": True}),
                                     "--session", "cli", target=target)
            assert rc == 0, err
            assert json.loads(out) == {"subscribers": 1, "replicated": False}
        lines = [json.loads(await asyncio.wait_for(sub.stdout.readline(), 10)) for _ in range(2)]
        assert [line["text"] for line in lines] == ["Hel", "Hello"]
        assert lines[0]["ts"] == "7" and lines[0]["say"] == "TEXT"
        sub.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(sub.wait(), 10) == 130
    finally:
        if sub.returncode is None:  # a failed test leaves no subscriber behind
            sub.kill()
            await sub.wait()
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


async def test_json_output_prints_zero_values(app):
    """Zero values are printed, not dropped: `{}` would read as a missing reply."""
    target = f"127.0.0.1:{app.port}"
    rc, out, err = await run("publish", "theme", '{"kind":"dark"}', "--session", "nobody-listens", target=target)
    assert rc == 0, err
    assert json.loads(out) == {"subscribers": 0, "replicated": False}
    rc, out, err = await run("call", "uibus.v1.CodeBoltService/GetStats", "--session", "nobody-listens", target=target)
    assert rc == 0, err
    assert json.loads(out) == {"connections": "0", "pendingWaits": "0", "sessionConnections": "0",
                               "sessionPendingWaits": "0"}  # int64 is a JSON string in proto3 JSON


def test_version_names_the_installed_distribution():
    done = subprocess.run([UIBUS, "--version"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"uibus {metadata.version('uibus')}"


@pytest.mark.parametrize("argv", [
    ["serve", "--bogus"], ["publish", "--bogus"], ["publish", "theme", "x", "--bogus"], ["publish"],
    ["call", "--bogus"], ["call", "scrollToSettings", "--bogus"], ["call"], ["subscribe", "theme", "--bogus"],
    ["subscribe", "theme", "--provider", "NOPE"], ["chat", "--bogus"], ["ext-ui-stdio", "--bogus"],
], ids=" ".join)
def test_usage_errors_show_the_subcommand_usage(argv: list[str]):
    """A mistyped flag shows the usage of the subcommand typed, whose flags help, not the top-level
    usage that only lists subcommand names."""
    done = subprocess.run([UIBUS, *argv], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"usage: uibus {argv[0]} "), done.stderr
    assert f"uibus {argv[0]}: error: " in done.stderr, done.stderr
    assert "{serve," not in done.stderr, done.stderr

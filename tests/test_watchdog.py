"""The per-test timeout (tests/watchdog.py), run for real: pytest in a subprocess on generated tests
that hang, with a 2 s timeout and this suite's own conftest. Each hung test must fail on its own
within a bounded time with the stacks that show where it hangs, and the session must go on to the
next test; a test that swallows its cancel must still end the run (the last resort)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.conftest import REPO

TIMEOUT = 2  # each generated test's
# The generated tests end within the timeout, the watchdog's wait for the loop (3 s) and slack for
# a loaded machine; without the watchdog they would sleep for an hour.
BOUND = 15.0

CONFTEST = 'pytest_plugins = ["tests.conftest"]  # this suite\'s own: its loop choice and its watchdog\n'

HANGS = '''
import asyncio
import os
import threading
import time


def test_the_loop_is_the_one_asked_for():
    pass


async def idle_forever():
    await asyncio.Event().wait()  # nothing will ever set it: the loop sits idle in epoll/select


async def test_hangs_on_an_idle_loop():
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    assert loop == os.environ["EXPECT_LOOP"], loop
    await idle_forever()


async def test_blocks_its_loop_in_sync_code():
    time.sleep(3600)  # the loop cannot answer: the watchdog's signal must interrupt this


def test_hangs_in_sleep():
    time.sleep(3600)


def test_hangs_on_a_lock():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


def test_the_session_goes_on_after_them():
    pass
'''

SWALLOWS = '''
import asyncio


async def test_swallows_every_cancel():
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass
'''

FAILING = {  # the generated test that hangs -> a frame its report must show
    "test_hangs_on_an_idle_loop": 'in idle_forever\n    await asyncio.Event().wait()',
    "test_blocks_its_loop_in_sync_code": 'in test_blocks_its_loop_in_sync_code\n    time.sleep(3600)',
    "test_hangs_in_sleep": 'in test_hangs_in_sleep\n    time.sleep(3600)',
    "test_hangs_on_a_lock": 'in test_hangs_on_a_lock\n    lock.acquire()',
}


def _pytest(tmp: Path, name: str, source: str, loop: str, grace: float = 15) -> subprocess.Popen[str]:
    where = tmp / name
    where.mkdir()
    (where / "conftest.py").write_text(CONFTEST)
    (where / "test_generated.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": str(REPO), "UIBUS_TEST_LOOP": loop, "EXPECT_LOOP": loop,
           "UIBUS_WATCHDOG_GRACE": str(grace)}
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto",
         "-o", "asyncio_default_fixture_loop_scope=function", "--timeout", str(TIMEOUT), "-rA",
         f"--junitxml={where / 'report.xml'}", "test_generated.py"],
        cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _sections(out: str) -> dict[str, str]:
    """Each failed test's section of the report, by test name."""
    parts = re.split(r"^_{3,} (\S+?)(?:\[\S*\])? _{3,}$", out, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_a_hung_test_fails_with_its_stacks_and_the_session_goes_on(tmp_path: Path) -> None:
    started = time.monotonic()
    runs = {loop: _pytest(tmp_path, loop, HANGS, loop) for loop in ("uvloop", "asyncio")}
    last = _pytest(tmp_path, "swallows", SWALLOWS, "uvloop", grace=2)
    outputs = {}
    for loop, proc in [*runs.items(), ("swallows", last)]:
        try:
            outputs[loop], _ = proc.communicate(timeout=50 - (time.monotonic() - started))
        except subprocess.TimeoutExpired:
            for p in [*runs.values(), last]:
                p.kill()
            raise AssertionError(f"the {loop} run hung: the watchdog did not end it") from None
    assert time.monotonic() - started < 55

    for loop, proc in runs.items():
        out = outputs[loop]
        assert proc.returncode == 1, out[-3000:]
        report = ET.parse(tmp_path / loop / "report.xml").getroot()
        cases = {c.get("name"): c for c in report.iter("testcase")}
        assert set(cases) == {*FAILING, "test_the_loop_is_the_one_asked_for", "test_the_session_goes_on_after_them"}
        for name, case in cases.items():
            failed = case.find("failure") is not None
            assert failed == (name in FAILING), (loop, name, out[-3000:])
            assert float(case.get("time", "0")) < BOUND, (loop, name, case.get("time"))
        sections = _sections(out)
        for name, frame in FAILING.items():
            text = sections[name]
            assert f"Timeout: test_generated.py::{name} ran over its {TIMEOUT} s" in text, (loop, name, text[:2000])
            assert "+++ stacks of every thread +++" in text and "--- thread MainThread" in text
            assert frame in text, (loop, name, text)
        # on an idle loop (uvloop's too) the loop itself answers: every task's await chain, its task cancelled
        idle = sections["test_hangs_on_an_idle_loop"]
        assert f"+++ asyncio tasks of its loop ({loop}" in idle and "the watchdog cancelled its task" in idle
        assert "coro=<test_hangs_on_an_idle_loop()" in idle
        # a loop blocked in sync code cannot answer: the signal interrupts the blocking call
        assert "SIGALRM interrupted the main thread" in sections["test_blocks_its_loop_in_sync_code"]

    out = outputs["swallows"]
    assert last.returncode == 1, out[-3000:]
    assert "it did not end 2 s after the watchdog cancelled or interrupted it: exiting" in out, out[-3000:]
    assert "in test_swallows_every_cancel" in out and "--- thread MainThread" in out
    assert not (tmp_path / "swallows" / "report.xml").exists()  # the process ended at once: os._exit(1)

"""The per-test timeout: a hung test fails within its timeout with every thread's and every asyncio
task's stack in its report, and the session goes on; it never hangs CI.

pytest-timeout still reads the settings (the `timeout` ini value, `--timeout`,
`@pytest.mark.timeout(n)`, `timeout_func_only`); this plugin replaces only its timer, through the
`pytest_timeout_set_timer` / `pytest_timeout_cancel_timer` hooks. Its signal method could not be
kept: a Python signal handler runs only when the main thread gets back to the bytecode loop, and an
idle uvloop loop (sitting in epoll; libuv retries the interrupted call) never does, so a hung async
test hung the whole run.

At the timeout a watchdog thread
1. takes every thread's stack;
2. finds the test's loop and task where asyncio.Runner (pytest-asyncio's runner, asyncio.run) runs it
   on the main thread, and wakes that loop with `call_soon_threadsafe` (both asyncio's loop and uvloop
   wake for it): on the loop, it takes every task's stack (await chain included) and cancels the
   runner's task, so the test fails there with a CancelledError;
3. when no loop runs or it does not answer within ANSWER seconds (a test blocked in sync code,
   `time.sleep`, a lock), interrupts the main thread with SIGALRM, whose handler fails the test where
   it blocks (like pytest-timeout's signal method);
4. as a last resort, when the test has not ended GRACE seconds later (a cancel swallowed again and
   again, a call no signal interrupts), writes the stacks to the terminal and ends the process with
   os._exit(1), as pytest-timeout's thread method does.
Whatever the test does with the cancel or the exception, its report is a failure carrying the stacks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
import traceback
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_timeout

ANSWER = 3.0  # seconds the test's loop has to run the watchdog's callback
GRACE = float(os.environ.get("UIBUS_WATCHDOG_GRACE", "15"))  # after the cancel/signal, before os._exit
RUNNER_RUN = asyncio.Runner.run.__code__


@dataclass
class Fired:
    """What the watchdog found when it fired, for the report of the phase it fired in."""

    text: str
    reported: bool = False


FIRED = pytest.StashKey[Fired]()
TIMER = pytest.StashKey["Watchdog"]()


def thread_stacks() -> str:
    """Every thread's stack but the watchdog's own, most recent call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        out.append(f"--- thread {names.get(ident, '?')} ({ident})\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(out)


def _await_chain(task: asyncio.Task[Any]) -> list[types.FrameType]:
    """The frames of a task's coroutine and of what it awaits, down to the innermost awaited
    coroutine (Task.get_stack gives only the outermost while a task is suspended)."""
    frames: list[types.FrameType] = []
    obj: Any = task.get_coro()
    for _ in range(200):  # a chain is never this deep; bounded all the same
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)
        if frame is None:
            break
        frames.append(frame)
        obj = getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None) or getattr(obj, "ag_await", None)
    return frames


def task_stacks(loop: asyncio.AbstractEventLoop) -> str:
    """Every task of `loop`, each with the stack of its await chain (outermost call first)."""
    for _ in range(10):  # read from another thread, the task set may change under the iteration
        try:
            tasks = list(asyncio.all_tasks(loop))
            break
        except RuntimeError:
            time.sleep(0.01)
    else:
        return "(the task set kept changing)"
    out = []
    for task in tasks:
        summary = traceback.StackSummary.extract((f, f.f_lineno) for f in _await_chain(task))
        out.append(f"--- {task!r}\n{''.join(summary.format())}")
    return "\n".join(out) or "(no tasks)"


def _runner_frame() -> types.FrameType | None:
    """The innermost asyncio.Runner.run frame on the main thread: its `task` is what the loop runs
    for the test (or for one of its fixtures) and `self._loop` that loop."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        if frame.f_code is RUNNER_RUN:
            return frame
        frame = frame.f_back
    return None


def _loop_of(runner: types.FrameType) -> asyncio.AbstractEventLoop:
    return runner.f_locals["self"]._loop  # type: ignore[no-any-return]


class TimedOut(Exception):
    """Raised in the main thread by SIGALRM when a sync test (or a loop blocked in sync code) overran."""


@dataclass
class Watchdog:
    item: pytest.Item
    settings: Any  # pytest-timeout's Settings
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    old_handler: Any = None

    def start(self) -> None:
        self.old_handler = signal.signal(signal.SIGALRM, self._on_alarm)
        self.thread = threading.Thread(target=self._watch, name=f"watchdog {self.item.nodeid}", daemon=True)
        self.thread.start()

    def cancel(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join(5)
        signal.signal(signal.SIGALRM, self.old_handler if self.old_handler is not None else signal.SIG_DFL)

    def _header(self) -> str:
        return f"Timeout: {self.item.nodeid} ran over its {self.settings.timeout:g} s"

    def _on_alarm(self, signum: int, frame: types.FrameType | None) -> None:
        __tracebackhide__ = True
        if not self.done.is_set():  # the test may have ended just as the watchdog fired
            raise TimedOut(self._header())

    def _fire(self, text: str) -> None:
        self.item.stash[FIRED] = Fired(text)

    def _watch(self) -> None:
        if self.done.wait(self.settings.timeout):
            return
        if not self.settings.disable_debugger_detection and pytest_timeout.is_debugging():
            return
        threads = f"+++ stacks of every thread +++\n{thread_stacks()}"
        runner = _runner_frame()
        if runner is None or not self._cancel_on_loop(runner, threads):
            if runner is None:
                tasks = "(no asyncio loop runs on the main thread)"
            else:
                tasks = f"+++ asyncio tasks of its loop (read from outside it) +++\n{task_stacks(_loop_of(runner))}"
            self._fire(f"{self._header()}; SIGALRM interrupted the main thread.\n\n{threads}\n\n{tasks}")
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGALRM)
        if self.done.wait(GRACE):
            return
        self._last_resort()

    def _cancel_on_loop(self, runner: types.FrameType, threads: str) -> bool:
        """On the test's loop: every task's stack, then the runner's task cancelled. False when the
        loop does not run the callback within ANSWER seconds (blocked in sync code, or closed)."""
        loop, task = _loop_of(runner), runner.f_locals["task"]
        answered, late, lock = threading.Event(), threading.Event(), threading.Lock()

        def on_loop() -> None:
            with lock:
                if late.is_set():  # too late: the SIGALRM path has taken over
                    return
                tasks = f"+++ asyncio tasks of its loop ({type(loop).__module__}) +++\n{task_stacks(loop)}"
                self._fire(f"{self._header()}; the watchdog cancelled its task.\n\n{threads}\n\n{tasks}")
                task.cancel(f"{self._header()} (watchdog)")
                answered.set()

        try:
            loop.call_soon_threadsafe(on_loop)
        except RuntimeError:  # the loop closed meanwhile
            return False
        answered.wait(ANSWER)
        with lock:
            late.set()
            return answered.is_set()

    def _last_resort(self) -> None:
        """pytest-timeout's thread method: the stacks on the terminal (capture suspended), then exit."""
        config = self.item.config
        terminal = config.get_terminal_writer()
        try:
            capman = config.pluginmanager.getplugin("capturemanager")
            if capman is not None:
                capman.suspend_global_capture(self.item)
            terminal.sep("+", title=f"{self._header()}, and it did not end {GRACE:g} s after the watchdog "
                                    "cancelled or interrupted it: exiting")
            terminal.write(self.item.stash[FIRED].text if FIRED in self.item.stash else "")
            terminal.sep("+", title="stacks now")
            terminal.write(thread_stacks() + "\n")
            runner = _runner_frame()
            if runner is not None:
                terminal.write(task_stacks(_loop_of(runner)) + "\n")
        except Exception:
            traceback.print_exc()
        finally:
            terminal.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


@pytest.hookimpl
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    if settings.method == "thread" or threading.current_thread() is not threading.main_thread():
        return None  # asked for pytest-timeout's own thread method (dump and exit): its implementation
    watchdog = Watchdog(item, settings)
    item.stash[TIMER] = watchdog
    watchdog.start()
    return True


@pytest.hookimpl
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    watchdog = item.stash.get(TIMER, None)
    if watchdog is None:
        return None
    del item.stash[TIMER]
    watchdog.cancel()
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """The report of the phase the watchdog fired in is a failure with the stacks it took, however
    the test took the cancel or the exception (swallowed, turned into another error, or passed)."""
    report = yield
    fired = item.stash.get(FIRED, None)
    if fired is not None and not fired.reported:
        fired.reported = True
        report.outcome = "failed"
        original = str(report.longrepr) if report.longrepr else ""
        report.longrepr = f"{fired.text}\n\n+++ the test's own error +++\n{original}" if original else fired.text
    return report

"""Owned tasks: every background task uibus starts belongs to a `Tasks` set that its owner's
teardown joins, and every task that is stopped is stopped with `cancel_and_wait`.

Why one module: the hand-written pattern `task.cancel(); with suppress(CancelledError): await
task` swallows a cancel that was meant for the *caller* (the caller is cancelled while it waits:
the `CancelledError` it gets is its own, and suppressing it lets the caller run on as if nothing
happened; a shutdown then waits forever). `asyncio.Task.cancelling()` tells the two apart: while
the current task has a cancel request pending for itself, the error is re-raised.

A task that swallows its own cancel (a library catching `CancelledError` inside a command, as
redis-py can) would make a plain "cancel and wait" hang; `cancel_and_wait(patience=…)` cancels it
again every `patience` seconds and gives up (logged) after `attempts`, so a teardown always ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from uibus.infra import telemetry

log = logging.getLogger("uibus.infra.tasks")
T = TypeVar("T")


def caller_cancelled() -> bool:
    """True when the running task has a cancel request of its own pending (so a `CancelledError`
    seen now is the caller's and must propagate)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _outcome(task: asyncio.Future[Any]) -> BaseException | None:
    """The task's exception (retrieved, so asyncio does not log it as never retrieved); None when it
    returned or was cancelled."""
    if task.cancelled():
        return None
    return task.exception()


async def cancel_and_wait(task: asyncio.Future[Any] | None, *, patience: float | None = None,
                          attempts: int = 3, what: str = "") -> BaseException | None:
    """Cancels `task` and waits until it has ended; returns the exception it ended with, if any
    (never raises it: stopping a task is teardown, the owner decides what a failure means).

    A cancel of the *caller* while it waits propagates (the task has been cancelled by then too).
    With `patience`, a task still running after that many seconds is cancelled again, up to
    `attempts` times, then left behind with an error logged: a teardown must end.
    """
    if task is None:
        return None
    if task.done():
        return _outcome(task)
    for attempt in range(attempts if patience is not None else 1):
        task.cancel()
        # asyncio.wait never raises the task's outcome, and raises CancelledError only when the
        # caller itself is cancelled, which is exactly the cancel that must propagate.
        done, _ = await asyncio.wait((task,), timeout=patience)
        if done:
            return _outcome(task)
        log.warning("a task did not stop when cancelled; cancelling it again",
                    extra={"fields": {"task": what or task_name(task), "attempt": attempt + 1}})
    log.error("a task never stopped; left behind", extra={"fields": {"task": what or task_name(task)}})
    return None


def task_name(task: asyncio.Future[Any]) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else repr(task)


class Tasks:
    """A set of tasks one owner started and its teardown joins (`aclose`).

    A task leaves the set when it ends; an exception it ends with is logged once (nobody awaits a
    background task, so it would otherwise vanish) unless `quiet`. After `aclose` begins, `spawn`
    refuses: nothing may start behind a teardown's back.
    """

    def __init__(self, owner: str, *, quiet: bool = False) -> None:
        self.owner = owner
        self._quiet = quiet
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self.owner}: closed, no new tasks")
        # Tracing on: an owned task outlives the call that started it, so it starts in no trace (it
        # may adopt one: uibus.infra.telemetry.adopted), else all it does would join that call's trace.
        task = asyncio.get_running_loop().create_task(coro, name=name or f"{self.owner}", context=None if
                                                      telemetry.tracer is None else telemetry.untraced())
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        exc = _outcome(task)
        if exc is not None and not self._quiet:
            log.error("a background task failed", exc_info=exc,
                      extra={"fields": {"owner": self.owner, "task": task.get_name()}})

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    def __bool__(self) -> bool:
        return bool(self._tasks)

    @property
    def closed(self) -> bool:
        return self._closed

    async def join(self) -> None:
        """Waits for the running tasks to end by themselves (a cancel of the caller propagates)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    async def aclose(self, *, grace: float = 0.0, patience: float | None = 5.0) -> None:
        """Refuses new tasks, lets the running ones finish for up to `grace` seconds (work that is
        worth finishing: a store write, a closing generator), then cancels the rest and waits for
        all of them to end."""
        self._closed = True
        if grace > 0 and self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace)
        await cancel_all(list(self._tasks), patience=patience, what=self.owner)

    async def __aenter__(self) -> Tasks:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def cancel_all(tasks: Iterable[asyncio.Future[Any]], *, patience: float | None = None,
                     what: str = "") -> None:
    """`cancel_and_wait` for several tasks at once: all are cancelled before any is waited for."""
    pending = [t for t in tasks if t is not None and not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*(cancel_and_wait(t, patience=patience, what=what) for t in pending))

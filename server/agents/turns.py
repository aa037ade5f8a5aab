"""The session part every stdio agent protocol shares: one `StdioSession` per agent process, and
everything around a protocol's messages that is not the protocol.

* `Requests`: our requests in flight to the agent, uibus.infra.jsonrpc's one map of request id -> future
  (as the MCP SDK's `BaseSession` keeps): a reply settles its future, the process's end fails every one.
* `asks`: what the agent asks of the user while it works (pi's extension-UI dialogs, ACP's
  permission requests): uibus.infra.peer's `Incoming`, the one map of the peer's requests, one owned
  task each by the agent's request id (for a JSON-RPC agent, its `Peer`'s own): a repeated id while
  the first is open is the same dialog; a cancelled turn or the process's end cancels them all
  (each answers the agent `cancelled` while it still runs); closing the session joins them.
* The turn loop (`StdioSession.stream`): one turn at a time (the engine's `AgentSessions` sees to
  that), a queue of the agent's events for it, one deadline timer per turn (`turn_timeout_seconds`;
  one timer rather than a timeout per line: bench/README.md measured a few percent of a piece for
  the latter), the process's end as the turn's error at once, and — when a turn is cancelled or
  fails in the middle — the protocol's cancel, after which the next turn waits (bounded by
  `stop_timeout_seconds`, then the process is killed) for the cancelled run to end: a new prompt
  must never land in an agent still busy with the last one.

A protocol is one module (uibus.agents.rpc, uibus.agents.acp) and one line in
uibus.agents.config's BACKENDS: a `StdioBackend` whose `session` builds its `StdioSession` subclass
(or uibus.agents.jsonrpc's `JsonRpcSession`), which writes only the protocol's mapping: `on_message`
(one JSON object from the agent; `on_request`/`on_notification` on JSON-RPC), `handshake`,
`run_turn` (send the prompt, turn events into pieces) and `cancel_run`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from contextlib import AsyncExitStack, aclosing
from typing import Any

from opentelemetry.context import Context

from uibus.agents import AgentError, AgentSession, Piece, SessionUi, Turn
from uibus.agents.stdio import AgentProcess, StdioBackend, text
from uibus.infra.jsonrpc import Pending
from uibus.infra.peer import Incoming
from uibus.infra.tasks import Tasks
from uibus.infra.telemetry import adopted
from uibus.infra.telemetry.spans import tool_spans

log = logging.getLogger("uibus.agents.stdio")

Event = dict[str, Any]
_TIMED_OUT: Event = {"uibus": "the turn timed out"}  # the deadline's marker in a turn's queue (by identity)


class Requests(Pending):
    """Our requests in flight to one agent, by id: the one in-flight map of uibus.infra.jsonrpc (bounded),
    whose failures here are the turn's AgentError (a JSON-RPC agent's and pi's RPC alike): a JSON-RPC
    error answer says "message (JSON-RPC code)", which a turn shows as its error."""

    def __init__(self) -> None:
        super().__init__(gone=AgentError,
                         failed=lambda e: AgentError(f"{text(e.message) or 'error'} (JSON-RPC {e.code})"))


class TurnRun:
    """One turn as its protocol sees it: the agent's events in order, and whether the agent ended it."""

    def __init__(self, session: StdioSession, queue: asyncio.Queue[Event | None]) -> None:
        self._session = session
        self._queue = queue
        self.ended = False  # the agent ended the turn itself: there is nothing to cancel

    def put(self, item: Event) -> None:
        """Adds an item (an event, or a marker of the protocol's own) behind those already queued."""
        self._queue.put_nowait(item)

    def lost(self) -> None:
        """The process is gone: the turn ends at its next wait."""
        self._queue.put_nowait(None)

    async def next(self) -> Event:
        """The agent's next event; AgentError when the process went or the turn's deadline passed."""
        item = await self._queue.get()
        if item is None:
            raise AgentError(f"{self._session.process.gone} during the turn")
        if item is _TIMED_OUT:
            raise AgentError(f"the turn did not end within {self._session.options.turn_timeout:g} s "
                             "(option turn_timeout_seconds)")
        return item


class StdioSession(AgentSession):
    """An agent session whose agent is one `AgentProcess`; a protocol module adds its messages
    (see the module docstring for what it implements)."""

    logger = log
    run_noun = "run"  # what a cancelled turn leaves running, as the next turn's error names it
    handshake_says = "answer"  # the start's timeout error: "the agent did not {handshake_says} within …"
    agent_kind = "an agent"  # … "is command {agent_kind}?"

    def __init__(self, backend: StdioBackend, ui: SessionUi) -> None:
        self.backend = backend
        self.options = backend.options
        self.ui = ui
        self.idle_seconds = backend.options.idle_seconds
        self.process = AgentProcess(backend, ui, self.on_message, self._lost, self.logger)
        self.log = self.process.log
        self.requests = Requests()
        self.tasks = Tasks(f"agent {backend.spec.name} session")
        self.asks = Incoming(f"agent {backend.spec.name} requests")
        self.asks.wrap = self._traced
        self.trace: Context | None = None  # with tracing on: the context of the turn running now
        # The agent's run the next turn must wait for (a cancelled turn's, or one the agent started).
        self.run: asyncio.Future[Any] | None = None
        self._turn: TurnRun | None = None
        self._closed = False
        # Undone in reverse by aclose: the process (entered by start) first, then the session's
        # tasks, then the backend's count.
        self._owned = AsyncExitStack()
        self._owned.callback(backend.released)
        self._owned.push_async_callback(self.tasks.aclose)
        self._owned.push_async_callback(self.asks.aclose)

    def _traced(self, coro: Coroutine[Any, Any, Any]) -> Coroutine[Any, Any, Any]:
        """An agent's request is part of the turn that caused it (with tracing on)."""
        return adopted(self.trace, coro) if self.trace is not None else coro

    @property
    def alive(self) -> bool:
        return self.process.alive

    @property
    def running(self) -> bool:
        return self.run is not None and not self.run.done()

    # ---- what a protocol implements ----

    @abc.abstractmethod
    def on_message(self, message: Event) -> None:
        """One JSON object from the agent (called in the order they came)."""

    @abc.abstractmethod
    async def handshake(self) -> None:
        """Whatever makes the agent ready once its process runs (bounded by start_timeout_seconds)."""

    @abc.abstractmethod
    def run_turn(self, turn: Turn, run: TurnRun) -> AsyncIterator[Piece]:
        """Sends the prompt and yields the turn's pieces from `run.next()`'s events; sets
        `run.ended` once the agent ended the turn itself."""

    @abc.abstractmethod
    def cancel_run(self) -> None:
        """Sends the protocol's cancel of a turn that did not end, and sets `self.run` to what the
        next turn must wait for. Called only while the process is alive."""

    # ---- the process ----

    def deliver(self, event: Event) -> None:
        """Hands one of the agent's events to the turn running now (none running: dropped)."""
        if self._turn is not None:
            self._turn.put(event)

    def run_started(self) -> None:
        """The agent began a run: until `run_ended`, the next turn waits for it."""
        if self.run is None or self.run.done():
            self.run = asyncio.get_running_loop().create_future()

    def run_ended(self) -> None:
        if self.run is not None and not self.run.done():
            self.run.set_result(None)

    def _lost(self, why: str) -> None:
        self.requests.fail_all(why)
        if self._turn is not None:
            self._turn.lost()
        self.run_ended()
        self.asks.cancel_all()  # closes each dialog for every UI

    async def start(self) -> None:
        await self._owned.enter_async_context(self.process)
        try:
            # asyncio.timeout rather than wait_for throughout: wait_for, on 3.11, can swallow a
            # cancel that arrives as the awaited thing completes, and a cancelled turn must end.
            async with asyncio.timeout(self.options.start_timeout):
                await self.handshake()
        except TimeoutError:
            raise AgentError(f"the agent did not {self.handshake_says} within {self.options.start_timeout:g} s "
                             f"(option start_timeout_seconds); is command {self.agent_kind}?") from None

    async def aclose(self) -> None:
        """Waits (bounded by stop_timeout_seconds) for a cancelled run to end — at shutdown the
        drain cancels the turns still running after the grace period, and the agent should record
        the cut-off turn before its process is stopped — then stops the process, then the
        session's tasks; counted out of the backend exactly once."""
        if self._closed:
            return
        self._closed = True
        try:  # a turn cut off by shutdown: its cancel was sent; the agent saves its state before it stops
            run = self.run
            if run is not None and not run.done() and self.alive:
                await asyncio.wait((run,), timeout=self.options.stop_timeout)
        except asyncio.CancelledError:
            self.process.kill()  # a cancelled close stops at once, its whole group
            raise
        finally:
            await self._owned.aclose()

    # ---- a turn ----

    async def _after_cancelled_run(self) -> None:
        run = self.run
        if run is None or run.done():
            return
        done, _ = await asyncio.wait((run,), timeout=self.options.stop_timeout)  # never raises run's error
        if not done:
            why = (f"the agent did not end its cancelled {self.run_noun} within {self.options.stop_timeout:g} s "
                   "(option stop_timeout_seconds); it was stopped, the next turn starts a new one")
            self.process.stop(why)  # not alive from now on: the next turn must not wait for its exit
            raise AgentError(why)

    async def prepare(self, turn: Turn) -> None:
        """What a protocol must ask the agent before the turn's events are taken (nothing by
        default): events that come meanwhile belong to no turn."""

    async def stream(self, turn: Turn) -> AsyncIterator[Piece]:
        await self._after_cancelled_run()
        if not self.alive:
            raise AgentError(self.process.gone or "the agent process is not running")
        await self.prepare(turn)
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        run = self._turn = TurnRun(self, queue)
        timer = asyncio.get_running_loop().call_later(self.options.turn_timeout, queue.put_nowait, _TIMED_OUT)
        tools = tool_spans()  # None unless this turn is traced
        if tools is not None:
            self.trace = tools.parent
        try:
            async with aclosing(self.run_turn(turn, run)) as pieces:
                async for piece in pieces:
                    if tools is not None:
                        tools.piece(piece)
                    yield piece
        finally:
            timer.cancel()
            if tools is not None:
                tools.close()
                self.trace = None
            self._turn = None
            if not run.ended:  # cancelled or failed in the middle: the protocol's cancel
                self.asks.cancel_all()
                if self.alive:
                    self.cancel_run()

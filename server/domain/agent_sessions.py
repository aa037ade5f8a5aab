"""Agents that live across turns: one `AgentSession` per (uibus session, agent), owned here.

The chat engine asks `AgentSessions.use` for the agent of a turn. The first turn of a (session,
agent) opens it (`SessionBackend.open_session` then `start`), later turns reuse it, one at a time: a
second turn waits for the first rather than being slipped into the agent's run (pi's `followUp`),
because one agent run can only be streamed to one caller — a follow-up's events would arrive on the
first caller's stream and its own stream would see nothing it could tell apart. Waiting keeps every
call's stream its own and the agent's conversation in the order the turns came.

An agent session is closed, exactly once and with errors collected, when

* it was idle (no turn running or waiting) for its `idle_seconds`,
* its uibus session was evicted (retention, `max-sessions`; on any replica): each live agent keeps a
  marker key in the session store, and a session whose marker is gone was deleted,
* the server shuts down (`aclose`: every one of them, concurrently; a cancel of the shutdown
  itself cuts each close short — each still kills its process group — and propagates, as a plain
  CancelledError, once all of them are closed; failures are collected),
* it died (`alive` false): the next turn opens a new one.

A caller that named no session (`keep=False`) gets an agent of its own for the turn, closed with it:
a fresh conversation, as the engine gives stateless agents.

The `SessionUi` handed to each agent session is uibus.domain.session_bound.SessionBound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from uibus.agents import AgentError, AgentSession, SessionBackend
from uibus.agents.workspaces import GitError, Workspaces
from uibus.domain.agent_handles import Handles
from uibus.domain.agent_room import Room
from uibus.domain.changes import Changes
from uibus.domain.dialogs import Dialogs
from uibus.domain.feed import UiFeed
from uibus.domain.session_bound import SessionBound
from uibus.infra.auth import OPERATOR, Tokens
from uibus.infra.errors import Cancelled, Unavailable
from uibus.infra.quotas import Quotas
from uibus.infra.sharing import LocalSharing, Sharing
from uibus.infra.store import Store
from uibus.infra.tasks import Tasks
from uibus.pb.cline import ui_pb2

log = logging.getLogger("uibus.agents")

MARKER = "agent/live/"  # + agent name: the store key a live agent session keeps in its uibus session
SWEEP_S = 5.0  # how often idle and evicted agent sessions are looked for (at most; idle/2 when shorter)


@dataclass
class _Live:
    """One open agent session and its turn bookkeeping."""

    agent: AgentSession
    tenant: str = OPERATOR  # whose it is (uibus.infra.auth.Tokens.tenant): its quota agent_processes
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one turn at a time
    users: int = 0  # turns running or waiting
    idle_since: float = field(default_factory=time.monotonic)
    task: asyncio.Task[object] | None = None  # the task running its turn now (StopTurn cancels it)
    stopping: asyncio.Task[object] | None = None  # the turn task a StopTurn cancelled
    cut: asyncio.Task[object] | None = None  # the turn task shutdown cut off after the grace


def cut_by_shutdown(agent: str) -> str:
    """The message of a turn cut off because this uibus stopped (its caller's status, an ERROR at its webviews)."""
    return (f"the turn of {agent} was interrupted: the uibus server hosting it is shutting down; the "
            "conversation is kept, send the turn again")


class AgentSessions:
    """Every live agent session of this process, by (uibus session, agent name)."""

    def __init__(self, dialogs: Dialogs, feed: UiFeed, store: Store, sharing: Sharing | None = None, *,
                 changes: Changes | None = None, workspaces: Workspaces | None = None, tokens: Tokens | None = None,
                 quotas: Quotas | None = None, mcp_url: Callable[[], str] = str, sweep_s: float = SWEEP_S) -> None:
        """`sharing` hears when an agent's state may have changed (a turn, a steering call, it closed:
        other processes list it; none: alone); `changes` is poked when a turn starts or ends (watches
        re-list at once); `workspaces`: where agents with option `workspace = "worktree"` get theirs;
        `tokens`: agents' /mcp tokens are minted there, tenants named by it; `quotas`: each tenant's
        share of processes; `mcp_url()`: uibus's own MCP endpoint once the HTTP port listens ("": none)."""
        self.dialogs = dialogs
        self.feed = feed
        self.store = store
        self.handles = Handles(store, feed, dialogs)
        self.sweep_s = sweep_s
        self._live: dict[tuple[str, str], _Live] = {}
        self._opening: dict[tuple[str, str], asyncio.Lock] = {}
        self._one_shot = 0  # agent sessions of callers that named no session, open now
        self._stopping = 0  # agent sessions being closed now (their processes still stopping)
        self._sweeper = Tasks("agent sessions sweep")
        self._closing = False
        self.closed_idle = self.closed_evicted = self.closed_dead = 0
        self.changes = changes or Changes()
        self.sharing: Sharing = sharing if sharing is not None else LocalSharing()
        self.mcp_url, self.tokens, self.quotas = mcp_url, tokens, quotas
        # who gives way when a turn needs a process (max_processes, each tenant's share)
        self.room = Room(lambda: self._live, self._open, self._close, tokens, quotas)
        self._bound: dict[AgentSession, SessionBound] = {}  # each open agent session's SessionUi
        self.workspaces = workspaces

    @property
    def closed_reclaimed(self) -> int:
        """Idle agent sessions closed to make room for a turn (a /metrics counter)."""
        return self.room.reclaimed

    def count(self) -> int:
        """Agent sessions open or closing now (each may hold a process)."""
        return len(self._live) + self._one_shot + self._stopping

    # ---- lifecycle ----

    async def __aenter__(self) -> AgentSessions:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes every agent session, concurrently (each may wait for its process to stop).

        Never raises a group holding a cancel: a cancel of the caller cancels the closes (each
        still kills its process group) and is re-raised, plain, once every one has ended (their
        failures logged); otherwise failures are raised, one alone, several as an ExceptionGroup."""
        self._closing = True
        cancelled = False
        try:
            await self._sweeper.aclose()
        except asyncio.CancelledError:
            cancelled = True
        live, self._live = list(self._live.items()), {}
        closing = Tasks("closing agent sessions", quiet=True)
        tasks = [closing.spawn(self._close(key, entry.agent, "shutdown"), name="close agent session")
                 for key, entry in live]
        if tasks:
            if cancelled:
                await self._cut_short(closing)
            else:
                try:
                    await asyncio.wait(tasks)
                except asyncio.CancelledError:
                    cancelled = True
                    await self._cut_short(closing)
        errors = [e for e in (t.exception() for t in tasks if t.done() and not t.cancelled())
                  if isinstance(e, Exception)]
        if cancelled:
            for error in errors:  # the cancel goes first: these are not raised, so they are logged
                log.error("closing an agent session failed",
                          extra={"fields": {"error": f"{type(error).__name__}: {error}"}})
            raise asyncio.CancelledError
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup("closing agent sessions", errors)

    @staticmethod
    async def _cut_short(closing: Tasks) -> None:
        """Cancels the closes still running and waits for them (each kills its process at once);
        a further cancel of the caller is the one already being propagated."""
        with contextlib.suppress(asyncio.CancelledError):
            await closing.aclose(patience=5.0)

    async def _close(self, key: tuple[str, str], agent: AgentSession, why: str, *, marker: bool = True) -> None:
        """`marker=False` leaves the session's live-agent marker: it is another replica's now."""
        self._stopping += 1
        try:
            await agent.aclose()
        finally:
            self._stopping -= 1
            self._release(agent)
            log.info("agent session closed", extra={"fields": {"session": key[0], "agent": key[1], "why": why}})
            with contextlib.suppress(Exception):  # the store may be down or closing: the sweep redoes it
                if marker:
                    await self.store.put(key[0], MARKER + key[1], None)
            if marker and key not in self._live:  # not another replica's now, nor replaced here
                self.sharing.agent_changed(*key)

    def _ensure_sweeper(self, idle_seconds: float) -> None:
        self.sweep_s = min(self.sweep_s, max(0.05, idle_seconds / 2))
        if not self._sweeper and not self._closing and not self._sweeper.closed:
            self._sweeper.spawn(self._sweep_forever(), name="agent sessions")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            try:
                await self.sweep()
            except Exception as exc:  # a store outage: the next sweep tries again
                log.warning("agent session sweep failed", extra={"fields": {"error": str(exc)}})

    async def sweep(self) -> None:
        """Closes the agent sessions idle too long, dead, or whose uibus session was evicted."""
        now = time.monotonic()
        for key, entry in list(self._live.items()):
            if entry.users:
                continue
            why = ""
            if not entry.agent.alive:
                why = "its agent exited"
            elif now - entry.idle_since >= entry.agent.idle_seconds:
                why = f"idle for {entry.agent.idle_seconds:g} s"
            elif await self.store.get(key[0], MARKER + key[1]) is None:
                why = "its session was evicted"
            if why and self._live.get(key) is entry and not entry.users:
                del self._live[key]
                if why.startswith("idle"):
                    self.closed_idle += 1
                elif why.startswith("its session"):
                    self.closed_evicted += 1
                else:
                    self.closed_dead += 1
                try:
                    await self._close(key, entry.agent, why)
                except Exception as exc:
                    log.warning("closing an agent session failed", extra={"fields": {
                        "session": key[0], "agent": key[1], "error": str(exc)}})

    def is_live(self, session: str, name: str) -> bool:
        """Whether an agent session of (`session`, `name`) is open here (uibus.replicas.ownership)."""
        return (session, name) in self._live or (session, name) in self._opening

    async def drop(self, session: str, name: str, why: str) -> None:
        """Closes the agent session of (`session`, `name`) now, if open here: its owner lost the
        right to host it (uibus.replicas.ownership fences it); its turns were cut first."""
        entry = self._live.pop((session, name), None)
        if entry is not None:
            await self._close((session, name), entry.agent, why, marker=False)

    async def close_agent(self, session: str, name: str, why: str) -> bool:
        """Closes the agent session of (`session`, `name`) if open here and idle (its workspace is
        being removed: cline.WorktreeService); False when none was open."""
        entry = self._live.pop((session, name), None)
        if entry is not None:
            await self._close((session, name), entry.agent, why)
        return entry is not None
    # ---- what the sessions API reads and steers (uibus.domain.sessions) ----

    def live_agents(self, session: str) -> list[tuple[str, AgentSession, bool]]:
        """(agent name, its live agent session, whether it runs a turn now) for `session`."""
        return [(key[1], entry.agent, entry.task is not None)
                for key, entry in list(self._live.items()) if key[0] == session]

    def live_agent(self, session: str, name: str) -> AgentSession | None:
        entry = self._live.get((session, name))
        return entry.agent if entry is not None else None

    def running(self, session: str, name: str) -> bool:
        entry = self._live.get((session, name))
        return entry is not None and entry.task is not None

    def stop(self, session: str, name: str) -> bool:
        """Cancels the turn `name` runs in `session` now, whoever started it: the agent's own cancel
        runs (pi `abort`, ACP `session/cancel`) and its caller gets CANCELLED. False: none runs."""
        entry = self._live.get((session, name))
        task = entry.task if entry is not None else None
        if entry is None or task is None or task.done():
            return False
        if entry.stopping is not task:
            entry.stopping = task
            task.cancel("stopped from a UI of the session")
        return True

    def cut_turns(self) -> int:
        """Shutdown, after the grace: cancels every turn still running here, each caller getting
        UNAVAILABLE (the conversation is kept, send the turn again) and each session's webviews an
        ERROR saying so, rather than the transport's bare cancel. Returns how many were cut."""
        n = 0
        for entry in list(self._live.values()):
            task = entry.task
            if task is not None and not task.done() and entry.cut is not task and entry.stopping is not task:
                entry.cut = task
                task.cancel("the server is shutting down")
                n += 1
        return n

    async def close_session(self, session: str) -> int:
        """Closes every live agent of `session` (it is being deleted), running turns cancelled
        first; returns how many were closed."""
        keys = [key for key in self._live if key[0] == session]
        for key in keys:
            self.stop(*key)
        closed = 0
        for key in keys:
            entry = self._live.pop(key, None)
            if entry is None:
                continue
            closed += 1
            try:
                await self._close(key, entry.agent, "its session was deleted")
            except Exception as exc:
                log.warning("closing an agent session failed", extra={"fields": {
                    "session": key[0], "agent": key[1], "error": str(exc)}})
        return closed

    # ---- turns ----

    def _release(self, agent: AgentSession) -> None:
        bound = self._bound.pop(agent, None)
        if bound is not None:
            bound.release()

    async def _workspace(self, session: str, backend: SessionBackend, owner: str = "") -> str:
        """The directory the agent of (`session`, this backend) works in, made at its first turn and
        reopened after (uibus.agents.workspaces); "" for the configured cwd. `owner`: whose
        workspace it is when not the session's own (a one-shot agent's throwaway one)."""
        repo = backend.workspace_repo
        if repo is None or self.workspaces is None:
            return ""
        try:
            made = await self.workspaces.open(owner or session, backend.spec.name, repo)
        except (GitError, OSError) as exc:
            raise AgentError(f"cannot make the workspace of agent {backend.spec.name!r} (option workspace = "
                             f"\"worktree\", a git worktree of {repo}): {exc}") from exc
        return made.cwd_for(repo)

    async def _open(self, session: str, backend: SessionBackend, *, keep: bool = True,
                    owner: str = "") -> AgentSession:
        name = backend.spec.name
        workspace = await self._workspace(session, backend, owner)
        ui = SessionBound(session, self.dialogs, self.feed, self, agent=name, workspace=workspace)
        if keep:  # a conversation that outlives its process: the handle of the last one, if any
            ui = SessionBound(session, self.dialogs, self.feed, self, agent=name, handles=self.handles,
                              handle=await self.handles.read(session, name), workspace=workspace)
        agent = backend.open_session(ui)
        self._bound[agent] = ui
        try:
            await agent.start()
        except BaseException:
            try:
                await agent.aclose()
            finally:
                self._release(agent)
            raise
        return agent

    @asynccontextmanager
    async def use(self, session: str, name: str, backend: SessionBackend, *,
                  keep: bool = True) -> AsyncIterator[AgentSession]:
        """The agent session for one turn of `name` in `session`, held for the turn. Raises
        AgentError when the agent cannot start (the turn's answer) and the backend's
        ResourceExhausted when it may not (the call's status)."""
        if self._closing:
            raise AgentError("the server is shutting down")
        if not keep:
            self._one_shot += 1
            # a one-shot agent's workspace is its own and goes with it (a branch with commits is kept)
            owner = f"{session}~one-shot-{uuid.uuid4().hex[:12]}" if backend.workspace_repo is not None else ""
            try:
                agent = await self._open(session, backend, keep=False, owner=owner)
                try:
                    yield agent
                finally:
                    try:
                        await agent.aclose()
                    finally:
                        self._release(agent)
            finally:
                self._one_shot -= 1
                if owner and self.workspaces is not None:
                    await self.workspaces.remove_session(owner)
            return
        key = (session, name)
        entry = self._live.get(key)
        if entry is None:
            opening = self._opening.setdefault(key, asyncio.Lock())
            try:
                async with opening:  # two first turns at once start one agent
                    entry = self._live.get(key)
                    if entry is None:
                        async with self.room.within_share(session, name) as tenant:  # the tenant's share first
                            agent = await self.room.open(session, backend)
                            try:  # the marker first: a sweep must never find a live agent without one
                                await self.store.put(session, MARKER + name, {"since": int(time.time() * 1000)})
                            except BaseException:
                                try:
                                    await agent.aclose()
                                finally:
                                    self._release(agent)
                                raise
                            entry = self._live[key] = _Live(agent, tenant)
                        self._ensure_sweeper(agent.idle_seconds)
            finally:
                if not opening.locked():
                    self._opening.pop(key, None)
        entry.users += 1
        try:
            async with entry.lock:
                if not entry.agent.alive:  # it died after the last turn: this turn gets a new one
                    old = entry.agent
                    self.closed_dead += 1
                    await self._close(key, old, "its agent exited")
                    await self.store.put(session, MARKER + name, {"since": int(time.time() * 1000)})
                    entry.agent = await self.room.open(session, backend)
                task = asyncio.current_task()
                entry.task = task
                self.changes.poke()
                self.sharing.agent_changed(session, name)
                try:
                    yield entry.agent
                finally:
                    entry.task = None
                    self.changes.poke()
                    self.sharing.agent_changed(session, name)
                    stopped = entry.stopping is task
                    if stopped:
                        entry.stopping = None
                    # Stopped from another UI (StopTurn) and not also cancelled by its own caller: the
                    # caller hears CANCELLED with a reason (a gRPC handler that just ends cancelled
                    # sends no status at all). Raised here, in the turn's exit, it replaces the cancel
                    # however the engine leaves the turn (its exit stack closes this without the error).
                    if stopped and task is not None and task.cancelling() == 1:
                        task.uncancel()
                        raise Cancelled(f"the turn of {name} in session {session!r} was stopped from a UI of "
                                        "the session")
                    cut = entry.cut is task
                    if cut:
                        entry.cut = None
                    if cut and task is not None and task.cancelling() == 1:  # shutdown's cut (cut_turns)
                        task.uncancel()
                        message = cut_by_shutdown(name)
                        self.feed.say(session, message, ui_pb2.ERROR)
                        raise Unavailable(message)
        finally:
            entry.users -= 1
            entry.idle_since = time.monotonic()

"""Who runs the live agent of a (session, agent): one owner across every replica and worker.

A hosted agent (a SessionBackend: pi, ACP agents) is a process holding a conversation; two of them
for one (session, agent) would be two conversations, each forgetting the other's turns. So the
right to host one is a lease in the shared store (Store.take_lease) with a fencing token, and the
replica holding it is the owner: its turns run here, everyone else's are carried to it
(uibus.replicas.turn_forwarding).

* The lease is taken at a turn's start when it is free or expired (a takeover: counted), renewed
  every `lease_s / 4` while this replica holds it, and given up when its agent session closed
  (idle, evicted, dead, shutdown) with no turn running: the next turn anywhere takes it at once.
* Fencing: a renewal the store refuses (another replica took the lease: our token is old) or no
  successful renewal for longer than `lease_s` by this process's monotonic clock (the store link is
  cut: the lease may have expired and been taken elsewhere) ends ownership here at once: the turns
  running on it are cut with UNAVAILABLE and the agent session is closed, so there are never two
  writers to one conversation. The renewal itself is checked against the token on the server.
* Turns running here are tracked per lease, so a fence can cut them: their task is cancelled and,
  at the `running` boundary, that cancel (ours, not the caller's) becomes the UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

from uibus.infra.errors import Unavailable
from uibus.infra.store import Store
from uibus.infra.tasks import Tasks

log = logging.getLogger("uibus.agents")

LEASE_S = 10.0  # default: a lease expires this long after its owner stopped renewing it


class Interrupted(Unavailable):
    """A hosted agent's turn cut off by the loss of its host (the owner died, or lost its lease)."""


class Fenced(Interrupted):
    """This replica lost the lease of the agent while a turn ran on it: the turn is cut."""


def interrupted(agent: str) -> str:
    """The message of a turn cut off by the loss of its host (here or at the owner)."""
    return (f"the turn was interrupted: the uibus replica hosting agent {agent!r} for this session stopped or "
            "lost its ownership; the conversation is kept, send the turn again")


@dataclass(eq=False)
class _Held:
    """One lease held here."""

    token: int
    renewed_at: float  # monotonic time the last successful take/renew was *sent*
    turns: set[asyncio.Task[object]] = field(default_factory=set)  # local turns running on it
    cut: set[asyncio.Task[object]] = field(default_factory=set)  # those a fence cancelled
    idle_since: float = field(default_factory=time.monotonic)


class HostedAgents(Protocol):
    """The agent sessions open here, as ownership sees them (uibus.domain.agent_sessions)."""

    def is_live(self, session: str, name: str) -> bool:
        """Whether an agent session of (`session`, `name`) is open here."""
        ...

    async def drop(self, session: str, name: str, why: str) -> None:
        """Closes the agent session of (`session`, `name`): this replica lost the right to host it."""
        ...


class Ownership:
    """The leases this replica holds, their renewal, fencing and release."""

    def __init__(self, store: Store, sessions: HostedAgents, owner_id: str, *, lease_s: float = LEASE_S,
                 on_session: Callable[[str, bool], None] = lambda session, holding: None) -> None:
        """`on_session(session, holding)`: told (session, True) when the first lease of a session is
        held here, (session, False) after the last one went: the forwarding listens to a session's
        forwarded turns exactly then."""
        self.store = store
        self.sessions = sessions
        self.owner_id = owner_id
        self.lease_s = lease_s
        self.held: dict[tuple[str, str], _Held] = {}
        self._tasks = Tasks("agent ownership")
        self._renewer: asyncio.Task[None] | None = None
        self._closing = False
        self.on_session = on_session
        self.taken_over = 0  # leases taken from an owner whose lease had expired
        self.fenced = 0  # leases lost while held (refused renewal, or none for longer than the lease)
        self.released = 0

    # ---- claiming ----

    async def claim(self, session: str, agent: str) -> str:
        """The owner of (`session`, `agent`) now: this replica's id when it holds the lease (taken
        now if free or expired), else the live owner's."""
        key = (session, agent)
        held = self.held.get(key)
        started = time.monotonic()
        if held is not None:
            if started - held.renewed_at <= self.lease_s:
                return self.owner_id
            self.fence(key, f"its lease was not renewed for over {self.lease_s:g} s")
        if self._closing:
            raise Unavailable("the server is shutting down")
        lease = await self.store.take_lease(session, agent, self.owner_id, self.lease_s)
        if lease.owner != self.owner_id:
            return lease.owner
        held = self.held.get(key)
        if held is not None and held.token == lease.token:  # a concurrent claim took it first
            held.renewed_at = max(held.renewed_at, started)
            return self.owner_id
        if held is not None:  # held under an older token: that one is lost
            self.fence(key, "its lease changed hands")
        if lease.taken_from:
            self.taken_over += 1
            log.info("agent lease taken over", extra={"fields": {
                "session": session, "agent": agent, "from": lease.taken_from, "token": lease.token}})
        first = not any(k[0] == session for k in self.held)
        self.held[key] = _Held(lease.token, started)
        if first:
            self.on_session(session, True)
        if (self._renewer is None or self._renewer.done()) and not self._tasks.closed:
            self._renewer = self._tasks.spawn(self._renew_forever(), name="agent lease renewal")
        return self.owner_id

    def holds(self, session: str, agent: str) -> bool:
        """Whether this replica holds the lease now (and has renewed it within the lease)."""
        held = self.held.get((session, agent))
        return held is not None and time.monotonic() - held.renewed_at <= self.lease_s

    @asynccontextmanager
    async def running(self, session: str, agent: str) -> AsyncIterator[None]:
        """Holds a local turn on the lease: a fence cancels it, and that cancel leaves here as
        Fenced (UNAVAILABLE) rather than as a cancellation of the caller."""
        held = self.held.get((session, agent))
        if held is None:
            raise Fenced(interrupted(agent))
        task = asyncio.current_task()
        assert task is not None
        held.turns.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if task in held.cut:
                held.cut.discard(task)
                task.uncancel()
                raise Fenced(interrupted(agent)) from None
            raise
        finally:
            held.turns.discard(task)
            held.idle_since = time.monotonic()

    # ---- losing and giving up ----

    def fence(self, key: tuple[str, str], why: str) -> None:
        """Ownership of `key` ends here now: running turns cut, the agent session closed."""
        held = self.held.pop(key, None)
        if held is None:
            return
        self.fenced += 1
        log.warning("agent lease lost: its turns are cut and its agent closed", extra={"fields": {
            "session": key[0], "agent": key[1], "token": held.token, "why": why}})
        for task in held.turns:
            held.cut.add(task)
            task.cancel()
        self._gone(key[0])
        if not self._tasks.closed:
            self._tasks.spawn(self.sessions.drop(key[0], key[1], f"its lease was lost ({why})"),
                              name="close fenced agent session")

    def _gone(self, session: str) -> None:
        if not any(k[0] == session for k in self.held):
            self.on_session(session, False)

    async def _renew_forever(self) -> None:
        """Every lease_s/4: fences what went unrenewed too long, starts a renewal round (never two
        at once: a round stuck on a cut link must not pile up), until nothing is held."""
        round_: asyncio.Task[None] | None = None
        while self.held:
            await asyncio.sleep(self.lease_s / 4)
            now = time.monotonic()
            for key, held in list(self.held.items()):
                if now - held.renewed_at > self.lease_s:
                    self.fence(key, f"its lease was not renewed for over {self.lease_s:g} s (store unreachable)")
            if (round_ is None or round_.done()) and self.held and not self._tasks.closed:
                round_ = self._tasks.spawn(self._renew_round(), name="agent lease renewal round")

    async def _renew_round(self) -> None:
        await asyncio.gather(*(self._renew(key, held) for key, held in list(self.held.items())))

    async def _renew(self, key: tuple[str, str], held: _Held) -> None:
        session, agent = key
        if not held.turns and not self.sessions.is_live(session, agent) \
                and time.monotonic() - held.idle_since > self.lease_s / 4:
            await self._release(key, held)
            return
        sent = time.monotonic()
        try:
            ok = await self.store.renew_lease(session, agent, self.owner_id, held.token, self.lease_s)
        except Exception as exc:  # an outage: the next round tries again; the clock fences
            log.debug("agent lease renewal failed", extra={"fields": {"session": session, "error": str(exc)}})
            return
        if self.held.get(key) is not held:
            return
        if ok:
            held.renewed_at = max(held.renewed_at, sent)
        else:
            self.fence(key, "another replica holds it now")

    async def _release(self, key: tuple[str, str], held: _Held) -> None:
        """Gives up a lease with no agent and no turn here, so any replica can take it at once."""
        if self.held.get(key) is not held:
            return
        del self.held[key]
        self.released += 1
        self._gone(key[0])
        try:
            await self.store.drop_lease(key[0], key[1], self.owner_id, held.token)
        except Exception as exc:  # it expires by itself within the lease
            log.debug("agent lease release failed", extra={"fields": {"session": key[0], "error": str(exc)}})

    # ---- lifecycle ----

    async def __aenter__(self) -> Ownership:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stops renewing and gives every lease up (bounded: a store that does not answer lets
        them expire instead), so the other replicas take over at once after a clean stop."""
        self._closing = True
        await self._tasks.aclose(patience=1.0)
        held, self.held = list(self.held.items()), {}
        for session in {k[0] for k, _ in held}:
            self.on_session(session, False)
        if held:
            try:
                async with asyncio.timeout(min(2.0, self.lease_s)):
                    await asyncio.gather(*(self.store.drop_lease(k[0], k[1], self.owner_id, h.token)
                                           for k, h in held), return_exceptions=True)
            except TimeoutError:
                log.info("agent leases left to expire (store slow)", extra={"fields": {"leases": len(held)}})

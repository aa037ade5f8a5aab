"""The state of each hosted agent (running, modes, models, commands), shared through the session
store so the sessions listing of every replica shows the agents other replicas host.

With Redis a hosted agent lives at one replica, its lease owner (uibus.replicas.ownership), and the
listing reads live agents from memory. Asking the owner on every listing would be a bus round trip
per session per watch per second; instead the owner writes the state when it changes, key
`agents/state/<agent>` = {holder, at_ms, state}, like the waiting dialogs (uibus.replicas.dialog_sharing),
and removes it when the agent closes. The writes stamp the session's last activity, so the
listing's per-session cache (uibus.domain.sessions) reads them again exactly when one changed.

When the state changes: a turn starts or ends (an agent's modes, commands and title arrive in
turns), a steering call changed it, the agent opened or closed (Placement.agent_changed, told by
AgentSessions and Steering). Writes are coalesced per agent (the latest state wins) and never fail
a turn: a write that fails is logged, and the next change writes again.

A crashed owner leaves its entries behind: an entry is listed only while its holder is announced
on the session's AGENT_TURN (it listens there while it holds a lease in the session) or is younger
than UNHEARD_GRACE_MS; readers delete the entries they find dead.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError

from uibus.infra import kinds
from uibus.infra.store import Store
from uibus.infra.tasks import Tasks
from uibus.pb.uibus.v1 import sessions_pb2 as pb

log = logging.getLogger("uibus.agents")

KEY = "agents/state/"  # + agent name
STORE_WAIT_S = 2.0  # the longest one write may take (Redis down: the next change writes again)
UNHEARD_GRACE_MS = 30_000  # see uibus.replicas.dialog_sharing: the same margin for an unannounced holder

Announced = Callable[[str, str, Any], "bool | None"]
# (session, agent) -> the state of the agent open here (uibus.domain.steering), None when none is
StateOf = Callable[[str, str], "pb.AgentState | None"]


class AgentStateSharing:
    """Writes the state of the agents hosted here; reads those other replicas host."""

    def __init__(self, store: Store, state_of: StateOf, replica: str, announced: Announced) -> None:
        self.store = store
        self.state_of = state_of
        self.replica = replica
        self._announced = announced
        self._dirty: dict[tuple[str, str], None] = {}
        self._writer: asyncio.Task[None] | None = None
        self._tasks = Tasks("agent state sharing")

    def changed(self, session: str, name: str) -> None:
        """The state of (`session`, `name`) here changed: write it (soon, once however many changes)."""
        if self._tasks.closed:
            return
        self._dirty[(session, name)] = None
        if self._writer is None or self._writer.done():
            self._writer = self._tasks.spawn(self._write_all(), name="agent state write")

    async def _write_all(self) -> None:
        while self._dirty:
            key = next(iter(self._dirty))
            del self._dirty[key]
            session, name = key
            state = self.state_of(session, name)
            value = None
            if state is not None:
                value = {"holder": self.replica, "at_ms": int(time.time() * 1000),
                         "state": base64.b64encode(state.SerializeToString()).decode()}
            try:
                async with asyncio.timeout(STORE_WAIT_S):
                    await self.store.put(session, KEY + name, value)
            except Exception as exc:  # the next change writes again
                log.warning("agent state not shared", extra={"fields": {
                    "session": session, "agent": name, "error": f"{type(exc).__name__}: {exc}"}})

    def others(self, session: str, kept: dict[str, Any]) -> list[pb.AgentState]:
        """The states other replicas wrote for `session` (its store entries under KEY), of holders
        still alive; entries found dead are deleted in the background."""
        now_ms = int(time.time() * 1000)
        found = []
        for key, entry in kept.items():
            try:
                holder, at_ms = str(entry["holder"]), int(entry.get("at_ms") or 0)
                state = pb.AgentState.FromString(base64.b64decode(entry["state"]))
            except (KeyError, TypeError, ValueError, AttributeError, DecodeError):
                continue  # not an entry this version can read
            if holder == self.replica:
                continue  # this replica's memory is exact
            if now_ms - at_ms >= UNHEARD_GRACE_MS \
                    and self._announced(holder, session, kinds.AGENT_TURN) is False:
                if not self._tasks.closed:
                    self._tasks.spawn(self._remove(session, key, entry), name="dead agent state removal")
                continue
            found.append(state)
        return found

    async def _remove(self, session: str, key: str, seen: Any) -> None:
        def drop(value: Any | None) -> Any | None:
            return None if value == seen else value  # rewritten since: a live holder's

        try:
            async with asyncio.timeout(STORE_WAIT_S):
                await self.store.update(session, key, drop)
        except Exception as exc:
            log.debug("dead agent state not removed", extra={"fields": {"session": session, "error": str(exc)}})

    async def __aenter__(self) -> AgentStateSharing:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Lets the pending writes finish (briefly: the removals at shutdown are among them)."""
        await self._tasks.aclose(grace=2 * STORE_WAIT_S)

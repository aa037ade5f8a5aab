"""Room for a turn: an agent's `max_processes`, shared by everyone, and each tenant's share of it (the
quota `agent_processes`, per tenant and agent; docs/security/quotas.md).

A process whose turns are done stays for the agent's idle_seconds, so the next turn finds its
conversation; but an idle process is nobody's to keep. Without this, one tenant's finished turns held
every process of an agent for idle_seconds (900 by default) and refused every other tenant's first
turn RESOURCE_EXHAUSTED. So:

* a tenant at its share gives way to itself: its own least recently used idle agent session of that
  agent is closed, and it is refused (QuotaExceeded naming the quota) only when all of its own are
  running or awaiting a turn; another tenant's are never touched, so no one is refused for it;
* at the agent's max_processes, the least recently used idle agent session of that agent (anyone's)
  is closed and the open tried once more.

Only agent sessions running or awaiting a turn are never closed.

`Room` is owned by `AgentSessions` (uibus.domain.agent_sessions) and handed what it acts on — the
live agent sessions, how to open one and how to close one — when it is built: its own object
because it is its own job (who gives way), not the sessions' lifecycle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from uibus.infra.auth import OPERATOR, Tokens
from uibus.infra.errors import ResourceExhausted
from uibus.infra.quotas import Quotas

QUOTA = "agent_processes"

Key = tuple[str, str]  # (uibus session, agent name)


class Room:
    """Who gives way when a turn needs a process: the agent's max_processes and each tenant's share."""

    def __init__(self, live: Callable[[], dict[Key, Any]], open_: Callable[[str, Any], Awaitable[Any]],
                 close: Callable[[Key, Any, str], Awaitable[None]], tokens: Tokens | None,
                 quotas: Quotas | None) -> None:
        """`live()`: the live agent sessions by key (each with `tenant`, `users`, `task`, `idle_since`,
        `agent`); `open_(session, backend)`: opens one (ResourceExhausted at max_processes);
        `close(key, agent, why)`: closes one taken out of `live()`; `tokens`: whose each session is;
        `quotas`: the quotas in force (None: no per-tenant share, only max_processes)."""
        self._live = live
        self._open = open_
        self._close = close
        self.tokens = tokens
        self.quotas = quotas
        self.reclaimed = 0  # idle agent sessions closed to make room for a turn (a /metrics counter)
        # (tenant, agent) -> agent sessions being opened now: counted in the share before they are
        # live, so two first turns of one tenant at once cannot both take its last place.
        self._starting: dict[Key, int] = {}

    def _share_of(self, tenant: str, name: str) -> int:
        """What `tenant` holds of agent `name`: its live agent sessions and those being opened."""
        live = sum(1 for key, entry in self._live().items() if key[1] == name and entry.tenant == tenant)
        return live + self._starting.get((tenant, name), 0)

    @asynccontextmanager
    async def within_share(self, session: str, name: str) -> AsyncIterator[str]:
        """A place in the share of agent `name` of `session`'s tenant (yielded), held while its agent
        session is opened (it counts as live once opened). At the share, the tenant's own least
        recently used idle one is closed first; QuotaExceeded when none of its own is idle."""
        tenant = self.tokens.tenant(session) if self.tokens is not None else OPERATOR
        quotas = self.quotas
        while quotas is not None and quotas.at_limit(QUOTA, tenant, held=self._share_of(tenant, name)):
            if not await self._reclaim(name, tenant):
                raise quotas.refuse(QUOTA, tenant, f" of agent {name!r}, none of them idle")
        key = (tenant, name)
        self._starting[key] = self._starting.get(key, 0) + 1
        try:
            yield tenant
        finally:
            left = self._starting[key] - 1
            if left:
                self._starting[key] = left
            else:
                del self._starting[key]

    async def open(self, session: str, backend: Any) -> Any:
        """Opens an agent session; at the agent's max_processes, its least recently used idle agent
        session is closed first and the open tried once more (ResourceExhausted when none is idle)."""
        try:
            return await self._open(session, backend)
        except ResourceExhausted:
            if not await self._reclaim(backend.spec.name):
                raise
        return await self._open(session, backend)

    async def _reclaim(self, name: str, tenant: str | None = None) -> bool:
        """Closes the least recently used idle agent session of agent `name` (of `tenant` alone when
        given); False when none is idle."""
        live = self._live()
        idle = [(entry.idle_since, key) for key, entry in live.items()
                if key[1] == name and not entry.users and entry.task is None
                and (tenant is None or entry.tenant == tenant)]
        if not idle:
            return False
        key = min(idle)[1]
        entry = live.pop(key)
        self.reclaimed += 1
        why = "max_processes" if tenant is None else f"its tenant's quota {QUOTA}"
        await self._close(key, entry.agent, f"closed (the least recently used idle one) to make room under {why}")
        return True

"""Room for a turn under an agent's `max_processes`: the least recently used idle agent session of
that agent is closed first, and the open tried once more.

A process whose turns are done stays for the agent's idle_seconds, so the next turn finds its
conversation; but an idle process is nobody's to keep. Without this, one tenant's finished turns held
every process of an agent for idle_seconds (900 by default) and refused every other tenant's first
turn RESOURCE_EXHAUSTED (docs/security/quotas.md). Only agent sessions running or awaiting a turn are never closed.

A mixin of `AgentSessions` (uibus.domain.agent_sessions), whose `_live`, `_open` and `_close` it uses:
its own module because it is its own job (who gives way), not the sessions' lifecycle.
"""

from __future__ import annotations

from typing import Any

from uibus.errors import ResourceExhausted


class MakesRoom:
    closed_reclaimed = 0  # idle agent sessions closed to make room for a turn (a /metrics counter)
    _live: dict[tuple[str, str], Any]

    async def _open_reclaiming(self, session: str, backend: Any) -> Any:
        """`_open`; at the agent's max_processes, its least recently used idle agent session is
        closed first and the open tried once more (ResourceExhausted when none is idle)."""
        try:
            return await self._open(session, backend)  # type: ignore[attr-defined]
        except ResourceExhausted:
            if not await self._reclaim(backend.spec.name):
                raise
        return await self._open(session, backend)  # type: ignore[attr-defined]

    async def _reclaim(self, name: str) -> bool:
        """Closes the least recently used idle agent session of agent `name`; False when none is idle."""
        idle = [(entry.idle_since, key) for key, entry in self._live.items()
                if key[1] == name and not entry.users and entry.task is None]
        if not idle:
            return False
        key = min(idle)[1]
        entry = self._live.pop(key)
        self.closed_reclaimed += 1
        await self._close(key, entry.agent, "closed (the least recently used idle one) to make room "  # type: ignore[attr-defined]
                                            "under max_processes")
        return True

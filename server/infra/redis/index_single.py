"""The session index of a store on one Redis (a server, or the master a sentinel set names).

  `uibus:sessions`  sorted set: session `s` -> last write (ms since the epoch)

Retention runs in Lua scripts (uibus.infra.redis.scripts), so each step is atomic on the server: a write
stamps the session in the index in the same MULTI (or script); eviction pops the longest idle from
the index and deletes their keys in one script, so with several replicas each session is evicted,
and counted, by exactly one of them, and concurrent evictions never go below the bound. The index
is one key and the eviction script derives the keys of the sessions it deletes, which a single
Redis allows (a cluster does not: uibus.infra.redis.index_cluster). Data of an earlier version joins the
index at its session's next write, and a list of it joins its session's `lists` hash (so eviction
deletes it) at its next append.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from uibus.infra.redis import scripts
from uibus.infra.redis.keys import IndexHost
from uibus.infra.store import EVICT_BATCH, now_ms


class SingleIndex:
    """One sorted set of every session; each write and its stamp (and making room) is one script."""

    def __init__(self, store: IndexHost) -> None:
        self.store = store
        self.key = f"{store.keys.namespace}:sessions"
        script = store.redis.register_script
        self._put, self._append = script(scripts.PUT), script(scripts.APPEND)
        self._evict_over_max_script = script(scripts.EVICT_OVER_MAX)
        self._evict_idle_script = script(scripts.EVICT_IDLE)

    def index_keys(self) -> list[str]:
        """The sorted sets that index the sessions (here one)."""
        return [self.key]

    async def probe(self) -> None:
        """The tiny SET that expires by itself (a Redis out of memory refuses it)."""
        await self.store.redis.set(f"{self.store.keys.namespace}:probe", now_ms(), px=10_000)

    async def memory(self) -> list[dict[str, Any]]:
        return [await self.store.redis.info("memory")]

    def _retention_args(self, session: str) -> list[Any]:
        """The trailing ARGV of the write scripts: stamp, member, and what making room needs."""
        s = self.store
        return [now_ms(), s.keys.member(session), s.keys.namespace, s.max_sessions, EVICT_BATCH]

    def _counted(self, evicted: int, sessions: int) -> None:
        self.store.stats.evicted_over_max += int(evicted)
        self.store.stats.sessions = int(sessions)

    async def put(self, session: str, key: str, raw: bytes) -> None:
        """One script: the write (`raw` JSON; empty deletes), the session's stamp and, for a new
        session, making room."""
        s = self.store
        with s.guard():
            evicted, sessions = await self._put(keys=[s.keys.kv(session), self.key],
                                                args=[key, raw, *self._retention_args(session)])
            self._counted(evicted, sessions)

    async def update(self, session: str, key: str, change: Callable[[Any | None], Any | None]) -> Any | None:
        """The watched transaction with the session's stamp and the count after it in its MULTI (a
        delete only refreshes a session that exists); a session it created makes room after it."""
        s = self.store
        member = s.keys.member(session)

        def stamp(pipe: Any, create: bool) -> None:
            pipe.zadd(self.key, {member: now_ms()}, xx=not create)
            pipe.zcard(self.key)

        value, replies = await s.watched(session, key, change, stamp)
        _, created, sessions = replies
        with s.guard():
            s.stats.sessions = int(sessions)
            if created and s.max_sessions and sessions > s.max_sessions:
                await self._evict_over_max()  # the new session is the newest: never the one evicted
        return value

    async def append(self, session: str, key: str, raw: bytes, max_len: int, max_bytes: int) -> None:
        """One script: the push of `raw` (JSON), both bounds, the byte total, the stamp."""
        s = self.store
        with s.guard():
            dropped, evicted, sessions = await self._append(
                keys=[s.keys.list(session, key), s.keys.lists(session), self.key],
                args=[raw, max_len, max_bytes, key, *self._retention_args(session)])
            s.stats.history_dropped += int(dropped)
            self._counted(evicted, sessions)

    async def _evict_over_max(self) -> int:
        s = self.store
        n, left = await self._evict_over_max_script(keys=[self.key],
                                                    args=[s.keys.namespace, s.max_sessions, EVICT_BATCH])
        self._counted(n, left)
        return int(n)

    async def sweep(self) -> int:
        s = self.store
        evicted = 0
        with s.guard():
            if s.ttl_s > 0:
                cutoff = now_ms() - s.ttl_s * 1000
                while True:
                    n, left = await self._evict_idle_script(keys=[self.key],
                                                            args=[s.keys.namespace, cutoff, EVICT_BATCH])
                    evicted += int(n)
                    s.stats.evicted_idle += int(n)
                    s.stats.sessions = int(left)
                    if n < EVICT_BATCH:
                        break
            if s.max_sessions:
                while await self._evict_over_max() == EVICT_BATCH:
                    pass
            else:
                s.stats.sessions = int(await s._redis.zcard(self.key))
        return evicted

"""The session index of a store on a Redis Cluster.

On a Redis Cluster one script may only touch keys of one slot (else CROSSSLOT),
and one index key would put every write of every session on one master. So here:
  `uibus:{ix:<n>}:sessions`  INDEX_SHARDS sorted sets replace `uibus:sessions`; a session's is
                             chosen by a stable hash (crc32) of `s`, the tags spread them over the
                             masters ('ix:<n>' is never a session: ':' is quoted in members)
  `uibus:{s}:seen`           the session's last write, next to its data (same slot)
  `uibus:{ix:lock}:evicting` held (SET NX PX, with a token) by the one replica evicting over
                             max_sessions or sweeping, so that concurrent evictions, which can no
                             longer count and pop in one atomic step, never go below the bound
A write is two steps: the session's own write (a script or MULTI on its slot, `seen` included),
then its stamp (ZADD) in its index. The bound is the sum of the indexes' ZCARDs; eviction takes the
globally longest idle from the heads of all indexes and removes each from its index with a
compare-and-remove (only while its score is the one seen): the replica whose removal returns it is
the one that deletes and counts it, so each session still goes exactly once. It deletes the
session's keys only if `seen` is not newer than that score: a write that raced the eviction keeps
its session (re-stamped in the index), never half of it. A write whose stamp fails (the index's
master is down) is reported failed; its data waits, unindexed, for the session's next write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from uibus.infra.errors import StoreFull, StoreUnavailable
from uibus.infra.redis import scripts
from uibus.infra.redis.conn import CLUSTER_OUTAGE, OUTAGE_ERRORS
from uibus.infra.redis.keys import IndexHost
from uibus.infra.store import EVICT_BATCH, now_ms

log = logging.getLogger("uibus.infra.store")

# The cluster's index is split in this many sorted sets (their `{ix:<n>}` tags spread them over the
# masters). Part of the layout: changing it hides the sessions indexed in the sets left out.
INDEX_SHARDS = 16
# The hash tag of the session "" on a cluster: never a member (quoting writes '%' only as '%XX').
EMPTY_TAG = "%"
# The eviction lock: held this long at most (a replica that dies holding it blocks eviction no
# longer), waited for a little longer; a step under it takes milliseconds.
EVICT_LOCK_MS = 3000
EVICT_LOCK_WAIT_S = EVICT_LOCK_MS / 1000 + 0.5


class ClusterIndex:
    """INDEX_SHARDS sorted sets and each session's `seen`; a write is its session's step, then its
    stamp; eviction takes the globally longest idle under the eviction lock."""

    def __init__(self, store: IndexHost) -> None:
        self.store = store
        self._redis = store.redis
        namespace = store.keys.namespace
        self._indexes = [f"{namespace}:{{ix:{n}}}:sessions" for n in range(INDEX_SHARDS)]
        self._evict_lock = f"{namespace}:{{ix:lock}}:evicting"
        script = self._redis.register_script
        self._put_session, self._append_session = script(scripts.PUT_SESSION), script(scripts.APPEND_SESSION)
        self._drop_if_idle, self._take = script(scripts.DROP_IF_IDLE), script(scripts.TAKE)
        self._take_idle, self._release = script(scripts.TAKE_IDLE), script(scripts.RELEASE)

    def index_keys(self) -> list[str]:
        """The sorted sets that index the sessions (one per index shard)."""
        return list(self._indexes)

    async def probe(self) -> None:
        """CLUSTER INFO on every master the client knows must say cluster_state:ok: while a slot
        range has no master (a master died and no replica took over yet) the store is down, even
        for sessions on the other masters (they refuse with CLUSTERDOWN meanwhile); a master the
        client cannot reach fails the probe too (and makes it learn the slots again). Then the tiny
        SET on each index's slot: the masters the index lives on take writes."""
        infos = await asyncio.gather(*(self._redis.cluster_info(target_nodes=node)
                                       for node in self._redis.get_primaries()))
        down = [info.get("cluster_state") for info in infos if info.get("cluster_state") != "ok"]
        if down or not infos:
            raise self.store._failed("refusing", StoreUnavailable(
                "session store unavailable: Redis refuses commands (cluster down: a slot range has no master)"))
        async with self._redis.pipeline(transaction=False) as pipe:
            for index in self._indexes:
                pipe.set(index.rpartition(":")[0] + ":probe", now_ms(), px=10_000)
            await pipe.execute()

    async def memory(self) -> list[dict[str, Any]]:
        return [await self._redis.info("memory", target_nodes=node) for node in self._redis.get_primaries()]

    # ---- the writes: the session's own step, then its stamp ----------------------------------

    async def put(self, session: str, key: str, raw: bytes) -> None:
        """The write (`raw` JSON; empty deletes) and `seen` in the session's slot, then the stamp."""
        s = self.store
        now = now_ms()
        with s.guard():
            await self._put_session(keys=[s.keys.kv(session), self._seen(session)], args=[key, raw, now])
        await self._stamp(session, now, create=bool(raw))

    async def update(self, session: str, key: str, change: Callable[[Any | None], Any | None]) -> Any | None:
        """The watched transaction with `seen` in its MULTI (the session's slot only); the stamp
        in its index follows the EXEC."""
        stamped = [0.0]
        seen = self._seen(session)

        def stamp(pipe: Any, create: bool) -> None:
            stamped[0] = now_ms()
            pipe.set(seen, stamped[0], xx=not create)

        value, _ = await self.store.watched(session, key, change, stamp)
        await self._stamp(session, stamped[0], create=value is not None)
        return value

    async def append(self, session: str, key: str, raw: bytes, max_len: int, max_bytes: int) -> None:
        """The push and its bounds as on one server, and `seen`, in the session's slot; then the stamp."""
        s = self.store
        now = now_ms()
        with s.guard():
            dropped = await self._append_session(
                keys=[s.keys.list(session, key), s.keys.lists(session), self._seen(session)],
                args=[raw, max_len, max_bytes, key, now])
            s.stats.history_dropped += int(dropped)
        await self._stamp(session, now, create=True)

    def _seen(self, session: str) -> str:
        return self.store.keys.base(session) + ":seen"

    def _index_of(self, member: str) -> str:
        """The index of session `member`: a stable hash (the same in every replica and release)."""
        return self._indexes[zlib.crc32(member.encode()) % INDEX_SHARDS]

    async def _stamp(self, session: str, now: float, create: bool) -> None:
        """The write's second step: the session's stamp in its index (a delete only refreshes a
        session that is indexed). A session the stamp adds is new: room is made for it. The write
        is done by then, so a failure to make room is noted (health, log), not raised: the sweep
        enforces the bound again within `sweep_s`."""
        member = self.store.keys.member(session)
        with self.store.guard():
            added = await self._redis.zadd(self._index_of(member), {member: now}, xx=not create)
        if not added:
            return
        with contextlib.suppress(StoreUnavailable, StoreFull):  # noted by the guard
            with self.store.guard():
                if self.store.max_sessions > 0:
                    evicted = await self._evict_over_max(keep=member)  # not `+= await`: a lost update
                    self.store.stats.evicted_over_max += evicted
                else:
                    self.store.stats.sessions = sum(await self._counts())

    async def _counts(self) -> list[int]:
        """ZCARD of every index, in one pipeline (one round trip per master)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for index in self._indexes:
                pipe.zcard(index)
            return [int(n) for n in await pipe.execute()]

    async def _heads(self, n: int) -> tuple[list[int], list[tuple[float, bytes, bytes, str]]]:
        """The ZCARD of every index and its `n` + 1 longest idle (score, raw score, member,
        index), in one pipeline: one more than wanted, in case one of them is the one to keep."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for index in self._indexes:
                pipe.zcard(index)
                pipe.zrange(index, 0, n, withscores=True, score_cast_func=bytes)
            replies = await pipe.execute()
        heads = [(float(score), score, member, index)
                 for index, entries in zip(self._indexes, replies[1::2], strict=True) for member, score in entries]
        return [int(c) for c in replies[::2]], heads

    @contextlib.asynccontextmanager
    async def _eviction_lock(self) -> AsyncIterator[bool]:
        """Holds the cluster-wide eviction lock (yields True), or yields False when it stayed
        taken for EVICT_LOCK_WAIT_S (its holder hangs: skip, the next write or sweep tries again).
        Counting and popping across the shards cannot be one atomic step, so without it two
        replicas would both evict the same surplus and go below the bound. Exactly-once eviction
        does not depend on it (the compare-and-remove does that)."""
        token = os.urandom(12).hex()
        deadline = time.monotonic() + EVICT_LOCK_WAIT_S
        while not await self._redis.set(self._evict_lock, token, nx=True, px=EVICT_LOCK_MS):
            if time.monotonic() > deadline:
                log.warning("session store eviction skipped: its lock stays taken",
                            extra={"fields": {"lock": self._evict_lock, "waited_s": EVICT_LOCK_WAIT_S}})
                yield False
                return
            await asyncio.sleep(0.002)
        try:
            yield True
        finally:
            # A failed release is harmless (the lock expires); it must not hide the body's error.
            with contextlib.suppress(*OUTAGE_ERRORS, *CLUSTER_OUTAGE, ResponseError):
                await self._release(keys=[self._evict_lock], args=[token])

    async def _drop_taken(self, index: str, taken: Sequence[tuple[bytes, bytes]]) -> int:
        """Deletes the sessions this replica took out of `index` (member, score it had), each
        in its own slot, concurrently; one written after that score is kept and stamped again.
        Returns how many were deleted."""
        async def drop(member: bytes, score: bytes) -> int:
            m = member.decode()
            base = self.store.keys.base_of(m)
            done = await self._drop_if_idle(keys=[base + ":kv", base + ":lists", base + ":seen"], args=[base, score])
            if int(done[0]) == 1:
                return 1
            await self._redis.zadd(index, {m: float(done[1])}, gt=True)  # written meanwhile: it stays
            return 0

        return sum(await asyncio.gather(*(drop(m, score) for m, score in taken)))

    async def _evict_over_max(self, keep: str | None = None) -> int:
        """While more than `max_sessions` are indexed (the sum over the shards), takes the globally
        longest idle (never `keep`) from the heads of the indexes and deletes them, at most
        EVICT_BATCH in one step under the eviction lock; returns how many went and refreshes
        `stats.sessions`. A head written meanwhile is not taken (compare and remove), so a round
        can fall short: then the count is taken again."""
        evicted = 0
        async with self._eviction_lock() as held:
            if not held:
                return 0
            for _ in range(8):  # each round makes progress unless writers keep racing it
                counts, heads = await self._heads(1)  # one head each: what a new session's write needs
                self.store.stats.sessions = total = sum(counts)
                want = min(total - self.store.max_sessions, EVICT_BATCH - evicted)
                if want <= 0:
                    break
                if want > 1:
                    counts, heads = await self._heads(want)
                chosen = [h for h in sorted(heads) if keep is None or h[2].decode() != keep][:want]
                if not chosen:
                    break
                by_index: dict[str, list[bytes]] = {}
                for _, score, member, index in chosen:
                    by_index.setdefault(index, []).extend((member, score))
                taken = await asyncio.gather(*(self._take(keys=[index], args=args) for index, args in by_index.items()))
                n = sum(await asyncio.gather(*(self._drop_taken(index, list(zip(t[::2], t[1::2], strict=True)))
                                                for index, t in zip(by_index, taken, strict=True))))
                evicted += n
                self.store.stats.sessions = total - n
                if n == want:  # the surplus is gone (a writer racing it only added to the count)
                    break
        return evicted

    async def sweep(self) -> int:
        """The sweep on a cluster: the idle over every index (each batch taken atomically from its
        index, so by one replica), then the bound across all of them; refreshes `stats.sessions`."""
        evicted = 0
        with self.store.guard():
            if self.store.ttl_s > 0:
                cutoff = now_ms() - self.store.ttl_s * 1000
                # counted first and then counted down, so the gauge is right as soon as a session is gone
                self.store.stats.sessions = sum(await self._counts())
                for index in self._indexes:
                    while True:
                        async with self._eviction_lock() as held:
                            if not held:
                                return evicted
                            t = await self._take_idle(keys=[index], args=[cutoff, EVICT_BATCH])
                            n = await self._drop_taken(index, list(zip(t[::2], t[1::2], strict=True)))
                        evicted += n
                        self.store.stats.evicted_idle += n
                        self.store.stats.sessions = max(0, self.store.stats.sessions - n)
                        if len(t) < 2 * EVICT_BATCH:
                            break
            if self.store.max_sessions:
                while (n := await self._evict_over_max()) > 0:
                    self.store.stats.evicted_over_max += n
                    if n < EVICT_BATCH:
                        break
            else:
                self.store.stats.sessions = sum(await self._counts())
        return evicted

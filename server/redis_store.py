"""The session store on Redis, so several replicas share one state (SPEC.md §4): one server,
a master set behind sentinels (both: `make_client` hands out a plain client) or a Redis Cluster.

Layout, for a session `s` (percent-quoted so it contains no ':' or braces):
  `uibus:{s}:kv`          hash: store key -> JSON value
  `uibus:{s}:list:<key>`  list of JSON values, oldest first, trimmed to the newest `max_len`
  `uibus:{s}:lists`       hash: list key -> byte total of that list (every list of the session)
  `uibus:sessions`        sorted set: session `s` -> last write (ms since the epoch)
The `{s}` braces are a Redis Cluster hash tag: all keys of one session live in one slot. No
operation uses KEYS or SCAN: eviction finds a session's lists in its `lists` hash.

Retention runs in Lua scripts, so each step is atomic on the server: a write stamps the session
in the index in the same MULTI (or script); eviction pops the longest idle from the index and
deletes their keys in one script, so with several replicas each session is evicted, and
counted, by exactly one of them, and concurrent evictions never go below the bound. The index is
one key and the eviction script derives the keys of the sessions it deletes, which a single
Redis allows. Data of an earlier version joins the index at its session's next write, and a list
of it joins its session's `lists` hash (so eviction deletes it) at its next append.

On a Redis Cluster (`cluster=True`) one script may only touch keys of one slot (else CROSSSLOT),
and one index key would put every write of every session on one master. So there:
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

Faults are classified in `_guard`, the one place: unreachable (a cluster with a slot range
without a master too), loading, read-only or unable to persist is StoreUnavailable, out of memory
(maxmemory with noeviction) StoreFull; both mark the store unhealthy until `probe` (PING and a
tiny SET; on a cluster CLUSTER INFO on every master too) passes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any
from urllib.parse import quote

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    BusyLoadingError,
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
)

from uibus.errors import StoreFull, StoreUnavailable
from uibus.redis_conn import OUTAGE_ERRORS, SlotMap, make_client
from uibus.store import EVICT_BATCH, Store, now_ms

log = logging.getLogger("uibus.store")

_GLOB_SPECIAL = str.maketrans({c: "\\" + c for c in "*?[]\\"})

# Deletes every key of session member `m` (its values, each list named in its `lists` hash).
_DROP = """
local function drop(ns, m)
  local base = ns .. ':{' .. m .. '}'
  for _, k in ipairs(redis.call('HKEYS', base .. ':lists')) do
    redis.call('DEL', base .. ':list:' .. k)
  end
  redis.call('DEL', base .. ':kv', base .. ':lists')
end
"""

# Deletes the longest idle sessions (never `keep`; false = none) while more than `max` are indexed, at most
# `batch`; returns how many. Atomic with the write that called it, so replicas never over-evict.
_EVICT_OVER = _DROP + """
local function evict_over(index, ns, max, batch, keep)
  local over = math.min(redis.call('ZCARD', index) - max, batch)
  local n = 0
  if over > 0 then
    for _, m in ipairs(redis.call('ZRANGE', index, 0, over)) do
      if n == over then break end
      if m ~= keep then
        drop(ns, m)
        redis.call('ZREM', index, m)
        n = n + 1
      end
    end
  end
  return n
end
"""

# KEYS: index. ARGV: namespace, max_sessions, batch. Returns {deleted, sessions left}.
_EVICT_OVER_MAX = _EVICT_OVER + """
return {evict_over(KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), false), redis.call('ZCARD', KEYS[1])}
"""

# KEYS: the session's kv hash, index. ARGV: key, JSON value ('' deletes), now, member, namespace,
# max_sessions, batch. The write, its stamp and (for a new session) making room, in one step.
# Returns {sessions evicted, sessions stored}.
_PUT = _EVICT_OVER + """
local evicted = 0
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZADD', KEYS[2], 'XX', ARGV[3], ARGV[4])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  if redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4]) == 1 and tonumber(ARGV[6]) > 0 then
    evicted = evict_over(KEYS[2], ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[4])
  end
end
return {evicted, redis.call('ZCARD', KEYS[2])}
"""

# KEYS: index. ARGV: namespace, cutoff (ms), batch.
# Deletes up to `batch` sessions last written before the cutoff; returns {deleted, sessions left}.
_EVICT_IDLE = _DROP + """
local victims = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
for _, m in ipairs(victims) do
  drop(ARGV[1], m)
  redis.call('ZREM', KEYS[1], m)
end
return {#victims, redis.call('ZCARD', KEYS[1])}
"""

# KEYS: list, the session's lists hash, index. ARGV: JSON value, max_len, max_bytes, list key, now,
# member, namespace, max_sessions, batch. RPUSH, keep the byte total in the lists hash, drop the
# oldest over max_len (LTRIM) and, with max_bytes > 0, while over max_bytes (LPOP, never the item
# just pushed); stamp the session and, if it is new, make room.
# Returns {entries dropped for bytes, sessions evicted, sessions stored}. (_PUSH is its first part, the
# list alone, which the cluster's _APPEND_SESSION shares.)
_PUSH = """
local max_len, max_bytes = tonumber(ARGV[2]), tonumber(ARGV[3])
local dropped = 0
if max_len <= 0 then
  redis.call('DEL', KEYS[1])
  redis.call('HDEL', KEYS[2], ARGV[4])
else
  local total = tonumber(redis.call('HGET', KEYS[2], ARGV[4]))
  if not total then
    total = 0
    for _, v in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do total = total + #v end
  end
  local n = redis.call('RPUSH', KEYS[1], ARGV[1])
  total = total + #ARGV[1]
  if n > max_len then
    for _, v in ipairs(redis.call('LRANGE', KEYS[1], 0, n - max_len - 1)) do total = total - #v end
    redis.call('LTRIM', KEYS[1], n - max_len, -1)
    n = max_len
  end
  while max_bytes > 0 and total > max_bytes and n > 1 do
    total = total - #redis.call('LPOP', KEYS[1])
    n = n - 1
    dropped = dropped + 1
  end
  redis.call('HSET', KEYS[2], ARGV[4], total)
end
"""

_APPEND = _EVICT_OVER + _PUSH + """
local evicted = 0
if redis.call('ZADD', KEYS[3], ARGV[5], ARGV[6]) == 1 and tonumber(ARGV[8]) > 0 then
  evicted = evict_over(KEYS[3], ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[6])
end
return {dropped, evicted, redis.call('ZCARD', KEYS[3])}
"""

# ---- Redis Cluster: the session's own step, its index's step, the eviction lock -----------------

# KEYS: the session's kv hash, its seen key. ARGV: key, JSON value ('' deletes), now.
# The write and the session's `seen`; a delete refreshes `seen` only of a session that exists.
_PUT_SESSION = """
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('SET', KEYS[2], ARGV[3], 'XX')
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3])
end
return 1
"""

# KEYS: list, the session's lists hash, its seen key. ARGV: as _APPEND's first five (value, max_len,
# max_bytes, list key, now). The push and its bounds as _APPEND, and `seen`; returns entries dropped.
_APPEND_SESSION = _PUSH + """
redis.call('SET', KEYS[3], ARGV[5])
return dropped
"""

# KEYS: the session's kv hash, lists hash, seen key. ARGV: the session's key prefix (`ns:{m}`), the
# index score it was taken at. Deletes every key of the session unless it was written after that
# score: returns {1} (deleted) or {0, seen} (kept: the caller stamps it again).
_DROP_IF_IDLE = """
local seen = redis.call('GET', KEYS[3])
if seen and tonumber(seen) > tonumber(ARGV[2]) then
  return {0, seen}
end
for _, k in ipairs(redis.call('HKEYS', KEYS[2])) do
  redis.call('DEL', ARGV[1] .. ':list:' .. k)
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return {1}
"""

# KEYS: an index. ARGV: member, score, member, score, … Removes each member whose score is still
# the one given (compare and remove: not one written since); returns those removed.
_TAKE = """
local taken = {}
for i = 1, #ARGV, 2 do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) == tonumber(ARGV[i + 1]) then
    redis.call('ZREM', KEYS[1], ARGV[i])
    taken[#taken + 1] = ARGV[i]
    taken[#taken + 1] = score
  end
end
return taken
"""

# KEYS: an index. ARGV: cutoff (ms), batch. Removes up to `batch` members last written before the
# cutoff; returns them as {member, score, …}.
_TAKE_IDLE = """
local victims = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1], 'WITHSCORES', 'LIMIT', 0,
                           tonumber(ARGV[2]))
for i = 1, #victims, 2 do
  redis.call('ZREM', KEYS[1], victims[i])
end
return victims
"""

# KEYS: the eviction lock. ARGV: the holder's token. Releases the lock only if still held by it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


# The cluster's index is split in this many sorted sets (their `{ix:<n>}` tags spread them over the
# masters). Part of the layout: changing it hides the sessions indexed in the sets left out.
INDEX_SHARDS = 16
# The hash tag of the session "" on a cluster: never a member (quoting writes '%' only as '%XX').
EMPTY_TAG = "%"
# The eviction lock (cluster): held this long at most (a replica that dies holding it blocks
# eviction no longer), waited for a little longer; a step under it takes milliseconds.
EVICT_LOCK_MS = 3000
EVICT_LOCK_WAIT_S = EVICT_LOCK_MS / 1000 + 0.5
# What redis-py's cluster client raises, with no reply of Redis, while it finds no node for a slot
# (a master is gone and no replica took over yet) or cannot reach any node to learn the slots.
_CLUSTER_OUTAGE: tuple[type[BaseException], ...] = (SlotNotCoveredError, ClusterError)

# Replies of a Redis that is up but refuses commands for a while (unavailable, not our bug), in words.
_REFUSING = {"LOADING": "loading its data", "READONLY": "a read-only replica", "MISCONF": "cannot persist to disk",
             "MASTERDOWN": "its primary is down", "TRYAGAIN": "cluster busy", "CLUSTERDOWN": "cluster down"}
# After "out of memory", the store counts as recovered only below this share of maxmemory: a Redis
# at its limit takes a tiny SET but refuses the next real write, and health must not flap with it.
FULL_RECOVERED_BELOW = 0.95
# One wording for every "out of memory" (Redis words it differently inside a MULTI, with key names).
OUT_OF_MEMORY = "session store is full: Redis out of memory (used memory > maxmemory)"


def _short(exc: BaseException) -> str:
    """Redis's message without the script it came from (a digest and line number say nothing)."""
    return str(exc).split(" script: ", 1)[0].rstrip(".") or type(exc).__name__


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class RedisStore(Store):
    """Same semantics as SqliteStore; one client (and its pool) for the life of the store."""

    def __init__(self, url: str, namespace: str = "uibus", *, ttl_s: float = 0, max_sessions: int = 0,
                 sweep_s: float | None = None, cluster: bool = False) -> None:
        """`cluster`: `url` names a node of a Redis Cluster, and the cluster's layout (module
        docstring) is used; else one server (or the master behind the sentinels of a
        `redis+sentinel://` URL) with the single index."""
        super().__init__(ttl_s=ttl_s, max_sessions=max_sessions, sweep_s=sweep_s)
        self.url = url
        self.namespace = namespace
        self.cluster = cluster
        self._redis: Any = make_client(url, f"{namespace}-store", cluster=cluster)
        self._index = f"{namespace}:sessions"
        self._indexes = [f"{namespace}:{{ix:{n}}}:sessions" for n in range(INDEX_SHARDS)]
        self._evict_lock = f"{namespace}:{{ix:lock}}:evicting"
        script = self._redis.register_script
        if cluster:
            self._put_session, self._append_session = script(_PUT_SESSION), script(_APPEND_SESSION)
            self._drop_if_idle, self._take, self._take_idle = script(_DROP_IF_IDLE), script(_TAKE), script(_TAKE_IDLE)
            self._release = script(_RELEASE)
        else:
            self._put, self._append = script(_PUT), script(_APPEND)
            self._evict_over_max_script, self._evict_idle_script = script(_EVICT_OVER_MAX), script(_EVICT_IDLE)
        self._full = False  # Redis refused a write for memory: the probe also wants room below the limit
        self._slots = SlotMap(self._redis) if isinstance(self._redis, RedisCluster) else None

    async def _ready(self) -> None:
        """On a cluster, the first learning of the slots, once (uibus.redis_conn.SlotMap: several
        first commands at once race). Later relearning (after MOVED or a dead node) is the client's
        own business."""
        if self._slots is not None and not self._slots.learned:
            with self._guard():
                await self._slots.learn()

    @staticmethod
    def _member(session: str) -> str:
        """The session as it appears in key names and in the index."""
        return quote(session, safe="")

    def _base(self, session: str) -> str:
        return self._base_of(self._member(session))

    def _base_of(self, member: str) -> str:
        """The prefix of the session's keys. On a cluster the session "" gets the tag EMPTY_TAG:
        Redis hashes a key with an empty `{}` whole, which would put its keys in different slots
        (one server has no slots: there `{}` stays, as data written before expects)."""
        return f"{self.namespace}:{{{member or (EMPTY_TAG if self.cluster else '')}}}"

    def _lists(self, session: str) -> str:
        return self._base(session) + ":lists"

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Re-raises what an unreachable or refusing Redis raises as StoreUnavailable (gRPC
        UNAVAILABLE) and "out of memory" as StoreFull (RESOURCE_EXHAUSTED), each noted for health;
        any other error (a bug of ours) goes on as it is."""
        try:
            yield
        except OutOfMemoryError as exc:
            self._full = True
            raise self._failed("oom", StoreFull(OUT_OF_MEMORY)) from exc
        except OUTAGE_ERRORS as exc:
            raise self._failed("unreachable", StoreUnavailable(
                f"session store unavailable: Redis unreachable ({_short(exc)})")) from exc
        except _CLUSTER_OUTAGE as exc:
            raise self._failed("unreachable", StoreUnavailable(
                f"session store unavailable: Redis Cluster has no master for a slot ({_short(exc)})")) from exc
        except RedisClusterException as exc:  # no node reachable to learn the slots from; else our bug
            if "connect" not in str(exc):
                raise
            raise self._failed("unreachable", StoreUnavailable(
                f"session store unavailable: Redis Cluster unreachable ({_short(exc)})")) from exc
        except ResponseError as exc:  # inside a MULTI Redis adds key names to the text: only its code is shown
            text = str(exc)
            code = ("LOADING" if isinstance(exc, BusyLoadingError) else "READONLY" if isinstance(exc, ReadOnlyError)
                    else next((c for c in _REFUSING if c in text), None))
            if code is None:
                raise
            raise self._failed("refusing", StoreUnavailable(
                f"session store unavailable: Redis refuses commands ({_REFUSING[code]})")) from exc

    async def probe(self) -> None:
        """PING, then a tiny SET that expires by itself: a Redis out of memory answers PING but
        refuses the SET, and that must keep the store unhealthy. After "out of memory", also
        used_memory below FULL_RECOVERED_BELOW of maxmemory (when INFO is allowed)."""
        await self._ready()
        with self._guard():
            await self._redis.ping()
            if self.cluster:
                await self._probe_cluster()
            else:
                await self._redis.set(f"{self.namespace}:probe", now_ms(), px=10_000)
            if self._full:
                try:
                    memories = ([await self._redis.info("memory", target_nodes=node)
                                 for node in self._redis.get_primaries()] if self.cluster
                                else [await self._redis.info("memory")])
                except ResponseError:  # INFO refused (an ACL): the SET above is all we can tell
                    memories = []
                for memory in memories:
                    used, limit = int(memory.get("used_memory", 0)), int(memory.get("maxmemory", 0))
                    if limit and used > limit * FULL_RECOVERED_BELOW:
                        raise self._failed("oom", StoreFull(OUT_OF_MEMORY))
                self._full = False

    async def _probe_cluster(self) -> None:
        """CLUSTER INFO on every master the client knows must say cluster_state:ok: while a slot
        range has no master (a master died and no replica took over yet) the store is down, even
        for sessions on the other masters (they refuse with CLUSTERDOWN meanwhile); a master the
        client cannot reach fails the probe too (and makes it learn the slots again). Then the tiny
        SET on each index's slot: the masters the index lives on take writes."""
        infos = await asyncio.gather(*(self._redis.cluster_info(target_nodes=node)
                                       for node in self._redis.get_primaries()))
        down = [info.get("cluster_state") for info in infos if info.get("cluster_state") != "ok"]
        if down or not infos:
            raise self._failed("refusing", StoreUnavailable(
                "session store unavailable: Redis refuses commands (cluster down: a slot range has no master)"))
        async with self._redis.pipeline(transaction=False) as pipe:
            for index in self._indexes:
                pipe.set(index.rpartition(":")[0] + ":probe", now_ms(), px=10_000)
            await pipe.execute()

    def _stamp(self, pipe: Any, session: str, create: bool) -> None:
        """Queues the session's activity stamp and the count after the write in `pipe` (a MULTI);
        a delete (`create` False) only refreshes a session that exists."""
        pipe.zadd(self._index, {self._member(session): now_ms()}, xx=not create)
        pipe.zcard(self._index)

    def _retention_args(self, session: str) -> list[Any]:
        """The trailing ARGV of the write scripts: stamp, member, and what making room needs."""
        return [now_ms(), self._member(session), self.namespace, self.max_sessions, EVICT_BATCH]

    def _counted(self, evicted: int, sessions: int) -> None:
        self.stats.evicted_over_max += int(evicted)
        self.stats.sessions = int(sessions)

    async def _evict_over_max(self) -> int:
        n, left = await self._evict_over_max_script(keys=[self._index],
                                                    args=[self.namespace, self.max_sessions, EVICT_BATCH])
        self._counted(n, left)
        return int(n)

    async def sweep(self) -> int:
        await self._ready()
        if self.cluster:
            return await self._sweep_sharded()
        evicted = 0
        with self._guard():
            if self.ttl_s > 0:
                cutoff = now_ms() - self.ttl_s * 1000
                while True:
                    n, left = await self._evict_idle_script(keys=[self._index],
                                                            args=[self.namespace, cutoff, EVICT_BATCH])
                    evicted += int(n)
                    self.stats.evicted_idle += int(n)
                    self.stats.sessions = int(left)
                    if n < EVICT_BATCH:
                        break
            if self.max_sessions:
                while await self._evict_over_max() == EVICT_BATCH:
                    pass
            else:
                self.stats.sessions = int(await self._redis.zcard(self._index))
        return evicted

    def _kv(self, session: str) -> str:
        return self._base(session) + ":kv"

    def _list(self, session: str, key: str) -> str:
        return f"{self._base(session)}:list:{key}"

    async def get(self, session: str, key: str) -> Any | None:
        await self._ready()
        with self._guard():
            raw = await self._redis.hget(self._kv(session), key)
            return json.loads(raw) if raw is not None else None

    async def put(self, session: str, key: str, value: Any | None) -> None:
        """One script: the write, the session's stamp and, for a new session, making room (on a
        cluster: the write in its slot, then the stamp, see `_stamp_sharded`)."""
        await self._ready()
        if self.cluster:
            now = now_ms()
            with self._guard():
                await self._put_session(keys=[self._kv(session), self._seen(session)],
                                        args=[key, b"" if value is None else _dumps(value), now])
            await self._stamp_sharded(session, now, create=value is not None)
            return
        with self._guard():
            evicted, sessions = await self._put(keys=[self._kv(session), self._index],
                                                args=[key, b"" if value is None else _dumps(value),
                                                      *self._retention_args(session)])
            self._counted(evicted, sessions)

    async def update(self, session: str, key: str, change: Callable[[Any | None], Any | None]) -> Any | None:
        """Optimistic transaction: WATCH the session's hash, read, MULTI/EXEC the write; when
        another writer (any replica) changed the hash meanwhile, EXEC fails and it is redone on the
        fresh value. Redis decides who wins, so no write is lost across replicas."""
        await self._ready()
        name = self._kv(session)
        result: list[Any] = [None]
        stamped = [0.0]

        async def attempt(pipe: Any) -> None:
            raw = await pipe.hget(name, key)
            value = result[0] = change(json.loads(raw) if raw is not None else None)
            pipe.multi()
            if value is None:
                pipe.hdel(name, key)
            else:
                pipe.hset(name, key, _dumps(value))
            if self.cluster:  # the session's slot only: the stamp in its index follows the EXEC
                stamped[0] = now_ms()
                pipe.set(self._seen(session), stamped[0], xx=value is None)
            else:
                self._stamp(pipe, session, create=value is not None)

        if self.cluster:
            with self._guard():
                await self._redis.transaction(attempt, name)
            await self._stamp_sharded(session, stamped[0], create=result[0] is not None)
            return result[0]
        with self._guard():
            _, created, sessions = await self._redis.transaction(attempt, name)
            self.stats.sessions = int(sessions)
            if created and self.max_sessions and sessions > self.max_sessions:
                await self._evict_over_max()  # the new session is the newest: never the one evicted
        return result[0]

    async def scan(self, session: str, prefix: str) -> dict[str, Any]:
        """HSCAN with a MATCH pattern: only matching fields cross the network, in sorted order."""
        await self._ready()
        with self._guard():
            pattern = prefix.translate(_GLOB_SPECIAL) + "*"
            found: dict[str, Any] = {}
            async for field, raw in self._redis.hscan_iter(self._kv(session), match=pattern, count=500):
                name = field.decode()
                if name.startswith(prefix):  # MATCH is a glob; the prefix test is the contract
                    found[name] = json.loads(raw)
            return dict(sorted(found.items()))

    async def append(self, session: str, key: str, value: Any, max_len: int = 10_000, max_bytes: int = 0) -> None:
        """One script (push, both bounds, the byte total, the stamp), so readers never see the
        list over its bounds and concurrent appends never lose a byte of the total. (On a
        cluster the stamp follows, see `_stamp_sharded`.)"""
        await self._ready()
        if self.cluster:
            now = now_ms()
            with self._guard():
                dropped = await self._append_session(
                    keys=[self._list(session, key), self._lists(session), self._seen(session)],
                    args=[_dumps(value), max_len, max_bytes, key, now])
                self.stats.history_dropped += int(dropped)
            await self._stamp_sharded(session, now, create=True)
            return
        with self._guard():
            dropped, evicted, sessions = await self._append(
                keys=[self._list(session, key), self._lists(session), self._index],
                args=[_dumps(value), max_len, max_bytes, key, *self._retention_args(session)])
            self.stats.history_dropped += int(dropped)
            self._counted(evicted, sessions)

    async def items(self, session: str, key: str, last: int = 0) -> list[Any]:
        await self._ready()
        with self._guard():
            start = -last if last > 0 else 0
            return [json.loads(v) for v in await self._redis.lrange(self._list(session, key), start, -1)]

    # ---- Redis Cluster: a sharded index, its stamps, eviction across the shards ------------------

    def _seen(self, session: str) -> str:
        return self._base(session) + ":seen"

    def _index_of(self, member: str) -> str:
        """The index of session `member`: a stable hash (the same in every replica and release)."""
        return self._indexes[zlib.crc32(member.encode()) % INDEX_SHARDS]

    async def _stamp_sharded(self, session: str, now: float, create: bool) -> None:
        """The write's second step: the session's stamp in its index (a delete only refreshes a
        session that is indexed). A session the stamp adds is new: room is made for it. The write
        is done by then, so a failure to make room is noted (health, log), not raised: the sweep
        enforces the bound again within `sweep_s`."""
        member = self._member(session)
        with self._guard():
            added = await self._redis.zadd(self._index_of(member), {member: now}, xx=not create)
        if not added:
            return
        with contextlib.suppress(StoreUnavailable, StoreFull):  # noted by the guard
            with self._guard():
                if self.max_sessions > 0:
                    evicted = await self._evict_over_max_sharded(keep=member)  # not `+= await`: a lost update
                    self.stats.evicted_over_max += evicted
                else:
                    self.stats.sessions = sum(await self._counts())

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
            with contextlib.suppress(*OUTAGE_ERRORS, *_CLUSTER_OUTAGE, ResponseError):
                await self._release(keys=[self._evict_lock], args=[token])

    async def _drop_taken(self, index: str, taken: Sequence[tuple[bytes, bytes]]) -> int:
        """Deletes the sessions this replica took out of `index` (member, score it had), each
        in its own slot, concurrently; one written after that score is kept and stamped again.
        Returns how many were deleted."""
        async def drop(member: bytes, score: bytes) -> int:
            m = member.decode()
            base = self._base_of(m)
            done = await self._drop_if_idle(keys=[base + ":kv", base + ":lists", base + ":seen"], args=[base, score])
            if int(done[0]) == 1:
                return 1
            await self._redis.zadd(index, {m: float(done[1])}, gt=True)  # written meanwhile: it stays
            return 0

        return sum(await asyncio.gather(*(drop(m, score) for m, score in taken)))

    async def _evict_over_max_sharded(self, keep: str | None = None) -> int:
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
                self.stats.sessions = total = sum(counts)
                want = min(total - self.max_sessions, EVICT_BATCH - evicted)
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
                self.stats.sessions = total - n
                if n == want:  # the surplus is gone (a writer racing it only added to the count)
                    break
        return evicted

    async def _sweep_sharded(self) -> int:
        """The sweep on a cluster: the idle over every index (each batch taken atomically from its
        index, so by one replica), then the bound across all of them; refreshes `stats.sessions`."""
        evicted = 0
        with self._guard():
            if self.ttl_s > 0:
                cutoff = now_ms() - self.ttl_s * 1000
                # counted first and then counted down, so the gauge is right as soon as a session is gone
                self.stats.sessions = sum(await self._counts())
                for index in self._indexes:
                    while True:
                        async with self._eviction_lock() as held:
                            if not held:
                                return evicted
                            t = await self._take_idle(keys=[index], args=[cutoff, EVICT_BATCH])
                            n = await self._drop_taken(index, list(zip(t[::2], t[1::2], strict=True)))
                        evicted += n
                        self.stats.evicted_idle += n
                        self.stats.sessions = max(0, self.stats.sessions - n)
                        if len(t) < 2 * EVICT_BATCH:
                            break
            if self.max_sessions:
                while (n := await self._evict_over_max_sharded()) > 0:
                    self.stats.evicted_over_max += n
                    if n < EVICT_BATCH:
                        break
            else:
                self.stats.sessions = sum(await self._counts())
        return evicted

    async def close(self) -> None:
        """Never raises (shutdown must end with 0): a client that fails to close is one log line."""
        await super().close()
        try:
            await self._redis.aclose()
        except Exception as exc:
            log.warning("session store (Redis) not closed cleanly", extra={"fields": {"error": _short(exc)}})

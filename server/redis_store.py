"""The session store on Redis, so several replicas share one state (SPEC.md §4).

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
Redis (what `make_client` connects to) allows; a Redis Cluster would need a per-slot index.
Data of an earlier version joins the index at its session's next write, and a list of it joins
its session's `lists` hash (so eviction deletes it) at its next append.

Faults are classified in `_guard`, the one place: unreachable, loading, read-only or unable to
persist is StoreUnavailable, out of memory (maxmemory with noeviction) StoreFull; both mark the
store unhealthy until `probe` (PING and a tiny SET) passes again.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

from redis.exceptions import BusyLoadingError, OutOfMemoryError, ReadOnlyError, ResponseError

from uibus.errors import StoreFull, StoreUnavailable
from uibus.redis_conn import OUTAGE_ERRORS, make_client
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
# Returns {entries dropped for bytes, sessions evicted, sessions stored}.
_APPEND = _EVICT_OVER + """
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
local evicted = 0
if redis.call('ZADD', KEYS[3], ARGV[5], ARGV[6]) == 1 and tonumber(ARGV[8]) > 0 then
  evicted = evict_over(KEYS[3], ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[6])
end
return {dropped, evicted, redis.call('ZCARD', KEYS[3])}
"""


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
                 sweep_s: float | None = None) -> None:
        super().__init__(ttl_s=ttl_s, max_sessions=max_sessions, sweep_s=sweep_s)
        self.url = url
        self.namespace = namespace
        self._redis = make_client(url, f"{namespace}-store")
        self._index = f"{namespace}:sessions"
        self._put = self._redis.register_script(_PUT)
        self._append = self._redis.register_script(_APPEND)
        self._evict_over_max_script = self._redis.register_script(_EVICT_OVER_MAX)
        self._evict_idle_script = self._redis.register_script(_EVICT_IDLE)
        self._full = False  # Redis refused a write for memory: the probe also wants room below the limit

    @staticmethod
    def _member(session: str) -> str:
        """The session as it appears in key names and in the index."""
        return quote(session, safe="")

    def _base(self, session: str) -> str:
        return f"{self.namespace}:{{{self._member(session)}}}"

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
        with self._guard():
            await self._redis.ping()
            await self._redis.set(f"{self.namespace}:probe", now_ms(), px=10_000)
            if self._full:
                try:
                    memory = await self._redis.info("memory")
                except ResponseError:  # INFO refused (an ACL): the SET above is all we can tell
                    memory = {}
                used, limit = int(memory.get("used_memory", 0)), int(memory.get("maxmemory", 0))
                if limit and used > limit * FULL_RECOVERED_BELOW:
                    raise self._failed("oom", StoreFull(OUT_OF_MEMORY))
                self._full = False

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
        with self._guard():
            raw = await self._redis.hget(self._kv(session), key)
            return json.loads(raw) if raw is not None else None

    async def put(self, session: str, key: str, value: Any | None) -> None:
        """One script: the write, the session's stamp and, for a new session, making room."""
        with self._guard():
            evicted, sessions = await self._put(keys=[self._kv(session), self._index],
                                                args=[key, b"" if value is None else _dumps(value),
                                                      *self._retention_args(session)])
            self._counted(evicted, sessions)

    async def update(self, session: str, key: str, change: Callable[[Any | None], Any | None]) -> Any | None:
        """Optimistic transaction: WATCH the session's hash, read, MULTI/EXEC the write; when
        another writer (any replica) changed the hash meanwhile, EXEC fails and it is redone on the
        fresh value. Redis decides who wins, so no write is lost across replicas."""
        name = self._kv(session)
        result: list[Any] = [None]

        async def attempt(pipe: Any) -> None:
            raw = await pipe.hget(name, key)
            value = result[0] = change(json.loads(raw) if raw is not None else None)
            pipe.multi()
            if value is None:
                pipe.hdel(name, key)
            else:
                pipe.hset(name, key, _dumps(value))
            self._stamp(pipe, session, create=value is not None)

        with self._guard():
            _, created, sessions = await self._redis.transaction(attempt, name)
            self.stats.sessions = int(sessions)
            if created and self.max_sessions and sessions > self.max_sessions:
                await self._evict_over_max()  # the new session is the newest: never the one evicted
        return result[0]

    async def scan(self, session: str, prefix: str) -> dict[str, Any]:
        """HSCAN with a MATCH pattern: only matching fields cross the network, in sorted order."""
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
        list over its bounds and concurrent appends never lose a byte of the total."""
        with self._guard():
            dropped, evicted, sessions = await self._append(
                keys=[self._list(session, key), self._lists(session), self._index],
                args=[_dumps(value), max_len, max_bytes, key, *self._retention_args(session)])
            self.stats.history_dropped += int(dropped)
            self._counted(evicted, sessions)

    async def items(self, session: str, key: str, last: int = 0) -> list[Any]:
        with self._guard():
            start = -last if last > 0 else 0
            return [json.loads(v) for v in await self._redis.lrange(self._list(session, key), start, -1)]

    async def close(self) -> None:
        """Never raises (shutdown must end with 0): a client that fails to close is one log line."""
        await super().close()
        try:
            await self._redis.aclose()
        except Exception as exc:
            log.warning("session store (Redis) not closed cleanly", extra={"fields": {"error": _short(exc)}})

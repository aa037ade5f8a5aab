"""The session store on Redis, so several replicas share one state (docs/scaling.md): one server,
a master set behind sentinels (both: `make_client` hands out a plain client) or a Redis Cluster.

Layout, for a session `s` (percent-quoted so it contains no ':' or braces):
  `uibus:{s}:kv`          hash: store key -> JSON value
  `uibus:{s}:list:<key>`  list of JSON values, oldest first, trimmed to the newest `max_len`
  `uibus:{s}:lists`       hash: list key -> byte total of that list (every list of the session)
The `{s}` braces are a Redis Cluster hash tag: all keys of one session live in one slot. No
operation uses KEYS or SCAN: eviction finds a session's lists in its `lists` hash.

Which sessions exist and how long each was idle is the session index, kept by one of two
strategies chosen once, at construction: `SingleIndex` (uibus.infra.redis.index_single: one sorted set,
each write and its stamp one script) for one server or a sentinel-followed master, `ClusterIndex`
(uibus.infra.redis.index_cluster: sharded sorted sets, a write then its stamp, an eviction lock) for a
Redis Cluster, where one script may touch one slot only. Reads (get, scan, items) need no index
and are the same on both; the Lua scripts are in uibus.infra.redis.scripts.

Faults are classified in `guard`, the one place: unreachable (a cluster with a slot range
without a master too), loading, read-only or unable to persist is StoreUnavailable, out of memory
(maxmemory with noeviction) StoreFull; both mark the store unhealthy until `probe` (PING and a
tiny SET; on a cluster CLUSTER INFO on every master too) passes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import unquote

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    BusyLoadingError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
)

from uibus.infra.errors import StoreFull, StoreUnavailable
from uibus.infra.redis.conn import CLUSTER_OUTAGE, OUTAGE_ERRORS, SlotMap, make_client
from uibus.infra.redis.index_cluster import EMPTY_TAG, ClusterIndex
from uibus.infra.redis.index_single import SingleIndex
from uibus.infra.redis.keys import Keys, dumps
from uibus.infra.redis.leases import RedisLeases
from uibus.infra.redis.scripts import LOG_APPEND
from uibus.infra.store import LOG_HEAD_KEY, Lease, LogEntry, LogRead, LogRetention, Store, now_ms
from uibus.infra.telemetry.spans import store_op

log = logging.getLogger("uibus.infra.store")

_GLOB_SPECIAL = str.maketrans({c: "\\" + c for c in "*?[]\\"})

# Replies of a Redis that is up but refuses commands for a while (unavailable, not our bug), in words.
_REFUSING = {"LOADING": "loading its data", "READONLY": "a read-only replica", "MISCONF": "cannot persist to disk",
             "MASTERDOWN": "its primary is down", "TRYAGAIN": "cluster busy", "CLUSTERDOWN": "cluster down"}
# After "out of memory", the store counts as recovered only below this share of maxmemory: a Redis
# at its limit takes a tiny SET but refuses the next real write, and health must not flap with it.
FULL_RECOVERED_BELOW = 0.95
# One wording for every "out of memory" (Redis words it differently inside a MULTI, with key names).
OUT_OF_MEMORY = "session store is full: Redis out of memory (used memory > maxmemory)"


def short(exc: BaseException) -> str:
    """Redis's message without the script it came from (a digest and line number say nothing)."""
    return str(exc).split(" script: ", 1)[0].rstrip(".") or type(exc).__name__


_T = TypeVar("_T")


def keeps_cancel(op: Callable[..., Awaitable[_T]]) -> Callable[..., Awaitable[_T]]:
    """Re-raises a cancel that reached the caller during the operation but did not come out of it.

    With a socket timeout, redis-py sends each command through `asyncio.wait_for`, which on Python
    3.11 loses a cancel that arrives as the send completes (CPython gh-86296, fixed in 3.12): the
    caller's task comes back with its cancel requested and no CancelledError, and goes on as if
    nobody had left (seen: a dialog opened for a caller that was gone). Counted against the task's
    cancel requests at the start, so a task already being cancelled (a teardown writing its last
    state) is not cut short by its own earlier cancel."""

    @functools.wraps(op)
    async def kept(*args: Any, **kw: Any) -> _T:
        task = asyncio.current_task()
        before = task.cancelling() if task is not None else 0
        result = await op(*args, **kw)
        if task is not None and task.cancelling() > before:
            raise asyncio.CancelledError
        return result
    return kept


class RedisStore(Store):
    """Same semantics as SqliteStore; one client (and its pool) for the life of the store. The
    writes that stamp the session index go to the index strategy (`_sessions`)."""

    def __init__(self, url: str, namespace: str = "uibus", *, ttl_s: float = 0, max_sessions: int = 0,
                 sweep_s: float | None = None, cluster: bool = False) -> None:
        """`cluster`: `url` names a node of a Redis Cluster, and the cluster's layout
        (uibus.infra.redis.index_cluster) is used; else one server (or the master behind the sentinels
        of a `redis+sentinel://` URL) with the single index."""
        super().__init__(ttl_s=ttl_s, max_sessions=max_sessions, sweep_s=sweep_s)
        self.url = url
        self.namespace = namespace
        self.cluster = cluster
        self.redis: Any = make_client(url, f"{namespace}-store", cluster=cluster)
        self.keys = Keys(namespace, EMPTY_TAG if cluster else "")
        self._full = False  # Redis refused a write for memory: the probe also wants room below the limit
        self._slots = SlotMap(self.redis) if isinstance(self.redis, RedisCluster) else None
        # The session index, chosen once: every write that stamps a session goes through it.
        self._sessions: SingleIndex | ClusterIndex = ClusterIndex(self) if cluster else SingleIndex(self)
        self._lease_steps = RedisLeases(self.redis, self.keys)  # agent ownership (uibus.infra.redis.leases)
        self._log_append = self.redis.register_script(LOG_APPEND)

    async def _ready(self) -> None:
        """On a cluster, the first learning of the slots, once (uibus.infra.redis.conn.SlotMap: several
        first commands at once race). Later relearning (after MOVED or a dead node) is the client's
        own business."""
        if self._slots is not None and not self._slots.learned:
            with self.guard():
                await self._slots.learn()

    # ---- faults -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
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
                f"session store unavailable: Redis unreachable ({short(exc)})")) from exc
        except CLUSTER_OUTAGE as exc:
            raise self._failed("unreachable", StoreUnavailable(
                f"session store unavailable: Redis Cluster has no master for a slot ({short(exc)})")) from exc
        except RedisClusterException as exc:  # no node reachable to learn the slots from; else our bug
            if "connect" not in str(exc):
                raise
            raise self._failed("unreachable", StoreUnavailable(
                f"session store unavailable: Redis Cluster unreachable ({short(exc)})")) from exc
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
        refuses the SET, and that must keep the store unhealthy (on a cluster the index strategy
        checks every master). After "out of memory", also used_memory below FULL_RECOVERED_BELOW
        of maxmemory (when INFO is allowed)."""
        await self._ready()
        with self.guard():
            await self.redis.ping()
            await self._sessions.probe()
            if self._full:
                try:
                    memories = await self._sessions.memory()
                except ResponseError:  # INFO refused (an ACL): the SET above is all we can tell
                    memories = []
                for memory in memories:
                    used, limit = int(memory.get("used_memory", 0)), int(memory.get("maxmemory", 0))
                    if limit and used > limit * FULL_RECOVERED_BELOW:
                        raise self._failed("oom", StoreFull(OUT_OF_MEMORY))
                self._full = False

    # ---- the operations -----------------------------------------------------------------------

    async def sweep(self) -> int:
        await self._ready()
        return await self._sessions.sweep()

    @keeps_cancel
    async def sessions(self) -> list[tuple[str, float]]:
        """ZRANGE of the index (each index on a cluster), merged, most recent first."""
        await self._ready()
        found: list[tuple[str, float]] = []
        with self.guard():
            for index in self._sessions.index_keys():
                for member, score in await self.redis.zrange(index, 0, -1, withscores=True):
                    found.append((unquote(member.decode()), float(score)))
        return sorted(found, key=lambda item: -item[1])

    @keeps_cancel
    async def drop_session(self, session: str) -> bool:
        """Deletes the session's keys (each list its `lists` hash names, the values, the cluster's
        `seen`), then its index entry. Not one step: a write racing the delete may leave a key the
        TTL sweep deletes later, as with any session that is written to after it was deleted."""
        await self._ready()
        keys = self.keys
        base = keys.base(session)
        member = keys.member(session)
        with self.guard():
            lists = [k.decode() for k in await self.redis.hkeys(keys.lists(session))]
            await self.redis.delete(*(keys.list(session, k) for k in lists), keys.kv(session), keys.lists(session),
                                    base + ":seen", keys.log(session), keys.log_index(session))
            removed = 0
            for index in self._sessions.index_keys():
                removed += int(await self.redis.zrem(index, member))
        return removed > 0

    @store_op("get")
    @keeps_cancel
    async def get(self, session: str, key: str) -> Any | None:
        await self._ready()
        with self.guard():
            raw = await self.redis.hget(self.keys.kv(session), key)
            return json.loads(raw) if raw is not None else None

    @store_op("put")
    @keeps_cancel
    async def put(self, session: str, key: str, value: Any | None) -> None:
        await self._ready()
        await self._sessions.put(session, key, b"" if value is None else dumps(value))

    @store_op("update")
    @keeps_cancel
    async def update(self, session: str, key: str, change: Callable[[Any | None], Any | None]) -> Any | None:
        """Optimistic transaction (`watched`), the session's stamp by the index strategy."""
        await self._ready()
        return await self._sessions.update(session, key, change)

    async def watched(self, session: str, key: str, change: Callable[[Any | None], Any | None],
                      stamp: Callable[[Any, bool], None]) -> tuple[Any | None, list[Any]]:
        """WATCH the session's hash, read, MULTI/EXEC the write with what `stamp(pipe, create)`
        queues after it; when another writer (any replica) changed the hash meanwhile, EXEC fails
        and it is redone on the fresh value. Redis decides who wins, so no write is lost across
        replicas. Returns the value written and EXEC's replies."""
        name = self.keys.kv(session)
        result: list[Any] = [None]

        async def attempt(pipe: Any) -> None:
            raw = await pipe.hget(name, key)
            value = result[0] = change(json.loads(raw) if raw is not None else None)
            pipe.multi()
            if value is None:
                pipe.hdel(name, key)
            else:
                pipe.hset(name, key, dumps(value))
            stamp(pipe, value is not None)

        with self.guard():
            replies = await self.redis.transaction(attempt, name)
        return result[0], replies

    @store_op("scan")
    @keeps_cancel
    async def scan(self, session: str, prefix: str) -> dict[str, Any]:
        """HSCAN with a MATCH pattern: only matching fields cross the network, in sorted order."""
        await self._ready()
        with self.guard():
            pattern = prefix.translate(_GLOB_SPECIAL) + "*"
            found: dict[str, Any] = {}
            async for field, raw in self.redis.hscan_iter(self.keys.kv(session), match=pattern, count=500):
                name = field.decode()
                if name.startswith(prefix):  # MATCH is a glob; the prefix test is the contract
                    found[name] = json.loads(raw)
            return dict(sorted(found.items()))

    @store_op("append")
    @keeps_cancel
    async def append(self, session: str, key: str, value: Any, max_len: int = 10_000, max_bytes: int = 0) -> None:
        """One script (push, both bounds, the byte total, the stamp), so readers never see the
        list over its bounds and concurrent appends never lose a byte of the total. (On a
        cluster the stamp follows, see ClusterIndex.)"""
        await self._ready()
        await self._sessions.append(session, key, dumps(value), max_len, max_bytes)

    @store_op("items")
    @keeps_cancel
    async def items(self, session: str, key: str, last: int = 0) -> list[Any]:
        await self._ready()
        with self.guard():
            start = -last if last > 0 else 0
            return [json.loads(v) for v in await self.redis.lrange(self.keys.list(session, key), start, -1)]

    # ---- the session log: a Stream per session in the session's slot (uibus.infra.redis.scripts.LOG_APPEND) --

    @keeps_cancel
    async def log_append(self, session: str, entries: list[LogEntry], keep: LogRetention) -> None:
        """One script for the batch (replacing each (kind, key), then retention), then the
        session's activity stamp through the index strategy, as any write of the session."""
        await self._ready()
        cutoff = now_ms() - keep.max_age_s * 1000 if keep.max_age_s > 0 else -1
        args: list[Any] = [keep.max_entries, keep.max_bytes, int(cutoff), len(entries)]
        for e in entries:
            args += [e.seq, e.kind, e.key, e.epoch, int(e.at), e.data]
        with self.guard():
            head = await self._log_append(keys=[self.keys.log(session), self.keys.log_index(session)], args=args)
        await self._sessions.put(session, LOG_HEAD_KEY, dumps(int(head)))

    @keeps_cancel
    async def log_read(self, session: str, after: int = 0, *, kind: str = "", last: int = 0) -> LogRead:
        await self._ready()
        name = self.keys.log(session)
        with self.guard():
            floor = await self.redis.hget(self.keys.log_index(session), "_floor")
            if last > 0:
                rows = list(reversed(await self.redis.xrevrange(name, "+", f"({after}-0" if after else "-",
                                                                 count=last)))
            else:
                rows = await self.redis.xrange(name, f"({after}-0" if after else "-", "+")
        entries = []
        for rid, fields in rows:
            entry = LogEntry(int(rid.split(b"-")[0]), fields[b"k"].decode(), fields[b"y"].decode(),
                             int(fields[b"e"]), float(fields[b"a"]), bytes(fields[b"d"]))
            if not kind or entry.kind == kind:
                entries.append(entry)
        return LogRead(entries, int(floor) if floor is not None else 0)

    # ---- leases (uibus.infra.redis.leases): atomic on the server, shared by every replica ---------------

    @keeps_cancel
    async def take_lease(self, session: str, name: str, owner: str, ttl_s: float) -> Lease:
        await self._ready()
        with self.guard():
            return await self._lease_steps.take(session, name, owner, ttl_s)

    @keeps_cancel
    async def renew_lease(self, session: str, name: str, owner: str, token: int, ttl_s: float) -> bool:
        await self._ready()
        with self.guard():
            return await self._lease_steps.renew(session, name, owner, token, ttl_s)

    @keeps_cancel
    async def drop_lease(self, session: str, name: str, owner: str, token: int) -> None:
        await self._ready()
        with self.guard():
            await self._lease_steps.drop(session, name, owner, token)

    async def close(self) -> None:
        """Never raises (shutdown must end with 0): a client that fails to close is one log line."""
        await super().close()
        try:
            await self.redis.aclose()
        except Exception as exc:
            log.warning("session store (Redis) not closed cleanly", extra={"fields": {"error": short(exc)}})

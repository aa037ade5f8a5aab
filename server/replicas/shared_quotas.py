"""Per-tenant quotas that hold across replicas: a tenant's N replicas together hold ONE quota.

`uibus.infra.quotas.Quotas` counts in one process, so with N replicas a tenant would hold N × each
quota. With a Redis URL the app uses `SharedQuotas` instead (uibus.replicas.quota_sharing); every door still asks the
same `hold` / `tick` / `take`, and nothing in the domain or the edge knows which one it got.

* **Rate quotas** (`sessions_per_minute`) are exact: `take` runs one Lua script (RATE) on a sorted set
  per quota and tenant, a sliding minute of Redis's own clock: trim what is older than 60 s, refuse
  when the rest is at the limit, else add this one. One round trip, only when a session is created.
* **Held quotas** (streams, watches, dialogs, connections, MCP tasks) stay a synchronous, local check:
  this replica's own count (exact, in memory) plus the other replicas' counts as last read. Each
  replica writes what it holds, by quota and tenant, to a hash of its own (HELD: one round trip that
  also reads everyone else's), whenever its count changes (coalesced: at most every MIN_GAP_S) and at
  least every REFRESH_S. The hash expires TTL_S after its last write and the replica's registry entry
  is dropped then, so a crashed replica's leases stop counting within TTL_S; a replica that stops
  cleanly deletes its hash at once.

  The bound (docs/security/quotas.md): a lease taken on one replica reaches the others within one
  round trip plus MIN_GAP_S of being taken, and each of them reads it at its next exchange (at most
  REFRESH_S later). So a tenant holds at most its limit plus what it opened on the *other* replicas
  within the last ~REFRESH_S + MIN_GAP_S (a synchronised burst on N replicas in that window: up to
  N × the limit, for that moment); once the counts are read, new holds are refused until it is back
  under its limit. In steady state the limit is exact.

When Redis is unreachable nothing is refused because of it: held quotas go on with the other
replicas' last counts until they are TTL_S old, then count this replica alone; `take` falls back to
this replica's own sliding minute (`Quotas.tick`). Both say so once in the log (a warning), and
once again when Redis is back. During an outage a tenant can therefore hold up to N × a quota.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from redis.exceptions import RedisError

from uibus.infra.quotas import WINDOW_S, Quotas
from uibus.infra.redis.conn import CLUSTER_OUTAGE, OUTAGE_ERRORS, make_client

log = logging.getLogger("uibus.quotas")

__all__ = ["SharedQuotas"]

REFRESH_S = 0.5  # the longest between two exchanges of held counts (the heartbeat)
MIN_GAP_S = 0.05  # changes within this of the last exchange wait for the next (one write for a burst)
TTL_S = 5.0  # a replica's held counts expire this long after its last exchange (a crash frees them then)
TAKE_WAIT_S = 1.0  # the longest a rate quota's round trip may take before this replica counts alone
TAG = "{uibus-quotas}"  # one cluster slot for every key a script touches
REGISTRY = f"uibus:quotas:{TAG}:replicas"  # sorted set: replica id -> its last exchange (ms, Redis's clock)
HELD_PREFIX = f"uibus:quotas:{TAG}:held:"  # + replica id: hash "quota\ttenant" -> count
RATE_PREFIX = f"uibus:quotas:{TAG}:rate:"  # + quota:tenant: sorted set of stamps (ms)

# KEYS: the registry, this replica's hash. ARGV: replica id, ttl_ms, then field, count pairs (what it
# holds now). Replaces its hash, stamps it, drops replicas not heard of within ttl, and returns the
# others' hashes as {replica, {field, count, …}, …}.
HELD = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('DEL', KEYS[2])
for i = 3, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[1], ttl * 4)
local prefix = string.sub(KEYS[2], 1, #KEYS[2] - #ARGV[1])
local out = {}
for _, r in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if r ~= ARGV[1] then
    out[#out + 1] = r
    out[#out + 1] = redis.call('HGETALL', prefix .. r)
  end
end
return out
"""

# KEYS: the tenant's window of one rate quota. ARGV: limit, window_ms, a unique member. 1: counted; 0: full.
RATE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

_OUTAGE = (*OUTAGE_ERRORS, *CLUSTER_OUTAGE, TimeoutError)


class SharedQuotas(Quotas):
    """`Quotas` whose counts are a tenant's across every replica on one Redis (module docstring).
    An async context manager: entering starts the exchange of held counts, leaving deletes this
    replica's counts and closes its Redis client."""

    def __init__(self, limits: Mapping[str, int] | None, url: str, replica: str, *, cluster: bool = False,
                 refresh_s: float = REFRESH_S, ttl_s: float = TTL_S) -> None:
        super().__init__(limits)
        self.replica = replica
        self.refresh_s = refresh_s
        self.ttl_s = ttl_s
        self._client = make_client(url, "uibus-quotas", cluster=cluster)
        self._held_script: Any = self._client.register_script(HELD)
        self._rate_script: Any = self._client.register_script(RATE)
        self._key = HELD_PREFIX + replica
        self._others: dict[tuple[str, str], int] = {}  # (quota, tenant) -> the other replicas' sum
        self._read_at = 0.0  # monotonic time of the last successful exchange
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._seq = itertools.count()
        self.exchanges = 0  # successful exchanges (tests wait on it)
        self._down: set[str] = set()  # what is in fallback now ("held", "rate"): warned once each

    # ---- the checks (synchronous for held quotas: nothing waits on Redis) ----

    def in_use(self, quota: str, tenant: str) -> int:
        """What the tenant holds on every replica: this one's exact count plus the others' as last read
        (dropped once older than the TTL: then this replica counts alone)."""
        mine = self._held.get((quota, tenant), 0)
        if not self._others or time.monotonic() - self._read_at > self.ttl_s:
            return mine
        return mine + self._others.get((quota, tenant), 0)

    def others(self, quota: str, tenant: str) -> int:
        """The other replicas' count as last read (tests, /metrics readers)."""
        return self._others.get((quota, tenant), 0)

    def hold(self, quota: str, tenant: str) -> Any:
        lease = super().hold(quota, tenant)
        self._changed.set()
        return lease

    def _give_back(self, key: tuple[str, str]) -> None:
        super()._give_back(key)
        self._changed.set()

    async def take(self, quota: str, tenant: str) -> None:
        """One more of a rate quota, counted in Redis (exact across replicas); this replica's own
        count when Redis does not answer within TAKE_WAIT_S."""
        limit = self.limits[quota]
        if not limit:
            return
        key = f"{RATE_PREFIX}{quota}:{quote(tenant, safe='')}"
        try:
            async with asyncio.timeout(TAKE_WAIT_S):
                taken = await self._rate_script(keys=[key], args=[limit, int(WINDOW_S * 1000),
                                                                  f"{self.replica}:{next(self._seq)}"])
        except (*_OUTAGE, RedisError) as exc:
            self._fallback("rate", exc)
            self.tick(quota, tenant)
            return
        self._back("rate")
        if not taken:
            raise self.refuse(quota, tenant, " in the last minute (on every replica together)")

    # ---- the exchange of held counts ----

    async def __aenter__(self) -> SharedQuotas:
        await self._exchange_logged()  # the others' counts before the first call is served
        self._task = asyncio.create_task(self._run(), name="uibus-shared-quotas")
        return self

    async def __aexit__(self, *exc: object) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        try:  # what this replica held stops counting now, not TTL_S later
            async with asyncio.timeout(TAKE_WAIT_S):
                await self._client.delete(self._key)
                await self._client.zrem(REGISTRY, self.replica)
        except (*_OUTAGE, RedisError) as exc:
            log.debug("shared quota counts left to expire", extra={"fields": {"error": repr(exc)}})
        finally:
            await self._client.aclose()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.refresh_s):
                    await self._changed.wait()
            await asyncio.sleep(MIN_GAP_S)  # a burst of changes: one write
            await self._exchange_logged()

    async def _exchange_logged(self) -> None:
        try:
            async with asyncio.timeout(max(self.refresh_s, TAKE_WAIT_S)):
                await self.exchange()
        except (*_OUTAGE, RedisError) as exc:
            self._fallback("held", exc)

    async def exchange(self) -> None:
        """Writes what this replica holds and reads what the others hold: one round trip."""
        self._changed.clear()
        args: list[Any] = [self.replica, int(self.ttl_s * 1000)]
        for (quota, tenant), n in self._held.items():
            args += (f"{quota}\t{tenant}", n)
        reply = await self._held_script(keys=[REGISTRY, self._key], args=args)
        others: dict[tuple[str, str], int] = {}
        for fields in reply[1::2]:
            for field, n in zip(fields[::2], fields[1::2], strict=True):
                quota, _, tenant = field.decode().partition("\t")
                others[(quota, tenant)] = others.get((quota, tenant), 0) + int(n)
        self._others = others
        self._read_at = time.monotonic()
        self.exchanges += 1
        self._back("held")

    def _fallback(self, what: str, exc: BaseException) -> None:
        if what not in self._down:
            self._down.add(what)
            log.warning("Redis unreachable: quotas are counted by this replica alone until it is back "
                        "(a tenant can hold up to one quota per replica meanwhile)",
                        extra={"fields": {"quotas": what, "error": f"{type(exc).__name__}: {exc}"[:300]}})

    def _back(self, what: str) -> None:
        if what in self._down:
            self._down.discard(what)
            log.warning("Redis reachable again: quotas are counted across replicas", extra={"fields": {"quotas": what}})

"""Fair shares of the service between tenants: a per-tenant call rate and a per-tenant limit on calls in flight.

uibus serves every tenant on one event loop (and a couple of cores), so a tenant that keeps many unary
calls coming, each within its other quotas, takes the CPU every other tenant's calls wait for. The
pipeline's unary wrapper asks `Admission.take` right after it admitted a call (the caller's tenant is
the grant's: `Grant.tenant`, or `anonymous` without tokens), one step of two parts:

1. **Its rate** (`--quota-calls-per-second`, `Rate`): a token bucket per tenant, refilled at the rate and
   holding BURST_S of it (a tenant that was quiet may make that many calls at once: 80 at the default
   rate). Not more: a burst is served at the full speed of the loop, so every other tenant's calls wait
   behind it; a second's worth (800) took ~0.2 s, long enough to be another tenant's p99. A call
   that finds a token goes on (the fast path: a clock read and some float arithmetic, no await); one
   that finds none *reserves* the next free one and sleeps until then, so a closed-loop client is slowed
   to its rate and its parked calls cost the loop a timer each. Only a call that would wait more than
   MAX_WAIT_S, or find MAX_WAITERS of its tenant already waiting, is refused: RESOURCE_EXHAUSTED from
   `uibus.infra.quotas` (the quota `calls_per_second`, its limit and its option; counted on /metrics as
   `uibus_quota_refused_total{quota="calls_per_second"}`; a call that waited, on `uibus_quota_waited_total`).
   A caller that goes away while it waits gives its reserved token back. The rate is what bounds a
   tenant's share of the CPU: a call costs about the same wherever it waits, so calls per second is CPU
   per second. It applies only when tokens are configured: without them every caller is the one
   tenant `anonymous` and there is nobody to share with.
   The bucket is per replica (a Redis round trip per call would cost more than the call): with N
   replicas a tenant may make N × its rate in all, each replica still keeping its own share for others.
2. **Its calls in flight** (`--tenant-concurrency`, the slots): a tenant with fewer than `limit` calls
   running goes on at once (one dict read and write); past it, the call waits in its tenant's own FIFO
   until one of that tenant's calls ends; with `queue` already waiting it is refused (TenantBusy). This
   bounds how many of a tenant's slow calls (a store write, an agent's reply) hold resources at once,
   which a rate does not.

bench/fairness.py measures both (docs/security/quotas.md, "Fair shares"): the slots alone halve what a
busy tenant adds to another's latency, but do not bound its share of the CPU; the rate does.

Dialog calls (WAITING) are not admitted here: they wait for a person, held by the `dialogs` quota; nor is
the health check (a probe must never wait behind a tenant). Streams are not either: they are held (the
`streams` quota), and a stream's messages are not calls. Both parts off (`--tenant-concurrency 0`, and
`--quota-calls-per-second 0` or no tokens) means no Admission at all: the pipeline then pays nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from uibus.infra.errors import ResourceExhausted
from uibus.infra.quotas import Quotas

QUEUE_PER_CALL = 16  # calls of one tenant that may wait, per call it may run (bounded: memory, latency)
DEFAULT_LIMIT = 16  # --tenant-concurrency: above the unary concurrency one client usually has (grpc-js: 1-10)
BURST_S = 0.1  # a tenant's bucket holds this many seconds of its rate (bench/fairness.py --head-start 0)
MAX_WAIT_S = 1.0  # the longest a call waits for its token; past it, refused
MAX_WAITERS = 1024  # calls of one tenant waiting for a token at once (bounded: memory); past it, refused
RATE_QUOTA = "calls_per_second"  # its name in uibus.infra.quotas (the refusal, the option, /metrics)

# Calls that wait for a person, not for the loop: held under the `dialogs` quota instead (else a tenant's
# open dialogs would take its slots and hold up its other calls for as long as nobody answers).
WAITING = frozenset(f"/uibus.v1.ExtensionUiService/{name}" for name in ("Select", "Confirm", "Input", "Editor"))
EXEMPT = WAITING | {"/grpc.health.v1.Health/Check"}  # and probes: never behind a tenant


class TenantBusy(ResourceExhausted):
    """A tenant's wait queue is full (RESOURCE_EXHAUSTED)."""


class _Bucket:
    __slots__ = ("stamp", "tokens", "waiting")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens  # below 1: none free; below 0: reserved by waiting calls
        self.stamp = stamp
        self.waiting = 0


class Rate:
    """A token bucket per tenant: `per_second` refill, `burst_s` of it held; a call without a token
    waits for the next free one (at most `max_wait_s`, at most `max_waiters` at once), else is refused
    by `quotas` (module docstring, part 1)."""

    def __init__(self, per_second: float, quotas: Quotas, *, burst_s: float = BURST_S,
                 max_wait_s: float = MAX_WAIT_S, max_waiters: int = MAX_WAITERS) -> None:
        if per_second <= 0:
            raise ValueError("per_second must be positive (0 turns the rate off: no Rate at all)")
        self.per_second = per_second
        self.capacity = max(1.0, per_second * burst_s)
        self.max_wait_s = max_wait_s
        self.max_waiters = max_waiters
        self.quotas = quotas
        self._buckets: dict[str, _Bucket] = {}
        self.waited = 0  # calls that waited for their token (bench, tests)

    def waiting(self, tenant: str) -> int:
        bucket = self._buckets.get(tenant)
        return bucket.waiting if bucket is not None else 0

    def reserve(self, tenant: str) -> float:
        """Takes the tenant's next token: 0.0 when it is free now, else the seconds until it is (the
        caller must `wait` them); QuotaExceeded when that is past the bounds."""
        now = time.monotonic()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            if len(self._buckets) >= 4096:
                self._forget(now)
            bucket = self._buckets[tenant] = _Bucket(self.capacity, now)
        else:
            tokens = bucket.tokens + (now - bucket.stamp) * self.per_second
            bucket.tokens = tokens if tokens < self.capacity else self.capacity
            bucket.stamp = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        delay = (1.0 - bucket.tokens) / self.per_second
        if delay > self.max_wait_s or bucket.waiting >= self.max_waiters:
            raise self.quotas.refuse(RATE_QUOTA, tenant, f", and {bucket.waiting} of its calls already wait "
                                     f"(at most {self.max_wait_s:g} s each) for their turn")
        bucket.tokens -= 1.0
        bucket.waiting += 1
        self.waited += 1
        self.quotas.slowed(RATE_QUOTA, tenant)
        return delay

    async def wait(self, tenant: str, delay: float) -> None:
        """Sleeps until the token `reserve` promised. Cancelled meanwhile (the caller went away): the
        token goes back to the bucket, and the cancel goes on."""
        bucket = self._buckets[tenant]
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            bucket.tokens += 1.0
            raise
        finally:
            bucket.waiting -= 1

    def _forget(self, now: float) -> None:
        """Drops the buckets that are full again and have nobody waiting (they would be made anew as
        they are): the map stays as big as the tenants active within the last second or so."""
        for tenant, bucket in list(self._buckets.items()):
            if not bucket.waiting and bucket.tokens + (now - bucket.stamp) * self.per_second >= self.capacity:
                del self._buckets[tenant]


class Admission:
    """A tenant's unary calls: at most `rate` of them per second (waiting for their token; None: no rate),
    then at most `limit` running (0: no limit) and at most `queue` more waiting for a slot (FIFO)."""

    def __init__(self, limit: int = DEFAULT_LIMIT, queue: int | None = None, rate: Rate | None = None) -> None:
        if limit < 0:
            raise ValueError("limit must be 0 (no limit on calls in flight) or more")
        self.limit = limit
        self.queue = QUEUE_PER_CALL * limit if queue is None else queue
        self.rate = rate
        self._running: dict[str, int] = {}
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self.waited = 0  # calls that waited for their turn (bench, tests)
        self.refused = 0  # calls refused with a full queue

    def covers(self, method: str) -> bool:
        """Whether calls of `method` are admitted here (every unary method but those that wait for a person,
        and the health check)."""
        return method not in EXEMPT

    def running(self, tenant: str) -> int:
        return self._running.get(tenant, 0)

    def waiting(self, tenant: str) -> int:
        return len(self._waiting.get(tenant, ()))

    def enter(self, tenant: str) -> asyncio.Future[None] | None:
        """Takes one of the tenant's slots: None when it has one now (go on), a future to await
        (`wait`) when it must wait; TenantBusy when its queue is full. Pair with `leave`."""
        running = self._running.get(tenant, 0)
        if running < self.limit:
            self._running[tenant] = running + 1
            return None
        waiting = self._waiting.get(tenant)
        if waiting is None:
            waiting = self._waiting[tenant] = deque()
        if len(waiting) >= self.queue:
            self.refused += 1
            raise TenantBusy(f"tenant {tenant!r} has {running} unary calls running and {len(waiting)} waiting, its "
                             f"limit (option --tenant-concurrency {self.limit}, {self.queue} may wait): retry "
                             "when some have ended; other tenants are not affected")
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting.append(turn)
        self.waited += 1
        return turn

    async def take(self, tenant: str) -> str:
        """The one admission step: the tenant's token (waiting for it when it must), then its slot (the
        same); the tenant, for `leave`. The token comes first, so a call waiting for it holds no slot."""
        rate = self.rate
        if rate is not None:
            delay = rate.reserve(tenant)
            if delay:
                await rate.wait(tenant, delay)
        if self.limit:
            turn = self.enter(tenant)
            if turn is not None:
                await self.wait(tenant, turn)
        return tenant

    async def wait(self, tenant: str, turn: asyncio.Future[None]) -> None:
        """Waits for the slot `enter` promised. Cancelled meanwhile (the caller went away): the slot,
        if it was already handed over, goes to the next one, and the cancel goes on."""
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.leave(tenant)
            else:
                turn.cancel()
                waiting = self._waiting.get(tenant)
                if waiting is not None and not waiting:
                    del self._waiting[tenant]
            raise

    def leave(self, tenant: str) -> None:
        """Gives back a slot `take` took: to the tenant's next waiting call, if any."""
        if not self.limit:
            return
        waiting = self._waiting.get(tenant)
        while waiting:
            turn = waiting.popleft()
            if not turn.done():  # a waiter whose caller went away is skipped
                turn.set_result(None)  # the slot passes to it: the running count stays
                return
        if waiting is not None:
            del self._waiting[tenant]
        running = self._running.get(tenant, 0) - 1
        if running > 0:
            self._running[tenant] = running
        else:
            self._running.pop(tenant, None)


def admission_for(limit: int, per_second: float = 0, quotas: Quotas | None = None) -> Admission | None:
    """The admission of `--tenant-concurrency` and `--quota-calls-per-second` (pass 0 for the rate when no
    tokens are configured); None when both are off."""
    rate = Rate(per_second, quotas if quotas is not None else Quotas()) if per_second > 0 else None
    return Admission(limit, rate=rate) if limit > 0 or rate is not None else None


def tenant_here(actor_tenant: str, fallback: Any, metadata: Any) -> str:
    """The tenant of the call being served: the admitted caller's (set as the current actor when the call
    was admitted), else asked of `fallback(metadata)` (the pipeline's `tenant_of`); `anonymous` when
    neither knows one (an open call such as health, made without a token)."""
    if actor_tenant:
        return actor_tenant
    try:
        return str(fallback(metadata))
    except Exception:  # an open call without a token: one tenant for all of them
        return "anonymous"

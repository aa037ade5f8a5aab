"""Per-tenant quotas: what one tenant may hold at once, so no tenant can take the service from the others.

A tenant is whose the caller is (uibus.infra.auth's `Grant.tenant`: the `(name)` its tokens-file line
gives, so a token and its replacement are one tenant; an unnamed token is a tenant of its own; the
all-sessions `--auth-token` is `operator`; an agent's minted token is its session's tenant); without
tokens every caller is the one tenant `anonymous`. Every door asks this one module (one behaviour every way in):

* `hold(quota, tenant)`: a lease on something held open (a connection, a watch), given back with
  `release` (idempotent) or as a context manager; QuotaExceeded when the tenant holds its limit;
* `tick(quota, tenant)`: something done at a rate (sessions created per minute), counted in a
  sliding minute; QuotaExceeded when the tenant made its limit within the last 60 s. `await take(…)`
  is the same for callers that can wait: with replicas (uibus.replicas.shared_quotas) it is the one
  round trip that counts the tenant's minute on every replica together.

QuotaExceeded is RESOURCE_EXHAUSTED (gRPC), 429 (HTTP), and on JSON-RPC the code QUOTA_EXCEEDED
with `data.quota` naming it: the message always names the quota, its limit and its option. A limit
of 0 turns that quota off. Every refusal counts on `/metrics` as `uibus_quota_refused_total{quota,
tenant}` (and what is held as `uibus_quota_in_use`), with a bounded label set: the first
MAX_TENANT_LABELS tenants seen by name, every later one as `other`.

Nothing here runs per message: a lease is taken when a connection or stream opens.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from uibus.infra.errors import ResourceExhausted

ANONYMOUS = "anonymous"  # the tenant of every caller when no tokens are configured
MAX_TENANT_LABELS = 32  # tenants named on /metrics; the rest are `other`
OTHER = "other"
WINDOW_S = 60.0  # of the rate quotas


@dataclass(frozen=True)
class Quota:
    name: str
    option: str  # the flag that sets it (env UIBUS_<NAME>)
    default: int
    what: str  # what is counted, for the refusal and the docs
    rate: bool = False  # counted per minute rather than held


QUOTAS: dict[str, Quota] = {q.name: q for q in (
    Quota("acp_connections", "--quota-acp-connections", 32, "ACP connections (/acp WebSocket and HTTP) open"),
    Quota("codebolt_connections", "--quota-codebolt-connections", 64, "CodeBolt agent connections open"),
    Quota("streams", "--quota-streams", 4096, "gRPC server streams open (UI feeds, dialogs, chats)"),
    Quota("watches", "--quota-watches", 256, "WatchSessions streams open"),
    Quota("sessions_per_minute", "--quota-sessions-per-minute", 120, "sessions created (CreateSession, "
          "session/new) per minute", rate=True),
    Quota("dialogs", "--quota-dialogs", 4096, "dialogs open (waiting for an answer)"),
    Quota("mcp_tasks", "--quota-mcp-tasks", 64, "MCP tasks running (an agent's turn each, tasks extension)"),
    # Per tenant *and agent*, counted by uibus.domain.agent_room (not held here): a quarter of the
    # default max_processes (64), so four tenants at their share still leave none refused.
    Quota("agent_processes", "--quota-agent-processes", 16, "agent processes (running or kept idle)"),
    # Enforced by the kernel, not counted here: the cgroup of the tenant's agents (uibus.agents.limits).
    Quota("tenant_memory_mb", "--quota-tenant-memory-mb", 16384, "MB of memory its hosted agents use together"),
    Quota("tenant_pids", "--quota-tenant-pids", 2048, "processes its hosted agents run together"),
    # Per replica, by uibus.edge.calls.admission's token bucket (not counted here), only with tokens: a
    # quarter of what one core serves (~3,500 unary calls/s here), so one tenant at its rate leaves the rest.
    Quota("calls_per_second", "--quota-calls-per-second", 800, "unary calls per second (on this replica)"),
)}


class QuotaExceeded(ResourceExhausted):
    """A tenant is at one of its quotas; `quota` names it."""

    def __init__(self, message: str, quota: str) -> None:
        super().__init__(message)
        self.quota = quota


class Lease:
    """One unit of a held quota; `release` gives it back (once, however often it is called)."""

    __slots__ = ("_owner", "key")

    def __init__(self, owner: Quotas | None, key: tuple[str, str]) -> None:
        self._owner = owner
        self.key = key

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._give_back(self.key)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Quotas:
    """The quotas in force and what each tenant holds. `limits`: quota name -> limit (missing: the
    default; 0: off)."""

    def __init__(self, limits: Mapping[str, int] | None = None) -> None:
        self.limits = {name: q.default for name, q in QUOTAS.items()}
        for name, limit in (limits or {}).items():
            if name not in QUOTAS:
                raise KeyError(f"no quota {name!r}")
            self.limits[name] = limit
        self._held: dict[tuple[str, str], int] = {}
        self._ticks: dict[tuple[str, str], deque[float]] = {}
        self.refused: dict[tuple[str, str], int] = {}  # (quota, tenant label) -> refusals
        self.waited: dict[tuple[str, str], int] = {}  # (quota, tenant label) -> calls slowed (calls_per_second)
        self._labels: dict[str, str] = {}

    def label(self, tenant: str) -> str:
        """The tenant's /metrics label: its name for the first MAX_TENANT_LABELS seen, else `other`."""
        found = self._labels.get(tenant)
        if found is None:
            found = tenant if len(self._labels) < MAX_TENANT_LABELS else OTHER
            if found != OTHER:
                self._labels[tenant] = found
        return found

    def in_use(self, quota: str, tenant: str) -> int:
        return self._held.get((quota, tenant), 0)

    def at_limit(self, quota: str, tenant: str, held: int | None = None) -> bool:
        limit = self.limits[quota]
        return bool(limit) and (self.in_use(quota, tenant) if held is None else held) >= limit

    def refuse(self, quota: str, tenant: str, detail: str = "") -> QuotaExceeded:
        """The refusal (counted on /metrics), to raise."""
        key = (quota, self.label(tenant))
        self.refused[key] = self.refused.get(key, 0) + 1
        q = QUOTAS[quota]
        return QuotaExceeded(f"quota {quota} exceeded: tenant {tenant!r} is at its limit of {self.limits[quota]} "
                             f"{q.what}{detail} (option {q.option}); other tenants are not affected", quota)

    def slowed(self, quota: str, tenant: str) -> None:
        """Counts a call that waited for its turn under `quota` rather than being refused (/metrics)."""
        key = (quota, self.label(tenant))
        self.waited[key] = self.waited.get(key, 0) + 1

    def hold(self, quota: str, tenant: str) -> Lease:
        """A lease on one more of `quota` for `tenant`, or QuotaExceeded."""
        key = (quota, tenant)
        if self.at_limit(quota, tenant):
            raise self.refuse(quota, tenant)
        self._held[key] = self._held.get(key, 0) + 1
        return Lease(self, key)

    def _give_back(self, key: tuple[str, str]) -> None:
        left = self._held.get(key, 0) - 1
        if left > 0:
            self._held[key] = left
        else:
            self._held.pop(key, None)

    def tick(self, quota: str, tenant: str, now: float | None = None) -> None:
        """Counts one more of a rate quota for `tenant`, or QuotaExceeded when its last minute is full."""
        limit = self.limits[quota]
        if not limit:
            return
        now = time.monotonic() if now is None else now
        stamps = self._ticks.setdefault((quota, tenant), deque())
        while stamps and now - stamps[0] >= WINDOW_S:
            stamps.popleft()
        if len(stamps) >= limit:
            raise self.refuse(quota, tenant, " in the last minute")
        stamps.append(now)
        if len(self._ticks) > 4 * MAX_TENANT_LABELS:  # forget tenants whose minute has passed
            for key, old in list(self._ticks.items()):
                if not old or now - old[-1] >= WINDOW_S:
                    del self._ticks[key]

    async def take(self, quota: str, tenant: str) -> None:
        """`tick` for a caller that can wait: with replicas the count is shared and this is one round trip
        to Redis (uibus.replicas.shared_quotas); here it is `tick` itself."""
        self.tick(quota, tenant)

    # ---- /metrics ----

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily("uibus_quota_refused", "Calls and connections refused because the tenant was "
                                      "at a quota (tenant: uibus.infra.auth's Grant.tenant; `other` past the first "
                                      f"{MAX_TENANT_LABELS})", labels=["quota", "tenant"])
        for (quota, tenant), n in sorted(self.refused.items()):
            refused.add_metric([quota, tenant], n)
        held: dict[tuple[str, str], int] = {}
        for (quota, tenant), n in self._held.items():
            key = (quota, self.label(tenant))
            held[key] = held.get(key, 0) + n
        in_use = GaugeMetricFamily("uibus_quota_in_use", "What each tenant holds of each held quota",
                                   labels=["quota", "tenant"])
        for (quota, tenant), n in sorted(held.items()):
            in_use.add_metric([quota, tenant], n)
        waited = CounterMetricFamily("uibus_quota_waited", "Calls slowed to the tenant's rate (waited for their "
                                     "token) rather than refused", labels=["quota", "tenant"])
        for (quota, tenant), n in sorted(self.waited.items()):
            waited.add_metric([quota, tenant], n)
        yield refused
        yield waited
        yield in_use

    def describe(self) -> list[Any]:
        return []

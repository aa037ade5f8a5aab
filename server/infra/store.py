"""The session store: small JSON values and append-only lists, namespaced by session.

Services keep their state here (theme, announcement, ChatContext per agent, chat history,
extension-UI status, CodeBolt state) under keys they own, so a backend only has to implement
five operations. The embedded default is one SQLite file that survives restarts
(`uibus.infra.sqlite_store`); a Redis backend (`uibus.infra.redis.RedisStore`) implements the same `Store` for
several replicas. A store is an
async context manager: entering it starts the retention sweep, leaving it flushes and closes the
backend.

Retention, so that sessions do not live forever: every write (put, update, append; a delete of an
existing session too) stamps the session's last activity. The sweep deletes sessions idle longer
than `ttl_s`; a write that creates a session beyond `max_sessions` deletes the longest-idle ones.
Deleting a session deletes all of it (every value and every list). A list appended with
`max_bytes` keeps its newest entries within that many bytes of JSON. What was deleted is counted
in `Store.stats` (exported on /metrics).

Faults: each backend turns what its broken or unreachable backing store raises into
`StoreUnavailable` (UNAVAILABLE) and a full disk or memory into `StoreFull` (RESOURCE_EXHAUSTED),
in one place per backend, so no caller sees a driver exception and no call logs a traceback. A
failure also marks the store unhealthy (`problem` says why; `on_change` listeners hear it, the App
maps it to gRPC health and /readyz) and starts a probe that retries a tiny write every
`PROBE_S`: only the probe declares recovery, because a read that works says nothing about a disk
that is still full. Failures are logged at most once per kind per minute.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uibus.infra.errors import StoreFull, StoreUnavailable
from uibus.infra.logs import Throttle
from uibus.infra.tasks import Tasks

__all__ = ["Lease", "LogEntry", "LogRead", "LogRetention", "Store", "StoreFull", "StoreStats", "StoreUnavailable"]

log = logging.getLogger("uibus.infra.store")

SWEEP_MAX_S = 60.0  # the sweep runs at least this often (it also refreshes the session count)
EVICT_BATCH = 500  # sessions deleted per step, so one sweep never holds the backend for long
PROBE_S = 1.0  # while the store fails, a tiny write is retried this often to see it recover
FAILURE_LOG_S = 60.0  # one log line per kind of store failure per this many seconds


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def now_ms() -> float:
    """Wall-clock milliseconds: last activity must survive restarts and compare across replicas."""
    return time.time() * 1000


@dataclass
class StoreStats:
    """What retention did, read by /metrics. Counted per process: with several replicas on one
    Redis each session is evicted (and counted) by exactly one of them, so the sum is the total."""

    evicted_idle: int = 0  # sessions deleted by the sweep for being idle longer than the TTL
    evicted_over_max: int = 0  # sessions deleted because a new one went over max_sessions
    history_dropped: int = 0  # list entries dropped to keep a list within its byte bound
    sessions: int = -1  # sessions stored, as last seen by a write or the sweep (-1: not yet known)


@dataclass(frozen=True, slots=True)
class Lease:
    """Who owns a (session, agent) now, as the store answered a `take_lease`.

    `token` is the fencing token: it grows by one each time the lease changes hands (or is taken
    again after it expired), so a write checked against it can never come from an owner that lost
    it. `taken_from` names the owner whose lease had expired when this call took it ("" when there
    was none, or the caller already held it)."""

    owner: str
    token: int
    taken_from: str = ""


@dataclass(slots=True)
class LogEntry:
    """One entry of a session's ordered log (uibus.domain.session_log): its position `seq`, what it
    is (`kind`) and which thing it is a state of (`key`: a ClineMessage's ts), the conversation
    (`epoch`), when it was written (Unix ms) and its bytes. The log keeps one entry per (kind,
    key): a newer state replaces the older one (it gets a new, higher seq). `new`: the writer
    knows its (kind, key) has no entry yet (a key it has just made, as a host request's id), so
    a store need not look for one to replace."""

    seq: int
    kind: str
    key: str
    epoch: int
    at: float
    data: bytes
    new: bool = False


@dataclass(frozen=True, slots=True)
class LogRead:
    """What `Store.log_read` found: the entries after the cursor (oldest seq first), and `floor`,
    the highest seq retention has dropped (a cursor below it missed entries: a gap)."""

    entries: list[LogEntry]
    floor: int = 0


@dataclass(frozen=True, slots=True)
class LogRetention:
    """How much of a session's log is kept: the newest `max_entries`, within `max_bytes` of data,
    none older than `max_age_s` (0: unbounded); the newest entry is always kept."""

    max_entries: int = 10_000
    max_bytes: int = 8 * 1024 * 1024
    max_age_s: float = 7 * 24 * 3600.0


NO_KEY = -(2**63) - 1  # below every int64 key: what `log_top_key` says of a log without that kind
LOG_KEY = "log/entries"  # the generic log (Store's own implementation): one JSON document per session
LOG_HEAD_KEY = "log/head"  # a store whose log lives beside its values stamps the session with its head here


def _log_doc(current: Any) -> dict[str, Any]:
    if isinstance(current, dict) and isinstance(current.get("e"), list):
        return {"floor": int(current.get("floor", 0)), "e": list(current["e"])}
    return {"floor": 0, "e": []}


def _entry_json(e: LogEntry) -> list[Any]:
    return [e.seq, e.kind, e.key, e.epoch, e.at, base64.b64encode(e.data).decode("ascii")]


def _entry_of(row: Any) -> LogEntry | None:
    try:
        seq, kind, key, epoch, at, data = row
        return LogEntry(int(seq), str(kind), str(key), int(epoch), float(at), base64.b64decode(data))
    except (TypeError, ValueError):
        return None


class Store(abc.ABC):
    """Async interface so that a networked backend fits; values are JSON-serialisable."""

    def __init__(self, *, ttl_s: float = 0, max_sessions: int = 0, sweep_s: float | None = None) -> None:
        """`ttl_s` > 0 deletes a session idle that long (0 keeps it forever); `max_sessions` > 0
        bounds how many are kept (0 = unbounded). `sweep_s` is the sweep period, by default
        min(ttl/4, 60 s): an idle session goes at most a quarter TTL late, and the session gauge is
        at most a minute old. The defaults keep everything, as a store did before retention."""
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        default = min(ttl_s / 4, SWEEP_MAX_S) if ttl_s > 0 else SWEEP_MAX_S
        self.sweep_s = sweep_s if sweep_s is not None and sweep_s > 0 else default
        self.stats = StoreStats()
        # The sweep and the probe: owned, so `close` stops both however a backend call takes a cancel.
        self._tasks = Tasks("uibus-store")
        self._sweeper: asyncio.Task[None] | None = None
        self._stopping = False
        self.problem: str | None = None  # why the store fails right now (the error's message); None: it works
        self._failed_since = 0.0
        self._listeners: list[Callable[[], None]] = []
        self._prober: asyncio.Task[None] | None = None
        self._failure_logs: dict[str, Throttle] = {}  # one per kind of failure
        # The leases of a one-process store: (session, name) -> [owner, token, monotonic expiry].
        self._leases: dict[tuple[str, str], list[Any]] = {}

    @abc.abstractmethod
    async def get(self, session: str, key: str) -> Any | None: ...

    @abc.abstractmethod
    async def put(self, session: str, key: str, value: Any | None) -> None:
        """Stores `value`; `None` deletes the key."""

    @abc.abstractmethod
    async def update(self, session: str, key: str, change: Callable[[Any | None], Any | None]) -> Any | None:
        """Replaces the value of `key` with `change(current)` atomically, and returns it.

        Atomic against every writer of the store, other processes and replicas included (a
        transaction, not a local lock), so two read-modify-writes never lose one another's
        change. `change` must be a pure function: a backend may call it again after a conflict.
        `None` from `change` deletes the key.
        """

    @abc.abstractmethod
    async def scan(self, session: str, prefix: str) -> dict[str, Any]:
        """Every key of `session` that starts with `prefix`, with its value."""

    @abc.abstractmethod
    async def append(self, session: str, key: str, value: Any, max_len: int = 10_000, max_bytes: int = 0) -> None:
        """Appends to the list `key`, keeping at most the newest `max_len` items and, with
        `max_bytes` > 0, only the newest items whose JSON sizes sum to at most `max_bytes`.

        The item just appended is always kept, even alone over `max_bytes`, so an append is never
        silently lost; everything older goes until the list fits (counted in
        `stats.history_dropped`). A `max_len` of 0 or less keeps nothing.
        """

    @abc.abstractmethod
    async def items(self, session: str, key: str, last: int = 0) -> list[Any]:
        """The list `key`, oldest first; `last` > 0 returns only the newest `last` items."""

    # ---- leases: one owner of a (session, agent) at a time, with a fencing token ------------------
    # The embedded stores serve one process, so this in-memory table is their implementation; a
    # store shared by several processes (RedisStore) overrides all three with atomic server steps.

    async def take_lease(self, session: str, name: str, owner: str, ttl_s: float) -> Lease:
        """Takes (or renews) the lease of (`session`, `name`) for `owner` when it is free, expired
        or already `owner`'s, for `ttl_s`; otherwise returns the live owner's lease untouched."""
        now = time.monotonic()
        held = self._leases.get((session, name))
        if held is not None and held[0] and held[0] != owner and held[2] > now:
            return Lease(held[0], held[1])
        token = held[1] if held is not None else 0
        taken_from = ""
        if held is None or held[0] != owner or held[2] <= now:
            token += 1
            taken_from = held[0] if held is not None and held[0] != owner else ""  # "" when it was given up
        self._leases[(session, name)] = [owner, token, now + ttl_s]
        return Lease(owner, token, taken_from)

    async def renew_lease(self, session: str, name: str, owner: str, token: int, ttl_s: float) -> bool:
        """Extends the lease by `ttl_s` if `owner` still holds it with `token` and it has not
        expired; False means it is lost (fenced): its holder must stop acting for the session."""
        held = self._leases.get((session, name))
        if held is None or held[0] != owner or held[1] != token or held[2] <= time.monotonic():
            return False
        held[2] = time.monotonic() + ttl_s
        return True

    async def drop_lease(self, session: str, name: str, owner: str, token: int) -> None:
        """Gives the lease up (another process may take it at once) if still `owner`'s with `token`."""
        held = self._leases.get((session, name))
        if held is not None and held[0] == owner and held[1] == token:
            held[0], held[2] = "", 0.0  # free, its token kept: the next owner's is higher

    # ---- the session log --------------------------------------------------------------------------
    # A generic implementation over `update` (one document per session, atomic on every backend);
    # SqliteStore overrides all three with indexed rows.

    # A store that commits without waiting (an embedded file written on the loop's thread) sets this
    # and implements `log_append_many`: callers waiting for a commit (a host's final message, an
    # acknowledged event) then share one transaction made at the loop's next turn, with no task.
    log_inline = False

    def log_append_many(self, batches: dict[str, list[LogEntry]], keep: LogRetention) -> None:
        """`log_append` of several sessions in one transaction, committed before it returns,
        without awaiting (only where `log_inline`)."""
        raise NotImplementedError

    async def log_append(self, session: str, entries: list[LogEntry], keep: LogRetention) -> None:
        """Appends `entries` (ascending seq), each replacing the entry of its (kind, key), then
        applies `keep` (oldest first; what goes raises the floor). Stamps the session's activity."""
        now = now_ms()

        def change(current: Any) -> Any:
            doc = _log_doc(current)
            newest = {(e.kind, e.key): e for e in entries}  # within the batch too, the last state wins
            rows = [r for r in doc["e"] if (r[1], r[2]) not in newest] + [_entry_json(e) for e in newest.values()]
            rows.sort(key=lambda r: r[0])
            floor, total = doc["floor"], sum(len(r[5]) for r in rows)
            cutoff = now - keep.max_age_s * 1000 if keep.max_age_s > 0 else float("-inf")
            while len(rows) > 1 and (len(rows) > keep.max_entries > 0 or total > keep.max_bytes > 0
                                     or rows[0][4] < cutoff):
                gone = rows.pop(0)
                total -= len(gone[5])
                floor = max(floor, gone[0])
            return {"floor": floor, "e": rows}

        await self.update(session, LOG_KEY, change)

    async def log_read(self, session: str, after: int = 0, *, kind: str = "", last: int = 0) -> LogRead:
        """The entries with seq > `after` (of `kind` only, when given), oldest first; with `last`,
        only the newest `last` of them."""
        doc = _log_doc(await self.get(session, LOG_KEY))
        entries = [e for e in map(_entry_of, doc["e"]) if e is not None and e.seq > after
                   and (not kind or e.kind == kind)]
        if last > 0:
            entries = entries[-last:]
        return LogRead(entries, doc["floor"])

    async def log_top_key(self, session: str, kind: str) -> int | None:
        """The highest key of `kind` in the session's log read as a number (a ClineMessage's ts;
        NO_KEY when it holds none): a key above it has no entry, so its first state is `new`.
        None: this store does not say (it has no use for `LogEntry.new`)."""
        return None

    async def log_head(self, session: str) -> tuple[int, int]:
        """(the highest seq, its epoch) of the session's log; (floor, 0) when it holds nothing."""
        read = await self.log_read(session, last=1)
        return (read.entries[-1].seq, read.entries[-1].epoch) if read.entries else (read.floor, 0)

    async def sessions(self) -> list[tuple[str, float]]:
        """Every stored session with its last activity (Unix ms), most recently active first: what
        the sessions API lists (uibus.domain.sessions). A backend that cannot list raises
        NotImplementedError (answered UNIMPLEMENTED)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its sessions")

    async def drop_session(self, session: str) -> bool:
        """Deletes all of `session` (every value and list, its activity), as eviction does; True
        when it existed."""
        raise NotImplementedError(f"{type(self).__name__} cannot delete a session")

    async def sweep(self) -> int:
        """Deletes the sessions idle longer than the TTL and any beyond `max_sessions`, longest
        idle first, and refreshes `stats.sessions`; returns how many went. A backend without
        retention has nothing to do."""
        return 0

    async def probe(self) -> None:
        """A tiny write and read that raises (StoreUnavailable, StoreFull) while the backend cannot
        take writes; it decides when a failing store has recovered. Nothing to check by default."""
        return

    # ---- health: noted by the backends' error mapping, cleared only by the probe ---------------

    @property
    def healthy(self) -> bool:
        return self.problem is None

    def on_change(self, listener: Callable[[], None]) -> None:
        """Calls `listener()` (on the event loop) whenever `problem` changes; read it from there."""
        self._listeners.append(listener)

    def _notify(self) -> None:
        for listener in self._listeners:
            try:
                listener()
            except Exception as exc:  # one broken listener must not break the store call that noticed
                log.error("store health listener failed", exc_info=exc)

    def _log_allowed(self, kind: str) -> int | None:
        """Throttle.allow for this kind of failure: one line per kind per FAILURE_LOG_S."""
        throttle = self._failure_logs.get(kind)
        if throttle is None:
            throttle = self._failure_logs[kind] = Throttle(burst=1, window_s=FAILURE_LOG_S)
        return throttle.allow()

    def _failed(self, kind: str, error: StoreUnavailable | StoreFull) -> StoreUnavailable | StoreFull:
        """Notes a failure of the backend (`kind` names it for the log throttle): marks the store
        unhealthy, starts the probe, logs (at most once per kind per minute); returns `error` for
        the caller to raise. A store that is closing is not "failing": it is going away."""
        if self._stopping:
            return error
        skipped = self._log_allowed(kind)
        if skipped is not None:
            fields: dict[str, Any] = {"kind": kind, "error": str(error)}
            if skipped:
                fields["not_logged_since"] = skipped
            log.warning("session store failing", extra={"fields": fields})
        if self.problem != str(error):
            if self.problem is None:
                self._failed_since = time.monotonic()
            self.problem = str(error)
            self._notify()
        if (self._prober is None or self._prober.done()) and not self._tasks.closed and _loop_running():
            self._prober = self._tasks.spawn(self._probe_until_healthy(), name="uibus-store-probe")
        return error

    async def _probe_until_healthy(self) -> None:
        """Retries `probe()` every PROBE_S until it passes, then clears `problem` (one log line)."""
        while not self._stopping:
            await asyncio.sleep(PROBE_S)
            try:
                await self.probe()
            except (StoreUnavailable, StoreFull):
                continue  # noted (and logged, throttled) by the backend's mapping
            except Exception as exc:  # not an outage we know: keep probing, say so once a minute
                if self._log_allowed("probe") is not None:
                    log.error("session store probe failed", exc_info=exc)
                continue
            if self._stopping:
                return
            log.info("session store recovered", extra={"fields": {
                "after_s": round(time.monotonic() - self._failed_since, 1), "was": self.problem}})
            self.problem = None
            self._notify()
            return

    async def _sweep_forever(self) -> None:
        """Sweeps at once (a restart cleans up what expired while down), then every period. A
        failed sweep is retried next period: retention must never stop the service (an outage is
        already logged, throttled, where it was noticed)."""
        while not self._stopping:  # a cancel that a client library turns into an error still stops it
            try:
                await self.sweep()
            except (StoreUnavailable, StoreFull) as exc:
                log.debug("session sweep skipped", extra={"fields": {"error": str(exc)}})
            except Exception as exc:
                log.error("session sweep failed", exc_info=exc)
            await asyncio.sleep(self.sweep_s)

    async def close(self) -> None:
        """Stops the sweep and the probe; a backend then flushes and releases itself (call this
        first). Never raises: a backend that cannot flush logs one line, and shutdown goes on."""
        self._stopping = True
        self._sweeper = self._prober = None
        # Bounded (cancelled again every 1.5 s, at most three times): a sweep stuck in a backend call
        # that swallows its cancel cannot hold up shutdown. A cancel of the closer itself propagates.
        await self._tasks.aclose(patience=1.5)

    async def __aenter__(self) -> Store:
        """Starts the sweep after one probe: a backend that does not answer yet (Redis starting
        after the pod) is not a start failure, it starts unhealthy and the probe sees it come up."""
        if self._sweeper is None:
            try:
                await self.probe()
            except (StoreUnavailable, StoreFull):  # noted as `problem` by the mapping
                pass
            self._sweeper = self._tasks.spawn(self._sweep_forever(), name="uibus-store-sweep")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

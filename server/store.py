"""The session store: small JSON values and append-only lists, namespaced by session.

Services keep their state here (theme, announcement, ChatContext per agent, chat history,
extension-UI status, CodeBolt state) under keys they own, so a backend only has to implement
five operations. The embedded default is one SQLite file that survives restarts; a Redis
backend (`uibus.redis_store`) implements the same `Store` for several replicas. A store is an
async context manager: entering it starts the retention sweep, leaving it flushes and closes the
backend.

Retention, so that sessions do not live forever: every write (put, update, append; a delete of an
existing session too) stamps the session's last activity. The sweep deletes sessions idle longer
than `ttl_s`; a write that creates a session beyond `max_sessions` deletes the longest-idle ones.
Deleting a session deletes all of it (every value and every list). A list appended with
`max_bytes` keeps its newest entries within that many bytes of JSON. What was deleted is counted
in `Store.stats` (exported on /metrics).
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from uibus.errors import StoreUnavailable

__all__ = ["SqliteStore", "Store", "StoreStats", "StoreUnavailable"]

log = logging.getLogger("uibus.store")

SWEEP_MAX_S = 60.0  # the sweep runs at least this often (it also refreshes the session count)
EVICT_BATCH = 500  # sessions deleted per step, so one sweep never holds the backend for long


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
        self._sweeper: asyncio.Task[None] | None = None
        self._stopping = False

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

    async def sweep(self) -> int:
        """Deletes the sessions idle longer than the TTL and any beyond `max_sessions`, longest
        idle first, and refreshes `stats.sessions`; returns how many went. A backend without
        retention has nothing to do."""
        return 0

    async def _sweep_forever(self) -> None:
        """Sweeps at once (a restart cleans up what expired while down), then every period. A
        failed sweep is logged and retried next period: retention must never stop the service."""
        while not self._stopping:  # a cancel that a client library turns into an error still stops it
            try:
                await self.sweep()
            except StoreUnavailable as exc:
                log.warning("session sweep skipped", extra={"fields": {"error": str(exc)}})
            except Exception as exc:
                log.error("session sweep failed", exc_info=exc)
            await asyncio.sleep(self.sweep_s)

    async def close(self) -> None:
        """Stops the sweep; a backend then flushes and releases itself (call this first)."""
        self._stopping = True
        task, self._sweeper = self._sweeper, None
        if task is not None:
            task.cancel()
            # wait() never raises, so a close inside a cancelled task still runs; bounded, so a sweep
            # stuck in a backend call cannot hold up shutdown.
            await asyncio.wait([task], timeout=5)

    async def __aenter__(self) -> Store:
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="uibus-store-sweep")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SqliteStore(Store):
    """One SQLite file in WAL mode, used from the event loop thread.

    Each operation is a few indexed statements in one transaction (tens of microseconds), so
    running it inline is cheaper than a thread hop per call; WAL with synchronous=NORMAL keeps
    commits off fsync while staying crash-safe.

    Retention tables: `sessions(session, last_used ms)` (indexed by last_used, so the longest
    idle are found without a scan), a `size` per list row and `list_bytes(session, key, total)`,
    the running byte total of each list, so a byte-bounded append never sums the list. The number
    of sessions is counted once at open and then kept in memory (this process is the only writer
    the embedded store expects; the sweep recounts).
    """

    def __init__(self, path: str, *, ttl_s: float = 0, max_sessions: int = 0, sweep_s: float | None = None) -> None:
        super().__init__(ttl_s=ttl_s, max_sessions=max_sessions, sweep_s=sweep_s)
        if path != ":memory:":
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
            path = str(Path(path).expanduser())
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.executescript(
            """
            PRAGMA journal_mode=WAL;
            PRAGMA synchronous=NORMAL;
            CREATE TABLE IF NOT EXISTS kv (
              session TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL,
              PRIMARY KEY (session, key)) WITHOUT ROWID;
            CREATE TABLE IF NOT EXISTS lists (
              session TEXT NOT NULL, key TEXT NOT NULL, seq INTEGER NOT NULL, value TEXT NOT NULL,
              size INTEGER NOT NULL DEFAULT 0,
              PRIMARY KEY (session, key, seq)) WITHOUT ROWID;
            """
        )
        self._migrate()
        self.stats.sessions = self._count()

    def _migrate(self) -> None:
        """Adds what a file of an earlier version lacks, once, in one transaction: the row sizes
        and list totals are computed from the stored JSON, and every session already stored counts
        as active now (so an upgrade starts its TTL instead of deleting everything at once)."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if "size" not in {r[1] for r in self._db.execute("PRAGMA table_info(lists)")}:
                self._db.execute("ALTER TABLE lists ADD COLUMN size INTEGER NOT NULL DEFAULT 0")
                self._db.execute("UPDATE lists SET size = length(CAST(value AS BLOB))")
            if "list_bytes" not in tables:
                self._db.execute("CREATE TABLE list_bytes (session TEXT NOT NULL, key TEXT NOT NULL, "
                                 "total INTEGER NOT NULL, PRIMARY KEY (session, key)) WITHOUT ROWID")
                self._db.execute("INSERT INTO list_bytes(session, key, total) "
                                 "SELECT session, key, SUM(size) FROM lists GROUP BY session, key")
            if "sessions" not in tables:
                self._db.execute("CREATE TABLE sessions (session TEXT NOT NULL PRIMARY KEY, "
                                 "last_used REAL NOT NULL) WITHOUT ROWID")
                self._db.execute("CREATE INDEX sessions_by_last_used ON sessions(last_used)")
                now = now_ms()
                self._db.execute("INSERT INTO sessions(session, last_used) "
                                 "SELECT session, ? FROM kv UNION SELECT session, ? FROM lists", (now, now))

    def _count(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0])

    def _touch(self, session: str, create: bool) -> bool:
        """Stamps `session` as written now, inside the caller's transaction; returns True when
        this created it. A delete (`create` False) never creates an empty session."""
        now = now_ms()
        if self._db.execute("UPDATE sessions SET last_used=? WHERE session=?", (now, session)).rowcount or not create:
            return False
        self._db.execute("INSERT INTO sessions(session, last_used) VALUES (?, ?)", (session, now))
        return True

    def _drop(self, sessions: list[str]) -> None:
        """Deletes all of each session (values, lists, list totals, its activity), inside the
        caller's transaction."""
        rows = [(s,) for s in sessions]
        for table in ("kv", "lists", "list_bytes", "sessions"):
            self._db.executemany(f"DELETE FROM {table} WHERE session=?", rows)  # fixed table names

    def _evict_over_max(self, keep: str | None) -> int:
        """Deletes the longest-idle sessions (never `keep`, the one just created) while more than
        `max_sessions` are stored, at most EVICT_BATCH at a time; returns how many went."""
        over = min(self.stats.sessions - self.max_sessions, EVICT_BATCH) if self.max_sessions else 0
        if over <= 0:
            return 0
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            victims = [r[0] for r in self._db.execute(
                "SELECT session FROM sessions WHERE session IS NOT ? ORDER BY last_used LIMIT ?", (keep, over))]
            self._drop(victims)
        self.stats.sessions -= len(victims)
        self.stats.evicted_over_max += len(victims)
        return len(victims)

    def _created(self, session: str) -> None:
        """After the write that created `session` committed: count it, and make room."""
        self.stats.sessions += 1
        self._evict_over_max(keep=session)

    async def sweep(self) -> int:
        evicted = 0
        if self.ttl_s > 0:
            cutoff = now_ms() - self.ttl_s * 1000
            while True:
                with self._db:
                    self._db.execute("BEGIN IMMEDIATE")
                    victims = [r[0] for r in self._db.execute(
                        "SELECT session FROM sessions WHERE last_used < ? ORDER BY last_used LIMIT ?",
                        (cutoff, EVICT_BATCH))]
                    self._drop(victims)
                evicted += len(victims)
                self.stats.evicted_idle += len(victims)
                if len(victims) < EVICT_BATCH:
                    break
                await asyncio.sleep(0)  # let calls run between batches
        while True:  # recount (another process may have written), then enforce the bound
            self.stats.sessions = self._count()
            if self._evict_over_max(keep=None) < EVICT_BATCH:
                break
            await asyncio.sleep(0)
        return evicted

    async def get(self, session: str, key: str) -> Any | None:
        row = self._db.execute("SELECT value FROM kv WHERE session=? AND key=?", (session, key)).fetchone()
        return json.loads(row[0]) if row else None

    def _set(self, session: str, key: str, value: Any | None) -> bool:
        """Writes (or with None deletes) one value and stamps the session, inside the caller's
        transaction; True when this created the session."""
        if value is None:
            self._db.execute("DELETE FROM kv WHERE session=? AND key=?", (session, key))
        else:
            self._db.execute("INSERT OR REPLACE INTO kv(session, key, value) VALUES (?, ?, ?)",
                             (session, key, json.dumps(value, separators=(",", ":"))))
        return self._touch(session, create=value is not None)

    async def put(self, session: str, key: str, value: Any | None) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            created = self._set(session, key, value)
        if created:
            self._created(session)

    async def update(self, session: str, key: str, change: Callable[[Any | None], Any | None]) -> Any | None:
        """BEGIN IMMEDIATE takes SQLite's write lock before the read, so no other connection (or
        process) can write between our read and our write; nothing awaits inside."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute("SELECT value FROM kv WHERE session=? AND key=?", (session, key)).fetchone()
            value = change(json.loads(row[0]) if row else None)
            created = self._set(session, key, value)
        if created:
            self._created(session)
        return value

    async def scan(self, session: str, prefix: str) -> dict[str, Any]:
        rows = self._db.execute(
            "SELECT key, value FROM kv WHERE session=? AND key >= ? AND key < ? ORDER BY key",
            (session, prefix, prefix + "\U0010ffff"))
        return {k: json.loads(v) for k, v in rows}

    async def append(self, session: str, key: str, value: Any, max_len: int = 10_000, max_bytes: int = 0) -> None:
        """The list's rows are always seqs lo..hi (both bounds drop a prefix), so one ranged DELETE
        trims it; its byte total comes from `list_bytes`, and only the rows that go are read."""
        text = json.dumps(value, separators=(",", ":"))
        size = len(text.encode())
        dropped = 0
        where = (session, key)
        with self._db:  # one transaction
            self._db.execute("BEGIN IMMEDIATE")
            if max_len <= 0:  # a bound of 0 keeps nothing
                self._db.execute("DELETE FROM lists WHERE session=? AND key=?", where)
                self._db.execute("DELETE FROM list_bytes WHERE session=? AND key=?", where)
            else:
                row = self._db.execute("SELECT MAX(seq) FROM lists WHERE session=? AND key=?", where).fetchone()
                seq = (row[0] if row and row[0] is not None else -1) + 1
                known = self._db.execute("SELECT total FROM list_bytes WHERE session=? AND key=?", where).fetchone()
                if known is not None:
                    total = int(known[0])
                else:  # a new list (nothing to sum), or one an earlier version wrote: sum it once
                    total = int(self._db.execute("SELECT COALESCE(SUM(size), 0) FROM lists WHERE session=? AND key=?",
                                                 where).fetchone()[0])
                self._db.execute("INSERT INTO lists(session, key, seq, value, size) VALUES (?, ?, ?, ?, ?)",
                                 (*where, seq, text, size))
                total += size
                cut = seq - max_len  # rows with seq <= cut go: first for the count bound, then for bytes
                if cut >= 0 or 0 < max_bytes < total:
                    older = self._db.execute("SELECT seq, size FROM lists WHERE session=? AND key=? AND seq < ? "
                                             "ORDER BY seq", (*where, seq))
                    try:
                        for old_seq, old_size in older:
                            if old_seq > cut:
                                if not 0 < max_bytes < total:
                                    break
                                cut = old_seq
                                dropped += 1
                            total -= old_size
                    finally:
                        older.close()
                    self._db.execute("DELETE FROM lists WHERE session=? AND key=? AND seq <= ?", (*where, cut))
                self._db.execute("INSERT OR REPLACE INTO list_bytes(session, key, total) VALUES (?, ?, ?)",
                                 (*where, total))
            created = self._touch(session, create=True)
        self.stats.history_dropped += dropped
        if created:
            self._created(session)

    async def items(self, session: str, key: str, last: int = 0) -> list[Any]:
        if last > 0:
            rows = self._db.execute("SELECT value FROM lists WHERE session=? AND key=? ORDER BY seq DESC "
                                    "LIMIT ?", (session, key, last)).fetchall()
            rows.reverse()
        else:
            rows = self._db.execute("SELECT value FROM lists WHERE session=? AND key=? ORDER BY seq",
                                    (session, key)).fetchall()
        return [json.loads(r[0]) for r in rows]

    async def close(self) -> None:
        await super().close()
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            self._db.close()


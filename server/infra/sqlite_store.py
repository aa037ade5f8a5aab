"""The embedded session store: one SQLite file (the default backend; `uibus.infra.store` has the base
`Store` with its health and retention tasks, `uibus.infra.redis.RedisStore` the one for several replicas)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from uibus.infra.errors import ConfigError, StoreFull, StoreUnavailable
from uibus.infra.filemodes import private_store, said
from uibus.infra.sqlite_log import append_batch
from uibus.infra.store import EVICT_BATCH, NO_KEY, LogEntry, LogRead, LogRetention, Store, now_ms
from uibus.infra.store_lock import StoreLock

__all__ = ["SqliteStore"]

log = logging.getLogger("uibus.infra.store")


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

    Opening checks the file (`PRAGMA quick_check`: about 40 ms for a 58 MB file in the page cache,
    0.45 s from a cold disk) so that a damaged file fails the start with `ConfigError("--store", …)`
    instead of serving while every call fails; at run time `_fault` maps SQLite's result codes to
    StoreFull / StoreUnavailable.
    """

    def __init__(self, path: str, *, ttl_s: float = 0, max_sessions: int = 0, sweep_s: float | None = None,
                 serving: dict[str, Any] | None = None) -> None:
        """`serving`: this store is the one a uibus serves, which says so (its addresses) in the store's
        lock file and holds it until `close` (uibus.infra.store_lock); StoreInUse when another does."""
        super().__init__(ttl_s=ttl_s, max_sessions=max_sessions, sweep_s=sweep_s)
        self._lock: StoreLock | None = None
        self._faults = _Faults(self)
        self._closed = False
        self._corrupt = False  # a page was found damaged: the probe re-checks the file, not just one write
        shown = path
        tightened: list[str] = []
        try:
            if path != ":memory:":
                file = Path(path).expanduser()
                shown = path = str(file)
                if file.is_dir():
                    raise ConfigError("--store", f"{shown}: is a directory, not a SQLite file")
                tightened = private_store(file)  # its user's alone: 0600 in a 0700 folder (infra.filemodes)
                if serving is not None:
                    self._lock = StoreLock(file, serving)
            self.path = path
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except OSError as exc:  # a parent that is a file, no permission to create the folder
            self._unlock()
            raise ConfigError("--store", f"{shown}: cannot create its folder ({exc.strerror or exc})") from exc
        except sqlite3.Error as exc:
            self._unlock()
            raise ConfigError("--store", f"{shown}: {_open_problem(exc)}") from exc
        try:
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
                CREATE TABLE IF NOT EXISTS log (
                  session TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL, key TEXT NOT NULL,
                  epoch INTEGER NOT NULL, at REAL NOT NULL, data BLOB NOT NULL,
                  PRIMARY KEY (session, seq)) WITHOUT ROWID;
                CREATE UNIQUE INDEX IF NOT EXISTS log_by_key ON log(session, kind, key);
                CREATE TABLE IF NOT EXISTS log_meta (
                  session TEXT NOT NULL PRIMARY KEY, floor INTEGER NOT NULL, count INTEGER NOT NULL,
                  bytes INTEGER NOT NULL) WITHOUT ROWID;
                """
            )
            damage = self._damage()
            if damage:
                raise ConfigError("--store", f"{shown}: damaged file (PRAGMA quick_check: {damage[:120]})")
            self._migrate()
            self.stats.sessions = self._count()
            said(tightened)
        except (sqlite3.Error, ConfigError) as exc:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._unlock()
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError("--store", f"{shown}: {_open_problem(exc)}") from exc

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()

    @property
    def connection(self) -> sqlite3.Connection:
        """The file's one connection, for tables kept beside the store's in the same file (the audit
        log, uibus.infra.audit_sqlite), written inline on the same thread."""
        return self._db

    def _damage(self) -> str:
        """What `PRAGMA quick_check` finds wrong with the file ("" when nothing): every page and
        b-tree checked, without the index cross-checks of integrity_check (twice its cost)."""
        rows = [r[0] for r in self._db.execute("PRAGMA quick_check(3)")]
        return "" if rows == ["ok"] else "; ".join(" ".join(str(r).split()) for r in rows)  # one line

    def _fault(self, exc: sqlite3.Error) -> StoreUnavailable | StoreFull | None:
        """The one place SQLite errors are classified (through `_Faults`): a full disk is
        StoreFull, a damaged, unreadable, locked or vanished file StoreUnavailable (both noted for
        health); None for anything else (a bug of ours), which goes on as it is."""
        if self._closed:
            return StoreUnavailable("session store unavailable: closed (shutting down)")
        code = getattr(exc, "sqlite_errorcode", None)
        kind = _FAULTS.get(code & 0xFF) if isinstance(code, int) else None
        if kind is None:
            return None
        if kind == "corrupt":
            self._corrupt = True
        if kind == "full":
            return self._failed(kind, StoreFull(f"session store is full: {exc}"))
        return self._failed(kind, StoreUnavailable(f"session store unavailable: {exc}"))

    async def probe(self) -> None:
        """One-row write and read-back in a table of its own (so a full disk shows: the commit must
        append to the WAL); after damage was seen, also quick_check, since a good write elsewhere
        says nothing about the damaged pages. It does not wait on another process's lock."""
        with self._faults:
            self._db.execute("PRAGMA busy_timeout=0")
            try:
                with self._db:
                    self._db.execute("BEGIN IMMEDIATE")
                    self._db.execute("CREATE TABLE IF NOT EXISTS probe (id INTEGER PRIMARY KEY, at REAL NOT NULL)")
                    self._db.execute("INSERT OR REPLACE INTO probe(id, at) VALUES (1, ?)", (now_ms(),))
                self._db.execute("SELECT at FROM probe WHERE id=1").fetchone()
            finally:
                self._db.execute("PRAGMA busy_timeout=5000")  # sqlite3.connect's default
            if self._corrupt:
                damage = self._damage()
                if damage:  # the same words as SQLite's, so the reason stays put while it lasts
                    raise self._failed("corrupt", StoreUnavailable(
                        "session store unavailable: database disk image is malformed"))
                self._corrupt = False

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
        for table in ("kv", "lists", "list_bytes", "log", "log_meta", "sessions"):
            self._db.executemany(f"DELETE FROM {table} WHERE session=?", rows)  # fixed table names

    def _evict_over_max(self, keep: str | None) -> int:
        """Deletes the longest-idle sessions (never `keep`, the one just created) while more than
        `max_sessions` are stored, at most EVICT_BATCH at a time; returns how many went."""
        over = min(self.stats.sessions - self.max_sessions, EVICT_BATCH) if self.max_sessions else 0
        if over <= 0:
            return 0
        with self._faults, self._db:
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
                with self._faults, self._db:
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
            with self._faults:
                self.stats.sessions = self._count()
                if self._evict_over_max(keep=None) < EVICT_BATCH:
                    break
            await asyncio.sleep(0)
        return evicted

    async def sessions(self) -> list[tuple[str, float]]:
        with self._faults:
            rows = self._db.execute("SELECT session, last_used FROM sessions ORDER BY last_used DESC").fetchall()
        return [(str(r[0]), float(r[1])) for r in rows]

    async def drop_session(self, session: str) -> bool:
        with self._faults, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            existed = self._db.execute("SELECT 1 FROM sessions WHERE session=?", (session,)).fetchone() is not None
            self._drop([session])
        if existed:
            self.stats.sessions -= 1
        return existed

    async def get(self, session: str, key: str) -> Any | None:
        with self._faults:
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
        with self._faults, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            created = self._set(session, key, value)
        if created:
            self._created(session)

    async def update(self, session: str, key: str, change: Callable[[Any | None], Any | None]) -> Any | None:
        """BEGIN IMMEDIATE takes SQLite's write lock before the read, so no other connection (or
        process) can write between our read and our write; nothing awaits inside."""
        with self._faults, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute("SELECT value FROM kv WHERE session=? AND key=?", (session, key)).fetchone()
            value = change(json.loads(row[0]) if row else None)
            created = self._set(session, key, value)
        if created:
            self._created(session)
        return value

    async def scan(self, session: str, prefix: str) -> dict[str, Any]:
        with self._faults:
            rows = self._db.execute(
                "SELECT key, value FROM kv WHERE session=? AND key >= ? AND key < ? ORDER BY key",
                (session, prefix, prefix + "\U0010ffff")).fetchall()
        return {k: json.loads(v) for k, v in rows}

    async def append(self, session: str, key: str, value: Any, max_len: int = 10_000, max_bytes: int = 0) -> None:
        """The list's rows are always seqs lo..hi (both bounds drop a prefix), so one ranged DELETE
        trims it; its byte total comes from `list_bytes`, and only the rows that go are read."""
        text = json.dumps(value, separators=(",", ":"))
        size = len(text.encode())
        dropped = 0
        where = (session, key)
        with self._faults, self._db:  # one transaction
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
        with self._faults:
            if last > 0:
                rows = self._db.execute("SELECT value FROM lists WHERE session=? AND key=? ORDER BY seq DESC "
                                        "LIMIT ?", (session, key, last)).fetchall()
                rows.reverse()
            else:
                rows = self._db.execute("SELECT value FROM lists WHERE session=? AND key=? ORDER BY seq",
                                        (session, key)).fetchall()
        return [json.loads(r[0]) for r in rows]

    # ---- the session log: one row per (session, kind, key), ordered by seq ------------------------

    log_inline = True  # every operation runs inline on the loop's thread anyway

    async def log_append(self, session: str, entries: list[LogEntry], keep: LogRetention) -> None:
        self.log_append_many({session: entries}, keep)

    def log_append_many(self, batches: dict[str, list[LogEntry]], keep: LogRetention) -> None:
        """One transaction for every session's batch (one commit, never one per event or per
        session: the group commit of callers waiting at once); each entry replaces its (kind,
        key)'s row; `log_meta` keeps the session's count, bytes and floor, so retention trims from
        the oldest seq without counting the log."""
        db = self._db
        now = now_ms()
        created: list[str] = []
        with self._faults, db:
            db.execute("BEGIN IMMEDIATE")
            for session, entries in batches.items():
                if append_batch(db, session, entries, keep, now):
                    created.append(session)
        for session in created:
            self._created(session)

    async def log_top_key(self, session: str, kind: str) -> int | None:
        with self._faults:  # the keys of one kind of one session, on log_by_key: once per session and process
            row = self._db.execute("SELECT max(CAST(key AS INTEGER)) FROM log INDEXED BY log_by_key "
                                   "WHERE session=? AND kind=?", (session, kind)).fetchone()
        return int(row[0]) if row[0] is not None else NO_KEY

    async def log_read(self, session: str, after: int = 0, *, kind: str = "", last: int = 0) -> LogRead:
        db = self._db
        with self._faults:
            meta = db.execute("SELECT floor FROM log_meta WHERE session=?", (session,)).fetchone()
            sql = "SELECT seq, kind, key, epoch, at, data FROM log WHERE session=? AND seq>?"
            args: tuple[Any, ...] = (session, after)
            if kind:
                sql += " AND kind=?"
                args += (kind,)
            if last > 0:
                rows = db.execute(sql + " ORDER BY seq DESC LIMIT ?", (*args, last)).fetchall()
                rows.reverse()
            else:
                rows = db.execute(sql + " ORDER BY seq", args).fetchall()
        return LogRead([LogEntry(r[0], r[1], r[2], r[3], r[4], bytes(r[5])) for r in rows],
                       int(meta[0]) if meta is not None else 0)

    async def close(self) -> None:
        """Checkpoints the WAL into the file and closes it. A checkpoint that fails (disk full,
        damaged file) loses nothing, since the WAL stays and is replayed at the next open, so it
        is one log line, never an exception that would turn a clean shutdown into exit 1."""
        await super().close()
        if self._closed:
            return
        self._closed = True
        for step, run in (("checkpoint", lambda: self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")),
                          ("close", self._db.close)):
            try:
                run()
            except sqlite3.Error as exc:
                log.warning("session store not closed cleanly; the next start replays its journal",
                            extra={"fields": {"step": step, "path": self.path, "error": str(exc)}})
        self._unlock()  # after the checkpoint: the next uibus starts on a settled file


class _Faults:
    """`with store._faults:` around every use of the connection: re-raises what SQLite raises for a
    broken file or disk as StoreUnavailable / StoreFull (see SqliteStore._fault). A class, not a
    generator context manager, because it wraps every call: a fifth of the cost (0.3 µs)."""

    __slots__ = ("store",)

    def __init__(self, store: SqliteStore) -> None:
        self.store = store

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, sqlite3.Error):
            error = self.store._fault(exc)
            if error is not None:
                raise error from exc
        return False


# SQLite primary result codes that mean the file or its disk failed, not our SQL, by failure kind.
_FAULTS = {13: "full",  # SQLITE_FULL
           11: "corrupt", 26: "corrupt",  # SQLITE_CORRUPT, SQLITE_NOTADB
           10: "io", 14: "io", 8: "io", 3: "io", 22: "io", 15: "io",  # IOERR, CANTOPEN, READONLY, PERM, NOLFS, PROTOCOL
           5: "busy", 6: "busy",  # SQLITE_BUSY, SQLITE_LOCKED: another process held the lock past the timeout
           7: "memory"}  # SQLITE_NOMEM


def _open_problem(exc: sqlite3.Error) -> str:
    """What is wrong with a store file that failed to open, in a few words, with SQLite's own."""
    code = getattr(exc, "sqlite_errorcode", None)
    words = {26: "not a SQLite database", 11: "damaged file", 13: "disk full", 8: "read-only",
             5: "locked by another process", 6: "locked by another process",
             7: "out of memory"}.get(code & 0xFF if isinstance(code, int) else -1, "cannot open it")
    return f"{words} ({exc})"

"""The session store: small JSON values and append-only lists, namespaced by session.

Services keep their state here (theme, announcement, ChatContext per agent, chat history,
extension-UI status, CodeBolt state) under keys they own, so a backend only has to implement
five operations. The embedded default is one SQLite file that survives restarts; a Redis
backend (`uibus.redis_store`) implements the same `Store` for several replicas. A store is an
async context manager: leaving it flushes and closes the backend.
"""

from __future__ import annotations

import abc
import json
import sqlite3
from pathlib import Path
from collections.abc import Callable
from typing import Any

from uibus.errors import StoreUnavailable

__all__ = ["SqliteStore", "Store", "StoreUnavailable"]


class Store(abc.ABC):
    """Async interface so that a networked backend fits; values are JSON-serialisable."""

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
    async def append(self, session: str, key: str, value: Any, max_len: int = 10_000) -> None:
        """Appends to the list `key`, keeping at most the newest `max_len` items."""

    @abc.abstractmethod
    async def items(self, session: str, key: str, last: int = 0) -> list[Any]:
        """The list `key`, oldest first; `last` > 0 returns only the newest `last` items."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Flushes and releases the backend."""

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SqliteStore(Store):
    """One SQLite file in WAL mode, used from the event loop thread.

    Each operation is a single indexed statement (tens of microseconds), so running it inline
    is cheaper than a thread hop per call; WAL with synchronous=NORMAL keeps commits off fsync
    while staying crash-safe.
    """

    def __init__(self, path: str) -> None:
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
              PRIMARY KEY (session, key, seq)) WITHOUT ROWID;
            """
        )

    async def get(self, session: str, key: str) -> Any | None:
        row = self._db.execute("SELECT value FROM kv WHERE session=? AND key=?", (session, key)).fetchone()
        return json.loads(row[0]) if row else None

    async def put(self, session: str, key: str, value: Any | None) -> None:
        if value is None:
            self._db.execute("DELETE FROM kv WHERE session=? AND key=?", (session, key))
        else:
            self._db.execute("INSERT OR REPLACE INTO kv(session, key, value) VALUES (?, ?, ?)",
                             (session, key, json.dumps(value, separators=(",", ":"))))

    async def update(self, session: str, key: str, change: Callable[[Any | None], Any | None]) -> Any | None:
        """BEGIN IMMEDIATE takes SQLite's write lock before the read, so no other connection (or
        process) can write between our read and our write; nothing awaits inside."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute("SELECT value FROM kv WHERE session=? AND key=?", (session, key)).fetchone()
            value = change(json.loads(row[0]) if row else None)
            if value is None:
                self._db.execute("DELETE FROM kv WHERE session=? AND key=?", (session, key))
            else:
                self._db.execute("INSERT OR REPLACE INTO kv(session, key, value) VALUES (?, ?, ?)",
                                 (session, key, json.dumps(value, separators=(",", ":"))))
        return value

    async def scan(self, session: str, prefix: str) -> dict[str, Any]:
        rows = self._db.execute(
            "SELECT key, value FROM kv WHERE session=? AND key >= ? AND key < ? ORDER BY key",
            (session, prefix, prefix + "\U0010ffff"))
        return {k: json.loads(v) for k, v in rows}

    async def append(self, session: str, key: str, value: Any, max_len: int = 10_000) -> None:
        with self._db:  # one transaction
            self._db.execute("BEGIN")
            row = self._db.execute("SELECT MAX(seq) FROM lists WHERE session=? AND key=?",
                                   (session, key)).fetchone()
            seq = (row[0] if row and row[0] is not None else -1) + 1
            self._db.execute("INSERT INTO lists(session, key, seq, value) VALUES (?, ?, ?, ?)",
                             (session, key, seq, json.dumps(value, separators=(",", ":"))))
            if seq >= max_len:
                self._db.execute("DELETE FROM lists WHERE session=? AND key=? AND seq <= ?",
                                 (session, key, seq - max_len))

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
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            self._db.close()


"""The audit chain in SQLite: a table of the session store's own file (or of any file, for
`uibus audit verify`), written inline on the event loop's thread as the store writes (one short
transaction: tens of microseconds in WAL mode; uibus.infra.sqlite_store says why inline).

Layout: `audit(seq PRIMARY KEY, at_ms, act, who, person, session, entry, hash)` — the entry's
canonical text as written, and beside it the columns the filters use (each checked against the
entry by `verify`, so a changed column is as visible as a changed entry) — and
`audit_marks(name, seq, hash)`: `head`, the last entry written (so removing the newest entries
shows), and `anchor`, the last entry retention removed (the kept chain starts after it).

Each append reads the head inside its own `BEGIN IMMEDIATE`, not from memory: several processes on
one file (workers, the CLI) append to one chain.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from uibus.infra.audit import GENESIS, Query, Row, sealed, time_ms

__all__ = ["SqliteAudit", "open_file"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
  seq INTEGER PRIMARY KEY, at_ms INTEGER NOT NULL, act TEXT NOT NULL, who TEXT NOT NULL,
  person TEXT NOT NULL, session TEXT NOT NULL, entry TEXT NOT NULL, hash TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_by_session ON audit(session, seq);
CREATE INDEX IF NOT EXISTS audit_by_who ON audit(who, seq);
CREATE INDEX IF NOT EXISTS audit_by_person ON audit(person, seq);
CREATE INDEX IF NOT EXISTS audit_by_time ON audit(at_ms);
CREATE TABLE IF NOT EXISTS audit_marks (name TEXT PRIMARY KEY, seq INTEGER NOT NULL, hash TEXT NOT NULL);
"""


def open_file(path: str) -> sqlite3.Connection:
    """A connection to a store file for the CLI (read as the server writes: WAL); the file must exist."""
    if path != ":memory:" and not Path(path).expanduser().is_file():
        raise FileNotFoundError(f"no store file {path}")
    return sqlite3.connect(str(Path(path).expanduser()) if path != ":memory:" else path, isolation_level=None)


class SqliteAudit:
    """The chain in one SQLite connection (`isolation_level=None`: transactions are explicit)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        db.executescript(_SCHEMA)

    def _mark(self, name: str) -> tuple[int, str]:
        row = self.db.execute("SELECT seq, hash FROM audit_marks WHERE name=?", (name,)).fetchone()
        return (int(row[0]), str(row[1])) if row else (0, GENESIS)

    async def append(self, body: dict[str, Any]) -> dict[str, Any]:
        db = self.db
        with db:
            db.execute("BEGIN IMMEDIATE")
            seq, prev = self._mark("head")
            if seq == 0:  # nothing written yet, or only retention's anchor left
                seq, prev = self._mark("anchor")
            entry = sealed(body, seq + 1, prev)
            db.execute("INSERT INTO audit(seq, at_ms, act, who, person, session, entry, hash) VALUES (?,?,?,?,?,?,?,?)",
                       (entry["seq"], time_ms(entry), entry["act"], entry["who"], entry.get("person", ""),
                        entry["session"], json.dumps(entry, sort_keys=True, ensure_ascii=False), entry["hash"]))
            db.execute("INSERT OR REPLACE INTO audit_marks(name, seq, hash) VALUES ('head', ?, ?)",
                       (entry["seq"], entry["hash"]))
        return entry

    async def query(self, query: Query) -> list[dict[str, Any]]:
        sql = "SELECT entry FROM audit WHERE seq > ?"
        args: list[Any] = [query.after]
        if query.session:
            sql += " AND session = ?"
            args.append(query.session)
        if query.person:
            sql += " AND (person = ? OR who = ?)"
            args += [query.person, query.person]
        if query.act:
            sql += " AND (act = ? OR (substr(?, -1) = '.' AND substr(act, 1, length(?)) = ?))"
            args += [query.act] * 4
        if query.since_ms:
            sql += " AND at_ms >= ?"
            args.append(query.since_ms)
        if query.until_ms:
            sql += " AND at_ms < ?"
            args.append(query.until_ms)
        rows = self.db.execute(sql + " ORDER BY seq LIMIT ?", (*args, query.limit)).fetchall()
        return [json.loads(r[0]) for r in rows]

    async def rows(self, after: int, limit: int) -> list[Row]:
        rows = self.db.execute("SELECT seq, entry, hash, at_ms, act, who, person, session FROM audit WHERE seq > ? "
                               "ORDER BY seq LIMIT ?", (after, limit)).fetchall()
        return [Row(r[0], r[1], {"hash": r[2], "at_ms": r[3], "act": r[4], "who": r[5], "person": r[6],
                                 "session": r[7]}) for r in rows]

    async def marks(self) -> tuple[tuple[int, str], tuple[int, str]]:
        return self._mark("anchor"), self._mark("head")

    async def trim(self, before_ms: int) -> int:
        """In one transaction: the oldest entries older than `before_ms` go — the run of them the
        chain starts with, up to the first entry that is not (as uibus.infra.redis.audit: an entry
        within retention never goes, even after a clock stepped back) — and the last one's hash
        becomes the anchor. The newest entry always stays (the chain keeps a visible end)."""
        db = self.db
        with db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT seq, hash FROM audit WHERE seq < (SELECT MIN(seq) FROM audit WHERE at_ms >= ? "
                             "OR seq = (SELECT MAX(seq) FROM audit)) ORDER BY seq DESC LIMIT 1",
                             (before_ms,)).fetchone()
            if row is None:
                return 0
            n = db.execute("DELETE FROM audit WHERE seq <= ?", (row[0],)).rowcount
            db.execute("INSERT OR REPLACE INTO audit_marks(name, seq, hash) VALUES ('anchor', ?, ?)", (row[0], row[1]))
        return int(n)

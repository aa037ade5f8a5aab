"""`uibus backup DEST`: one consistent copy of the SQLite store, safe while uibus serves it.

The store runs in WAL mode: its committed state is the file plus its `-wal`, so `cp` of the file
alone can miss or tear the latest commits, and a copy of all three is consistent only if nothing
wrote between the copies. SQLite's online backup API copies the database as of one read
transaction (the server's writes go on meanwhile: a WAL reader blocks no writer) into DEST, which
is then switched out of WAL mode so that it is one self-contained file: nothing `-wal`/`-shm`
beside it, openable by any sqlite3, and a store `uibus serve --store DEST` starts from.

DEST is written under a temporary name in its folder and renamed into place once checked
(`PRAGMA quick_check`), so it is either the whole copy or absent; an existing DEST is not replaced.
It is private to its user (0600), as the store is. Restore: stop uibus, put the copy in place of the
store (remove the old store's `-wal`/`-shm`), start it. A Redis store (`--redis-url`) is backed up
with Redis's own tools (docs/operations.md, "Backups").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path

from uibus.infra.config import Config


def backup(store: Path, dest: Path) -> int:
    """Copies `store` to `dest` (see the module docstring); returns the number of sessions copied."""
    if not store.is_file():
        raise FileNotFoundError(f"no store file {store}")
    if dest.exists():
        raise FileExistsError(f"{dest} exists: remove it or name another")
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    try:
        # Read-write only so that, when uibus is not running, closing it removes the -wal/-shm it opened
        # (a read-only one would leave them); it only reads, and a WAL reader blocks no writer.
        source = sqlite3.connect(store)
        try:
            copy = sqlite3.connect(tmp, isolation_level=None)
            try:
                source.backup(copy)  # all pages in one step: one snapshot, never restarted by a write
                copy.execute("PRAGMA journal_mode=DELETE")  # one file: no -wal/-shm beside the copy
                checked = [r[0] for r in copy.execute("PRAGMA quick_check(1)")]
                if checked != ["ok"]:
                    raise sqlite3.DatabaseError(f"the copy does not check: {checked[0]}")
                tables = {r[0] for r in copy.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                sessions = copy.execute("SELECT count(*) FROM sessions").fetchone()[0] if "sessions" in tables else 0
            finally:
                copy.close()
        finally:
            source.close()
        os.link(tmp, dest)  # never over a DEST that appeared meanwhile (rename would replace it)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return int(sessions)


def _run(ns: argparse.Namespace) -> int:
    if ns.redis_url:
        print("uibus backup: the store is Redis (--redis-url / UIBUS_REDIS_URL): back it up with Redis's own "
              "tools (BGSAVE, AOF); see docs/operations.md", file=sys.stderr)
        return 2
    store, dest = Path(ns.store).expanduser(), Path(ns.dest).expanduser()
    try:
        sessions = backup(store, dest)
    except (OSError, sqlite3.Error) as exc:
        print(f"uibus backup: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, sqlite3.Error) else 2
    print(f"backed up {store} ({sessions} sessions) to {dest}: {dest.stat().st_size} bytes, one file")
    return 0


def add_parser(sub: argparse._SubParsersAction,  # type: ignore[type-arg]
               client_options: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("backup", help="copy the SQLite store to one consistent file, safe while uibus serves it",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", help="the file to write (must not exist)")
    p.add_argument("--store", default=os.environ.get("UIBUS_STORE") or Config().store,
                   help="the SQLite store file (env UIBUS_STORE; default: serve's)")
    p.add_argument("--redis-url", default=os.environ.get("UIBUS_REDIS_URL", ""), help=argparse.SUPPRESS)
    p.set_defaults(func=_run)

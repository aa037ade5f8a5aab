"""`uibus audit verify` and `uibus audit export`: the audit log read straight from its store.

They read the store, not a server: a server that is down, or one whose tokens the reader does not
hold, does not stop an auditor with access to the store (docs/security/audit.md). The store is
named as `serve` names it: `--store` (the SQLite file) or `--redis-url` (with `--redis-cluster`).

`verify` exits 0 with "chain of N entries verified", or 1 naming the first broken entry's seq and
what is wrong with it (changed, removed, reordered); 2 when the store cannot be read.
`export` writes every entry (filtered) as JSON lines, exactly as stored.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import sys
from collections.abc import Callable
from typing import Any

from uibus.infra.audit import AuditBackend, Query, check_rows
from uibus.infra.audit_sqlite import SqliteAudit, open_file
from uibus.infra.config import Config


def _backend(ns: argparse.Namespace) -> tuple[AuditBackend, Callable[[], Any]]:
    """The audit backend of the store the flags name, and what closes it."""
    if ns.redis_url:
        from uibus.infra.redis import RedisStore
        from uibus.infra.redis.audit import RedisAudit

        store = RedisStore(ns.redis_url, cluster=ns.redis_cluster)
        return RedisAudit(store.redis, store.namespace), store.close
    db = open_file(ns.store)
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "audit" not in tables:
        db.close()
        raise FileNotFoundError(f"{ns.store} holds no audit log (no table `audit`)")

    async def close() -> None:
        db.close()
    return SqliteAudit(db), close


async def _verify(ns: argparse.Namespace) -> int:
    backend, close = _backend(ns)
    try:
        count, broken = await check_rows(backend)
    finally:
        await close()
    if broken is None:
        print(f"chain of {count} entries verified")
        return 0
    print(f"audit log broken at seq {broken.seq}: {broken.why} ({count} entries verified before it)", file=sys.stderr)
    return 1


async def _export(ns: argparse.Namespace) -> int:
    backend, close = _backend(ns)
    query = Query(session=ns.session, person=ns.person, act=ns.act, since_ms=ns.since, until_ms=ns.until, limit=1000)
    try:
        while True:
            page = await backend.query(query)
            for entry in page:
                sys.stdout.write(json.dumps(entry, sort_keys=True, ensure_ascii=False) + "\n")
            if len(page) < query.limit:
                return 0
            query.after = page[-1]["seq"]
    finally:
        await close()


def _run(fn: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    def run(ns: argparse.Namespace) -> int:
        try:
            return int(asyncio.run(fn(ns)))
        except (OSError, sqlite3.Error) as exc:
            print(f"uibus audit: cannot read the store: {exc}", file=sys.stderr)
            return 2
        except Exception as exc:  # Redis unreachable, a URL it cannot parse
            print(f"uibus audit: cannot read the store: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    return run


def add_parser(sub: argparse._SubParsersAction,  # type: ignore[type-arg]
               client_options: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("audit", help="verify or export the audit log, read from the store", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_subparsers(dest="audit_command", required=True)
    for name, fn, text in (("verify", _verify, "check the hash chain: exit 0, or 1 naming the first broken entry"),
                           ("export", _export, "print the entries as JSON lines, exactly as stored")):
        q = what.add_parser(name, help=text)
        q.add_argument("--store", default=os.environ.get("UIBUS_STORE") or Config().store,
                       help="the SQLite store file (env UIBUS_STORE; default: serve's)")
        q.add_argument("--redis-url", default=os.environ.get("UIBUS_REDIS_URL", ""),
                       help="read the audit log of this Redis instead (env UIBUS_REDIS_URL)")
        q.add_argument("--redis-cluster", action="store_true", help="--redis-url names a node of a Redis Cluster")
        if name == "export":
            q.add_argument("--session", default="", help="only this session's entries")
            q.add_argument("--person", default="", help="only this person's (or token name's) entries")
            q.add_argument("--act", default="", help="only this act (or acts starting so, ending in '.')")
            q.add_argument("--since", type=int, default=0, help="entries at or after this time (ms since the epoch)")
            q.add_argument("--until", type=int, default=0, help="entries before this time (ms since the epoch)")
        q.set_defaults(func=_run(fn))

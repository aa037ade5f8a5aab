"""Which audit backend a store has: the chain lives where the sessions do (the SQLite file, or the
Redis every replica shares), so one `--store` / `--redis-url` names both, for `serve` and for
`uibus audit verify`."""

from __future__ import annotations

import sqlite3
from typing import Any

from uibus.infra.audit import AuditBackend, AuditLog
from uibus.infra.audit_sqlite import SqliteAudit
from uibus.infra.sqlite_store import SqliteStore

__all__ = ["audit_log_for", "backend_for"]


def backend_for(store: Any) -> AuditBackend:
    """A table of the SQLite store's file; one chain in the store's Redis; in memory for any other
    store (an embedder's or a test's: nothing durable to write to)."""
    if isinstance(store, SqliteStore):
        return SqliteAudit(store.connection)
    redis = getattr(store, "redis", None)
    if redis is not None:
        from uibus.infra.redis.audit import RedisAudit

        return RedisAudit(redis, getattr(store, "namespace", "uibus"))
    return SqliteAudit(sqlite3.connect(":memory:", isolation_level=None))


def audit_log_for(store: Any, retention_days: float) -> AuditLog:
    return AuditLog(backend_for(store), retention_days=retention_days)

"""The audit log: who allowed, stopped, deleted, invited — one hash chain, append-only, durable.

Every entry is `{seq, time, act, who, person?, tenant, door, client, session, detail{…}, prev,
hash}`: `who`, `tenant`, `door` and `client` are the acting caller (`uibus.infra.actor.current()`, set
by the pipeline when it admits a call); `prev` is the hash of the entry before it and `hash` the
SHA-256 of the entry's canonical JSON (sorted keys, no spaces, UTF-8) without `hash`, so changing,
removing or reordering one stored entry breaks the chain at that entry (`verify`). Only the
first entries go at once, by age (`trim`): the hash of the last one removed is kept as the
*anchor* the remaining chain starts from, so a log trimmed by retention still verifies.

Where the entries live is a backend's business (`uibus.infra.audit_sqlite`: a table of the session
store's SQLite file; `uibus.infra.redis.audit`: one chain in Redis that every replica appends to with
a compare-and-set script). The hash is always computed here, in Python, so both write the same
entries and one `verify` reads both.

What is never written: token values (nothing that carries one is passed in: the actor is named by
the grant's person or its source, "--tokens-file line 3"; a detail key that names a secret is
dropped), and unbounded text (each detail value is cut to MAX_TEXT characters, at most MAX_KEYS
keys, the client's name to MAX_CLIENT).

When the store refuses a write, recording does not fail the act that already happened: the entry
waits in memory (a bounded backlog, in order) and is written when the store answers again; while
any entry waits, `ready()` raises UNAVAILABLE, which the dialogs ask before they take an answer, so
no approval or denial is given that the log cannot name (docs/security/audit.md, "When the store is down").
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from uibus.infra.actor import Actor, current
from uibus.infra.errors import Unavailable
from uibus.infra.tasks import cancel_and_wait

__all__ = ["GENESIS", "AuditBackend", "AuditLog", "Broken", "NoAudit", "Query", "Recorder", "Row", "check_rows",
           "entry_hash", "iso_time", "sealed"]

log = logging.getLogger("uibus.infra.audit")

GENESIS = "0" * 64  # the `prev` of the first entry ever written
MAX_TEXT = 1000  # characters kept of one detail value (a question, an answer)
MAX_KEYS = 16  # detail keys kept per entry
MAX_KEY = 40  # characters of a detail key
MAX_CLIENT = 120  # characters of the caller's client name (user-agent, clientInfo)
MAX_BACKLOG = 10_000  # entries kept in memory while the store refuses writes; beyond it they are counted lost
RETRY_S = 1.0  # how often a waiting backlog is tried again
SWEEP_S = 3600.0  # how often retention runs
MAX_PAGE = 1000  # entries one List call returns at most
SECRET_WORDS = ("token", "secret", "password", "authorization", "cookie", "bearer")
FIELDS = ("seq", "time", "act", "who", "tenant", "door", "client", "session", "detail", "prev", "hash")


def iso_time(ms: int) -> str:
    """An entry's time as written: UTC, milliseconds, `Z` (sortable, and readable in an export)."""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def time_ms(entry: dict[str, Any]) -> int:
    """The time of an entry as milliseconds since the epoch (from its `time`)."""
    return int(datetime.strptime(str(entry["time"]), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp() * 1000)


def canonical(entry: dict[str, Any]) -> bytes:
    return json.dumps(entry, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def entry_hash(entry: dict[str, Any]) -> str:
    """SHA-256 (hex) of the entry's canonical JSON without its `hash` (its `prev` included: the chain)."""
    return hashlib.sha256(canonical({k: v for k, v in entry.items() if k != "hash"})).hexdigest()


def sealed(body: dict[str, Any], seq: int, prev: str) -> dict[str, Any]:
    """`body` as entry `seq` of the chain whose last hash is `prev`."""
    entry = {**body, "seq": seq, "prev": prev}
    entry["hash"] = entry_hash(entry)
    return entry


def _clean(text: Any, limit: int) -> str:
    """`text` cut to `limit` characters, as UTF-8 can hold it: a lone surrogate (JSON allows one)
    becomes "?", so no entry fails to encode — one that did would wait in the backlog forever and
    refuse every answer after it."""
    return str(text)[:limit].encode("utf-8", "replace").decode("utf-8")


def _bounded(value: Any) -> str | int | bool:
    if isinstance(value, bool | int):
        return value
    text = str(value)
    return _clean(text, MAX_TEXT) if len(text) <= MAX_TEXT else _clean(text, MAX_TEXT) + "…"


def body_of(act: str, session: str, detail: dict[str, Any], actor: Actor, now_ms: int) -> dict[str, Any]:
    """An entry before it has a place in the chain (no seq, prev, hash)."""
    kept: dict[str, Any] = {}
    for key, value in detail.items():
        if len(kept) >= MAX_KEYS:
            kept["more"] = True
            break
        if value is None or any(word in key.lower() for word in SECRET_WORDS):
            continue  # nothing that may carry a secret is written, whatever a caller passes
        kept[_clean(key, MAX_KEY)] = _bounded(value)
    body: dict[str, Any] = {"time": iso_time(now_ms), "act": _clean(act, 64), "who": _clean(actor.who, 200),
                            "tenant": _clean(actor.tenant, 100), "door": _clean(actor.door, 32),
                            "client": _clean(actor.client, MAX_CLIENT), "session": _clean(session, 256), "detail": kept}
    if actor.person:
        body["person"] = body["who"]
    return body


@dataclass(frozen=True)
class Row:
    """One stored entry as the store holds it: its seq (the row's key), the entry's text, and the
    columns a store keeps beside it to filter on (each must agree with the entry)."""

    seq: int
    text: str
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Broken:
    """Where the chain first breaks, and what is wrong: changed, removed or reordered."""

    seq: int
    why: str


@dataclass
class Query:
    session: str = ""
    person: str = ""  # the entry's person, or its `who`
    act: str = ""  # an act, or a prefix ending in "." (`dialog.`)
    since_ms: int = 0
    until_ms: int = 0  # 0: no bound
    after: int = 0  # entries after this seq (paging)
    limit: int = 100

    def matches(self, entry: dict[str, Any]) -> bool:
        if self.session and entry.get("session") != self.session:
            return False
        if self.person and self.person not in (entry.get("person"), entry.get("who")):
            return False
        act = str(entry.get("act", ""))
        if self.act and not (act == self.act or (self.act.endswith(".") and act.startswith(self.act))):
            return False
        if self.since_ms or self.until_ms:
            at = time_ms(entry)
            if at < self.since_ms or (self.until_ms and at >= self.until_ms):
                return False
        return True


class AuditBackend(Protocol):
    """Where the chain is kept (uibus.infra.audit_sqlite, uibus.infra.redis.audit)."""

    async def append(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` sealed as the next entry of the chain, written; the entry."""
        ...

    async def query(self, query: Query) -> list[dict[str, Any]]:
        """The entries `query` matches, by seq, at most `query.limit`."""
        ...

    async def rows(self, after: int, limit: int) -> list[Row]:
        """Stored rows with seq > `after`, by seq (for `verify`, which reads the raw text)."""
        ...

    async def marks(self) -> tuple[tuple[int, str], tuple[int, str]]:
        """(anchor, head): the (seq, hash) the kept chain starts after, and its last entry's."""
        ...

    async def trim(self, before_ms: int) -> int:
        """Removes the entries older than `before_ms` from the start, moving the anchor; how many."""
        ...


def check_row(row: Row, last_seq: int, last_hash: str,
              start: bool = False) -> tuple[dict[str, Any] | None, Broken | None]:
    """One stored row against the chain so far: the entry, or where and how it is broken."""
    try:
        entry = json.loads(row.text)
        if not isinstance(entry, dict) or not isinstance(entry.get("seq"), int):
            raise ValueError("not an entry")
    except ValueError:
        return None, Broken(row.seq, f"entry {row.seq} was changed: its text is not an entry")
    if entry["seq"] != row.seq:
        return None, Broken(min(row.seq, entry["seq"]), f"entries were reordered: the row of seq {row.seq} "
                                                        f"holds entry {entry['seq']}")
    if row.seq != last_seq + 1:
        missing = f"{last_seq + 1}" if row.seq == last_seq + 2 else f"{last_seq + 1}..{row.seq - 1}"
        return None, Broken(last_seq + 1, f"entry {missing} was removed (the chain jumps from {last_seq} to {row.seq})")
    if entry_hash(entry) != entry.get("hash") or row.columns.get("hash", entry.get("hash")) != entry.get("hash"):
        return None, Broken(row.seq, f"entry {row.seq} was changed: its contents do not match its hash")
    if entry.get("prev") != last_hash:
        if start:  # the first entry kept: it, or the anchor retention left, was put in
            return None, Broken(row.seq, f"entry {row.seq} was replaced: its prev is not the chain's start (the "
                                         "anchor retention left)")
        return None, Broken(last_seq, f"entry {last_seq} was changed or replaced: entry {row.seq}'s prev is not "
                                      "its hash")
    for column, value in row.columns.items():
        if column != "hash" and value != (time_ms(entry) if column == "at_ms" else entry.get(column, "")):
            return None, Broken(row.seq, f"entry {row.seq} was changed: its stored {column} differs from the entry")
    return entry, None


async def check_rows(backend: AuditBackend, page: int = 1000) -> tuple[int, Broken | None]:
    """Walks the whole kept chain: (entries verified, the first break or None)."""
    (anchor_seq, anchor_hash), (head_seq, head_hash) = await backend.marks()
    last_seq, last_hash, n = anchor_seq, anchor_hash, 0
    while True:
        rows = await backend.rows(last_seq, page)
        for row in rows:
            if row.seq <= last_seq:  # two rows of one seq: a copy put in
                return n, Broken(row.seq, f"entry {row.seq} is stored twice (an entry was inserted)")
            entry, broken = check_row(row, last_seq, last_hash, n == 0)
            if broken is not None:
                return n, broken
            assert entry is not None
            last_seq, last_hash, n = row.seq, entry["hash"], n + 1
        if len(rows) < page:
            break
    if (last_seq, last_hash) != (head_seq, head_hash) and head_seq:
        if head_seq > last_seq:
            return n, Broken(last_seq + 1, f"entries {last_seq + 1}..{head_seq} were removed (the chain ends at "
                                           f"{last_seq}; its head says {head_seq})")
        return n, Broken(last_seq, f"entry {last_seq} was changed or replaced: the head's hash differs")
    return n, None


class Recorder(Protocol):
    """What the domain records through (its audit port, given at construction)."""

    async def record(self, act: str, *, session: str = "", **detail: str | int | bool | None) -> None: ...

    def note(self, act: str, *, session: str = "", **detail: str | int | bool | None) -> None:
        """`record` from code that cannot wait (written in the background, in order, by the same actor)."""
        ...

    def ready(self) -> None: ...


class NoAudit:
    """Records nothing (a domain built without an audit log: tests, embedders)."""

    async def record(self, act: str, *, session: str = "", **detail: str | int | bool | None) -> None:
        return None

    def note(self, act: str, *, session: str = "", **detail: str | int | bool | None) -> None:
        return None

    def ready(self) -> None:
        return None


class AuditLog:
    """The recorder the app builds over its store's backend; an async context manager that runs
    retention (`retention_days`, 0 = keep forever) and writes the backlog back while open."""

    def __init__(self, backend: AuditBackend, *, retention_days: float = 365.0) -> None:
        self.backend = backend
        self.retention_days = retention_days
        self.written = 0
        self.lost = 0  # entries dropped with the backlog full (logged; on /metrics)
        self._backlog: deque[dict[str, Any]] = deque()
        self._lock = asyncio.Lock()  # one append at a time from this process: in order, no self-conflict
        self._tasks: set[asyncio.Task[Any]] = set()
        self._retry: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        """Entries recorded but not yet written (the store refused them)."""
        return len(self._backlog)

    def ready(self) -> None:
        """Raises UNAVAILABLE while entries wait for the store: an approval must not go unrecorded."""
        if self._backlog:
            raise Unavailable(f"the audit log cannot write ({len(self._backlog)} entries wait for its store): "
                              "answers to dialogs are refused until it can")

    async def record(self, act: str, *, session: str = "", **detail: str | int | bool | None) -> None:
        """Appends one entry for the current actor. Never raises for the store (the act happened):
        an entry the store refuses waits in the backlog. The write goes on if the caller is cancelled."""
        body = body_of(act, session, detail, current(), int(time.time() * 1000))
        write = asyncio.ensure_future(self._write(body))
        self._tasks.add(write)
        write.add_done_callback(self._tasks.discard)
        await asyncio.shield(write)

    def note(self, act: str, *, session: str = "", **detail: str | int | bool | None) -> None:
        body = body_of(act, session, detail, current(), int(time.time() * 1000))
        write = asyncio.get_running_loop().create_task(self._write(body), name="uibus-audit-note")
        self._tasks.add(write)
        write.add_done_callback(self._tasks.discard)

    async def _write(self, body: dict[str, Any]) -> None:
        async with self._lock:
            if not self._backlog:
                try:
                    await self.backend.append(body)
                    self.written += 1
                    return
                except Exception as exc:  # the store's fault, whichever store: kept, retried
                    log.error("audit log: the store refused an entry; it waits in memory",
                              extra={"fields": {"act": body["act"], "error": f"{type(exc).__name__}: {exc}"[:300]}})
            self._keep(body)

    def _keep(self, body: dict[str, Any]) -> None:
        if len(self._backlog) >= MAX_BACKLOG:
            self.lost += 1
            log.error("audit log: backlog full, entry lost", extra={"fields": {"act": body["act"]}})
            return
        self._backlog.append(body)
        if self._retry is None or self._retry.done():
            self._retry = asyncio.get_running_loop().create_task(self._drain(), name="uibus-audit-backlog")

    async def _drain(self) -> None:
        """Writes the backlog in order once the store takes writes again."""
        while self._backlog:
            await asyncio.sleep(RETRY_S)
            async with self._lock:
                while self._backlog:
                    try:
                        await self.backend.append(self._backlog[0])
                    except Exception:
                        break
                    self._backlog.popleft()
                    self.written += 1
        log.info("audit log: backlog written")

    async def list(self, query: Query) -> list[dict[str, Any]]:
        query.limit = max(1, min(query.limit or 100, MAX_PAGE))
        return await self.backend.query(query)

    async def export(self, query: Query | None = None) -> AsyncIterator[dict[str, Any]]:
        """Every entry `query` matches, by seq, page by page."""
        query = query or Query()
        query.limit = MAX_PAGE
        while True:
            page = await self.backend.query(query)
            for entry in page:
                yield entry
            if len(page) < MAX_PAGE:
                return
            query.after = page[-1]["seq"]

    async def verify(self) -> tuple[int, Broken | None]:
        return await check_rows(self.backend)

    async def sweep(self) -> int:
        """Retention once: removes the entries older than `retention_days` (0: none)."""
        if self.retention_days <= 0:
            return 0
        return await self.backend.trim(int((time.time() - self.retention_days * 86400) * 1000))

    async def _sweep_loop(self) -> None:
        while True:
            try:
                removed = await self.sweep()
                if removed:
                    log.info("audit log: retention removed entries", extra={"fields": {"removed": removed}})
            except Exception as exc:
                log.warning("audit log: retention failed; tried again later",
                            extra={"fields": {"error": f"{type(exc).__name__}: {exc}"[:300]}})
            await asyncio.sleep(SWEEP_S)

    async def __aenter__(self) -> AuditLog:
        if self.retention_days > 0:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop(), name="uibus-audit-retention")
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Lets the writes under way finish (and the backlog one last try), then stops retention."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)
        for task in (self._sweeper, self._retry):
            await cancel_and_wait(task)
        if self._backlog:
            log.error("audit log: entries never written (the store refused them to the end)",
                      extra={"fields": {"entries": len(self._backlog)}})

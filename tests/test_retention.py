"""Session retention, on every store backend (SQLite file, a real redis-server, a real Redis Cluster
of 3 masters and 3 replicas): at most
`max_sessions` sessions are kept (the longest idle go first), a session idle longer than the TTL is
deleted by the sweep, the chat history stays within its byte bound, and /metrics counts all of it.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from tests.chatkit import answer
from tests.conftest import free_port, start_app
from tests.redisproc import RedisClusterProcess, RedisProcess, redis_cluster, redis_cluster_clean, redis_server
from tests.support import scrape
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.domain.feed import THEME_KEY
from uibus.domain.history import HISTORY_KEY
from uibus.infra.config import Config
from uibus.infra.redis import EMPTY_TAG
from uibus.infra.sqlite_store import SqliteStore
from uibus.infra.store import Store
from uibus.pb.cline import common_pb2
from uibus.pb.uibus.v1 import host_pb2

__all__ = ["redis_cluster", "redis_cluster_clean", "redis_server"]

DARK = '{"kind": "dark"}'


def on_redis(request: pytest.FixtureRequest, config: Config, kind: str) -> Config:
    """The test config on a real redis-server of its own, or on the shared cluster (emptied)."""
    if kind == "redis-cluster":
        cluster: RedisClusterProcess = request.getfixturevalue("redis_cluster_clean")
        return replace(config, redis_url=cluster.url, redis_cluster=True)
    server: RedisProcess = request.getfixturevalue("redis_server")
    return replace(config, redis_url=server.url)


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("redis-cluster", marks=pytest.mark.redis)])
def backend(request: pytest.FixtureRequest, config: Config) -> Config:
    """The test config on one backend: its SQLite file, a real redis-server of its own, or the cluster."""
    return config if request.param == "sqlite" else on_redis(request, config, request.param)


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("redis-cluster", marks=pytest.mark.redis)])
def redis_backend(request: pytest.FixtureRequest, config: Config) -> Config:
    return on_redis(request, config, request.param)


def open_store(cfg: Config, **retention: Any) -> Store:
    if cfg.redis_url:
        from uibus.infra.redis import RedisStore

        return RedisStore(cfg.redis_url, cluster=cfg.redis_cluster, **retention)
    return SqliteStore(cfg.store, **retention)


async def sessions_holding_data(cfg: Config) -> set[str]:
    """Every session that still has anything stored, read from the backend itself (not through the
    store), so a key that eviction forgot would show."""
    if not cfg.redis_url:
        with sqlite3.connect(cfg.store) as db:
            return {r[0] for r in db.execute("SELECT session FROM kv UNION SELECT session FROM lists UNION "
                                             "SELECT session FROM list_bytes UNION SELECT session FROM sessions")}
    from redis.asyncio import Redis

    if cfg.redis_cluster:  # every master, directly; the index keys (`{ix:<n>}`, never a session) are read
        from redis.asyncio.cluster import RedisCluster

        cluster = RedisCluster.from_url(cfg.redis_url)
        try:
            await cluster.initialize()
            nodes = [Redis(host=n.host, port=int(n.port)) for n in cluster.get_primaries()]
        finally:
            await cluster.aclose()
    else:
        nodes = [Redis.from_url(cfg.redis_url)]
    found: set[str] = set()
    try:
        for client in nodes:
            async for raw in client.scan_iter(match="uibus:{*", count=1000):  # a test may scan; the store never does
                key = raw.decode()
                tag = key.split("{", 1)[1].split("}", 1)[0]
                if tag.startswith("ix:"):
                    if key.endswith(":sessions"):
                        found |= {unquote(m.decode()) for m in await client.zrange(key, 0, -1)}
                    continue
                found.add("" if cfg.redis_cluster and tag == EMPTY_TAG else unquote(tag))
            if not cfg.redis_cluster:
                found |= {unquote(m.decode()) for m in await client.zrange("uibus:sessions", 0, -1)}
        return found
    finally:
        for client in nodes:
            await client.aclose()


def evicted(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], reason: str) -> float:
    return samples.get(("uibus_sessions_evicted_total", (("reason", reason),)), 0.0)


def size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())


async def theme_of(app: App, session: str) -> str:
    async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:
        return (await conn.host.GetSessionState(common_pb2.Empty())).theme


async def set_theme(app: App, session: str) -> None:
    async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:
        await conn.host.SetTheme(host_pb2.TextEvent(text=DARK))


async def test_ten_thousand_sessions_with_a_max_of_one_thousand_keep_the_newest(backend: Config) -> None:
    app = await start_app(replace(backend, max_sessions=1000, http_port=free_port()))
    try:
        await set_theme(app, "first")  # through gRPC, before the crowd
        await app.core.history.append("first", "user", "hello")
        for i in range(10_000):  # the crowd, at the store (gRPC for each would only make the test slow)
            await app.store.put(f"s{i}", THEME_KEY, DARK)
            if i % 10 == 9:
                await app.store.append(f"s{i}", HISTORY_KEY, {"i": i})
        await set_theme(app, "late")  # a new session through gRPC pushes out the longest idle one

        newest = {f"s{i}" for i in range(9001, 10_000)} | {"late"}
        assert await sessions_holding_data(app.config) == newest  # every value and list of the rest is gone
        assert await theme_of(app, "first") == ""  # evicted: its state is gone …
        assert await app.core.history.read("first") == []
        assert await theme_of(app, "s9000") == ""
        assert await theme_of(app, "s9999") == DARK  # … a recent one keeps it
        assert await app.core.history.read("s9999") == [{"i": 9999}]
        assert await theme_of(app, "late") == DARK

        samples = await scrape(app)
        assert evicted(samples, "max_sessions") == 10_002 - 1000
        assert evicted(samples, "idle") == 0
        assert samples[("uibus_sessions_stored", ())] == 1000
    finally:
        await app.aclose(grace=1.0)


async def test_an_idle_session_expires_and_an_active_one_stays(backend: Config) -> None:
    app = await start_app(replace(backend, session_ttl_seconds=1.0, http_port=free_port()))  # sweep every 0.25 s
    try:
        await set_theme(app, "idle")
        await app.core.history.append("idle", "user", "anyone?")
        written = time.monotonic()
        while await theme_of(app, "idle"):
            assert time.monotonic() - written < 5, "the idle session never expired"
            await set_theme(app, "busy")  # a write keeps a session alive
            await asyncio.sleep(0.1)
        assert time.monotonic() - written >= 0.9  # not before its TTL
        assert await app.core.history.read("idle") == []
        assert await theme_of(app, "busy") == DARK
        assert await sessions_holding_data(app.config) == {"busy"}
        samples = await scrape(app)
        assert evicted(samples, "idle") == 1
        assert evicted(samples, "max_sessions") == 0
        assert samples[("uibus_sessions_stored", ())] == 1
    finally:
        await app.aclose(grace=1.0)


async def test_chat_history_stays_within_its_byte_bound(backend: Config) -> None:
    app = await start_app(replace(backend, history_bytes=2048, http_port=free_port()))
    try:
        async with Connection(f"127.0.0.1:{app.port}", session="talk") as conn:
            for i in range(12):  # each turn stores the user's message and the reply
                last = await answer(conn, "hello_world", f"message number {i}", sly={"delay_ms": 0})
        for i in range(100):  # other sides append to the same history
            await app.core.history.append("talk", "user", f"from the UI {i} " + "x" * (i % 40), source="webview")
        kept = await app.core.history.read("talk")
        assert sum(size(e) for e in kept) <= 2048
        assert kept[-1]["text"] == "from the UI 99 " + "x" * 19  # the newest stays
        assert kept == sorted(kept, key=lambda e: e["ts"]) and len(kept) > 5
        assert last.text  # the chat worked (its turns are among the dropped, oldest entries)
        samples = await scrape(app)
        assert samples[("uibus_history_entries_dropped_total", ())] == 12 * 2 + 100 - len(kept)
    finally:
        await app.aclose(grace=1.0)


async def test_append_byte_bound_keeps_the_newest_that_fit_and_survives_reopening(backend: Config) -> None:
    entries = [{"i": i, "text": "x" * (i % 50)} for i in range(300)]
    store = open_store(backend)
    try:
        for e in entries:
            await store.append("s", "h", e, max_bytes=1000)
        kept = await store.items("s", "h")
        assert sum(map(size, kept)) <= 1000 < sum(map(size, entries[-len(kept) - 1:]))  # as many as fit
        assert kept == entries[-len(kept):]  # the newest, in order
        assert store.stats.history_dropped == 300 - len(kept)
        await store.append("s", "other", "untouched", max_bytes=1000)
    finally:
        await store.close()

    store = open_store(backend)  # the running byte total is stored, not rebuilt from memory
    try:
        for e in entries[:40]:
            await store.append("s", "h", e, max_bytes=1000)
        again = await store.items("s", "h")
        assert sum(map(size, again)) <= 1000 < sum(map(size, [*kept, *entries[:40]][-len(again) - 1:]))
        assert again == [*kept, *entries[:40]][-len(again):]
        big = {"text": "y" * 5000}  # alone over the bound: kept, so an append is never silently lost
        await store.append("s", "h", big, max_bytes=1000)
        assert await store.items("s", "h") == [big]
        await store.append("s", "h", {"i": -1}, max_bytes=1000)  # and the next one pushes it out
        assert await store.items("s", "h") == [{"i": -1}]
        assert store.stats.history_dropped == 40 + len(kept) - len(again) + len(again) + 1
        for i in range(5):  # the count bound still applies alongside
            await store.append("s", "h", {"i": i}, max_len=3, max_bytes=1000)
        assert await store.items("s", "h") == [{"i": 2}, {"i": 3}, {"i": 4}]
        assert await store.items("s", "other") == ["untouched"]
    finally:
        await store.close()


async def test_the_sweep_runs_while_entered_and_deletes_count_as_activity(backend: Config) -> None:
    store = open_store(backend, ttl_s=0.5, sweep_s=0.05)
    async with store:
        await store.put("gone", "k", 1)
        await store.append("gone", "l", "item")
        await store.put("kept", "k", 1)
        await store.put("never", "k", None)  # deleting from an unknown session creates none
        start = time.monotonic()
        while await store.get("gone", "k") is not None:
            assert time.monotonic() - start < 5, "the sweep never deleted the idle session"
            await store.put("kept", "missing", None)  # a delete in an existing session is activity
            await asyncio.sleep(0.05)
        assert await store.items("gone", "l") == []
        assert await store.get("kept", "k") == 1
        assert store.stats.evicted_idle == 1 and store.stats.sessions == 1
    sweeper = store._sweeper
    assert sweeper is None  # closed with the store
    assert await sessions_holding_data(backend) == {"kept"}


async def test_any_session_name_is_evicted_whole_and_a_lowered_bound_is_enforced_by_the_sweep(
        backend: Config) -> None:
    store = open_store(backend, max_sessions=2)
    try:
        for session in ("", "a:b", "{x}"):
            await store.put(session, "k", session)
            await store.append(session, "l:1", session)
        assert await sessions_holding_data(backend) == {"a:b", "{x}"}  # "" was the longest idle
        await store.put("", "k", "back")
        assert await sessions_holding_data(backend) == {"{x}", ""}
        assert await store.items("", "l:1") == [] and await store.get("", "k") == "back"
        assert store.stats.evicted_over_max == 2
    finally:
        await store.close()
    lowered = open_store(backend, max_sessions=1)  # e.g. a restart with a smaller --max-sessions
    try:
        await lowered.sweep()
        assert await sessions_holding_data(backend) == {""}
        assert lowered.stats.evicted_over_max == 1 and lowered.stats.sessions == 1
    finally:
        await lowered.close()


async def test_redis_replicas_evict_each_session_once(redis_backend: Config) -> None:
    """Two stores on one Redis (two replicas) create sessions concurrently over the bound: together
    they evict exactly the surplus, each session once, and never go below the bound."""
    cfg = redis_backend
    a, b = (open_store(cfg, max_sessions=100, ttl_s=60) for _ in range(2))
    try:
        async def writer(store: Store, name: str) -> None:
            for i in range(500):
                await store.put(f"{name}{i}", "k", i)

        await asyncio.gather(writer(a, "a"), writer(b, "b"), writer(a, "c"), writer(b, "d"))
        assert a.stats.evicted_over_max + b.stats.evicted_over_max == 2000 - 100
        assert len(await sessions_holding_data(cfg)) == 100
        for store in (a, b):  # the sweep enforces the bound too, and finds nothing more to do
            await store.sweep()
            assert store.stats.sessions == 100
        assert a.stats.evicted_over_max + b.stats.evicted_over_max == 2000 - 100
        a.ttl_s = b.ttl_s = 0.001  # now all of them are idle: each is deleted by one replica
        await asyncio.sleep(0.01)
        await asyncio.gather(a.sweep(), b.sweep())
        assert a.stats.evicted_idle + b.stats.evicted_idle == 100
        assert await sessions_holding_data(cfg) == set()
    finally:
        await a.close()
        await b.close()


OLD_SCHEMA = """
CREATE TABLE kv (session TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL,
  PRIMARY KEY (session, key)) WITHOUT ROWID;
CREATE TABLE lists (session TEXT NOT NULL, key TEXT NOT NULL, seq INTEGER NOT NULL, value TEXT NOT NULL,
  PRIMARY KEY (session, key, seq)) WITHOUT ROWID;
"""


async def test_a_sqlite_file_of_the_previous_version_is_migrated(tmp_path: Path) -> None:
    path = str(tmp_path / "old.db")
    with sqlite3.connect(path) as db:  # as the version without retention wrote it
        db.executescript(OLD_SCHEMA)
        db.execute("INSERT INTO kv VALUES ('old1', 'ui/theme', ?)", (json.dumps(DARK),))
        db.executemany("INSERT INTO lists VALUES ('old2', 'h', ?, ?)", [(i, json.dumps("x" * 98)) for i in range(3)])
    store = SqliteStore(path, max_sessions=2)
    try:
        assert store.stats.sessions == 2  # both count, as active from now on
        assert await store.get("old1", "ui/theme") == DARK
        assert await store.items("old2", "h") == ["x" * 98] * 3
        await store.append("old2", "h", "y" * 98, max_bytes=300)  # sizes were computed: 4 x 100 bytes > 300
        assert await store.items("old2", "h") == ["x" * 98] * 2 + ["y" * 98]
        assert store.stats.history_dropped == 1
        await store.put("new", "k", 1)  # over the bound: old1 is the longest idle
        assert await store.get("old1", "ui/theme") is None
        assert await store.items("old2", "h") == ["x" * 98] * 2 + ["y" * 98]
        assert store.stats.evicted_over_max == 1
    finally:
        await store.close()
    reopened = SqliteStore(path)  # a migrated file opens as a current one
    try:
        assert reopened.stats.sessions == 2
        assert await reopened.get("new", "k") == 1
    finally:
        await reopened.close()

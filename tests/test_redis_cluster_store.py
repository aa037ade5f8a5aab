"""RedisStore on the topologies that survive losing a master: a real Redis Cluster (3 masters, 3
replicas) and a real master set behind three sentinels. A master is SIGKILLed; the store reports
the outage (StoreUnavailable, unhealthy) instead of hanging, and once a replica is promoted the
same store object serves every session again, with the data it had, without a restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from tests.conftest import run_reporter
from tests.redisproc import (
    RedisClusterProcess,
    RedisSentinelProcess,
    fresh_redis_cluster,
    redis_cluster,
    redis_cluster_clean,
    redis_sentinel,
)
from uibus.infra.redis import INDEX_SHARDS, RedisStore
from uibus.infra.store import StoreUnavailable

__all__ = ["fresh_redis_cluster", "redis_cluster", "redis_cluster_clean", "redis_sentinel"]

# The promotion itself takes 2-3 s here (1 s node timeout / down-after); the store must follow it
# within this long after the kill, probe period and client reconnects included.
FAILOVER_WINDOW_S = 15.0


async def node_keys(port: int) -> list[str]:
    """The uibus keys the node on `port` holds, read from that node alone."""
    client = Redis(port=port)
    try:
        return [k.decode() async for k in client.scan_iter(match="uibus:*", count=1000)]
    finally:
        await client.aclose()


async def replicated(ports: list[int]) -> None:
    """WAIT on each master until its replica has every write so far (replication is async: a
    write the replica never got is lost in a failover, by Redis's design, not the store's)."""
    for port in ports:
        client = Redis(port=port)
        try:
            assert await client.execute_command("WAIT", 1, 5000) == 1, f"the replica of {port} lags"
        finally:
            await client.aclose()


async def until_ok(call: Callable[[], Awaitable[Any]], timeout: float, what: str) -> Any:
    """Retries `call` while it raises StoreUnavailable (any other error fails); its result."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await asyncio.wait_for(call(), 10)
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: still unavailable after {timeout}s") from None
            await asyncio.sleep(0.05)


async def wait_healthy(store: RedisStore, timeout: float) -> float:
    start = time.monotonic()
    while not store.healthy:
        assert time.monotonic() - start < timeout, f"the store stayed unhealthy: {store.problem}"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_sessions_and_the_index_spread_over_every_master(redis_cluster_clean: RedisClusterProcess) -> None:
    cluster = redis_cluster_clean
    store = RedisStore(cluster.url, cluster=True, max_sessions=1000)
    try:
        for i in range(60):
            await store.put(f"user-{i}", "ui/theme", {"i": i})
            await store.append(f"user-{i}", "history", {"text": f"hello {i}"})
        masters = cluster.masters()
        assert len(masters) == 3
        held = {port: await node_keys(port) for port, _ in masters}
        sessions = {port: {k for k in keys if ":{ix:" not in k and k.endswith(":kv")} for port, keys in held.items()}
        assert all(len(s) >= 5 for s in sessions.values()), {p: len(s) for p, s in sessions.items()}
        assert sum(map(len, sessions.values())) == 60  # each session's keys on exactly one master …
        for port, keys in held.items():  # … all of them together (one slot: one hash tag)
            for kv in sessions[port]:
                base = kv.removesuffix(":kv")
                assert {base + ":lists", base + ":seen", base + ":list:history"} <= set(keys)
        indexes = {port: [k for k in keys if k.endswith(":sessions")] for port, keys in held.items()}
        assert all(indexes.values()), indexes  # the index is split over every master too
        assert sum(map(len, indexes.values())) == INDEX_SHARDS
        assert store.stats.sessions == 60
        assert await store.get("user-59", "ui/theme") == {"i": 59}
    finally:
        await store.close()


async def test_a_killed_cluster_master_is_an_outage_until_its_replica_takes_over(
        fresh_redis_cluster: RedisClusterProcess, pytestconfig: pytest.Config) -> None:
    cluster = fresh_redis_cluster
    report = run_reporter(pytestconfig, "redis-cluster failover")
    store = RedisStore(cluster.url, cluster=True, max_sessions=1000, ttl_s=3600)
    sessions = [f"s{i}" for i in range(40)]
    try:
        for s in sessions:
            await store.put(s, "k", s)
            await store.append(s, "h", "before")
        await replicated([port for port, _ in cluster.masters()])
        await store.probe()
        victim = next(s for s in sessions if cluster.master_of(f"uibus:{{{s}}}:kv") == cluster.masters()[0][0])
        killed_at = time.monotonic()
        port = cluster.kill_master_of(f"uibus:{{{victim}}}:kv")

        with pytest.raises(StoreUnavailable):  # a quick error, not a hang
            await asyncio.wait_for(store.get(victim, "k"), 10)
        assert not store.healthy
        with pytest.raises(StoreUnavailable):  # the probe fails while a slot range has no master
            await asyncio.wait_for(store.probe(), 10)

        promoted = cluster.wait_failover(FAILOVER_WINDOW_S)
        assert port not in [p for p, _ in cluster.masters()]
        for s in sessions:  # every session, on the promoted replica too: what it had, writable again
            assert await until_ok(lambda s=s: store.get(s, "k"), FAILOVER_WINDOW_S, s) == s
            await until_ok(lambda s=s: store.append(s, "h", "after"), FAILOVER_WINDOW_S, s)
            assert await store.items(s, "h") == ["before", "after"]
        serving = time.monotonic() - killed_at
        healthy = await wait_healthy(store, FAILOVER_WINDOW_S)
        total = time.monotonic() - killed_at
        assert total < FAILOVER_WINDOW_S
        await store.probe()
        await store.sweep()  # retention works across the new layout of masters
        assert store.stats.sessions == len(sessions)
        report(f"master {port} killed: replica promoted after {promoted:.2f}s, every session served after "
               f"{serving:.2f}s, store healthy after {total:.2f}s (+{healthy:.2f}s)")
    finally:
        await store.close()


async def test_a_killed_sentinel_master_is_followed_by_the_same_store(
        redis_sentinel: RedisSentinelProcess, pytestconfig: pytest.Config) -> None:
    sentinel = redis_sentinel
    report = run_reporter(pytestconfig, "redis-sentinel failover")
    store = RedisStore(sentinel.url, max_sessions=1000)
    try:
        for i in range(20):
            await store.put(f"s{i}", "k", i)
            await store.append(f"s{i}", "h", "before")
        assert await store.update("s0", "n", lambda v: (v or 0) + 1) == 1
        await replicated([sentinel.master_port()])
        killed_at = time.monotonic()
        old = sentinel.kill_master()

        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(store.put("s1", "k", -1), 10)
        assert not store.healthy

        promoted = sentinel.wait_promoted(old, FAILOVER_WINDOW_S)
        assert sentinel.master_port() != old
        await until_ok(lambda: store.put("new", "k", "after"), FAILOVER_WINDOW_S, "a write after the failover")
        serving = time.monotonic() - killed_at
        for i in range(20):
            assert await store.get(f"s{i}", "k") == i
            await store.append(f"s{i}", "h", "after")
            assert await store.items(f"s{i}", "h") == ["before", "after"]
        assert await store.update("s0", "n", lambda v: (v or 0) + 1) == 2
        assert await store.get("new", "k") == "after"
        await wait_healthy(store, FAILOVER_WINDOW_S)
        total = time.monotonic() - killed_at
        assert total < FAILOVER_WINDOW_S
        report(f"master {old} killed: replica promoted after {promoted:.2f}s, writes served after {serving:.2f}s, "
               f"store healthy after {total:.2f}s")
    finally:
        await store.close()

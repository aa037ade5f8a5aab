"""uibus on the Redis topologies operators run for availability, as real processes: a Redis Cluster
of 3 masters + 3 replicas with a master SIGKILLed, and a master set behind three sentinels with
its master SIGKILLed. Two uibus replicas stay up throughout; nothing is restarted but Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import start_app, wait_for
from tests.redisproc import (
    RedisClusterProcess,
    RedisSentinelProcess,
    fresh_redis_cluster,
    redis_cluster,
    redis_cluster_clean,
    redis_sentinel,
)
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra import kinds
from uibus.infra.config import Config
from uibus.infra.redis import RedisStore, ReplicatedBus, shard_of
from uibus.pb.cline import common_pb2
from uibus.pb.uibus.v1 import host_pb2

__all__ = ["fresh_redis_cluster", "redis_cluster", "redis_cluster_clean", "redis_sentinel"]

SESSIONS = [f"team-{i}" for i in range(24)]  # spread over every master's slots


@asynccontextmanager
async def two_apps(tmp_path: Path, url: str, cluster: bool) -> AsyncIterator[tuple[App, App]]:
    apps: list[App] = []
    try:
        for name in ("a", "b"):
            apps.append(await start_app(Config(host="127.0.0.1", port=0, http_port=0, store=str(tmp_path / name),
                                               redis_url=url, redis_cluster=cluster, grace_seconds=1.0)))
        await wait_for(lambda: all(not app.not_ready() for app in apps), timeout=10, what="both replicas ready")
        yield apps[0], apps[1]
    finally:
        for app in apps:
            await app.aclose(grace=0.5)


async def serving(app: App) -> bool:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def health_becomes(apps: tuple[App, ...], want: bool, timeout: float) -> None:
    """Polls gRPC health (which follows readiness within a poll) until it is `want` on every app
    (True) or on some app (False)."""
    deadline = time.monotonic() + timeout
    while True:
        states = [await serving(app) for app in apps]
        if (all(states) if want else not all(states)):
            return
        assert time.monotonic() < deadline, f"health never became {'SERVING' if want else 'NOT_SERVING'}: {states}"
        await asyncio.sleep(0.1)


async def every_session_crosses(a: App, b: App, tag: str, timeout: float) -> float:
    """Subscribes every session on B (waiting for the headers), sets its theme on A (store) and
    publishes one event per session on A (bus); retries until B got all of them. Returns seconds."""
    start = time.monotonic()
    pending = set(SESSIONS)
    while pending:
        assert time.monotonic() - start < timeout, f"sessions not served after {timeout}s: {sorted(pending)[:5]}"
        for session in sorted(pending):
            try:
                async with Connection(f"127.0.0.1:{a.port}", session=session) as on_a, \
                        Connection(f"127.0.0.1:{b.port}", session=session) as on_b:
                    stream = on_b.ui.subscribeToAddToInput(common_pb2.EmptyRequest())
                    await asyncio.wait_for(stream.initial_metadata(), 3)
                    await on_a.host.SetTheme(host_pb2.TextEvent(text=f'{{"tag":"{tag}"}}'), timeout=3)
                    await on_a.host.PublishAddToInput(host_pb2.TextEvent(text=f"{tag}/{session}"), timeout=3)
                    got = await asyncio.wait_for(stream.read(), 3)
                    state = await on_b.host.GetSessionState(common_pb2.Empty(), timeout=3)
                    stream.cancel()
                    if got.value == f"{tag}/{session}" and tag in state.theme:
                        pending.discard(session)
            except (grpc.aio.AioRpcError, TimeoutError):
                await asyncio.sleep(0.2)  # a slot without a master yet: UNAVAILABLE, or no event
    return time.monotonic() - start


async def test_a_killed_cluster_master_fails_over_and_every_session_is_served_again(
        fresh_redis_cluster: RedisClusterProcess, tmp_path: Path) -> None:
    cluster = fresh_redis_cluster
    async with two_apps(tmp_path, cluster.url, True) as (a, b):
        await every_session_crosses(a, b, "before", timeout=15)
        # The sessions' keys are spread over the masters (the `{session}` hash tag).
        owners = {cluster.master_of(f"uibus:{{{s}}}:kv") for s in SESSIONS}
        assert len(owners) == 3, owners
        victim_session = SESSIONS[0]
        # Webviews stay subscribed on B through the failover (each shard's master holds their SSUBSCRIBE).
        watching = [Connection(f"127.0.0.1:{b.port}", session=s) for s in SESSIONS]
        views = [c.ui.subscribeToAddToInput(common_pb2.EmptyRequest()) for c in watching]
        for view in views:
            await view.initial_metadata()
        killed = cluster.kill_master_of(f"uibus:bus:{{{shard_of(victim_session, 256)}}}")
        await health_becomes((a, b), False, 5)  # NOT_SERVING while a slot range is down
        failover_s = await asyncio.to_thread(cluster.wait_failover, 30)
        recovered_s = await every_session_crosses(a, b, "after", timeout=30)
        await wait_for(lambda: a.not_ready() is None and b.not_ready() is None, timeout=15, what="both ready")
        await health_becomes((a, b), True, 5)
        # The webviews that stayed subscribed through it hear what is published now, on every session.
        for session in SESSIONS:
            async with Connection(f"127.0.0.1:{a.port}", session=session) as on_a:
                await on_a.host.PublishAddToInput(host_pb2.TextEvent(text=f"kept/{session}"))
        for session, view in zip(SESSIONS, views, strict=True):
            while (await asyncio.wait_for(view.read(), 5)).value != f"kept/{session}":
                pass  # (the "after" round's own events come first)
        for view in views:
            view.cancel()
        for conn in watching:
            await conn.close()
        print(f"killed master {killed}: cluster failover {failover_s:.1f}s, every session served "
              f"{recovered_s:.1f}s later")
        # Nothing published after the recovery is lost: a burst on every session, A -> B.
        async with Connection(f"127.0.0.1:{b.port}", session=victim_session) as on_b, \
                Connection(f"127.0.0.1:{a.port}", session=victim_session) as on_a:
            stream = on_b.ui.subscribeToAddToInput(common_pb2.EmptyRequest())
            await stream.initial_metadata()
            for i in range(200):
                await on_a.host.PublishAddToInput(host_pb2.TextEvent(text=f"burst {i}"))
            assert [(await asyncio.wait_for(stream.read(), 5)).value for _ in range(200)] == \
                [f"burst {i}" for i in range(200)]
            stream.cancel()
        assert isinstance(a.bus, ReplicatedBus) and a.bus.stats.dropped == 0
        await wait_for(lambda: a.bus.count() == 0 and b.bus.count() == 0, what="every stream gone")


async def test_the_bus_and_store_follow_a_sentinel_failover_without_a_restart(
        redis_sentinel: RedisSentinelProcess, tmp_path: Path) -> None:
    async with two_apps(tmp_path, redis_sentinel.url, False) as (a, b):
        assert isinstance(a.store, RedisStore)
        await every_session_crosses(a, b, "before", timeout=15)
        old = redis_sentinel.kill_master()
        promoted_s = await asyncio.to_thread(redis_sentinel.wait_promoted, old, 30)
        assert redis_sentinel.master_port() != old
        recovered_s = await every_session_crosses(a, b, "after", timeout=30)
        await wait_for(lambda: a.not_ready() is None and b.not_ready() is None, timeout=15, what="both ready")
        await health_becomes((a, b), True, 5)
        print(f"sentinel promoted a new master in {promoted_s:.1f}s; every session served {recovered_s:.1f}s later")
        await wait_for(lambda: a.bus.count(kinds.ADD_TO_INPUT) == 0 and b.bus.count(kinds.ADD_TO_INPUT) == 0,
                       what="every stream gone")


async def test_the_cluster_bus_counts_shards_and_spreads_them_over_the_masters(
        redis_cluster_clean: RedisClusterProcess, tmp_path: Path) -> None:
    async with two_apps(tmp_path, redis_cluster_clean.url, True) as (_, b):
        assert isinstance(b.bus, ReplicatedBus)
        conns = [Connection(f"127.0.0.1:{b.port}", session=s) for s in SESSIONS]
        try:
            streams = [c.ui.subscribeToAddToInput(common_pb2.EmptyRequest()) for c in conns]
            for stream in streams:
                await stream.initial_metadata()
            shards = {shard_of(s, 256) for s in SESSIONS}
            assert b.bus.shards_subscribed == len(shards)
            assert len([link for link in b.bus._links.values() if link.want]) == 3  # one per master
            for stream in streams:
                stream.cancel()
        finally:
            for conn in conns:
                await conn.close()
        await wait_for(lambda: b.bus.count() == 0, what="streams gone")


async def test_a_write_failover_waits_only_a_round_trip_for_replicas_that_kept_listening(
        fresh_redis_cluster: RedisClusterProcess) -> None:
    """A's writes to one master fail while B listens only to another master's shards, so B never
    loses a subscription and has no reason to say hello: A asks "who listens?" once the cluster
    answers again, and sends its buffer a round trip later, not after resubscribe_s (4 s)."""
    cluster = fresh_redis_cluster
    on_first = next(s for s in (f"s{i}" for i in range(10_000))
                    if cluster.master_of(f"uibus:bus:{{{shard_of(s, 256)}}}") == cluster.masters()[0][0])
    ctl_master = cluster.master_of("uibus:bus:ctl")
    elsewhere = next(s for s in (f"t{i}" for i in range(10_000))
                     if cluster.master_of(f"uibus:bus:{{{shard_of(s, 256)}}}") not in
                     (cluster.masters()[0][0], ctl_master))
    # Heartbeats far apart, so B's next one cannot stand in for the answer (it used to, now and then).
    a = ReplicatedBus(cluster.url, cluster=True, heartbeat_s=30)
    b = ReplicatedBus(cluster.url, cluster=True, heartbeat_s=30)
    await a.start()
    await b.start()
    try:
        listening = b.subscribe(on_first, kinds.ADD_TO_INPUT)
        await b.ready(on_first)
        await wait_for(lambda: a._presence.seen.get(b.replica_id, 0) > 0, timeout=5, what="A heard B's hello")
        victim = cluster.master_of(f"uibus:bus:{{{shard_of(elsewhere, 256)}}}")
        cluster.kill_node(victim)
        a.publish(elsewhere, kinds.ADD_TO_INPUT, common_pb2.String(value="buffered"))
        await wait_for(lambda: not a._writer_up, timeout=5, what="A's write fails")
        await asyncio.to_thread(cluster.wait_failover, 30)
        ok_at = time.monotonic()
        await wait_for(lambda: a._writer_up, timeout=10, what="A writes again")
        waited = time.monotonic() - ok_at
        print(f"A wrote again {waited:.2f}s after the failover")
        assert waited < 3.0, f"A held its buffer {waited:.1f}s after the failover"
        assert b.connected and b.stats.outages == 0  # B lost nothing
        b.unsubscribe(listening)
    finally:
        await a.stop()
        await b.stop()

"""Sharded bus channels: a replica hears only the shards its subscribers are in, so its bus work
is what its own subscribers need however many replicas there are (docs/scaling.md). Real uibus apps on
one real redis-server, real gRPC streams; the counts are read from each replica's /metrics."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from tests.conftest import free_port, start_app, wait_for
from tests.redisproc import RedisProcess, redis_server
from tests.support import scrape_by_name
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra import kinds
from uibus.infra.config import Config
from uibus.infra.redis import ReplicatedBus, shard_of
from uibus.pb.cline import common_pb2
from uibus.pb.uibus.v1 import host_pb2

__all__ = ["redis_server"]

EVENTS = 150  # per session
SESSIONS = 3  # per replica


def bus_of(app: App) -> ReplicatedBus:
    assert isinstance(app.bus, ReplicatedBus)
    return app.bus


@asynccontextmanager
async def replicas(redis_url: str, tmp_path: Path, n: int, shards: int) -> AsyncIterator[list[App]]:
    apps: list[App] = []
    try:
        for i in range(n):
            apps.append(await start_app(Config(host="127.0.0.1", port=0, http_port=free_port(),
                                               store=str(tmp_path / f"r{shards}-{i}.db"), redis_url=redis_url,
                                               bus_shards=shards, grace_seconds=1.0)))
        await wait_for(lambda: all(bus_of(a).connected for a in apps), what="every replica on redis")
        yield apps
    finally:
        for app in apps:
            await app.aclose(grace=0.5)


def disjoint_sessions(n: int, shards: int) -> list[list[str]]:
    """SESSIONS names per replica, no two replicas' sessions in one shard (with 256 shards a few
    of a dozen random names would share one now and then; the test is about the mechanism)."""
    taken: set[int] = set()
    out: list[list[str]] = []
    i = 0
    for _ in range(n):
        mine: list[str] = []
        while len(mine) < SESSIONS:
            name, i = f"user-{i}", i + 1
            shard = shard_of(name, shards)
            if shards == 1 or shard not in taken:
                taken.add(shard)
                mine.append(name)
        out.append(mine)
    return out


async def fan_in(apps: list[App], shards: int) -> list[float]:
    """Every replica's SESSIONS sessions subscribed on it; EVENTS events per session published
    through random replicas. Returns, per replica, envelopes received / envelopes it needed."""
    rng = random.Random(27)
    sessions = disjoint_sessions(len(apps), shards)
    conns: list[Connection] = []
    streams: dict[str, grpc.aio.UnaryStreamCall] = {}
    try:
        for app, names in zip(apps, sessions, strict=True):
            for name in names:
                conn = Connection(f"127.0.0.1:{app.port}", session=name)
                conns.append(conn)
                streams[name] = conn.ui.subscribeToAddToInput(common_pb2.EmptyRequest())
                await streams[name].initial_metadata()  # headers: live on every replica
        publishers: dict[tuple[int, str], Connection] = {}
        before = [await scrape_by_name(app) for app in apps]
        needed = [0] * len(apps)
        home = {name: i for i, names in enumerate(sessions) for name in names}
        sent = {name: [f"{name}/{k}" for k in range(EVENTS)] for name in home}
        route: dict[str, int] = {}  # event -> the replica it was published through
        for k in range(EVENTS):  # bounded: EVENTS rounds over every session
            for name in home:
                via = rng.randrange(len(apps))
                route[sent[name][k]] = via
                if via != home[name]:
                    needed[home[name]] += 1
                stub = publishers.get((via, name))
                if stub is None:
                    stub = publishers[(via, name)] = Connection(f"127.0.0.1:{apps[via].port}", session=name)
                    conns.append(stub)
                await stub.host.PublishAddToInput(host_pb2.TextEvent(text=sent[name][k]))

        async def read(name: str) -> list[str]:
            return [(await asyncio.wait_for(streams[name].read(), 5)).value for _ in range(EVENTS)]

        got = dict(zip(home, await asyncio.gather(*(read(n) for n in home)), strict=True))
        # Every event delivered once, and a publisher's (one replica's) in the order it published them.
        # Two replicas' events for one session may cross, even published one after the other: the
        # publish returns once the event is in its replica's outbox for Redis, and one published on
        # the session's own replica is delivered there at once (~1 run in 8 here under load).
        for name, events in sent.items():
            assert sorted(got[name]) == sorted(events), name
            for via in range(len(apps)):
                assert [e for e in got[name] if route[e] == via] == [e for e in events if route[e] == via], (name, via)
        after = [await scrape_by_name(app) for app in apps]
        ratios = []
        for i in range(len(apps)):
            received = after[i]["uibus_replication_received_total"] - before[i]["uibus_replication_received_total"]
            ratios.append(received / needed[i])
        for stream in streams.values():
            stream.cancel()
        for app in apps:
            await wait_for(lambda app=app: app.bus.count(kinds.ADD_TO_INPUT) == 0, what="streams gone")
        return ratios
    finally:
        for conn in conns:
            await conn.close()


async def test_four_replicas_each_receive_only_what_their_subscribers_need(
        redis_server: RedisProcess, tmp_path: Path) -> None:
    async with replicas(redis_server.url, tmp_path, 4, 256) as apps:
        sharded = await fan_in(apps, 256)
    print(f"envelopes received / needed per replica: sharded {sharded}")
    assert max(sharded) <= 1.25, sharded
    async with replicas(redis_server.url, tmp_path, 4, 1) as apps:  # one channel: what uibus did before
        single = await fan_in(apps, 1)
    print(f"one channel {single}")
    assert min(single) >= 3.0, single  # every replica got (about) every envelope of every session


async def test_a_shard_is_followed_while_subscribed_then_left_after_its_linger(
        redis_server: RedisProcess, tmp_path: Path) -> None:
    async with replicas(redis_server.url, tmp_path, 2, 256) as (a, b):
        bus = bus_of(b)
        bus._shards.linger_s = 0.3  # the test's churn window
        conn = Connection(f"127.0.0.1:{b.port}", session="lingering")
        try:
            first = conn.ui.subscribeToAddToInput(common_pb2.EmptyRequest())
            await first.initial_metadata()
            assert (await scrape_by_name(b))["uibus_replication_shards_subscribed"] == 1
            first.cancel()
            await wait_for(lambda: bus.count() == 0, what="stream gone")
            second = conn.ui.subscribeToAddToInput(common_pb2.EmptyRequest())  # within the linger: no resubscribe
            await second.initial_metadata()
            assert bus.shards_subscribed == 1
            async with Connection(f"127.0.0.1:{a.port}", session="lingering") as pub:
                await pub.host.PublishAddToInput(host_pb2.TextEvent(text="still heard"))
            assert (await asyncio.wait_for(second.read(), 3)).value == "still heard"
            second.cancel()
            await wait_for(lambda: bus.count() == 0, what="stream gone")
            await wait_for(lambda: bus.shards_subscribed == 0 and not bus._shards, timeout=3,
                           what="the shard left after the linger")
            assert (await scrape_by_name(b))["uibus_replication_shards_subscribed"] == 0
        finally:
            await conn.close()


async def test_open_url_on_a_replica_with_no_subscriber_sees_a_host_elsewhere(
        redis_server: RedisProcess, tmp_path: Path) -> None:
    """openUrl asks whether any host listens: the replica it lands on follows the session's shard
    (reads its presence hash) before it answers, so the first call already knows."""
    async with replicas(redis_server.url, tmp_path, 2, 256) as (a, b):
        host = Connection(f"127.0.0.1:{b.port}", session="browse")
        webview = Connection(f"127.0.0.1:{a.port}", session="browse")
        try:
            requests = host.host.SubscribeHostRequests(common_pb2.Empty())
            await requests.initial_metadata()
            await webview.ui.openUrl(common_pb2.StringRequest(value="https://example.com/"))
            assert (await asyncio.wait_for(requests.read(), 3)).open_url.url == "https://example.com/"
            requests.cancel()
            await wait_for(lambda: bus_of(b).count() == 0, what="host stream gone")
            await wait_for(lambda: bus_of(a).remote_count("browse", kinds.HOST_REQUEST) == 0, what="A told")
            try:
                await webview.ui.openUrl(common_pb2.StringRequest(value="https://example.com/"))
                raise AssertionError("openUrl with no host anywhere succeeded")
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            await host.close()
            await webview.close()

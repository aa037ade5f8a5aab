"""ReplicatedBus on its own, two instances on one real redis-server: what crosses, what does not,
and what a stalled Redis does to publishers (nothing: they never wait)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from tests.conftest import wait_for
from tests.redisproc import RedisProcess
from tests.redistarget import RedisTarget, redis_cluster, redis_cluster_clean, redis_server, redis_target
from uibus.infra.bus import Subscription
from uibus.infra.kinds import Kind
from uibus.infra.redis import ReplicatedBus
from uibus.pb.cline import common_pb2, ui_pb2

__all__ = ["redis_cluster", "redis_cluster_clean", "redis_server", "redis_target"]

K = Kind("k", object)  # a test kind: any payload, the default overflow policy
HOST = Kind("host", common_pb2.String, presence=True)


@pytest.fixture
async def buses(redis_target: RedisTarget) -> AsyncIterator[tuple[ReplicatedBus, ReplicatedBus]]:
    """Two buses on one redis-server, then on the Redis Cluster (sharded pub/sub)."""
    async with pair(redis_target.url, redis_target.cluster) as both:
        yield both


@pytest.fixture
async def single_buses(redis_server: RedisProcess) -> AsyncIterator[tuple[ReplicatedBus, ReplicatedBus]]:
    async with pair(redis_server.url, False) as both:
        yield both


@asynccontextmanager
async def pair(url: str, cluster: bool) -> AsyncIterator[tuple[ReplicatedBus, ReplicatedBus]]:
    a = ReplicatedBus(url, outbox_size=8, cluster=cluster)
    b = ReplicatedBus(url, outbox_size=8, cluster=cluster)
    await a.start()
    await b.start()
    try:
        assert a.connected and b.connected
        yield a, b
    finally:
        for bus in (a, b):
            await asyncio.wait_for(bus.stop(), 10)


async def drain(sub: Subscription, n: int, timeout: float = 3.0) -> list[object]:
    return [await asyncio.wait_for(sub.__anext__(), timeout) for _ in range(n)]


async def test_protobuf_and_json_items_cross_with_target_and_key(buses: tuple[ReplicatedBus, ReplicatedBus]) -> None:
    a, b = buses
    tab = b.subscribe("s", K, "TAB")
    anyone = b.subscribe("s", K)
    await b.ready("s")  # B's shard subscription confirmed: what A publishes now reaches it
    msg = ui_pb2.ClineMessage(ts=5, type=ui_pb2.ASK, ask=ui_pb2.FOLLOWUP, text="?", images=["x"])
    assert a.publish("s", K, msg, target="TAB", key=5) == 0  # nobody on A
    a.publish("s", K, {"plain": ["json", 1]}, target=None, key=("tuple", 1))
    a.publish("s", K, common_pb2.String(value="sidebar only"), target="SIDEBAR")
    got_tab = await drain(tab, 2)
    assert got_tab == [msg, {"plain": ["json", 1]}] and isinstance(got_tab[0], ui_pb2.ClineMessage)
    assert await drain(anyone, 3) == [msg, {"plain": ["json", 1]}, common_pb2.String(value="sidebar only")]
    assert len(tab) == 0
    assert a.publish("s", K, object()) == 0 and a.stats.unreplicable == 1  # local only, counted
    b.unsubscribe(tab)
    b.unsubscribe(anyone)
    assert b.count() == 0


async def test_own_envelopes_are_not_delivered_twice(buses: tuple[ReplicatedBus, ReplicatedBus]) -> None:
    a, b = buses
    sub_a = a.subscribe("s", K)
    sub_b = b.subscribe("s", K)
    await b.ready("s")
    assert a.publish("s", K, common_pb2.String(value="one")) == 1
    a.publish("s", K, common_pb2.String(value="two"))
    assert [m.value for m in await drain(sub_b, 2)] == ["one", "two"]  # type: ignore[attr-defined]
    assert [m.value for m in await drain(sub_a, 2)] == ["one", "two"]  # type: ignore[attr-defined]
    assert len(sub_a) == 0 and a.stats.received == 0
    a.unsubscribe(sub_a)
    b.unsubscribe(sub_b)


async def test_stalled_redis_never_blocks_publish_and_recovers(
        single_buses: tuple[ReplicatedBus, ReplicatedBus], redis_server: RedisProcess) -> None:
    a, b = single_buses
    local = a.subscribe("s", K, maxsize=10_000)
    remote = b.subscribe("s", K, maxsize=10_000)
    await b.ready("s")
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # accepts bytes, answers nothing: a hung Redis
    try:
        for i in range(200):  # bounded; publish is synchronous, so it cannot wait on Redis
            assert a.publish("s", K, common_pb2.String(value=str(i))) == 1
        assert [m.value for m in await drain(local, 200)] == [str(i) for i in range(200)]  # type: ignore[attr-defined]
        await wait_for(lambda: a.stats.dropped >= 200 - 8, timeout=10, what="outbox overflow counted")
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    await wait_for(lambda: a.connected and b.connected, timeout=15, what="replication back")
    start = time.monotonic()
    while True:  # the first envelopes after the stall may still be in flight: look for a fresh one
        a.publish("s", K, common_pb2.String(value="fresh"))
        try:
            while (await asyncio.wait_for(remote.__anext__(), 0.5)).value != "fresh":  # type: ignore[attr-defined]
                pass
            break
        except TimeoutError:
            assert time.monotonic() - start < 10, "replication did not resume"
    a.unsubscribe(local)
    b.unsubscribe(remote)
    assert a.count() == 0 and b.count() == 0


async def test_stop_while_redis_is_down_does_not_hang(redis_server: RedisProcess) -> None:
    bus = ReplicatedBus(redis_server.url)
    await bus.start()
    sub = bus.subscribe("s", K)
    redis_server.kill()
    bus.publish("s", K, common_pb2.String(value="x"))
    await wait_for(lambda: not bus.connected, timeout=5, what="outage noticed")
    bus.unsubscribe(sub)
    await asyncio.wait_for(bus.stop(), 5)


async def test_start_without_redis_serves_locally(tmp_path: object) -> None:
    from tests.conftest import free_port

    bus = ReplicatedBus(f"redis://127.0.0.1:{free_port()}/0")
    await asyncio.wait_for(bus.start(wait_s=0.5), 5)
    assert not bus.connected
    sub = bus.subscribe("s", K)
    assert bus.publish("s", K, common_pb2.String(value="local")) == 1
    assert (await drain(sub, 1))[0] == common_pb2.String(value="local")
    bus.unsubscribe(sub)
    await asyncio.wait_for(bus.stop(), 5)


async def test_presence_is_kept_by_heartbeats_and_expires_with_a_dead_replica(redis_server: RedisProcess) -> None:
    a = ReplicatedBus(redis_server.url, heartbeat_s=0.1)
    b = ReplicatedBus(redis_server.url, heartbeat_s=0.1)
    await a.start()
    await b.start()
    try:
        await a.ready("s")  # A follows the session's shard (it has no subscriber there)
        assert a.publish("s", HOST, common_pb2.String(value="nobody")) == 0
        hosts = [b.subscribe("s", HOST), b.subscribe("s", HOST)]
        await wait_for(lambda: a.remote_count("s", HOST) == 2, what="A learns of B's two hosts")
        await asyncio.sleep(0.6)  # twice the expiry: heartbeats keep it fresh
        assert a.remote_count("s", HOST) == 2
        assert a.publish("s", HOST, common_pb2.String(value="to b")) == 2
        assert [m.value for m in await drain(hosts[0], 1)] == ["to b"]  # type: ignore[attr-defined]
        late = ReplicatedBus(redis_server.url, heartbeat_s=0.1)
        await late.start()  # a replica that joins later knows at once: it reads the shard's presence hash
        await late.ready("s")
        assert late.remote_count("s", HOST) == 2
        await late.stop()
        await b.stop()  # B dies without unsubscribing: its announcement must expire
        await wait_for(lambda: a.remote_count("s", HOST) == 0, timeout=3, what="B's hosts expire on A")
        assert a.publish("s", HOST, common_pb2.String(value="gone")) == 0
        for sub in hosts:
            b.unsubscribe(sub)
    finally:
        await a.stop()
        if b._tasks:
            await b.stop()


async def test_an_outage_inside_the_buffer_loses_nothing_acknowledged(redis_server: RedisProcess) -> None:
    """Redis killed and restarted (an empty one, on the same port) 2 s later, under a steady publish
    rate on A: every event A acknowledged arrives on B, in order per publisher, once Redis is back
    and B listens again (a few may arrive twice: at least once across an outage)."""
    a = ReplicatedBus(redis_server.url)
    b = ReplicatedBus(redis_server.url)
    await a.start()
    await b.start()
    try:
        remote = b.subscribe("s", K, maxsize=10_000)
        await b.ready("s")
        await wait_for(lambda: a.connected and b.connected, what="both on redis")
        await asyncio.sleep(0.2)  # A hears B's hello
        sent: list[str] = []
        loop = asyncio.get_running_loop()
        start = loop.time()
        killed = restarted = False
        while loop.time() - start < 4.0:  # bounded: 4 s at ~100 events/s
            elapsed = loop.time() - start
            if elapsed > 0.8 and not killed:
                redis_server.kill()
                killed = True
            elif elapsed > 2.8 and not restarted:
                await loop.run_in_executor(None, redis_server.start)
                restarted = True
            value = f"e{len(sent)}"
            a.publish("s", K, common_pb2.String(value=value))
            sent.append(value)
            await asyncio.sleep(0.01)
        assert killed and restarted and a.stats.outages >= 1
        got: list[str] = []
        deadline = loop.time() + 15
        while set(got) < set(sent) and loop.time() < deadline:
            try:
                got.append((await asyncio.wait_for(remote.__anext__(), 1.0)).value)  # type: ignore[attr-defined]
            except TimeoutError:
                continue
        missing = [v for v in sent if v not in set(got)]
        assert not missing, f"{len(missing)} of {len(sent)} acknowledged events lost: {missing[:10]}"
        firsts = list(dict.fromkeys(got))
        assert firsts == sent  # in the order A published them
        assert a.stats.dropped == 0
        b.unsubscribe(remote)
    finally:
        for bus in (a, b):
            await asyncio.wait_for(bus.stop(), 10)


async def test_what_the_buffer_cannot_hold_is_dropped_and_counted(redis_server: RedisProcess) -> None:
    bus = ReplicatedBus(redis_server.url, buffer_bytes=4096, buffer_age_s=0.5)
    await bus.start()
    try:
        redis_server.kill()
        await wait_for(lambda: not bus.connected, timeout=5, what="the outage noticed")
        for i in range(100):  # ~70 bytes each: the byte bound holds the newest ~50
            bus.publish("s", K, common_pb2.String(value=f"event-{i:04d}"))
        assert 0 < bus.stats.dropped < 100 and bus._outbox.bytes <= 4096
        await asyncio.sleep(0.6)
        await asyncio.get_running_loop().run_in_executor(None, redis_server.start)
        await wait_for(lambda: bus.connected, timeout=10, what="back on redis")
        await wait_for(lambda: bus.stats.dropped == 100, timeout=5, what="the expired rest counted as dropped")
        assert bus.stats.sent < 100
    finally:
        await asyncio.wait_for(bus.stop(), 10)


async def test_a_replica_with_another_shard_count_is_reported(redis_server: RedisProcess,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    a = ReplicatedBus(redis_server.url, shards=256, heartbeat_s=0.2)
    b = ReplicatedBus(redis_server.url, shards=64, heartbeat_s=0.2)  # an operator's typo in one replica's config
    await a.start()
    await b.start()
    try:
        await wait_for(lambda: b.replica_id in a.mismatched and a.replica_id in b.mismatched, timeout=5,
                       what="both told")
        assert any("different --bus-shards" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
    finally:
        for bus in (a, b):
            await asyncio.wait_for(bus.stop(), 10)


async def test_a_subscriber_back_right_as_its_shard_is_left_is_heard(
        buses: tuple[ReplicatedBus, ReplicatedBus]) -> None:
    """The linger ends (UNSUBSCRIBE sent) and a subscriber arrives before Redis confirmed it: the
    confirmation of our own UNSUBSCRIBE must not be taken for a slot move, and the SUBSCRIBE after
    it makes the shard heard again."""
    a, b = buses
    for attempt in range(3):  # the same race, three times over on one connection
        first = b.subscribe("churn", K)
        await b.ready("churn")
        b.unsubscribe(first)
        n = next(iter(b._shards))
        b._shards.drop(n)  # what the linger's timer does
        again = b.subscribe("churn", K)  # no await in between: the UNSUBSCRIBE is still in flight
        start = time.monotonic()
        await b.ready("churn")
        assert time.monotonic() - start < 1.0, "the shard was not subscribed again"
        assert b.connected
        a.publish("churn", K, common_pb2.String(value=f"heard {attempt}"))
        assert [m.value for m in await drain(again, 1)] == [f"heard {attempt}"]  # type: ignore[attr-defined]
        b.unsubscribe(again)

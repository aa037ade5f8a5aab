"""The parts of uibus.infra.redis that need no Redis, each alone: the outbox (its bounds, its drops, a
failed batch back at the front), the envelope codec (round trips, and every malformed or hostile
envelope refused as one BadEnvelope), the shards' reference counting and timers, presence's
counts, and the bus facade's receive path and stop (which must end with Redis unreachable).
Real objects on a real event loop; no server anywhere."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.conftest import free_port, wait_for
from uibus.infra.kinds import Kind
from uibus.infra.redis import ReplicatedBus, codec
from uibus.infra.redis.outbox import Outbox, Outgoing, ReplicationStats
from uibus.infra.redis.presence import Presence
from uibus.infra.redis.shards import Shards, shard_of
from uibus.pb.cline import ui_pb2

K = Kind("k", object)


def envelopes(batch: list[Outgoing]) -> list[bytes]:
    return [e[2] for e in batch]


# ---- the outbox ---------------------------------------------------------------------------------


async def test_the_outbox_bound_by_count_drops_the_oldest_and_counts_them() -> None:
    stats = ReplicationStats()
    box = Outbox(stats, size=3)
    for i in range(5):
        box.put("c", b"e%d" % i)
    assert len(box) == 3 and stats.dropped == 2
    assert envelopes(box.take()) == [b"e2", b"e3", b"e4"]
    assert box.bytes == 0 and not box


async def test_the_outbox_bound_by_bytes_keeps_the_newest_within_them_and_always_the_newest() -> None:
    stats = ReplicationStats()
    box = Outbox(stats, max_bytes=100)
    for i in range(4):
        box.put("c", bytes([65 + i]) * 40)
    assert box.bytes == 80 and stats.dropped == 2  # 120 > 100: the oldest two went
    assert envelopes(box.take()) == [b"C" * 40, b"D" * 40]
    box.put("c", b"x" * 500)  # alone over the bound: kept, so a publish is never silently lost
    assert len(box) == 1 and box.bytes == 500 and stats.dropped == 2


async def test_the_outbox_drops_what_waited_longer_than_its_age_when_it_could_be_sent() -> None:
    stats = ReplicationStats()
    box = Outbox(stats, max_age_s=0.05)
    box.put("c", b"old-1")
    box.put("c", b"old-2")
    await asyncio.sleep(0.1)
    box.put("c", b"fresh")
    assert stats.dropped == 0  # nothing expires while it waits: only when it could be sent
    assert envelopes(box.take()) == [b"fresh"]
    assert stats.dropped == 2 and box.bytes == 0


async def test_a_failed_batch_goes_back_to_the_front_in_order_and_is_sent_first() -> None:
    stats = ReplicationStats()
    box = Outbox(stats, batch=2)
    for i in range(5):
        box.put("c", b"e%d" % i)
    written: list[list[bytes]] = []
    failures: list[str] = []
    running = True

    async def write(batch: list[Outgoing]) -> None:
        if not failures:
            raise ConnectionError("redis went away")
        written.append(envelopes(batch))

    async def recover(exc: Exception) -> None:
        failures.append(str(exc))
        box.put("c", b"e5")  # published during the outage: queued behind what failed

    async def runner() -> None:
        await box.run(write, recover, lambda: running)

    task = asyncio.create_task(runner())
    await wait_for(lambda: box.drained.is_set(), what="the outbox drained")
    running = False
    box.wake()
    await asyncio.wait_for(task, 1)
    assert failures == ["redis went away"]
    assert written == [[b"e0", b"e1"], [b"e2", b"e3"], [b"e4", b"e5"]]
    assert stats.sent == 6 and stats.dropped == 0


async def test_a_failed_batch_put_back_into_a_full_outbox_loses_its_oldest_first() -> None:
    stats = ReplicationStats()
    box = Outbox(stats, size=3, batch=2)
    for i in range(3):
        box.put("c", b"e%d" % i)
    failed = box.take()  # e0, e1 in flight
    box.put("c", b"e3")
    box.put_back(failed)  # e0 e1 e2 e3: one too many, and e0 is the oldest
    assert stats.dropped == 1
    assert envelopes(box.take()) + envelopes(box.take()) == [b"e1", b"e2", b"e3"]


async def test_flush_waits_for_the_writer_and_gives_up_after_its_timeout() -> None:
    box = Outbox(ReplicationStats())
    box.put("c", b"never written")
    start = time.monotonic()
    await box.flush(0.1)  # no writer: it waits its timeout, then returns
    assert 0.09 <= time.monotonic() - start < 1
    assert len(box) == 1


# ---- the envelope codec -------------------------------------------------------------------------


def test_a_protobuf_item_round_trips_with_its_type_and_fields() -> None:
    item = ui_pb2.ClineMessage(ts=7, type=ui_pb2.SAY, text="hi", partial=True)
    data = codec.encode("r1", "s", "partial", "TAB", ("a", 1), item)
    assert data is not None
    env = codec.decode(data)
    assert (env.origin, env.session, env.kind, env.target, env.key, env.type) == (
        "r1", "s", "partial", "TAB", ("a", 1), "cline.ClineMessage")
    assert codec.Items().item(env) == item


def test_a_json_item_round_trips_and_a_nested_tuple_key_comes_back_hashable() -> None:
    data = codec.encode("r1", "s", "k", None, ("a", ("b", 2)), {"x": [1, 2]})
    assert data is not None
    env = codec.decode(data)
    assert env.key == ("a", ("b", 2)) and hash(env.key)
    assert env.type == codec.JSON_ITEM and codec.Items().item(env) == {"x": [1, 2]}


def test_what_has_no_wire_form_is_not_encoded() -> None:
    assert codec.encode("r1", "s", "k", None, None, object()) is None  # neither protobuf nor JSON
    assert codec.encode("r1", "s", "k", None, frozenset({1}), "fine") is None  # a key JSON cannot carry


def test_control_and_presence_envelopes_round_trip() -> None:
    hello = codec.decode(codec.control("r1", 256, codec.HELLO))
    assert (hello.origin, hello.session, hello.type, hello.payload) == ("r1", "256", codec.HELLO, b"")
    entries = [("s", "host", 2), ("t", "answer", 0)]
    env = codec.decode(codec.presence("r1", entries))
    assert env.type == codec.PRESENCE and codec.decode_presence(env.payload) == entries


@pytest.mark.parametrize("data", [
    b"",  # nothing
    b"not json\n",
    b"{\"a\": 1}\n",  # not a list
    b"[\"r\", \"s\", \"k\", null, null]\n",  # five fields
    b"[\"r\", \"s\", \"k\", null, null, \"\", 7]\n",  # seven
    b"[1, \"s\", \"k\", null, null, \"\"]\n",  # an origin that is not a string
    b"[\"r\", [\"s\"], \"k\", null, null, \"\"]\n",  # a session that is not a string
    b"[\"r\", \"s\", \"k\", 5, null, \"\"]\n",  # a target that is neither a string nor null
    b"[\"r\", \"s\", \"k\", null, null, 3]\n",  # a type that is not a string
    b"[\"r\", \"s\", \"k\", null, {\"a\": 1}, \"\"]\n",  # a key that is an object (unhashable)
    b"[\"r\", \"s\", \"k\", null, [[{}]], \"\"]\n",  # ... nested in a tuple
    b"[" * 100_000 + b"\n",  # nesting built to exhaust the parser's stack
    b"\xff\xfe\n",  # not UTF-8
])
def test_a_malformed_or_hostile_header_is_one_bad_envelope(data: bytes) -> None:
    with pytest.raises(codec.BadEnvelope):
        codec.decode(data)


@pytest.mark.parametrize(("type_name", "payload"), [
    ("no.such.Message", b""),  # a type this process does not know
    ("cline.ClineMessage", b"\xff\xff\xff\xff"),  # bytes that are not that message
    ("", b"{not json"),
    ("", b"[" * 100_000),
])
def test_a_payload_that_cannot_be_read_is_one_bad_envelope(type_name: str, payload: bytes) -> None:
    head = json.dumps(["r", "s", "k", None, None, type_name]).encode()
    env = codec.decode(head + b"\n" + payload)
    with pytest.raises(codec.BadEnvelope):
        codec.Items().item(env)


@pytest.mark.parametrize("payload", [b"{}", b"[[\"s\", \"k\"]]", b"[[\"s\", \"k\", \"2\"]]", b"[[\"s\", \"k\", true]]",
                                     b"[[1, \"k\", 2]]", b"nope"])
def test_a_malformed_presence_announcement_is_one_bad_envelope(payload: bytes) -> None:
    with pytest.raises(codec.BadEnvelope):
        codec.decode_presence(payload)


# ---- the facade's receive path, and its stop, with no Redis ------------------------------------


async def test_the_bus_counts_bad_envelopes_and_delivers_good_ones_from_other_replicas() -> None:
    bus = ReplicatedBus(f"redis://127.0.0.1:{free_port()}/0")  # never started: nothing connects
    try:
        sub = bus.subscribe("s", K)
        for bad in (b"garbage", b"[" * 50_000, codec.control("other", 256, "!hello")[:-3]):
            bus.on_data(bad)
        assert bus.stats.bad == 3 and len(sub) == 0
        bus.on_data(codec.encode(bus.replica_id, "s", "k", None, None, "mine") or b"")  # our own echo: ignored
        bus.on_data(codec.encode("other", "s", "k", None, None, {"v": 1}) or b"")
        bus.on_data(codec.encode("other", "nobody", "k", None, None, 1) or b"")  # no subscriber here
        unknown = codec.encode("other", "s", "k", None, None, ui_pb2.ClineMessage(ts=1))
        assert unknown is not None
        bus.on_data(unknown.replace(b"cline.ClineMessage", b"cline.Nothing"))  # a type unknown here: bad, not raised
        assert [await asyncio.wait_for(sub.__anext__(), 1)] == [{"v": 1}]
        assert (bus.stats.received, bus.stats.unwanted, bus.stats.bad) == (3, 1, 4)
        bus.on_data(codec.control("other", 16, codec.HELLO))  # another --bus-shards: reported once
        bus.on_data(codec.control("other", 16, codec.WHO))
        assert bus.mismatched == {"other"}
    finally:
        await asyncio.wait_for(bus.stop(), 5)


async def test_stop_ends_promptly_while_redis_is_unreachable() -> None:
    bus = ReplicatedBus(f"redis://127.0.0.1:{free_port()}/0", heartbeat_s=0.05)
    await bus.start(wait_s=0.2)
    assert not bus.connected
    sub = bus.subscribe("s", K)
    assert bus.publish("s", K, "local") == 1  # local delivery never depends on Redis
    await asyncio.sleep(0.3)  # the listener and the writer retrying, the heartbeat queueing
    start = time.monotonic()
    await asyncio.wait_for(bus.stop(flush_s=0.1), 5)
    assert time.monotonic() - start < 3
    assert not bus._tasks and not bus._small  # every task it started has ended
    assert [await asyncio.wait_for(sub.__anext__(), 1)] == ["local"]


# ---- shards and presence -------------------------------------------------------------------------


async def test_a_shard_is_wanted_once_held_and_left_after_its_linger() -> None:
    wanted: list[str] = []
    left: list[tuple[int, str]] = []
    shards = Shards("bus", 16, want=wanted.append, unwant=lambda n, c: left.append((n, c)), linger_s=0.05)
    n = shard_of("s", 16)
    shards.hold(n)
    shards.hold(n)
    assert wanted == [f"bus:{{{n}}}"] and len(shards) == 1
    shards.release(n)
    shards.release(n)
    shards.hold(n)  # back within the linger: nothing left, nothing subscribed again
    await asyncio.sleep(0.1)
    assert left == [] and wanted == [f"bus:{{{n}}}"]
    shards.release(n)
    await wait_for(lambda: bool(left), what="the shard left after its linger")
    assert left == [(n, f"bus:{{{n}}}")] and len(shards) == 0


async def test_ready_without_a_subscriber_visits_the_shard_and_waits_at_most_confirm_s() -> None:
    wanted: list[str] = []
    left: list[tuple[int, str]] = []
    shards = Shards("bus", 16, want=wanted.append, unwant=lambda n, c: left.append((n, c)),
                    linger_s=0.01, visit_s=0.1, confirm_s=0.05)
    start = time.monotonic()
    await shards.ready("s")  # never confirmed (no links here): returns after confirm_s
    assert 0.04 <= time.monotonic() - start < 1 and len(wanted) == 1
    await wait_for(lambda: bool(left), what="the visit ended and the shard left")
    shards.close()


async def test_presence_counts_expire_and_announcements_carry_their_hash_writes() -> None:
    shards = Shards("bus", 16, want=lambda c: None, unwant=lambda n, c: None)
    sent: list[tuple[str, bytes, tuple[tuple[str, str, str], ...]]] = []
    topics = {("s", "host"): {}}
    presence = Presence("me", shards, heartbeat_s=0.02, count=lambda kind, session: 2, topics=topics.keys(),
                        enqueue=lambda c, e, w: sent.append((c, e, w)) is None)
    presence.on_presence("other", [("s", "host", 3)])
    assert presence.remote_count("s", "host") == 3
    await wait_for(lambda: presence.remote_count("s", "host") == 0, timeout=1, what="three heartbeats passed")
    presence.kinds.add("host")
    presence.announce_all()
    [(channel, envelope, writes)] = sent
    assert channel == f"bus:{{{shard_of('s', 16)}}}"
    assert codec.decode_presence(codec.decode(envelope).payload) == [("s", "host", 2)]
    [(key, field, value)] = writes
    assert key == f"bus:presence:{{{shard_of('s', 16)}}}" and json.loads(field) == ["me", "s", "host"]
    assert value.startswith("2 ")


# ---- a cancel lost inside a store operation is raised after it (uibus.infra.redis.store.keeps_cancel) ----


async def test_a_cancel_swallowed_inside_a_store_operation_still_reaches_its_caller() -> None:
    from uibus.infra.redis.store import keeps_cancel

    entered = asyncio.Event()
    after: list[str] = []

    @keeps_cancel
    async def swallowing() -> str:  # what Python 3.11's wait_for can do to a cancel (gh-86296)
        entered.set()
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            pass
        return "written"

    async def caller() -> None:
        await swallowing()
        after.append("went on as if nobody had left")

    task = asyncio.ensure_future(caller())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert after == []

    # a task already being cancelled (a teardown writing its last state) is not cut by that cancel
    @keeps_cancel
    async def plain() -> str:
        await asyncio.sleep(0)
        return "written"

    async def teardown() -> str:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            return await plain()  # cancelling() is 1 before and after: its own cancel, not a new one
        return "never"

    closing = asyncio.ensure_future(teardown())
    await asyncio.sleep(0)
    closing.cancel()
    assert await closing == "written"

"""The versioned wire between replicas, unit by unit (tests/test_rolling_upgrade.py runs the previous
release for real beside this one): every envelope and control message says its sender's version,
a replica keeps to the form the oldest live peer reads, and a newer envelope is read as far as it
can be, never dropped.

The previous release's own decoder is read out of the repository history (commit PREVIOUS), so
"uibus 0.1.0 reads this" is checked against its code, not against a description of it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import types

import pytest

from tests.conftest import REPO, wait_for
from tests.redisproc import RedisProcess
from tests.redistarget import redis_server
from uibus.infra.kinds import Kind
from uibus.infra.redis import ReplicatedBus, codec
from uibus.infra.redis.presence import Presence
from uibus.infra.redis.shards import Shards
from uibus.pb.cline import ui_pb2

__all__ = ["redis_server"]
PREVIOUS = "477ee00"  # uibus 0.1.0, the previous release (CHANGELOG.md)
K = Kind("k", object)


def previous_codec() -> types.ModuleType:
    """server/redis/codec.py of the previous release, loaded as a module of its own."""
    try:
        source = subprocess.run(["git", "show", f"{PREVIOUS}:server/redis/codec.py"], cwd=REPO, check=True,
                                capture_output=True, text=True, timeout=60).stdout
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"the previous release ({PREVIOUS}) is not in this clone's history: fetch it "
                    f"(git fetch --unshallow, or a clone with history) — {exc.stderr.strip()}")
    module = types.ModuleType("previous_codec")
    sys.modules[module.__name__] = module  # dataclasses look their module up while the class is made
    try:
        exec(compile(source, f"{PREVIOUS}:server/redis/codec.py", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module


def test_the_previous_release_reads_the_legacy_form_and_every_control_message() -> None:
    old = previous_codec()
    item = ui_pb2.ClineMessage(ts=5, text="hi")
    for trace in (None, "00-" + "a" * 32 + "-" + "b" * 16 + "-01"):
        legacy = codec.encode("new", "s", "partial_message", None, 5, item, trace, version=codec.LEGACY)
        assert legacy is not None
        env = old.decode(legacy)
        assert (env.origin, env.kind, env.key, env.trace) == ("new", "partial_message", 5, trace)
        assert old.Items().item(env) == item
    for control in (codec.control("new", 256, codec.HELLO), codec.control("new", 256, codec.WHO),
                    codec.presence("new", [("s", "host_request", 1)])):
        env = old.decode(control)  # the version rides in the key slot, which it reads and ignores
        assert env.key == codec.PROTOCOL
    assert old.decode_presence(old.decode(codec.presence("new", [("s", "k", 1)])).payload) == [("s", "k", 1)]
    # ... and it is why the legacy form exists: the current form's header is one it refuses.
    current = codec.encode("new", "s", "partial_message", None, 5, item)
    assert current is not None
    with pytest.raises(old.BadEnvelope):
        old.decode(current)


def test_this_release_reads_the_previous_ones_envelopes() -> None:
    old = previous_codec()
    env = codec.decode(old.encode("old", "s", "partial_message", None, 5, {"a": 1}, "tp"))
    assert (env.version, env.trace, codec.Items().item(env)) == (codec.LEGACY, "tp", {"a": 1})
    assert codec.decode(old.control("old", 256, old.HELLO)).version == codec.LEGACY
    assert codec.decode(old.presence("old", [])).version == codec.LEGACY


def test_a_newer_envelope_is_read_as_far_as_this_release_knows() -> None:
    head = ["newer", "s", "k", None, None, codec.JSON_ITEM, None, codec.PROTOCOL + 1, {"what": "comes next"}, 9]
    env = codec.decode(json.dumps(head).encode() + b"\n" + b'{"v": 1}')
    assert env.version == codec.PROTOCOL + 1 and codec.Items().item(env) == {"v": 1}
    hello = json.dumps(["newer", "256", "", None, codec.PROTOCOL + 1, codec.HELLO, "later", 1]).encode() + b"\n"
    assert codec.decode(hello).version == codec.PROTOCOL + 1
    for bad in ([*head[:7], "2"], [*head[:7], 0], ["r"] * (codec.MAX_FIELDS + 1)):
        with pytest.raises(codec.BadEnvelope):
            codec.decode(json.dumps(bad).encode() + b"\n")


def _env(origin: str, version: int, what: str = codec.HELLO) -> codec.Envelope:
    return codec.Envelope(origin, "16" if what == codec.HELLO else "s", "", None, None, what, b"", None, version)


async def test_the_wire_follows_the_oldest_live_replica() -> None:
    shards = Shards("bus", 16, want=lambda c: None, unwant=lambda n, c: None)
    presence = Presence("me", shards, heartbeat_s=0.02, count=lambda kind, session: 0, topics=(),
                        enqueue=lambda c, e, w: True)
    run = asyncio.create_task(presence.run("ctl", lambda: True))
    try:
        presence.heard(_env("new", 2))
        await asyncio.sleep(0.1)
        assert presence.wire == codec.LEGACY  # no census yet: an old replica may be live and unheard
        wait = presence.begin_census()
        assert wait == 0.02  # at most a heartbeat
        presence.choose_wire()
        assert presence.wire == codec.LEGACY  # the hellos answering our who may still be on their way
        await wait_for(lambda: presence.wire == 2, timeout=2, what="the census completed, every peer at 2")
        presence.heard(_env("old", codec.LEGACY))  # a 0.1.0 hello: no version in it
        assert presence.wire == codec.LEGACY
        presence.heard(_env("old", codec.LEGACY, codec.JSON_ITEM))
        presence.heard(_env("new", codec.LEGACY, codec.JSON_ITEM))  # its legacy-form data: still 2
        assert presence.versions == {"new": 2, "old": codec.LEGACY}
        # The old replica stops; `new` goes on saying hello: ten heartbeats later it is forgotten.
        beat = asyncio.create_task(_hello_every(presence, "new", 0.02))
        try:
            await wait_for(lambda: presence.wire == 2, timeout=3, what="the old replica forgotten")
            assert "old" not in presence.versions
            presence.recount()  # the control channel lost: hellos may be missed, so legacy again
            assert presence.wire == codec.LEGACY
            await asyncio.sleep(0.1)
            assert presence.wire == codec.LEGACY  # heartbeats without a census change nothing
            presence.begin_census()
            await wait_for(lambda: presence.wire == 2, timeout=2, what="a new census")
        finally:
            beat.cancel()
    finally:
        run.cancel()
        shards.close()


async def _hello_every(presence: Presence, origin: str, period: float) -> None:
    while True:
        presence.heard(_env(origin, 2))
        await asyncio.sleep(period)


async def test_a_kind_a_live_replica_does_not_know_stays_on_this_replica() -> None:
    """A kind newer than the wire the oldest live replica speaks is delivered here only (counted), and the
    other kinds go on in the form it reads."""
    bus = ReplicatedBus("redis://127.0.0.1:1/0", heartbeat_s=0.02)  # never started: nothing connects
    try:
        newer = Kind("from_the_future", dict, since=codec.PROTOCOL + 1)
        sub = bus.subscribe("s", newer)
        assert bus.publish("s", newer, {"v": 1}) == 1
        assert [await asyncio.wait_for(sub.__anext__(), 1)] == [{"v": 1}]
        assert bus.stats.kept_local == 1
        assert bus.wire_version == codec.LEGACY
        bus.on_data(codec.control("peer", 256, codec.HELLO))
        assert bus.peer_versions == {"peer": codec.PROTOCOL}
    finally:
        await asyncio.wait_for(bus.stop(), 5)


@pytest.mark.redis
async def test_two_replicas_of_this_release_speak_the_current_form_over_real_redis(redis_server: RedisProcess) -> None:
    """Between replicas of this release the census ends within a second and the current form (the
    eighth field) is what crosses Redis, traced or not, with nothing counted bad."""
    a, b = ReplicatedBus(redis_server.url), ReplicatedBus(redis_server.url)
    await a.start()
    await b.start()
    try:
        await wait_for(lambda: a.wire_version == b.wire_version == codec.PROTOCOL, timeout=5,
                       what="both censuses complete")
        assert a.peer_versions == {b.replica_id: codec.PROTOCOL} and b.peer_versions == {a.replica_id: codec.PROTOCOL}
        sub = b.subscribe("s", K)
        await b.ready("s")
        await a.ready("s")
        a.publish("s", K, {"n": 1})
        assert [await asyncio.wait_for(sub.__anext__(), 5)] == [{"n": 1}]
        assert (a.stats.bad, b.stats.bad) == (0, 0)
        b.unsubscribe(sub)
    finally:
        await asyncio.gather(a.stop(), b.stop())

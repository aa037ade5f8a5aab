"""The topic bus across replicas: every publish is delivered locally at once and also handed to
Redis pub/sub, and every replica delivers what the others publish (docs/scaling.md, "Several replicas").

This class is the facade: it is a `uibus.infra.bus.Bus` and composes the parts, each a module of its own
(see `uibus.infra.redis`): the envelope codec, the outbox and its writer, the shards followed, the
pub/sub links and presence. What it keeps is the wiring between them and the replica's
connection state. Why the bus is shaped like this:
* `publish` must never wait on the network: it delivers locally, encodes, and appends to the outbox
  (uibus.infra.redis.outbox), which a background writer drains. Local delivery never depends on Redis.
* Sharded channels (uibus.infra.redis.shards), so a replica's bus cost is what its own subscribers need.
* Headers still mean "live": a stream awaits `ready(session)` (its shard's SUBSCRIBE confirmed and
  its presence read, at most `confirm_s`) before it yields LIVE.
* Redis Cluster (`cluster=True`): sharded pub/sub, one link per master, following failovers and
  slot moves (uibus.infra.redis.links); disconnected (health NOT_SERVING) while any link is down.
  Sentinel needs nothing here: the client's pool asks the sentinels for the master on every
  reconnect (uibus.infra.redis.conn).
* Nothing acknowledged is lost silently: the outbox buffers across an outage, bounded and counted.
  Once Redis answers again the writer holds the buffer until the other replicas are listening
  again (each says so with a hello on the control channel once all its channels are subscribed
  again, and when asked: the writer asks "who listens?" as soon as Redis answers, so a replica
  that never lost its subscriptions answers at once), at most `resubscribe_s`, then sends it.
* `publish` returns how many subscribers it reached, remote ones of `presence` kinds included
  (uibus.infra.redis.presence), and sends those kinds only when some other replica listens, so a caller
  told "nobody listens" never has its event delivered later.
* `stats` counts what crossed Redis; /metrics exports it as `uibus_replication_*_total`, and
  `shards_subscribed` as a gauge.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine, Hashable
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from uibus.infra import telemetry
from uibus.infra.bus import Bus, Subscription
from uibus.infra.kinds import Kind
from uibus.infra.redis import codec
from uibus.infra.redis.conn import OUTAGE_ERRORS, AnyRedis, make_client
from uibus.infra.redis.links import PATIENCE_S, Commands, Links
from uibus.infra.redis.outbox import Outbox, Outgoing, ReplicationStats, Writes
from uibus.infra.redis.presence import Presence
from uibus.infra.redis.shards import Shards, shard_of
from uibus.infra.retry import Backoff
from uibus.infra.tasks import Tasks
from uibus.infra.telemetry.spans import published, received

__all__ = ["ReplicatedBus", "ReplicationStats", "shard_of"]

log = logging.getLogger("uibus.infra.redis")


class ReplicatedBus(Bus):
    """A `Bus` whose topics span every replica sharing one Redis (a server, a cluster, a master set)."""

    replicated = True

    def __init__(self, redis_url: str, queue_size: int = 256, max_per_session: int = 10_000, *,
                 channel: str = "uibus:bus", outbox_size: int = 10_000, heartbeat_s: float = 5.0,
                 mailbox_bytes: int = 16 * 1024 * 1024, mailboxes_bytes: int = 256 * 1024 * 1024,
                 buffer_bytes: int = 16 * 1024 * 1024, buffer_age_s: float = 10.0, resubscribe_s: float = 4.0,
                 shards: int = 256, cluster: bool = False, linger_s: float = 5.0, visit_s: float = 60.0,
                 confirm_s: float = 2.0) -> None:
        super().__init__(queue_size, max_per_session, mailbox_bytes=mailbox_bytes, mailboxes_bytes=mailboxes_bytes)
        self.replica_id = uuid.uuid4().hex[:16]
        self.channel = channel
        self.shards = max(1, shards)
        self.cluster = cluster
        self.stats = ReplicationStats()
        self._redis: AnyRedis = make_client(redis_url, "uibus-bus", cluster=cluster)
        self._pub_cmd = Commands.of(cluster).publish
        self._ctl = f"{channel}:ctl"
        self._resubscribe_s = resubscribe_s
        self._heartbeat_s = heartbeat_s
        self._outbox = Outbox(self.stats, size=outbox_size, max_bytes=buffer_bytes, max_age_s=buffer_age_s)
        self._items = codec.Items()
        self._shards = Shards(channel, self.shards, want=self._want, unwant=self._unwant,
                              linger_s=linger_s, visit_s=visit_s, confirm_s=confirm_s)
        self._links = Links(self._redis, cluster=cluster, ctl=self._ctl, listener=self, running=self._running)
        self._presence = Presence(self.replica_id, self._shards, heartbeat_s=heartbeat_s, count=self.count,
                                  topics=self._topics.keys(), enqueue=self._enqueue)
        self._tasks = Tasks("uibus-bus")  # the writer, the heartbeat, the cluster's first placement
        self._small = Tasks("uibus-bus-small", quiet=True)  # hellos, whos, presence reads
        self._writer_up = True  # optimistic until a write fails, so early publishes are not dropped
        self._listening = asyncio.Event()  # the control channel is subscribed
        self._listening_since = 0.0  # monotonic time every channel was last confirmed after a loss
        self._listen_lost = 0.0  # monotonic time a subscription was last lost
        self._hello_due = True  # say hello once every channel is confirmed again
        self._down_logged = False
        self._started = False

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, wait_s: float = 2.0) -> None:
        """Starts the listeners, writer and heartbeat; waits up to `wait_s` for the subscription.

        An unreachable Redis is not fatal: the replica serves its own clients and keeps retrying.
        """
        if self._started:
            return
        self._started = True
        self._tasks.spawn(self._write_loop(), name="uibus-bus-write")
        self._tasks.spawn(self._presence.run(self._ctl, self._running), name="uibus-bus-heartbeat")
        self._links.start()
        if self.cluster:  # a cluster's channels are placed once its slot map is read
            self._tasks.spawn(self._links.learn_and_place(), name="uibus-bus-topology")
        self._links.unplaced.add(self._ctl)
        if not self.cluster:
            self._links.place_unplaced()
        try:
            await asyncio.wait_for(self._listening.wait(), wait_s)
        except TimeoutError:
            pass

    async def stop(self, flush_s: float = 0.5) -> None:
        """Flushes what is queued (briefly), stops the tasks and closes the Redis clients. Always
        ends: the loops also stop on the started flag, and a task that swallows its cancel (inside
        a redis-py command, seen in CI) is cancelled again and at last left behind, logged."""
        if self._writer_up:
            await self._outbox.flush(flush_s)
        self._started = False
        self._outbox.wake()
        await asyncio.gather(self._tasks.aclose(patience=PATIENCE_S), self._small.aclose(patience=PATIENCE_S),
                             self._links.aclose())
        self._shards.close()
        await self._redis.aclose()

    def _running(self) -> bool:
        return self._started

    @property
    def connected(self) -> bool:
        """True while this replica can write to Redis and every channel it listens to is subscribed."""
        return self._listening.is_set() and self._writer_up and self._links.up

    @property
    def wire_version(self) -> int:
        """The wire protocol version this replica writes data envelopes in now (for /metrics)."""
        return self._presence.wire

    @property
    def peer_versions(self) -> dict[str, int]:
        """The wire protocol version of each replica heard from recently."""
        return {o: self._presence.versions.get(o, codec.LEGACY) for o in self._presence.seen}

    @property
    def shards_subscribed(self) -> int:
        """Shards this replica listens to now (for /metrics)."""
        return self._shards.subscribed

    @property
    def mismatched(self) -> set[str]:
        """Replicas heard from with another shard count."""
        return self._presence.mismatched

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """A short Redis call in a task of its own: a cancel landing inside a redis-py command can be
        swallowed, and the listener must stay cancellable. Its failure is an outage the loops see."""
        if self._small.closed:
            work.close()
            return
        self._small.spawn(work, name="uibus-bus-small")

    # -- subscribing: shards followed, presence announced ---------------------------------------

    def shard_channel(self, session: str) -> str:
        return self._shards.channel_of(shard_of(session, self.shards))

    def subscribe(self, session: str, kind: Kind, target: str = "", maxsize: int | None = None) -> Subscription:
        sub = super().subscribe(session, kind, target, maxsize)
        self._shards.hold(shard_of(session, self.shards))
        if kind.presence:
            self._presence.kinds.add(kind.name)
            self._presence.announce([(session, kind.name)])
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        before = self.count(sub.kind, sub.session)
        super().unsubscribe(sub)
        if self.count(sub.kind, sub.session) != before:
            self._shards.release(shard_of(sub.session, self.shards))
            if sub.kind in self._presence.kinds:
                self._presence.announce([(sub.session, sub.kind)])

    async def ready(self, session: str) -> None:
        """Returns once this replica hears every event published for `session` on any replica and
        knows every replica's presence counts for it (at most `confirm_s`: with Redis down, local
        delivery goes on). Without a subscriber here the shard is followed for `visit_s`."""
        await self._shards.ready(session)

    def remote_count(self, session: str, kind: Kind | str) -> int:
        """Subscribers other replicas announced for (session, kind) and that have not expired."""
        return self._presence.remote_count(session, kind.name if isinstance(kind, Kind) else kind)

    def announced(self, origin: str, session: str, kind: Kind) -> bool | None:
        """Whether replica `origin` has a fresh announcement of a subscriber of (session, kind)
        (uibus.infra.redis.presence)."""
        return self._presence.announced(origin, session, kind.name)

    def _want(self, channel: str) -> None:
        self._links.want(channel)

    def _unwant(self, n: int, channel: str) -> None:
        self._links.unwant(channel)
        self._presence.forget_shard(n)

    # -- publishing and writing -----------------------------------------------------------------

    def publish(self, session: str, kind: Kind, item: Any, target: str | None = None,
                key: Hashable = None) -> int:
        name = kind.name
        self.last_replicated = False
        n = self._deliver(session, name, item, target, key)
        if kind.presence:
            remote = self._presence.remote_count(session, name)
            if not remote:  # no other replica listens: sending would deliver to nobody, or worse, to
                return n  # a subscriber that joins later, after the caller was told "nobody is listening"
            n += remote
        wire = self._presence.wire  # the form every live replica reads (uibus.infra.redis.presence)
        if kind.since > wire:  # a kind some live replica does not know: this replica's subscribers only
            self.stats.kept_local += 1
            return n
        # Traced (uibus.infra.telemetry): one publish span, its traceparent in the envelope.
        trace = None if telemetry.tracer is None else published(session, name)
        envelope = codec.encode(self.replica_id, session, name, target, key, item, trace, wire)
        if envelope is None:
            self.stats.unreplicable += 1
            return n
        if not self._started:
            self.stats.dropped += 1
            return n
        # Inline, not via shard_channel/_enqueue: this runs per event (bench/instructions.py).
        self._outbox.put(f"{self.channel}:{{{shard_of(session, self.shards)}}}", envelope)
        self.last_replicated = True
        return n

    def _enqueue(self, channel: str, envelope: bytes, writes: Writes = ()) -> bool:
        if not self._started:
            self.stats.dropped += 1
            return False
        self._outbox.put(channel, envelope, writes)
        return True

    async def _write_loop(self) -> None:
        if self.cluster:  # the first pipeline must not initialize the client beside the first placement
            await self._links.refresh_topology(first=True)
        await self._outbox.run(self._write, self._recover, self._running)

    async def _write(self, batch: list[Outgoing]) -> None:
        """One pipeline: per envelope its presence hash writes first, then the publish."""
        expire_ms = int(10 * self._heartbeat_s * 1000)
        async with self._redis.pipeline(transaction=False) as pipe:
            for _, channel, envelope, writes in batch:
                for key, fld, value in writes:
                    if value:
                        pipe.hset(key, fld, value)
                        pipe.pexpire(key, expire_ms)
                    else:
                        pipe.hdel(key, fld)
                pipe.execute_command(self._pub_cmd, channel, envelope)
            await pipe.execute()

    async def _recover(self, exc: Exception) -> None:
        """After a failed write: waits for Redis, then (at most resubscribe_s) for every replica to
        listen again, so the buffer sent next reaches them."""
        self.unexpected("write", exc)
        self._writer_up = False
        self.went_down("write", exc)
        down_since = time.monotonic()
        await self._until_reachable()
        # Replicas that never lost their subscriptions (a cluster master they do not listen to
        # failed) would only say hello at their next heartbeat: ask, so the wait is a round trip.
        self._spawn(self._redis.execute_command(self._pub_cmd, self._ctl, self._presence.who()))
        known = self._presence.known_at(down_since)
        deadline = time.monotonic() + self._resubscribe_s
        while time.monotonic() < deadline:
            mine = self._links.all_confirmed() and (self._listening_since >= down_since
                                                    or self._listen_lost < down_since)
            if mine and self._presence.heard_again(known, down_since):
                break
            await asyncio.sleep(0.02)
        self._writer_up = True
        self._came_back()
        self._presence.announce_all()

    async def _until_reachable(self) -> None:
        backoff = Backoff()  # uibus.infra.retry: replicas that lost Redis together do not ping it together
        while self._started:
            await backoff.wait()
            try:
                if isinstance(self._redis, RedisCluster):
                    await self._links.refresh_topology()
                    await self._redis.ping(target_nodes=RedisCluster.PRIMARIES)
                else:
                    await self._redis.ping()
                return
            except Exception:  # still down: the next wait is longer
                pass

    # -- what the links hear (uibus.infra.redis.links.Listener) ---------------------------------------

    def on_data(self, data: bytes) -> None:
        """Delivers one envelope from another replica; a bad one is counted, never raised."""
        try:
            env = codec.decode(data)
        except codec.BadEnvelope:
            self.stats.bad += 1
            return
        if env.origin == self.replica_id:
            return
        self._presence.heard(env)
        if env.type == codec.HELLO:
            return
        if env.type == codec.WHO:
            if not self._hello_due and self._links.all_confirmed():
                self._say_hello()
            return
        self.stats.received += 1
        try:
            if env.type == codec.PRESENCE:
                self._presence.on_presence(env.origin, codec.decode_presence(env.payload))
                return
            if (env.session, env.kind) not in self._topics:
                self.stats.unwanted += 1
                return  # nobody here listens: skip decoding
            item = self._items.item(env)
        except codec.BadEnvelope:
            self.stats.bad += 1
            return
        if env.trace is None or telemetry.tracer is None:
            self._deliver(env.session, env.kind, item, env.target, env.key)
            return
        with received(env.trace, env.session, env.kind, env.origin):  # the publisher's trace goes on
            self._deliver(env.session, env.kind, item, env.target, env.key)

    def on_confirmed(self, channel: str) -> None:
        if channel == self._ctl:
            self._listening.set()
            # Who is live, and which wire version each speaks: every listening replica answers the
            # who with a hello carrying its version (uibus.infra.redis.presence, the census).
            self._spawn(self._redis.execute_command(self._pub_cmd, self._ctl, self._presence.who()))
            asyncio.get_running_loop().call_later(self._presence.begin_census() + 0.01, self._presence.choose_wire)
        else:
            found = self._shards.by_channel(channel)
            if found is not None and not found[1].confirmed:
                n, st = found
                st.confirmed = True
                self._spawn(self._presence.read(self._redis, n, st))
                self._presence.announce_shard(n)
        if self._hello_due and self._links.all_confirmed():
            self._hello_due = False
            self._listening_since = time.monotonic()
            self._say_hello()
            self._came_back()

    def on_lost(self, channel: str) -> None:
        self._hello_due = True
        self._listen_lost = time.monotonic()
        if channel == self._ctl:
            self._listening.clear()
            self._presence.recount()
            return
        found = self._shards.by_channel(channel)
        if found is not None:
            found[1].confirmed = False
            found[1].complete.clear()

    def _say_hello(self) -> None:
        """Tells the others this replica listens, straight to Redis (ahead of a buffered outbox)."""
        self._spawn(self._redis.execute_command(self._pub_cmd, self._ctl, self._presence.hello()))

    # -- outage reporting: once per outage, not per failed call ---------------------------------

    def went_down(self, where: str, exc: BaseException) -> None:
        if not self._down_logged:
            self._down_logged = True
            self.stats.outages += 1
            log.warning("redis unreachable; replicating nothing until it is back (local delivery goes on)",
                        extra={"fields": {"where": where, "error": str(exc)}})

    def unexpected(self, where: str, exc: BaseException) -> None:
        if not isinstance(exc, (*OUTAGE_ERRORS, ResponseError)):  # not an outage: say what it was
            log.warning("redis client failed unexpectedly; retrying", exc_info=exc,
                        extra={"fields": {"where": where, "error": f"{type(exc).__name__}: {exc}"}})

    def _came_back(self) -> None:
        if self._down_logged and self.connected:
            self._down_logged = False
            log.info("redis reachable again; replication resumed", extra={"fields": {"replica": self.replica_id}})

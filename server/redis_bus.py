"""The topic bus across replicas: every publish is delivered locally at once and also handed to
Redis pub/sub, and every replica delivers what the others publish (SPEC.md §4).

Why it is shaped like this:
* `publish` must never wait on the network, so the Redis write happens in a background writer fed
  by a bounded outbox. Local delivery never depends on Redis.
* Sharded channels, so a replica's bus cost is what its own subscribers need, not N times that.
  A session maps to one of `shards` channels (crc32 of its name, `<channel>:{<n>}`); a replica
  publishes an envelope to its session's shard and listens to a shard while it has a subscriber
  there (counted; after the last one leaves it keeps listening `linger_s` more, against churn).
  One channel per deployment (`shards=1`, what uibus did before) made every replica receive every
  envelope of every session, so adding replicas added work to each instead of capacity.
* Headers still mean "live". A fresh subscription to a shard takes a round trip to Redis, and
  pub/sub keeps nothing for a subscriber that is not there yet, so a stream awaits `ready(session)`
  (its shard's SUBSCRIBE confirmed, at most `confirm_s`) before it yields LIVE: an event published
  on any replica after the headers reaches it.
* Redis Cluster (`cluster=True`): shard channels are sharded pub/sub (SSUBSCRIBE/SPUBLISH, Redis
  7), so each master carries only its slots' traffic; the `{n}` hash tag spreads the shards over
  the slots. A replica holds one pub/sub connection per master that owns a shard it listens to,
  follows failovers and slot moves (a lost connection or a server-side SUNSUBSCRIBE makes it
  re-read the slot map and subscribe again at the new owner), and counts as disconnected (health
  NOT_SERVING) while any of those connections is down. Sentinel needs nothing here: the client's
  pool asks the sentinels for the master on every reconnect (uibus.redis_conn).
* Nothing acknowledged is lost silently. The outbox is also the buffer across a short outage or a
  failover: while Redis is unreachable envelopes stay in it (a batch whose write failed goes back
  to its front), bounded by `buffer_bytes` (default 16 MiB) and `outbox_size` envelopes, the
  oldest dropped first, and by age: an envelope older than `buffer_age_s` (default 10 s) when it
  could be sent is dropped (live UI events are worthless minutes later). Every drop is counted in
  `stats.dropped`. Once Redis answers again the writer holds the buffer until the other replicas
  are listening again (each says so with a hello on the control channel once all its channels
  are subscribed again, and when asked: the writer asks "who listens?" as soon as Redis answers,
  so a replica that never lost its subscriptions answers at once), at most `resubscribe_s`, then
  sends it. A batch that failed halfway may
  be sent twice: delivery across an outage is at least once.
* Envelope: one JSON header line `[origin, session, kind, target, key, type]` and the payload.
  Protobuf items travel as their serialized bytes with the message's full name, resolved on the
  receiving side through the default descriptor pool; JSON-able plain items travel as JSON.
* `publish` returns how many subscribers it reached. Locally that is exact; remote subscribers are
  known only by announcement, so for kinds marked `presence` (host requests, which openUrl uses to
  tell whether any host can open a URL; forwarded dialog answers) each replica announces its
  subscription counts on its shard, on change and as a periodic heartbeat, and also writes them
  to the shard's presence hash in Redis (same pipeline, ahead of the announcement). A replica that
  starts listening to a shard reads that hash once, after its SUBSCRIBE is confirmed, so it knows
  every replica's counts at once instead of after three heartbeats. `publish` adds the fresh
  counts and sends those kinds only when some other replica listens, so a caller told "nobody
  listens" never has its event delivered later; a caller that needs the counts of a session it
  has no subscriber in awaits `ready(session)` first (the shard is then followed for `visit_s`).
  A crashed replica's counts expire after three heartbeats. `announced` tells whether one given
  replica still announces a topic (extension-UI dialogs use it to tell a live holder of a waiting
  dialog from a crashed one). Hellos (who listens) go on one control channel every replica hears:
  a few bytes per replica per heartbeat.
* `stats` counts what crossed Redis; /metrics exports it as `uibus_replication_*_total`, and
  `shards_subscribed` as a gauge.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
import zlib
from collections import deque
from collections.abc import Coroutine, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from uibus.bus import Bus, Subscription
from uibus.kinds import Kind
from uibus.redis_conn import OUTAGE_ERRORS, AnyRedis, SlotMap, make_client, node_client

log = logging.getLogger("uibus.redis_bus")

_JSON_ITEM = ""  # type field of an envelope whose payload is a JSON value, not a protobuf
_PRESENCE = "!presence"  # type field of a subscription-count announcement
_HELLO = "!hello"  # type field of "this replica is subscribed" (after each (re)subscribe, and each heartbeat)
_WHO = "!who"  # type field of "who is subscribed?": every replica whose channels all are says hello
_BATCH = 512  # envelopes per pipelined write
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 2.0
_SINGLE = "single"  # the name of the one link to a single Redis (or a Sentinel-followed master)


def shard_of(session: str, shards: int) -> int:
    """The session's shard: stable across replicas, versions and restarts (crc32, not hash())."""
    return zlib.crc32(session.encode("utf-8", "surrogatepass")) % shards if shards > 1 else 0


@dataclass
class ReplicationStats:
    sent: int = 0  # envelopes written to Redis
    received: int = 0  # envelopes from other replicas
    dropped: int = 0  # envelopes not sent: outbox full or Redis down
    bad: int = 0  # envelopes received that could not be decoded
    unwanted: int = 0  # envelopes received for no subscriber here (other sessions of a shard listened to)
    unreplicable: int = 0  # items delivered locally only (neither protobuf nor JSON-able)
    outages: int = 0  # times the connection to Redis was lost

    def counters(self) -> dict[str, tuple[int, str]]:
        """Each counter with its help text, for /metrics (`uibus_replication_<name>_total`)."""
        return {"sent": (self.sent, "Envelopes this replica wrote to Redis"),
                "received": (self.received, "Envelopes received from other replicas"),
                "dropped": (self.dropped, "Envelopes not sent to Redis: outbox full or Redis down"),
                "bad": (self.bad, "Envelopes received that could not be decoded"),
                "unwanted": (self.unwanted, "Envelopes received from other replicas for no subscriber here"),
                "unreplicable": (self.unreplicable, "Events delivered on this replica only (no wire form)"),
                "outages": (self.outages, "Times the connection to Redis was lost")}


@dataclass
class _Shard:
    """One shard this replica listens to: why (refs) and how far (confirmed, presence read)."""

    channel: str
    refs: int = 0  # local subscriptions in the shard, plus one while visited (see ready)
    confirmed: bool = False  # Redis confirmed the SUBSCRIBE on the current connection
    complete: asyncio.Event = field(default_factory=asyncio.Event)  # confirmed and the presence hash read
    linger: asyncio.TimerHandle | None = None  # the pending unsubscribe after the last ref left
    visit: asyncio.TimerHandle | None = None  # the end of a visit (ready() without a subscriber)


class _Link:
    """One pub/sub connection: to the single Redis, or to one master of a cluster."""

    def __init__(self, name: str, client: AnyRedis, owned: bool) -> None:
        self.name = name
        self.client = client
        self.owned = owned  # a per-node client of a cluster: closed with the link
        self.want: set[str] = set()
        self.confirmed: set[str] = set()
        # Unsubscribes asked for and not yet confirmed: their confirmation is ours, not a slot move,
        # even when the channel is wanted again by then (a subscriber back right at the linger's end).
        self.leaving: dict[str, int] = {}
        self.pubsub: PubSub | None = None
        # False from a failure until the next confirmation: a new link counts as up, so opening one
        # (the first shard of a master) does not flip health to NOT_SERVING for a round trip.
        self.up = True
        self.lock = asyncio.Lock()  # subscribe/unsubscribe commands in the order they were asked
        self.task: asyncio.Task[None] | None = None


Outgoing = tuple[float, str, bytes, tuple[tuple[str, str, str], ...]]  # (queued, channel, envelope, presence writes)


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
        self._sub_cmd, self._unsub_cmd, self._msg_type = (
            ("ssubscribe", "sunsubscribe", "smessage") if cluster else ("subscribe", "unsubscribe", "message"))
        self._pub_cmd = "SPUBLISH" if cluster else "PUBLISH"
        self._ctl = f"{channel}:ctl"
        self._outbox: deque[Outgoing] = deque()
        self._outbox_size = outbox_size
        self._outbox_bytes = 0
        self._buffer_bytes = buffer_bytes
        self._buffer_age_s = buffer_age_s
        self._resubscribe_s = resubscribe_s
        self._linger_s = linger_s
        self._visit_s = visit_s
        self._confirm_s = confirm_s
        self._seen: dict[str, float] = {}  # other replica -> monotonic time it was last heard from
        self._small: set[asyncio.Task[Any]] = set()  # hellos, (un)subscribe commands, presence reads
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()  # set by the writer whenever the outbox is empty
        self._writer_up = True  # optimistic until a write fails, so early publishes are not dropped
        self._listening = asyncio.Event()  # the control channel is subscribed
        self._listening_since = 0.0  # monotonic time every channel was last confirmed after a loss
        self._listen_lost = 0.0  # monotonic time a subscription was last lost
        self._hello_due = True  # say hello once every channel is confirmed again
        self._down_logged = False
        self._tasks: list[asyncio.Task[None]] = []
        self._classes: dict[str, type[Message]] = {}
        self._presence_kinds: set[str] = set()  # names of the presence kinds subscribed to here
        self._heartbeat_s = heartbeat_s
        # (session, kind) -> origin replica -> (count, monotonic expiry)
        self._remote: dict[tuple[str, str], dict[str, tuple[int, float]]] = {}
        self._shards: dict[int, _Shard] = {}
        self._by_channel: dict[str, int] = {}
        self._links: dict[str, _Link] = {}
        self._regrouping: asyncio.Task[None] | None = None
        self._unplaced: set[str] = set()  # channels wanted whose cluster master is not known yet
        self._started = False
        self._slots = SlotMap(self._redis) if isinstance(self._redis, RedisCluster) else None
        self.mismatched: set[str] = set()  # replicas heard from with another shard count

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, wait_s: float = 2.0) -> None:
        """Starts the listeners, writer and heartbeat; waits up to `wait_s` for the subscription.

        An unreachable Redis is not fatal: the replica serves its own clients and keeps retrying.
        """
        if self._tasks:
            return
        self._started = True
        self._tasks = [asyncio.create_task(self._write_loop(), name="uibus-bus-write"),
                       asyncio.create_task(self._heartbeat_loop(), name="uibus-bus-heartbeat")]
        if self.cluster:
            self._tasks.append(asyncio.create_task(self._cluster_start(), name="uibus-bus-topology"))
        else:
            self._links[_SINGLE] = _Link(_SINGLE, self._redis, owned=False)
        self._unplaced.add(self._ctl)
        if not self.cluster:  # a cluster's channels are placed once its slot map is read
            self._place_unplaced()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._listening.wait(), wait_s)

    async def stop(self, flush_s: float = 0.5) -> None:
        """Flushes what is queued (briefly), stops the tasks and closes the Redis clients."""
        if self._outbox and self._writer_up:
            self._drained.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), flush_s)
        self._started = False
        links = list(self._links.values())
        tasks = {*self._tasks, *(link.task for link in links if link.task is not None),
                 *([self._regrouping] if self._regrouping is not None else [])}
        for task in self._small:
            task.cancel()
        # A cancel that lands inside a redis-py command can be swallowed (seen: the writer back at its
        # wait, stop() waiting for it forever), so the loops also see _started false, and whoever is
        # still running after a while is cancelled again; at most 5 s in all.
        self._wake.set()
        pending = {t for t in tasks if not t.done()}
        for _ in range(10):
            if not pending:
                break
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.5)
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a loop that ended with an error was logged by it already
        if pending:
            log.warning("redis bus tasks did not stop", extra={"fields": {"tasks": [t.get_name() for t in pending]}})
        if self._small:
            await asyncio.wait(self._small, timeout=1.0)
        for st in self._shards.values():
            for timer in (st.linger, st.visit):
                if timer is not None:
                    timer.cancel()
        self._tasks = []
        for link in links:
            if link.owned:
                with contextlib.suppress(Exception):
                    await link.client.aclose()
        self._links.clear()
        await self._redis.aclose()

    @property
    def connected(self) -> bool:
        """True while this replica can write to Redis and every channel it listens to is subscribed."""
        return (self._listening.is_set() and self._writer_up
                and all(link.up for link in self._links.values() if link.want))

    @property
    def shards_subscribed(self) -> int:
        """Shards this replica listens to now (for /metrics)."""
        return sum(1 for st in self._shards.values() if st.confirmed)

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        def done(task: asyncio.Task[Any]) -> None:
            self._small.discard(task)
            if not task.cancelled():
                task.exception()  # an outage: the link's loop sees it too and recovers

        task = asyncio.get_running_loop().create_task(work)
        self._small.add(task)
        task.add_done_callback(done)

    # -- shards: which channels this replica listens to -----------------------------------------

    def shard_channel(self, session: str) -> str:
        return f"{self.channel}:{{{shard_of(session, self.shards)}}}"

    def _shard(self, n: int) -> _Shard:
        st = self._shards.get(n)
        if st is None:
            st = self._shards[n] = _Shard(f"{self.channel}:{{{n}}}")
            self._by_channel[st.channel] = n
            self._want(st.channel)
        return st

    def _hold(self, n: int) -> None:
        st = self._shard(n)
        st.refs += 1
        if st.linger is not None:
            st.linger.cancel()
            st.linger = None

    def _release(self, n: int) -> None:
        st = self._shards.get(n)
        if st is None:
            return
        st.refs -= 1
        if st.refs <= 0 and st.linger is None:
            st.linger = asyncio.get_running_loop().call_later(self._linger_s, self._drop_shard, n)

    def _drop_shard(self, n: int) -> None:
        st = self._shards.get(n)
        if st is None or st.refs > 0:
            return
        del self._shards[n]
        del self._by_channel[st.channel]
        self._unwant(st.channel)
        for topic in [t for t in self._remote if shard_of(t[0], self.shards) == n]:
            del self._remote[topic]  # not followed any more: the counts would go stale

    async def ready(self, session: str) -> None:
        """Returns once this replica hears every event published for `session` on any replica and
        knows every replica's presence counts for it (at most `confirm_s`: with Redis down, local
        delivery goes on). Without a subscriber here the shard is followed for `visit_s`."""
        n = shard_of(session, self.shards)
        st = self._shard(n)
        if st.visit is not None or st.refs == 0:  # nobody here keeps the shard: visit it
            if st.visit is not None:
                st.visit.cancel()
            else:
                self._hold(n)
            st.visit = asyncio.get_running_loop().call_later(self._visit_s, self._end_visit, n)
        if not st.complete.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(st.complete.wait(), self._confirm_s)

    def _end_visit(self, n: int) -> None:
        st = self._shards.get(n)
        if st is not None and st.visit is not None:
            st.visit = None
            self._release(n)

    def _want(self, channel: str) -> None:
        link = self._link_for(channel) if self._started else None
        if link is None:  # a cluster whose slot map is not known yet: _regroup places it
            self._unplaced.add(channel)
            return
        link.want.add(channel)
        if link.task is None or link.task.done():
            link.task = asyncio.get_running_loop().create_task(self._link_loop(link), name=f"uibus-bus-{link.name}")
        elif link.pubsub is not None:
            self._spawn(self._command(link, self._sub_cmd, channel))

    def _unwant(self, channel: str) -> None:
        self._unplaced.discard(channel)
        for link in list(self._links.values()):  # _retire removes from it
            if channel in link.want:
                link.want.discard(channel)
                link.confirmed.discard(channel)
                if not link.want and link.owned:
                    self._retire(link)
                elif link.pubsub is not None:
                    link.leaving[channel] = link.leaving.get(channel, 0) + 1
                    self._spawn(self._command(link, self._unsub_cmd, channel))

    async def _command(self, link: _Link, command: str, channel: str) -> None:
        async with link.lock:
            pubsub = link.pubsub
            if pubsub is not None:
                await getattr(pubsub, command)(channel)

    # -- the links: one pub/sub connection per Redis (per master of a cluster) ------------------

    def _link_for(self, channel: str) -> _Link | None:
        if not self.cluster:
            return self._links.get(_SINGLE)
        assert isinstance(self._redis, RedisCluster)
        try:
            node = self._redis.get_node_from_key(channel)
        except Exception:  # the slot map is not read yet, or the slot has no master right now
            return None
        if node is None:
            return None
        link = self._links.get(node.name)
        if link is None:
            link = self._links[node.name] = _Link(node.name, node_client(self._redis, node.host, node.port,
                                                                         "uibus-bus"), owned=True)
        return link

    def _retire(self, link: _Link) -> None:
        self._links.pop(link.name, None)
        for channel in link.confirmed:
            self._lost(channel)
        link.want.clear()
        link.confirmed.clear()
        task = link.task
        if task is not None:
            task.cancel()

        async def close() -> None:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            with contextlib.suppress(Exception):
                await link.client.aclose()

        self._spawn(close())

    async def _link_loop(self, link: _Link) -> None:
        backoff = _BACKOFF_MIN_S
        while self._started and self._links.get(link.name) is link:
            pubsub = link.client.pubsub(ignore_subscribe_messages=False)
            try:
                link.pubsub = pubsub
                channels = sorted(link.want, key=lambda c: c == self._ctl)  # the control channel last
                if not channels:
                    return
                async with link.lock:
                    if self.cluster:  # SSUBSCRIBE takes channels of one slot only: one command each
                        for channel in channels:
                            await pubsub.ssubscribe(channel)
                    else:  # one command: every channel is subscribed before the hello (ctl, last) goes out
                        await pubsub.subscribe(*channels)
                backoff = _BACKOFF_MIN_S
                while self._started:
                    msg = await pubsub.get_message(timeout=None)
                    if msg is not None:
                        self._on_message(link, msg)
            except Exception as exc:  # an outage; MOVED or a slot without a master (ResponseError); any other
                # failure of the client too (a write racing a reconnect raised RuntimeError on uvloop): the
                # listener must outlive them all, so each is a lost subscription, retried.
                link.up = False
                link.pubsub = None
                link.leaving.clear()  # what was in flight on the lost connection is void
                for channel in list(link.confirmed):
                    self._lost(channel)
                link.confirmed.clear()
                self._unexpected("listen", exc)
                self._went_down("listen", exc)
                if self.cluster:
                    self._regroup_soon()
            finally:
                link.pubsub = None
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    def _on_message(self, link: _Link, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == self._msg_type:
            self._receive(msg["data"])
            return
        channel = msg.get("channel")
        if isinstance(channel, bytes):
            channel = channel.decode()
        if kind == self._sub_cmd:
            if channel in link.want:
                link.up = True
                link.confirmed.add(channel)
                self._confirmed(channel)
        elif kind == self._unsub_cmd:
            asked = link.leaving.get(channel, 0)
            if asked:
                if asked == 1:
                    del link.leaving[channel]
                else:
                    link.leaving[channel] = asked - 1
                if channel not in link.want:
                    link.confirmed.discard(channel)
                return  # wanted again: the SUBSCRIBE sent after it is on its way, its confirmation follows
            link.confirmed.discard(channel)
            if self.cluster and channel in link.want:  # not asked for: the slot moved (or its master failed over)
                self._lost(channel)
                link.want.discard(channel)
                self._unplaced.add(channel)
                self._regroup_soon()

    def _confirmed(self, channel: str) -> None:
        if channel == self._ctl:
            self._listening.set()
        else:
            n = self._by_channel.get(channel)
            st = self._shards.get(n) if n is not None else None
            if st is not None and not st.confirmed:
                st.confirmed = True
                self._spawn(self._read_presence(n, st))  # type: ignore[arg-type]
                self._announce_shard(n)  # type: ignore[arg-type]
        if self._hello_due and self._all_confirmed():
            self._hello_due = False
            self._listening_since = time.monotonic()
            self._say_hello()
            self._came_back()

    def _lost(self, channel: str) -> None:
        self._hello_due = True
        self._listen_lost = time.monotonic()
        if channel == self._ctl:
            self._listening.clear()
            return
        n = self._by_channel.get(channel)
        st = self._shards.get(n) if n is not None else None
        if st is not None:
            st.confirmed = False
            st.complete.clear()

    def _all_confirmed(self) -> bool:
        return not self._unplaced and all(link.want <= link.confirmed for link in self._links.values())

    async def _read_presence(self, n: int, st: _Shard) -> None:
        """The shard's presence hash, read once its subscription is confirmed: every change after it
        arrives as an announcement, so the counts are complete from here on."""
        try:
            fields = await self._redis.hgetall(self._presence_key(n))
        except OUTAGE_ERRORS:
            return  # the link's loop notices the outage too; the next confirmation reads again
        now_ms, now = time.time() * 1000, time.monotonic()
        stale: list[bytes] = []
        for raw_field, raw_value in fields.items():
            try:
                origin, session, kind = json.loads(raw_field)
                count, expires_ms = (int(x) for x in raw_value.split())
            except (ValueError, TypeError):
                stale.append(raw_field)
                continue
            if expires_ms < now_ms - 10 * self._heartbeat_s * 1000:
                stale.append(raw_field)  # a replica gone for good: nobody else would ever delete it
            elif origin != self.replica_id and count > 0 and expires_ms > now_ms:
                self._remote.setdefault((session, kind), {})[origin] = (count, now + (expires_ms - now_ms) / 1000)
        if stale:
            with contextlib.suppress(*OUTAGE_ERRORS):
                await self._redis.hdel(self._presence_key(n), *stale)
        if st.confirmed and self._shards.get(n) is st:
            st.complete.set()

    def _presence_key(self, n: int) -> str:
        return f"{self.channel}:presence:{{{n}}}"

    # -- cluster topology -----------------------------------------------------------------------

    async def _cluster_start(self) -> None:
        """Learns the slot map (retrying while the cluster is unreachable), then places the channels."""
        await self._refresh_topology(first=True)
        self._place_unplaced()

    async def _refresh_topology(self, first: bool = False) -> None:
        """Reads the slot map (uibus.redis_conn.SlotMap: one reader at a time), retrying while
        the cluster is unreachable. `first`: only if never read, as at start, where the writer and
        the listeners start together: reading it again there, under the writer's first pipeline,
        closed the connections that pipeline was using (it hung, and the bus sent nothing)."""
        assert self._slots is not None
        backoff = _BACKOFF_MIN_S
        while self._started:
            try:
                await (self._slots.learn() if first else self._slots.read())
                return
            except Exception as exc:  # every node down (RedisClusterException), an outage, a slot-less reply
                self._went_down("topology", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    def _regroup_soon(self) -> None:
        if self._started and (self._regrouping is None or self._regrouping.done()):
            self._regrouping = asyncio.get_running_loop().create_task(self._regroup(), name="uibus-bus-regroup")

    async def _regroup(self) -> None:
        """After a failover or a slot move: reads the slot map again and moves every channel to the
        link of the master that owns its slot now."""
        await asyncio.sleep(0.1)  # several links fail at once: one refresh for all of them
        await self._refresh_topology()
        for link in list(self._links.values()):
            for channel in list(link.want):
                owner = self._link_for(channel)
                if owner is not link:
                    link.want.discard(channel)
                    if channel in link.confirmed:
                        link.confirmed.discard(channel)
                        self._lost(channel)
                    self._unplaced.add(channel)
            if not link.want and link.owned:
                self._retire(link)
        self._place_unplaced()

    def _place_unplaced(self) -> None:
        channels, self._unplaced = self._unplaced, set()
        for channel in channels:
            self._want(channel)
        if self._unplaced:  # still no master for some slot: try again shortly
            loop = asyncio.get_running_loop()
            loop.call_later(0.5, self._regroup_soon)

    # -- publishing -----------------------------------------------------------------------------

    def publish(self, session: str, kind: Kind, item: Any, target: str | None = None,
                key: Hashable = None) -> int:
        name = kind.name
        self.last_replicated = False
        n = self._deliver(session, name, item, target, key)
        if kind.presence:
            remote = self.remote_count(session, name)
            if not remote:  # no other replica listens: sending would deliver to nobody, or worse, to
                return n  # a subscriber that joins later, after the caller was told "nobody is listening"
            n += remote
        if isinstance(item, Message):
            type_name, payload = item.DESCRIPTOR.full_name, item.SerializeToString()
        else:
            try:
                type_name, payload = _JSON_ITEM, json.dumps(item, separators=(",", ":")).encode()
            except (TypeError, ValueError):
                self.stats.unreplicable += 1
                return n
        try:
            head = json.dumps([self.replica_id, session, name, target, key, type_name], separators=(",", ":"))
        except (TypeError, ValueError):  # a key JSON cannot carry
            self.stats.unreplicable += 1
            return n
        self.last_replicated = self._enqueue(self.shard_channel(session), head.encode() + b"\n" + payload)
        return n

    def _enqueue(self, channel: str, envelope: bytes, writes: tuple[tuple[str, str, str], ...] = ()) -> bool:
        if not self._tasks:
            self.stats.dropped += 1
            return False
        self._outbox.append((time.monotonic(), channel, envelope, writes))
        self._outbox_bytes += len(envelope)
        self._bound()
        self._wake.set()
        return True

    def _bound(self) -> None:
        """Drops the oldest envelopes beyond the outbox's count and byte bounds (counted)."""
        outbox = self._outbox
        while len(outbox) > self._outbox_size or (self._outbox_bytes > self._buffer_bytes and len(outbox) > 1):
            self._outbox_bytes -= len(outbox.popleft()[2])
            self.stats.dropped += 1

    def _expire(self) -> None:
        """Drops what waited longer than buffer_age_s (counted): it is news no more."""
        outbox, oldest = self._outbox, time.monotonic() - self._buffer_age_s
        while outbox and outbox[0][0] < oldest:
            self._outbox_bytes -= len(outbox.popleft()[2])
            self.stats.dropped += 1

    async def _write_loop(self) -> None:
        expire_ms = int(10 * self._heartbeat_s * 1000)
        if self.cluster:  # the first pipeline must not initialize the client beside _cluster_start
            await self._refresh_topology(first=True)
        while self._started:
            if not self._outbox:
                self._drained.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._expire()
            batch = [self._outbox.popleft() for _ in range(min(_BATCH, len(self._outbox)))]
            self._outbox_bytes -= sum(len(e[2]) for e in batch)
            if not batch:
                continue
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for _, channel, envelope, writes in batch:
                        for key, fld, value in writes:  # presence: the hash first, then the announcement
                            if value:
                                pipe.hset(key, fld, value)
                                pipe.pexpire(key, expire_ms)
                            else:
                                pipe.hdel(key, fld)
                        pipe.execute_command(self._pub_cmd, channel, envelope)
                    await pipe.execute()
                self.stats.sent += len(batch)
            except Exception as exc:  # as in _link_loop: whatever the client raises, the writer lives on
                self._unexpected("write", exc)
                self._outbox.extendleft(reversed(batch))  # kept, in order, for when Redis is back
                self._outbox_bytes += sum(len(e[2]) for e in batch)
                self._bound()
                self._writer_up = False
                self._went_down("write", exc)
                down_since = time.monotonic()
                await self._until_reachable()
                # Replicas that never lost their subscriptions (a cluster master they do not listen to
                # failed) would only say hello at their next heartbeat: ask, so the wait is a round trip.
                self._spawn(self._redis.execute_command(self._pub_cmd, self._ctl, self._control(_WHO)))
                await self._others_listening(down_since)
                self._writer_up = True
                self._came_back()
                self._announce_all()

    async def _others_listening(self, down_since: float) -> None:
        """Waits (at most resubscribe_s) until this replica and every replica heard from before the
        outage are subscribed again, so the buffer sent next reaches them."""
        known = [o for o, t in self._seen.items() if t >= down_since - 3 * self._heartbeat_s]
        deadline = time.monotonic() + self._resubscribe_s
        while time.monotonic() < deadline:
            mine = self._all_confirmed() and (self._listening_since >= down_since or self._listen_lost < down_since)
            if mine and all(self._seen.get(o, 0.0) >= down_since for o in known):
                return
            await asyncio.sleep(0.02)

    async def _until_reachable(self) -> None:
        backoff = _BACKOFF_MIN_S
        while self._started:
            await asyncio.sleep(backoff)
            try:
                if isinstance(self._redis, RedisCluster):
                    await self._refresh_topology()
                    await self._redis.ping(target_nodes=RedisCluster.PRIMARIES)
                else:
                    await self._redis.ping()
                return
            except Exception:
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    # -- receiving ------------------------------------------------------------------------------

    def _receive(self, data: bytes) -> None:
        """Delivers one envelope from another replica; a bad one is counted, never raised."""
        head, _, payload = data.partition(b"\n")
        try:
            origin, session, kind, target, key, type_name = json.loads(head)
            if origin == self.replica_id:
                return
            self._seen[origin] = time.monotonic()
            if type_name in (_HELLO, _WHO) and session and session != str(self.shards):
                self._disagrees(origin, session)
            if type_name == _HELLO:
                return
            if type_name == _WHO:
                if not self._hello_due and self._all_confirmed():
                    self._say_hello()
                return
            self.stats.received += 1
            if type_name == _PRESENCE:
                self._on_presence(origin, json.loads(payload))
                return
            if (session, kind) not in self._topics:
                self.stats.unwanted += 1
                return  # nobody here listens: skip decoding
            if type_name == _JSON_ITEM:
                item = json.loads(payload)
            else:
                item = self._message_class(type_name).FromString(payload)
        except (ValueError, TypeError, KeyError, DecodeError):
            self.stats.bad += 1
            return
        self._deliver(session, kind, item, target, tuple(key) if isinstance(key, list) else key)

    def _message_class(self, full_name: str) -> type[Message]:
        cls = self._classes.get(full_name)
        if cls is None:
            descriptor = descriptor_pool.Default().FindMessageTypeByName(full_name)  # KeyError if unknown
            cls = self._classes[full_name] = message_factory.GetMessageClass(descriptor)
        return cls

    # -- presence: how many subscribers other replicas have -------------------------------------

    def subscribe(self, session: str, kind: Kind, target: str = "", maxsize: int | None = None) -> Subscription:
        sub = super().subscribe(session, kind, target, maxsize)
        self._hold(shard_of(session, self.shards))
        if kind.presence:
            self._presence_kinds.add(kind.name)
            self._announce([(session, kind.name)])
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        before = self.count(sub.kind, sub.session)
        super().unsubscribe(sub)
        if self.count(sub.kind, sub.session) != before:
            self._release(shard_of(sub.session, self.shards))
            if sub.kind in self._presence_kinds:
                self._announce([(sub.session, sub.kind)])

    def remote_count(self, session: str, kind: Kind | str) -> int:
        """Subscribers other replicas announced for (session, kind) and that have not expired."""
        origins = self._remote.get((session, kind.name if isinstance(kind, Kind) else kind))
        if not origins:
            return 0
        now = time.monotonic()
        return sum(n for n, expires in origins.values() if expires > now)

    def announced(self, origin: str, session: str, kind: Kind) -> bool | None:
        """Whether replica `origin` has a fresh announcement of a subscriber of (session, kind).

        None when this replica cannot tell: it does not follow the session's shard, or has not read
        the shard's presence since its subscription was (re)confirmed (Redis is down, say)."""
        st = self._shards.get(shard_of(session, self.shards))
        if st is None or not st.complete.is_set():
            return None
        origins = self._remote.get((session, kind.name))
        entry = origins.get(origin) if origins else None
        return entry is not None and entry[0] > 0 and entry[1] > time.monotonic()

    def _announce(self, topics: Iterable[tuple[str, str]]) -> None:
        by_shard: dict[int, list[list[Any]]] = {}
        for session, kind in topics:
            by_shard.setdefault(shard_of(session, self.shards), []).append([session, kind, self.count(kind, session)])
        expires_ms = int(time.time() * 1000 + 3 * self._heartbeat_s * 1000)
        head = json.dumps([self.replica_id, "", "", None, None, _PRESENCE], separators=(",", ":")).encode()
        for n, entries in by_shard.items():
            key = self._presence_key(n)
            writes = tuple((key, json.dumps([self.replica_id, s, k], separators=(",", ":")),
                            f"{c} {expires_ms}" if c > 0 else "") for s, k, c in entries)
            self._enqueue(f"{self.channel}:{{{n}}}", head + b"\n" + json.dumps(entries, separators=(",", ":")).encode(),
                          writes)

    def _announce_shard(self, n: int) -> None:
        self._announce([t for t in self._topics if t[1] in self._presence_kinds
                        and shard_of(t[0], self.shards) == n])

    def _say_hello(self) -> None:
        """Tells the others this replica listens, straight to Redis (ahead of a buffered outbox), in
        a task of its own: a cancel landing inside a redis-py command can be swallowed, and the
        listener must stay cancellable (seen here on uvloop: stop() waited forever)."""
        self._spawn(self._redis.execute_command(self._pub_cmd, self._ctl, self._control(_HELLO)))

    def _control(self, what: str) -> bytes:
        """A hello or a who, with this replica's shard count in the session field: replicas that
        disagree on it would each listen where the others do not publish."""
        return json.dumps([self.replica_id, str(self.shards), "", None, None, what],
                          separators=(",", ":")).encode() + b"\n"

    def _announce_all(self) -> None:
        mine = [t for t in self._topics if t[1] in self._presence_kinds]
        for i in range(0, len(mine), 1000):
            self._announce(mine[i:i + 1000])

    def _on_presence(self, origin: str, entries: list[list[Any]]) -> None:
        expires = time.monotonic() + 3 * self._heartbeat_s
        for session, kind, n in entries:
            origins = self._remote.setdefault((session, kind), {})
            if n > 0:
                origins[origin] = (int(n), expires)
            else:
                origins.pop(origin, None)
                if not origins:
                    del self._remote[(session, kind)]

    async def _heartbeat_loop(self) -> None:
        while self._started:
            await asyncio.sleep(self._heartbeat_s)
            self._announce_all()
            self._enqueue(self._ctl, self._control(_HELLO))  # the others know it listens (_others_listening)
            now = time.monotonic()
            for origin in [o for o, t in self._seen.items() if t < now - 10 * self._heartbeat_s]:
                del self._seen[origin]  # a replica gone for good
            for topic in [t for t, o in self._remote.items() if all(e <= now for _, e in o.values())]:
                del self._remote[topic]

    # -- outage reporting: once per outage, not per failed call ---------------------------------

    def _went_down(self, where: str, exc: BaseException) -> None:
        if not self._down_logged:
            self._down_logged = True
            self.stats.outages += 1
            log.warning("redis unreachable; replicating nothing until it is back (local delivery goes on)",
                        extra={"fields": {"where": where, "error": str(exc)}})

    def _disagrees(self, origin: str, shards: str) -> None:
        """Another replica uses another --bus-shards: events between the two are lost for most
        sessions (each maps them to other channels). Said once per replica, as an error."""
        if origin not in self.mismatched:
            self.mismatched.add(origin)
            log.error("another replica uses a different --bus-shards: most sessions' events between the two are "
                      "lost; give every replica the same value", extra={"fields": {
                          "replica": origin, "its_shards": shards, "our_shards": self.shards}})

    @staticmethod
    def _unexpected(where: str, exc: Exception) -> None:
        if not isinstance(exc, (*OUTAGE_ERRORS, ResponseError)):  # not an outage: say what it was
            log.warning("redis client failed unexpectedly; retrying", exc_info=exc,
                        extra={"fields": {"where": where, "error": f"{type(exc).__name__}: {exc}"}})

    def _came_back(self) -> None:
        if self._down_logged and self.connected:
            self._down_logged = False
            log.info("redis reachable again; replication resumed", extra={"fields": {"replica": self.replica_id}})

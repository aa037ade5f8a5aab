"""The topic bus across replicas: every publish is delivered locally at once and also handed to
Redis pub/sub, and every replica delivers what the others publish (SPEC.md §4).

Why it is shaped like this:
* `publish` must never wait on the network, so the Redis write happens in a background writer fed
  by a bounded outbox. Local delivery never depends on Redis.
* Nothing acknowledged is lost silently. The outbox is also the buffer across a short outage or a
  failover: while Redis is unreachable envelopes stay in it (a batch whose write failed goes back
  to its front), bounded by `buffer_bytes` (default 16 MiB) and `outbox_size` envelopes, the
  oldest dropped first, and by age: an envelope older than `buffer_age_s` (default 10 s) when it
  could be sent is dropped (live UI events are worthless minutes later). Every drop is counted in
  `stats.dropped`. Once Redis answers again the writer holds the buffer until the other replicas
  are listening again (each says so with a hello when its subscription is back; Redis pub/sub
  keeps nothing for a subscriber that is not there yet), at most `resubscribe_s`, then sends it.
  A batch that failed halfway may be sent twice: delivery across an outage is at least once.
* One channel per deployment, not one per session: every replica receives every envelope, reads a
  short header and skips the payload when it has no subscriber for that (session, kind), which
  costs a dict lookup. Per-session channels would cut cross traffic for many replicas with
  disjoint sessions, but each first subscriber of a session would then race its own SUBSCRIBE
  (events published before it lands are lost) and every stream open/close would become Redis
  traffic. For the few replicas uibus is deployed with, one channel is the simpler correct choice.
* Envelope: one JSON header line `[origin, session, kind, target, key, type]` and the payload.
  Protobuf items travel as their serialized bytes with the message's full name, resolved on the
  receiving side through the default descriptor pool; JSON-able plain items travel as JSON.
* `publish` returns how many subscribers it reached. Locally that is exact; remote subscribers are
  known only by announcement, so for kinds marked `presence` (host requests, which openUrl uses to
  tell whether any host can open a URL) each replica announces its subscription counts
  on change and as a periodic heartbeat, and `publish` adds the other replicas' fresh counts and
  sends those kinds only when some other replica listens, so a caller told "nobody listens" never
  has its event delivered later. A crashed replica's counts expire after three heartbeats. For
  other kinds the number is local only (the same event may reach more webviews elsewhere).
  `announced` tells whether one given replica still announces a topic (extension-UI dialogs use
  it to tell a live holder of a waiting dialog from a crashed one).
* `stats` counts what crossed Redis; /metrics exports it as `uibus_replication_*_total`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from uibus.bus import Bus, Subscription
from uibus.kinds import Kind
from uibus.redis_conn import OUTAGE_ERRORS, make_client

log = logging.getLogger("uibus.redis_bus")

_JSON_ITEM = ""  # type field of an envelope whose payload is a JSON value, not a protobuf
_PRESENCE = "!presence"  # type field of a subscription-count announcement
_HELLO = "!hello"  # type field of "this replica is subscribed" (after each (re)subscribe, and each heartbeat)
_BATCH = 512  # envelopes per pipelined write
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 2.0


@dataclass
class ReplicationStats:
    sent: int = 0  # envelopes written to Redis
    received: int = 0  # envelopes from other replicas
    dropped: int = 0  # envelopes not sent: outbox full or Redis down
    bad: int = 0  # envelopes received that could not be decoded
    unwanted: int = 0  # envelopes received for no subscriber here (the N x cost of one channel)
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


class ReplicatedBus(Bus):
    """A `Bus` whose topics span every replica sharing one Redis."""

    replicated = True

    def __init__(self, redis_url: str, queue_size: int = 256, max_per_session: int = 10_000, *,
                 channel: str = "uibus:bus", outbox_size: int = 10_000, heartbeat_s: float = 5.0,
                 mailbox_bytes: int = 16 * 1024 * 1024, mailboxes_bytes: int = 256 * 1024 * 1024,
                 buffer_bytes: int = 16 * 1024 * 1024, buffer_age_s: float = 10.0, resubscribe_s: float = 4.0) -> None:
        super().__init__(queue_size, max_per_session, mailbox_bytes=mailbox_bytes, mailboxes_bytes=mailboxes_bytes)
        self.replica_id = uuid.uuid4().hex[:16]
        self.channel = channel
        self.stats = ReplicationStats()
        self._redis = make_client(redis_url, "uibus-bus")
        self._outbox: deque[tuple[float, bytes]] = deque()  # (monotonic time queued, envelope)
        self._outbox_size = outbox_size
        self._outbox_bytes = 0
        self._buffer_bytes = buffer_bytes
        self._buffer_age_s = buffer_age_s
        self._resubscribe_s = resubscribe_s
        self._seen: dict[str, float] = {}  # other replica -> monotonic time it was last heard from
        self._hellos: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()  # set by the writer whenever the outbox is empty
        self._writer_up = True  # optimistic until a write fails, so early publishes are not dropped
        self._listening = asyncio.Event()
        self._listening_since = 0.0  # monotonic time the current subscription to Redis began
        self._listen_lost = 0.0  # monotonic time the subscription was last lost
        self._down_logged = False
        self._tasks: list[asyncio.Task[None]] = []
        self._classes: dict[str, type[Message]] = {}
        self._presence_kinds: set[str] = set()  # names of the presence kinds subscribed to here
        self._heartbeat_s = heartbeat_s
        # (session, kind) -> origin replica -> (count, monotonic expiry)
        self._remote: dict[tuple[str, str], dict[str, tuple[int, float]]] = {}

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, wait_s: float = 2.0) -> None:
        """Starts the listener, writer and heartbeat; waits up to `wait_s` for the subscription.

        An unreachable Redis is not fatal: the replica serves its own clients and keeps retrying.
        """
        if self._tasks:
            return
        self._tasks = [asyncio.create_task(self._listen_loop(), name="uibus-bus-listen"),
                       asyncio.create_task(self._write_loop(), name="uibus-bus-write"),
                       asyncio.create_task(self._heartbeat_loop(), name="uibus-bus-heartbeat")]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._listening.wait(), wait_s)

    async def stop(self, flush_s: float = 0.5) -> None:
        """Flushes what is queued (briefly), stops the tasks and closes the Redis client."""
        if self._outbox and self._writer_up:
            self._drained.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), flush_s)
        for task in [*self._tasks, *self._hellos]:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._hellos:
            await asyncio.wait(self._hellos, timeout=1.0)
        self._tasks = []
        await self._redis.aclose()

    @property
    def connected(self) -> bool:
        """True while this replica both receives from and can write to Redis."""
        return self._listening.is_set() and self._writer_up

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
        self.last_replicated = self._enqueue(head.encode() + b"\n" + payload)
        return n

    def _enqueue(self, envelope: bytes) -> bool:
        if not self._tasks:
            self.stats.dropped += 1
            return False
        self._outbox.append((time.monotonic(), envelope))
        self._outbox_bytes += len(envelope)
        self._bound()
        self._wake.set()
        return True

    def _bound(self) -> None:
        """Drops the oldest envelopes beyond the outbox's count and byte bounds (counted)."""
        outbox = self._outbox
        while len(outbox) > self._outbox_size or (self._outbox_bytes > self._buffer_bytes and len(outbox) > 1):
            self._outbox_bytes -= len(outbox.popleft()[1])
            self.stats.dropped += 1

    def _expire(self) -> None:
        """Drops what waited longer than buffer_age_s (counted): it is news no more."""
        outbox, oldest = self._outbox, time.monotonic() - self._buffer_age_s
        while outbox and outbox[0][0] < oldest:
            self._outbox_bytes -= len(outbox.popleft()[1])
            self.stats.dropped += 1

    async def _write_loop(self) -> None:
        while True:
            if not self._outbox:
                self._drained.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._expire()
            batch = [self._outbox.popleft() for _ in range(min(_BATCH, len(self._outbox)))]
            self._outbox_bytes -= sum(len(e) for _, e in batch)
            if not batch:
                continue
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for _, envelope in batch:
                        pipe.publish(self.channel, envelope)
                    await pipe.execute()
                self.stats.sent += len(batch)
            except OUTAGE_ERRORS as exc:
                self._outbox.extendleft(reversed(batch))  # kept, in order, for when Redis is back
                self._outbox_bytes += sum(len(e) for _, e in batch)
                self._bound()
                self._writer_up = False
                self._went_down("write", exc)
                down_since = time.monotonic()
                await self._until_reachable()
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
            mine = self._listening.is_set() and (self._listening_since >= down_since or self._listen_lost < down_since)
            if mine and all(self._seen.get(o, 0.0) >= down_since for o in known):
                return
            await asyncio.sleep(0.02)

    async def _until_reachable(self) -> None:
        backoff = _BACKOFF_MIN_S
        while True:
            await asyncio.sleep(backoff)
            try:
                await self._redis.ping()
                return
            except OUTAGE_ERRORS:
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    # -- receiving ------------------------------------------------------------------------------

    async def _listen_loop(self) -> None:
        backoff = _BACKOFF_MIN_S
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self._listening_since = time.monotonic()
                self._listening.set()
                self._say_hello()
                backoff = _BACKOFF_MIN_S
                self._came_back()
                self._announce_all()  # so others learn our subscriptions without waiting a heartbeat
                while True:
                    msg = await pubsub.get_message(timeout=None)
                    if msg is not None and msg.get("type") == "message":
                        self._receive(msg["data"])
            except OUTAGE_ERRORS as exc:
                self._listening.clear()
                self._listen_lost = time.monotonic()
                self._went_down("listen", exc)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    def _receive(self, data: bytes) -> None:
        """Delivers one envelope from another replica; a bad one is counted, never raised."""
        head, _, payload = data.partition(b"\n")
        try:
            origin, session, kind, target, key, type_name = json.loads(head)
            if origin == self.replica_id:
                return
            self._seen[origin] = time.monotonic()
            if type_name == _HELLO:
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
        if kind.presence:
            self._presence_kinds.add(kind.name)
            self._announce([(session, kind.name)])
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        before = self.count(sub.kind, sub.session)
        super().unsubscribe(sub)
        if sub.kind in self._presence_kinds and self.count(sub.kind, sub.session) != before:
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

        None when this replica cannot tell: it is not listening to Redis, or has not listened for
        a whole expiry window (three heartbeats) yet, so silence is not yet evidence of absence.
        """
        origins = self._remote.get((session, kind.name))
        entry = origins.get(origin) if origins else None
        now = time.monotonic()
        if entry is not None and entry[0] > 0 and entry[1] > now:
            return True
        if not self._listening.is_set() or now - self._listening_since < 3 * self._heartbeat_s:
            return None
        return False

    def _announce(self, topics: Iterable[tuple[str, str]]) -> None:
        entries = [[s, k, self.count(k, s)] for s, k in topics]
        if entries:
            head = json.dumps([self.replica_id, "", "", None, None, _PRESENCE], separators=(",", ":"))
            self._enqueue(head.encode() + b"\n" + json.dumps(entries, separators=(",", ":")).encode())

    def _say_hello(self) -> None:
        """Tells the others this replica listens, straight to Redis (ahead of a buffered outbox), in
        a task of its own: a cancel landing inside a redis-py command can be swallowed, and the
        listener must stay cancellable (seen here on uvloop: stop() waited forever)."""
        def done(task: asyncio.Task[Any]) -> None:
            self._hellos.discard(task)
            if not task.cancelled():
                task.exception()  # an outage: the heartbeat's hello follows anyway

        task = asyncio.get_running_loop().create_task(self._redis.publish(self.channel, self._hello()))
        self._hellos.add(task)
        task.add_done_callback(done)

    def _hello(self) -> bytes:
        return json.dumps([self.replica_id, "", "", None, None, _HELLO], separators=(",", ":")).encode() + b"\n"

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
        while True:
            await asyncio.sleep(self._heartbeat_s)
            self._announce_all()
            self._enqueue(self._hello())  # so the others know this replica listens (see _others_listening)
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

    def _came_back(self) -> None:
        if self._down_logged and self.connected:
            self._down_logged = False
            log.info("redis reachable again; replication resumed", extra={"fields": {"replica": self.replica_id}})

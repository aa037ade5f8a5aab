"""Presence: how many subscribers the other replicas have, and which replicas are listening.

`publish` returns how many subscribers it reached. Locally that is exact; remote subscribers are
known only by announcement, so for kinds marked `presence` (host requests, which openUrl uses to
tell whether any host can open a URL; forwarded dialog answers) each replica announces its
subscription counts on its shard, on change and as a periodic heartbeat, and also writes them to
the shard's presence hash in Redis (same pipeline, ahead of the announcement). A replica that
starts listening to a shard reads that hash once, after its SUBSCRIBE is confirmed (`read`), so it
knows every replica's counts at once instead of after three heartbeats. A crashed replica's counts
expire after three heartbeats. `announced` tells whether one given replica still announces a
topic (extension-UI dialogs use it to tell a live holder of a waiting dialog from a crashed one).

Hellos (who listens) go on one control channel every replica hears: a few bytes per replica per
heartbeat. `seen` is when each other replica was last heard from; the writer waits for the ones it
knew to say hello again after an outage before it sends what it buffered. A replica that uses
another shard count is reported once, as an error (`mismatched`).

Versions: every hello, who and presence announcement carries its sender's wire protocol version
(uibus.infra.redis.codec); a replica of uibus 0.1.0 says none and is taken as version 1. `wire` is the
version this replica writes data envelopes in: the lowest any replica heard within the last ten
heartbeats speaks (as long as `seen` remembers it), never above our own. Until the census is
complete it is version 1, since a 0.1.0 replica may be live and unheard: the census begins when the
control channel is subscribed, with a who that every listening replica answers with a hello
(0.1.0's too), and ends CENSUS_S later (at most a heartbeat); losing the control channel begins it
again. So an old replica never gets a header it counts as bad, and once the last one is gone (ten
heartbeats of silence) the newer form is written again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Collection, Iterable

from uibus.infra.redis import codec
from uibus.infra.redis.conn import OUTAGE_ERRORS, AnyRedis
from uibus.infra.redis.outbox import Writes
from uibus.infra.redis.shards import Shard, Shards

log = logging.getLogger("uibus.infra.redis")
CENSUS_S = 1.0  # after our who: every listening replica has said hello (a round trip; generous)


class Presence:
    """This replica's view of the others' subscriber counts and liveness; builds its own announcements."""

    def __init__(self, replica_id: str, shards: Shards, *, heartbeat_s: float,
                 count: Callable[[str, str], int], topics: Collection[tuple[str, str]],
                 enqueue: Callable[[str, bytes, Writes], bool]) -> None:
        """`count(kind, session)`: subscribers here; `topics`: the (session, kind) subscribed here
        (a live view); `enqueue(channel, envelope, writes)`: into the outbox."""
        self.replica_id = replica_id
        self.shards = shards
        self.heartbeat_s = heartbeat_s
        self._count = count
        self._topics = topics
        self._enqueue = enqueue
        self.kinds: set[str] = set()  # names of the presence kinds subscribed to here
        # (session, kind) -> origin replica -> (count, monotonic expiry)
        self.remote: dict[tuple[str, str], dict[str, tuple[int, float]]] = {}
        self.seen: dict[str, float] = {}  # other replica -> monotonic time it was last heard from
        self.mismatched: set[str] = set()  # replicas heard from with another shard count
        self.versions: dict[str, int] = {}  # other replica -> the wire protocol it speaks
        self.wire = codec.LEGACY  # the version data envelopes are written in now (see the module docstring)
        self._census_ends: float | None = None  # monotonic end of the census of live replicas; None: not begun

    def key(self, n: int) -> str:
        """The presence hash of shard `n`."""
        return f"{self.shards.channel}:presence:{{{n}}}"

    # -- what the others have -------------------------------------------------------------------

    def remote_count(self, session: str, kind: str) -> int:
        """Subscribers other replicas announced for (session, kind) and that have not expired."""
        origins = self.remote.get((session, kind))
        if not origins:
            return 0
        now = time.monotonic()
        return sum(n for n, expires in origins.values() if expires > now)

    def announced(self, origin: str, session: str, kind: str) -> bool | None:
        """Whether replica `origin` has a fresh announcement of a subscriber of (session, kind);
        None when the session's shard is not followed or its presence not read since (re)confirmed."""
        st = self.shards.get(self.shards.of(session))
        if st is None or not st.complete.is_set():
            return None
        origins = self.remote.get((session, kind))
        entry = origins.get(origin) if origins else None
        return entry is not None and entry[0] > 0 and entry[1] > time.monotonic()

    def on_presence(self, origin: str, entries: list[tuple[str, str, int]]) -> None:
        expires = time.monotonic() + 3 * self.heartbeat_s
        for session, kind, n in entries:
            origins = self.remote.setdefault((session, kind), {})
            if n > 0:
                origins[origin] = (n, expires)
            else:
                origins.pop(origin, None)
                if not origins:
                    del self.remote[(session, kind)]

    def forget_shard(self, n: int) -> None:
        """The shard is not followed any more: its counts would go stale."""
        for topic in [t for t in self.remote if self.shards.of(t[0]) == n]:
            del self.remote[topic]

    async def read(self, redis: AnyRedis, n: int, st: Shard) -> None:
        """The shard's presence hash, read once its subscription is confirmed: every change after it
        arrives as an announcement, so the counts are complete from here on (`st.complete`)."""
        try:
            fields = await redis.hgetall(self.key(n))
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
            if expires_ms < now_ms - 10 * self.heartbeat_s * 1000:
                stale.append(raw_field)  # a replica gone for good: nobody else would ever delete it
            elif origin != self.replica_id and count > 0 and expires_ms > now_ms:
                self.remote.setdefault((session, kind), {})[origin] = (count, now + (expires_ms - now_ms) / 1000)
        if stale:
            with contextlib.suppress(*OUTAGE_ERRORS):
                await redis.hdel(self.key(n), *stale)
        if st.confirmed and self.shards.get(n) is st:
            st.complete.set()

    # -- what this replica has ------------------------------------------------------------------

    def announce(self, topics: Iterable[tuple[str, str]]) -> None:
        """Announces this replica's counts of `topics`, per shard: the hash writes, then the envelope."""
        by_shard: dict[int, list[tuple[str, str, int]]] = {}
        for session, kind in topics:
            by_shard.setdefault(self.shards.of(session), []).append((session, kind, self._count(kind, session)))
        expires_ms = int(time.time() * 1000 + 3 * self.heartbeat_s * 1000)
        for n, entries in by_shard.items():
            key = self.key(n)
            writes = tuple((key, json.dumps([self.replica_id, s, k], separators=(",", ":")),
                            f"{c} {expires_ms}" if c > 0 else "") for s, k, c in entries)
            self._enqueue(self.shards.channel_of(n), codec.presence(self.replica_id, entries), writes)

    def announce_shard(self, n: int) -> None:
        self.announce([t for t in self._topics if t[1] in self.kinds and self.shards.of(t[0]) == n])

    def announce_all(self) -> None:
        mine = [t for t in self._topics if t[1] in self.kinds]
        for i in range(0, len(mine), 1000):
            self.announce(mine[i:i + 1000])

    # -- liveness -------------------------------------------------------------------------------

    def heard(self, envelope: codec.Envelope) -> None:
        """Another replica spoke: noted with its version; a hello or a who with another shard count
        is reported. A data envelope in the version-1 form says nothing of its sender's version (a
        newer replica writes it for an old peer's sake), so it sets one only for a replica not yet known."""
        origin = envelope.origin
        self.seen[origin] = time.monotonic()
        known = self.versions.get(origin)
        if envelope.type[:1] == "!" or envelope.version > codec.LEGACY or known is None:
            if known != envelope.version:
                self.versions[origin] = envelope.version
                self.choose_wire()
        shards = envelope.session
        if envelope.type in (codec.HELLO, codec.WHO) and shards and shards != str(self.shards.count):
            self._disagrees(envelope.origin, envelope.session)

    def begin_census(self) -> float:
        """The control channel is subscribed and a who is on its way: the census ends in the seconds
        returned (the caller calls `choose_wire` then); version 1 is written until it does."""
        wait = min(CENSUS_S, self.heartbeat_s)
        self._census_ends = time.monotonic() + wait
        self.wire = codec.LEGACY
        return wait

    def recount(self) -> None:
        """The control channel was lost: hellos may be missed, so version 1 is written until a new
        census (`begin_census`, once it is subscribed again) is complete."""
        self._census_ends = None
        self.wire = codec.LEGACY

    def choose_wire(self) -> None:
        """`wire`: the lowest version of the replicas `seen` remembers, at most ours; version 1 until
        the census is complete."""
        if self._census_ends is None or time.monotonic() < self._census_ends:
            self.wire = codec.LEGACY
            return
        lowest = min((self.versions.get(o, codec.LEGACY) for o in self.seen), default=codec.PROTOCOL)
        self.wire = max(codec.LEGACY, min(codec.PROTOCOL, lowest))

    def hello(self) -> bytes:
        return codec.control(self.replica_id, self.shards.count, codec.HELLO)

    def who(self) -> bytes:
        return codec.control(self.replica_id, self.shards.count, codec.WHO)

    def _disagrees(self, origin: str, shards: str) -> None:
        """Another replica uses another --bus-shards: events between the two are lost for most
        sessions (each maps them to other channels). Said once per replica, as an error."""
        if origin not in self.mismatched:
            self.mismatched.add(origin)
            log.error("another replica uses a different --bus-shards: most sessions' events between the two are "
                      "lost; give every replica the same value", extra={"fields": {
                          "replica": origin, "its_shards": shards, "our_shards": self.shards.count}})

    def known_at(self, down_since: float) -> list[str]:
        """The replicas heard from shortly before `down_since` (an outage began)."""
        return [o for o, t in self.seen.items() if t >= down_since - 3 * self.heartbeat_s]

    def heard_again(self, known: Iterable[str], down_since: float) -> bool:
        """Every replica of `known` has been heard from since `down_since`."""
        return all(self.seen.get(o, 0.0) >= down_since for o in known)

    async def run(self, ctl: str, running: Callable[[], bool]) -> None:
        """The heartbeat: this replica's counts and a hello every `heartbeat_s`; forgets replicas
        gone for good and counts that expired."""
        while running():
            await asyncio.sleep(self.heartbeat_s)
            self.announce_all()
            self._enqueue(ctl, self.hello(), ())  # the others know it listens (the writer's wait)
            now = time.monotonic()
            for origin in [o for o, t in self.seen.items() if t < now - 10 * self.heartbeat_s]:
                del self.seen[origin]  # a replica gone for good
                self.versions.pop(origin, None)
            self.choose_wire()
            for topic in [t for t, o in self.remote.items() if all(e <= now for _, e in o.values())]:
                del self.remote[topic]

"""The pub/sub links: one connection per Redis (per master of a cluster) and the channels on it.

A `Link` owns its channels the way redis-py's `PubSub` owns its own: it knows which channels it
wants, which Redis confirmed, which it asked to leave, (un)subscribes them in the order asked, and
is closed by one `aclose`. Its listener loop reconnects with backoff; every failure (an outage,
MOVED, a slot without a master, a client failing in a way we do not know) is a lost subscription,
retried, because the listener must outlive them all.

`Links` places channels on links. One server (or a Sentinel-followed master): one link on the
bus's own client. A Redis Cluster: shard channels are sharded pub/sub (SSUBSCRIBE, Redis 7), so
each master carries only its slots' traffic; a link per master that owns a wanted channel, on a
client of its own. It follows failovers and slot moves: a lost connection or a SUNSUBSCRIBE we did
not ask for re-reads the slot map (`regroup`) and moves each channel to its master's link.

What the links hear goes to a `Listener` (the bus): data, a channel confirmed, a channel lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster

from uibus.infra.redis.conn import AnyRedis, SlotMap, node_client
from uibus.infra.retry import Backoff
from uibus.infra.tasks import Tasks, cancel_and_wait

log = logging.getLogger("uibus.infra.redis")

SINGLE = "single"  # the name of the one link to a single Redis (or a Sentinel-followed master)
PATIENCE_S = 0.5  # a task that swallowed its cancel (inside redis-py) is cancelled again after this


class Listener(Protocol):
    def on_data(self, data: bytes) -> None: ...
    def on_confirmed(self, channel: str) -> None: ...
    def on_lost(self, channel: str) -> None: ...
    def went_down(self, where: str, exc: BaseException) -> None: ...
    def unexpected(self, where: str, exc: BaseException) -> None: ...


@dataclass(frozen=True, slots=True)
class Commands:
    """The pub/sub dialect: classic on one server, sharded (S…) on a cluster."""

    subscribe: str
    unsubscribe: str
    message: str
    publish: str

    @staticmethod
    def of(cluster: bool) -> Commands:
        if cluster:
            return Commands("ssubscribe", "sunsubscribe", "smessage", "SPUBLISH")
        return Commands("subscribe", "unsubscribe", "message", "PUBLISH")


class Link:
    """One pub/sub connection and the channels it carries."""

    def __init__(self, links: Links, name: str, client: AnyRedis, owned: bool) -> None:
        self.links = links
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
        self.retired = False

    def add(self, channel: str) -> None:
        """Wants `channel`: subscribed now if connected, else when the (started) loop connects."""
        self.want.add(channel)
        if self.task is None or self.task.done():
            self.task = self.links.loops.spawn(self._run(), name=f"uibus-bus-{self.name}")
        elif self.pubsub is not None:
            self.links.command(self._command(self.links.cmd.subscribe, channel))

    def remove(self, channel: str) -> None:
        """Wants `channel` no more: unsubscribed (a link of a cluster left with none is retired)."""
        self.want.discard(channel)
        self.confirmed.discard(channel)
        if not self.want and self.owned:
            self.links.retire(self)
        elif self.pubsub is not None:
            self.leaving[channel] = self.leaving.get(channel, 0) + 1
            self.links.command(self._command(self.links.cmd.unsubscribe, channel))

    async def _command(self, command: str, channel: str) -> None:
        async with self.lock:
            pubsub = self.pubsub
            if pubsub is not None:
                await getattr(pubsub, command)(channel)

    def fail_all(self) -> None:
        for channel in list(self.confirmed):
            self.links.listener.on_lost(channel)
        self.confirmed.clear()

    async def _run(self) -> None:
        links = self.links
        backoff = Backoff()  # between reconnects (uibus.infra.retry)
        while links.running() and not self.retired:
            pubsub = self.client.pubsub(ignore_subscribe_messages=False)
            try:
                self.pubsub = pubsub
                channels = sorted(self.want, key=lambda c: c == links.ctl)  # the control channel last
                if not channels:
                    return
                async with self.lock:
                    if links.cluster:  # SSUBSCRIBE takes channels of one slot only: one command each
                        for channel in channels:
                            await pubsub.ssubscribe(channel)
                    else:  # one command: every channel is subscribed before the hello (ctl, last) goes out
                        await pubsub.subscribe(*channels)
                backoff.reset()
                while links.running():
                    msg = await pubsub.get_message(timeout=None)
                    if msg is not None:
                        self._on_message(msg)
            except Exception as exc:  # an outage; MOVED or a slot without a master (ResponseError); any other
                # failure of the client too (a write racing a reconnect raised RuntimeError on uvloop): the
                # listener must outlive them all, so each is a lost subscription, retried.
                self.up = False
                self.pubsub = None
                self.leaving.clear()  # what was in flight on the lost connection is void
                self.fail_all()
                links.listener.unexpected("listen", exc)
                links.listener.went_down("listen", exc)
                if links.cluster:
                    links.regroup_soon()
            finally:
                self.pubsub = None
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await backoff.wait()

    def _on_message(self, msg: dict[str, Any]) -> None:
        links = self.links
        kind = msg.get("type")
        if kind == links.cmd.message:
            links.listener.on_data(msg["data"])
            return
        channel = msg.get("channel")
        if isinstance(channel, bytes):
            channel = channel.decode()
        if kind == links.cmd.subscribe:
            if channel in self.want:
                self.up = True
                self.confirmed.add(channel)
                links.listener.on_confirmed(channel)
        elif kind == links.cmd.unsubscribe:
            asked = self.leaving.get(channel, 0)
            if asked:
                if asked == 1:
                    del self.leaving[channel]
                else:
                    self.leaving[channel] = asked - 1
                if channel not in self.want:
                    self.confirmed.discard(channel)
                return  # wanted again: the SUBSCRIBE sent after it is on its way, its confirmation follows
            self.confirmed.discard(channel)
            if links.cluster and channel in self.want:  # not asked for: the slot moved (or its master failed over)
                links.listener.on_lost(channel)
                self.want.discard(channel)
                links.unplaced.add(channel)
                links.regroup_soon()

    async def aclose(self) -> None:
        """Stops the listener (cancelled again if a cancel is swallowed inside redis-py) and closes
        the client when the link owns it. Never raises but for the caller's own cancel."""
        self.retired = True
        await cancel_and_wait(self.task, patience=PATIENCE_S, what=f"uibus-bus-{self.name}")
        if self.owned:
            with contextlib.suppress(Exception):
                await self.client.aclose()


class Links:
    """Every link of this replica, the channels not placed yet, and the cluster's slot map."""

    def __init__(self, redis: AnyRedis, *, cluster: bool, ctl: str, listener: Listener,
                 running: Callable[[], bool]) -> None:
        self.redis = redis
        self.cluster = cluster
        self.cmd = Commands.of(cluster)
        self.ctl = ctl
        self.listener = listener
        self.running = running
        self.unplaced: set[str] = set()  # channels wanted whose cluster master is not known yet
        self._links: dict[str, Link] = {}
        self.loops = Tasks("uibus-bus-links")  # each link's listener, the regrouping
        self.commands = Tasks("uibus-bus-commands", quiet=True)  # (un)subscribes, retired links' closing
        self._regrouping: asyncio.Task[None] | None = None
        self.slots = SlotMap(redis) if isinstance(redis, RedisCluster) else None

    def values(self) -> list[Link]:
        return list(self._links.values())

    def start(self) -> None:
        """One server: the one link on the bus's own client. A cluster places its channels once its
        slot map is read (`learn_and_place`)."""
        if not self.cluster:
            self._links[SINGLE] = Link(self, SINGLE, self.redis, owned=False)

    @property
    def up(self) -> bool:
        """Every link that carries a wanted channel is connected."""
        return all(link.up for link in self._links.values() if link.want)

    def all_confirmed(self) -> bool:
        return not self.unplaced and all(link.want <= link.confirmed for link in self._links.values())

    def want(self, channel: str) -> None:
        link = self._link_for(channel) if self.running() else None
        if link is None:  # a cluster whose slot map is not known yet: regroup places it
            self.unplaced.add(channel)
            return
        link.add(channel)

    def unwant(self, channel: str) -> None:
        self.unplaced.discard(channel)
        for link in list(self._links.values()):  # retire removes from it
            if channel in link.want:
                link.remove(channel)

    def _link_for(self, channel: str) -> Link | None:
        if not self.cluster:
            return self._links.get(SINGLE)
        assert isinstance(self.redis, RedisCluster)
        try:
            node = self.redis.get_node_from_key(channel)
        except Exception:  # the slot map is not read yet, or the slot has no master right now
            return None
        if node is None:
            return None
        link = self._links.get(node.name)
        if link is None:
            link = self._links[node.name] = Link(self, node.name, node_client(self.redis, node.host, node.port,
                                                                              "uibus-bus"), owned=True)
        return link

    def retire(self, link: Link) -> None:
        self._links.pop(link.name, None)
        link.fail_all()
        link.want.clear()
        self.command(link.aclose())  # cancels its listener, closes its client

    def command(self, work: Coroutine[Any, Any, Any]) -> None:
        """Runs a short Redis command in a task of its own (a cancel landing inside a redis-py command
        can be swallowed, and a listener must stay cancellable); its failure is an outage the
        link's loop sees too. Nothing starts once the links are closing."""
        if self.commands.closed:
            work.close()
            return
        self.commands.spawn(work, name="uibus-bus-command")

    # -- cluster topology -----------------------------------------------------------------------

    async def learn_and_place(self) -> None:
        """Learns the slot map (retrying while the cluster is unreachable), then places the channels."""
        await self.refresh_topology(first=True)
        self.place_unplaced()

    async def refresh_topology(self, first: bool = False) -> None:
        """Reads the slot map (uibus.infra.redis.conn.SlotMap: one reader at a time), retrying while
        the cluster is unreachable. `first`: only if never read, as at start, where the writer and
        the listeners start together: reading it again there, under the writer's first pipeline,
        closed the connections that pipeline was using (it hung, and the bus sent nothing)."""
        assert self.slots is not None
        backoff = Backoff()
        while self.running():
            try:
                await (self.slots.learn() if first else self.slots.read())
                return
            except Exception as exc:  # every node down (RedisClusterException), an outage, a slot-less reply
                self.listener.went_down("topology", exc)
                await backoff.wait()

    def regroup_soon(self) -> None:
        if self.running() and (self._regrouping is None or self._regrouping.done()) and not self.loops.closed:
            self._regrouping = self.loops.spawn(self._regroup(), name="uibus-bus-regroup")

    async def _regroup(self) -> None:
        """After a failover or a slot move: reads the slot map again and moves every channel to the
        link of the master that owns its slot now."""
        await asyncio.sleep(0.1)  # several links fail at once: one refresh for all of them
        await self.refresh_topology()
        for link in list(self._links.values()):
            for channel in list(link.want):
                owner = self._link_for(channel)
                if owner is not link:
                    link.want.discard(channel)
                    if channel in link.confirmed:
                        link.confirmed.discard(channel)
                        self.listener.on_lost(channel)
                    self.unplaced.add(channel)
            if not link.want and link.owned:
                self.retire(link)
        self.place_unplaced()

    def place_unplaced(self) -> None:
        channels, self.unplaced = self.unplaced, set()
        for channel in channels:
            self.want(channel)
        if self.unplaced and self.running():  # still no master for some slot: try again shortly
            asyncio.get_running_loop().call_later(0.5, self.regroup_soon)

    async def aclose(self) -> None:
        """Stops every listener and command (each cancelled again while it swallows its cancel,
        so this always ends) and closes the clients the links own."""
        links, self._links = list(self._links.values()), {}
        for link in links:
            link.retired = True
        await asyncio.gather(self.loops.aclose(patience=PATIENCE_S), self.commands.aclose(patience=PATIENCE_S))
        for link in links:
            if link.owned:
                with contextlib.suppress(Exception):
                    await link.client.aclose()

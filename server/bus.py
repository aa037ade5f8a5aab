"""The topic bus: per-(session, kind[, target]) topics, one bounded mailbox per subscriber.

Publishing never awaits: it appends to each subscriber's mailbox and wakes its reader, so a slow
subscriber can only hurt itself. What happens when a mailbox is full is the kind's policy
(`uibus.kinds`), and every drop or coalesce is counted. A subscription is removed by
`unsubscribe`, which the streams call in a `finally` right beside `subscribe`, so a stream that
ends for any reason (cancel, disconnect, deadline, shutdown) leaves nothing behind.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from uibus.errors import ResourceExhausted, Unavailable
from uibus.kinds import Kind, Policy


class SubscriptionLimit(ResourceExhausted):
    """The session already has as many open subscriptions as the config allows."""


class BusClosed(Unavailable):
    """The bus is shutting down and takes no new subscriptions."""


@dataclass
class KindCounters:
    published: int = 0
    delivered: int = 0
    dropped: int = 0
    coalesced: int = 0
    subscriptions: int = 0


class Subscription:
    """One subscriber's bounded mailbox. Iterate it to receive events; it ends when closed."""

    __slots__ = ("_items", "_maxsize", "_policy", "_waiter", "closed", "counters", "kind", "session",
                 "target")

    def __init__(self, session: str, kind: str, target: str, maxsize: int, policy: Policy,
                 counters: KindCounters) -> None:
        self.session = session
        self.kind = kind  # the kind's name
        self.target = target
        self._maxsize = maxsize
        self._policy = policy
        self._items: deque[tuple[Hashable, Any]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.counters = counters

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, item: Any, key: Hashable = None) -> None:
        """Queues `item` without waiting; at the bound applies the kind's policy."""
        items = self._items
        if len(items) >= self._maxsize:
            if self._policy is Policy.LATEST:
                items.clear()
                self.counters.coalesced += 1
            elif self._policy is Policy.COALESCE and key is not None:
                for i in range(len(items) - 1, -1, -1):
                    if items[i][0] == key:
                        items[i] = (key, item)
                        self.counters.coalesced += 1
                        return
                items.popleft()
                self.counters.dropped += 1
            else:
                items.popleft()
                self.counters.dropped += 1
        items.append((key, item))
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def close(self) -> None:
        """Ends iteration once the queued events are read; wakes a waiting reader."""
        self.closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Any:
        while not self._items:
            if self.closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()[1]


class Bus:
    """In-process topic bus. State is a few plain maps, as in grpc_health's aio servicer."""

    replicated = False  # True when events also reach other replicas (ReplicatedBus)

    def __init__(self, queue_size: int = 256, max_per_session: int = 10_000) -> None:
        self.queue_size = queue_size
        self.max_per_session = max_per_session
        # (session, kind name) -> target -> subscriptions; target "" is "no target".
        self._topics: dict[tuple[str, str], dict[str, set[Subscription]]] = {}
        self._per_session: dict[str, int] = {}
        self.counters: dict[str, KindCounters] = {}
        self._closed = False

    async def start(self) -> None:
        """Connects the bus to its peers; the in-process bus has none (see ReplicatedBus)."""

    async def stop(self) -> None:
        """Disconnects from peers after the server has stopped."""

    async def __aenter__(self) -> Bus:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.stop()

    def _counters(self, kind: str) -> KindCounters:
        c = self.counters.get(kind)
        if c is None:
            c = self.counters[kind] = KindCounters()
        return c

    def subscribe(self, session: str, kind: Kind, target: str = "", maxsize: int | None = None) -> Subscription:
        if self._closed:
            raise BusClosed("the server is shutting down")
        open_now = self._per_session.get(session, 0)
        if open_now >= self.max_per_session:
            raise SubscriptionLimit(f"session {session!r} already has {open_now} open subscriptions "
                                    f"(limit {self.max_per_session})")
        name = kind.name
        counters = self._counters(name)
        sub = Subscription(session, name, target, maxsize or self.queue_size, kind.policy, counters)
        self._topics.setdefault((session, name), {}).setdefault(target, set()).add(sub)
        self._per_session[session] = open_now + 1
        counters.subscriptions += 1
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Removes `sub`; safe to call twice."""
        sub.close()
        topic = self._topics.get((sub.session, sub.kind))
        if topic is None:
            return
        subs = topic.get(sub.target)
        if subs is None or sub not in subs:
            return
        subs.discard(sub)
        sub.counters.subscriptions -= 1
        if not subs:
            del topic[sub.target]
            if not topic:
                del self._topics[(sub.session, sub.kind)]
        left = self._per_session[sub.session] - 1
        if left:
            self._per_session[sub.session] = left
        else:
            del self._per_session[sub.session]

    def publish(self, session: str, kind: Kind, item: Any, target: str | None = None,
                key: Hashable = None) -> int:
        """Queues `item` for the topic's subscribers; returns how many it reached.

        `target=None` reaches every target of (session, kind); a target string reaches the
        subscribers of that target and those that subscribed with no target ("").
        """
        return self._deliver(session, kind.name, item, target, key)

    def _deliver(self, session: str, kind: str, item: Any, target: str | None, key: Hashable) -> int:
        counters = self._counters(kind)
        counters.published += 1
        topic = self._topics.get((session, kind))
        if not topic:
            return 0
        groups: Iterable[set[Subscription]]
        if target is None:
            groups = tuple(topic.values())
        else:
            groups = [s for s in (topic.get(target), topic.get("") if target else None) if s]
        n = 0
        for subs in groups:
            for sub in subs:
                sub.offer(item, key)
            n += len(subs)
        counters.delivered += n
        return n

    def count(self, kind: Kind | str | None = None, session: str | None = None) -> int:
        """Live subscriptions, optionally of one kind (a record or its name) and/or one session."""
        name = kind.name if isinstance(kind, Kind) else kind
        if name is None and session is None:
            return sum(self._per_session.values())
        if session is not None and name is None:
            return self._per_session.get(session, 0)
        if session is None:
            c = self.counters.get(name or "")
            return c.subscriptions if c else 0
        return sum(len(s) for s in self._topics.get((session, name or ""), {}).values())

    def subscriptions(self, session: str, kind: Kind | str) -> list[Subscription]:
        """The open subscriptions of one topic (every target), for inspection."""
        name = kind.name if isinstance(kind, Kind) else kind
        return [sub for subs in self._topics.get((session, name), {}).values() for sub in subs]

    def close(self) -> None:
        """Graceful-shutdown switch: refuse new subscriptions and end every open stream."""
        self._closed = True
        for topic in self._topics.values():
            for subs in topic.values():
                for sub in subs:
                    sub.close()

"""The topic bus: per-(session, kind[, target]) topics, one bounded mailbox per subscriber.

Publishing never awaits: it appends to each subscriber's mailbox and wakes its reader, so a slow
subscriber can only hurt itself. What happens when a mailbox is full is a per-kind policy, and
every drop or coalesce is counted. A subscription is removed by `unsubscribe`, which the stream
handlers call in a `finally` right beside `subscribe`, so a stream that ends for any reason
(cancel, disconnect, deadline, shutdown) leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any


class Policy(enum.Enum):
    """What a full mailbox does with one more event."""

    DROP_OLDEST = "drop_oldest"  # clicks and notices: the newest events matter most
    COALESCE = "coalesce"  # partial messages: a newer state of the same key replaces the queued one
    LATEST = "latest"  # state such as the theme: only the newest value is worth delivering


class SubscriptionLimit(Exception):
    """The session already has as many open subscriptions as the config allows."""


class BusClosed(Exception):
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
        self.kind = kind
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

    def __init__(self, queue_size: int = 256, max_per_session: int = 10_000,
                 policies: dict[str, Policy] | None = None) -> None:
        self.queue_size = queue_size
        self.max_per_session = max_per_session
        self._policies: dict[str, Policy] = dict(policies or {})
        # (session, kind) -> target -> subscriptions; target "" is "no target".
        self._topics: dict[tuple[str, str], dict[str, set[Subscription]]] = {}
        self._per_session: dict[str, int] = {}
        self.counters: dict[str, KindCounters] = {}
        self._closed = False

    async def start(self) -> None:
        """Connects the bus to its peers; the in-process bus has none (see ReplicatedBus)."""

    async def stop(self) -> None:
        """Disconnects from peers after the server has stopped."""

    def set_policy(self, kind: str, policy: Policy) -> None:
        self._policies[kind] = policy

    def _counters(self, kind: str) -> KindCounters:
        c = self.counters.get(kind)
        if c is None:
            c = self.counters[kind] = KindCounters()
        return c

    def subscribe(self, session: str, kind: str, target: str = "", maxsize: int | None = None) -> Subscription:
        if self._closed:
            raise BusClosed("the server is shutting down")
        open_now = self._per_session.get(session, 0)
        if open_now >= self.max_per_session:
            raise SubscriptionLimit(f"session {session!r} already has {open_now} open subscriptions "
                                    f"(limit {self.max_per_session})")
        counters = self._counters(kind)
        sub = Subscription(session, kind, target, maxsize or self.queue_size,
                           self._policies.get(kind, Policy.DROP_OLDEST), counters)
        self._topics.setdefault((session, kind), {}).setdefault(target, set()).add(sub)
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

    def publish(self, session: str, kind: str, item: Any, target: str | None = None,
                key: Hashable = None) -> int:
        """Queues `item` for the topic's subscribers; returns how many it reached.

        `target=None` reaches every target of (session, kind); a target string reaches the
        subscribers of that target and those that subscribed with no target ("").
        """
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

    def count(self, kind: str | None = None, session: str | None = None) -> int:
        """Live subscriptions, optionally of one kind and/or one session."""
        if kind is None and session is None:
            return sum(self._per_session.values())
        if session is not None and kind is None:
            return self._per_session.get(session, 0)
        if session is None:
            c = self.counters.get(kind or "")
            return c.subscriptions if c else 0
        return sum(len(s) for s in self._topics.get((session, kind or ""), {}).values())

    def subscriptions(self, session: str, kind: str) -> list[Subscription]:
        """The open subscriptions of one topic (every target), for inspection."""
        return [sub for subs in self._topics.get((session, kind), {}).values() for sub in subs]

    def close(self) -> None:
        """Graceful-shutdown switch: refuse new subscriptions and end every open stream."""
        self._closed = True
        for topic in self._topics.values():
            for subs in topic.values():
                for sub in subs:
                    sub.close()

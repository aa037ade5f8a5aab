"""The topic bus: per-(session, kind[, target]) topics, one bounded mailbox per subscriber.

Publishing never awaits: it appends to each subscriber's mailbox and wakes its reader, so a slow
subscriber can only hurt itself. What happens when a mailbox is full is the kind's policy
(`uibus.infra.kinds`), and every drop or coalesce is counted. A subscription is removed by
`unsubscribe`, which the streams call in a `finally` right beside `subscribe`, so a stream that
ends for any reason (cancel, disconnect, deadline, shutdown) leaves nothing behind.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from uibus.infra.errors import ResourceExhausted, Unavailable
from uibus.infra.kinds import Kind, Policy


class Live:
    """The marker a stream yields once its subscription is registered (see `LIVE`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LIVE"


# Yielded by a streaming handler right after its subscription is registered. The handler pipeline
# does not pass it on: it sends the call's response headers instead, on every transport. That is
# the guarantee a client can build on: headers received => every event published from now on
# reaches this stream. (Without it an idle stream sends no headers until its first event.)
LIVE = Live()


class SubscriptionLimit(ResourceExhausted):
    """The session already has as many open subscriptions as the config allows."""


class BusClosed(Unavailable):
    """The bus is shutting down and takes no new subscriptions."""


class MailboxOverflow(ResourceExhausted):
    """A subscriber fell so far behind that its queued events went over its byte budget (or all
    mailboxes together went over theirs and it was the fullest): its stream is ended."""


@dataclass
class KindCounters:
    published: int = 0
    delivered: int = 0
    dropped: int = 0
    coalesced: int = 0
    subscriptions: int = 0
    overflowed: int = 0  # streams ended because their mailbox went over its byte budget


class Budget:
    """The bytes every mailbox of one bus holds together, and the bounds: one stalled reader can
    cost at most `per_mailbox` bytes, and all of them together at most `total_limit`."""

    __slots__ = ("per_mailbox", "total", "total_limit")

    def __init__(self, per_mailbox: int, total_limit: int) -> None:
        self.per_mailbox = per_mailbox
        self.total_limit = total_limit
        self.total = 0


# What a subscription counts against when it has no bus budget (made alone, or removed): unbounded,
# and read by nobody.
_DETACHED = Budget(1 << 62, 1 << 62)


def size_of(item: Any) -> int:
    """What an event costs in a mailbox, about: its serialized size (protobuf messages), or the
    length of its text for the JSON entries of the chat history; a small floor for the rest."""
    byte_size = getattr(item, "ByteSize", None)
    if byte_size is not None:
        return byte_size() + 64
    if isinstance(item, dict):
        text = item.get("text")
        return (len(text) if isinstance(text, str) else 0) + 256
    return 64


class Subscription:
    """One subscriber's bounded mailbox. Iterate it to receive events; it ends when closed."""

    __slots__ = ("_budget", "_items", "_maxsize", "_policy", "_waiter", "bytes", "closed", "counters", "failure",
                 "kind", "session", "target")

    def __init__(self, session: str, kind: str, target: str, maxsize: int, policy: Policy,
                 counters: KindCounters, budget: Budget | None = None) -> None:
        self.session = session
        self.kind = kind  # the kind's name
        self.target = target
        self._maxsize = maxsize
        self._policy = policy
        self._items: deque[tuple[Hashable, Any, int]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._budget = budget if budget is not None else _DETACHED
        self.bytes = 0  # what the queued events cost (see size_of)
        self.closed = False
        self.failure: MailboxOverflow | None = None
        self.counters = counters

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, item: Any, key: Hashable = None, size: int = 64) -> bool:
        """Queues `item` without waiting; at the count bound applies the kind's policy. Over the
        byte budget it ends the stream and returns True (the bus then removes the subscription)."""
        if self.failure is not None:
            return False
        items = self._items
        counters = self.counters
        if len(items) >= self._maxsize:
            if self._policy is Policy.LATEST:
                self._drop_all()
                counters.coalesced += 1
            elif self._policy is Policy.COALESCE and key is not None:
                for i in range(len(items) - 1, -1, -1):
                    old = items[i]
                    if old[0] == key:
                        items[i] = (key, item, size)
                        self._grow(size - old[2])
                        counters.coalesced += 1
                        return False
                self._grow(-items.popleft()[2])
                counters.dropped += 1
            else:
                self._grow(-items.popleft()[2])
                counters.dropped += 1
        items.append((key, item, size))
        budget = self._budget  # inlined _grow: this line runs once per delivery
        budget.total += size
        self.bytes += size
        if self.bytes > budget.per_mailbox and not self._shrink(key):
            self.overflow(f"a {self.kind} subscriber of session {self.session!r} fell behind: its queued events "
                          f"reached {self.bytes} bytes, over the {self._budget.per_mailbox}-byte mailbox budget "
                          "(--mailbox-bytes); subscribe again and read faster")
            return True
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
        return False

    def _grow(self, size: int) -> None:
        self.bytes += size
        self._budget.total += size

    def _drop_all(self) -> None:
        self._budget.total -= self.bytes
        self.bytes = 0
        self._items.clear()

    def _shrink(self, key: Hashable) -> bool:
        """What the kind's policy can do before the stream is ended: keep only the newest state
        (LATEST) or drop older states of the newest event's key (COALESCE). True if now within."""
        items = self._items
        if self._policy is Policy.LATEST:
            newest = items.pop()
            self._drop_all()
            items.append(newest)
            self._grow(newest[2])
            self.counters.coalesced += 1
        elif self._policy is Policy.COALESCE and key is not None:
            newest = items.pop()
            kept = [entry for entry in items if entry[0] != key]
            if len(kept) < len(items):
                self.counters.coalesced += len(items) - len(kept)
                self._drop_all()
                for entry in kept:
                    items.append(entry)
                    self._grow(entry[2])
                self._grow(newest[2])
            items.append(newest)
        return self.bytes <= self._budget.per_mailbox

    def overflow(self, why: str) -> None:
        """Ends the stream with RESOURCE_EXHAUSTED: the queued events are freed at once (and the bus
        removes the subscription at once), and the reader gets the error at its next read.

        Nothing is cancelled: a reader stuck writing to a client that stopped reading holds one
        message, no more; if that client reads again it gets what was in flight, then the status.
        A client that never does is dropped by keepalive (or its disconnect)."""
        if self.failure is not None or self.closed:
            return
        self.failure = MailboxOverflow(why)
        self.counters.overflowed += 1
        self._drop_all()
        self.closed = True
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

    def release(self) -> None:
        """The subscription was removed: its queued events (still readable until the reader is
        done) no longer count against the bus's budget, which must return to zero with the counts."""
        self._budget.total -= self.bytes
        self._budget = _DETACHED

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Any:
        while not self._items:
            if self.failure is not None:
                raise self.failure
            if self.closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        _, item, size = self._items.popleft()
        self.bytes -= size
        self._budget.total -= size
        return item


class Bus:
    """In-process topic bus. State is a few plain maps, as in grpc_health's aio servicer."""

    replicated = False  # True when events also reach other replicas (ReplicatedBus)
    # Whether the last `publish` handed its event to replication (PublishReply.replicated): read it
    # right after the call, before any await (publish is synchronous).
    last_replicated = False
    # This replica's id on the replicated bus (the origin of what it publishes, the holder of what
    # it shares); "" alone: there are no other replicas to tell apart.
    replica_id = ""

    def __init__(self, queue_size: int = 256, max_per_session: int = 10_000, *,
                 mailbox_bytes: int = 16 * 1024 * 1024, mailboxes_bytes: int = 256 * 1024 * 1024) -> None:
        self.queue_size = queue_size
        self.max_per_session = max_per_session
        self.budget = Budget(mailbox_bytes, mailboxes_bytes)
        # (session, kind name) -> target -> subscriptions; target "" is "no target".
        self._topics: dict[tuple[str, str], dict[str, set[Subscription]]] = {}
        self._per_session: dict[str, int] = {}
        self.counters: dict[str, KindCounters] = {}
        self._closed = False

    async def start(self) -> None:
        """Connects the bus to its peers; the in-process bus has none (see ReplicatedBus)."""

    async def stop(self) -> None:
        """Disconnects from peers after the server has stopped."""

    async def ready(self, session: str) -> None:
        """Returns once every event published for `session` from now on, on any replica, reaches
        this bus's subscribers of it, and `publish` knows every replica's presence counts for it.
        A stream awaits it before its headers (LIVE); the in-process bus is always ready."""

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
        sub = Subscription(session, name, target, maxsize or self.queue_size, kind.policy, counters, self.budget)
        self._topics.setdefault((session, name), {}).setdefault(target, set()).add(sub)
        self._per_session[session] = open_now + 1
        counters.subscriptions += 1
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Removes `sub`; safe to call twice."""
        sub.close()
        sub.release()
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
        size = size_of(item)
        ended: list[Subscription] = []
        for subs in groups:
            for sub in subs:
                if sub.offer(item, key, size):
                    ended.append(sub)
            n += len(subs)
        counters.delivered += n
        for sub in ended:  # over their byte budget: gone at once, as any ended stream
            self.unsubscribe(sub)
        if self.budget.total > self.budget.total_limit:
            self._relieve()
        return n

    def _relieve(self) -> None:
        """All mailboxes together are over their budget: end the fullest streams until within.
        Rare (only when many readers stall at once), so a scan of every subscription is fine."""
        budget = self.budget
        subs = sorted((sub for topic in self._topics.values() for group in topic.values() for sub in group),
                      key=lambda sub: sub.bytes, reverse=True)
        for sub in subs:
            if budget.total <= budget.total_limit or not sub.bytes:
                break
            sub.overflow(f"the server's mailboxes together went over {budget.total_limit} bytes "
                         f"(--mailboxes-bytes) and this {sub.kind} subscriber of session {sub.session!r} had the "
                         f"most queued ({sub.bytes} bytes); subscribe again and read faster")
            self.unsubscribe(sub)

    def announced(self, origin: str, session: str, kind: Kind) -> bool | None:
        """Whether replica `origin` has announced a subscriber of (session, kind) that has not
        expired; None: this bus does not know (alone there is no other replica to hear of)."""
        return None

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

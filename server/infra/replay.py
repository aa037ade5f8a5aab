"""Replay then live: the one way a stream resuming from a cursor joins its history to the live events.

Every stream that resumes (a webview's messages and host requests, the extension-UI events, a
`/mcp` call's event stream on another replica) does the same four steps, and each step is there
for a reason:

1. **subscribe first**, before reading anything: an event published while the replay is read is
   then queued in the subscription, never lost between the read and going live;
2. **replay** what the stream's log (or snapshot) holds after the cursor;
3. **de-duplicate**: what the subscription queued meanwhile may also be in the replay (published
   after subscribing, committed before the read), so the queued events are merged into the replay
   (`Catchup.merge`: one state per key, the newest) and, once live, an event the replay already
   delivered is dropped (`Catchup.live`);
4. **live**: the subscription's events from then on.

What stays each stream's own: where its replay comes from, what its key and version are (a
ClineMessage's ts and seq; an event's seq; an MCP event's number), what it sends when the cursor is
older than its log keeps (a gap), and in which order it sends the replay. The subscription itself
is the caller's: it subscribes and unsubscribes in one `finally`, beside the stream, so its
mailbox is gone the moment the stream ends (this module holds nothing of its own to release).

Keys and versions, not a cursor threshold: another replica may stamp a newer state with a lower
seq than one this replica stamped, so "newer than what was sent for this key" is the only test
that neither drops news nor repeats history.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Mailbox(Protocol[T_co]):
    """What a stream reads its live events from: a bus subscription (uibus.infra.bus.Subscription),
    whose length is what it has queued."""

    def __len__(self) -> int: ...

    def __aiter__(self) -> AsyncIterator[T_co]: ...

    async def __anext__(self) -> T_co: ...


def seq_of(item: Any) -> int:
    """The key and version of an event that is a thing of its own (a host request, an extension-UI
    event): its seq, which no other event of the session has."""
    return int(item.seq)


class Catchup(Generic[T]):
    """One resuming stream's de-duplication, from its replay to its end.

    `key(item)`: which thing an event is a state of; `version(item)`: how new that state is (higher
    is newer). For events that are things of their own both are the seq (the default).

        sub = bus.subscribe(...)            # 1. subscribe first
        try:
            catchup = Catchup(sub)
            found = await catchup.merge(replayed_from_the_log, after=cursor)   # 2. + 3.
            for item in sorted(found.values(), key=...):
                catchup.sent(item)
                yield item
            async for item in catchup.live():                               # 3. + 4.
                yield item
        finally:
            bus.unsubscribe(sub)
    """

    __slots__ = ("_key", "_sent", "_sub", "_version")

    def __init__(self, sub: Mailbox[T], *, key: Callable[[T], Hashable] = seq_of,
                 version: Callable[[T], int] = seq_of) -> None:
        self._sub = sub
        self._key = key
        self._version = version
        self._sent: dict[Hashable, int] = {}  # key -> the version of it the replay delivered

    async def merge(self, replayed: Iterable[T] | dict[Any, T], *, after: int | None = None,
                    live_wins_ties: bool = False) -> dict[Any, T]:
        """The replay (items, or a dict of them by key, which is updated in place and returned)
        merged with what the subscription queued since it was taken: one state per key, the
        newest; the replay's own on a tie unless `live_wins_ties`. With `after` (the cursor),
        queued events not newer than it are left out (the client has them).

        Only what is queued *now* is taken (no wait): what comes later is live, and `live` drops
        the states of it the replay already delivered."""
        key, version = self._key, self._version
        found: dict[Any, T] = replayed if isinstance(replayed, dict) else {key(item): item for item in replayed}
        sub = self._sub
        while len(sub):
            item = await anext(sub)
            v = version(item)
            if after is not None and v <= after:
                continue
            k = key(item)
            known = found.get(k)
            if known is None or v > version(known) or (live_wins_ties and v == version(known)):
                found[k] = item
        return found

    def sent(self, item: T) -> None:
        """`item` went to the client as part of the replay: a live state of it no newer is dropped."""
        self._sent[self._key(item)] = self._version(item)

    def delivered(self, item: T) -> bool:
        """Whether the replay already delivered this state of `item` (or a newer one)."""
        sent = self._sent
        if not sent:
            return False
        known = sent.get(self._key(item))
        return known is not None and self._version(item) <= known

    def live(self) -> AsyncIterator[T]:
        """The subscription's events until it ends, without those the replay delivered. Ends when
        the subscription does (it is closed, or the bus shuts down); its failure (an overflowed
        mailbox) is raised to the stream, as any read of it would. A plain iterator, not a
        generator: a stream that stops reading it leaves nothing to close."""
        return self._sub.__aiter__() if not self._sent else _Live(self)


class _Live(Generic[T]):
    """`Catchup.live` once the replay sent something: the subscription, minus what it delivered."""

    __slots__ = ("_catchup",)

    def __init__(self, catchup: Catchup[T]) -> None:
        self._catchup = catchup

    def __aiter__(self) -> _Live[T]:
        return self

    async def __anext__(self) -> T:
        catchup = self._catchup
        while True:
            item = await anext(catchup._sub)
            if not catchup.delivered(item):  # else replayed already (queued before the read, or relayed late)
                return item

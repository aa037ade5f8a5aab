"""Which shard channels this replica listens to, and for how long.

A session maps to one of `count` channels (crc32 of its name, `<channel>:{<n>}`), so a replica's
bus cost is what its own subscribers need, not N times that (one channel per deployment made every
replica receive every envelope of every session). A replica listens to a shard while it has a
subscriber there (counted in `refs`); after the last one leaves it keeps listening `linger_s` more,
against churn. `ready(session)` without a subscriber visits the shard for `visit_s`. A shard is
complete once its SUBSCRIBE is confirmed and its presence hash read: `ready` waits for that (at
most `confirm_s`), because pub/sub keeps nothing for a subscriber that is not there yet.

The subscribing itself is the links' job (uibus.infra.redis.links): `want(channel)` when a shard is
first needed, `unwant(n, channel)` when it is left.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


def shard_of(session: str, shards: int) -> int:
    """The session's shard: stable across replicas, versions and restarts (crc32, not hash())."""
    return zlib.crc32(session.encode("utf-8", "surrogatepass")) % shards if shards > 1 else 0


@dataclass
class Shard:
    """One shard this replica listens to: why (refs) and how far (confirmed, presence read)."""

    channel: str
    refs: int = 0  # local subscriptions in the shard, plus one while visited (see ready)
    confirmed: bool = False  # Redis confirmed the SUBSCRIBE on the current connection
    complete: asyncio.Event = field(default_factory=asyncio.Event)  # confirmed and the presence hash read
    linger: asyncio.TimerHandle | None = None  # the pending unsubscribe after the last ref left
    visit: asyncio.TimerHandle | None = None  # the end of a visit (ready() without a subscriber)


class Shards:
    """The shards followed here, by number; counts references and runs the linger and visit timers."""

    def __init__(self, channel: str, count: int, *, want: Callable[[str], None],
                 unwant: Callable[[int, str], None], linger_s: float = 5.0, visit_s: float = 60.0,
                 confirm_s: float = 2.0) -> None:
        self.channel = channel
        self.count = max(1, count)
        self.linger_s = linger_s
        self.visit_s = visit_s
        self.confirm_s = confirm_s
        self._want = want
        self._unwant = unwant
        self._shards: dict[int, Shard] = {}
        self._by_channel: dict[str, int] = {}

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._shards))

    def __len__(self) -> int:
        return len(self._shards)

    def of(self, session: str) -> int:
        return shard_of(session, self.count)

    def channel_of(self, n: int) -> str:
        return f"{self.channel}:{{{n}}}"

    def get(self, n: int) -> Shard | None:
        return self._shards.get(n)

    def by_channel(self, channel: str) -> tuple[int, Shard] | None:
        n = self._by_channel.get(channel)
        if n is None:
            return None
        st = self._shards.get(n)
        return None if st is None else (n, st)

    @property
    def subscribed(self) -> int:
        """Shards listened to now (for /metrics)."""
        return sum(1 for st in self._shards.values() if st.confirmed)

    def _shard(self, n: int) -> Shard:
        st = self._shards.get(n)
        if st is None:
            st = self._shards[n] = Shard(self.channel_of(n))
            self._by_channel[st.channel] = n
            self._want(st.channel)
        return st

    def hold(self, n: int) -> None:
        st = self._shard(n)
        st.refs += 1
        if st.linger is not None:
            st.linger.cancel()
            st.linger = None

    def release(self, n: int) -> None:
        st = self._shards.get(n)
        if st is None:
            return
        st.refs -= 1
        if st.refs <= 0 and st.linger is None:
            st.linger = asyncio.get_running_loop().call_later(self.linger_s, self.drop, n)

    def drop(self, n: int) -> None:
        """Leaves shard `n` if nothing holds it (what the linger's timer does)."""
        st = self._shards.get(n)
        if st is None or st.refs > 0:
            return
        del self._shards[n]
        del self._by_channel[st.channel]
        self._unwant(n, st.channel)

    async def ready(self, session: str) -> None:
        """Follows the session's shard (a visit of `visit_s` when nobody here holds it) and waits,
        at most `confirm_s`, until it is complete."""
        n = self.of(session)
        st = self._shard(n)
        if st.visit is not None or st.refs == 0:  # nobody here keeps the shard: visit it
            if st.visit is not None:
                st.visit.cancel()
            else:
                self.hold(n)
            st.visit = asyncio.get_running_loop().call_later(self.visit_s, self._end_visit, n)
        if not st.complete.is_set():
            try:
                await asyncio.wait_for(st.complete.wait(), self.confirm_s)
            except TimeoutError:
                pass

    def _end_visit(self, n: int) -> None:
        st = self._shards.get(n)
        if st is not None and st.visit is not None:
            st.visit = None
            self.release(n)

    def close(self) -> None:
        """Cancels every pending linger and visit (the bus is stopping)."""
        for st in self._shards.values():
            for timer in (st.linger, st.visit):
                if timer is not None:
                    timer.cancel()

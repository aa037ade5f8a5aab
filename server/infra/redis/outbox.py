"""The outbox: envelopes published here and not yet written to Redis, and the loop that writes them.

`publish` must never wait on the network, so it only appends here; one writer drains the outbox in
pipelined batches. The outbox is also the buffer across a short outage or a failover: while Redis
is unreachable envelopes stay in it (a batch whose write failed goes back to its front, in order),
bounded by `max_bytes` and `size` envelopes, the oldest dropped first, and by age: an envelope
older than `max_age_s` when it could be sent is dropped (live UI events are worthless minutes
later). Every drop is counted in `stats.dropped`. A batch that failed halfway may be sent twice:
delivery across an outage is at least once.

Nothing here knows Redis: the writer is handed a `write(batch)` coroutine and a `recover(error)`
one that returns once sending may resume (the bus waits for Redis and for the other replicas to
listen again there), so the bounds and the ordering are testable alone.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

# Presence hash writes that go ahead of an envelope in the same pipeline: (key, field, value; "" deletes).
Writes = tuple[tuple[str, str, str], ...]
Outgoing = tuple[float, str, bytes, Writes]  # (queued at, monotonic; channel; envelope; presence writes)
BATCH = 512  # envelopes per pipelined write


@dataclass
class ReplicationStats:
    sent: int = 0  # envelopes written to Redis
    received: int = 0  # envelopes from other replicas
    dropped: int = 0  # envelopes not sent: outbox full or Redis down
    bad: int = 0  # envelopes received that could not be decoded
    unwanted: int = 0  # envelopes received for no subscriber here (other sessions of a shard listened to)
    unreplicable: int = 0  # items delivered locally only (neither protobuf nor JSON-able)
    outages: int = 0  # times the connection to Redis was lost
    kept_local: int = 0  # events of a kind a live replica's wire protocol does not have: delivered here only

    def counters(self) -> dict[str, tuple[int, str]]:
        """Each counter with its help text, for /metrics (`uibus_replication_<name>_total`)."""
        return {"sent": (self.sent, "Envelopes this replica wrote to Redis"),
                "received": (self.received, "Envelopes received from other replicas"),
                "dropped": (self.dropped, "Envelopes not sent to Redis: outbox full or Redis down"),
                "bad": (self.bad, "Envelopes received that could not be decoded"),
                "unwanted": (self.unwanted, "Envelopes received from other replicas for no subscriber here"),
                "unreplicable": (self.unreplicable, "Events delivered on this replica only (no wire form)"),
                "outages": (self.outages, "Times the connection to Redis was lost"),
                "kept_local": (self.kept_local, "Events delivered on this replica only because a live replica's "
                               "wire protocol version does not have their kind")}


class Outbox:
    """A bounded FIFO of outgoing envelopes (count, bytes, age), drained by `run`."""

    def __init__(self, stats: ReplicationStats, *, size: int = 10_000, max_bytes: int = 16 * 1024 * 1024,
                 max_age_s: float = 10.0, batch: int = BATCH) -> None:
        self.stats = stats
        self.size = size
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.batch = batch
        self.bytes = 0  # envelope bytes held
        self._queue: deque[Outgoing] = deque()
        self._wake = asyncio.Event()
        self.drained = asyncio.Event()  # set by the writer whenever the outbox is empty

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def put(self, channel: str, envelope: bytes, writes: Writes = ()) -> None:
        self._queue.append((time.monotonic(), channel, envelope, writes))
        self.bytes += len(envelope)
        self._bound()
        self._wake.set()

    def take(self) -> list[Outgoing]:
        """The next batch, oldest first, after dropping what is too old to send."""
        self._expire()
        queue = self._queue
        batch = [queue.popleft() for _ in range(min(self.batch, len(queue)))]
        self.bytes -= sum(len(e[2]) for e in batch)
        return batch

    def put_back(self, batch: list[Outgoing]) -> None:
        """A batch whose write failed goes back to the front, in order, for when Redis is back
        (then the bounds apply again: the oldest go first)."""
        self._queue.extendleft(reversed(batch))
        self.bytes += sum(len(e[2]) for e in batch)
        self._bound()

    def _bound(self) -> None:
        """Drops the oldest envelopes beyond the count and byte bounds (counted)."""
        queue = self._queue
        while len(queue) > self.size or (self.bytes > self.max_bytes and len(queue) > 1):
            self.bytes -= len(queue.popleft()[2])
            self.stats.dropped += 1

    def _expire(self) -> None:
        """Drops what waited longer than max_age_s (counted): it is news no more."""
        queue, oldest = self._queue, time.monotonic() - self.max_age_s
        while queue and queue[0][0] < oldest:
            self.bytes -= len(queue.popleft()[2])
            self.stats.dropped += 1

    def wake(self) -> None:
        """Makes a waiting writer look again (at `running()`, when stopping)."""
        self._wake.set()

    async def flush(self, timeout_s: float) -> None:
        """Waits (at most `timeout_s`) until the writer has emptied the outbox."""
        if self._queue:
            self.drained.clear()
            try:
                await asyncio.wait_for(self.drained.wait(), timeout_s)
            except TimeoutError:
                pass

    async def run(self, write: Callable[[list[Outgoing]], Awaitable[None]],
                  recover: Callable[[Exception], Awaitable[None]], running: Callable[[], bool]) -> None:
        """The writer: while `running()`, writes each batch; a batch whose write raised goes back
        to the front and `recover(error)` is awaited before the next one. Whatever `write` raises
        (a client fails in more ways than an outage) the writer lives on."""
        while running():
            if not self._queue:
                self.drained.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self.take()
            if not batch:
                continue
            try:
                await write(batch)
            except Exception as exc:
                self.put_back(batch)
                await recover(exc)
                continue
            self.stats.sent += len(batch)

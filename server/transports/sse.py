"""Server-sent events, once, for every SSE uibus writes: `/acp` over HTTP (uibus.transports.acp_http)
and `/mcp` (uibus.transports.mcp_http).

* `frame`: one event as the wire has it, with an `id:` that increases per stream (`Ids`), so a
  client can name the last one it saw (resumption with Last-Event-ID is a later addition; the ids
  are there for it);
* `KEEPALIVE`: the comment that keeps proxies from closing an idle stream;
* `Budget` and `Queue`: events waiting for a reader, bounded in *bytes* per connection (all its
  streams together). A connection whose client stops reading is cut when the bound is passed —
  `Overflow`, which the transport turns into a clear error — never grown, and never a response
  dropped in silence;
* `pump`: the GET loop that hands a queue's events to the reader, with keep-alives, until the
  queue closes or the client goes away (what it did not take stays for the next reader).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

KEEPALIVE = b": keep-alive\n\n"
HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]

Send = Callable[[dict[str, Any]], Awaitable[None]]


def frame(data: bytes, ident: int | None = None, event: str | None = None) -> bytes:
    """One event: `data` must be one line (compact JSON is)."""
    head = b""
    if ident is not None:
        head += b"id: %d\n" % ident
    if event is not None:
        head += b"event: " + event.encode() + b"\n"
    return head + b"data: " + data + b"\n\n"


class Ids:
    """The event ids of one stream: 1, 2, 3, …"""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = 0

    def next(self) -> int:
        self.last += 1
        return self.last


class Overflow(Exception):
    """More bytes waited for a reader than the connection's bound: the connection is cut."""


class Budget:
    """The bytes waiting for a reader on one connection, all its streams together."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.overflowed = ""  # why the connection was cut, once it was

    def take(self, size: int) -> None:
        if self.overflowed:
            raise Overflow(self.overflowed)
        if self.used + size > self.limit:
            self.overflowed = (f"{self.used + size} bytes of events waited for a reader, more than the bound of "
                               f"{self.limit}: the client stopped reading its event streams, so the connection "
                               "was closed")
            raise Overflow(self.overflowed)
        self.used += size

    def give(self, size: int) -> None:
        self.used -= size


class Queue:
    """One stream's events until its reader takes them, within the connection's `Budget`."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.ids = Ids()
        self.queue: collections.deque[bytes] = collections.deque()
        self.more = asyncio.Event()
        self.reading = False
        self.closed = False

    def push(self, data: bytes, event: str | None = None) -> None:
        """Queues one event; Overflow (nothing queued) past the budget."""
        framed = frame(data, self.ids.next(), event)
        self.budget.take(len(framed))
        self.queue.append(framed)
        self.more.set()

    def close(self) -> None:
        self.closed = True
        self.more.set()

    def drop(self) -> None:
        """Forgets what waits (the connection is gone), giving its bytes back."""
        while self.queue:
            self.budget.give(len(self.queue.popleft()))

    async def take(self, patience: float) -> bytes | None:
        """The next event; b"" after `patience` seconds of nothing; None once closed."""
        if not self.queue and not self.closed:
            self.more.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.more.wait(), patience)
        if self.queue:
            framed = self.queue.popleft()
            self.budget.give(len(framed))
            return framed
        return None if self.closed else b""

    def put_back(self, framed: bytes) -> None:
        """An event taken but not delivered (the reader went away): first for the next reader."""
        self.budget.used += len(framed)
        self.queue.appendleft(framed)


async def pump(queue: Queue, send: Send, gone: asyncio.Future[Any], keepalive_s: float) -> None:
    """Writes `queue`'s events to an open SSE response until it closes or the client goes (`gone`)."""
    while not gone.done():
        taking = asyncio.ensure_future(queue.take(keepalive_s))
        await asyncio.wait((taking, gone), return_when=asyncio.FIRST_COMPLETED)
        if gone.done():  # the client went away: what it did not take stays for the next reader
            taking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await taking
            if taking.done() and not taking.cancelled() and taking.result():
                queue.put_back(taking.result())  # type: ignore[arg-type]
            return
        framed = taking.result()
        if framed is None:
            break
        await send({"type": "http.response.body", "more_body": True, "body": framed or KEEPALIVE})
    if not gone.done():
        await send({"type": "http.response.body", "body": b""})

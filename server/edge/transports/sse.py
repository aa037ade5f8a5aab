"""Server-sent events, once, for every SSE uibus writes: `/acp` over HTTP (uibus.edge.transports.acp_http)
and `/mcp` (uibus.edge.transports.mcp_http). The transports translate framing only; what a stream
keeps, how it is resumed and when it cannot be are decided here, once.

* `frame`: one event as the wire has it, with an `id:` that increases per stream: `<n>`, or
  `<name>.<n>` for a stream whose id must also say which stream it is (MCP's GET names no stream,
  only the id does);
* `KEEPALIVE`: the comment that keeps proxies from closing an idle stream;
* `Budget` and `Queue`: events waiting for a reader, bounded in *bytes* per connection (all its
  streams together). A connection whose client stops reading is cut when the bound is passed —
  `Overflow`, which the transport turns into a clear error — never grown, and never a response
  dropped in silence;
* the replay log: each `Queue` keeps the events it already handed to a reader, because a write
  to a connection that just broke is lost without an error; bounded in bytes per stream
  (`REPLAY_BYTES`) and per group of streams (`Replay`: a connection's, an endpoint's), the oldest
  events of the oldest streams out first. `Queue.resume(after)` (a client's `Last-Event-ID`) puts the events
  after that id in front of what waits, so the next reader gets exactly the missed ones, once, in
  order, then live. An id older than the log keeps is `TooOld`, an id the stream never gave is
  `UnknownId`: an explicit answer, never a silent hole;
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
REPLAY_BYTES = 1024 * 1024  # bytes of delivered events one stream keeps for a client resuming it

Send = Callable[[dict[str, Any]], Awaitable[None]]


def frame(data: bytes, ident: int | str | None = None, event: str | None = None) -> bytes:
    """One event: `data` must be one line (compact JSON is); b"" is an event with an id only."""
    head = b""
    if ident is not None:
        head += b"id: " + str(ident).encode() + b"\n"
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


class ResumeError(Exception):
    """A `Last-Event-ID` this stream cannot resume from; the message says why, for the client."""


class TooOld(ResumeError):
    """The events after the id were handed out and have since left the replay log."""


class UnknownId(ResumeError):
    """The id is not one this stream gave (another stream's, a future one, not an id at all)."""


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


class Replay:
    """The bytes the replay logs of a group of streams keep together. Past `limit` the oldest
    events of the oldest streams go first (a stream keeps its newest event while it pushes)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.queues: dict[int, Queue] = {}  # by id, oldest first

    def add(self, queue: Queue) -> None:
        self.queues[id(queue)] = queue

    def remove(self, queue: Queue) -> None:
        """`queue` is forgotten: its log's bytes are given back."""
        if self.queues.pop(id(queue), None) is not None:
            queue.forget_sent()

    def trim(self, keep: Queue) -> None:
        for key, queue in list(self.queues.items()):
            while self.used > self.limit and queue.sent and (queue is not keep or len(queue.sent) > 1):
                queue.trim_one()
            if not queue.sent:  # emptied: to the back, so the next trim does not walk past it again
                self.queues[key] = self.queues.pop(key)
            if self.used <= self.limit:
                return


class Queue:
    """One stream's events until its reader takes them (within the connection's `Budget`), and
    the ones it took, for a reader that resumes (within `replay_bytes`, and its group's `Replay`)."""

    def __init__(self, budget: Budget, name: str = "", replay_bytes: int = REPLAY_BYTES,
                 replay: Replay | None = None) -> None:
        self.budget = budget
        self.replay = replay if replay is not None else Replay(replay_bytes)
        self.replay.add(self)
        self.name = name  # the stream's part of its event ids ("": the ids are plain numbers)
        self.ids = Ids()
        self.queue: collections.deque[tuple[int, bytes]] = collections.deque()  # waiting for a reader
        self.sent: collections.deque[tuple[int, bytes]] = collections.deque()  # handed out, kept for a resume
        self.sent_bytes = 0
        self.replay_bytes = replay_bytes
        self.floor = 0  # the highest id that left the replay log (resuming from below it is TooOld)
        self._taken = 0  # the id `take` gave last (`put_back` takes it back)
        self.more = asyncio.Event()
        self.reading = False
        self.closed = False
        self._stop = asyncio.Event()  # set: the current reader is to stop (a resuming one takes over)
        self._idle = asyncio.Event()  # set while no reader reads
        self._idle.set()

    def begin_reading(self) -> asyncio.Event:
        """A reader starts; the event it gets is set when it is to stop."""
        self.reading = True
        self._idle.clear()
        self._stop = asyncio.Event()
        return self._stop

    def end_reading(self) -> None:
        self.reading = False
        self._idle.set()

    async def take_over(self, patience: float = 5.0) -> bool:
        """Stops the current reader, if any, for a client that resumes: it says it lost that
        connection, whose end the server may not have seen yet. False if it did not stop in time."""
        if self.reading:
            self._stop.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), patience)
        return not self.reading

    def ident(self, n: int) -> str:
        return f"{self.name}.{n}" if self.name else str(n)

    def push(self, data: bytes, event: str | None = None) -> tuple[int, bytes]:
        """Queues one event; Overflow (nothing queued) past the budget. Returns its number and its
        bytes as framed (what a transport that also keeps it elsewhere keeps: `/mcp` on replicas)."""
        n = self.ids.last + 1
        framed = frame(data, self.ident(n), event)
        self.budget.take(len(framed))
        self.ids.next()
        self.queue.append((n, framed))
        self.more.set()
        return n, framed

    def close(self) -> None:
        self.closed = True
        self.more.set()

    def drop(self) -> None:
        """Forgets what waits and what was sent (the connection is gone), giving its bytes back."""
        while self.queue:
            self.budget.give(len(self.queue.popleft()[1]))
        self.forget_sent()

    def forget_sent(self) -> None:
        self.replay.used -= self.sent_bytes
        self.sent.clear()
        self.sent_bytes = 0
        self.floor = self.ids.last

    def trim_one(self) -> None:
        """The oldest event of the replay log goes: resuming from before it is TooOld from now."""
        gone, old = self.sent.popleft()
        self.sent_bytes -= len(old)
        self.replay.used -= len(old)
        self.floor = gone

    def position(self, last_event_id: str) -> int:
        """The number of the event a client's `Last-Event-ID` names on this stream (UnknownId if
        the stream never gave it)."""
        name, _, number = last_event_id.strip().rpartition(".")
        if name != self.name or not number.isdigit() or len(number) > 18 or int(number) > self.ids.last:
            raise UnknownId(f"Last-Event-ID {last_event_id[:80]!r} is not an event of this stream")
        return int(number)

    def resume(self, last_event_id: str) -> None:
        """The next reader starts after `last_event_id`: the events it missed (handed to a reader
        that went away) go back in front of what waits, in order, each once."""
        after = self.position(last_event_id)
        if after < self.floor:
            raise TooOld(f"the events after {last_event_id[:80]} are no longer kept (a stream keeps the newest "
                         f"{self.replay_bytes} bytes of events it sent; the oldest kept follows "
                         f"{self.ident(self.floor)})")
        back = []
        while self.sent and self.sent[-1][0] > after:
            n, framed = self.sent.pop()
            self.sent_bytes -= len(framed)
            self.replay.used -= len(framed)
            back.append((n, framed))
        for n, framed in back:  # newest first, so the oldest ends in front
            self.budget.used += len(framed)
            self.queue.appendleft((n, framed))
        if back:
            self.more.set()

    def _sent(self, n: int, framed: bytes) -> None:
        self.sent.append((n, framed))
        self.sent_bytes += len(framed)
        self.replay.used += len(framed)
        while self.sent_bytes > self.replay_bytes and len(self.sent) > 1:
            self.trim_one()
        if self.replay.used > self.replay.limit:
            self.replay.trim(self)

    async def take(self, patience: float) -> bytes | None:
        """The next event; b"" after `patience` seconds of nothing; None once closed and read."""
        if not self.queue and not self.closed:
            self.more.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.more.wait(), patience)
        if self.queue:
            n, framed = self.queue.popleft()
            self.budget.give(len(framed))
            self._taken = n
            self._sent(n, framed)
            return framed
        return None if self.closed else b""

    def put_back(self, framed: bytes) -> None:
        """The event `take` just gave, not delivered (the reader went away): first for the next reader."""
        n = self._taken
        if self.sent and self.sent[-1][1] is framed:
            self.sent.pop()
            self.sent_bytes -= len(framed)
            self.replay.used -= len(framed)
        elif self.floor == n:  # trimmed from the replay log meanwhile: it waits again, so it is not gone
            self.floor = n - 1
        self.budget.used += len(framed)
        self.queue.appendleft((n, framed))


async def pump(queue: Queue, send: Send, gone: asyncio.Future[Any], keepalive_s: float,
               stop: asyncio.Event | None = None) -> None:
    """Writes `queue`'s events to an open SSE response until it closes, the client goes (`gone`)
    or another reader takes over (`stop`, from `Queue.begin_reading`)."""
    stopping = asyncio.ensure_future(stop.wait()) if stop is not None else asyncio.get_running_loop().create_future()
    try:
        while not gone.done() and not stopping.done():
            taking = asyncio.ensure_future(queue.take(keepalive_s))
            await asyncio.wait((taking, gone, stopping), return_when=asyncio.FIRST_COMPLETED)
            if gone.done() or stopping.done():  # what this reader did not take stays for the next one
                taking.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await taking
                if taking.done() and not taking.cancelled() and taking.result():
                    queue.put_back(taking.result())  # type: ignore[arg-type]
                break
            framed = taking.result()
            if framed is None:
                break
            await send({"type": "http.response.body", "more_body": True, "body": framed or KEEPALIVE})
    finally:
        stopping.cancel()
    if not gone.done():
        await send({"type": "http.response.body", "body": b""})

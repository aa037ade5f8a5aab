"""`/mcp` event streams resumable on any replica (uibus.edge.transports.mcp_http frames them).

Why: a call's event stream lives on the replica that runs the call, and its replay log there
(uibus.edge.transports.sse) is memory. Behind a load balancer the GET that resumes it with
`Last-Event-ID` may reach another replica, which would have to answer 404 though the call is
still running. So, when the bus is replicated, every event of a call's stream is also

* written to the session's ordered log (uibus.domain.session_log), 32 events to an entry (kind
  `MCP_EVENTS`, key `<stream>.<block>`: a block's entry is replaced as it fills, so a long call
  costs the log one entry per 32 events, not one per progress piece), the first block with the
  stream's head (the Mcp-Session-Id, a hash of the POST's Authorization, the JSON-RPC id and the
  replica running the call), so another replica can check a resume exactly as the call's would;
* published on the bus (`kinds.MCP_EVENT`, targeted at the stream), so the replica serving the
  resume gets the rest of the call live.

The replica serving the resume does replay-then-live (uibus.infra.replay) keyed by the event's
number: subscribe, read the log after the client's id, merge what was queued meanwhile, then live
without what the replay sent. Event numbers are contiguous, so a hole (events the call's replica
stamped but its write-behind has not committed yet, at most `write_s` old) is seen and read again,
never skipped in silence; a hole that stays is the call's `DATA_LOSS` error. While it reads it
tells the call's replica so (`<stream>/reader` notices), so the call is not cancelled as abandoned;
and it ends the stream with `UNAVAILABLE` when that replica is gone (its presence expired).

The stream's name starts with the wall-clock microseconds of its start in hex, a lower bound of
the seq of everything it logs (a seq is never below the clock), so a resume reads the log from
there instead of the session's whole log.

A single uibus (no replicated bus) logs nothing of this: there a stream is served where it runs,
and one of a previous process is 404, as the transport documents.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from uibus.domain.session_log import SessionLog
from uibus.edge.transports import sse
from uibus.infra import kinds
from uibus.infra.bus import Bus
from uibus.infra.errors import UibusError
from uibus.infra.json_input import dump_json_bytes, load_json
from uibus.infra.replay import Catchup
from uibus.infra.tasks import cancel_and_wait

MCP_EVENTS = "mcp_event"  # the kind of a /mcp stream's events in the session log
BLOCK = 32  # events per log entry
FILL_TRIES = 8  # reads of the log, `write_s` apart, before a hole is taken as lost
# One event: {"n": number, "f": the framed event ("" for an end without one), "end": bool, "at": Unix ms}
Record = dict[str, Any]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def new_stream_name() -> str:
    """`<start µs, hex>-<random>`: unguessable, and says from which seq its log entries are."""
    return f"{time.time_ns() // 1000:x}-{secrets.token_urlsafe(12)}"


def _start_of(name: str) -> int | None:
    start, dash, rest = name.partition("-")
    if not dash or not rest or not 0 < len(start) <= 15:
        return None
    try:
        return int(start, 16)
    except ValueError:
        return None


def auth_hash(authorization: str) -> str:
    """What the log keeps of the POST's Authorization: enough to compare a resume's, not the token."""
    return hashlib.sha256(authorization.encode("utf-8", "surrogateescape")).hexdigest()


def _n(record: Record) -> int:
    return int(record["n"])


class _Block:
    """One log entry of a stream: its head (the first block only) and up to BLOCK events. Kept as an
    object the log serializes when it writes (uibus.domain.session_log), so a block filling up
    between two writes is encoded once."""

    __slots__ = ("events", "head", "seq")

    def __init__(self, head: dict[str, Any] | None) -> None:
        self.seq = 0  # stamped by the log
        self.head = head
        self.events: list[list[Any]] = []

    def SerializeToString(self) -> bytes:  # the protobuf method the log calls
        return dump_json_bytes({"h": self.head, "e": self.events})


class SharedStream:
    """The call's side: its stream's events to the log and the bus, and its remote readers heard."""

    def __init__(self, bus: Bus, log: SessionLog, session: str, name: str, head: dict[str, Any]) -> None:
        self.bus = bus
        self.log = log
        self.session = session
        self.name = name
        self._block = _Block(head)
        self._index = 0

    def record(self, n: int, framed: bytes, end: bool = False) -> None:
        """Event `n` (as framed) was queued on the stream; `end`: it is the last one (b"": the stream
        ended without one, as when it was cut)."""
        data = framed.decode("utf-8", "replace")
        at = time.time() * 1000
        block = self._block
        if len(block.events) >= BLOCK:
            block = self._block = _Block(None)
            self._index += 1
        block.events.append([n, data, end, at])
        self.log.stamp_event(self.session, MCP_EVENTS, f"{self.name}.{self._index}", block)  # type: ignore[arg-type]
        self.bus.publish(self.session, kinds.MCP_EVENT, {"n": n, "f": data, "end": end, "at": at}, target=self.name)

    async def watch_readers(self, heard: Callable[[], None]) -> None:
        """Calls `heard` for each notice of a replica reading the stream, until cancelled."""
        sub = self.bus.subscribe(self.session, kinds.MCP_EVENT, self.name + "/reader")
        try:
            async for _notice in sub:
                heard()
        finally:
            self.bus.unsubscribe(sub)


async def _read(log: SessionLog, session: str, name: str,
                start: int) -> tuple[dict[str, Any] | None, dict[int, Record]]:
    """The stream's head and its logged events by number."""
    replay = await log.read(session, start - 1, kind=MCP_EVENTS)
    head: dict[str, Any] | None = None
    found: dict[int, Record] = {}
    prefix = name + "."
    for entry in replay.entries:
        if not entry.key.startswith(prefix):
            continue
        try:
            block = load_json(entry.data, "a logged /mcp block")
            if block.get("h") is not None:
                head = block["h"]
            for n, framed, end, at in block["e"]:
                found[int(n)] = {"n": int(n), "f": str(framed), "end": bool(end), "at": float(at)}
        except (UibusError, ValueError, TypeError, KeyError, AttributeError):  # not ours to read: skipped
            continue
    return head, found


class RemoteResume:
    """Serves a resume of a stream whose call runs on another replica (or ran there lately)."""

    def __init__(self, bus: Bus, log: SessionLog, resume_s: float, keepalive_s: float) -> None:
        self.bus = bus
        self.log = log
        self.resume_s = resume_s
        self.keepalive_s = keepalive_s

    async def serve(self, session: str, last: str, session_id: str | None, authorization: str, send: Send,
                    disconnect: Awaitable[None], not_found: Callable[[], Awaitable[None]],
                    error: Callable[[Any, str, str], bytes]) -> None:
        """Answers the GET: `not_found()` when no stream of this session has event `last` (or the
        caller is not its client), else the events after it, then the rest of the call live, until
        the call ends or `disconnect` returns (the client went away).
        `error(ident, status, message)`: the JSON-RPC error of the call as one frame's data."""
        gone = asyncio.ensure_future(disconnect)
        try:
            await self._serve(session, last, session_id, authorization, send, gone, not_found, error)
        finally:
            await cancel_and_wait(gone)

    async def _serve(self, session: str, last: str, session_id: str | None, authorization: str, send: Send,
                     gone: asyncio.Future[Any], not_found: Callable[[], Awaitable[None]],
                     error: Callable[[Any, str, str], bytes]) -> None:
        name, _, number = last.rpartition(".")
        start = _start_of(name)
        if start is None or not number.isdigit() or len(number) > 18:
            await not_found()
            return
        after = int(number)
        sub = self.bus.subscribe(session, kinds.MCP_EVENT, name)
        try:
            await self.bus.ready(session)  # every event published from now on reaches `sub`
            _notify(self.bus, session, name)  # at once: the call's replica may be about to give up on its stream
            catchup: Catchup[Record] = Catchup(sub, key=_n, version=_n)
            head, found = await _read(self.log, session, name, start)
            if head is None or (found and max(found) < after):  # its first writes may be a write_s behind
                await asyncio.sleep(self.log.write_s * 2)
                head, found = await _read(self.log, session, name, start)
            now_ms = time.time() * 1000
            if (head is None or head.get("sid") != session_id or head.get("auth") != auth_hash(authorization)
                    or head.get("replica") in ("", self.bus.replica_id) or max(found, default=0) < after
                    or any(r["end"] and now_ms - r["at"] > self.resume_s * 1000 for r in found.values())):
                await not_found()
                return
            await send({"type": "http.response.start", "status": 200, "headers": sse.HEADERS})
            await _Reader(self, session, name, start, head, catchup, send, gone, error).run(found, after)
        finally:
            self.bus.unsubscribe(sub)


class _Reader:
    """One remote reader of a stream, from the replay to the call's end or the client's."""

    def __init__(self, owner: RemoteResume, session: str, name: str, start: int, head: dict[str, Any],
                 catchup: Catchup[Record], send: Send, gone: asyncio.Future[Any],
                 error: Callable[[Any, str, str], bytes]) -> None:
        self.owner = owner
        self.session = session
        self.name = name
        self.start = start
        self.head = head
        self.catchup = catchup
        self.send = send
        self.gone = gone
        self.error = error
        self.expected = 0
        self.pending: dict[int, Record] = {}  # read from the log, beyond a hole

    async def _emit(self, record: Record) -> bool:
        """Sends `record` if it is the next one; True once the stream has ended."""
        self.catchup.sent(record)
        self.expected = record["n"] + 1
        if record["f"]:
            await self.send({"type": "http.response.body", "more_body": True, "body": record["f"].encode()})
        return bool(record["end"])

    async def _fail(self, status: str, message: str) -> None:
        data = self.error(self.head.get("rid"), status, message)
        await self.send({"type": "http.response.body", "more_body": True, "body": sse.frame(data, None, "message")})

    async def _fill(self, upto: int) -> bool:
        """Events `expected`..`upto`-1 from the log (the call's replica commits them within its
        write-behind interval, so a few reads apart); False when they stay missing."""
        for attempt in range(FILL_TRIES):
            if all(n in self.pending for n in range(self.expected, upto)):
                return True
            if attempt:
                self._notify()  # the call's replica counts this wait as reading
                await asyncio.sleep(self.owner.log.write_s)
            _, found = await _read(self.owner.log, self.session, self.name, self.start)
            for n, record in found.items():
                if n >= self.expected:
                    self.pending.setdefault(n, record)
        return all(n in self.pending for n in range(self.expected, upto))

    async def _drain(self, upto: int | None) -> bool | None:
        """Sends the pending events in order up to `upto` (all contiguous ones with None): True once
        ended, None when a hole below `upto` stays (the call's error was sent)."""
        if upto is not None and not await self._fill(upto):
            await self._fail("DATA_LOSS", f"events {self.expected}..{upto - 1} of this stream were not kept "
                             "(the replica running the call could not write them); the rest cannot follow in order")
            return None
        while self.expected in self.pending:
            if await self._emit(self.pending.pop(self.expected)):
                return True
        return False

    async def run(self, found: dict[int, Record], after: int) -> None:
        catchup = self.catchup
        await catchup.merge(found, after=after)
        self.pending = {n: r for n, r in found.items() if n > after}
        self.expected = after + 1
        ended = await self._drain(max(self.pending) + 1 if self.pending else None)
        tick = min(self.keepalive_s, self.owner.resume_s / 3)  # how often the call's replica hears of us
        clock = asyncio.get_running_loop().time
        nxt: asyncio.Future[Record] | None = None
        try:
            if ended is False:
                self._notify()
                notice_at, quiet_at = clock() + tick, clock() + self.keepalive_s
                live = catchup.live()
                nxt = asyncio.ensure_future(anext(live))
                while ended is False:
                    done, _ = await asyncio.wait((nxt, self.gone), timeout=max(0.0, min(notice_at, quiet_at) - clock()),
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if self.gone.done():
                        return
                    if clock() >= notice_at:  # while events flow too: the call's replica sees no reader of its own
                        self._notify()
                        notice_at = clock() + tick
                    if nxt not in done:
                        if clock() >= quiet_at:
                            quiet_at = clock() + self.keepalive_s
                            await self.send({"type": "http.response.body", "more_body": True, "body": sse.KEEPALIVE})
                            if self.owner.bus.announced(self.head.get("replica", ""), self.session,
                                                        kinds.MCP_EVENT) is False:
                                ended = await self._drain(None) or await self._lost()
                        continue
                    quiet_at = clock() + self.keepalive_s
                    try:
                        record = nxt.result()
                    except StopAsyncIteration:  # the bus is closing: the client resumes elsewhere
                        return
                    nxt = asyncio.ensure_future(anext(live))
                    n = record["n"]
                    if n < self.expected:
                        continue
                    self.pending[n] = record
                    ended = await self._drain(n if n > self.expected else None)
                    if ended is None:
                        return
                    if ended is False:
                        ended = await self._drain(None)
        finally:
            if nxt is not None:
                await cancel_and_wait(nxt)
            if not self.gone.done():
                await self.send({"type": "http.response.body", "body": b""})

    async def _lost(self) -> bool:
        """The call's replica is gone without the stream's end: the call's error, and the end."""
        _, found = await _read(self.owner.log, self.session, self.name, self.start)
        for n, record in found.items():
            if n >= self.expected:
                self.pending.setdefault(n, record)
        if await self._drain(None):
            return True
        await self._fail("UNAVAILABLE", "the uibus replica running this call is gone; the call did not finish")
        return True

    @property
    def keepalive_s(self) -> float:
        return self.owner.keepalive_s

    def _notify(self) -> None:
        _notify(self.owner.bus, self.session, self.name)


def _notify(bus: Bus, session: str, name: str) -> None:
    """Tells the call's replica a client reads its stream here (it would cancel it as abandoned)."""
    bus.publish(session, kinds.MCP_EVENT, {"reading": True}, target=name + "/reader")

"""A session's recent ClineMessages, kept in the store so a webview opened later starts with the
conversation so far (`UiFeed` notes every message it publishes here; WebviewService replays them).

Its own module because it is its own job with its own timers and tasks: write-behind batching per
session, bounded by count and bytes, merged with what is still in memory on read.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from typing import Any

from google.protobuf.message import DecodeError

from uibus.errors import StoreFull, StoreUnavailable
from uibus.pb.cline import ui_pb2
from uibus.store import Store
from uibus.tasks import Tasks

log = logging.getLogger("uibus.feed")

# The latest state of each of the session's recent messages (RecentMessages), what a webview opened
# later starts with: {"<ts>": base64 of the serialized ClineMessage, ...}, oldest first; finished
# messages in the first key, messages still growing (partial) in the second.
RECENT_KEY = "ui/recent"
RECENT_PARTIAL_KEY = "ui/recent-partial"
MAX_RECENT = 200  # messages kept per session (and per key): the newest by ts
MAX_RECENT_BYTES = 256 * 1024  # per key, only the newest within this many bytes (the newest always)
RECENT_WRITE_S = 0.25  # a session is written at most once per this (at once when it was not just written)


def _encode(message: ui_pb2.ClineMessage) -> str:
    """A message as stored: base64 of its protobuf bytes (every field kept exactly, unlike a
    hand-picked JSON shape, and about ten times cheaper than proto3 JSON both ways)."""
    return base64.b64encode(message.SerializeToString()).decode("ascii")


def _decode(data: Any) -> ui_pb2.ClineMessage | None:
    """The stored message, or None for an entry that is not one (never fails a reader)."""
    if not isinstance(data, str):
        return None
    try:
        return ui_pb2.ClineMessage.FromString(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError, DecodeError):
        return None


class RecentMessages:
    """The latest state of each session's recent ClineMessages, kept in the store so a webview
    opened later (or reloaded) starts with the conversation so far.

    Write-behind, because publishing a partial message must stay cheap and never await (a reply
    grows many times a second, and `UiFeed.say` runs in cancel paths): `note` only records the
    message in memory. A session's noted states are written in one go at once when the session was
    not written in the last `write_s`, else at the end of that interval; so a session costs at most
    one write per `write_s` however fast it publishes, and a message that stops changing is stored
    within `write_s`. One write per session is in flight at a time, so an older state never
    overwrites a newer one; `read` merges the store with what is still in memory, so on this
    process a message can be replayed the moment it is published. With several replicas each
    message is written by the replica it was published on (`Store.update` is atomic across them).

    Two keys, so that a streaming reply does not rewrite the whole conversation every `write_s`:
    finished messages (`partial` false) in RECENT_KEY, written only when a message finishes, and
    messages still growing in RECENT_PARTIAL_KEY (usually one or two, so a cheap write); a message
    moves from the second to the first when it finishes. Each key holds the newest `max_messages`
    by ts, and of those only the newest whose encoded sizes sum to at most `max_bytes` (the newest
    one is always kept, as the store's lists keep their newest entry); `read` gives the newest
    `max_messages` of both. Memory holds at most 2 x `max_messages` unwritten states per session,
    only until its next write. The writes are ordinary store writes (they stamp the session's
    activity, and retention deletes the keys with the session). A failed write is dropped, counted
    in `write_failures`: the store already logs and reports its failures, and live delivery never
    depended on it.
    """

    def __init__(self, store: Store, *, max_messages: int = MAX_RECENT, max_bytes: int = MAX_RECENT_BYTES,
                 write_s: float = RECENT_WRITE_S) -> None:
        self.store = store
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.write_s = write_s
        self.write_failures = 0
        self._pending: dict[str, dict[int, ui_pb2.ClineMessage]] = {}  # noted, not yet being written
        self._writing: dict[str, dict[int, ui_pb2.ClineMessage]] = {}  # the batch whose write is in flight
        self._cooling: dict[str, asyncio.TimerHandle] = {}  # written less than write_s ago: the next write
        self._tasks = Tasks("uibus-recent")  # the writes in flight, one per session at most
        self._inflight: dict[str, asyncio.Task[None]] = {}  # each session's write in flight

    def note(self, session: str, message: ui_pb2.ClineMessage) -> None:
        """Records `message` as its ts's latest state and makes sure it gets written. The message is
        kept as it is (not copied): callers hand over a message they no longer change."""
        pending = self._pending.get(session)
        if pending is None:
            pending = self._pending[session] = {}
        pending[message.ts] = message
        if len(pending) > 2 * self.max_messages:
            for ts in sorted(pending)[:-self.max_messages]:
                del pending[ts]
        if session not in self._cooling and session not in self._writing:
            self._start(session)

    def _start(self, session: str) -> None:
        """Starts writing what the session has pending, in a task (the caller must not wait)."""
        self._cooling.pop(session, None)
        batch = self._pending.pop(session, None)
        if not batch:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a synchronous caller): nothing can write, as a failed write
            self.write_failures += 1
            return
        self._writing[session] = batch
        self._inflight[session] = self._tasks.spawn(self._write(session, batch), name="uibus-recent-write")

    async def _write(self, session: str, batch: dict[int, ui_pb2.ClineMessage]) -> None:
        try:
            newest = sorted(batch)[-self.max_messages:]
            done = {str(ts): _encode(batch[ts]) for ts in newest if not batch[ts].partial}
            growing = {str(ts): _encode(batch[ts]) for ts in newest if batch[ts].partial}
            if done:
                await self.store.update(session, RECENT_KEY, lambda current: self._merge(current, done))
            await self.store.update(session, RECENT_PARTIAL_KEY,
                                    lambda current: self._merge(current, growing, done) or None)
        except (StoreUnavailable, StoreFull):
            self.write_failures += 1
        except Exception as exc:  # a bug of ours must not stop the session's writes
            self.write_failures += 1
            log.error("recent messages not stored", exc_info=exc, extra={"fields": {"session": session}})
        finally:
            self._writing.pop(session, None)
            self._inflight.pop(session, None)
        self._cooling[session] = asyncio.get_running_loop().call_later(self.write_s, self._start, session)

    async def forget(self, session: str) -> None:
        """Drops what is noted of `session` and not yet written, after its write in flight (if any)
        has landed: the session is being deleted, and a write behind the delete would bring its
        messages back (DeleteSession must be final)."""
        self._pending.pop(session, None)
        while (writing := self._inflight.get(session)) is not None:
            await asyncio.wait((writing,))  # not cancelled: a store write is atomic, let it land first
            self._pending.pop(session, None)
        timer = self._cooling.pop(session, None)
        if timer is not None:
            timer.cancel()
        self._pending.pop(session, None)

    def _merge(self, current: Any, add: dict[str, str], remove: dict[str, str] | None = None) -> dict[str, str]:
        """The stored value with `add` merged in and `remove`'s keys taken out, within the bounds,
        oldest first (pure: Store.update may run it again after a conflict)."""
        entries = {k: v for k, v in current.items() if k.isdigit()} if isinstance(current, dict) else {}
        for key in remove or ():
            entries.pop(key, None)
        entries.update(add)
        kept: list[str] = []
        total = 0
        for key in sorted(entries, key=int, reverse=True)[:self.max_messages]:
            size = len(key) + len(entries[key]) + 6  # as JSON: two pairs of quotes, a colon, a comma
            if kept and total + size > self.max_bytes:
                break
            kept.append(key)
            total += size
        return {key: entries[key] for key in reversed(kept)}

    async def read(self, session: str) -> dict[int, ui_pb2.ClineMessage]:
        """The latest state of the session's recent messages by ts (the newest `max_messages`): what
        is stored (a finished state over a growing one), overridden by what this process noted and
        has not written yet."""
        growing = await self.store.get(session, RECENT_PARTIAL_KEY)
        done = await self.store.get(session, RECENT_KEY)
        messages: dict[int, ui_pb2.ClineMessage] = {}
        for stored in (growing, done):
            if isinstance(stored, dict):
                for key, data in stored.items():
                    message = _decode(data)
                    if message is not None and key.isdigit():
                        messages[int(key)] = message
        for batch in (self._writing.get(session), self._pending.get(session)):  # read after the awaits
            if batch:
                messages.update(batch)
        if len(messages) > self.max_messages:
            messages = {ts: messages[ts] for ts in sorted(messages)[-self.max_messages:]}
        return messages

    async def flush(self) -> None:
        """Writes everything noted now and waits for every write (tests; a shutdown that wants it)."""
        while True:
            for session in list(self._pending):
                if session not in self._writing:
                    timer = self._cooling.pop(session, None)
                    if timer is not None:
                        timer.cancel()
                    self._start(session)
            if not self._tasks:
                return
            await self._tasks.join()

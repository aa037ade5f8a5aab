"""One ordered log per session: every ClineMessage state gets the session's next sequence number
(`seq`) and its conversation (`epoch`) before it is fanned out, and is kept in the store, so a
UI that reconnects says "after seq N" and gets exactly what it missed (docs/streams/resume.md).

Why write-behind and coalescing: a reply grows many times a second and publishing must never
await (`UiFeed.say` runs in cancel paths), so stamping is in memory (a clock read and a dict
insert) and a session's stamped states are written in one transaction at once when the session
was not written in the last `write_s`, else at the end of that interval: one commit per session
per `write_s` at most, never one per token. Only the latest state of a growing message is kept
(its (kind, key) row is replaced, with the new seq), so a 10,000-piece reply is one entry. `read`
merges the store with what is still in memory, so on this process an event can be replayed the
moment it is stamped; `flush(session)` waits until the session's states are committed: a call
that acknowledges an event (a chat turn's final reply, a host's final message, an extension-UI
notice or a dialog's answer) awaits it before its reply, so acknowledged is durable; a request of
the host is written behind (docs/streams/resume.md says why). On the embedded store those waits
are a group commit: callers waiting in one turn of the loop share one transaction.

The seq is the session's position: it grows by at least one per event and never goes back,
across restarts too, because it is max(last + 1, wall-clock microseconds); so no read of the
store is needed before stamping. The epoch of a conversation is the seq of its first event; the
session's current epoch is read from the log once per process (`prepare`), before the session's
first event here when the caller can await (a chat turn, a host publish).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError, Message

from uibus.infra.errors import StoreFull, StoreUnavailable
from uibus.infra.replay import Catchup
from uibus.infra.store import NO_KEY, LogEntry, LogRetention, Store
from uibus.infra.tasks import Tasks
from uibus.pb.cline import ui_pb2

log = logging.getLogger("uibus.log")

MESSAGE = "message"  # a ClineMessage state, keyed by its ts
LOG_WRITE_S = 0.25  # a session's log is committed at most once per this (at once when idle)
MAX_PENDING = 4096  # unwritten states kept per session (oldest dropped first) while its store fails


# A session's states waiting to be written: (kind, key) -> (entry, the message whose bytes it gets).
_Batch = dict[tuple[str, str], tuple[LogEntry, "Message | None"]]


def new_key() -> str:
    """A key no entry has yet, for an event that is a thing of its own (a host request's id):
    random, in `uuid.uuid4().hex`'s form, made without building a `uuid.UUID` (that was half of
    what making a host request cost). `stamp_event(..., new=True)` is for keys made here."""
    b = bytearray(os.urandom(16))
    b[6] = b[6] & 0x0F | 0x40  # version 4
    b[8] = b[8] & 0x3F | 0x80  # the RFC 4122 variant
    return b.hex()


@dataclass(slots=True)
class _Head:
    seq: int = 0
    epoch: int = 0
    prepared: bool = False
    top: int = NO_KEY  # no ClineMessage ts above this in the log (the store's, and every one stamped here)
    top_known: bool = False  # the store said its highest one (`prepare`): a ts above `top` is `new`
    loading: asyncio.Future[None] | None = None


@dataclass(slots=True)
class Replay:
    """What a reader gets from a cursor: the entries after it (oldest seq first) and whether
    entries after it were already dropped by retention (`gap`), so it must start over."""

    entries: list[LogEntry] = field(default_factory=list)
    gap: bool = False
    head: int = 0  # the highest seq known when read (the cursor of a reader that got everything)


def _entries(batch: _Batch) -> list[LogEntry]:
    """A batch's entries as the store takes them: a message is serialized only now, when written,
    so a state replaced before its write was never encoded (a growing reply's many pieces)."""
    entries = []
    for entry, message in batch.values():
        if message is not None:
            entry.data = message.SerializeToString()
        entries.append(entry)
    return entries


class SessionLog:
    def __init__(self, store: Store, *, retention: LogRetention | None = None, write_s: float = LOG_WRITE_S) -> None:
        self.store = store
        self.retention = retention if retention is not None else LogRetention()
        self.write_s = write_s
        self.write_failures = 0
        self.appended = 0  # entries committed (after coalescing), for /metrics and the bench
        self.commits = 0  # transactions that committed them (group commit: fewer than acknowledgements)
        self._heads: dict[str, _Head] = {}
        self._pending: dict[str, _Batch] = {}  # stamped, not yet being written: by (kind, key), in seq order
        self._writing: dict[str, _Batch] = {}  # the batch whose write is in flight
        self._done: dict[str, asyncio.Event] = {}  # set when the session's write in flight ends
        self._cooling: dict[str, asyncio.TimerHandle] = {}
        self._group: set[str] = set()  # sessions in the group commit at the loop's next turn
        self._group_done: asyncio.Future[set[str]] | None = None
        self._committed_this_turn = False  # a commit for a waiting caller ran in this turn of the loop
        self._tasks = Tasks("uibus-log")

    # ---- stamping ----------------------------------------------------------------------------

    def _head(self, session: str) -> _Head:
        head = self._heads.get(session)
        if head is None:
            head = self._heads[session] = _Head()
        return head

    def prepared(self, session: str) -> bool:
        """Whether `prepare` has learnt the session's epoch on this process (then it has nothing to do)."""
        head = self._heads.get(session)
        return head is not None and head.prepared

    async def prepare(self, session: str) -> None:
        """Learns the session's current epoch (and last seq) from the store, once per process. A
        store that fails leaves the session unprepared (tried again next time); stamping works
        either way."""
        head = self._head(session)
        if head.prepared:
            return
        if head.loading is not None:
            await asyncio.shield(head.loading)
            return
        head.loading = asyncio.get_running_loop().create_future()
        try:
            seq, epoch = await self.store.log_head(session)
            top = await self.store.log_top_key(session, MESSAGE)
            if top is not None:
                head.top = max(head.top, top)
                head.top_known = True
            if seq > head.seq:
                head.seq = seq
            if not head.epoch:
                head.epoch = epoch
            head.prepared = True
        except (StoreUnavailable, StoreFull):
            pass
        finally:
            head.loading.set_result(None)
            head.loading = None

    def next_seq(self, session: str) -> int:
        head = self._head(session)
        seq = head.seq + 1
        now = time.time_ns() // 1000
        if now > seq:
            seq = now
        head.seq = seq
        return seq

    def new_epoch(self, session: str) -> None:
        """The session's next event starts a new conversation (its seq becomes the epoch)."""
        self._head(session).epoch = 0

    def stamp(self, session: str, message: ui_pb2.ClineMessage, *, new_epoch: bool = False) -> ui_pb2.ClineMessage:
        """Gives `message` the session's next seq and the current epoch (a new one with
        `new_epoch`, or for Cline's TASK message, which starts a task) and queues it for the
        store. The message is kept as it is (not copied): callers hand over a message they no
        longer change. Returns it."""
        seq = self.next_seq(session)
        head = self._heads[session]
        if new_epoch or not head.epoch or (message.type == ui_pb2.SAY and message.say == ui_pb2.TASK):
            head.epoch = seq
        message.seq = seq
        message.epoch = head.epoch
        # A ts above every one in the log has no entry to replace there (a host's new message): the
        # store need not look for one. (Stamped before `prepare` learnt the store's, none is new.)
        ts = message.ts
        new = head.top_known and ts > head.top
        if ts > head.top:
            head.top = ts
        # `at`: when it happened (the seq is the wall clock in µs, or just above), not when written
        self._note(session, LogEntry(seq, MESSAGE, str(ts), head.epoch, seq / 1000, b"", new), message)
        return message

    def stamp_event(self, session: str, kind: str, key: str, message: Message, *, new: bool = False) -> int:
        """Gives an event of another kind (a host request, an extension-UI event) the session's next
        seq (its `seq` field) and queues it for the store under (kind, key): a newer event of the
        same key replaces the older one; `new`: the key is a `new_key()`, so the store need not look
        for an older entry of it. Returns the seq."""
        head = self._heads.get(session) or self._head(session)
        seq = head.seq + 1  # next_seq, inline: this runs on every unary call that reaches the host
        now = time.time_ns() // 1000
        if now > seq:
            seq = now
        head.seq = seq
        if not head.epoch:
            head.epoch = seq
        message.seq = seq  # type: ignore[attr-defined]
        self._note(session, LogEntry(seq, kind, key, head.epoch, seq / 1000, b"", new), message)
        return seq

    def retract(self, session: str, kind: str, key: str) -> None:
        """Takes back an event stamped a moment ago that reached nobody and was refused to its
        caller (an openUrl with no host listening), so no later reader replays it. Only while it
        is still unwritten; the next state of its key replaces it anyway."""
        pending = self._pending.get(session)
        if pending is not None:
            pending.pop((kind, key), None)

    async def resume(self, session: str, since: int, kind: str, payload: type[Message],
                     catchup: Catchup[Any]) -> tuple[list[Any], bool]:
        """What a stream resuming after `since` sends before going live (uibus.infra.replay): the
        events of `kind` after the cursor from the log, merged with what its subscription (taken
        before this read) queued meanwhile, each seq once, in seq order, each noted as sent to
        `catchup` (so `catchup.live()` drops them); and whether the cursor was older than the log
        keeps (a gap: the caller sends its snapshot instead)."""
        replay = await self.read(session, since, kind=kind)
        by_seq: dict[int, Any] = {}
        if not replay.gap:
            for entry in replay.entries:
                try:
                    by_seq[entry.seq] = payload.FromString(entry.data)
                except DecodeError:
                    continue
        await catchup.merge(by_seq, after=since)
        missed = [by_seq[seq] for seq in sorted(by_seq)]
        for item in missed:
            catchup.sent(item)
        return missed, replay.gap

    def _note(self, session: str, entry: LogEntry, message: Message | None) -> None:
        pending = self._pending.get(session)
        if pending is None:
            pending = self._pending[session] = {}
        key = (entry.kind, entry.key)
        pending.pop(key, None)  # re-inserted last: the dict stays in seq order
        pending[key] = (entry, message)
        if len(pending) > MAX_PENDING:
            del pending[next(iter(pending))]
        if session not in self._cooling and session not in self._writing:
            self._start(session)

    # ---- writing -----------------------------------------------------------------------------

    def _start(self, session: str) -> None:
        """The write-behind of the session's queued states: at once when it was idle, else when
        its `write_s` is over. Where the store commits inline it joins the group commit of the
        loop's next turn (one transaction for every session written then), else a task writes it."""
        self._cooling.pop(session, None)
        if not self._pending.get(session):
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a synchronous caller): nothing can write
            self._pending.pop(session)
            self.write_failures += 1
            return
        if self._tasks.closed:  # stamped after shutdown wrote the log: live delivery goes on, unkept
            self._pending.pop(session)
            self.write_failures += 1
            return
        if self.store.log_inline:
            self._together([session])
            return
        batch = self._pending.pop(session)
        self._writing[session] = batch
        self._done[session] = asyncio.Event()
        self._tasks.spawn(self._write(session, batch), name="uibus-log-write")

    async def _write(self, session: str, batch: _Batch) -> None:
        try:
            entries = _entries(batch)
            await self.store.log_append(session, entries, self.retention)
            self.appended += len(entries)
            self.commits += 1
        except (StoreUnavailable, StoreFull):
            self.write_failures += 1
            self._requeue(session, batch)
        except Exception as exc:  # a bug of ours must not stop the session's writes
            self.write_failures += 1
            log.error("session log not written", exc_info=exc, extra={"fields": {"session": session}})
        finally:
            self._writing.pop(session, None)
            done = self._done.pop(session, None)
            if done is not None:
                done.set()
        self._cooling[session] = asyncio.get_running_loop().call_later(self.write_s, self._start, session)

    def _together(self, sessions: list[str]) -> asyncio.Future[set[str]]:
        """Group commit, where the store commits inline: the sessions join the transaction made
        at the loop's next turn, which every caller that asks during this turn shares (100
        concurrent acknowledgements cost two commits, not 100). The future's result: the sessions
        whose states could not be committed (still queued for the write-behind)."""
        self._group.update(sessions)
        done = self._group_done
        if done is None:
            loop = asyncio.get_running_loop()
            done = self._group_done = loop.create_future()
            loop.call_soon(self._commit_group)
        return done

    def _commit_group(self) -> None:
        done, self._group_done = self._group_done, None
        group, self._group = self._group, set()
        failed = self._commit_sessions(group)
        if done is not None and not done.done():
            done.set_result(failed)

    def _turn_over(self) -> None:
        self._committed_this_turn = False

    def _commit_sessions(self, sessions: set[str] | list[str]) -> set[str]:
        """Commits the sessions' queued states in one transaction, now; the sessions that failed
        (their states queued again for the write-behind, which tries after `write_s`)."""
        batches = {s: self._pending.pop(s) for s in sessions if self._pending.get(s)}
        if not batches:
            return set()
        failed = self._commit(batches)
        loop = asyncio.get_running_loop()
        for session in batches:
            if session not in self._cooling:  # as after every write: the write-behind waits `write_s`
                self._cooling[session] = loop.call_later(self.write_s, self._start, session)
        return failed

    def _commit(self, batches: dict[str, _Batch]) -> set[str]:
        """Writes the sessions' batches in one transaction; the sessions that failed (requeued)."""
        try:
            written = {session: _entries(batch) for session, batch in batches.items()}
            self.store.log_append_many(written, self.retention)
            self.appended += sum(len(entries) for entries in written.values())
            self.commits += 1
            return set()
        except (StoreUnavailable, StoreFull):  # kept queued: the write-behind tries again after `write_s`
            self.write_failures += 1
            for session, batch in batches.items():
                self._requeue(session, batch)
            return set(batches)
        except Exception as exc:  # a bug of ours must not stop the session's writes, nor other sessions'
            if len(batches) > 1:
                failed: set[str] = set()
                for session, batch in batches.items():
                    failed |= self._commit({session: batch})
                return failed
            self.write_failures += 1
            log.error("session log not written", exc_info=exc, extra={"fields": {"session": next(iter(batches))}})
            return set(batches)

    def _requeue(self, session: str, batch: _Batch) -> None:
        """A failed batch goes back before what was noted since (newer states of a key win)."""
        newer = self._pending.get(session, {})
        merged = {k: v for k, v in batch.items() if k not in newer}
        merged.update(newer)
        while len(merged) > MAX_PENDING:
            del merged[next(iter(merged))]
        self._pending[session] = merged

    async def flush(self, session: str | None = None) -> None:
        """Waits until what was stamped (for `session`, or every session) is committed, writing
        it now instead of at the end of the interval (with every other caller waiting at once,
        where the store commits inline). Raises nothing: a store that fails keeps the states
        queued (and says so on its health)."""
        if self.store.log_inline and not self._tasks.closed:
            await self._flush_inline([session] if session is not None else list({*self._pending, *self._writing}))
            return
        while True:
            sessions = [session] if session is not None else list({*self._pending, *self._writing})
            busy = False
            for s in sessions:
                if s in self._writing:
                    busy = True
                    await self._done[s].wait() if s in self._done else asyncio.sleep(0)
                elif s in self._pending:
                    timer = self._cooling.pop(s, None)
                    if timer is not None:
                        timer.cancel()
                    self._start(s)
                    busy = s in self._writing
                    if busy:
                        await self._done[s].wait()
                    if s in self._pending and self.store.problem:  # failing: do not spin
                        return
            if not busy:
                return

    async def _flush_inline(self, sessions: list[str]) -> None:
        """`flush` on a store that commits inline (its write-behind never runs as a task: see
        `_start`): the first acknowledgement of a turn of the loop commits at once, so a lone
        caller waits for no loop turn; any other in the same turn joins the next turn's group."""
        waiting = [s for s in sessions if self._pending.get(s)]
        if not waiting:
            return
        if not self._committed_this_turn:
            self._committed_this_turn = True
            asyncio.get_running_loop().call_soon(self._turn_over)
            self._commit_sessions(waiting)
        else:
            await asyncio.shield(self._together(waiting))

    async def aclose(self) -> None:
        """Writes what is pending, then stops (the store closes after this)."""
        await self.flush()
        for timer in self._cooling.values():
            timer.cancel()
        self._cooling.clear()
        await self._tasks.aclose()

    # ---- reading -----------------------------------------------------------------------------

    async def read(self, session: str, after: int = 0, *, kind: str = "", last: int = 0) -> Replay:
        """The session's entries after `after` (of `kind`, when given): the store's, overridden by
        what this process stamped and has not committed yet; `gap` when retention dropped entries
        after the cursor."""
        stored = await self.store.log_read(session, after, kind=kind, last=last)
        by_key: dict[tuple[str, str], LogEntry] = {(e.kind, e.key): e for e in stored.entries}
        for batch in (self._writing.get(session), self._pending.get(session)):  # read after the await
            if batch:
                for key, (entry, message) in batch.items():
                    if entry.seq > after and (not kind or entry.kind == kind):
                        if message is not None and not entry.data:
                            entry = LogEntry(entry.seq, entry.kind, entry.key, entry.epoch, entry.at,
                                             message.SerializeToString())
                        by_key[key] = entry
        entries = sorted(by_key.values(), key=lambda e: e.seq)
        if last > 0:
            entries = entries[-last:]
        head = max(self._head(session).seq, entries[-1].seq if entries else 0)
        return Replay(entries, gap=0 < after < stored.floor, head=head)

    def head(self, session: str) -> int:
        """The last seq stamped on this process for the session (0: none yet)."""
        head = self._heads.get(session)
        return head.seq if head is not None else 0

    async def forget(self, session: str) -> None:
        """The session is being deleted: its unwritten states and its head go, after a write in
        flight has landed (not cancelled: a store write is atomic), so no write lands behind the
        delete and brings the session back with its messages (DeleteSession is final)."""
        self._pending.pop(session, None)
        while (done := self._done.get(session)) is not None:
            await done.wait()
            self._pending.pop(session, None)
        timer = self._cooling.pop(session, None)
        if timer is not None:
            timer.cancel()
        self._pending.pop(session, None)
        self._heads.pop(session, None)

"""Waiting extension-UI dialogs, shared through the session store so a UI on any replica sees them.

With Redis, a dialog lives in the replica its agent called (its holder), and a UI that subscribes
on another replica cannot read the holder's memory. So the holder writes each waiting dialog to
the session store, key `extui/pending/<id>` = {holder, deadline_ms, seq, request}, and removes it when
the dialog closes (answer, timeout, caller gone, shutdown); a UI stream replays the entries other
replicas hold (uibus.domain.dialogs). The order of the writes is what makes the replay exact,
without locks:

* the entry is written before the dialog's request is published, so a UI that subscribed too late
  for the live request finds the entry (a UI stream subscribes first, then reads the store);
* the entry is removed before the dialog's closed event is published, so a UI that subscribed
  too late for the closed event no longer finds the entry;
* a request that reaches a UI both ways (published after it subscribed, read before it was
  removed) is passed on once: the stream skips live requests it has already replayed.

A crashed replica leaves its entries behind, and they must not be replayed forever. The holder
listens for answers forwarded to the session (presence kind EXT_UI_ANSWER) from before it writes
an entry until after it removes it, and its heartbeats keep that announcement fresh; so an entry
is replayed only while its holder's announcement is fresh (a crashed replica's expires after three
heartbeats, 15 s by default) and, for a dialog with a timeout, before its deadline. A dialog
without a timeout therefore needs no lifetime of its own: it stays visible exactly as long as its
holder lives. Readers delete the entries they find dead.

The entry goes to the store directly, the holder's announcement through the bus's outbox, so a
reader can find a fresh entry before the announcement has reached it. Such an entry is not
replayed (nor deleted, unless old): this replica would forward an answer to it nowhere (a
presence kind is sent only to replicas known to listen) and tell the UI NOT_FOUND for a dialog it
has just shown. Nothing is lost: the reader subscribed and completed the shard before reading, and
the holder publishes the live request after its announcement, on the same channel, so the
request reaches the UI live, after the reader knows whom to forward answers to.

Store writes never fail a dialog and wait at most `STORE_WAIT_S`: when Redis is down the bus does
not replicate either, so only this replica's UIs see the dialog, and they read memory. A delete
that fails is retried in the background until it succeeds or the replica stops. Single-process
uibus (no Redis) keeps nothing here: memory is exact there, and entries in the SQLite file would
outlive the only process that could answer them.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from google.protobuf.message import DecodeError

from uibus.infra import kinds
from uibus.infra.bus import Bus
from uibus.infra.retry import Backoff
from uibus.infra.store import Store
from uibus.infra.tasks import Tasks, cancel_and_wait
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

log = logging.getLogger("uibus.dialogs")

KEY = "extui/pending/"  # + dialog id
STORE_WAIT_S = 1.0  # the longest a dialog's request or closed event waits for its store write
# An entry whose holder is not (or no longer) announced is dead only once it is older than this:
# a fresh entry may be read before the holder's announcement has crossed Redis (it is skipped,
# not deleted), and a replica hears of a crash only when the announcement expires (three
# heartbeats, 15 s by default).
UNHEARD_GRACE_MS = 30_000
# An entry this long past its deadline is dead whatever its holder: the holder's timer closes the
# dialog at the deadline and removes the entry (the margin covers clocks that differ).
PAST_DEADLINE_MS = 60_000


class SharedDialogs:
    """This replica's waiting dialogs in the shared store, and the other replicas' as read there."""

    def __init__(self, bus: Bus, store: Store) -> None:
        self.bus = bus
        self.store = store
        self.replica = bus.replica_id
        # bus.announced(origin, session, kind) -> bool | None (None: the bus cannot tell)
        self._announced = bus.announced
        self._tasks = Tasks("shared dialog writes")
        self._retry: dict[tuple[str, str], None] = {}  # (session, dialog id) whose delete failed, in order
        self._retrying: asyncio.Task[None] | None = None
        self._seq = itertools.count()  # orders this replica's dialogs opened within one millisecond

    async def put(self, session: str, request: pb.ExtensionUiRequest) -> None:
        """Writes the waiting dialog `request`; call before the request is published."""
        entry = {"holder": self.replica, "deadline_ms": request.expires_at_ms, "seq": next(self._seq),
                 "request": base64.b64encode(request.SerializeToString()).decode()}
        try:
            async with asyncio.timeout(STORE_WAIT_S):
                await self.store.put(session, KEY + request.id, entry)
        except Exception as exc:  # an outage or a stall: the dialog goes on, visible to live UIs
            log.warning("waiting dialog not shared: UIs joining on other replicas will not see it",
                        extra={"fields": {"session": session, "dialog": request.id, "error": repr(exc)}})

    def remove(self, session: str, dialog_id: str, then: Callable[[], None] | None = None) -> None:
        """Deletes the entry of `dialog_id` in the background, then calls `then` (which publishes the
        closed event); `then` runs even if the delete fails or takes longer than STORE_WAIT_S."""
        self._spawn(self._remove(session, dialog_id, then))

    async def _remove(self, session: str, dialog_id: str, then: Callable[[], None] | None) -> None:
        try:
            if not await self._delete(session, dialog_id):
                self._retry[(session, dialog_id)] = None
                if (self._retrying is None or self._retrying.done()) and not self._tasks.closed:
                    self._retrying = asyncio.ensure_future(self._retry_loop())
        finally:
            if then is not None:
                then()

    async def _delete(self, session: str, dialog_id: str) -> bool:
        try:
            async with asyncio.timeout(STORE_WAIT_S):
                await self.store.put(session, KEY + dialog_id, None)
            return True
        except Exception as exc:  # an outage, a stall, a store closing: retried later
            log.debug("shared dialog entry not deleted yet", extra={"fields": {
                "session": session, "dialog": dialog_id, "error": repr(exc)}})
            return False

    async def _retry_loop(self) -> None:
        backoff = Backoff()  # uibus.infra.retry: longer while the store stays down, short again once it answers
        while self._retry:
            await backoff.wait()
            for session, dialog_id in list(self._retry):
                if not await self._delete(session, dialog_id):
                    break
                self._retry.pop((session, dialog_id), None)
                backoff.reset()

    async def holder_of(self, session: str, dialog_id: str) -> str | None:
        """The replica its entry names as holding `dialog_id` (an answer given here goes to it
        alone); None when there is no entry (closed, or never shared) or the store does not answer."""
        try:
            async with asyncio.timeout(STORE_WAIT_S):
                entry = await self.store.get(session, KEY + dialog_id)
        except Exception as exc:  # an outage or a stall: the answer goes to every listener instead
            log.debug("shared dialog entry not read", extra={"fields": {"session": session, "error": repr(exc)}})
            return None
        holder = entry.get("holder") if isinstance(entry, dict) else None
        return holder if isinstance(holder, str) and holder else None

    def others(self, session: str, kept: dict[str, Any]) -> list[pb.ExtensionUiRequest]:
        """The requests of the dialogs other replicas hold and still wait on, oldest first, read from
        `kept` (the session's store entries under extui/); entries found dead are deleted in the
        background.

        This replica's own entries are skipped: its memory is exact (an entry of its own that is
        not in memory is a dialog closing, or one about to be published live)."""
        now_ms = int(time.time() * 1000)
        found: list[tuple[int, str, int, pb.ExtensionUiRequest]] = []
        for key, entry in kept.items():
            if not key.startswith(KEY):
                continue
            try:
                holder = str(entry["holder"])
                deadline = int(entry.get("deadline_ms") or 0)
                seq = int(entry.get("seq") or 0)
                request = pb.ExtensionUiRequest.FromString(base64.b64decode(entry["request"]))
            except (KeyError, TypeError, ValueError, AttributeError, DecodeError):
                continue  # not an entry this version can read: leave it to the one that wrote it
            if holder == self.replica:
                continue
            if self._dead(holder, session, request.ts, deadline, now_ms):
                self.remove(session, key[len(KEY):])
                continue
            if self._announced(holder, session, kinds.EXT_UI_ANSWER) is False:
                continue  # its holder is not heard yet: an answer could not be forwarded (see above)
            if deadline and now_ms >= deadline:
                continue  # its holder's timer is closing it
            found.append((request.ts, holder, seq, request))
        found.sort(key=lambda f: f[:3])
        return [f[3] for f in found]

    def _dead(self, holder: str, session: str, ts: int, deadline: int, now_ms: int) -> bool:
        if deadline and now_ms > deadline + PAST_DEADLINE_MS:
            return True
        if now_ms - ts < UNHEARD_GRACE_MS:
            return False
        return self._announced(holder, session, kinds.EXT_UI_ANSWER) is False

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        if self._tasks.closed:  # shutdown: the entry expires with its deadline instead
            work.close()
            return
        self._tasks.spawn(work, name="uibus-shared-dialog")

    async def aclose(self, wait_s: float = 2 * STORE_WAIT_S) -> None:
        """Lets the pending writes finish (briefly), then stops retrying. Call before the store and
        the bus close, so the closed events of shutdown still reach the other replicas."""
        await self._tasks.aclose(grace=wait_s)
        retrying, self._retrying = self._retrying, None
        await cancel_and_wait(retrying)

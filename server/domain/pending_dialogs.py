"""The open extension-UI dialogs of every session: a registry the domain's `Dialogs` asks through.

A waiting dialog is one asyncio future here, keyed by dialog id. It is closed exactly once, by
whichever comes first — a UI's answer, its timer, the agent's call ending, or shutdown — and
closing is synchronous (no await between "is it still open?" and "resolve it"), which is what
makes "first answer wins" hold without locks. Closing removes every trace of the dialog from the
open maps, cancels its timer, stamps its close into the session log and tells every UI of the
session through the bus; only a bounded memory of recently closed ids stays, so a late answer can
be told "already answered" apart from "unknown". A module of its own because holding the open
dialogs (limits, timers, the one close) is a job apart from the protocol's behaviour around them
(asking, fire-and-forget events, answers, the UI's stream: uibus.domain.dialogs).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uibus.domain.session_log import SessionLog
from uibus.infra import kinds
from uibus.infra.bus import Bus
from uibus.infra.errors import ResourceExhausted, Unavailable
from uibus.infra.sharing import Sharing
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

ANSWERED = pb.DIALOG_OUTCOME_ANSWERED
CANCELLED = pb.DIALOG_OUTCOME_CANCELLED
TIMED_OUT = pb.DIALOG_OUTCOME_TIMED_OUT
CALLER_CANCELLED = pb.DIALOG_OUTCOME_CALLER_CANCELLED
SHUTDOWN = pb.DIALOG_OUTCOME_SHUTDOWN

MAX_PENDING_PER_SESSION = 256


class TooManyDialogs(ResourceExhausted):
    """The session already has as many dialogs waiting as allowed."""


class ShuttingDown(Unavailable):
    """The server is shutting down and opens no new dialogs."""


@dataclass(frozen=True, slots=True)
class Answer:
    outcome: int
    value: str | None = None
    confirmed: bool = False


@dataclass(slots=True, eq=False)
class Dialog:
    id: str
    session: str
    method: str  # the ExtensionUiRequest oneof field: select, confirm, input, editor
    request: pb.ExtensionUiRequest
    future: asyncio.Future[Answer]
    options: frozenset[str] | None = None  # select only: the answers a UI may give
    timer: asyncio.TimerHandle | None = None
    timeout_ms: int = 0
    answered_by: list[str] | None = None  # with tracing on: [transport, identity] of the UI's call


EXT_UI = "ext_ui"  # the kind of extension-UI events in the session log


class PendingDialogs:
    """The open dialogs of every session, and a bounded memory of closed ones."""

    def __init__(self, bus: Bus, sharing: Sharing, max_per_session: int = MAX_PENDING_PER_SESSION,
                 remember: int = 4096, log: SessionLog | None = None,
                 on_change: Callable[[], None] = lambda: None) -> None:
        """`on_change`: told when a dialog opens or closes here (the sessions API's watches re-list)."""
        self.bus = bus
        self.log = log  # the session log: every event a UI gets is stamped and kept there first
        self.sharing = sharing  # closing unshares the dialog (with Redis: its store entry) before telling UIs
        self.max_per_session = max_per_session
        self._remember = remember
        self._open: dict[str, Dialog] = {}
        self._by_session: dict[str, dict[str, Dialog]] = {}  # insertion order = replay order
        self._closed: OrderedDict[str, tuple[str, int]] = OrderedDict()  # id -> (session, outcome)
        self.closing = False
        self.on_change = on_change

    def count(self, session: str | None = None) -> int:
        if session is None:
            return len(self._open)
        return len(self._by_session.get(session, ()))

    def _admit(self, session: str) -> None:
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        waiting = self._by_session.get(session)
        if waiting is not None and len(waiting) >= self.max_per_session:
            raise TooManyDialogs(f"session {session!r} already has {len(waiting)} dialogs waiting for an "
                                 f"answer (limit {self.max_per_session})")

    def prepare(self, session: str, method: str, payload: Any, timeout_ms: int = 0,
                options: frozenset[str] | None = None) -> Dialog:
        """A new dialog with its id and request, checked against the limits but not yet waiting."""
        self._admit(session)
        dialog_id = str(uuid.uuid4())
        now_ms = int(time.time() * 1000)
        request = pb.ExtensionUiRequest(id=dialog_id, ts=now_ms,
                                        expires_at_ms=now_ms + timeout_ms if timeout_ms else 0,
                                        **{method: payload})
        return Dialog(dialog_id, session, method, request, asyncio.get_running_loop().create_future(), options,
                      timeout_ms=timeout_ms)

    def open(self, dialog: Dialog) -> None:
        """Registers a prepared dialog, arms its timer and publishes it to the session's UIs (the
        limits are checked again: other dialogs may have opened since `prepare`)."""
        self._admit(dialog.session)
        if dialog.timeout_ms:
            dialog.timer = asyncio.get_running_loop().call_later(dialog.timeout_ms / 1000, self.close, dialog,
                                                                 TIMED_OUT)
        self._open[dialog.id] = dialog
        self._by_session.setdefault(dialog.session, {})[dialog.id] = dialog
        event = pb.ExtensionUiEvent(request=dialog.request)
        if self.log is not None:
            self.log.stamp_event(dialog.session, EXT_UI, dialog.id, event)
        self.bus.publish(dialog.session, kinds.EXTENSION_UI, event, key=dialog.id)
        self.on_change()

    async def wait(self, dialog: Dialog) -> Answer:
        """The dialog's answer; if the caller goes away first, the dialog closes for every UI."""
        try:
            return await dialog.future
        finally:
            self.close(dialog, CALLER_CANCELLED)  # no-op unless the call ended unanswered

    def close(self, dialog: Dialog, outcome: int, value: str | None = None, confirmed: bool = False) -> bool:
        """Resolves `dialog` with `outcome` unless it is already closed; True if this call closed it."""
        if self._open.pop(dialog.id, None) is None:
            return False
        waiting = self._by_session[dialog.session]
        del waiting[dialog.id]
        if not waiting:
            del self._by_session[dialog.session]
        if dialog.timer is not None:
            dialog.timer.cancel()
            dialog.timer = None
        closed = self._closed
        closed[dialog.id] = (dialog.session, outcome)
        if len(closed) > self._remember:
            closed.popitem(last=False)
        if not dialog.future.done():
            dialog.future.set_result(Answer(outcome, value, confirmed))
        session, event = dialog.session, pb.ExtensionUiEvent(closed=pb.DialogClosed(id=dialog.id, reason=outcome))
        if self.log is not None:
            self.log.stamp_event(session, EXT_UI, dialog.id, event)  # replaces the dialog's request
        # unshared first: a UI that subscribes after the event must not replay it from another replica
        self.sharing.unshare_dialog(session, dialog.id,
                                      lambda: self.bus.publish(session, kinds.EXTENSION_UI, event, key=dialog.id))
        self.on_change()
        return True

    def find(self, session: str, dialog_id: str) -> Dialog | None:
        """The open dialog `dialog_id` of `session`; dialogs of other sessions are invisible."""
        dialog = self._open.get(dialog_id)
        return dialog if dialog is not None and dialog.session == session else None

    def closed_outcome(self, session: str, dialog_id: str) -> int | None:
        """How a recently closed dialog of `session` ended, if it is still remembered."""
        entry = self._closed.get(dialog_id)
        return entry[1] if entry is not None and entry[0] == session else None

    def is_open(self, dialog: Dialog) -> bool:
        return dialog.id in self._open

    def waiting(self, session: str) -> list[Dialog]:
        """The session's open dialogs, oldest first (what a newly connected UI must see)."""
        return list(self._by_session.get(session, {}).values())

    def shutdown(self) -> None:
        """Refuse new dialogs and release every waiting caller at once."""
        self.closing = True
        for dialog in list(self._open.values()):
            self.close(dialog, SHUTDOWN)

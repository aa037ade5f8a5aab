"""Extension-UI dialogs: an agent asks, a UI of the session answers (protos/uibus/v1/extension_ui.proto;
docs/protocols/extension-ui.md).

`Dialogs` is the whole extension-UI behaviour, for every caller (the gRPC service, the CodeBolt
gateway): asking (select / confirm / input / editor, which wait for an answer), fire-and-forget
requests (notify, status, widget, title, editor text), answering, and the UI's event stream.

A waiting dialog is one asyncio future in `PendingDialogs` (uibus.domain.pending_dialogs), closed
exactly once, synchronously, so "first answer wins" holds without locks. Requests and closed
events reach the UIs through the bus (kind EXTENSION_UI); status, widgets and title are written
to the store before they are published, so a UI that subscribes later starts from the current
state.

A dialog lives in the process its agent called. This module applies answers given here to the
dialogs held here, nothing else: where an answer to a dialog held elsewhere goes is the edge's
business (uibus.replicas.placement asks `answer` here first, then the holder). What other processes
must see of the dialogs held here is told to the store/bus layer (`Sharing`, uibus.infra.sharing:
with Redis each waiting dialog is written to the shared store, so a UI subscribing on any replica
replays every waiting dialog of the session); the dialog is shared between `prepare` and `open`,
and its closed event is published once it is unshared (alone: at once).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from uibus.domain.feed import REPLAY_END
from uibus.domain.pending_dialogs import (
    ANSWERED,
    CALLER_CANCELLED,
    CANCELLED,
    EXT_UI,
    SHUTDOWN,
    TIMED_OUT,
    Answer,
    Dialog,
    PendingDialogs,
)
from uibus.domain.session_log import SessionLog
from uibus.infra import dialog_limits as checks
from uibus.infra import kinds, telemetry
from uibus.infra.audit import NoAudit, Recorder
from uibus.infra.bus import LIVE, Bus, Live
from uibus.infra.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    UibusError,
    Unavailable,
)
from uibus.infra.replay import Catchup
from uibus.infra.sharing import LocalSharing, Sharing
from uibus.infra.store import Store
from uibus.infra.telemetry import spans
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

MAX_STATE_KEYS = 256  # status entries and widgets per session
# A UI stream must not lose dialog requests to a burst of status updates; 1024 holds every
# pending dialog of a session (request + closed) with room to spare, and at the bound a closed
# event replaces its own request and a newer status replaces an older one of the same key.
UI_QUEUE = 1024
# Store keys: extui/title, extui/status/<key>, extui/widget/<key>, and with Redis the waiting
# dialogs, extui/pending/<id> (uibus.replicas.dialog_sharing): one scan of PREFIX reads them all.
PREFIX = "extui/"
STATUS = PREFIX + "status/"
WIDGET = PREFIX + "widget/"
TITLE = PREFIX + "title"
_CLOSED_HOW = {TIMED_OUT: "timed out", CALLER_CANCELLED: "was cancelled by the agent that asked it",
               SHUTDOWN: "was closed by the server shutting down"}
# How each dialog is checked, and the name the protocol gives it (the ExtensionUiRequest field).
_ASK: dict[type[Any], tuple[str, Callable[[Any], str | None]]] = {
    pb.SelectRequest: ("select", checks.check_select),
    pb.ConfirmRequest: ("confirm", checks.check_confirm),
    pb.InputRequest: ("input", checks.check_input),
    pb.EditorRequest: ("editor", checks.check_editor),
}
DialogRequest = pb.SelectRequest | pb.ConfirmRequest | pb.InputRequest | pb.EditorRequest
_DIALOG_METHODS = frozenset(method for method, _ in _ASK.values())  # the requests that wait for an answer


@dataclass(frozen=True, slots=True)
class Verdict:
    """What became of an answer: taken (error None), refused (error), or the dialog is not held
    here (`unknown`: another process may hold it)."""
    error: UibusError | None = None
    unknown: bool = False


def _event(replayed: bool = False, **method: Any) -> pb.ExtensionUiEvent:
    return pb.ExtensionUiEvent(request=pb.ExtensionUiRequest(
        id=str(uuid.uuid4()), ts=int(time.time() * 1000), replayed=replayed, **method))


def state_events(state: dict[str, Any]) -> list[pb.ExtensionUiEvent]:
    """The kept title, statuses and widgets of a session as replayed requests."""
    events = []
    title = state.get(TITLE)
    if title:
        events.append(_event(True, set_title=pb.SetTitleRequest(title=title)))
    for key, value in state.items():
        if key.startswith(STATUS):
            events.append(_event(True, set_status=pb.SetStatusRequest(key=key[len(STATUS):], text=value)))
    for key, value in state.items():
        if key.startswith(WIDGET):
            events.append(_event(True, set_widget=pb.SetWidgetRequest(
                key=key[len(WIDGET):], lines=value["lines"], placement=value["placement"])))
    return events


class Dialogs:
    def __init__(self, bus: Bus, store: Store, sharing: Sharing | None = None, queue_size: int = UI_QUEUE, *,
                 log: SessionLog | None = None, on_change: Callable[[], None] = lambda: None,
                 observe_wait: Callable[[str, str, float], None] | None = None, audit: Recorder | None = None) -> None:
        """`sharing`: where the waiting dialogs are told, for other processes' UIs (none: alone);
        `audit`: where each answer is recorded, by whom (uibus.infra.audit: approvals and denials);
        `log`: the session log the UIs' events are stamped into (resumable streams; without one
        events carry no seq); `on_change`: told when a dialog opens or closes; `observe_wait(kind,
        outcome, seconds)`: how long each dialog waited for a person (/metrics)."""
        self.bus = bus
        self.store = store
        self.log = log
        self.sharing: Sharing = sharing if sharing is not None else LocalSharing()
        self.pending = PendingDialogs(bus, self.sharing, log=log, on_change=on_change)
        self.ui_queue = max(UI_QUEUE, queue_size)
        self.observe_wait = observe_wait
        self.audit: Recorder = audit if audit is not None else NoAudit()

    def count(self, session: str | None = None) -> int:
        """Dialogs waiting for an answer (of one session, or of all)."""
        return self.pending.count(session)

    def shutdown(self) -> None:
        """Refuse new dialogs and release every waiting agent (answered "shutdown")."""
        self.pending.shutdown()
        self.sharing.close_dialogs()

    async def aclose(self) -> None:
        """After `shutdown`, before the bus and the store close: lets the last store writes and
        closed events go out, so other replicas neither replay nor keep showing these dialogs."""
        await self.sharing.aclose_dialogs()

    # ---- agents: dialogs ----

    async def ask(self, session: str, request: DialogRequest) -> pb.DialogResult:
        """Shows the dialog to the session's UIs and waits for its outcome.

        Cancelling the awaiting task closes the dialog for every UI at once.
        """
        method, check = _ASK[type(request)]
        problem = check(request)
        if problem:
            raise InvalidArgument(f"{method}: {problem}")
        options = frozenset(request.options) if isinstance(request, pb.SelectRequest) else None
        dialog = self.pending.prepare(session, method, request, checks.timeout_of(request), options)
        traced = telemetry.tracer is not None
        span = spans.dialog_start(method, session, dialog.id, dialog.timeout_ms) if traced else None
        started = time.monotonic()
        sharing = self.sharing
        opened = False
        answer: Answer | None = None
        try:
            await sharing.share_dialog(session, dialog.request)  # before it is published: a late UI reads it
            self.pending.open(dialog)
            opened = True
            answer = await self.pending.wait(dialog)
        finally:
            if not opened:  # refused or cancelled before it opened
                sharing.unshare_dialog(session, dialog.id)
            sharing.dialog_done(session)
            if opened:
                self._waited(dialog, answer, time.monotonic() - started, span)
            elif span is not None:
                span.end()
        if answer.outcome == SHUTDOWN:
            raise Unavailable(f"the server is shutting down; dialog {dialog.id} was closed unanswered")
        result = pb.DialogResult(id=dialog.id, outcome=answer.outcome, confirmed=answer.confirmed)
        if answer.value is not None:
            result.value = answer.value
        return result

    def _waited(self, dialog: Dialog, answer: Answer | None, seconds: float, span: Any) -> None:
        """The human wait of one dialog that was shown: on /metrics, and as its span's end."""
        reason = pb.DialogOutcome.Name(answer.outcome if answer is not None else CALLER_CANCELLED)
        reason = reason.removeprefix("DIALOG_OUTCOME_")
        if self.observe_wait is not None:
            self.observe_wait(dialog.method, spans.outcome_name(reason), seconds)
        if span is not None:
            spans.dialog_end(span, reason, seconds,
                             dialog.answered_by if reason in ("ANSWERED", "CANCELLED") else None)

    # ---- agents: fire-and-forget ----

    async def _fire(self, session: str, key: Any, **method: Any) -> pb.FireReply:
        """Publishes a fire-and-forget event; the reply acknowledges it, so it is committed to the
        session's log first (a UI resuming later, anywhere, gets it)."""
        event = _event(**method)
        if self.log is not None:  # a status or widget replaces its key's older state; a notice is its own
            self.log.stamp_event(session, EXT_UI, "/".join(key) if key else event.request.id, event)
        n = self.bus.publish(session, kinds.EXTENSION_UI, event, key=key)
        await self.settled(session)
        return pb.FireReply(id=event.request.id, subscribers=n)

    async def settled(self, session: str) -> None:
        """Returns once the session's extension-UI events so far are in its log (group commit):
        awaited before a reply acknowledges one (a notice fired, a dialog answered)."""
        if self.log is not None:
            await self.log.flush(session)

    async def _keep(self, session: str, prefix: str, key: str, value: Any | None) -> None:
        """Stores one status/widget entry, refusing a new key beyond the per-session bound."""
        store = self.store
        if value is not None and await store.get(session, prefix + key) is None:
            kept = await store.scan(session, prefix)
            if len(kept) >= MAX_STATE_KEYS:
                raise ResourceExhausted(f"session {session!r} already keeps {len(kept)} {prefix.split('/')[1]} "
                                        f"entries (limit {MAX_STATE_KEYS}); clear one first")
        await store.put(session, prefix + key, value)

    @staticmethod
    def _check(name: str, problem: str | None) -> None:
        if problem:
            raise InvalidArgument(f"{name}: {problem}")

    async def notify(self, session: str, request: pb.NotifyRequest) -> pb.FireReply:
        self._check("notify", checks.check_notify(request))
        return await self._fire(session, None, notify=request)

    async def set_status(self, session: str, request: pb.SetStatusRequest) -> pb.FireReply:
        self._check("setStatus", checks.check_status(request))
        await self._keep(session, STATUS, request.key, request.text if request.HasField("text") else None)
        return await self._fire(session, ("status", request.key), set_status=request)

    async def set_widget(self, session: str, request: pb.SetWidgetRequest) -> pb.FireReply:
        self._check("setWidget", checks.check_widget(request))
        value = {"lines": list(request.lines), "placement": request.placement} if request.lines else None
        await self._keep(session, WIDGET, request.key, value)
        return await self._fire(session, ("widget", request.key), set_widget=request)

    async def set_title(self, session: str, request: pb.SetTitleRequest) -> pb.FireReply:
        self._check("setTitle", checks.check_title(request))
        await self.store.put(session, TITLE, request.title or None)
        return await self._fire(session, ("title",), set_title=request)

    async def set_editor_text(self, session: str, request: pb.SetEditorTextRequest) -> pb.FireReply:
        self._check("set_editor_text", checks.check_editor_text(request))
        return await self._fire(session, None, set_editor_text=request)

    # ---- UIs ----

    async def events(self, session: str, since: int | None = None,
                     mark_end: bool = False) -> AsyncIterator[pb.ExtensionUiEvent | Live | Any]:
        """`LIVE` once subscribed, kept state, then waiting dialogs (oldest first), then live events;
        with `mark_end`, the feed's `REPLAY_END` between the two (a multiplexing stream's cue).

        The subscription is taken before the waiting dialogs are listed, with no await between,
        so a dialog opened here at any moment reaches this UI exactly once. With Redis the
        dialogs other replicas hold are read from the store after subscribing (the same scan as
        the state); one published after the subscription may arrive both ways, so a live request
        already replayed is skipped (see uibus.replicas.dialog_sharing).
        """
        sub = self.bus.subscribe(session, kinds.EXTENSION_UI, maxsize=self.ui_queue)
        try:
            waiting = self.pending.waiting(session)
            await self.bus.ready(session)  # heard on every replica (and their dialogs' holders known) first
            yield LIVE  # subscribed: the pipeline sends the response headers now
            if since is not None and self.log is not None:
                await self._close_orphans(session)  # closes it makes reach `sub` and the log: sent once
                catchup: Catchup[pb.ExtensionUiEvent] = Catchup(sub)  # replay then live (uibus.infra.replay)
                missed, gap = await self.log.resume(session, since, EXT_UI, pb.ExtensionUiEvent, catchup)
                if not gap:  # exactly what came after the cursor, then live
                    for event in missed:
                        yield event
                    if mark_end:
                        yield REPLAY_END
                    async for event in catchup.live():  # what was replayed, queued meanwhile too: sent once
                        yield event
                    return
                yield pb.ExtensionUiEvent(gap=True)  # too old: the snapshot follows
            kept = await self.store.scan(session, PREFIX)
            for event in state_events(kept):
                yield event
            requests: list[tuple[pb.ExtensionUiRequest, Dialog | None]] = [(d.request, d) for d in waiting]
            elsewhere = self.sharing.dialogs_elsewhere(session, kept)
            if elsewhere:
                requests += [(request, None) for request in elsewhere]
                requests.sort(key=lambda pair: pair[0].ts)
            replayed: set[str] = set()
            for request, dialog in requests:
                if dialog is not None and not self.pending.is_open(dialog):
                    continue  # closed meanwhile: its closed event is (or will be) queued
                replay = pb.ExtensionUiEvent()
                replay.request.CopyFrom(request)
                replay.request.replayed = True
                replayed.add(request.id)
                yield replay
            if mark_end:
                yield REPLAY_END
            async for event in sub:
                if replayed:
                    which = event.WhichOneof("event")
                    dialog_id = event.request.id if which == "request" else event.closed.id
                    if dialog_id in replayed:
                        replayed.discard(dialog_id)
                        if which == "request":
                            continue  # already replayed
                yield event
        finally:
            self.bus.unsubscribe(sub)

    async def _close_orphans(self, session: str) -> None:
        """Closes the dialogs the session's log shows waiting that no process holds any more: their
        process was killed before it could close them (a graceful stop closes its dialogs). Without
        this a UI resuming from a cursor would be shown one as waiting (replayed from the log), or
        keep the one it saw before the crash, forever. Each is closed as SHUTDOWN in the log and to
        every UI of the session, so they all converge. Read on a resume (a reconnect), not per event:
        the log's extension-UI entries are bounded by its retention."""
        assert self.log is not None
        replay = await self.log.read(session, 0, kind=EXT_UI)
        waiting_in_log = []
        for entry in replay.entries:
            try:
                event = pb.ExtensionUiEvent.FromString(entry.data)
            except DecodeError:
                continue
            if event.HasField("request") and event.request.WhichOneof("method") in _DIALOG_METHODS:
                waiting_in_log.append(event.request.id)
        # held here (checked after the read: a dialog opens here before its request is logged) ...
        orphans = [d for d in waiting_in_log if self.pending.find(session, d) is None]
        if not orphans:
            return
        # ... or by a live replica (it shares a dialog before it is logged; a dead one's are not read)
        elsewhere = {request.id for request in await self.sharing.read_dialogs_elsewhere(session)}
        closed = False
        for dialog_id in orphans:
            if dialog_id in elsewhere or self.pending.find(session, dialog_id) is not None:
                continue
            event = pb.ExtensionUiEvent(closed=pb.DialogClosed(id=dialog_id, reason=SHUTDOWN))
            self.log.stamp_event(session, EXT_UI, dialog_id, event)
            self.bus.publish(session, kinds.EXTENSION_UI, event, key=dialog_id)
            closed = True
        if closed:
            await self.log.flush(session)

    async def answer(self, session: str, request: pb.RespondRequest) -> Verdict:
        """Applies an answer to a dialog held here and commits it: once this returns a taken answer,
        the dialog's close is in the log (acknowledged is durable), and in the audit log, by whom.
        `unknown` when no dialog of that id is held here. Refused (UNAVAILABLE) while the audit log
        cannot write: no approval goes unrecorded."""
        self.audit.ready()
        dialog = self.pending.find(session, request.id) if request.id else None
        verdict = self.verdict(session, request)
        if verdict.error is None and not verdict.unknown:
            await self.settled(session)
            if dialog is not None:
                await self.record_answer(session, request, dialog.request)
        return verdict

    async def record_answer(self, session: str, request: pb.RespondRequest,
                            asked: pb.ExtensionUiRequest | None, *, forwarded: bool = False) -> None:
        """The audit entry of an answer taken (here, or by the replica holding the dialog, `forwarded`):
        the dialog's kind, its question, the answer. Recorded once, where the answer was given."""
        kind = asked.WhichOneof("method") if asked is not None else None
        question = getattr(asked, kind) if kind else None
        how = request.WhichOneof("answer")
        detail: dict[str, str | bool | None] = {
            "dialog": request.id, "kind": kind or "", "title": getattr(question, "title", None),
            "message": getattr(question, "message", None) or getattr(question, "placeholder", None),
            "options": ", ".join(question.options) if kind == "select" else None}
        if how == "confirmed":
            detail["answer"] = "approved" if request.confirmed else "denied"
        elif how == "cancelled":
            detail["answer"] = "dismissed"
        else:
            detail["answer"], detail["value"] = "value", request.value
        if forwarded:
            detail["forwarded"] = True
        act = "dialog.approve" if how == "confirmed" and request.confirmed else \
            "dialog.deny" if how in ("confirmed", "cancelled") else "dialog.answer"
        await self.audit.record(act, session=session, **detail)

    async def respond(self, session: str, request: pb.RespondRequest) -> None:
        """Answers a dialog held here, raising what was wrong (NOT_FOUND when none is)."""
        verdict = await self.answer(session, request)
        if verdict.error is not None:
            raise verdict.error

    def verdict(self, session: str, request: pb.RespondRequest) -> Verdict:
        """Applies an answer if it fits the open dialog; else why not. Synchronous, so the first
        answer wins (an answer carried here from another process is applied the same way)."""
        if not request.id:
            return Verdict(InvalidArgument("id is required: the id of the extension_ui_request being answered"))
        kind = request.WhichOneof("answer")
        if kind is None:
            return Verdict(InvalidArgument(f"dialog {request.id}: answer with value, confirmed or cancelled"))
        dialog = self.pending.find(session, request.id)
        if dialog is None:
            outcome = self.pending.closed_outcome(session, request.id)
            if outcome == ANSWERED or outcome == CANCELLED:
                how = "answered" if outcome == ANSWERED else "dismissed"
                return Verdict(FailedPrecondition(f"dialog {request.id} was already {how} by a UI; "
                                                  "the first answer wins"))
            if outcome is not None:
                return Verdict(NotFound(f"dialog {request.id} {_CLOSED_HOW[outcome]}"))
            return Verdict(NotFound(f"no open dialog {request.id!r} in session {session!r}"), unknown=True)
        method = dialog.method
        if telemetry.tracer is not None:  # which UI answers (if this one's answer stands)
            dialog.answered_by = telemetry.caller()
        if kind == "cancelled":
            if not request.cancelled:
                return Verdict(InvalidArgument(f"dialog {request.id}: cancelled must be true; to answer, send "
                                               f"{'confirmed' if method == 'confirm' else 'value'}"))
            self.pending.close(dialog, CANCELLED)
        elif kind == "confirmed":
            if method != "confirm":
                return Verdict(InvalidArgument(f"dialog {request.id} is a {method}: answer it with value or "
                                               "cancelled"))
            self.pending.close(dialog, ANSWERED, confirmed=request.confirmed)
        else:
            value = request.value
            if method == "confirm":
                return Verdict(InvalidArgument(f"dialog {request.id} is a confirm: answer it with confirmed or "
                                               "cancelled"))
            if len(value) > checks.MAX_LONG_TEXT:
                return Verdict(InvalidArgument(f"value is {len(value)} characters long; the limit is "
                                               f"{checks.MAX_LONG_TEXT}"))
            if dialog.options is not None and value not in dialog.options:
                return Verdict(InvalidArgument(f"dialog {request.id}: {value[:80]!r} is not one of its options"))
            self.pending.close(dialog, ANSWERED, value=value)
        return Verdict()

    def stats(self, session: str) -> pb.ExtensionUiStats:
        return pb.ExtensionUiStats(pending_dialogs=self.pending.count(),
                                   session_pending_dialogs=self.pending.count(session),
                                   session_ui_streams=self.bus.count(kinds.EXTENSION_UI, session))

"""uibus.v1.ExtensionUiService: the extension-UI sub-protocol of the RPC mode over gRPC (SPEC.md §3).

Dialog calls park on an asyncio future in `PendingDialogs`; requests and dialog-closed events
reach the UIs through the bus (kind `extension_ui`), so delivery costs one queue append per UI.
Status, widgets and title are written to the session store before they are published, so a UI
that subscribes later starts from the current state.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from uibus import topics
from uibus.bus import BusClosed, SubscriptionLimit
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc
from uibus.services import ext_ui_checks as checks
from uibus.services.common import Runtime
from uibus.services.ext_ui_dialogs import (
    ANSWERED,
    CANCELLED,
    SHUTDOWN,
    Dialog,
    PendingDialogs,
    ShuttingDown,
    TooManyDialogs,
)
from uibus.services.ext_ui_forward import AnswerForwarding, Verdict
from uibus.session import session_of

MAX_PENDING_PER_SESSION = 256
MAX_STATE_KEYS = 256  # status entries and widgets per session
# A UI stream must not lose dialog requests to a burst of status updates; 1024 holds every
# pending dialog of a session (request + closed) with room to spare, and at the bound a closed
# event replaces its own request and a newer status replaces an older one of the same key.
UI_QUEUE = 1024
STATUS = topics.EXT_UI_PREFIX + "status/"
WIDGET = topics.EXT_UI_PREFIX + "widget/"
TITLE = topics.EXT_UI_PREFIX + "title"
_CLOSED_HOW = {
    pb.DIALOG_OUTCOME_TIMED_OUT: "timed out",
    pb.DIALOG_OUTCOME_CALLER_CANCELLED: "was cancelled by the agent that asked it",
    pb.DIALOG_OUTCOME_SHUTDOWN: "was closed by the server shutting down",
}


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


class ExtensionUiService(extension_ui_pb2_grpc.ExtensionUiServiceServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.dialogs = PendingDialogs(rt.bus, MAX_PENDING_PER_SESSION)
        self.ui_queue = max(UI_QUEUE, rt.config.queue_size)
        rt.on_shutdown.append(self.dialogs.shutdown)
        # With a replicated bus, answers given on other replicas are forwarded to this one.
        self.forwarding = AnswerForwarding(rt.bus, self._verdict) if rt.bus.replicated else None

    # ---- agent side: dialogs ----

    async def _ask(self, context: grpc.aio.ServicerContext, method: str, request: Any,
                   check: Callable[[Any], str | None], options: frozenset[str] | None = None) -> pb.DialogResult:
        session = await session_of(context)
        problem = check(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {problem}")
        dialog: Dialog | None = None
        refusal: tuple[grpc.StatusCode, str] | None = None
        try:
            dialog = self.dialogs.open(session, method, request, checks.timeout_of(request), options)
        except TooManyDialogs as exc:
            refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ShuttingDown as exc:
            refusal = (grpc.StatusCode.UNAVAILABLE, str(exc))
        if dialog is None:
            assert refusal is not None
            await context.abort(*refusal)
        if self.forwarding is not None:
            self.forwarding.hold(session)
        try:
            answer = await self.dialogs.wait(dialog)
        finally:
            if self.forwarding is not None:
                self.forwarding.release(session, self.dialogs.count(session))
        if answer.outcome == SHUTDOWN:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the server is shutting down; dialog {dialog.id} was closed unanswered")
        result = pb.DialogResult(id=dialog.id, outcome=answer.outcome, confirmed=answer.confirmed)
        if answer.value is not None:
            result.value = answer.value
        return result

    async def Select(self, request: pb.SelectRequest, context: grpc.aio.ServicerContext) -> pb.DialogResult:
        return await self._ask(context, "select", request, checks.check_select, frozenset(request.options))

    async def Confirm(self, request: pb.ConfirmRequest, context: grpc.aio.ServicerContext) -> pb.DialogResult:
        return await self._ask(context, "confirm", request, checks.check_confirm)

    async def Input(self, request: pb.InputRequest, context: grpc.aio.ServicerContext) -> pb.DialogResult:
        return await self._ask(context, "input", request, checks.check_input)

    async def Editor(self, request: pb.EditorRequest, context: grpc.aio.ServicerContext) -> pb.DialogResult:
        return await self._ask(context, "editor", request, checks.check_editor)

    # ---- agent side: fire-and-forget ----

    async def _fire(self, context: grpc.aio.ServicerContext, session: str, key: Any, **method: Any) -> pb.FireReply:
        event = _event(**method)
        n = self.rt.bus.publish(session, topics.EXTENSION_UI, event, key=key)
        return pb.FireReply(id=event.request.id, subscribers=n)

    async def _checked(self, context: grpc.aio.ServicerContext, name: str, problem: str | None) -> str:
        session = await session_of(context)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {problem}")
        return session

    async def _keep(self, context: grpc.aio.ServicerContext, session: str, prefix: str, key: str,
                    value: Any | None) -> None:
        """Stores one status/widget entry, refusing a new key beyond the per-session bound."""
        store = self.rt.store
        if value is not None and await store.get(session, prefix + key) is None:
            kept = await store.scan(session, prefix)
            if len(kept) >= MAX_STATE_KEYS:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"session {session!r} already keeps {len(kept)} {prefix.split('/')[1]} "
                                    f"entries (limit {MAX_STATE_KEYS}); clear one first")
        await store.put(session, prefix + key, value)

    async def Notify(self, request: pb.NotifyRequest, context: grpc.aio.ServicerContext) -> pb.FireReply:
        session = await self._checked(context, "notify", checks.check_notify(request))
        return await self._fire(context, session, None, notify=request)

    async def SetStatus(self, request: pb.SetStatusRequest, context: grpc.aio.ServicerContext) -> pb.FireReply:
        session = await self._checked(context, "setStatus", checks.check_status(request))
        await self._keep(context, session, STATUS, request.key,
                         request.text if request.HasField("text") else None)
        return await self._fire(context, session, ("status", request.key), set_status=request)

    async def SetWidget(self, request: pb.SetWidgetRequest, context: grpc.aio.ServicerContext) -> pb.FireReply:
        session = await self._checked(context, "setWidget", checks.check_widget(request))
        value = {"lines": list(request.lines), "placement": request.placement} if request.lines else None
        await self._keep(context, session, WIDGET, request.key, value)
        return await self._fire(context, session, ("widget", request.key), set_widget=request)

    async def SetTitle(self, request: pb.SetTitleRequest, context: grpc.aio.ServicerContext) -> pb.FireReply:
        session = await self._checked(context, "setTitle", checks.check_title(request))
        await self.rt.store.put(session, TITLE, request.title or None)
        return await self._fire(context, session, ("title",), set_title=request)

    async def SetEditorText(self, request: pb.SetEditorTextRequest,
                            context: grpc.aio.ServicerContext) -> pb.FireReply:
        session = await self._checked(context, "set_editor_text", checks.check_editor_text(request))
        return await self._fire(context, session, None, set_editor_text=request)

    # ---- UI side ----

    async def Subscribe(self, request: pb.SubscribeRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ExtensionUiEvent]:
        """Kept state, then waiting dialogs, then live events.

        The subscription is taken before the waiting dialogs are listed, with no await between,
        so a dialog opened at any moment reaches this UI exactly once.
        """
        session = await session_of(context)
        bus = self.rt.bus
        try:
            sub = bus.subscribe(session, topics.EXTENSION_UI, maxsize=self.ui_queue)
        except SubscriptionLimit as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except BusClosed as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        try:
            waiting = self.dialogs.waiting(session)
            for event in state_events(await self.rt.store.scan(session, topics.EXT_UI_PREFIX)):
                yield event
            for dialog in waiting:
                if self.dialogs.is_open(dialog):  # else its closed event is already queued
                    replay = pb.ExtensionUiEvent()
                    replay.request.CopyFrom(dialog.request)
                    replay.request.replayed = True
                    yield replay
            async for event in sub:
                yield event
        finally:
            bus.unsubscribe(sub)

    async def Respond(self, request: pb.RespondRequest, context: grpc.aio.ServicerContext) -> pb.RespondReply:
        session = await session_of(context)
        code, details, unknown = self._verdict(session, request)
        if unknown and self.forwarding is not None:  # perhaps another replica holds it
            code, details, unknown = await self.forwarding.forward(session, request)
        if code is not None:
            await context.abort(code, details)
        return pb.RespondReply()

    def _verdict(self, session: str, request: pb.RespondRequest) -> Verdict:
        """Applies an answer if it fits the open dialog; else why not. Synchronous, so the first
        answer wins; also used for answers forwarded from other replicas."""
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not request.id:
            return bad, "id is required: the id of the extension_ui_request being answered", False
        kind = request.WhichOneof("answer")
        if kind is None:
            return bad, f"dialog {request.id}: answer with value, confirmed or cancelled", False
        dialog = self.dialogs.find(session, request.id)
        if dialog is None:
            outcome = self.dialogs.closed_outcome(session, request.id)
            if outcome == ANSWERED or outcome == CANCELLED:
                return (grpc.StatusCode.FAILED_PRECONDITION,
                        f"dialog {request.id} was already {'answered' if outcome == ANSWERED else 'dismissed'}"
                        " by a UI; the first answer wins", False)
            if outcome is not None:
                return grpc.StatusCode.NOT_FOUND, f"dialog {request.id} {_CLOSED_HOW[outcome]}", False
            return grpc.StatusCode.NOT_FOUND, f"no open dialog {request.id!r} in session {session!r}", True
        method = dialog.method
        if kind == "cancelled":
            if not request.cancelled:
                return bad, (f"dialog {request.id}: cancelled must be true; to answer, send "
                             f"{'confirmed' if method == 'confirm' else 'value'}"), False
            self.dialogs.close(dialog, CANCELLED)
        elif kind == "confirmed":
            if method != "confirm":
                return bad, f"dialog {request.id} is a {method}: answer it with value or cancelled", False
            self.dialogs.close(dialog, ANSWERED, confirmed=request.confirmed)
        else:
            value = request.value
            if method == "confirm":
                return bad, f"dialog {request.id} is a confirm: answer it with confirmed or cancelled", False
            if len(value) > checks.MAX_LONG_TEXT:
                return bad, f"value is {len(value)} characters long; the limit is {checks.MAX_LONG_TEXT}", False
            if dialog.options is not None and value not in dialog.options:
                return bad, f"dialog {request.id}: {value[:80]!r} is not one of its options", False
            self.dialogs.close(dialog, ANSWERED, value=value)
        return None, "", False

    async def GetStats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.ExtensionUiStats:
        session = await session_of(context)
        return pb.ExtensionUiStats(pending_dialogs=self.dialogs.count(),
                                   session_pending_dialogs=self.dialogs.count(session),
                                   session_ui_streams=self.rt.bus.count(topics.EXTENSION_UI, session))


def install(server: Any, rt: Runtime) -> list[str]:
    """Installer for server.app.INSTALLERS."""
    service = ExtensionUiService(rt)
    extension_ui_pb2_grpc.add_ExtensionUiServiceServicer_to_server(service, server)
    rt.gauges["uibus_extension_ui_pending_dialogs"] = (
        "Extension-UI dialogs waiting for an answer", service.dialogs.count)
    return [pb.DESCRIPTOR.services_by_name["ExtensionUiService"].full_name]

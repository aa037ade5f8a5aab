"""Extension-UI answers across replicas.

A dialog lives in the replica its agent called, but with a Redis bus its request reaches UIs on
every replica, so an answer can arrive anywhere. A replica that does not know the dialog id
forwards the answer over the bus (kind `ext_ui_answer`) and waits briefly for the verdict (kind
`ext_ui_answer_result`, targeted at the answer's id); the replica holding the dialog listens on
its session's answers only while it has dialogs waiting there, applies the answer exactly as a
local `Respond` would, and replies. Replicas that do not hold the dialog stay silent, so no reply
in time means no replica has it open.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable

import grpc

from uibus.bus import Bus, BusClosed, Subscription, SubscriptionLimit
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

FORWARD = "ext_ui_answer"
FORWARD_RESULT = "ext_ui_answer_result"
WAIT_S = 2.0
_CODES = {c.value[0]: c for c in grpc.StatusCode}

# (status or None when the answer was taken, message, "this replica does not know the dialog")
Verdict = tuple[grpc.StatusCode | None, str, bool]


class AnswerForwarding:
    def __init__(self, bus: Bus, answer: Callable[[str, pb.RespondRequest], Verdict]) -> None:
        self.bus = bus
        self._answer = answer
        self._listeners: dict[str, tuple[Subscription, asyncio.Task[None]]] = {}

    def hold(self, session: str) -> None:
        """Listens for answers forwarded to `session` (call when a dialog opens here)."""
        if session in self._listeners:
            return
        try:
            sub = self.bus.subscribe(session, FORWARD)
        except (SubscriptionLimit, BusClosed):
            return  # local answers still work; remote ones get NOT_FOUND
        self._listeners[session] = (sub, asyncio.ensure_future(self._serve(session, sub)))

    def release(self, session: str, still_open: int) -> None:
        """Stops listening once the session has no dialog waiting here."""
        if still_open == 0 and session in self._listeners:
            sub, _task = self._listeners.pop(session)
            self.bus.unsubscribe(sub)  # ends _serve's loop

    async def _serve(self, session: str, sub: Subscription) -> None:
        async for fwd in sub:
            code, details, unknown = self._answer(session, fwd.answer)
            if unknown:
                continue  # not ours: the replica holding it replies
            self.bus.publish(session, FORWARD_RESULT, pb.ForwardedAnswerResult(
                answer_id=fwd.answer_id, code=code.value[0] if code else 0, details=details), target=fwd.answer_id)

    async def forward(self, session: str, request: pb.RespondRequest) -> Verdict:
        """Asks the other replicas to apply `request`; NOT_FOUND when none holds the dialog."""
        answer_id = uuid.uuid4().hex
        not_found: Verdict = (grpc.StatusCode.NOT_FOUND, f"no open dialog {request.id!r} in session {session!r}", True)
        try:
            sub = self.bus.subscribe(session, FORWARD_RESULT, answer_id, maxsize=1)
        except (SubscriptionLimit, BusClosed):
            return not_found
        try:
            self.bus.publish(session, FORWARD, pb.ForwardedAnswer(answer_id=answer_id, answer=request))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WAIT_S):
                    async for result in sub:
                        return (_CODES.get(result.code, grpc.StatusCode.UNKNOWN) if result.code else None,
                                result.details, False)
        finally:
            self.bus.unsubscribe(sub)
        return not_found

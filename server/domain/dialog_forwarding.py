"""Extension-UI answers across replicas.

A dialog lives in the replica its agent called, but with a Redis bus its request reaches UIs on
every replica, so an answer can arrive anywhere. A replica that does not know the dialog id
forwards the answer over the bus (kind EXT_UI_ANSWER) and waits briefly for the verdict (kind
EXT_UI_ANSWER_RESULT, targeted at the answer's id); the replica holding the dialog listens on its
session's answers only while it has dialogs waiting there, applies the answer exactly as a local
answer would be applied, and replies. Replicas that do not hold the dialog stay silent, so no
reply in time means no replica has it open.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from uibus import kinds
from uibus.bus import Bus, BusClosed, Subscription, SubscriptionLimit
from uibus.errors import STATUS_NUMBERS, UibusError, error_of
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """What became of an answer: taken (error None), refused (error), or the dialog is not here."""

    error: UibusError | None = None
    unknown: bool = False  # this replica does not know the dialog (another one may)


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
            sub = self.bus.subscribe(session, kinds.EXT_UI_ANSWER)
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
            verdict = self._answer(session, fwd.answer)
            if verdict.unknown:
                continue  # not ours: the replica holding it replies
            error = verdict.error
            self.bus.publish(session, kinds.EXT_UI_ANSWER_RESULT, pb.ForwardedAnswerResult(
                answer_id=fwd.answer_id, code=STATUS_NUMBERS[error.code] if error else 0,
                details=str(error) if error else ""), target=fwd.answer_id)

    async def forward(self, session: str, request: pb.RespondRequest, not_found: Verdict) -> Verdict:
        """Asks the other replicas to apply `request`; `not_found` when none holds the dialog."""
        answer_id = uuid.uuid4().hex
        try:
            sub = self.bus.subscribe(session, kinds.EXT_UI_ANSWER_RESULT, answer_id, maxsize=1)
        except (SubscriptionLimit, BusClosed):
            return not_found
        try:
            self.bus.publish(session, kinds.EXT_UI_ANSWER, pb.ForwardedAnswer(answer_id=answer_id, answer=request))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WAIT_S):
                    async for result in sub:
                        return Verdict(error_of(result.code, result.details) if result.code else None)
        finally:
            self.bus.unsubscribe(sub)
        return not_found

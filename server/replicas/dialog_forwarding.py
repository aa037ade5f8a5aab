"""Extension-UI answers across replicas.

A dialog lives in the replica its agent called, but with a Redis bus its request reaches UIs on
every replica, so an answer can arrive anywhere. A replica that does not know the dialog id
forwards the answer over the bus (kind EXT_UI_ANSWER, uibus.replicas.asking) and waits briefly for
the verdict (kind EXT_UI_ANSWER_RESULT, targeted at the answer's id); the replica holding the dialog
applies the answer exactly as a local answer would be applied, and replies with its verdict.

The answer goes to the holder alone when its shared entry (uibus.replicas.dialog_sharing) names it
and it is heard listening: each replica listens to the answers targeted at its own id (and to
those sent to every listener). Otherwise (no entry: the dialog just closed, or is unknown; the
store does not answer) it goes to every listener, and every listening replica that does not hold
it replies "not here", so the forwarder knows when nobody holds it. A replica of the previous
release listens to every answer and may say "not here" to one addressed to another: only the
holder's verdict counts then.

A replica listens to a session's forwarded answers from before its first dialog there is
published until `LINGER_S` after its last one there closed. The linger is what lets the loser of
a race get its verdict: two UIs on two replicas answer at once, the holder takes the first and
closes the dialog, and the second answer, still crossing Redis, must find the holder listening
to be told "already answered" (FAILED_PRECONDITION) from its memory of closed dialogs, rather
than wait out `WAIT_S` for a reply that never comes. EXT_UI_ANSWER is a presence kind, so a
forwarder knows whether any other replica listens to the session at all: when none does, the
answer is unknown everywhere and NOT_FOUND is immediate; else it waits for the holder's verdict
or for every listener's "not here". `WAIT_S` only bounds the wait for a replica that died with
its presence not yet expired.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from uibus.domain.dialogs import Verdict
from uibus.infra import kinds, telemetry
from uibus.infra.bus import Bus, BusClosed, SubscriptionLimit
from uibus.infra.errors import STATUS_NUMBERS, error_of
from uibus.infra.tasks import Tasks
from uibus.infra.telemetry import as_caller
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb
from uibus.replicas.asking import Exchange, Listeners, replier

WAIT_S = 2.0  # how long a forwarded answer waits for its verdict
LINGER_S = 60.0  # how long a holder keeps listening after its last dialog of a session closed
# A listener's reply "I do not hold it": NOT_FOUND with no details (a verdict always has details).
_NOT_HERE = STATUS_NUMBERS["NOT_FOUND"]


class AnswerForwarding:
    """Serves the answers other replicas forward to the dialogs held here, and forwards the answers
    given here to dialogs held elsewhere."""

    def __init__(self, bus: Bus, answer: Callable[[str, pb.RespondRequest], Verdict],
                 settled: Callable[[str], Awaitable[None]], linger_s: float = LINGER_S) -> None:
        """`answer`: applies an answer to a dialog held here; `settled(session)`: returns once
        what it changed is committed, awaited before the answering replica is told it was taken."""
        self.bus = bus
        self._answer = answer
        self._settled = settled
        self.linger_s = linger_s
        self._holds: dict[str, int] = {}  # session -> dialogs being asked here (from hold to release)
        self._lingering: dict[str, asyncio.TimerHandle] = {}  # session -> when its listener goes
        self._serving = Tasks("forwarded answer listeners")  # joined by aclose
        # targeted at this replica: answers forwarded to it, and those sent to every listener
        self.listeners = Listeners(bus, kinds.EXT_UI_ANSWER, bus.replica_id, self._take, self._serving,
                                   "uibus-answer-listener")

    def hold(self, session: str) -> None:
        """Listens for answers forwarded to `session`; call before the dialog is published, so the
        presence announcement reaches the other replicas ahead of the dialog itself."""
        self._holds[session] = self._holds.get(session, 0) + 1
        timer = self._lingering.pop(session, None)
        if timer is not None:
            timer.cancel()
        self.listeners.listen(session)  # unable to: local answers still work, remote ones get NOT_FOUND

    def release(self, session: str) -> None:
        """Ends one `hold`; the last one leaves the listener up for `linger_s` more (see above)."""
        left = self._holds.get(session, 0) - 1
        if left > 0:
            self._holds[session] = left
            return
        self._holds.pop(session, None)
        if self.listeners.listening(session) and session not in self._lingering:
            self._lingering[session] = asyncio.get_running_loop().call_later(self.linger_s, self._drop, session)

    def _drop(self, session: str) -> None:
        self._lingering.pop(session, None)
        if self._holds.get(session):
            return
        self.listeners.stop(session)

    def close(self) -> None:
        """Stops every listener and linger timer (shutdown)."""
        for timer in self._lingering.values():
            timer.cancel()
        self._lingering.clear()
        self._holds.clear()
        self.listeners.close()

    async def aclose(self) -> None:
        """After `close`: waits for the listeners to end (unsubscribed, each finishes the answer it
        is serving), cancelling any still running after a second."""
        self.close()
        await self._serving.aclose(grace=1.0)

    async def _take(self, session: str, fwd: pb.ForwardedAnswer) -> None:
        """Applies one answer another replica forwarded, and replies its verdict (or "not here")."""
        with as_caller(fwd.answered_via, fwd.answered_by):  # whose answer (tracing on)
            verdict = self._answer(session, fwd.answer)
        reply = replier(self.bus, session, kinds.EXT_UI_ANSWER_RESULT, fwd.answer_id)
        if verdict.unknown:  # not held here: say so, so the forwarder need not wait out WAIT_S
            reply(pb.ForwardedAnswerResult(answer_id=fwd.answer_id, code=_NOT_HERE))
            return
        error = verdict.error
        if error is None:
            await self._settled(session)  # acknowledged is durable, on the holder's side too
        reply(pb.ForwardedAnswerResult(answer_id=fwd.answer_id, code=STATUS_NUMBERS[error.code] if error else 0,
                                       details=str(error) if error else ""))

    async def forward(self, session: str, request: pb.RespondRequest, not_found: Verdict,
                      holder: str | None = None) -> Verdict:
        """Asks the other replicas to apply `request`; `not_found` when none holds the dialog.
        `holder`: the replica holding the dialog, as its shared entry says: when it listens, the
        answer goes to it alone and only its verdict counts; else to every listener."""
        bus = self.bus
        to = holder if holder and holder != bus.replica_id and \
            bus.announced(holder, session, kinds.EXT_UI_ANSWER) is True else None
        ask = Exchange(bus, session, kinds.EXT_UI_ANSWER, kinds.EXT_UI_ANSWER_RESULT, to=to)
        try:
            await ask.open()
        except (SubscriptionLimit, BusClosed):
            return not_found
        try:
            # Every listener replies once, this replica's own included (it hears its own forward).
            forwarded = pb.ForwardedAnswer(answer_id=ask.id, answer=request)
            caller = telemetry.caller() if telemetry.tracer is not None else None
            if caller is not None:  # the holder's dialog span says which UI answered
                forwarded.answered_via, forwarded.answered_by = caller
            reached = ask.send(forwarded)
            if to is None and reached <= bus.count(kinds.EXT_UI_ANSWER, session):
                return not_found  # only this replica's own listener (if any): no other replica can know it
            with contextlib.suppress(TimeoutError, StopAsyncIteration):
                async with asyncio.timeout(WAIT_S):
                    while True:
                        result = await ask.reply(None)
                        if result.code == _NOT_HERE and not result.details:
                            if to is not None:
                                continue  # an older replica hears every answer: only the holder's verdict counts
                            reached -= 1
                            if reached <= 0:
                                break  # every listener said it does not know the dialog
                            continue
                        return Verdict(error_of(result.code, result.details) if result.code else None)
        finally:
            ask.close()
        return not_found

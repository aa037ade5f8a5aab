"""`Placement`: where a turn, a steering call or a dialog's answer runs — decided at the edge, once,
in front of the domain.

The domain (Chat, Steering, Dialogs, Sessions) runs what it is given *here* and knows nothing of
replicas. The services ask the placement, which calls either the local domain object or, for a
hosted agent owned by another replica, carries the call to that replica over the bus, where the
same domain object runs it:

* `LocalPlacement` (the in-process bus: one process is all there is): every call is the domain's,
  directly — no lease, no bus traffic.
* `LeasedPlacement` (the Redis bus): a hosted agent's turns and steering calls run at its one owner,
  the replica holding its lease (uibus.replicas.ownership, turn_forwarding); an answer to a dialog
  not held here goes to the replica holding it (dialog_forwarding). What the other replicas must see
  of this one (waiting dialogs, agent states) the domain tells its `Sharing` (uibus.replicas.sharing);
  the placement hands that sharing what it must ask of the domain (`serve`).

One path each, read top to bottom:

    local turn:      service → placement.turn → Chat.turn
    forwarded turn:  service → placement.turn → TurnForwarding.turn ⇒ bus ⇒ owner's
                     TurnForwarding listener → Chat.turn
    forwarded answer: service → placement.respond → Dialogs.answer (unknown here) →
                     AnswerForwarding.forward ⇒ bus ⇒ holder's listener → Dialogs.verdict
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any

from uibus.domain.core import Core
from uibus.domain.members import may_answer
from uibus.domain.steering import state_from
from uibus.infra.bus import Bus
from uibus.infra.sharing import LocalSharing, Sharing
from uibus.infra.store import Store
from uibus.pb.cline import ui_pb2
from uibus.pb.neuro_san.api.grpc import agent_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb
from uibus.pb.uibus.v1 import sessions_pb2
from uibus.replicas.ownership import LEASE_S
from uibus.replicas.sharing import LeasedSharing
from uibus.replicas.turn_forwarding import TurnForwarding

__all__ = ["LeasedPlacement", "LocalPlacement", "Placement", "placement_for", "sharing_for"]

Turn = AsyncIterator[agent_pb2.ChatResponse]
Family = dict[str, tuple[str, Callable[[], float]]]  # metric name -> (help, read it now)


class Placement:
    """The edge's calls that depend on where things run; alone, each is the domain's own call."""

    forwarded = served = interrupted = taken_over = fenced = 0  # /metrics: no replicas, none of these

    def __init__(self, core: Core) -> None:
        self.core = core

    # ---- hosted agents ----

    def turn(self, session: str, agent: str, request: agent_pb2.ChatRequest,
             metadata: Mapping[str, str] | None = None, *, keep: bool = True) -> Turn:
        """The ChatResponses of one turn, run where its agent lives."""
        chat = self.core.chat
        if not chat.placed(agent, request, keep):
            return chat.turn(session, agent, request, metadata, keep=keep)
        return self._placed_turn(session, agent, request, chat.carried(metadata))

    def _placed_turn(self, session: str, agent: str, request: agent_pb2.ChatRequest,
                     metadata: dict[str, str]) -> Turn:
        return self.core.chat.turn(session, agent, request, metadata)

    async def _steer(self, session: str, agent: str, action: str, args: dict[str, str]) -> dict[str, Any] | None:
        """The owner's result of a steering call of an agent hosted elsewhere; None: act here."""
        return None

    async def stop(self, session: str, agent: str) -> bool:
        remote = await self._steer(session, agent, "stop", {})
        steering = self.core.sessions.steering
        return bool(remote.get("stopped")) if remote is not None else await steering.stop(session, agent)

    async def set_mode(self, session: str, agent: str, mode_id: str) -> sessions_pb2.AgentState:
        remote = await self._steer(session, agent, "set_mode", {"mode_id": mode_id})
        steering = self.core.sessions.steering
        return state_from(remote) if remote is not None else await steering.set_mode(session, agent, mode_id)

    async def set_model(self, session: str, agent: str, model_id: str) -> sessions_pb2.AgentState:
        remote = await self._steer(session, agent, "set_model", {"model_id": model_id})
        steering = self.core.sessions.steering
        return state_from(remote) if remote is not None else await steering.set_model(session, agent, model_id)

    async def new_conversation(self, session: str, agent: str) -> sessions_pb2.AgentState:
        remote = await self._steer(session, agent, "new_conversation", {})
        steering = self.core.sessions.steering
        return state_from(remote) if remote is not None else await steering.new_conversation(session, agent)

    async def delete_session(self, session: str) -> sessions_pb2.DeleteSessionReply:
        """Deletes the session; the turns other replicas' agents run in it are stopped there first."""
        return await self.core.sessions.delete(session)

    # ---- dialogs ----

    async def respond(self, session: str, request: ext_pb.RespondRequest) -> None:
        """Answers a dialog of the session, wherever it is held, if it is the caller's to answer."""
        await may_answer(self.core.dialogs, session, request)  # addressed to a role or a person
        await self.core.dialogs.respond(session, request)

    # ---- /metrics and lifecycle ----

    def counters(self) -> Family:
        """Turns forwarded, served and interrupted, leases taken over and fenced (0 alone)."""
        return {
            "uibus_agent_turns_forwarded_total": (
                "hosted agent turns carried from this replica to the replica owning the agent",
                lambda: float(self.forwarded)),
            "uibus_agent_turns_served_total": (
                "hosted agent turns other replicas carried here, to the agent this replica owns",
                lambda: float(self.served)),
            "uibus_agent_turns_interrupted_total": (
                "forwarded turns ended UNAVAILABLE because the owning replica went silent",
                lambda: float(self.interrupted)),
            "uibus_agent_leases_taken_over_total": (
                "agent ownership leases this replica took over from a replica whose lease had expired",
                lambda: float(self.taken_over)),
            "uibus_agent_leases_fenced_total": (
                "agent ownership leases lost while held (refused renewal, or none for longer than the lease): "
                "their turns cut, their agent closed",
                lambda: float(self.fenced)),
        }

    def hosting(self) -> AbstractAsyncContextManager[object]:
        """Open after the agent sessions, closed before them (leases given up, forwarded turns ended)."""
        return nullcontext()


class LocalPlacement(Placement):
    """One process is all there is: everything runs here and nothing is told to anyone."""


class LeasedPlacement(Placement):
    """Replicas on Redis: leases, forwarding and sharing (see the module's text)."""

    def __init__(self, core: Core, sharing: LeasedSharing, *, lease_s: float = LEASE_S) -> None:
        super().__init__(core)
        self.sharing = sharing
        dialogs, steering = core.dialogs, core.sessions.steering
        sharing.serve(dialogs.verdict, dialogs.settled, steering.state_or_none)
        self.forwarding = TurnForwarding(
            core.bus, core.store, core.agent_sessions, core.chat.turn, steering.here,
            lambda session, text: core.feed.say(session, text, ui_pb2.ERROR), lease_s=lease_s)
        self.ownership = self.forwarding.ownership

    @property  # type: ignore[override]
    def forwarded(self) -> int:
        return self.forwarding.forwarded

    @property  # type: ignore[override]
    def served(self) -> int:
        return self.forwarding.served

    @property  # type: ignore[override]
    def interrupted(self) -> int:
        return self.forwarding.interrupted

    @property  # type: ignore[override]
    def taken_over(self) -> int:
        return self.ownership.taken_over

    @property  # type: ignore[override]
    def fenced(self) -> int:
        return self.ownership.fenced

    def _placed_turn(self, session: str, agent: str, request: agent_pb2.ChatRequest,
                     metadata: dict[str, str]) -> Turn:
        chat = self.core.chat
        return self.forwarding.turn(session, agent, request, metadata, lambda: chat.check(agent, request))

    async def _steer(self, session: str, agent: str, action: str, args: dict[str, str]) -> dict[str, Any] | None:
        # open here, or not a hosted agent (a bad name never claims a lease): answered here
        if not agent or self.core.agent_sessions.live_agent(session, agent) is not None \
                or not self.core.chat.hosted(agent):
            return None
        result = await self.forwarding.steer(session, agent, action, args)
        await self.core.sessions.steering.record(action, session, agent, args, forwarded=True)  # here, by whom
        return result

    async def delete_session(self, session: str) -> sessions_pb2.DeleteSessionReply:
        # A turn another replica's agent runs is stopped there (steering is carried to the owner);
        # that replica closes the agent at its next sweep, its live marker gone with the session.
        for remote in await self.sharing.agents_elsewhere(session):
            if remote.running and self.core.agent_sessions.live_agent(session, remote.agent) is None:
                try:
                    await self.stop(session, remote.agent)
                except Exception:
                    pass
        return await super().delete_session(session)

    async def respond(self, session: str, request: ext_pb.RespondRequest) -> None:
        await may_answer(self.core.dialogs, session, request)  # here, from the shared record when held elsewhere
        verdict = await self.core.dialogs.answer(session, request)
        if verdict.unknown:  # perhaps another replica holds it (which commits its close before it replies)
            shared = self.sharing
            holder = await shared.shared_dialogs.holder_of(session, request.id)  # to it alone when it listens
            asked = next((d for d in await shared.read_dialogs_elsewhere(session) if d.id == request.id), None)
            verdict = await shared.answers.forward(session, request, verdict, holder)
            if verdict.error is None:  # the audit entry is written here, where the answer was given
                await self.core.dialogs.record_answer(session, request, asked, forwarded=True)
        if verdict.error is not None:
            raise verdict.error

    @asynccontextmanager
    async def _hosting(self) -> AsyncIterator[object]:
        async with self.ownership, self.forwarding:  # the forwarding ends first, then the leases go
            yield self

    def hosting(self) -> AbstractAsyncContextManager[object]:
        return self._hosting()


def sharing_for(bus: Bus, store: Store) -> Sharing:
    """What the domain tells other replicas through: the shared store on a replicated bus, else
    nothing (one process). The one place, with `placement_for`, that asks whether there are replicas."""
    return LeasedSharing(bus, store) if bus.replicated else LocalSharing()


def placement_for(core: Core, *, lease_s: float = LEASE_S) -> Placement:
    """Leased when the core's sharing is (other replicas exist), else local."""
    if isinstance(core.sharing, LeasedSharing):
        return LeasedPlacement(core, core.sharing, lease_s=lease_s)
    return LocalPlacement(core)

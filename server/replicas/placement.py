"""`Placement`: the one question the domain asks about replicas — where does this run, and who else
must hear of it — answered locally or with leases.

The domain objects (Chat, Steering, Dialogs, AgentSessions, the sessions listing) are built with a
placement and call it at the points where replicas matter; they never ask whether there are
replicas. Two answers:

* `LocalPlacement` (the in-process bus: one process is all there is): every turn and steering call
  runs here, memory is exact, nothing is shared or forwarded, no bus traffic. Each call is a plain
  call-through or nothing at all.
* `LeasedPlacement` (the Redis bus): each hosted agent has one owner, the replica holding its
  lease (uibus.replicas.ownership); turns and steering calls arriving elsewhere are carried to it
  (uibus.replicas.turn_forwarding); waiting dialogs and agent states are written to the shared
  store for the other replicas' UIs and listings (dialog_sharing, agent_state_sharing); answers
  to a dialog held elsewhere are forwarded to it (dialog_forwarding).

What other replicas ask of this one runs in the domain: each domain object hands its part to the
placement when it is built (`serve_turns`, `serve_steering`, `serve_answers`, `host`), so the
wiring is one pass through the constructors and the placement never imports the domain.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any, Protocol

from uibus.infra.bus import Bus
from uibus.infra.store import Store
from uibus.pb.neuro_san.api.grpc import agent_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb
from uibus.pb.uibus.v1 import sessions_pb2
from uibus.replicas import agent_state_sharing, dialog_sharing
from uibus.replicas.agent_state_sharing import AgentStateSharing, StateOf
from uibus.replicas.dialog_forwarding import AnswerForwarding, Verdict
from uibus.replicas.dialog_sharing import SharedDialogs
from uibus.replicas.ownership import LEASE_S, HostedAgents
from uibus.replicas.turn_forwarding import RunHere, SteerHere, TurnForwarding

__all__ = ["Answer", "LeasedPlacement", "LocalPlacement", "Placement", "Verdict", "placement_for"]

# (session, answer) -> what became of it, applied to a dialog held here (Dialogs' own check)
Answer = Callable[[str, ext_pb.RespondRequest], Verdict]
# (session) -> returns once what an answer changed is committed (the session log's group commit)
Settled = Callable[[str], Awaitable[None]]
Turn = AsyncIterator[agent_pb2.ChatResponse]


class Placement(Protocol):
    """Where hosted agents run and what the other replicas must hear of (see the module's text)."""

    # ---- what this replica runs for others: handed over by each domain object as it is built ----

    def serve_turns(self, run_here: RunHere) -> None:
        """`run_here(session, agent, request, metadata)`: a turn of a hosted agent run by this replica."""
        ...

    def serve_steering(self, steer_here: SteerHere, state_of: StateOf) -> None:
        """`steer_here`: a steering call run by this replica; `state_of(session, agent)`: the state of
        an agent open here (None: not open here)."""
        ...

    def serve_answers(self, answer: Answer, settled: Settled) -> None:
        """`answer(session, request)`: an answer applied to a dialog held here (or why not);
        `settled(session)`: awaited before a taken answer is acknowledged to its replica."""
        ...

    def host(self, agents: HostedAgents) -> None:
        """The agent sessions open here: a replica that loses an agent's lease closes its session."""
        ...

    # ---- hosted agents ----

    def turn(self, session: str, agent: str, request: agent_pb2.ChatRequest, metadata: Mapping[str, str],
             check: Callable[[], None]) -> Turn:
        """A turn of a hosted agent of a named session, run by the agent's one owner (here or elsewhere)."""
        ...

    async def steer(self, session: str, agent: str, action: str, args: dict[str, str]) -> dict[str, Any] | None:
        """A steering call of an agent not open here, run by its owner: None when this replica owns it
        (the caller acts here), else the owner's result."""
        ...

    def agent_changed(self, session: str, agent: str) -> None:
        """The state of an agent open here may have changed (a turn, a steering call, it closed)."""
        ...

    async def agents_elsewhere(self, session: str) -> list[sessions_pb2.AgentState]:
        """The states of the agents of `session` that other replicas host."""
        ...

    # ---- dialogs ----

    async def share_dialog(self, session: str, request: ext_pb.ExtensionUiRequest) -> None:
        """A dialog about to open here: answers given elsewhere must reach it, UIs elsewhere must see
        it. Before it is published; `dialog_done` after it closed (or failed to open)."""
        ...

    def unshare_dialog(self, session: str, dialog_id: str, then: Callable[[], None] | None = None) -> None:
        """Removes the shared dialog, then calls `then` (publishing its closed event)."""
        ...

    def dialog_done(self, session: str) -> None:
        """Ends one `share_dialog` of `session`."""
        ...

    def dialogs_elsewhere(self, session: str, kept: dict[str, Any]) -> list[ext_pb.ExtensionUiRequest]:
        """The dialogs of `session` other replicas hold, read from its stored entries `kept`."""
        ...

    async def read_dialogs_elsewhere(self, session: str) -> list[ext_pb.ExtensionUiRequest]:
        """The same, read from the store."""
        ...

    async def forward_answer(self, session: str, request: ext_pb.RespondRequest, not_found: Verdict) -> Verdict:
        """An answer to a dialog not held here, applied where it is held; `not_found` when nowhere."""
        ...

    def close_dialogs(self) -> None:
        """Shutdown: no more answers from other replicas."""
        ...

    async def aclose_dialogs(self) -> None:
        """After `close_dialogs`, before the bus and the store close: the last shared writes go out."""
        ...

    # ---- /metrics: 0 alone ----

    @property
    def forwarded(self) -> int:
        """Turns this replica carried to their owner (accepted there)."""
        ...

    @property
    def served(self) -> int:
        """Turns other replicas carried here."""
        ...

    @property
    def interrupted(self) -> int:
        """Forwarded turns whose owner went silent."""
        ...

    @property
    def taken_over(self) -> int:
        """Leases taken over from an owner whose lease had expired."""
        ...

    @property
    def fenced(self) -> int:
        """Leases lost while held."""
        ...

    # ---- lifecycle (uibus.app enters them around the agent sessions) ----

    def sharing(self) -> AbstractAsyncContextManager[object]:
        """Open before the agent sessions, closed after them (their last states are written)."""
        ...

    def hosting(self) -> AbstractAsyncContextManager[object]:
        """Open after the agent sessions, closed before them (leases given up, forwarded turns ended)."""
        ...


class LocalPlacement:
    """One process is all there is: everything runs here and nothing is told to anyone."""

    forwarded = served = interrupted = taken_over = fenced = 0  # /metrics: no replicas, none of these

    def __init__(self) -> None:
        self._run_here: RunHere | None = None

    def serve_turns(self, run_here: RunHere) -> None:
        self._run_here = run_here

    def serve_steering(self, steer_here: SteerHere, state_of: StateOf) -> None:
        pass

    def serve_answers(self, answer: Answer, settled: Settled) -> None:
        pass

    def host(self, agents: HostedAgents) -> None:
        pass

    def turn(self, session: str, agent: str, request: agent_pb2.ChatRequest, metadata: Mapping[str, str],
             check: Callable[[], None]) -> Turn:
        assert self._run_here is not None, "no domain serves turns"
        return self._run_here(session, agent, request, metadata)  # it checks the request itself

    async def steer(self, session: str, agent: str, action: str, args: dict[str, str]) -> dict[str, Any] | None:
        return None

    def agent_changed(self, session: str, agent: str) -> None:
        pass

    async def agents_elsewhere(self, session: str) -> list[sessions_pb2.AgentState]:
        return []

    async def share_dialog(self, session: str, request: ext_pb.ExtensionUiRequest) -> None:
        pass

    def unshare_dialog(self, session: str, dialog_id: str, then: Callable[[], None] | None = None) -> None:
        if then is not None:
            then()

    def dialog_done(self, session: str) -> None:
        pass

    def dialogs_elsewhere(self, session: str, kept: dict[str, Any]) -> list[ext_pb.ExtensionUiRequest]:
        return []

    async def read_dialogs_elsewhere(self, session: str) -> list[ext_pb.ExtensionUiRequest]:
        return []

    async def forward_answer(self, session: str, request: ext_pb.RespondRequest, not_found: Verdict) -> Verdict:
        return not_found

    def close_dialogs(self) -> None:
        pass

    async def aclose_dialogs(self) -> None:
        pass

    def sharing(self) -> AbstractAsyncContextManager[object]:
        return nullcontext()

    def hosting(self) -> AbstractAsyncContextManager[object]:
        return nullcontext()


async def _nothing_to_settle(session: str) -> None:
    """Before Dialogs serves answers here, there is nothing of theirs to commit."""


def _unserved(*args: Any) -> Any:
    raise RuntimeError("no domain object serves this here")


class LeasedPlacement:
    """Replicas on Redis: leases, forwarding and sharing (see the module's text)."""

    def __init__(self, bus: Bus, store: Store, *, lease_s: float = LEASE_S,
                 say_error: Callable[[str, str], object] = lambda session, text: None) -> None:
        """`say_error(session, text)`: tells the session's webviews that a turn was interrupted by
        the loss of its host (a Cline ERROR message)."""
        self.store = store
        self._run_here: RunHere = _unserved
        self._steer_here: SteerHere = _unserved
        self._state_of: StateOf = lambda session, agent: None
        self._answer: Answer = lambda session, request: Verdict(unknown=True)
        self._settled: Settled = _nothing_to_settle
        self._agents: HostedAgents | None = None
        self.shared_dialogs = SharedDialogs(bus, store)
        self.answers = AnswerForwarding(bus, lambda session, request: self._answer(session, request),
                                        lambda session: self._settled(session))
        self.forwarding = TurnForwarding(
            bus, store, self, lambda s, a, r, m: self._run_here(s, a, r, m),
            lambda s, a, action, args: self._steer_here(s, a, action, args), say_error, lease_s=lease_s)
        self.ownership = self.forwarding.ownership
        self.agent_states = AgentStateSharing(store, lambda s, a: self._state_of(s, a), bus.replica_id,
                                              bus.announced)

    # ---- what this replica runs for others ----

    def serve_turns(self, run_here: RunHere) -> None:
        self._run_here = run_here

    def serve_steering(self, steer_here: SteerHere, state_of: StateOf) -> None:
        self._steer_here, self._state_of = steer_here, state_of

    def serve_answers(self, answer: Answer, settled: Settled) -> None:
        self._answer, self._settled = answer, settled

    def host(self, agents: HostedAgents) -> None:
        self._agents = agents

    # HostedAgents, for the ownership: the agent sessions handed to `host`
    def is_live(self, session: str, name: str) -> bool:
        return self._agents is not None and self._agents.is_live(session, name)

    async def drop(self, session: str, name: str, why: str) -> None:
        if self._agents is not None:
            await self._agents.drop(session, name, why)

    # ---- /metrics ----

    @property
    def forwarded(self) -> int:
        return self.forwarding.forwarded

    @property
    def served(self) -> int:
        return self.forwarding.served

    @property
    def interrupted(self) -> int:
        return self.forwarding.interrupted

    @property
    def taken_over(self) -> int:
        return self.ownership.taken_over

    @property
    def fenced(self) -> int:
        return self.ownership.fenced

    # ---- hosted agents ----

    def turn(self, session: str, agent: str, request: agent_pb2.ChatRequest, metadata: Mapping[str, str],
             check: Callable[[], None]) -> Turn:
        return self.forwarding.turn(session, agent, request, metadata, check)

    async def steer(self, session: str, agent: str, action: str, args: dict[str, str]) -> dict[str, Any] | None:
        return await self.forwarding.steer(session, agent, action, args)

    def agent_changed(self, session: str, agent: str) -> None:
        self.agent_states.changed(session, agent)

    async def agents_elsewhere(self, session: str) -> list[sessions_pb2.AgentState]:
        return self.agent_states.others(session, await self.store.scan(session, agent_state_sharing.KEY))

    # ---- dialogs ----

    async def share_dialog(self, session: str, request: ext_pb.ExtensionUiRequest) -> None:
        self.answers.hold(session)  # first, so other replicas know an answer can come here before they see it
        await self.shared_dialogs.put(session, request)  # before it is published: a late UI reads it

    def unshare_dialog(self, session: str, dialog_id: str, then: Callable[[], None] | None = None) -> None:
        self.shared_dialogs.remove(session, dialog_id, then)

    def dialog_done(self, session: str) -> None:
        self.answers.release(session)

    def dialogs_elsewhere(self, session: str, kept: dict[str, Any]) -> list[ext_pb.ExtensionUiRequest]:
        return self.shared_dialogs.others(session, kept)

    async def read_dialogs_elsewhere(self, session: str) -> list[ext_pb.ExtensionUiRequest]:
        return self.shared_dialogs.others(session, await self.store.scan(session, dialog_sharing.KEY))

    async def forward_answer(self, session: str, request: ext_pb.RespondRequest, not_found: Verdict) -> Verdict:
        holder = await self.shared_dialogs.holder_of(session, request.id)  # to it alone when it listens
        return await self.answers.forward(session, request, not_found, holder)

    def close_dialogs(self) -> None:
        self.answers.close()

    async def aclose_dialogs(self) -> None:
        await self.answers.aclose()
        await self.shared_dialogs.aclose()

    # ---- lifecycle ----

    def sharing(self) -> AbstractAsyncContextManager[object]:
        return self.agent_states

    @asynccontextmanager
    async def _hosting(self) -> AsyncIterator[object]:
        async with self.ownership, self.forwarding:  # the forwarding ends first, then the leases go
            yield self

    def hosting(self) -> AbstractAsyncContextManager[object]:
        return self._hosting()


def placement_for(bus: Bus, store: Store, *, lease_s: float = LEASE_S,
                  say_error: Callable[[str, str], object] = lambda session, text: None) -> Placement:
    """Leased on a replicated bus (other replicas exist), else local: the one place that asks."""
    if bus.replicated:
        return LeasedPlacement(bus, store, lease_s=lease_s, say_error=say_error)
    return LocalPlacement()

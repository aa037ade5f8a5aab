"""`LeasedSharing`: the store/bus layer's `Sharing` (uibus.infra.sharing) when there are replicas —
the waiting dialogs and hosted agents' states of this replica written to the shared store for the
others' UIs and listings, and answers given on other replicas heard while a dialog waits here.

The domain tells it what opens, closes and changes (it is handed to the domain when the domain is
built); what it must ask of the domain — apply an answer carried here, read an agent's state — the
edge hands it once the domain exists (`serve`, called by `LeasedPlacement`), so it never imports
the domain and the domain never registers anything with it. The parts are each a module of their
own: dialog_sharing (the store entries), dialog_forwarding (the answers), agent_state_sharing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from uibus.infra.bus import Bus
from uibus.infra.store import Store
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb
from uibus.pb.uibus.v1 import sessions_pb2
from uibus.replicas import agent_state_sharing, dialog_sharing
from uibus.replicas.agent_state_sharing import AgentStateSharing, StateOf
from uibus.replicas.dialog_forwarding import AnswerForwarding, Verdict
from uibus.replicas.dialog_sharing import SharedDialogs

# (session, answer) -> what became of it, applied to a dialog held here (Dialogs.verdict)
Answer = Callable[[str, ext_pb.RespondRequest], Verdict]
# (session) -> returns once what an answer changed is committed (the session log's group commit)
Settled = Callable[[str], Awaitable[None]]


async def _nothing_to_settle(session: str) -> None:
    """Before the domain is served here, there is nothing of its to commit."""


class LeasedSharing:
    """This replica's waiting dialogs and agent states in the shared store; answers heard meanwhile."""

    def __init__(self, bus: Bus, store: Store) -> None:
        self.store = store
        self._answer: Answer = lambda session, request: Verdict(unknown=True)
        self._settled: Settled = _nothing_to_settle
        self._state_of: StateOf = lambda session, agent: None
        self.shared_dialogs = SharedDialogs(bus, store)
        self.answers = AnswerForwarding(bus, lambda session, request: self._answer(session, request),
                                        lambda session: self._settled(session))
        self.states = AgentStateSharing(store, lambda s, a: self._state_of(s, a), bus.replica_id, bus.announced)

    def serve(self, answer: Answer, settled: Settled, state_of: StateOf) -> None:
        """What the domain answers for the others: an answer applied to a dialog held here, its
        commit, the state of an agent open here (None: not open here)."""
        self._answer, self._settled, self._state_of = answer, settled, state_of

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

    def close_dialogs(self) -> None:
        self.answers.close()

    async def aclose_dialogs(self) -> None:
        await self.answers.aclose()
        await self.shared_dialogs.aclose()

    # ---- hosted agents ----

    def agent_changed(self, session: str, agent: str) -> None:
        self.states.changed(session, agent)

    async def agents_elsewhere(self, session: str) -> list[sessions_pb2.AgentState]:
        return self.states.others(session, await self.store.scan(session, agent_state_sharing.KEY))

    def agent_states(self) -> AbstractAsyncContextManager[object]:
        return self.states

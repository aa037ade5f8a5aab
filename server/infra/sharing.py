"""`Sharing`: what other processes must see of this one — the dialogs waiting here and the state of
the hosted agents open here — told to the store/bus layer as it changes, read back from it.

The domain owns dialogs and agent sessions and tells this layer about them the way it tells the
store about a title: it never asks whether anyone else is listening. One process alone is told
nothing worth keeping (its memory is exact, and entries in the SQLite file would outlive the only
process that could answer them), so `LocalSharing` keeps nothing and reads nothing. With Redis,
uibus.replicas builds the one that writes to the shared store and listens for answers given on
other replicas (`uibus.replicas.sharing`); it is handed to the domain when the domain is built,
and the domain calls it, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, Protocol

from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb
from uibus.pb.uibus.v1 import sessions_pb2

__all__ = ["LocalSharing", "Sharing"]


class Sharing(Protocol):
    """The waiting dialogs and hosted agents of this process, as other processes must see them."""

    # ---- dialogs held here ----

    async def share_dialog(self, session: str, request: ext_pb.ExtensionUiRequest) -> None:
        """A dialog about to open here: answers given elsewhere must be able to reach it, UIs
        elsewhere must see it. Awaited before it is published; `dialog_done` after it closed (or
        failed to open)."""
        ...

    def unshare_dialog(self, session: str, dialog_id: str, then: Callable[[], None] | None = None) -> None:
        """Removes the shared dialog, then calls `then` (publishing its closed event): a UI that
        subscribes after the closed event must not find the dialog still shared."""
        ...

    def dialog_done(self, session: str) -> None:
        """Ends one `share_dialog` of `session`."""
        ...

    def dialogs_elsewhere(self, session: str, kept: dict[str, Any]) -> list[ext_pb.ExtensionUiRequest]:
        """The dialogs of `session` other processes hold, read from its stored entries `kept`."""
        ...

    async def read_dialogs_elsewhere(self, session: str) -> list[ext_pb.ExtensionUiRequest]:
        """The same, read from the store."""
        ...

    def close_dialogs(self) -> None:
        """Shutdown: no more answers from other processes."""
        ...

    async def aclose_dialogs(self) -> None:
        """After `close_dialogs`, before the bus and the store close: the last shared writes go out."""
        ...

    # ---- hosted agents open here ----

    def agent_changed(self, session: str, agent: str) -> None:
        """The state of an agent open here may have changed (a turn, a steering call, it closed)."""
        ...

    async def agents_elsewhere(self, session: str) -> list[sessions_pb2.AgentState]:
        """The states of the agents of `session` other processes host."""
        ...

    def agent_states(self) -> AbstractAsyncContextManager[object]:
        """Open before the agent sessions, closed after them (their last states are written)."""
        ...


class LocalSharing:
    """One process is all there is: memory is exact, nothing is shared, nothing is read."""

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

    def close_dialogs(self) -> None:
        pass

    async def aclose_dialogs(self) -> None:
        pass

    def agent_changed(self, session: str, agent: str) -> None:
        pass

    async def agents_elsewhere(self, session: str) -> list[sessions_pb2.AgentState]:
        return []

    def agent_states(self) -> AbstractAsyncContextManager[object]:
        return nullcontext()

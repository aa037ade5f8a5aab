"""`Changes`: "something the sessions listing shows changed here", told by whoever changed it.

A turn starting or ending (AgentSessions), a dialog opening or closing (PendingDialogs) and a
steering call show in every sessions watch at once (uibus.domain.sessions), not at the next
look. One `Changes` is built first and handed to each of them and to the listing, so none of
them needs the listing (built after them) to exist, and no hook is set after construction.
"""

from __future__ import annotations

import asyncio


class Changes:
    """A wake-up for every watch waiting: `poke` sets the current event and replaces it, so a watch
    takes `event` before it lists and a poke during the listing is not missed."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def poke(self) -> None:
        changed, self.event = self.event, asyncio.Event()
        changed.set()

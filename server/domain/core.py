"""`Core`: the domain objects one app owns, built once and shared by every service and transport."""

from __future__ import annotations

from dataclasses import dataclass

from uibus.agents.config import AgentTable
from uibus.bus import Bus
from uibus.config import Config
from uibus.domain.agent_sessions import AgentSessions
from uibus.domain.chat import Chat
from uibus.domain.clock import TsClock
from uibus.domain.dialogs import Dialogs
from uibus.domain.feed import UiFeed
from uibus.domain.history import ChatHistory
from uibus.domain.sessions import Sessions
from uibus.store import Store


@dataclass
class Core:
    config: Config
    bus: Bus
    store: Store
    clock: TsClock
    feed: UiFeed
    history: ChatHistory
    chat: Chat
    dialogs: Dialogs
    agent_sessions: AgentSessions
    sessions: Sessions

    @classmethod
    def build(cls, config: Config, bus: Bus, store: Store, agents: AgentTable) -> Core:
        clock = TsClock()
        feed = UiFeed(bus, store, clock)
        history = ChatHistory(store, bus, max_bytes=config.history_bytes)
        dialogs = Dialogs(bus, store, config.queue_size)
        sessions = AgentSessions(dialogs, feed, store)
        listing = Sessions(store, dialogs, sessions, history)
        sessions.on_change = listing.poke  # a turn starting or ending, a dialog opening or closing,
        dialogs.pending.on_change = listing.poke  # shows in every watch at once
        return cls(config=config, bus=bus, store=store, clock=clock, feed=feed, history=history,
                   chat=Chat(agents, history, feed, sessions, context_bytes=config.chat_context_bytes,
                             send_limit=config.max_message_bytes), dialogs=dialogs, agent_sessions=sessions,
                   sessions=listing)

    def begin_shutdown(self) -> None:
        """Refuse new streams and dialogs; end every open stream and waiting dialog."""
        self.bus.close()
        self.dialogs.shutdown()

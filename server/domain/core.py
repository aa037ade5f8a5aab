"""`Core`: the domain objects one app owns, built once and shared by every service and transport."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from uibus.agents.config import AgentTable
from uibus.agents.workspaces import Workspaces, default_workspaces_dir
from uibus.bus import Bus
from uibus.config import Config
from uibus.domain.agent_sessions import AgentSessions
from uibus.domain.agent_state_sharing import AgentStateSharing
from uibus.domain.chat import Chat
from uibus.domain.clock import TsClock
from uibus.domain.dialogs import Dialogs
from uibus.domain.feed import UiFeed
from uibus.domain.history import ChatHistory
from uibus.domain.ownership import Ownership
from uibus.domain.session_log import SessionLog
from uibus.domain.sessions import Sessions
from uibus.domain.turn_forwarding import TurnForwarding
from uibus.pb.cline import ui_pb2
from uibus.store import LogRetention, Store


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
    # With a replicated bus: the agent leases held here and the turns carried to their owners.
    ownership: Ownership | None = None
    forwarding: TurnForwarding | None = None
    agent_states: AgentStateSharing | None = None  # the state of the agents hosted here, for the others

    @classmethod
    def build(cls, config: Config, bus: Bus, store: Store, agents: AgentTable) -> Core:
        clock = TsClock()
        # the session log's retention: --log-max-events, --log-max-bytes, --log-max-age-seconds
        retention = LogRetention(max_entries=config.log_max_events, max_bytes=config.log_max_bytes,
                                 max_age_s=config.log_max_age_seconds)
        feed = UiFeed(bus, store, clock, log=SessionLog(store, retention=retention))
        history = ChatHistory(store, bus, max_bytes=config.history_bytes)
        dialogs = Dialogs(bus, store, config.queue_size, log=feed.log)
        sessions = AgentSessions(dialogs, feed, store)
        # the worktrees of agents with option workspace = "worktree": --workspaces-dir, else the
        # agents file's workspaces_dir, else beside the default store
        root = config.workspaces_dir or agents.workspaces_dir or default_workspaces_dir()
        sessions.workspaces = Workspaces(str(Path(root).expanduser()),
                                         enabled=any(getattr(b, "workspace_repo", None) is not None
                                                     for b in agents.backends.values()))
        listing = Sessions(store, dialogs, sessions, history, recent=feed.recent)
        sessions.on_change = listing.poke  # a turn starting or ending, a dialog opening or closing,
        dialogs.pending.on_change = listing.poke  # shows in every watch at once
        chat = Chat(agents, history, feed, sessions, context_bytes=config.chat_context_bytes,
                    send_limit=config.max_message_bytes)
        ownership = forwarding = agent_states = None
        replica_id = getattr(bus, "replica_id", "")
        if bus.replicated and replica_id:  # one owner per hosted agent across replicas and workers
            ownership = Ownership(store, sessions, replica_id, lease_s=config.agent_lease_seconds)
            forwarding = chat.routing = TurnForwarding(
                bus, ownership, lambda s, a, r, m: chat.turn_here(s, a, r, m, keep=True),
                lambda session, text: feed.say(session, text, ui_pb2.ERROR))
            # steering an agent another replica hosts goes to that replica, the same way
            listing.steering.route, forwarding.steer_here = forwarding.steer, listing.steering.here
            listing.steering.hosted = chat.hosted
            # and the listing shows the agents other replicas host
            agent_states = listing.agent_states = AgentStateSharing(
                store, sessions, replica_id, getattr(bus, "announced", None))
        return cls(config=config, bus=bus, store=store, clock=clock, feed=feed, history=history, chat=chat,
                   dialogs=dialogs, agent_sessions=sessions, sessions=listing, ownership=ownership,
                   forwarding=forwarding, agent_states=agent_states)

    def begin_shutdown(self) -> None:
        """Refuse new streams and dialogs; end every open stream and waiting dialog."""
        self.bus.close()
        self.dialogs.shutdown()

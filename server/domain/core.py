"""`Core`: the domain objects one app owns, built once and shared by every service and transport."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from uibus.agents.config import AgentTable
from uibus.agents.workspaces import Workspaces, default_workspaces_dir
from uibus.domain.agent_sessions import AgentSessions
from uibus.domain.changes import Changes
from uibus.domain.chat import Chat
from uibus.domain.clock import TsClock
from uibus.domain.dialogs import Dialogs
from uibus.domain.feed import UiFeed
from uibus.domain.history import ChatHistory
from uibus.domain.session_log import SessionLog
from uibus.domain.sessions import Sessions
from uibus.infra.audit import NoAudit, Recorder
from uibus.infra.auth import Tokens
from uibus.infra.bus import Bus
from uibus.infra.config import Config
from uibus.infra.quotas import Quotas
from uibus.infra.sharing import LocalSharing, Sharing
from uibus.infra.store import LogRetention, Store


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
    # What other processes must see of this one (waiting dialogs, hosted agents' states): told to
    # the store/bus layer as it changes (uibus.infra.sharing); alone, nothing is kept.
    sharing: Sharing
    # Where the acts people take are recorded, by whom (uibus.infra.audit); NoAudit: not recorded.
    audit: Recorder

    @classmethod
    def build(cls, config: Config, bus: Bus, store: Store, agents: AgentTable, *, tokens: Tokens | None = None,
              quotas: Quotas | None = None, mcp_url: Callable[[], str] = str,
              observe_wait: Callable[[str, str, float], None] | None = None, sharing: Sharing | None = None,
              audit: Recorder | None = None) -> Core:
        """Every domain object built once, each handed what it uses (no hook is set afterwards).
        `sharing`: what other processes are told of this one's dialogs and agents (None: alone);
        `tokens`, `quotas`: the app's (agents' /mcp tokens, tenants' shares of processes);
        `mcp_url()`: uibus's own MCP endpoint once the HTTP port listens, offered to ACP agents;
        `observe_wait(kind, outcome, seconds)`: how long each dialog waited for a person (/metrics);
        `audit`: the audit log's port, the one every domain object records acts through."""
        audit = audit if audit is not None else NoAudit()
        clock = TsClock()
        # the session log's retention: --log-max-events, --log-max-bytes, --log-max-age-seconds
        retention = LogRetention(max_entries=config.log_max_events, max_bytes=config.log_max_bytes,
                                 max_age_s=config.log_max_age_seconds)
        feed = UiFeed(bus, store, clock, log=SessionLog(store, retention=retention))
        history = ChatHistory(store, bus, max_bytes=config.history_bytes)
        sharing = sharing if sharing is not None else LocalSharing()
        # a turn starting or ending, a dialog opening or closing, shows in every sessions watch at once
        changes = Changes()
        dialogs = Dialogs(bus, store, sharing, config.queue_size, log=feed.log, on_change=changes.poke,
                          observe_wait=observe_wait, audit=audit)
        # the worktrees of agents with option workspace = "worktree": --workspaces-dir, else the
        # agents file's workspaces_dir, else beside the default store
        root = config.workspaces_dir or agents.workspaces_dir or default_workspaces_dir()
        workspaces = Workspaces(str(Path(root).expanduser()),
                                enabled=any(getattr(b, "workspace_repo", None) is not None
                                            for b in agents.backends.values()))
        sessions = AgentSessions(dialogs, feed, store, sharing, changes=changes, workspaces=workspaces,
                                 tokens=tokens, quotas=quotas, mcp_url=mcp_url)
        chat = Chat(agents, history, feed, sessions, context_bytes=config.chat_context_bytes,
                    send_limit=config.max_message_bytes)
        listing = Sessions(store, dialogs, sessions, history, sharing, changes=changes, recent=feed.recent)
        return cls(config=config, bus=bus, store=store, clock=clock, feed=feed, history=history, chat=chat,
                   dialogs=dialogs, agent_sessions=sessions, sessions=listing, sharing=sharing, audit=audit)

    def begin_shutdown(self) -> None:
        """Refuse new streams and dialogs; end every open stream and waiting dialog."""
        self.bus.close()
        self.dialogs.shutdown()

"""Conversation handles: what a hosted agent needs to pick its conversation up again in a new process.

A hosted agent keeps its conversation in its own storage (Claude Code under `~/.claude`, pi in a
session file under `~/.pi/agent/sessions`); uibus keeps only the *handle* to it — for ACP the
`sessionId` and its `cwd`, for pi the `sessionFile` — in the uibus session's store, under
`agent/handle/<agent>`. So the handle lives exactly as long as the uibus session: retention and
eviction delete it with every other key of the session, and a process closed for being idle, a
restart of uibus (SIGTERM or SIGKILL) or a replica that takes the session over finds it and
resumes the conversation instead of starting a blank one.

What the handle means belongs to the agent's backend (uibus.agents.acp, uibus.agents.rpc); this
module only stores it and says what happened: a resume is counted, a conversation that could not
be resumed is counted and told to the session's UIs in one INFO message (a webview SAY INFO and an
extension-UI notify), never silently.
"""

from __future__ import annotations

import logging
from typing import Any

from uibus.domain.dialogs import Dialogs
from uibus.domain.feed import UiFeed
from uibus.infra.dialog_limits import fit_text
from uibus.infra.store import Store
from uibus.pb.cline import ui_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb

log = logging.getLogger("uibus.agents")

HANDLE = "agent/handle/"  # + agent name: the store key of an agent's conversation handle in its uibus session


class Handles:
    """The conversation handles of every hosted agent, in the session store, and what their
    resumes came to (the /metrics counters)."""

    def __init__(self, store: Store, feed: UiFeed, dialogs: Dialogs) -> None:
        self.store = store
        self.feed = feed
        self.dialogs = dialogs
        self.resumed = 0  # conversations picked up again by a new process
        self.resume_failed = 0  # handles found whose conversation could not be picked up (a fresh one started)

    async def read(self, session: str, agent: str) -> dict[str, Any] | None:
        value = await self.store.get(session, HANDLE + agent)
        return value if isinstance(value, dict) else None

    async def keep(self, session: str, agent: str, handle: dict[str, Any]) -> None:
        await self.store.put(session, HANDLE + agent, handle)

    def note_resumed(self, session: str, agent: str) -> None:
        self.resumed += 1
        log.info("agent conversation resumed", extra={"fields": {"session": session, "agent": agent}})

    async def started_fresh(self, session: str, agent: str, why: str) -> None:
        """The agent could not pick its conversation up: one INFO at every UI of the session."""
        self.resume_failed += 1
        log.warning("agent conversation not resumed", extra={"fields": {"session": session, "agent": agent,
                                                                        "why": why}})
        text = f"{agent} starts a new conversation: the earlier one could not be resumed ({why})."
        self.feed.say(session, text, ui_pb2.INFO)
        try:
            await self.dialogs.notify(session, ext_pb.NotifyRequest(message=fit_text(text),
                                                                    notify_type=ext_pb.NOTIFY_TYPE_INFO))
        except Exception as exc:  # the webviews were told; a refused notify must not stop the agent
            log.warning("agent resume notice not sent to the extension UIs", extra={"fields": {"error": str(exc)}})

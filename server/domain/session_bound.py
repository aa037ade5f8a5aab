"""`SessionBound`: the `SessionUi` handed to an agent session (uibus.agents.SessionUi) — the
session's dialogs, fire-and-forget UI and webview messages through the domain's `Dialogs` and
`UiFeed`, never a transport; the agent's conversation handle (uibus.domain.agent_handles), read
before the agent opens and written when the agent reports one, so a new process resumes the
conversation (not for one-shot agents); and its way to uibus's own `/mcp`, with a token minted for
it alone and revoked when the agent session closes.

Why a module of its own: uibus.domain.agent_sessions owns the agent sessions (opening, turns,
closing); this is what one of them sees of its uibus session.
"""

from __future__ import annotations

from typing import Any, Protocol

from uibus.agents import Dialog
from uibus.domain.agent_handles import Handles
from uibus.domain.dialogs import Dialogs
from uibus.domain.feed import UiFeed
from uibus.infra.auth import Tokens
from uibus.pb.cline import ui_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb


class Owner(Protocol):
    """What a SessionBound needs of the agent sessions that made it (uibus.domain.agent_sessions)."""

    tokens: Tokens | None

    def mcp_url(self) -> str: ...


class SessionBound:
    """The `SessionUi` of one uibus session (uibus.agents.SessionUi)."""

    def __init__(self, session: str, dialogs: Dialogs, feed: UiFeed, owner: Owner | None = None, *,
                 agent: str = "", handles: Handles | None = None, handle: dict[str, Any] | None = None,
                 workspace: str = "") -> None:
        self.session = session
        self.workspace = workspace
        self._dialogs = dialogs
        self._feed = feed
        self._owner = owner
        self._agent = agent
        self._handles = handles  # None: a one-shot agent, whose conversation is not kept
        self.handle = handle
        tokens = owner.tokens if owner is not None else None
        self.tenant = tokens.tenant(session) if tokens is not None else "operator"
        self._minted: list[str] = []  # the /mcp tokens minted for this agent session, revoked at its close

    def release(self) -> None:
        """The agent session closed: the tokens minted for it stop working."""
        tokens = self._owner.tokens if self._owner is not None else None
        minted, self._minted = self._minted, []
        if tokens is not None:
            for token in minted:
                tokens.revoke(token)

    async def keep_handle(self, handle: dict[str, Any]) -> None:
        if self._handles is not None:
            await self._handles.keep(self.session, self._agent, handle)
            self.handle = handle

    def resumed(self) -> None:
        if self._handles is not None:
            self._handles.note_resumed(self.session, self._agent)

    async def started_fresh(self, why: str) -> None:
        if self._handles is not None:
            await self._handles.started_fresh(self.session, self._agent, why)

    def mcp_url(self) -> str:
        """uibus's own MCP endpoint, without headers or a token ("": none): which port a sandboxed
        agent's own network forwards to uibus (uibus.agents.network)."""
        return self._owner.mcp_url() if self._owner is not None else ""

    def mcp_endpoint(self, agent: str = "") -> tuple[str, dict[str, str]] | None:
        owner = self._owner
        if owner is None or not (url := owner.mcp_url()):
            return None
        headers = {"x-uibus-session": self.session}
        if agent:  # uibus's MCP server neither lists an agent to itself nor lets it call itself
            headers["x-uibus-agent"] = agent
        if owner.tokens is not None and owner.tokens.enabled:  # a token for this (session, agent) alone
            token = owner.tokens.mint(self.session, agent or self._agent)
            self._minted.append(token)
            # who caused it (the caller whose turn opened the agent), the agent, the session: never the token
            self._dialogs.audit.note("token.mint", session=self.session, agent=agent or self._agent)
            headers["authorization"] = f"Bearer {token}"
        return url, headers

    async def ask(self, request: Dialog) -> ext_pb.DialogResult:
        return await self._dialogs.ask(self.session, request)

    async def fire(self, request: ext_pb.NotifyRequest | ext_pb.SetStatusRequest | ext_pb.SetWidgetRequest
                   | ext_pb.SetTitleRequest | ext_pb.SetEditorTextRequest) -> None:
        dialogs, session = self._dialogs, self.session
        if isinstance(request, ext_pb.NotifyRequest):
            await dialogs.notify(session, request)
        elif isinstance(request, ext_pb.SetStatusRequest):
            await dialogs.set_status(session, request)
        elif isinstance(request, ext_pb.SetWidgetRequest):
            await dialogs.set_widget(session, request)
        elif isinstance(request, ext_pb.SetTitleRequest):
            await dialogs.set_title(session, request)
        else:
            await dialogs.set_editor_text(session, request)

    def say(self, text: str, say: int = ui_pb2.TEXT, *, ts: int = 0, partial: bool = False) -> int:
        return self._feed.say(self.session, text, say, ts=ts, partial=partial)

    def next_ts(self) -> int:
        return self._feed.clock.next()

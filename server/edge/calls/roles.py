"""The roles table: the least role (uibus.infra.roles) each method uibus serves needs of its caller on
the call's session, declared once, and the pipeline's check of it.

Every door runs its calls through the pipeline (gRPC, gRPC-Web, the HTTP APIs, CodeBolt's frames,
MCP's JSON-RPC methods, and /acp, whose methods are calls on the in-process channel: `ACP`), so
this one table decides for all of them; docs/security/roles.md is generated from it, and a test
fails when a registered method has no row here (a new method is never silently someone's).

* `observer` reads (feeds, history, listings, diffs); `participant` chats and publishes as a UI or
  a host; `approver` answers the agent's dialogs and permission questions; `owner` steers (stop,
  mode, model, a new conversation), deletes, invites and manages members, exports and merges.
* A dialog may be addressed to a role or a person (uibus.domain.members.may_answer): Respond needs
  `participant` here and, per dialog, its addressee (default `approver` for select and confirm).

Who is checked: grants of a person (a provider's token, the page's sign-in, a tokens-file
`person=`) and grants holding a role other than `owner`; a machine's tokens-file token is `owner`
of the sessions its patterns allow, as before roles, and pays nothing (the pipeline skips it).
Only ITS_SESSION calls are checked here; listings show a person only sessions where they hold a
role (`RoleCheck.visible`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from uibus.domain.members import ANSWERER
from uibus.infra.auth import Grant
from uibus.infra.errors import PermissionDenied
from uibus.infra.roles import OBSERVER, OWNER, PARTICIPANT, at_least
from uibus.infra.session import session_from_metadata

R, P, W = OBSERVER, PARTICIPANT, OWNER  # read, participate, own (short, for the table)
NONE = ""  # no role on the session needed: the token's own check (and a listing shows only sessions with one)

_UI = "/cline.UiService/"
_WT = "/cline.WorktreeService/"
_HOST = "/uibus.v1.HostService/"
_EXT = "/uibus.v1.ExtensionUiService/"
_SES = "/uibus.v1.SessionService/"
_TEAM = "/uibus.v1.TeamService/"
_AGENT = ".AgentService/"
CODEBOLT_FRAMES = "/codebolt.AgentToApp/"  # a CodeBolt agent's frames: `<family>.<action>`, connect, frame
MCP_TOOLS_CALL = "/mcp/tools/call"

# method path -> least role on the call's session. Methods the pipeline admits without a session
# (open, any token, all sessions: uibus.edge.calls.access) are listed too, for the docs.
TABLE: dict[str, str] = {
    # cline.UiService: a webview reads its session's streams; its clicks reach the host
    **{_UI + m: R for m in (
        "getWebviewHtml", "initializeWebview", "onDidShowAnnouncement", "subscribeToAccountButtonClicked",
        "subscribeToAddToInput", "subscribeToChatButtonClicked", "subscribeToDidBecomeVisible",
        "subscribeToFocusChatInput", "subscribeToHistoryButtonClicked", "subscribeToMarketplaceButtonClicked",
        "subscribeToMcpButtonClicked", "subscribeToPartialMessage", "subscribeToRelinquishControl",
        "subscribeToSettingsButtonClicked", "subscribeToShowWebview", "subscribeToTheme",
        "subscribeToWorktreesButtonClicked")},
    **{_UI + m: P for m in ("openUrl", "openWalkthrough", "scrollToSettings", "setTerminalExecutionMode",
                            "trackIntent")},
    # cline.WorktreeService: reading the worktrees; changing, merging or deleting them is the owner's
    **{_WT + m: R for m in ("getAvailableBranches", "getWorktreeDefaults", "getWorktreeIncludeStatus",
                            "listWorktrees", "trackWorktreeViewOpened")},
    **{_WT + m: W for m in ("checkoutBranch", "createWorktree", "createWorktreeInclude", "deleteWorktree",
                            "mergeWorktree", "switchWorktree")},
    # uibus.v1.HostService: the host (the IDE side) publishes into the session's UIs
    **{_HOST + m: P for m in ("PublishAddToInput", "PublishButtonClick", "PublishDidBecomeVisible",
                              "PublishFocusChatInput", "PublishPartialMessage", "PublishRelinquishControl",
                              "PublishShowWebview", "SetAnnouncement", "SetTheme", "SubscribeHostRequests")},
    _HOST + "GetSessionState": R,
    _HOST + "GetBusStats": W,  # process-wide: an all-sessions token alone (never a person)
    # uibus.v1.ExtensionUiService: an agent asks and publishes; a UI reads and answers
    **{_EXT + m: P for m in ("Select", "Confirm", "Input", "Editor", "Notify", "SetStatus", "SetWidget",
                             "SetTitle", "SetEditorText")},
    _EXT + "Subscribe": R, _EXT + "GetStats": R,
    _EXT + "Respond": P,  # and the dialog's addressee (default approver for select/confirm)
    "/uibus.v1.WebviewService/Subscribe": R,
    "/uibus.v1.CodeBoltService/SendUserMessage": P, "/uibus.v1.CodeBoltService/GetStats": R,
    # uibus.v1.SessionService
    _SES + "ListSessions": R, _SES + "WatchSessions": R,  # filtered: sessions where the caller holds a role
    _SES + "GetWorkspaceDiff": R,
    _SES + "CreateSession": P,  # a person who creates a session becomes its owner
    **{_SES + m: W for m in ("DeleteSession", "StopTurn", "SetMode", "SetModel", "NewConversation",
                             "ExportWorkspace")},
    # uibus.v1.TeamService
    _TEAM + "WhoAmI": R, _TEAM + "AcceptInvite": R,  # sessionless: any token (the invite names the session)
    **{_TEAM + m: W for m in ("ListMembers", "SetRole", "RemoveMember", "CreateInvite", "ListInvites",
                              "RevokeInvite")},
    # uibus.v1.AuditService: who did what (its own access rules: uibus.edge.services.audit)
    "/uibus.v1.AuditService/List": W, "/uibus.v1.AuditService/Export": W, "/uibus.v1.AuditService/Verify": W,
    # neuro-san: the concierge and AgentService of every agent (`/<agent>.AgentService/…` and canonical)
    "/dev.cognizant_ai.neuro_san.api.grpc.concierge.ConciergeService/List": R,
    # probes and reflection (open / any token)
    "/grpc.health.v1.Health/Check": R, "/grpc.health.v1.Health/Watch": R,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": R,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": R,
}
AGENT_METHODS: dict[str, str] = {"StreamingChat": P, "Function": R, "Connectivity": R}  # on `*.AgentService/`
CODEBOLT_ROLE = P  # every frame of a CodeBolt agent's WebSocket (it publishes into the session)
# MCP: every JSON-RPC method is a call `/mcp/<method>`; tools/call by its tool (an agent's name: chat)
MCP_METHODS: dict[str, str] = {
    # the protocol's own and the listings (filtered by role, as ListSessions): no role needed
    **{f"/mcp/{m}": NONE for m in ("initialize", "ping", "tools/list", "resources/list", "resources/read",
                                   "resources/templates/list", "prompts/list", "delete", "server/discover",
                                   "subscriptions/listen", "notification", "unknown", "invalid")},
    "/mcp/tasks/get": R,
    "/mcp/tasks/update": P, "/mcp/tasks/cancel": P,  # a task's input answers, its end (its maker's token)
    MCP_TOOLS_CALL: NONE,  # checked by its tool (MCP_TOOLS)
}
MCP_TOOLS: dict[str, str] = {"list_sessions": NONE, "ask_user": P, "notify_user": P, "set_status": P,
                             "stop_turn": W, "set_agent_mode": W}
MCP_AGENT_TOOL = P  # any other tool is an agent: a chat turn
# ACP (/acp): each editor method runs these calls on the in-process channel (uibus.edge.editors.uplink)
ACP: dict[str, tuple[str, ...]] = {
    "initialize": ("/<agent>.AgentService/Connectivity",),
    "session/new": (_SES + "CreateSession",),
    "session/load": ("/uibus.v1.WebviewService/Subscribe", _EXT + "Subscribe"),
    "session/resume": ("/uibus.v1.WebviewService/Subscribe", _EXT + "Subscribe"),
    "session/list": (_SES + "ListSessions",),
    "session/prompt": ("/<agent>.AgentService/StreamingChat",),
    "session/cancel": ("/<agent>.AgentService/StreamingChat",),  # ends the editor's own turn call
    "session/set_mode": (_SES + "SetMode",),
    "session/request_permission (answer)": (_EXT + "Respond",),
}
# Calls by which a person creates a session that has no record yet: they become its owner.
CREATES = frozenset({_SES + "CreateSession", "/uibus.v1.CodeBoltService/SendUserMessage"})  # + chat turns


def least_of(method: str) -> str | None:
    """The least role of `method` by its path alone; None: not in the table."""
    found = TABLE.get(method, MCP_METHODS.get(method))
    if found is not None:
        return found
    if _AGENT in method:
        return AGENT_METHODS.get(method.rpartition("/")[2])
    if method.startswith(CODEBOLT_FRAMES):
        return CODEBOLT_ROLE
    return None


def tool_role(name: object) -> str:
    return MCP_TOOLS.get(name, MCP_AGENT_TOOL) if isinstance(name, str) else NONE  # no name: InvalidParams


def least_for(method: str, request: Any) -> str:
    """The least role of this call: by its path, and MCP's tools/call by its tool. A method not in
    the table needs `owner` (safe by default; the docs test names it)."""
    if method == MCP_TOOLS_CALL:
        params = getattr(getattr(request, "message", None), "params", None)
        return tool_role(params.get("name")) if isinstance(params, dict) else NONE
    found = least_of(method)
    return OWNER if found is None else found


def creates(method: str, request: Any) -> bool:
    """Whether a person's call of `method` may create its session (a chat's first message too)."""
    if method in CREATES or method.endswith(_AGENT + "StreamingChat"):
        return True
    if method == MCP_TOOLS_CALL:
        params = getattr(getattr(request, "message", None), "params", None)
        return isinstance(params, dict) and params.get("name") not in MCP_TOOLS
    return False


def checked(grant: Grant) -> bool:
    """Whether a grant's calls are checked against the table: a person's, or one holding less than
    owner (a minted agent token is scoped instead: uibus.edge.calls.scope)."""
    return bool(grant.person) or (grant.role != OWNER and not grant.minted)


RoleOf = Callable[[Grant, str], Awaitable[str | None]]


async def tenant_role(grant: Grant, session: str) -> str | None:
    """The role a grant holds by itself (no session members): its role where its patterns allow."""
    return grant.role or None if grant.allows(session) else None


def refusal(method: str, session: str, least: str, held: str | None) -> PermissionDenied:
    return PermissionDenied(f"{method} needs the role {least} on session {session!r}; this caller holds "
                            f"{held or 'no role'} there")


class RoleCheck:
    """The pipeline's role check (`check`) and a person's listings (`visible`). `role_of(grant,
    session)`: the role held (the members' one: uibus.edge.services.team installs it); alone, a
    grant's own role where its patterns allow. `claim(grant, session)`: a person's creating call."""

    def __init__(self, role_of: RoleOf = tenant_role,
                 claim: Callable[[Grant, str], Awaitable[None]] | None = None) -> None:
        self.role_of = role_of
        self.claim = claim

    async def check(self, grant: Grant, method: str, request: Any, session: str) -> None:
        """PERMISSION_DENIED naming the role needed and the role held, when the grant's role on
        `session` is below what the call needs."""
        least = least_for(method, request)
        held = await self.role_of(grant, session)
        if least and not at_least(held, least):
            raise refusal(method, session, least, held)
        ANSWERER.set((grant.person, held or ""))
        if grant.person and self.claim is not None and creates(method, request):
            await self.claim(grant, session)

    def visible(self, grant: Grant) -> Callable[[str], Awaitable[bool]]:
        """Which sessions a listing shows the grant: those where it holds at least observer."""
        async def visible(session: str) -> bool:
            return at_least(await self.role_of(grant, session), OBSERVER)
        return visible


class Deferred:
    """A call admitted but for its role check, which reads the session's members (async): what the
    pipeline's synchronous admission hands its call wrapper for a `checked` grant only."""

    __slots__ = ("grant", "request")

    def __init__(self, grant: Grant, request: Any) -> None:
        self.grant = grant
        self.request = request

    async def settle(self, roles: RoleCheck, method: str, metadata: Any) -> Any:
        """The request, once the role check passed (else its PERMISSION_DENIED)."""
        await roles.check(self.grant, method, self.request, session_from_metadata(metadata))
        return self.request

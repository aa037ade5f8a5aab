"""What a token minted for a hosted agent may do (uibus.infra.auth `Grant.minted`): the calls an agent
needs, nothing else — checked by the handler pipeline (uibus.edge.pipeline) for every call, whichever
transport carries it.

A minted token is the agent's, not its session's (before, a sandboxed agent's token made an
unsandboxed agent of its session run commands — a confused deputy). Default-deny: the methods
listed here alone, two of them checked against the request (StopTurn and MCP's stop_turn: its own
agent only; MCP's tools/call: the user tools and list_sessions). Everything else — a chat turn
with any agent (its own included: gRPC, the neuro-san HTTP API, MCP agent tools, ACP over HTTP,
CodeBolt), steering, creating or deleting sessions, publishing as a UI, answering dialogs — is
PERMISSION_DENIED with a message that says whose the token is and what it may do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from uibus.edge.calls.context import Rejected
from uibus.infra.auth import Grant
from uibus.infra.errors import PermissionDenied

# What the refusal says an agent's token may do (the methods and tools below, in words).
AGENT_MAY = ("ask and notify the user (extension-UI dialogs; MCP ask_user, notify_user, set_status), list its "
             "own session (ListSessions, WatchSessions; MCP list_sessions) and stop its own turn (StopTurn; MCP "
             "stop_turn) — never chat with, steer or start an agent, create or delete sessions, or publish as a UI")
_EXT_UI = "/uibus.v1.ExtensionUiService/"
AGENT_METHODS = frozenset({
    *(_EXT_UI + m for m in ("Select", "Confirm", "Input", "Editor", "Notify", "SetStatus", "SetTitle", "SetWidget",
                            "SetEditorText")),
    "/uibus.v1.SessionService/ListSessions", "/uibus.v1.SessionService/WatchSessions",
    # MCP's own methods (uibus.edge.mcp.protocol paths); tools/call is checked tool by tool
    *(f"/mcp/{m}" for m in ("initialize", "ping", "tools/list", "resources/list", "resources/templates/list",
                            "prompts/list", "delete", "notification", "unknown", "invalid")),
})
AGENT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # probes, and what services exist
AGENT_TOOLS = frozenset({"ask_user", "notify_user", "set_status", "list_sessions"})  # MCP tools, + its own stop_turn
STOP_TURN = "/uibus.v1.SessionService/StopTurn"
MCP_TOOLS_CALL = "/mcp/tools/call"

AgentCheck = Callable[[Grant, Any], "str | None"]


def _allowed(grant: Grant, request: Any) -> str | None:
    return None


def _denied(grant: Grant, request: Any) -> str | None:
    return "is not a call an agent's token may make"


def _only_its_own(grant: Grant, agent: object) -> str | None:
    return None if agent == grant.agent else f"may stop its own turn ({grant.agent}) only, not {str(agent)[:64]!r}'s"


def _own_turn(grant: Grant, request: Any) -> str | None:
    return None if request.__class__ is Rejected else _only_its_own(grant, getattr(request, "agent", None))


def _agent_tool(grant: Grant, request: Any) -> str | None:
    """tools/call of MCP (a `uibus.edge.mcp.server.Call`): the user tools, list_sessions, its own stop_turn."""
    params = getattr(getattr(request, "message", None), "params", None)
    if request.__class__ is Rejected or not isinstance(params, dict):
        return None  # refused as what it is (undecodable), or answered InvalidParams by the handler
    name = params.get("name")
    if name in AGENT_TOOLS:
        return None
    if name == "stop_turn":
        args = params.get("arguments")
        return _only_its_own(grant, args.get("agent") if isinstance(args, dict) else None)
    return f"of the tool {str(name)[:64]!r}, which is not one an agent's token may call"


def agent_tool(grant: Grant, name: str) -> bool:
    """Whether an agent's token may call the MCP tool `name` at all (what tools/list shows it);
    stop_turn is listed, and checked per call (its own turn only)."""
    return name in AGENT_TOOLS or name == "stop_turn"


def agent_check(method: str) -> AgentCheck:
    """What an agent's minted token may do with `method`: a check of (grant, request) returning why
    the call is refused (None: allowed). Default-deny: a method not listed is refused."""
    if method in AGENT_METHODS or method.startswith(AGENT_PREFIXES):
        return _allowed
    if method == STOP_TURN:
        return _own_turn
    if method == MCP_TOOLS_CALL:
        return _agent_tool
    return _denied


def agent_refusal(grant: Grant, method: str, why: str) -> PermissionDenied:
    return PermissionDenied(f"this token belongs to agent {grant.agent!r} (minted for uibus's /mcp in session "
                            f"{grant.patterns[0]!r}), not to a user: {method} {why}; an agent's token may {AGENT_MAY}")

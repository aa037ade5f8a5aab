"""The sessions API as MCP tools: an agent (or an operator's MCP client) can see the sessions its
token may use and stop or steer a hosted agent of its session, as any UI can (uibus.domain.sessions).

`list_sessions` spans sessions: it shows only those the caller's token allows (the pipeline's
`visible_sessions`, handed in by the server). The steering tools act on the caller's session
(`x-uibus-session`), which the pipeline already checked against the token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf import json_format

from uibus.domain.sessions import Sessions, shown
from uibus.edge.mcp import protocol
from uibus.edge.mcp.protocol import InvalidParams
from uibus.infra.errors import NotFound
from uibus.replicas.placement import Placement

RESOURCE_PREFIX = "uibus://sessions/"  # a session as an MCP resource: its entry of list_sessions, as JSON
_STRING = {"type": "string"}
SESSION_TOOLS: dict[str, dict[str, Any]] = {
    "list_sessions": {
        "name": "list_sessions",
        "title": "List sessions",
        "description": ("The uibus sessions this token may use, most recently active first: title, last activity, "
                        "agents running a turn, dialogs waiting for an answer, each hosted agent's state."),
        "inputSchema": {"type": "object", "properties": {"prefix": _STRING}, "additionalProperties": False},
    },
    "stop_turn": {
        "name": "stop_turn",
        "title": "Stop an agent's turn",
        "description": "Stop the turn a hosted agent runs in this session now, whoever started it.",
        "inputSchema": {"type": "object", "properties": {"agent": _STRING}, "required": ["agent"],
                        "additionalProperties": False},
    },
    "set_agent_mode": {
        "name": "set_agent_mode",
        "title": "Set an agent's mode",
        "description": "Set the mode of a hosted agent of this session (one of the modes list_sessions shows).",
        "inputSchema": {"type": "object", "properties": {"agent": _STRING, "mode_id": _STRING},
                        "required": ["agent", "mode_id"], "additionalProperties": False},
    },
}


def _arg(args: dict[str, Any], tool: str, key: str, required: bool) -> str:
    value = args.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise InvalidParams(f"{tool} needs arguments.{key} (a string)")
    return value


async def run_session_tool(sessions: Sessions, placement: Placement, tool: str, session: str, args: dict[str, Any],
                           visible: Callable[[str], bool]) -> AsyncIterator[dict[str, Any]]:
    """The tools/call result of one session tool (yielded once, as the server's tools do)."""
    allowed = SESSION_TOOLS[tool]["inputSchema"]["properties"]
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        raise InvalidParams(f"{tool} takes no argument {', '.join(unknown)} (it takes: {', '.join(allowed)})")
    if tool == "list_sessions":
        listed = await sessions.list(visible, _arg(args, tool, "prefix", False))
        data = json_format.MessageToDict(listed, preserving_proto_field_name=True)
        lines = [f"{s.session}: {s.title or '(untitled)'}" + (f" — running {', '.join(s.running)}" if s.running else "")
                 + (f" — {s.waiting_dialogs} dialog(s) waiting" if s.waiting_dialogs else "")
                 for s in listed.sessions]
        yield protocol.text_result("\n".join(lines) or "No sessions.", {"sessions": data.get("sessions", [])})
        return
    agent = _arg(args, tool, "agent", True)
    if tool == "stop_turn":
        stopped = await placement.stop(session, agent)
        sessions.poke()
        yield protocol.text_result(f"Stopped the turn of {agent}." if stopped else f"{agent} runs no turn now.",
                                   {"stopped": stopped})
        return
    state = await placement.set_mode(session, agent, _arg(args, tool, "mode_id", True))
    sessions.poke()
    yield protocol.text_result(f"{agent} is in mode {state.current_mode}.",
                               json_format.MessageToDict(state, preserving_proto_field_name=True))


async def session_resources(sessions: Sessions, visible: Callable[[str], bool]) -> list[dict[str, Any]]:
    """The sessions the caller may see, as resources (`resources/list`): what an MCP client shows
    as the things it can read, and what `subscriptions/listen` announces changes of."""
    listed = await sessions.list(visible)
    return [{"uri": RESOURCE_PREFIX + s.session, "name": s.session, "title": s.title or s.session,
             "mimeType": "application/json",
             "description": f"uibus session {s.session}: title, last activity, running agents, waiting dialogs"}
            for s in listed.sessions]


async def read_session(sessions: Sessions, uri: Any, visible: Callable[[str], bool]) -> dict[str, Any]:
    """`resources/read` of a session resource: its entry as list_sessions reports it."""
    if not isinstance(uri, str) or not uri.startswith(RESOURCE_PREFIX):
        raise InvalidParams(f"resources/read needs params.uri, a resource of resources/list "
                            f"({RESOURCE_PREFIX}<session>)")
    name = uri[len(RESOURCE_PREFIX):]
    if not name or not await shown(visible, name):
        raise NotFound(f"no resource {uri[:200]!r} (no session of that name this token may see)")
    entry = await sessions.get(name)
    text = json_format.MessageToJson(entry, preserving_proto_field_name=True, indent=None)
    return {"contents": [{"uri": uri, "mimeType": "application/json", "text": text}]}

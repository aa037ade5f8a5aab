"""What uibus's UIs see, as ACP `session/update`s: a turn's MAXIMAL ChatResponses (the editor's own
prompt), the session's Cline messages (turns other UIs started, and the transcript `session/load`
replays), and a dialog as `session/request_permission` options or an elicitation form.

Each function returns the `update` objects (`{"sessionUpdate": ...}`); the caller wraps them in a
notification of its session. Names are the protocol's (the ACP schema in @agentclientprotocol/sdk).
"""

from __future__ import annotations

import json
import re
from typing import Any

from google.protobuf import json_format

from uibus.pb.cline import ui_pb2
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb
from uibus.pb.uibus.v1 import sessions_pb2

_AI, _AGENT = chat_pb2.ChatMessage.AI, chat_pb2.ChatMessage.AGENT
_TOOL_RESULT, _FRAMEWORK = chat_pb2.ChatMessage.AGENT_TOOL_RESULT, chat_pb2.ChatMessage.AGENT_FRAMEWORK
# A hosted agent's tool names as ACP's ToolKind (pi's tools; an ACP agent's kinds pass as they are).
_KINDS = {"bash": "execute", "read": "read", "write": "edit", "edit": "edit", "ls": "search", "find": "search",
          "grep": "search", "readFile": "read", "editedExistingFile": "edit", "newFileCreated": "edit",
          "searchFiles": "search", "listFilesTopLevel": "search", "listFilesRecursive": "search",
          "webFetch": "fetch"}
_ACP_KINDS = frozenset({"read", "edit", "delete", "move", "search", "execute", "think", "fetch", "switch_mode",
                        "other"})
_PLAN_LINE = re.compile(r"- \[( |x)\] (.*?)( \*\(in progress\)\*)?$")


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def chunk(kind: str, value: str) -> dict[str, Any]:
    return {"sessionUpdate": kind, "content": text(value)}


def _kind(tool: str) -> str:
    return tool if tool in _ACP_KINDS else _KINDS.get(tool, "other")


def _output(value: str) -> list[dict[str, Any]]:
    return [{"type": "content", "content": text(value)}] if value else []


# ---- the editor's own turn: MAXIMAL ChatResponses ----

def _tool_start(s: dict[str, Any]) -> dict[str, Any]:
    tool = str(s.get("tool") or "")
    args = s.get("args") if isinstance(s.get("args"), dict) else {}
    title = str(s.get("title") or args.get("command") or args.get("path") or tool)
    update: dict[str, Any] = {"sessionUpdate": "tool_call", "toolCallId": str(s.get("tool_call_id") or ""),
                              "title": title, "kind": _kind(tool),
                              "status": s.get("status") if s.get("status") in ("pending", "in_progress") else
                              "in_progress", "rawInput": args}
    path = args.get("path")
    if isinstance(path, str) and path:
        update["locations"] = [{"path": path}]
        if tool == "edit":  # pi's edit: the change itself, as ACP's diff content
            update["content"] = [{"type": "diff", "path": path, "oldText": str(args.get("oldText") or ""),
                                  "newText": str(args.get("newText") or "")}]
        elif tool == "write":
            update["content"] = [{"type": "diff", "path": path, "oldText": None,
                                  "newText": str(args.get("content") or "")}]
    return update


def turn_updates(response: agent_pb2.ChatResponse) -> list[dict[str, Any]]:
    """The updates one ChatResponse of the editor's turn shows (the final answer is the caller's)."""
    message = response.response
    if message.type == _AI:
        return [chunk("agent_message_chunk", message.text)] if message.text else []
    if message.type not in (_AGENT, _TOOL_RESULT) or not message.HasField("structure"):
        return []
    s = json_format.MessageToDict(message.structure)
    kind = s.get("kind")
    if kind == "thinking":
        return [chunk("agent_thought_chunk", message.text)] if message.text else []
    if kind == "tool_start":
        return [_tool_start(s)]
    if kind == "tool_end":
        failed = s.get("is_error") is True or s.get("status") == "failed"
        return [{"sessionUpdate": "tool_call_update", "toolCallId": str(s.get("tool_call_id") or ""),
                 "status": "failed" if failed else "completed", "content": _output(message.text)}]
    if kind == "plan":
        entries = [e for e in s.get("entries") or [] if isinstance(e, dict)]
        return [{"sessionUpdate": "plan", "entries": [
            {"content": str(e.get("content") or ""), "priority": e.get("priority") if e.get("priority") in
             ("high", "medium", "low") else "medium",
             "status": e.get("status") if e.get("status") in ("pending", "in_progress", "completed") else "pending"}
            for e in entries]}]
    return []


def is_final(response: agent_pb2.ChatResponse) -> bool:
    return response.response.type == _FRAMEWORK


def stop_reason(final: agent_pb2.ChatResponse) -> str:
    """The hosted agent's own stop reason, which uibus puts in the final message's structure
    (`stop_reason`; ACP agents say one); "" where the agent said none."""
    message = final.response
    if not message.HasField("structure"):
        return ""
    found = message.structure.fields.get("stop_reason")
    return found.string_value if found is not None else ""


# ---- turns other UIs started, and the transcript: the session's Cline messages ----

class FeedView:
    """The session's Cline messages as updates. A message grows (same `ts`, longer text) while it is
    partial: the editor gets what is new each time. Bounded: finished messages are forgotten."""

    MAX_TRACKED = 256

    def __init__(self) -> None:
        self._shown: dict[int, str] = {}  # ts -> the text shown so far
        self._command = 0  # the ts of the last command, whose output COMMAND_OUTPUT_SAY is

    def _delta(self, m: ui_pb2.ClineMessage) -> str:
        before = self._shown.get(m.ts, "")
        new = m.text[len(before):] if m.text.startswith(before) else ""
        if m.partial:
            if len(self._shown) >= self.MAX_TRACKED:
                self._shown.pop(next(iter(self._shown)))
            self._shown[m.ts] = m.text if m.text.startswith(before) else before
        else:
            self._shown.pop(m.ts, None)
        return new

    def updates(self, m: ui_pb2.ClineMessage) -> list[dict[str, Any]]:
        if m.type != ui_pb2.SAY:
            return []
        say = m.say
        if say in (ui_pb2.TEXT, ui_pb2.REASONING, ui_pb2.USER_FEEDBACK, ui_pb2.ERROR):
            delta = self._delta(m)
            if not delta:
                return []
            kind = {ui_pb2.REASONING: "agent_thought_chunk", ui_pb2.USER_FEEDBACK: "user_message_chunk"}.get(
                say, "agent_message_chunk")
            return [chunk(kind, delta)]
        tool_id = f"uibus-{m.ts}"
        if say == ui_pb2.COMMAND_SAY:
            first = m.ts not in self._shown and m.ts != self._command
            self._command = m.ts
            self._shown.pop(m.ts, None)
            return [{"sessionUpdate": "tool_call", "toolCallId": tool_id, "title": m.text, "kind": "execute",
                     "status": "in_progress", "rawInput": {"command": m.text}}] if first else []
        if say == ui_pb2.COMMAND_OUTPUT_SAY and self._command:
            return [{"sessionUpdate": "tool_call_update", "toolCallId": f"uibus-{self._command}",
                     "status": "in_progress" if m.partial else "completed", "content": _output(m.text)}]
        if say == ui_pb2.TOOL_SAY:
            return [self._tool(m, tool_id)]
        if say == ui_pb2.INFO and m.text.startswith("Plan\n\n"):
            entries = []
            for line in m.text[6:].splitlines():
                found = _PLAN_LINE.match(line)
                if found:
                    entries.append({"content": found.group(2), "priority": "medium", "status":
                                    "completed" if found.group(1) == "x" else
                                    "in_progress" if found.group(3) else "pending"})
            return [{"sessionUpdate": "plan", "entries": entries}]
        return []

    def _tool(self, m: ui_pb2.ClineMessage, tool_id: str) -> dict[str, Any]:
        try:
            body = json.loads(m.text)
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        tool = str(body.get("tool") or "")
        path = str(body.get("path") or "")
        output = str(body.get("content") or body.get("diff") or "")
        status = "in_progress" if m.partial else "failed" if body.get("error") else "completed"
        first = m.ts not in self._shown
        if m.partial:
            self._shown[m.ts] = ""
        else:
            self._shown.pop(m.ts, None)
        update: dict[str, Any] = {"sessionUpdate": "tool_call" if first else "tool_call_update",
                                  "toolCallId": tool_id, "status": status, "content": _output(output)}
        if first:
            update.update(title=f"{tool} {path}".strip(), kind=_kind(tool))
            if path:
                update["locations"] = [{"path": path}]
        return update


# ---- what the agent offers (uibus.v1.SessionService's AgentState) ----

def modes(state: sessions_pb2.AgentState | None) -> dict[str, Any] | None:
    """ACP's SessionModeState of the agent's modes; None when it offers none."""
    if state is None or not state.modes:
        return None
    return {"currentModeId": state.current_mode or state.modes[0].id, "availableModes": [
        {"id": m.id, "name": m.name or m.id, **({"description": m.description} if m.description else {})}
        for m in state.modes]}


def commands(state: sessions_pb2.AgentState | None) -> dict[str, Any] | None:
    """An `available_commands_update` of the agent's commands; None when it has none."""
    if state is None or not state.commands:
        return None
    return {"sessionUpdate": "available_commands_update", "availableCommands": [
        {"name": c.name, "description": c.description, **({"input": {"hint": c.input_hint}} if c.input_hint else {})}
        for c in state.commands]}


# ---- dialogs ----

_ALLOW = ("allow", "yes", "approve", "accept", "ok", "continue", "run")
_REJECT = ("block", "reject", "deny", "no", "cancel", "abort", "stop", "skip", "don't", "do not")


def option_kind(label: str) -> str:
    """ACP's hint for an option the agent named: allow/reject, once/always, from its words."""
    low = label.strip().lower()
    always = "always" in low
    if low.startswith(_REJECT) or any(f" {w}" in f" {low}" for w in ("block", "reject", "deny")):
        return "reject_always" if always else "reject_once"
    if low.startswith(_ALLOW) or "allow" in low:
        return "allow_always" if always else "allow_once"
    return "allow_once"


def permission(session: str, request: ext_pb.ExtensionUiRequest) -> dict[str, Any] | None:
    """A select or confirm as `session/request_permission` params (options named as the agent named
    them; the option id is the label, which is what Respond takes); None for other requests."""
    which = request.WhichOneof("method")
    if which == "select":
        title, options = request.select.title, [
            {"optionId": o, "name": o, "kind": option_kind(o)} for o in request.select.options]
    elif which == "confirm":
        title = request.confirm.title + (f"\n\n{request.confirm.message}" if request.confirm.message else "")
        options = [{"optionId": "yes", "name": "Yes", "kind": "allow_once"},
                   {"optionId": "no", "name": "No", "kind": "reject_once"}]
    else:
        return None
    return {"sessionId": session, "options": options, "toolCall": {
        "toolCallId": f"uibus-dialog-{request.id}", "title": title, "kind": "other", "status": "pending"}}


def elicitation(session: str, request: ext_pb.ExtensionUiRequest) -> dict[str, Any] | None:
    """An input or editor dialog as an `elicitation/create` form of one string field, `value`."""
    which = request.WhichOneof("method")
    if which == "input":
        title, field = request.input.title, {"type": "string", "title": request.input.title}
        if request.input.HasField("placeholder"):
            field["description"] = request.input.placeholder
    elif which == "editor":
        title, field = request.editor.title, {"type": "string", "title": request.editor.title}
        if request.editor.HasField("prefill"):
            field["default"] = request.editor.prefill
    else:
        return None
    return {"sessionId": session, "mode": "form", "message": title,
            "requestedSchema": {"type": "object", "properties": {"value": field}, "required": ["value"]}}


def answer(request: ext_pb.ExtensionUiRequest, result: Any) -> ext_pb.RespondRequest:
    """The editor's answer (a permission outcome or an elicitation result) as ExtensionUiService's
    Respond; anything it did not choose is a dismissal."""
    which = request.WhichOneof("method")
    reply = ext_pb.RespondRequest(id=request.id)
    result = result if isinstance(result, dict) else {}
    if which in ("select", "confirm"):
        outcome = result.get("outcome") if isinstance(result.get("outcome"), dict) else {}
        chosen = outcome.get("optionId") if outcome.get("outcome") == "selected" else None
        if isinstance(chosen, str) and which == "select":
            reply.value = chosen
        elif chosen in ("yes", "no"):
            reply.confirmed = chosen == "yes"
        else:
            reply.cancelled = True
    else:
        content = result.get("content") if isinstance(result.get("content"), dict) else {}
        if result.get("action") == "accept" and isinstance(content.get("value"), str):
            reply.value = content["value"]
        else:
            reply.cancelled = True
    return reply

"""What a hosted agent's work looks like to uibus's UIs, whatever protocol it speaks (pi's RPC mode,
ACP): the pieces for MAXIMAL callers and the Cline messages of the session's webviews, and the
ClineSayTool JSON (what Cline's webview renders a tool call with) for each protocol's tool calls.

`ClineView` keeps the messages one turn is growing (by a name the protocol chooses: "thinking", a
tool call's id), republishes each at most every PARTIAL_INTERVAL_S while it grows (a reply's
thinking can change hundreds of times a second; the bus coalesces states by ts anyway) and ends
every one of them when the turn ends, however it ends, so no webview shows an agent working forever.
"""

from __future__ import annotations

import json
import time
from typing import Any

from google.protobuf import struct_pb2

from uibus.agents import SessionUi
from uibus.agents.diffs import unified
from uibus.infra.dialog_limits import safe_text as text
from uibus.pb.neuro_san.api.grpc import chat_pb2

PARTIAL_INTERVAL_S = 0.05  # a growing Cline message is republished at most this often
AGENT, TOOL_RESULT = chat_pb2.ChatMessage.AGENT, chat_pb2.ChatMessage.AGENT_TOOL_RESULT
# pi's tools as Cline's ClineSayTool names them (webview-ui renders these).
PI_TOOLS = {"read": "readFile", "write": "newFileCreated", "edit": "editedExistingFile", "ls": "listFilesTopLevel",
            "find": "searchFiles", "grep": "searchFiles"}
# ACP tool kinds as ClineSayTool names them (execute is a command of its own).
ACP_TOOLS = {"read": "readFile", "edit": "editedExistingFile", "delete": "editedExistingFile",
             "move": "editedExistingFile", "search": "searchFiles", "fetch": "webFetch"}


def struct(value: dict[str, Any]) -> struct_pb2.Struct:
    """A Struct of the agent's JSON (for a MAXIMAL message's `structure`)."""
    s = struct_pb2.Struct()
    try:
        s.update(json.loads(json.dumps(value, default=str, allow_nan=False)))
    except (ValueError, TypeError):  # numbers JSON cannot carry, odd keys: keep the gist
        s.update({"summary": text(json.dumps(value, default=str))[:2000]})
    return s


def message(message_type: int, body: str, /, **structure: Any) -> chat_pb2.ChatMessage:
    """A MAXIMAL message of the agent's work (thinking, a tool starting or ending, a plan)."""
    return chat_pb2.ChatMessage(type=message_type, text=body, structure=struct(structure))  # type: ignore[arg-type]


class ClineView:
    """The Cline messages one turn shows, by name."""

    def __init__(self, ui: SessionUi) -> None:
        self.ui = ui
        self._growing: dict[str, tuple[int, int, str, float]] = {}  # name -> (ts, say, text, published at)

    def shown(self, name: str) -> str:
        """The text `name` shows now ("" if nothing yet)."""
        entry = self._growing.get(name)
        return entry[2] if entry is not None else ""

    def show(self, name: str, say: int, body: str, *, partial: bool) -> None:
        ts, _, _, at = self._growing.get(name, (0, say, "", 0.0))
        ts = ts or self.ui.next_ts()
        now = time.monotonic()
        if partial and now - at < PARTIAL_INTERVAL_S:
            self._growing[name] = (ts, say, body, at)
            return
        self.ui.say(body, say, ts=ts, partial=partial)
        if partial:
            self._growing[name] = (ts, say, body, now)
        else:
            self._growing.pop(name, None)

    def finish(self) -> None:
        """Ends every message still growing."""
        for ts, say, body, _ in list(self._growing.values()):
            self.ui.say(body, say, ts=ts)
        self._growing.clear()


def pi_tool(name: str, args: dict[str, Any], output: str | None) -> str:
    """Cline's ClineSayTool JSON for one of a pi agent's tool calls (`output` None while it runs)."""
    tool = PI_TOOLS.get(name)
    path = text(args.get("path", args.get("file_path", "")))
    if tool is None:
        body: dict[str, Any] = {"tool": name, "content": text(json.dumps(args, default=str))[:4000]}
    else:
        body = {"tool": tool, "path": path}
        if name in ("find", "grep"):
            body["regex"] = text(args.get("pattern", ""))
        if name == "write":
            body["content"] = text(args.get("content", ""))
            body["diff"] = unified(path, None, body["content"])
        elif name == "edit":
            body["diff"] = pi_edit_diff(path, args)
        elif output is not None:
            body["content"] = output
    return json.dumps(body)


def pi_edit_diff(path: str, args: dict[str, Any]) -> str:
    """A unified diff of each replacement of pi's `edit` tool (`edits: [{oldText, newText}]`, or the
    older single `oldText`/`newText`); line numbers count from each replaced block."""
    edits = args.get("edits")
    if not isinstance(edits, list):
        edits = [{"oldText": args.get("oldText", ""), "newText": args.get("newText", "")}]
    parts = [unified(path, text(e.get("oldText", "")), text(e.get("newText", "")))
             for e in edits if isinstance(e, dict)]
    return "\n".join(p for p in parts if p)


def acp_tool(call: dict[str, Any]) -> str:
    """Cline's ClineSayTool JSON for an ACP tool call (what its `tool_call`/`tool_call_update`
    notifications told so far: title, kind, status, locations, output)."""
    locations = call.get("locations") if isinstance(call.get("locations"), list) else []
    path = next((text(loc.get("path")) for loc in locations if isinstance(loc, dict)), "")
    tool = ACP_TOOLS.get(call["kind"], text(call["kind"]))
    body: dict[str, Any] = {"tool": tool, "path": path or text(call["title"])}
    output = call["output"]
    if output:
        is_diff = output.startswith("--- ")  # ACP `diff` content, made a unified diff by the session
        body["diff" if call["kind"] == "edit" or is_diff else "content"] = output
        if is_diff and output.startswith("--- /dev/null") and "\n--- " not in output:
            body["tool"] = "newFileCreated"  # one diff, from nothing: a file the agent created
            body["content"] = "\n".join(line[1:] for line in output.splitlines()[3:] if line.startswith("+"))
    if call["status"] == "failed":
        body["error"] = True
    return json.dumps(body)

"""The ACP v2 draft's wire shapes, for an editor that negotiated protocol version 2: what v1's
updates, answers and questions look like in v2. Framing only — every update is made once, in v1's
shape (uibus.edge.editors.updates), by the one path both versions share, and this module reshapes
it on its way out, so a v2 editor sees exactly what a v1 editor sees, worded as v2 words it.

The shapes are `@agentclientprotocol/sdk` 2.4.0's v2 schema (what clients run), where the draft's
prose differs (docs/protocols/acp.md, "v2 draft"):

* message chunks carry a `messageId`: uibus's updates do not say which message a piece belongs
  to, so a run of pieces of one kind is one message, and anything else in between (another kind,
  a tool call, a state change) starts the next. Ids are this connection's (`m<n>-<token>`): a
  replay to another connection names the same messages with ids of its own;
* `tool_call` is gone: every tool call is a `tool_call_update` upsert; diff content is `changes`
  plus a `git_patch`;
* `plan` is `plan_update` of one item plan (`planId` "uibus-plan": uibus keeps one plan per session);
* `current_mode_update` is a `config_option_update` of the `mode` option (when the modes are known);
* commands are typed (`type: "command"`, input `type: "text"`);
* `session/request_permission` has a `title` and the tool call as its `subject`.
"""

from __future__ import annotations

import difflib
import secrets
from typing import Any

from uibus.edge.editors.cursor import CURSOR_KEY
from uibus.infra.jsonrpc import INVALID_PARAMS, RpcError
from uibus.infra.session import MAX_SINCE

PROTOCOL_VERSION = 2
PLAN_ID = "uibus-plan"
MODE_OPTION = "mode"
SEQ_CURSOR = "_uibus/seq"  # replayFrom {"type": "_uibus/seq", "seq": N}: the log from position N on (inclusive)
_CHUNKS = frozenset({"user_message_chunk", "agent_message_chunk", "agent_thought_chunk"})


def initialize_result(v1: dict[str, Any]) -> dict[str, Any]:
    """v1's initialize answer (what uibus offers, decided once) in v2's shape: `info`, and the
    capabilities as objects (`{}` is "supported"). No `authMethods`: the token is the transport's,
    so there is no `auth/login` (nor `auth/logout`, which comes with it)."""
    caps = v1["agentCapabilities"]
    prompt = {name: {} for name, on in caps["promptCapabilities"].items() if on}
    session: dict[str, Any] = {"prompt": prompt}
    if "additionalDirectories" in caps["sessionCapabilities"]:
        session["additionalDirectories"] = {}
    return {"protocolVersion": PROTOCOL_VERSION, "info": v1["agentInfo"],
            "capabilities": {"session": session}}


def mode_option(modes: dict[str, Any]) -> dict[str, Any]:
    """v1's SessionModeState as v2's `mode` config option (a select)."""
    return {"type": "select", "configId": MODE_OPTION, "name": "Mode", "category": "mode",
            "currentValue": modes["currentModeId"],
            "options": [{"value": m["id"], "name": m["name"], **({"description": m["description"]}
                                                                  if m.get("description") else {})}
                        for m in modes["availableModes"]]}


def commands(available: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """v1's available commands, typed as v2 types them."""
    out = []
    for c in available:
        command: dict[str, Any] = {"type": "command", "name": c["name"], "description": c["description"]}
        if isinstance(c.get("input"), dict):
            command["input"] = {"type": "text", "hint": c["input"].get("hint", "")}
        out.append(command)
    return out


def _patch(path: str, old: str | None, new: str) -> str:
    """A git patch of one file's change (an added file when `old` is None)."""
    name = path.lstrip("/")
    before = "/dev/null" if old is None else f"a/{name}"
    lines = difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                 before, f"b/{name}")
    head = f"diff --git a/{name} b/{name}\n" + ("new file mode 100644\n" if old is None else "")
    return head + "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                          for line in lines)


def tool_content(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """v1's tool call content in v2's shapes: a diff as its `changes` and a `git_patch`."""
    out = []
    for item in content:
        if item.get("type") == "diff":
            old = item.get("oldText")
            out.append({"type": "diff", "changes": [{"operation": "add" if old is None else "modify",
                                                     "path": item["path"], "fileType": "text"}],
                        "patch": {"format": "git_patch", "text": _patch(item["path"], old, item.get("newText", ""))}})
        else:
            out.append(item)
    return out


def replay_cursor(params: dict[str, Any]) -> dict[str, Any]:
    """session/resume's params with a v2 `replayFrom` of uibus's own (`_uibus/seq`, inclusive) said
    as the cursor uibus.edge.editors.cursor reads (`_meta` `uibus/since`, exclusive). `start` passes
    as it is; any other type is -32602, as the draft says, never a resume without the replay."""
    start = params.get("replayFrom")
    if not isinstance(start, dict) or start.get("type") != SEQ_CURSOR:
        if isinstance(start, dict) and start.get("type") not in ("start", None):
            raise RpcError(INVALID_PARAMS, f"replayFrom type {str(start.get('type'))[:40]!r} is not supported: "
                                           f"uibus replays from {{\"type\": \"start\"}} or {{\"type\": "
                                           f"\"{SEQ_CURSOR}\", \"seq\": N}}")
        return params
    seq = start.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq <= MAX_SINCE + 1:
        raise RpcError(INVALID_PARAMS, f"replayFrom {SEQ_CURSOR} needs its seq (a positive integer): the "
                                       "_meta.uibus/seq of the first update to replay")
    rest = {k: v for k, v in params.items() if k != "replayFrom"}
    meta = rest.get("_meta") if isinstance(rest.get("_meta"), dict) else {}
    return {**rest, "_meta": {**meta, CURSOR_KEY: seq - 1}}


class Shapes:
    """One v2 connection's reshaping of v1 updates: per session, the message the current run of
    pieces belongs to, and the modes (for `current_mode_update`)."""

    def __init__(self) -> None:
        self._token = secrets.token_hex(4)
        self._count = 0
        self._runs: dict[str, tuple[str, str]] = {}  # session -> (chunk kind, messageId) of the run
        self.modes: dict[str, dict[str, Any]] = {}  # session -> v1 SessionModeState, once known

    def message_id(self) -> str:
        self._count += 1
        return f"m{self._count}-{self._token}"

    def forget(self, session: str) -> None:
        self._runs.pop(session, None)

    def update(self, params: dict[str, Any]) -> dict[str, Any] | None:
        """One session/update's params in v2's shape; None when v2 has no word for it."""
        session, update = params["sessionId"], params["update"]
        kind = update.get("sessionUpdate")
        if kind in _CHUNKS:
            run = self._runs.get(session)
            if run is None or run[0] != kind:
                run = (kind, self.message_id())
                self._runs[session] = run
            return {**params, "update": {**update, "messageId": run[1]}}
        self._runs.pop(session, None)  # anything else ends the run of pieces
        if kind in ("tool_call", "tool_call_update"):
            shaped = {**update, "sessionUpdate": "tool_call_update"}
            if "content" in update:
                shaped["content"] = tool_content(update["content"])
            return {**params, "update": shaped}
        if kind == "plan":
            return {**params, "update": {"sessionUpdate": "plan_update", "plan": {
                "type": "items", "planId": PLAN_ID, "entries": update["entries"]}}}
        if kind == "available_commands_update":
            return {**params, "update": {"sessionUpdate": kind, "availableCommands": commands(
                update["availableCommands"])}}
        if kind == "current_mode_update":
            modes = self.modes.get(session)
            if modes is None:
                return None  # v2 says a mode as the whole option, whose choices uibus has not heard yet
            modes["currentModeId"] = update["currentModeId"]
            return {**params, "update": {"sessionUpdate": "config_option_update",
                                         "configOptions": [mode_option(modes)]}}
        return params  # v2's own (state_update, user_message) and what both name alike


def permission(params: dict[str, Any]) -> dict[str, Any]:
    """v1's session/request_permission params in v2's shape: the title is the request's, the tool
    call its subject (a first-seen toolCallId makes the tool call at the editor)."""
    call = dict(params["toolCall"])
    title, _, description = str(call.get("title", "")).partition("\n\n")
    shaped: dict[str, Any] = {"sessionId": params["sessionId"], "title": title, "options": params["options"],
                              "subject": {"type": "tool_call", "toolCall": call}}
    if description:
        shaped["description"] = description
    return shaped

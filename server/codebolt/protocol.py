"""The CodeBolt agent-to-app envelope: parsing both wire forms into one `Request`, and building
the `ServiceResponse` that goes back.

Two forms arrive on the same socket (SPEC.md §7):

* the AsyncAPI form, `{type: "chatEvent", action: "sendMessage", requestId, message: {...}}`;
* the flatter form the codeboltjs library sends, where chat actions are the `type` itself
  (`{type: "sendMessage", message: "hi"}`), memory/state events carry their fields at the top
  level (`{type: "memoryEvent", action: "set", key, value}`, `{type: "agentStateEvent",
  action: "addToAgentState", payload: {key, value}}`), and `requestId` is added only to calls that
  wait for an answer.

codeboltjs matches a reply by `requestId` first and by reply `type` second, so every reply
carries both; a fire-and-forget flat message without a `requestId` gets no success reply (an
unsolicited message would reach the agent's user-message handler as if a user had sent it).
Nothing here does I/O: it is the schema, kept apart from what the actions do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from uibus.errors import InvalidArgument

# Every event family of the AsyncAPI document and its actions (the schema's enums).
FAMILIES: dict[str, tuple[str, ...]] = {
    "fsEvent": ("createFile", "createFolder", "readFile", "updateFile", "deleteFile", "deleteFolder", "fileList",
                "listCodeDefinitionNames", "searchFiles", "writeToFile", "grepSearch", "fileSearch",
                "editFileWithDiff"),
    "gitEvent": ("gitInit", "gitPull", "gitPush", "gitStatus", "gitAdd", "gitCommit", "gitCheckout", "gitBranch",
                 "gitLogs", "gitDiff"),
    "browserEvent": ("newPage", "getUrl", "goToPage", "screenshot", "getHTML", "getMarkdown", "getPDF", "pdfToText",
                     "getContent", "getSnapShot", "getBrowserInfo", "extractText", "close", "scroll", "type", "click",
                     "enter", "search"),
    "terminalEvent": ("executeCommand", "executeCommandRunUntilError", "executeCommandWithStream",
                      "sendInterruptToTerminal"),
    "llmEvent": ("inference", "legacyInference"),
    "taskEvent": ("addTask", "addSimpleTask", "getTasks", "getTasksByAgent", "getTasksByCategory", "getAllAgents",
                  "updateTask", "deleteTask", "addSubTask", "updateSubTask", "deleteSubTask",
                  "createTasksFromMarkdown", "exportTasksToMarkdown"),
    "vectordbEvent": ("getVector", "addVectorItem", "queryVectorItem", "queryVectorItems"),
    "memoryEvent": ("memorySet", "memoryGet"),
    "debugEvent": ("addLog", "openDebugBrowser"),
    "crawlerEvent": ("startCrawler", "crawlerScreenshot", "crawlerGoToPage", "crawlerScroll", "crawlerClick"),
    "projectEvent": ("getProjectSettings", "getProjectPath", "getRepoMap", "getEditorFileStatus", "runProject"),
    "chatEvent": ("getChatHistory", "processStoped", "processStarted", "processFinished", "sendMessage",
                  "waitforReply", "confirmationRequest", "notificationEvent"),
    "stateEvent": ("getApplicationState", "addToAgentState", "getAgentState", "getProjectState",
                   "updateProjectState"),
    "mcpEvent": ("getEnabledToolBoxes", "getLocalToolBoxes", "getAvailableToolBoxes", "searchAvailableToolBoxes",
                 "listToolsFromToolBoxes", "configureToolBox", "getTools", "executeTool"),
    "agentEvent": ("findAgent", "startAgent", "listAgents", "getAgentsDetail"),
    "tokenizerEvent": ("addToken", "getToken"),
    "historyEvent": ("summarizeAll", "summarize"),
    "utilsEvent": ("editFileAndApplyDiff",),
    "codeUtilsEvent": ("getAllFilesMarkdown", "performMatch", "getMatcherList", "getMatchDetail"),
}
SERVED_FAMILIES = ("chatEvent", "stateEvent", "memoryEvent")
# What the unsupported families do, for an error message that says why uibus will not.
_WHAT = {"fsEvent": "file-system", "gitEvent": "git", "browserEvent": "browser", "terminalEvent": "terminal",
         "llmEvent": "LLM", "taskEvent": "task-management", "vectordbEvent": "vector-database",
         "debugEvent": "debug", "crawlerEvent": "crawler", "projectEvent": "project", "mcpEvent": "MCP tool",
         "agentEvent": "agent-management", "tokenizerEvent": "tokenizer", "historyEvent": "history",
         "utilsEvent": "file-editing", "codeUtilsEvent": "code-analysis"}

# codeboltjs flat form: type -> (family, action) for chat; aliases for the other families.
_FLAT_CHAT = frozenset(FAMILIES["chatEvent"])
_FLAT_FAMILY = {"agentStateEvent": "stateEvent", "projectStateEvent": "stateEvent"}
_ACTION_ALIASES = {("memoryEvent", "set"): "memorySet", ("memoryEvent", "get"): "memoryGet",
                   ("stateEvent", "getAppState"): "getApplicationState"}
# The reply `type` codeboltjs waits for (a request without requestId is matched by it).
REPLY_TYPES = {
    "getChatHistory": "getChatHistoryResponse",
    "waitforReply": "waitFormessageResponse",
    "confirmationRequest": "confirmationResponse",
    "memorySet": "setMemoryResponse",
    "memoryGet": "getMemoryResponse",
    "getApplicationState": "getAppStateResponse",
    "addToAgentState": "addToAgentStateResponse",
    "getAgentState": "getAgentStateResponse",
    "getProjectState": "getProjectStateResponse",
    "updateProjectState": "updateProjectStateResponse",
}
# What codeboltjs sends without waiting for an answer.
FIRE_AND_FORGET = frozenset({"sendMessage", "processStarted", "processStoped", "processFinished", "notificationEvent"})
_ENVELOPE_KEYS = frozenset({"type", "action", "requestId"})


class EnvelopeError(InvalidArgument):
    """The text is not an envelope uibus can read; the message says what is wrong (and the reply
    still carries the requestId, when one could be read)."""

    def __init__(self, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(slots=True)
class Request:
    family: str  # an AsyncAPI family, e.g. chatEvent
    action: str  # an AsyncAPI action, e.g. sendMessage (aliases resolved)
    request_id: str  # "" when the agent sent none
    fields: dict[str, Any] = field(default_factory=dict)  # the action's payload, either form
    flat: bool = False  # sent in the codeboltjs flat form

    @property
    def name(self) -> str:
        return f"{self.family}.{self.action}"

    @property
    def reply_type(self) -> str:
        return REPLY_TYPES.get(self.action, self.action + "Response")

    @property
    def wants_reply(self) -> bool:
        """False for a flat fire-and-forget message without requestId: see the module docstring."""
        return bool(self.request_id) or not self.flat or self.action not in FIRE_AND_FORGET


def _request_id(obj: dict[str, Any]) -> str:
    rid = obj.get("requestId")
    if rid is None:
        return ""
    if not isinstance(rid, str):
        raise EnvelopeError(f"requestId must be a string, got {type(rid).__name__} {rid!r:.40}")
    if len(rid) > 256:
        raise EnvelopeError(f"requestId is {len(rid)} characters long; the limit is 256")
    return rid


def parse(text: str) -> Request:
    """One envelope from a WebSocket text frame; EnvelopeError says what breaks the schema."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise EnvelopeError(f"malformed JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise EnvelopeError(f"an envelope is a JSON object with type/action/requestId, got a JSON {_kind(obj)}")
    rid = _request_id(obj)
    kind = obj.get("type")
    if not isinstance(kind, str) or not kind:
        raise EnvelopeError("the envelope needs a non-empty string `type` (e.g. \"chatEvent\")", rid)
    if kind in _FLAT_CHAT:  # codeboltjs: {type: "sendMessage", message: "...", requestId?}
        return Request("chatEvent", kind, rid, _rest(obj), flat=True)
    family = _FLAT_FAMILY.get(kind, kind)
    actions = FAMILIES.get(family)
    if actions is None:
        raise EnvelopeError(f"unsupported message type {kind!r}: uibus serves chatEvent, stateEvent and memoryEvent "
                            "(and codeboltjs's flat chat types); it executes nothing else", rid)
    action = obj.get("action")
    if not isinstance(action, str) or not action:
        raise EnvelopeError(f"{kind} needs a non-empty string `action` (one of: {', '.join(actions)})", rid)
    action = _ACTION_ALIASES.get((family, action), action)
    if action not in actions:
        raise EnvelopeError(f"{action!r} is not an action of {family}; it has: {', '.join(actions)}", rid)
    if "message" in obj and kind == family:  # the AsyncAPI form
        message = obj["message"]
        if not isinstance(message, dict):
            raise EnvelopeError(f"{family}.{action}: `message` must be a JSON object, got a JSON {_kind(message)}",
                                rid)
        if not rid:
            raise EnvelopeError(f"{family}.{action}: `requestId` is required (a string the reply echoes)")
        return Request(family, action, rid, message)
    return Request(family, action, rid, _rest(obj), flat=True)


def _rest(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in _ENVELOPE_KEYS}


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def unsupported(req: Request) -> str:
    what = _WHAT.get(req.family, req.family)
    return (f"unsupported action {req.name}: uibus does not execute {what} actions; it serves only "
            f"{', '.join(SERVED_FAMILIES)}")


def timestamp() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def response(request_id: str, success: bool, data: Any = None, error: str = "", reply_type: str = "",
             code: str = "", **extra: Any) -> str:
    """A ServiceResponse as JSON text; `reply_type` and `extra` are the codeboltjs-facing fields,
    `code` the status name of a failure (the same one every other transport reports)."""
    out: dict[str, Any] = {"requestId": request_id, "success": success}
    if reply_type:
        out["type"] = reply_type
    if data is not None:
        out["data"] = data
    if error:
        out["error"] = error
    if code:
        out["code"] = code
    out["timestamp"] = timestamp()
    out.update(extra)
    return json.dumps(out, separators=(",", ":"), ensure_ascii=False)

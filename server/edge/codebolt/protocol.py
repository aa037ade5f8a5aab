"""The CodeBolt agent-to-app envelope: parsing every form an agent sends into one `Request`, and
building the reply that goes back.

Two sources define what arrives on the socket (docs/protocols/codebolt.md):

* the AsyncAPI document: `{type: "chatEvent", action: "sendMessage", requestId, message: {...}}`,
  answered by `requestId`;
* the real agent library, `@codebolt/codeboltjs` (tested: 1.1.99). Its frames are `LIBRARY` below,
  read off the library itself (tests/codeboltjs/extract.js; the table it makes is the test data of
  tests/test_codeboltjs.py). It never sends a `requestId` and matches a reply by one field only —
  `type`, or `event` for the browser and crawler calls, plus `agentId` for startAgent — and it
  never rejects. So every frame of the library is answered at once with exactly the reply its
  function waits for, served or not: a refusal that carried any other `type` would leave the
  agent's promise pending forever.

A fire-and-forget library message (sendMessage, processStarted, ...) gets no success reply: an
unsolicited frame reaches the agent's catch-all request handler as if the app had sent a request.
Nothing here does I/O: it is the schema, kept apart from what the actions do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from uibus.infra.errors import InvalidArgument
from uibus.infra.json_input import dump_json, load_json

# Every event family of the AsyncAPI document and its actions (the schema's enums).
ASYNCAPI: dict[str, tuple[str, ...]] = {
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


@dataclass(frozen=True, slots=True)
class Call:
    """One frame of the codeboltjs library: the family.action it runs as, and the reply its
    function waits for."""

    family: str
    action: str
    reply: str = ""  # the `type` (or `event`) the function waits for; "" when it waits for nothing
    key: str = "type"  # the reply field the library compares: "type", or "event" (browser, crawler)
    echo: tuple[str, ...] = ()  # request fields the library compares too (startAgent: agentId)


def _calls(frame_type: str, family: str, actions: str, reply: str = "{}Response", key: str = "type",
           **special: str) -> dict[tuple[str, str | None], Call]:
    """Rows of LIBRARY for one frame type whose actions follow one reply pattern; `special` maps an
    action to a reply that breaks the pattern ("" = no reply)."""
    out: dict[tuple[str, str | None], Call] = {}
    for action in actions.split():
        name = special.get(action, reply.format(action))
        out[(frame_type, action)] = Call(family, action, name, key)
    return out


# codeboltjs 1.1.99: (frame `type`, frame `action` or None) -> Call. Read off the library by
# tests/codeboltjs/extract.js; tests/test_codeboltjs.py proves every row against the library.
LIBRARY: dict[tuple[str, str | None], Call] = {
    # chat: the action is the frame type
    ("sendMessage", None): Call("chatEvent", "sendMessage"),
    ("getChatHistory", None): Call("chatEvent", "getChatHistory", "getChatHistoryResponse"),
    ("waitforReply", None): Call("chatEvent", "waitforReply", "waitFormessageResponse"),
    ("confirmationRequest", None): Call("chatEvent", "confirmationRequest", "confirmationResponse"),
    ("notificationEvent", None): Call("chatEvent", "notificationEvent"),
    ("processStarted", None): Call("chatEvent", "processStarted"),
    ("processStoped", None): Call("chatEvent", "processStoped"),
    ("processFinished", None): Call("chatEvent", "processFinished"),
    # state and memory
    ("memoryEvent", "set"): Call("memoryEvent", "memorySet", "memorySetResponse"),
    ("memoryEvent", "get"): Call("memoryEvent", "memoryGet", "memoryGetResponse"),
    ("projectStateEvent", "getAppState"): Call("stateEvent", "getApplicationState", "getAppStateResponse"),
    **_calls("agentStateEvent", "stateEvent", "addToAgentState getAgentState"),
    **_calls("projectStateEvent", "stateEvent", "getProjectState updateProjectState"),
    # unsupported: answered with the reply each function waits for, success false
    **_calls("fsEvent", "fsEvent", "createFile createFolder readFile updateFile deleteFile deleteFolder fileList "
             "listCodeDefinitionNames searchFiles writeToFile", updateFile="commandOutput"),
    **_calls("gitEvent", "gitEvent", "Init Clone Pull Push Status Add Commit Checkout Branch Logs Diff",
             Commit="gitCommitResponse"),
    ("inference", None): Call("llmEvent", "inference", "llmResponse"),
    **_calls("browserEvent", "browserEvent", "newPage getUrl goToPage screenshot getHTML getMarkdown getPDF pdfToText "
             "getContent getSnapShot getBrowserInfo extractText close scroll type click enter search", key="event",
             getHTML="htmlReceived", enter="EnterResponse", getPDF="", pdfToText="", close=""),
    ("executeCommand", None): Call("terminalEvent", "executeCommand", "commandError"),
    ("executeCommandRunUntilError", None): Call("terminalEvent", "executeCommandRunUntilError", "commandError"),
    ("executeCommandWithStream", None): Call("terminalEvent", "executeCommandWithStream", "commandError"),
    ("sendInterruptToTerminal", None): Call("terminalEvent", "sendInterruptToTerminal", "terminalInterrupted"),
    **_calls("settingEvent", "settingEvent", "getProjectPath getRepoMap getEditorFileStatus"),
    ("runProject", None): Call("projectEvent", "runProject"),
    **_calls("codeEvent", "codeEvent", "getAllFilesMarkdown performMatch getMatcherList getMatchDetail",
             performMatch="getgetJsTreeResponse", getMatcherList="getMatcherListTreeResponse",
             getMatchDetail="matchDetailTreeResponse"),
    **_calls("crawlerEvent", "crawlerEvent", "start screenshot goToPage scroll enter", reply=""),
    ("crawlerEvent", "click"): Call("crawlerEvent", "click", "clickFinished", "event"),
    ("crawlerEvent", "type"): Call("crawlerEvent", "type", "typeFinished", "event"),
    ("crawlerEvent", "crawl"): Call("crawlerEvent", "crawl", "crawlResponse"),
    **_calls("taskEvent", "taskEvent", "addTask getTasks updateTask"),
    **_calls("vectordbEvent", "vectordbEvent", "getVector addVectorItem queryVectorItem queryVectorItems",
             queryVectorItem="qeryVectorItemResponse", queryVectorItems="qeryVectorItemsResponse"),
    **_calls("debugEvent", "debugEvent", "addLog openDebugBrowser", addLog="debugEventResponse"),
    **_calls("tokenizerEvent", "tokenizerEvent", "addToken getToken"),
    **_calls("chatSummaryEvent", "chatSummaryEvent", "summarizeAll summarize",
             summarizeAll="getSummarizeAllResponse", summarize="getSummarizeResponse"),
    **_calls("codebolttools", "codebolttools", "getEnabledToolBoxes getLocalToolBoxes getAvailableToolBoxes "
             "searchAvailableToolBoxes listToolsFromToolBoxes configureToolBox getTools executeTool"),
    ("agentEvent", "findAgent"): Call("agentEvent", "findAgent", "findAgentByTaskResponse"),
    ("agentEvent", "startAgent"): Call("agentEvent", "startAgent", "taskCompletionResponse", echo=("agentId",)),
    ("agentEvent", "listAgents"): Call("agentEvent", "listAgents", "listAgentsResponse"),
    ("agentEvent", "agentsDetail"): Call("agentEvent", "agentsDetail", "listAgentsResponse"),
}


def _families() -> dict[str, tuple[str, ...]]:
    """Every family.action a frame can run as: the AsyncAPI enums plus the library's spellings."""
    out = {family: list(actions) for family, actions in ASYNCAPI.items()}
    for call in LIBRARY.values():
        names = out.setdefault(call.family, [])
        if call.action not in names:
            names.append(call.action)
    return {family: tuple(actions) for family, actions in out.items()}


FAMILIES = _families()
# What the unsupported families do, for an error message that says why uibus will not.
_WHAT = {"fsEvent": "file-system", "gitEvent": "git", "browserEvent": "browser", "terminalEvent": "terminal",
         "llmEvent": "LLM", "taskEvent": "task-management", "vectordbEvent": "vector-database",
         "debugEvent": "debug", "crawlerEvent": "crawler", "projectEvent": "project", "mcpEvent": "MCP tool",
         "agentEvent": "agent-management", "tokenizerEvent": "tokenizer", "historyEvent": "history",
         "utilsEvent": "file-editing", "codeUtilsEvent": "code-analysis", "settingEvent": "project-settings",
         "codeEvent": "code-analysis", "chatSummaryEvent": "chat-summary", "codebolttools": "MCP tool"}

_ACTION_ALIASES = {("memoryEvent", "set"): "memorySet", ("memoryEvent", "get"): "memoryGet",
                   ("stateEvent", "getAppState"): "getApplicationState"}
# The reply `type` of an AsyncAPI-form request of a served family: the one codeboltjs waits for.
REPLY_TYPES = {call.action: call.reply for call in LIBRARY.values() if call.family in SERVED_FAMILIES and call.reply}
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
    family: str  # a family, e.g. chatEvent
    action: str  # an action, e.g. sendMessage (aliases resolved)
    request_id: str  # "" when the agent sent none
    fields: dict[str, Any] = field(default_factory=dict)  # the action's payload, either form
    flat: bool = False  # sent in the codeboltjs form
    call: Call | None = None  # the library function's frame, when it is one

    @property
    def name(self) -> str:
        return f"{self.family}.{self.action}"

    @property
    def reply_type(self) -> str:
        if self.call is not None and self.call.reply:
            return self.call.reply
        return REPLY_TYPES.get(self.action, self.action + "Response")

    def reply_fields(self) -> dict[str, Any]:
        """What the library compares besides `type`: `event`, and echoed request fields."""
        call = self.call
        if call is None:
            return {}
        out: dict[str, Any] = {}
        if call.key != "type" and call.reply:
            out[call.key] = call.reply
        for name in call.echo:
            if name in self.fields:
                out[name] = self.fields[name]
        return out

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
    """One envelope from a WebSocket text frame; EnvelopeError says what breaks the schema.

    A frame without `requestId` is fine in either form: its reply is matched by `type`, the way
    codeboltjs matches every reply."""
    try:  # bounded depth: a deep frame is answered like any bad frame, never a RecursionError later
        obj = load_json(text, "the frame")
    except InvalidArgument as exc:
        raise EnvelopeError(f"malformed JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise EnvelopeError(f"an envelope is a JSON object with type/action/requestId, got a JSON {_kind(obj)}")
    rid = _request_id(obj)
    kind = obj.get("type")
    if not isinstance(kind, str) or not kind:
        raise EnvelopeError("the envelope needs a non-empty string `type` (e.g. \"chatEvent\")", rid)
    action = obj.get("action")
    call = LIBRARY.get((kind, action)) if isinstance(action, str) else None
    if call is None:
        call = LIBRARY.get((kind, None))
    if call is not None and (call.family not in SERVED_FAMILIES or kind != call.family):
        # A frame of the library (an AsyncAPI-form frame of a served family is read below).
        return Request(call.family, call.action, rid, _rest(obj), flat=True, call=call)
    family = kind
    actions = FAMILIES.get(family)
    if actions is None:
        raise EnvelopeError(f"unsupported message type {kind!r}: uibus serves chatEvent, stateEvent and memoryEvent "
                            "(and answers every frame of the codeboltjs library); it executes nothing else", rid)
    if not isinstance(action, str) or not action:
        raise EnvelopeError(f"{kind} needs a non-empty string `action` (one of: {', '.join(actions)})", rid)
    action = _ACTION_ALIASES.get((family, action), action)
    if action not in actions:
        raise EnvelopeError(f"{action!r} is not an action of {family}; it has: {', '.join(actions)}", rid)
    if "message" in obj:  # the AsyncAPI form
        message = obj["message"]
        if not isinstance(message, dict):
            raise EnvelopeError(f"{family}.{action}: `message` must be a JSON object, got a JSON {_kind(message)}",
                                rid)
        return Request(family, action, rid, message)
    return Request(family, action, rid, _rest(obj), flat=True)


def _rest(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in _ENVELOPE_KEYS}


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def unsupported(req: Request) -> str:
    what = _WHAT.get(req.family, req.family)
    return (f"{req.name}: uibus does not execute {what} actions, so nothing was done; it serves only "
            f"{', '.join(SERVED_FAMILIES)}")


def timestamp(ms: int | None = None) -> str:
    """ISO 8601 UTC with milliseconds: now, or of a uibus ts (milliseconds since the epoch)."""
    at = datetime.now(UTC) if ms is None else datetime.fromtimestamp(ms / 1000, UTC)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def user_message(text: str, ts: int) -> dict[str, Any]:
    """A user's message in codeboltjs's shape: the fields of its waitFormessageResponse, whose
    `message` is the app's `messageResponse`. Every field the library's own schema requires is
    there; uibus knows no editor file, selection or mentions, so those are empty."""
    return {"message": {"type": "messageResponse", "userMessage": text, "currentFile": "",
                        "selectedAgent": {"id": "", "name": "", "lastMessage": {}},
                        "mentionedFiles": [], "mentionedFullPaths": [], "mentionedFolders": [],
                        "mentionedMultiFile": [], "mentionedMCPs": [], "uploadedImages": [], "actions": [],
                        "mentionedAgents": [], "mentionedDocs": [], "links": [], "universalAgentLastMessage": "",
                        "selection": None, "controlFiles": [], "feedbackMessage": "", "terminalMessage": "",
                        "threadId": "", "processId": "", "shadowGitHash": ""},
            "sender": {"senderType": "user", "senderInfo": {}}, "templateType": "userChat", "messageId": str(ts)}


def push_user_message(text: str, ts: int) -> str:
    """The `messageResponse` frame the app pushes unasked; codeboltjs hands it to the agent's
    `chat.onActionMessage()` handler (it carries no requestId/success: nobody asked for it)."""
    return _dumps({"type": "messageResponse", **user_message(text, ts), "data": {"text": text},
                   "timestamp": timestamp()})


def _dumps(obj: dict[str, Any]) -> str:
    return dump_json(obj)  # RFC 8259 only: codeboltjs reads every frame with JSON.parse


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
    return _dumps(out)

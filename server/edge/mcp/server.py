"""uibus as a Model Context Protocol server: the agents, and the user, as tools.

Every served agent is a tool named and described as ConciergeService.List reports it, taking
neuro-san's ChatRequest as its arguments (so neuro-san's own `McpServiceAgentSession` works
unmodified): a call is one chat turn in the caller's uibus session, on the domain's `Chat`, so the
stored context continues (for a client that names its session with `x-uibus-session`; an unnamed
one carries its own `chat_context`, as with every transport), the session's webviews see the reply
live, and cancelling the call stops the backend. Three more tools put the person at the session's
UIs in reach of any agent that speaks MCP: `ask_user` opens an extension-UI dialog and returns its
answer, its dismissal or its timeout; `notify_user` and `set_status` are fire-and-forget.

Each JSON-RPC method is a method handler like the CodeBolt gateway's frames: built here, wrapped
once by the app's handler pipeline (token, session, limits, metrics, errors), and run by the
transport (uibus.edge.transports.mcp_http) with a `CallContext`. Handlers are async generators: they
yield `LIVE` once a call is admitted and about to wait (the transport may open its event stream
then), progress notifications as dicts, and finally one `Reply`.

The protocol state is deliberately small: an `Mcp-Session-Id` names a client's connection for
cancellation and for `DELETE`, nothing else, because everything a conversation needs lives in the
uibus session (the store), so any replica can answer any request without session affinity.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from google.protobuf import json_format

from uibus.domain.core import Core
from uibus.edge.calls import text_metadata
from uibus.edge.mcp import protocol
from uibus.edge.mcp.protocol import InvalidParams, Message, MethodNotFound
from uibus.edge.mcp.session_tools import SESSION_TOOLS, run_session_tool
from uibus.infra.bus import LIVE
from uibus.infra.dialog_limits import MAX_TIMEOUT_MS
from uibus.infra.jsonrpc import valid_id
from uibus.infra.peer import Incoming, request_key
from uibus.infra.proto_check import enum_spellings
from uibus.infra.proto_schema import standalone
from uibus.infra.quotas import ANONYMOUS, Quotas
from uibus.infra.session import names_session, session_of
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
from uibus.replicas.placement import Placement

_MAXIMAL = agent_pb2.MAXIMAL
_AI = chat_pb2.ChatMessage.AI
_OUTCOMES = {ext.DIALOG_OUTCOME_ANSWERED: "answered", ext.DIALOG_OUTCOME_CANCELLED: "cancelled",
             ext.DIALOG_OUTCOME_TIMED_OUT: "timed_out", ext.DIALOG_OUTCOME_CALLER_CANCELLED: "caller_cancelled"}
_LEVELS = {"info": ext.NOTIFY_TYPE_INFO, "warning": ext.NOTIFY_TYPE_WARNING, "error": ext.NOTIFY_TYPE_ERROR}
ENDED_SESSIONS = 4096  # DELETEd session ids remembered (then answered 404), oldest forgotten first

INSTRUCTIONS = (
    "uibus serves coding-agent UIs. Each agent tool is one chat turn with that agent in this uibus session "
    "(with an x-uibus-session header the conversation continues across calls, and chat_context starts over or "
    "branches; without one, pass back the chat_context of the last result to continue). ask_user asks the "
    "person at the session's UI and waits for the answer; notify_user and set_status show something without "
    "waiting.")

_STRING = {"type": "string"}
USER_TOOLS: dict[str, dict[str, Any]] = {
    "ask_user": {
        "name": "ask_user",
        "title": "Ask the user",
        "description": (
            "Ask the person at this session's UI (webview, browser page or terminal) and wait for the answer. "
            "kind: select (pick one of options), confirm (yes/no), input (one line), editor (multi-line text). "
            "The result says whether the user answered, dismissed the dialog or let it time out."),
        "inputSchema": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "description": "The question, shown as the dialog's title"},
                "kind": {"type": "string", "enum": ["select", "confirm", "input", "editor"],
                         "description": "Default: select when options are given, else input"},
                "options": {"type": "array", "items": _STRING, "description": "select: the choices"},
                "message": {"type": "string", "description": "confirm: the text under the title"},
                "placeholder": {"type": "string", "description": "input: the hint in the empty field"},
                "prefill": {"type": "string", "description": "editor: the text to start from"},
                "timeout_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_MS // 1000,
                                    "description": "Give up after this long (default: wait for the answer; "
                                                   "at most a day)"},
            },
            "required": ["title"],
            "additionalProperties": False,
        },
    },
    "notify_user": {
        "name": "notify_user",
        "title": "Notify the user",
        "description": "Show a notification at this session's UIs, without waiting.",
        "inputSchema": {
            "type": "object",
            "properties": {"message": _STRING, "level": {"type": "string", "enum": list(_LEVELS)}},
            "required": ["message"],
            "additionalProperties": False,
        },
    },
    "set_status": {
        "name": "set_status",
        "title": "Set a status entry",
        "description": ("Set (or, without text, clear) one entry of the status line at this session's UIs, "
                        "e.g. key 'build', text 'running tests'."),
        "inputSchema": {
            "type": "object",
            "properties": {"key": _STRING, "text": _STRING},
            "required": ["key"],
            "additionalProperties": False,
        },
    },
}


@dataclass
class Reply:
    """A method's result: the JSON-RPC `result` object."""

    result: dict[str, Any]


class Call:
    """One JSON-RPC message as a handler sees it (the pipeline's request object)."""

    __slots__ = ("message", "new_session", "session_id", "streaming")

    def __init__(self, message: Message, session_id: str | None, streaming: bool = False) -> None:
        self.message = message
        self.session_id = session_id  # the client's Mcp-Session-Id, if it sent one
        self.streaming = streaming  # the transport can send notifications before the result
        self.new_session: str | None = None  # set by initialize: the id the transport hands out


Handler = Callable[[Call, grpc.aio.ServicerContext], AsyncIterator[Any]]


def _args(message: Message) -> tuple[str, dict[str, Any]]:
    name = message.params.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidParams('tools/call needs params.name, the tool to call')
    args = message.params.get("arguments", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise InvalidParams(f"params.arguments of {name} must be an object")
    return name, args


def _string(args: Mapping[str, Any], key: str, tool: str, required: bool = False) -> str | None:
    value = args.get(key)
    if value is None:
        if required:
            raise InvalidParams(f"{tool} needs arguments.{key} (a string)")
        return None
    if not isinstance(value, str):
        raise InvalidParams(f"{tool}: arguments.{key} must be a string, not {type(value).__name__}")
    return value


def _only(args: Mapping[str, Any], tool: str) -> None:
    allowed = USER_TOOLS[tool]["inputSchema"]["properties"]
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        raise InvalidParams(f"{tool} takes no argument {', '.join(unknown)} (it takes: {', '.join(allowed)})")


class McpServer:
    """The MCP methods over the domain core, and the little per-connection state MCP needs."""

    def __init__(self, core: Core, placement: Placement,
                 wrap: Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler], version: str, *,
                 visible: Callable[[Any], Callable[[str], bool]] = lambda _metadata: lambda _session: True,
                 quotas: Quotas | None = None,
                 tenant_of: Callable[[Any], str] = lambda _metadata: ANONYMOUS,
                 tools_for: Callable[[Any], Callable[[str], bool]] = lambda _metadata: lambda _tool: True) -> None:
        """`visible(metadata)`: which sessions a call may list (the pipeline's visible_sessions:
        list_sessions); `quotas`: the quotas every door asks (ask_user holds the tenant's `dialogs`);
        `tenant_of(metadata)`: whose call it is; `tools_for(metadata)`: which tools tools/list shows
        the caller (the pipeline's: an agent's token sees only those it may call); `placement`: where
        a turn or a steering call runs (here, or at its hosted agent's replica)."""
        self.core = core
        self.placement = placement
        self.version = version
        self.chat_schema = standalone(agent_pb2.ChatRequest.DESCRIPTOR, required=("user_message",))
        self.handlers: dict[str, grpc.RpcMethodHandler] = {
            path: wrap(path, grpc.unary_stream_rpc_method_handler(fn)) for path, fn in self._methods().items()}
        # the one map of the clients' requests running (the JSON-RPC core's), by (Mcp-Session-Id, id):
        # notifications/cancelled and DELETE find them there
        self.inflight = Incoming("mcp requests")
        self.visible = visible
        self.quotas = quotas if quotas is not None else Quotas()
        self.tenant_of = tenant_of
        self.tools_for = tools_for
        self._ended: OrderedDict[str, None] = OrderedDict()

    # ---- what the transport asks -----------------------------------------------------------

    def handler(self, message: Message | None) -> grpc.RpcMethodHandler:
        """The wrapped handler that answers `message` (None: an input that is no message)."""
        if message is None:
            return self.handlers[protocol.INVALID]
        if not message.is_request:
            return self.handlers[protocol.NOTIFICATION]
        return self.handlers.get(protocol.path_of(message.method or ""), self.handlers[protocol.UNKNOWN])

    def serves(self, message: Message) -> bool:
        """Whether `message` is a request for a method served here (or not a request at all)."""
        return not message.is_request or protocol.path_of(message.method or "") in self.handlers

    def ended(self, session_id: str) -> bool:
        return session_id in self._ended

    @contextlib.contextmanager
    def tracking(self, session_id: str | None, ident: Any) -> Iterator[None]:
        """Registers the running request so `notifications/cancelled` (same session) can cancel it."""
        if session_id is None or ident is None:
            yield
            return
        with self.inflight.tracking((session_id, request_key(ident))):
            yield

    def _cancel(self, session_id: str | None, ident: Any) -> bool:
        if not session_id or not valid_id(ident, null=False):  # no request has such an id
            return False
        return self.inflight.cancel((session_id, request_key(ident)))

    def _end(self, session_id: str) -> None:
        self._ended[session_id] = None
        while len(self._ended) > ENDED_SESSIONS:
            self._ended.popitem(last=False)
        for key in self.inflight.keys():
            if isinstance(key, tuple) and key[0] == session_id:
                self.inflight.cancel(key)

    # ---- the methods -------------------------------------------------------------------------

    def _methods(self) -> dict[str, Handler]:
        async def initialize(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            session_of(context)  # a bad session name fails the handshake, not the first tool call
            call.new_session = secrets.token_hex(16)
            yield Reply({
                "protocolVersion": protocol.negotiate(call.message.params.get("protocolVersion")),
                "capabilities": {"tools": {"listChanged": False}, "resources": {"listChanged": False},
                                 "prompts": {"listChanged": False}},
                "serverInfo": {"name": "uibus", "title": "uibus", "version": self.version},
                "instructions": INSTRUCTIONS,
            })

        async def ping(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            yield Reply({})

        async def tools_list(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            shown = self.tools_for(context.invocation_metadata())
            yield Reply({"tools": [t for t in self.tools(_caller(context)) if shown(t["name"])]})

        async def tools_call(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            name, args = _args(call.message)
            session = session_of(context)
            if name == _caller(context):
                raise InvalidParams(f"{name} cannot call itself: its own turn holds its agent session, so the call "
                                    "would wait for itself")
            if name in USER_TOOLS:
                run = self._user_tool(name, session, args, self.tenant_of(context.invocation_metadata()))
            elif name in SESSION_TOOLS:
                run = self._session_tool(name, session, args, context)
            else:
                progress = call.message.progress_token if call.streaming else None  # else nowhere to send it
                run = self._chat(name, session, args, progress, text_metadata(context),
                                 names_session(context.invocation_metadata()))
            async with aclosing(run) as items:
                async for item in items:
                    yield item

        def empty(key: str) -> Handler:
            """A listing uibus has nothing in (MCP clients ask for them anyway)."""
            async def listing(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                yield Reply({key: []})
            return listing

        async def notified(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            message = call.message
            if message.method == "notifications/cancelled":
                self._cancel(call.session_id, message.params.get("requestId"))
            return
            yield  # an async generator with nothing to say: the transport answers 202

        async def delete(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if call.session_id:
                self._end(call.session_id)
            return
            yield

        async def unknown(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            raise MethodNotFound(f"method {call.message.method!r} is not served here; uibus serves "
                                 f"{', '.join(m for m in SERVED if m != 'delete')}")
            yield

        async def invalid(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            raise InvalidParams("not a JSON-RPC message")  # never runs: the pipeline answers the Rejected
            yield

        return {protocol.path_of("initialize"): initialize, protocol.path_of("ping"): ping,
                protocol.path_of("tools/list"): tools_list, protocol.path_of("tools/call"): tools_call,
                protocol.path_of("resources/list"): empty("resources"),
                protocol.path_of("resources/templates/list"): empty("resourceTemplates"),
                protocol.path_of("prompts/list"): empty("prompts"), protocol.path_of("delete"): delete,
                protocol.NOTIFICATION: notified, protocol.UNKNOWN: unknown, protocol.INVALID: invalid}

    # ---- tools -------------------------------------------------------------------------------

    def tools(self, caller: str = "") -> list[dict[str, Any]]:
        """The agents, as ConciergeService.List reports them, then the user tools; an agent named
        like a user tool is not listed (the user tool answers that name), nor a hosted agent to
        itself (`caller`, from AGENT_HEADER: uibus offers its /mcp to the ACP agents it hosts)."""
        agents = [{"name": info.agent_name, "description": info.description, "inputSchema": self.chat_schema}
                  for info in self.core.chat.directory.agents
                  if info.agent_name not in USER_TOOLS and info.agent_name not in SESSION_TOOLS
                  and info.agent_name != caller]
        return [*agents, *USER_TOOLS.values(), *SESSION_TOOLS.values()]

    async def _session_tool(self, tool: str, session: str, args: dict[str, Any],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        visible = self.visible(context.invocation_metadata())
        ran = run_session_tool(self.core.sessions, self.placement, tool, session, args, visible)
        async with aclosing(ran) as results:
            async for result in results:
                yield Reply(result)

    async def _chat(self, agent: str, session: str, args: dict[str, Any], progress: str | int | None,
                    metadata: dict[str, str], keep: bool) -> AsyncIterator[Any]:
        chat = self.core.chat
        if agent not in chat.names():
            raise InvalidParams(f"unknown tool {agent!r}; tools here: {', '.join(t['name'] for t in self.tools())}")
        if not isinstance(args.get("user_message"), dict):
            raise InvalidParams(f"{agent} needs arguments.user_message, a ChatMessage object such as "
                                '{"type": "HUMAN", "text": "hello"}')
        request = agent_pb2.ChatRequest()
        try:
            enum_spellings(args, request.DESCRIPTOR, f"arguments of {agent}")
            json_format.ParseDict(args, request)
        except json_format.ParseError as exc:
            raise InvalidParams(f"arguments of {agent} are not a neuro-san ChatRequest: {exc}") from None
        if progress is not None:  # every piece of the reply, to report it as it comes
            request.chat_filter.chat_filter_type = _MAXIMAL
        chat.check(agent, request)
        yield LIVE
        final = None
        pieces = 0
        async with aclosing(self.placement.turn(session, agent, request, metadata, keep=keep)) as replies:
            async for reply in replies:
                message = reply.response
                if message.type == _AI and progress is not None and message.text:
                    pieces += 1
                    yield protocol.notification("notifications/progress", {
                        "progressToken": progress, "progress": pieces, "message": message.text})
                final = message
        if final is None:
            yield Reply(protocol.text_result(""))
            return
        structured: dict[str, Any] = {}
        text = final.text
        if final.HasField("structure"):
            structured["structure"] = json_format.MessageToDict(final.structure)
            text += f"\n```json\n{json.dumps(structured['structure'], indent=2)}\n```"
        if final.HasField("chat_context"):
            structured["chat_context"] = json_format.MessageToDict(final.chat_context,
                                                                   preserving_proto_field_name=True)
        if final.HasField("sly_data"):
            structured["sly_data"] = json_format.MessageToDict(final.sly_data)
        yield Reply(protocol.text_result(text, structured or None))

    async def _user_tool(self, tool: str, session: str, args: dict[str, Any], tenant: str) -> AsyncIterator[Any]:
        _only(args, tool)
        dialogs = self.core.dialogs
        if tool == "notify_user":
            message = _string(args, "message", tool, required=True) or ""
            level = _string(args, "level", tool) or "info"
            if level not in _LEVELS:
                raise InvalidParams(f"notify_user: level must be one of {', '.join(_LEVELS)}, not {level!r}")
            fired = await dialogs.notify(session, ext.NotifyRequest(message=message, notify_type=_LEVELS[level]))
            yield Reply(_fired(fired, session, "notification"))
            return
        if tool == "set_status":
            key = _string(args, "key", tool, required=True) or ""
            text = _string(args, "text", tool)
            request = ext.SetStatusRequest(key=key)
            if text:
                request.text = text
            fired = await dialogs.set_status(session, request)
            yield Reply(_fired(fired, session, "status"))
            return
        dialog = _dialog(args)
        with self.quotas.hold("dialogs", tenant):
            yield LIVE  # admitted and valid: the wait for the person begins
            result = await dialogs.ask(session, dialog)
        yield Reply(_answer(dialog, result))


SERVED = ("initialize", "ping", "tools/list", "tools/call", "resources/list", "resources/templates/list",
          "prompts/list", "delete")


AGENT_HEADER = "x-uibus-agent"  # set by uibus for the agents it hosts: who is calling (see McpServer.tools)


def _caller(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == AGENT_HEADER:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def _fired(reply: ext.FireReply, session: str, what: str) -> dict[str, Any]:
    n = reply.subscribers
    text = (f"The {what} reached {n} UI{'s' if n != 1 else ''} of session {session}." if n
            else f"No UI of session {session} is open; the {what} was kept for the next one that opens."
            if what == "status" else f"No UI of session {session} is open; nobody saw the {what}.")
    return protocol.text_result(text, {"id": reply.id, "subscribers": n})


def _dialog(args: dict[str, Any]) -> ext.SelectRequest | ext.ConfirmRequest | ext.InputRequest | ext.EditorRequest:
    tool = "ask_user"
    title = _string(args, "title", tool, required=True) or ""
    options = args.get("options")
    if options is not None and (not isinstance(options, list) or not all(isinstance(o, str) for o in options)):
        raise InvalidParams("ask_user: arguments.options must be a list of strings")
    kind = _string(args, "kind", tool) or ("select" if options else "input")
    timeout = args.get("timeout_seconds")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or not 0 < timeout <= MAX_TIMEOUT_MS / 1000):
        raise InvalidParams(f"ask_user: arguments.timeout_seconds must be a positive number of seconds, at most "
                            f"{MAX_TIMEOUT_MS // 1000} (a day)")
    extra = {"timeout_ms": max(1, round(timeout * 1000))} if timeout is not None else {}
    misplaced = {"options": "select", "message": "confirm", "placeholder": "input", "prefill": "editor"}
    for key, owner in misplaced.items():
        if args.get(key) is not None and kind != owner:
            raise InvalidParams(f"ask_user: arguments.{key} is for kind {owner}, not {kind}")
    if kind == "select":
        return ext.SelectRequest(title=title, options=options or [], **extra)
    if kind == "confirm":
        return ext.ConfirmRequest(title=title, message=_string(args, "message", tool) or "", **extra)
    if kind == "input":
        placeholder = _string(args, "placeholder", tool)
        return ext.InputRequest(title=title, **({"placeholder": placeholder} if placeholder is not None else {}),
                                **extra)
    if kind == "editor":
        prefill = _string(args, "prefill", tool)
        return ext.EditorRequest(title=title, **({"prefill": prefill} if prefill is not None else {}), **extra)
    raise InvalidParams(f"ask_user: kind must be select, confirm, input or editor, not {kind!r}")


def _answer(dialog: Any, result: ext.DialogResult) -> dict[str, Any]:
    outcome = _OUTCOMES.get(result.outcome, "unknown")
    structured: dict[str, Any] = {"outcome": outcome, "dialog_id": result.id}
    confirm = isinstance(dialog, ext.ConfirmRequest)
    if confirm:
        structured["confirmed"] = result.confirmed
    if result.HasField("value"):
        structured["value"] = result.value
    if outcome == "answered":
        text = ("The user confirmed." if result.confirmed else "The user declined.") if confirm else result.value
    elif outcome == "cancelled":
        text = "The user dismissed the dialog without answering."
    elif outcome == "timed_out":
        text = "The user did not answer in time."
    else:
        text = f"The dialog ended without an answer ({outcome})."
    return protocol.text_result(text, structured)

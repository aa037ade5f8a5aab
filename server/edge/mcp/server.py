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
import hashlib
import json
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from typing import Any

import grpc
import grpc.aio
from google.protobuf import json_format

from uibus.domain.core import Core
from uibus.edge.calls import text_metadata
from uibus.edge.mcp import era, protocol
from uibus.edge.mcp.modern import Modern
from uibus.edge.mcp.protocol import AGENT_HEADER as AGENT_HEADER
from uibus.edge.mcp.protocol import Call, Handler, InvalidParams, Message, MethodNotFound, Reply
from uibus.edge.mcp.session_tools import SESSION_TOOLS, read_session, run_session_tool, session_resources
from uibus.edge.mcp.tasks import McpTasks
from uibus.edge.mcp.user_tools import USER_TOOLS, run_user_tool
from uibus.infra.bus import LIVE
from uibus.infra.jsonrpc import valid_id
from uibus.infra.peer import Incoming, request_key
from uibus.infra.proto_check import enum_spellings
from uibus.infra.proto_schema import standalone
from uibus.infra.quotas import ANONYMOUS, Quotas
from uibus.infra.session import names_session, session_of
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2
from uibus.replicas.placement import Placement

_MAXIMAL = agent_pb2.MAXIMAL
_AI = chat_pb2.ChatMessage.AI
ENDED_SESSIONS = 4096  # DELETEd session ids remembered (then answered 404), oldest forgotten first

INSTRUCTIONS = (
    "uibus serves coding-agent UIs. Each agent tool is one chat turn with that agent in this uibus session "
    "(with an x-uibus-session header the conversation continues across calls, and chat_context starts over or "
    "branches; without one, pass back the chat_context of the last result to continue). ask_user asks the "
    "person at the session's UI and waits for the answer; notify_user and set_status show something without "
    "waiting.")

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


class McpServer:
    """The MCP methods over the domain core, and the little per-connection state MCP needs."""

    def __init__(self, core: Core, placement: Placement,
                 wrap: Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler], version: str, *,
                 visible: Callable[[Any], Callable[[str], bool]] = lambda _metadata: lambda _session: True,
                 quotas: Quotas | None = None,
                 tenant_of: Callable[[Any], str] = lambda _metadata: ANONYMOUS,
                 tools_for: Callable[[Any], Callable[[str], bool]] = lambda _metadata: lambda _tool: True,
                 auth_of: Callable[[Any], str] | None = None) -> None:
        """`visible(metadata)`: which sessions a call may list (the pipeline's visible_sessions:
        list_sessions); `quotas`: the quotas every door asks (ask_user holds the tenant's `dialogs`);
        `tenant_of(metadata)`: whose call it is; `tools_for(metadata)`: which tools tools/list shows
        the caller (the pipeline's: an agent's token sees only those it may call); `placement`: where
        a turn or a steering call runs (here, or at its hosted agent's replica); `auth_of(metadata)`:
        a digest of the caller's credentials (a task is read only with the token that made it)."""
        auth_of = auth_of or _authorization_digest
        self.core = core
        self.placement = placement
        self.version = version
        self.chat_schema = standalone(agent_pb2.ChatRequest.DESCRIPTOR, required=("user_message",))
        self.server_info = {"name": "uibus", "title": "uibus", "version": version}
        self.quotas = quotas if quotas is not None else Quotas()
        self.tasks = McpTasks(core.store, core.dialogs, placement, self.quotas)
        self.visible = visible
        self.tools_for = tools_for
        self.modern = Modern(server_info=self.server_info, capabilities=self.capabilities, instructions=INSTRUCTIONS,
                             tasks=self.tasks, sessions=core.sessions, auth_of=auth_of, tool_names=self._tool_names,
                             visible=visible)
        self.handlers: dict[str, grpc.RpcMethodHandler] = {
            path: wrap(path, grpc.unary_stream_rpc_method_handler(fn)) for path, fn in self._methods().items()}
        # the one map of the clients' requests running (the JSON-RPC core's), by (Mcp-Session-Id, id):
        # notifications/cancelled and DELETE find them there
        self.inflight = Incoming("mcp requests")
        self.tenant_of = tenant_of
        self._ended: OrderedDict[str, None] = OrderedDict()

    # ---- what the transport asks -----------------------------------------------------------

    def handler(self, message: Message | None) -> grpc.RpcMethodHandler:
        """The wrapped handler that answers `message` (None: an input that is no message)."""
        if message is None:
            return self.handlers[protocol.INVALID]
        if not message.is_request:
            return self.handlers[protocol.NOTIFICATION]
        return self.handlers.get(protocol.path_of(message.method or ""), self.handlers[protocol.UNKNOWN])

    def capabilities(self) -> dict[str, Any]:
        """What uibus serves in the stateless era (server/discover); initialize says less."""
        return {"tools": {"listChanged": True}, "resources": {"listChanged": True, "subscribe": True},
                "prompts": {"listChanged": False}, "extensions": {era.TASKS: {}}}

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
            yield Reply({  # today's sessions get no list notifications and no tasks
                "protocolVersion": protocol.negotiate(call.message.params.get("protocolVersion")),
                "capabilities": {"tools": {"listChanged": False}, "resources": {"listChanged": False},
                                 "prompts": {"listChanged": False}},
                "serverInfo": self.server_info, "instructions": INSTRUCTIONS,
            })

        async def ping(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            yield Reply({})

        async def tools_list(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            yield Reply({"tools": self._shown_tools(context)})

        async def tools_call(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            name, args = _args(call.message)
            session = session_of(context)
            if name == _caller(context):
                raise InvalidParams(f"{name} cannot call itself: its own turn holds its agent session, so the call "
                                    "would wait for itself")
            envelope = call.envelope
            if name in USER_TOOLS:
                run = self._user_tool(name, session, args, self.tenant_of(context.invocation_metadata()),
                                      envelope, call.message.params)
            elif name in SESSION_TOOLS:
                run = self._session_tool(name, session, args, context)
            elif envelope is not None and envelope.extension(era.TASKS):  # the turn as a task: a handle now
                run = self._chat(name, session, args, None, text_metadata(context),
                                 names_session(context.invocation_metadata()))
                metadata = context.invocation_metadata()
                task = await self.tasks.start(session, self.modern.auth_of(metadata), self.tenant_of(metadata), name,
                                              run, lambda item: item.result if isinstance(item, Reply) else None)
                created = {k: v for k, v in task.items() if not k.startswith("_")}
                yield Reply({**created, "resultType": "task"})
                return
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

        async def resources_list(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            visible = self.visible(context.invocation_metadata())
            yield Reply({"resources": await session_resources(self.core.sessions, visible)})

        async def resources_read(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            visible = self.visible(context.invocation_metadata())
            yield Reply(await read_session(self.core.sessions, call.message.params.get("uri"), visible))

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

        methods: dict[str, Handler] = {
            protocol.path_of("initialize"): initialize, protocol.path_of("ping"): ping,
            protocol.path_of("tools/list"): tools_list, protocol.path_of("tools/call"): tools_call,
            protocol.path_of("resources/list"): resources_list, protocol.path_of("resources/read"): resources_read,
            protocol.path_of("resources/templates/list"): empty("resourceTemplates"),
            protocol.path_of("prompts/list"): empty("prompts"), protocol.path_of("delete"): delete,
            **self.modern.methods()}
        finished = {path: self._finished(handler) for path, handler in methods.items()}
        return {**finished, protocol.NOTIFICATION: notified, protocol.UNKNOWN: unknown, protocol.INVALID: invalid}

    def _finished(self, handler: Handler) -> Handler:
        """`handler` whose result a modern request gets as that era's result (uibus.edge.mcp.modern)."""
        async def finished(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with aclosing(handler(call, context)) as items:
                async for item in items:
                    yield Reply(self.modern.finish(call, item.result)) if isinstance(item, Reply) else item
        return finished

    # ---- tools -------------------------------------------------------------------------------

    def tools(self, caller: str = "") -> list[dict[str, Any]]:
        """The agents, as ConciergeService.List reports them, then the user tools; an agent named
        like a user tool is not listed (the user tool answers that name), nor a hosted agent to
        itself (`caller`, from AGENT_HEADER: uibus offers its /mcp to the ACP agents it hosts)."""
        agents = [{"name": info.agent_name, "description": info.description, "inputSchema": self.chat_schema}
                  for info in sorted(self.core.chat.directory.agents, key=lambda info: info.agent_name)
                  if info.agent_name not in USER_TOOLS and info.agent_name not in SESSION_TOOLS
                  and info.agent_name != caller]
        return [*agents, *USER_TOOLS.values(), *SESSION_TOOLS.values()]

    def _shown_tools(self, context: grpc.aio.ServicerContext) -> list[dict[str, Any]]:
        """The tools the caller may call, in a fixed order (agents by name, then uibus's own): a
        client caching the list, or a model's prompt built from it, sees the same list each time."""
        shown = self.tools_for(context.invocation_metadata())
        return [t for t in self.tools(_caller(context)) if shown(t["name"])]

    def _tool_names(self, context: grpc.aio.ServicerContext) -> list[str]:
        return [t["name"] for t in self._shown_tools(context)]

    def _user_tool(self, tool: str, session: str, args: dict[str, Any], tenant: str, envelope: protocol.Envelope | None,
                   params: dict[str, Any]) -> AsyncIterator[Any]:
        return self._replies(run_user_tool(self.core.dialogs, self.quotas, tool, session, args, tenant, envelope,
                                           params))

    @staticmethod
    async def _replies(run: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async with aclosing(run) as items:
            async for item in items:
                yield Reply(item) if isinstance(item, dict) else item

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
        failed = final.HasField("structure") and "error" in final.structure.fields  # uibus.domain.chat's marker
        if final.HasField("structure"):
            structured["structure"] = json_format.MessageToDict(final.structure)
            if not failed:  # a failure's structure repeats its text: the text alone, as a tool error
                text += f"\n```json\n{json.dumps(structured['structure'], indent=2)}\n```"
        if final.HasField("chat_context"):
            structured["chat_context"] = json_format.MessageToDict(final.chat_context,
                                                                   preserving_proto_field_name=True)
        if final.HasField("sly_data"):
            structured["sly_data"] = json_format.MessageToDict(final.sly_data)
        yield Reply(protocol.text_result(text, structured or None, is_error=failed))


SERVED = ("initialize", "ping", "tools/list", "tools/call", "resources/list", "resources/read",
          "resources/templates/list", "prompts/list", "delete", "server/discover", "tasks/get", "tasks/update",
          "tasks/cancel", "subscriptions/listen")


def _caller(context: grpc.aio.ServicerContext) -> str:
    return protocol.caller_of(context.invocation_metadata())


def _authorization_digest(metadata: Any) -> str:
    """Whose a task is: a digest of the call's Authorization (never the token itself)."""
    for key, value in metadata or ():
        if key == "authorization":
            raw = value if isinstance(value, bytes) else str(value).encode()
            return hashlib.sha256(raw).hexdigest()
    return ""

"""neuro-san over gRPC: `AgentService` per agent and at its canonical path, and `ConciergeService`.

Real neuro-san clients call `/<agent>.AgentService/<Method>` (SPEC.md §2), so the agent service
is routed by one generic handler, like upstream's dynamic router: a dict lookup per call for
configured agents, UNIMPLEMENTED naming the known agents for any other `<x>.AgentService`. The
canonical `/dev.cognizant_ai.neuro_san.api.grpc.agent.AgentService/...` path picks the agent
from call metadata `agent_name` (else the default agent), which is what grpcurl users need.

For reflection each agent gets a small dynamic file descriptor (package `<agent>`, service
`AgentService` using the canonical message types) in the default pool, so `grpcurl list` shows
`hello_world.AgentService` and `describe` works on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, struct_pb2

from uibus.agents.config import AgentTable, load_agents
from uibus.pb.neuro_san.api.grpc import agent_pb2, concierge_pb2, concierge_pb2_grpc
from uibus.services.chat import ChatEngine, ChatInputError, UnknownAgent, check_request
from uibus.services.common import Runtime
from uibus.session import session_of

_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
CANONICAL = _SERVICE.full_name
CONCIERGE = concierge_pb2.DESCRIPTOR.services_by_name["ConciergeService"].full_name
AGENT_NAME_KEY = "agent_name"
METHODS = tuple(m.name for m in _SERVICE.methods)
_SUFFIX = ".AgentService"


def per_agent_service(agent: str) -> str:
    return agent + _SUFFIX


def _struct(value: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(value)
    return s


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}


class AgentServicer:
    """The three AgentService methods for a given agent name; transport-neutral apart from the
    context calls every ServicerContext offers (metadata, abort)."""

    def __init__(self, engine: ChatEngine) -> None:
        self.engine = engine
        self._closing: set[asyncio.Task[None]] = set()

    async def _check(self, agent: str, context: grpc.aio.ServicerContext) -> None:
        try:
            self.engine.spec(agent)
        except UnknownAgent as exc:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))

    async def function(self, agent: str, request: agent_pb2.FunctionRequest,
                       context: grpc.aio.ServicerContext) -> agent_pb2.FunctionResponse:
        await self._check(agent, context)
        spec, backend = self.engine.spec(agent), self.engine.backend(agent)
        function = agent_pb2.Function(description=spec.description)
        if spec.parameters:
            function.parameters.update(spec.parameters)
        schema = spec.sly_data_schema if spec.sly_data_schema is not None else backend.sly_data_schema()
        if schema:
            function.sly_data_schema.update(schema)
        return agent_pb2.FunctionResponse(function=function)

    async def connectivity(self, agent: str, request: agent_pb2.ConnectivityRequest,
                           context: grpc.aio.ServicerContext) -> agent_pb2.ConnectivityResponse:
        await self._check(agent, context)
        spec = self.engine.spec(agent)
        info = agent_pb2.ConnectivityInfo(origin=agent, tools=list(spec.tools), display_as=spec.display_as)
        return agent_pb2.ConnectivityResponse(
            connectivity_info=[info],
            metadata=_struct({"description": spec.description, "tags": list(spec.tags), "backend": spec.backend}))

    def streaming_chat(self, agent_of: Callable[[grpc.aio.ServicerContext], str]) -> Callable[..., Any]:
        """The StreamingChat handler for the agent `agent_of(context)` names. It is an async
        generator function itself (gRPC decides how to run a handler by inspecting it)."""
        engine = self.engine

        async def streaming_chat(request: agent_pb2.ChatRequest,
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[agent_pb2.ChatResponse]:
            session = await session_of(context)
            agent = agent_of(context)
            await self._check(agent, context)
            try:
                check_request(request)
            except ChatInputError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            chat = engine.stream(session, agent, request, _metadata(context))
            on_done = getattr(context, "add_done_callback", None)
            if on_done is not None:
                on_done(lambda _ctx: self._close_if_parked(chat))
            async with aclosing(chat):
                async for response in chat:
                    yield response

        return streaming_chat

    def _close_if_parked(self, chat: Any) -> None:
        """A cancel that lands while gRPC is sending leaves our generator parked at a `yield`,
        where no CancelledError can reach it; close it now so the backend stops (and drops its
        upstream connection) at once instead of whenever the generator is collected."""
        if chat.ag_frame is not None and not chat.ag_running:
            task = asyncio.get_running_loop().create_task(chat.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)


def _unary(fn: Callable[..., Any], req: Any, resp: Any) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                               response_serializer=resp.SerializeToString)


def _stream(fn: Callable[..., Any], req: Any, resp: Any) -> grpc.RpcMethodHandler:
    return grpc.unary_stream_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                response_serializer=resp.SerializeToString)


def _handlers(servicer: AgentServicer, agent_of: Callable[[grpc.aio.ServicerContext], str]
              ) -> dict[str, grpc.RpcMethodHandler]:
    """Method handlers that serve the agent `agent_of(context)` names."""

    async def function(request: agent_pb2.FunctionRequest, context: grpc.aio.ServicerContext) -> Any:
        return await servicer.function(agent_of(context), request, context)

    async def connectivity(request: agent_pb2.ConnectivityRequest, context: grpc.aio.ServicerContext) -> Any:
        return await servicer.connectivity(agent_of(context), request, context)

    return {
        "Function": _unary(function, agent_pb2.FunctionRequest, agent_pb2.FunctionResponse),
        "Connectivity": _unary(connectivity, agent_pb2.ConnectivityRequest, agent_pb2.ConnectivityResponse),
        "StreamingChat": _stream(servicer.streaming_chat(agent_of), agent_pb2.ChatRequest, agent_pb2.ChatResponse),
    }


def _unknown_agent(agent: str, method: str, known: list[str]) -> grpc.RpcMethodHandler:
    message = f"agent {agent!r} is not served here; known agents: {', '.join(known)}"

    async def deny(request: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

    if method == "StreamingChat":
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class AgentRouter(grpc.GenericRpcHandler):
    """Resolves every AgentService path; `service()` is what gRPC and `Registry.lookup` call."""

    def __init__(self, servicer: AgentServicer, agents: AgentTable) -> None:
        self.engine = servicer.engine
        self._known = agents.names()
        self._paths: dict[str, grpc.RpcMethodHandler] = {}
        for agent in self._known:
            for method, handler in _handlers(servicer, lambda _ctx, a=agent: a).items():
                self._paths[f"/{per_agent_service(agent)}/{method}"] = handler
        default = agents.default

        def by_metadata(context: grpc.aio.ServicerContext) -> str:
            for key, value in context.invocation_metadata() or ():
                if key == AGENT_NAME_KEY:
                    return value if isinstance(value, str) else value.decode(errors="replace")
            return default

        for method, handler in _handlers(servicer, by_metadata).items():
            self._paths[f"/{CANONICAL}/{method}"] = handler

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        path = handler_call_details.method
        handler = self._paths.get(path)
        if handler is not None:
            return handler
        service, _, method = path[1:].partition("/")
        if service.endswith(_SUFFIX) and method in METHODS:
            return _unknown_agent(service[:-len(_SUFFIX)], method, self._known)
        return None


def engine_of(registry: Any) -> ChatEngine | None:
    """The chat engine installed on `registry` (an app's Registry), for in-process callers that
    want the chat itself rather than a gRPC method handler (tests, future transports)."""
    for handler in getattr(registry, "_generic", ()):
        if isinstance(handler, AgentRouter):
            return handler.engine
    return None


class ConciergeServicer(concierge_pb2_grpc.ConciergeServiceServicer):
    def __init__(self, agents: AgentTable) -> None:
        self.response = concierge_pb2.ConciergeResponse(agents=[
            concierge_pb2.AgentInfo(agent_name=s.name, description=s.description, tags=list(s.tags))
            for s in agents.specs.values()])

    async def List(self, request: concierge_pb2.ConciergeRequest,
                   context: grpc.aio.ServicerContext) -> concierge_pb2.ConciergeResponse:
        return self.response


def add_descriptors(agents: list[str]) -> None:
    """Adds `<agent>.AgentService` to the default descriptor pool (what reflection reads).
    The file's content depends on the name only, so adding it again (another App in the same
    process) is a no-op."""
    pool = descriptor_pool.Default()
    for agent in agents:
        name = f"uibus/agents/{agent}.proto"
        try:
            pool.FindFileByName(name)
            continue
        except KeyError:
            pass
        fdp = descriptor_pb2.FileDescriptorProto(name=name, package=agent, syntax="proto3",
                                                 dependency=[_SERVICE.file.name])
        service = fdp.service.add(name="AgentService")
        for m in _SERVICE.methods:
            service.method.add(name=m.name, input_type="." + m.input_type.full_name,
                               output_type="." + m.output_type.full_name, server_streaming=m.server_streaming)
        try:
            pool.Add(fdp)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"agent name {agent!r} clashes with a proto symbol this server already has: {exc}") \
                from exc


def install(registry: Any, rt: Runtime) -> list[str]:
    """Installer for server.app.INSTALLERS: the agents from the config, their routes and names."""
    agents = load_agents(rt.config.agents)
    engine = ChatEngine(rt, agents)
    servicer = AgentServicer(engine)
    registry.add_generic_rpc_handlers([AgentRouter(servicer, agents)])
    concierge_pb2_grpc.add_ConciergeServiceServicer_to_server(ConciergeServicer(agents), registry)
    add_descriptors(agents.names())
    closing: list[asyncio.Task[None]] = []

    def shutdown() -> None:
        closing.append(asyncio.get_running_loop().create_task(agents.aclose()))

    rt.on_shutdown.append(shutdown)
    return [*(per_agent_service(a) for a in agents.names()), CANONICAL, CONCIERGE]

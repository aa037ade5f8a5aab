"""neuro-san over gRPC: `AgentService` per agent and at its canonical path, and `ConciergeService`.

Real neuro-san clients call `/<agent>.AgentService/<Method>` (the path
neuro-san's own clients build; docs/protocols/neuro-san.md), so the agent service
is routed by one generic handler, like upstream's dynamic router: a dict lookup per call for
configured agents, UNIMPLEMENTED naming the known agents for any other `<x>.AgentService`. The
canonical `/dev.cognizant_ai.neuro_san.api.grpc.agent.AgentService/...` path picks the agent
from call metadata `agent_name` (else the default agent), which is what grpcurl users need.

For reflection each agent gets a small dynamic file descriptor (package `<agent>`, service
`AgentService` using the canonical message types) in the default pool, so `grpcurl list` shows
`hello_world.AgentService` and `describe` works on it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool

from uibus.domain.chat import Chat, UnknownAgent
from uibus.edge.calls import text_metadata
from uibus.infra.session import names_session, session_of
from uibus.infra.tasks import Tasks
from uibus.pb.neuro_san.api.grpc import agent_pb2, concierge_pb2, concierge_pb2_grpc
from uibus.replicas.placement import Placement

_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
CANONICAL = _SERVICE.full_name
CONCIERGE = concierge_pb2.DESCRIPTOR.services_by_name["ConciergeService"].full_name
AGENT_NAME_KEY = "agent_name"
METHODS = tuple(m.name for m in _SERVICE.methods)
_SUFFIX = ".AgentService"
UNKNOWN_AGENT = "<unknown>"  # how every agent not served here is named in metrics: callers pick names


def per_agent_service(agent: str) -> str:
    return agent + _SUFFIX


class AgentServicer:
    """The three AgentService methods for a given agent name."""

    def __init__(self, chat: Chat, placement: Placement) -> None:
        """`placement`: where each turn runs (here, or at its hosted agent's replica)."""
        self.chat = chat
        self.placement = placement
        # Closes of parked turns: owned, so the installer's teardown joins them before the chat closes.
        self.closing = Tasks("parked turn closes")

    async def function(self, agent: str, request: agent_pb2.FunctionRequest,
                       context: grpc.aio.ServicerContext) -> agent_pb2.FunctionResponse:
        return self.chat.function(agent)

    async def connectivity(self, agent: str, request: agent_pb2.ConnectivityRequest,
                           context: grpc.aio.ServicerContext) -> agent_pb2.ConnectivityResponse:
        return self.chat.connectivity(agent)

    def streaming_chat(self, agent_of: Callable[[grpc.aio.ServicerContext], str]) -> Callable[..., Any]:
        """The StreamingChat handler for the agent `agent_of(context)` names. It returns the turn's
        own stream, which the pipeline serves (and closes) as it would a generator's: no
        pass-through generator of its own, one hop less for each of a reply's chunks."""
        chat, placement = self.chat, self.placement

        def streaming_chat(request: agent_pb2.ChatRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[agent_pb2.ChatResponse]:
            session = session_of(context)
            agent = agent_of(context)
            chat.check(agent, request)  # bad input fails before the stream starts
            turn = placement.turn(session, agent, request, text_metadata(context),
                                  keep=names_session(context.invocation_metadata()))
            context.add_done_callback(lambda _ctx: self._close_if_parked(turn))
            return turn

        return streaming_chat

    def _close_if_parked(self, turn: Any) -> None:
        """A cancel that lands while gRPC is sending leaves our generator parked at a `yield`,
        where no CancelledError can reach it; close it now so the backend stops (and drops its
        upstream connection) at once instead of whenever the generator is collected."""
        if turn.ag_frame is not None and not turn.ag_running and not self.closing.closed:
            self.closing.spawn(turn.aclose(), name="uibus-close-parked-turn")


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

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        raise UnknownAgent(message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        raise UnknownAgent(message)
        yield  # an async generator: the shape of StreamingChat

    if method == "StreamingChat":
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


class AgentRouter(grpc.GenericRpcHandler):
    """Resolves every AgentService path; `service()` is what gRPC and `Registry.lookup` call."""

    def __init__(self, servicer: AgentServicer) -> None:
        chat = servicer.chat
        self._known = chat.names()
        self._paths: dict[str, grpc.RpcMethodHandler] = {}
        for agent in self._known:
            for method, handler in _handlers(servicer, lambda _ctx, a=agent: a).items():
                self._paths[f"/{per_agent_service(agent)}/{method}"] = handler
        default = chat.default_agent

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

    def label(self, path: str) -> str:
        """The metrics name of `path`: itself for served agents, one name for all others."""
        if path in self._paths:
            return path
        return f"/{UNKNOWN_AGENT}{_SUFFIX}/{path.rpartition('/')[2]}"


class ConciergeServicer(concierge_pb2_grpc.ConciergeServiceServicer):
    def __init__(self, chat: Chat) -> None:
        self.chat = chat

    async def List(self, request: concierge_pb2.ConciergeRequest,
                   context: grpc.aio.ServicerContext) -> concierge_pb2.ConciergeResponse:
        return self.chat.directory


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


def add_to(registry: Any, chat: Chat, servicer: AgentServicer) -> list[str]:
    """Registers the agents' routes and the concierge; returns the service names served."""
    registry.add_generic_rpc_handlers([AgentRouter(servicer)])
    concierge_pb2_grpc.add_ConciergeServiceServicer_to_server(ConciergeServicer(chat), registry)
    add_descriptors(chat.names())
    return [*(per_agent_service(a) for a in chat.names()), CANONICAL, CONCIERGE]

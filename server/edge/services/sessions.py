"""uibus.v1.SessionService: the sessions API (uibus.domain.sessions) and the steering of hosted
agents (uibus.domain.steering) over gRPC, and through the one pipeline over every transport.

ListSessions and WatchSessions are the only calls that span sessions: the pipeline admits them for
any valid token (`SESSIONLESS_SUFFIXES`) and hands this service, through `visible_of`, what the
caller's token may see, so a tenant lists only its own sessions. Every other method is on the
call's session (`x-uibus-session`), which the pipeline checks against the token as for any call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from uibus.domain.sessions import Sessions
from uibus.infra.errors import InvalidArgument
from uibus.infra.quotas import ANONYMOUS, Quotas
from uibus.infra.session import check_session, session_of
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc
from uibus.replicas.placement import Placement

Visible = Callable[[Any], Callable[[str], bool]]  # call metadata -> which sessions it may see
Tenant = Callable[[Any], str]  # call metadata -> the caller's tenant (uibus.infra.quotas)


class SessionService(sessions_pb2_grpc.SessionServiceServicer):
    def __init__(self, sessions: Sessions, placement: Placement, visible_of: Visible, tenant_of: Tenant | None = None,
                 quotas: Quotas | None = None) -> None:
        """`placement`: where a steering call runs (here, or at its agent's replica); `tenant_of`
        and `quotas`: the caller's tenant and its quotas (watches open, sessions created per minute),
        the same ones every door asks (uibus.infra.quotas)."""
        self.sessions = sessions
        self.placement = placement
        self.visible_of = visible_of
        self.tenant_of = tenant_of or (lambda _metadata: ANONYMOUS)
        self.quotas = quotas if quotas is not None else Quotas()

    def _visible(self, context: grpc.aio.ServicerContext) -> Callable[[str], bool]:
        return self.visible_of(context.invocation_metadata())

    async def ListSessions(self, request: pb.ListSessionsRequest,
                           context: grpc.aio.ServicerContext) -> pb.SessionList:
        if request.prefix:
            check_session(request.prefix)
        return await self.sessions.list(self._visible(context), request.prefix)

    async def WatchSessions(self, request: pb.ListSessionsRequest,
                            context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SessionList]:
        if request.prefix:
            check_session(request.prefix)
        tenant = self.tenant_of(context.invocation_metadata())
        async for listed in self.sessions.watch_held(self._visible(context), self.quotas, tenant, request.prefix):
            yield listed

    async def CreateSession(self, request: pb.CreateSessionRequest,
                            context: grpc.aio.ServicerContext) -> pb.SessionEntry:
        session = session_of(context)
        await self.quotas.take("sessions_per_minute", self.tenant_of(context.invocation_metadata()))
        return await self.sessions.create(session, request.title, request.agent)

    async def DeleteSession(self, request: pb.DeleteSessionRequest,
                            context: grpc.aio.ServicerContext) -> pb.DeleteSessionReply:
        return await self.placement.delete_session(session_of(context))

    async def StopTurn(self, request: pb.AgentRequest, context: grpc.aio.ServicerContext) -> pb.StopTurnReply:
        stopped = await self.placement.stop(session_of(context), request.agent)
        self.sessions.poke()
        return pb.StopTurnReply(stopped=stopped)

    async def SetMode(self, request: pb.SetModeRequest, context: grpc.aio.ServicerContext) -> pb.AgentState:
        state = await self.placement.set_mode(session_of(context), request.agent, request.mode_id)
        self.sessions.poke()
        return state

    async def SetModel(self, request: pb.SetModelRequest, context: grpc.aio.ServicerContext) -> pb.AgentState:
        state = await self.placement.set_model(session_of(context), request.agent, request.model_id)
        self.sessions.poke()
        return state

    async def GetWorkspaceDiff(self, request: pb.AgentRequest, context: grpc.aio.ServicerContext) -> pb.WorkspaceDiff:
        if not request.agent:
            raise InvalidArgument("agent is required: the agent whose workspace to show")
        return await self.sessions.workspace_diff(session_of(context), request.agent)

    async def ExportWorkspace(self, request: pb.ExportWorkspaceRequest,
                              context: grpc.aio.ServicerContext) -> pb.ExportWorkspaceReply:
        if not request.agent:
            raise InvalidArgument("agent is required: the agent whose workspace to export")
        reply = await self.sessions.export_workspace(session_of(context), request.agent, request.branch)
        self.sessions.poke()
        return reply

    async def NewConversation(self, request: pb.AgentRequest, context: grpc.aio.ServicerContext) -> pb.AgentState:
        state = await self.placement.new_conversation(session_of(context), request.agent)
        self.sessions.poke()
        return state


SERVICE = pb.DESCRIPTOR.services_by_name["SessionService"].full_name


def add_to(registry: Any, sessions: Sessions, placement: Placement, visible_of: Visible,
           tenant_of: Tenant | None = None, quotas: Quotas | None = None) -> str:
    sessions_pb2_grpc.add_SessionServiceServicer_to_server(
        SessionService(sessions, placement, visible_of, tenant_of, quotas), registry)
    return SERVICE

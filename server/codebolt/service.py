"""uibus.v1.CodeBoltService (the UI side of the gateway) and the installer that puts the
gateway on the HTTP port.

A user's message is one event for every consumer: it is written to the session's chat history
(so getChatHistory and neuro-san see it), which also announces it on the bus to the agents waiting
for a reply (kind `chat_message`), then it is shown to webviews as a ClineMessage.
"""

from __future__ import annotations

from typing import Any

import grpc

from uibus import chat_history
from uibus.codebolt import actions
from uibus.codebolt.asgi import CODEBOLTJS_PATH, PATH, AgentToApp
from uibus.codebolt.gateway import Gateway
from uibus.codebolt.inprocess import InProcess
from uibus.pb.cline import ui_pb2
from uibus.pb.uibus.v1 import codebolt_pb2 as pb
from uibus.pb.uibus.v1 import codebolt_pb2_grpc
from uibus.services.common import Runtime
from uibus.session import session_of

USER_SOURCE = "ui"


class CodeBoltService(codebolt_pb2_grpc.CodeBoltServiceServicer):
    def __init__(self, rt: Runtime, gateway: Gateway) -> None:
        self.rt = rt
        self.gateway = gateway

    async def SendUserMessage(self, request: pb.UserMessage, context: grpc.aio.ServicerContext) -> pb.UserMessageReply:
        session = await session_of(context)
        text = request.text
        if not text.strip():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text is required: the user's message")
        if len(text) > actions.MAX_TEXT:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"text is {len(text)} characters long; the limit is {actions.MAX_TEXT}")
        ts = actions.next_ts()
        # Announced on the bus by append itself; counted right after, before any waiter can finish.
        await chat_history.append(self.rt.store, session, "user", text, source=USER_SOURCE, ts=ts, bus=self.rt.bus)
        answered = self.gateway.user_waiters(session)
        actions.say(self.rt, session, ts, text, ui_pb2.USER_FEEDBACK)
        return pb.UserMessageReply(ts=ts, answered=answered)

    async def GetStats(self, request: pb.CodeBoltStatsRequest, context: grpc.aio.ServicerContext) -> pb.CodeBoltStats:
        session = await session_of(context)
        g = self.gateway
        return pb.CodeBoltStats(connections=g.count(), pending_waits=g.pending(), session_connections=g.count(session),
                                session_pending_waits=g.pending(session))


def install(registry: Any, rt: Runtime) -> list[str]:
    """Installer for server.app.INSTALLERS: the gRPC service, and the WebSocket on the HTTP port.

    The gateway reaches ExtensionUiService through `registry.lookup` at call time, so the order
    of installers does not matter.
    """
    gateway = Gateway(rt, InProcess(registry.lookup))
    codebolt_pb2_grpc.add_CodeBoltServiceServicer_to_server(CodeBoltService(rt, gateway), registry)
    endpoint = AgentToApp(gateway, rt.config.auth_token)
    rt.http_mounts[PATH] = endpoint
    rt.http_mounts[CODEBOLTJS_PATH] = endpoint
    rt.gauges["uibus_codebolt_connections"] = ("Open CodeBolt agent WebSocket connections", gateway.count)
    rt.gauges["uibus_codebolt_pending_waits"] = ("CodeBolt waitforReply / confirmation calls in flight",
                                                 gateway.pending)
    return [pb.DESCRIPTOR.services_by_name["CodeBoltService"].full_name]

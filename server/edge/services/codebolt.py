"""uibus.v1.CodeBoltService: the UI side of the CodeBolt gateway.

A user's message is one event for every consumer: it is written to the session's chat history
(so getChatHistory and neuro-san see it), which also announces it on the bus to the agents waiting
for a reply, then it is shown to webviews as a ClineMessage.
"""

from __future__ import annotations

from typing import Any

import grpc

from uibus.edge.codebolt import actions
from uibus.edge.codebolt.gateway import Gateway
from uibus.infra.errors import InvalidArgument
from uibus.infra.session import session_of
from uibus.pb.cline import ui_pb2
from uibus.pb.uibus.v1 import codebolt_pb2 as pb
from uibus.pb.uibus.v1 import codebolt_pb2_grpc

USER_SOURCE = "ui"


class CodeBoltService(codebolt_pb2_grpc.CodeBoltServiceServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.core = gateway.core

    async def SendUserMessage(self, request: pb.UserMessage, context: grpc.aio.ServicerContext) -> pb.UserMessageReply:
        session = session_of(context)
        text = request.text
        if not text.strip():
            raise InvalidArgument("text is required: the user's message")
        if len(text) > actions.MAX_TEXT:
            raise InvalidArgument(f"text is {len(text)} characters long; the limit is {actions.MAX_TEXT}")
        core = self.core
        ts = core.clock.next()
        # Announced on the bus by append itself; counted right after, before any waiter can finish.
        await core.history.append(session, "user", text, source=USER_SOURCE, ts=ts)
        answered = self.gateway.reached(session)
        core.feed.say(session, text, ui_pb2.USER_FEEDBACK, ts=ts)
        return pb.UserMessageReply(ts=ts, answered=answered)

    async def GetStats(self, request: pb.CodeBoltStatsRequest, context: grpc.aio.ServicerContext) -> pb.CodeBoltStats:
        session = session_of(context)
        g = self.gateway
        return pb.CodeBoltStats(connections=g.count(), pending_waits=g.pending(), session_connections=g.count(session),
                                session_pending_waits=g.pending(session))


SERVICE = pb.DESCRIPTOR.services_by_name["CodeBoltService"].full_name


def add_to(registry: Any, gateway: Gateway) -> str:
    codebolt_pb2_grpc.add_CodeBoltServiceServicer_to_server(CodeBoltService(gateway), registry)
    return SERVICE

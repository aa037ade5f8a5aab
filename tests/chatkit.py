"""Helpers for the neuro-san chat tests: agent configs, apps built from them, and calls at the
paths real neuro-san clients use."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2

CANONICAL = "dev.cognizant_ai.neuro_san.api.grpc.agent.AgentService"
MINIMAL, MAXIMAL = agent_pb2.MINIMAL, agent_pb2.MAXIMAL
AI, FRAMEWORK, PROGRESS = (chat_pb2.ChatMessage.AI, chat_pb2.ChatMessage.AGENT_FRAMEWORK,
                           chat_pb2.ChatMessage.AGENT_PROGRESS)


def write_agents(tmp_path: Path, agents: list[dict[str, Any]], default: str | None = None) -> str:
    data: dict[str, Any] = {"agents": agents}
    if default:
        data["default_agent"] = default
    path = tmp_path / "agents.json"
    path.write_text(json.dumps(data))
    return str(path)


def local(name: str, **options: Any) -> dict[str, Any]:
    return {"name": name, "backend": "local", "description": f"{name} test agent", "tags": ["test"],
            "options": {"delay_ms": 0, **options}}


@asynccontextmanager
async def running(config: Config, agents_file: str = "") -> AsyncIterator[App]:
    app = App(replace(config, agents=agents_file))
    async with app:
        yield app


class Agent:
    """The three AgentService calls of one agent (or of the canonical path when agent is "")."""

    def __init__(self, conn: Connection, agent: str) -> None:
        service = f"{agent}.AgentService" if agent else CANONICAL
        ch = conn.channel
        self.Function = ch.unary_unary(f"/{service}/Function",
                                       request_serializer=agent_pb2.FunctionRequest.SerializeToString,
                                       response_deserializer=agent_pb2.FunctionResponse.FromString)
        self.Connectivity = ch.unary_unary(f"/{service}/Connectivity",
                                           request_serializer=agent_pb2.ConnectivityRequest.SerializeToString,
                                           response_deserializer=agent_pb2.ConnectivityResponse.FromString)
        self.StreamingChat = ch.unary_stream(f"/{service}/StreamingChat",
                                             request_serializer=agent_pb2.ChatRequest.SerializeToString,
                                             response_deserializer=agent_pb2.ChatResponse.FromString)


def request(text: str, *, filter_type: int = MINIMAL, context: chat_pb2.ChatContext | None = None,
            sly: dict[str, Any] | None = None) -> agent_pb2.ChatRequest:
    req = agent_pb2.ChatRequest(user_message=chat_pb2.ChatMessage(type=chat_pb2.ChatMessage.HUMAN, text=text),
                                chat_filter=agent_pb2.ChatFilter(chat_filter_type=filter_type))
    if context is not None:
        req.chat_context.CopyFrom(context)
    if sly:
        req.sly_data.update(sly)
    return req


async def chat(conn: Connection, agent: str, text: str, metadata: tuple[tuple[str, str], ...] = (),
               **kw: Any) -> list[agent_pb2.ChatResponse]:
    return [r async for r in Agent(conn, agent).StreamingChat(request(text, **kw), metadata=metadata or None)]


async def answer(conn: Connection, agent: str, text: str, **kw: Any) -> chat_pb2.ChatMessage:
    """The final message of a turn (checked to be the AGENT_FRAMEWORK one)."""
    responses = await chat(conn, agent, text, **kw)
    final = responses[-1].response
    assert final.type == FRAMEWORK, responses
    return final


async def rpc_error(awaitable: Any) -> grpc.aio.AioRpcError:
    try:
        result = await awaitable
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call succeeded; an error was expected")


async def stream_error(call: Any) -> grpc.aio.AioRpcError:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the stream succeeded; an error was expected")

"""The CodeBolt gateway across two replicas sharing one real redis-server: the agent's socket is on
one replica, the user on the other."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect

from tests.conftest import free_port, wait_for
from tests.redisproc import RedisProcess, redis_server
from uibus.app import App
from uibus.app.installers import CODEBOLT
from uibus.clients.connection import Connection
from uibus.edge.transports.codebolt_ws import PATH
from uibus.infra.config import Config
from uibus.infra.redis import ReplicatedBus
from uibus.pb.uibus.v1 import codebolt_pb2 as cpb
from uibus.pb.uibus.v1 import codebolt_pb2_grpc

__all__ = ["redis_server"]


@pytest.fixture
async def replicas(redis_server: RedisProcess, tmp_path: Path) -> AsyncIterator[tuple[App, App]]:
    apps: list[App] = []
    try:
        for name in ("a", "b"):
            app = App(Config(host="127.0.0.1", port=0, http_port=free_port(), store=str(tmp_path / f"{name}.db"),
                             redis_url=redis_server.url, grace_seconds=1.0))
            await app.start()
            apps.append(app)
        buses = [app.bus for app in apps]
        assert all(isinstance(bus, ReplicatedBus) for bus in buses)
        await wait_for(lambda: all(bus.connected for bus in buses), what="both replicas on redis")  # type: ignore[attr-defined]
        yield apps[0], apps[1]
    finally:
        for app in apps:
            await app.aclose(grace=0.5)


async def call(ws: Any, obj: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(obj))
    return json.loads(await asyncio.wait_for(ws.recv(), 3))  # type: ignore[no-any-return]


async def test_agent_on_a_user_on_b(replicas: tuple[App, App]) -> None:
    a, b = replicas
    async with connect(f"ws://127.0.0.1:{a.http_port}{PATH}?session=r1") as ws, \
            Connection(f"127.0.0.1:{b.port}", session="r1") as user:
        memory = {"type": "memoryEvent", "action": "set", "key": "k", "value": [1, 2], "requestId": "m1"}
        assert (await call(ws, memory))["success"] is True
        await ws.send(json.dumps({"type": "waitforReply", "requestId": "w1"}))
        await wait_for(lambda: a[CODEBOLT].pending("r1") == 1, what="the wait on replica a")
        # The user's message is written on b and announced through Redis to the wait on a.
        sent = await codebolt_pb2_grpc.CodeBoltServiceStub(user.channel).SendUserMessage(cpb.UserMessage(text="hi"))
        assert sent.answered == 0  # nobody waits on b itself
        reply = json.loads(await asyncio.wait_for(ws.recv(), 3))
        assert reply["requestId"] == "w1" and reply["message"]["userMessage"] == "hi"
    # State lives in the shared store: an agent on b reads what the agent on a wrote.
    async with connect(f"ws://127.0.0.1:{b.http_port}{PATH}?session=r1") as ws:
        got = await call(ws, {"type": "memoryEvent", "action": "get", "key": "k", "requestId": "m2"})
        assert got["data"]["value"] == [1, 2]
        history = await call(ws, {"type": "getChatHistory", "requestId": "h"})
        assert [(e["role"], e["text"]) for e in history["data"]] == [("user", "hi")]

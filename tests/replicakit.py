"""Replicas and workers hosting agents on one real redis-server, for the tests of agent ownership
(docs/hosting/durable.md) and of steering across replicas (docs/protocols/sessions.md): one kit, so
both start, count and tear down replicas the same way and assert the same things when they close."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.chatkit import write_agents
from tests.conftest import free_port, start_app, wait_for
from tests.pikit import turn_of
from tests.redisproc import RedisProcess
from tests.test_acp_agent import fixture_agent
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config
from uibus.pb.neuro_san.api.grpc import agent_pb2

LEASE_S = 2.0  # short, so takeovers and fencing are seconds


@asynccontextmanager
async def replicas(tmp_path: Path, redis: RedisProcess, agents: list[dict[str, Any]], n: int = 2,
                   **changes: Any) -> AsyncIterator[list[App]]:
    """`n` replicas on `redis` serving `agents`; after they close, no agent session is left on any."""
    path = write_agents(tmp_path, agents)
    apps: list[App] = []
    try:
        for i in range(n):
            apps.append(await start_app(Config(
                host="127.0.0.1", port=0, http_port=free_port(), store=str(tmp_path / f"{i}.db"), redis_url=redis.url,
                grace_seconds=1.0, agents=path, agent_lease_seconds=LEASE_S, **changes)))
        await wait_for(lambda: all(a.bus.connected for a in apps), what="every replica on redis")
        yield apps
    finally:
        for app in apps:
            await app.aclose(grace=0.5)
    for app in apps:
        assert app.core.agent_sessions.count() == 0
        assert app.bus.count() == 0, "a subscription was left behind"
        assert app.placement.ownership is not None and not app.placement.ownership.held


def started(apps: list[App], agent: str) -> int:
    """Agent processes started by all replicas together."""
    return sum(getattr(a.core.chat.agents.backends[agent], "started", 0) for a in apps)


def owner_of(apps: list[App], session: str, agent: str) -> App:
    (owner,) = [a for a in apps if a.placement.ownership and (session, agent) in a.placement.ownership.held]
    return owner


async def final(conn: Connection, agent: str, text: str) -> str:
    return str((await turn_of(conn, agent, text))[-1].response.text)


async def fixture_process(tmp_path: Path, redis: RedisProcess, spawn: Any, *options: str) -> Any:
    """`uibus serve` as a process of its own on `redis`, hosting the ACP fixture agent, ready: a
    replica a test can kill or stop. `options` default to a lease of LEASE_S and a 1 s grace."""
    path = write_agents(tmp_path, [fixture_agent(tmp_path)])
    server = spawn("--redis-url", redis.url, "--agents", path,
                   *(options or ("--agent-lease-seconds", str(LEASE_S), "--grace-seconds", "1")))
    await server.wait_ready()
    return server


async def fixture_workers(tmp_path: Path, redis: RedisProcess, spawn: Any) -> Any:
    """`uibus serve --workers 2` on `redis` hosting the ACP fixture agent (lease LEASE_S), ready."""
    from tests.test_workers import started as workers_started
    path = write_agents(tmp_path, [fixture_agent(tmp_path)])
    server, _ = await workers_started(lambda *args: spawn(*args, "--agents", path, "--agent-lease-seconds",
                                                              str(LEASE_S)), redis)
    return server


@asynccontextmanager
async def worker_channels(target: str, workers: int = 2) -> AsyncIterator[dict[str, grpc.aio.Channel]]:
    """One channel to each worker, by worker id: the kernel picks a worker per connection, so fresh
    connections are opened (at most 40) until every worker has one; all of them closed after."""
    from tests.test_workers import fresh_channel
    by_worker: dict[str, grpc.aio.Channel] = {}
    opened: list[grpc.aio.Channel] = []
    try:
        for _ in range(40):
            channel = fresh_channel(target)
            opened.append(channel)
            call = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            by_worker.setdefault((await call.initial_metadata())["x-uibus-worker"], channel)
            await call
            if len(by_worker) == workers:
                break
        assert len(by_worker) == workers, "40 connections all went to one worker"
        yield by_worker
    finally:
        for channel in opened:
            await channel.close()


def streaming_chat(channel: grpc.aio.Channel, agent: str = "acp") -> Callable[..., Any]:
    """`agent`'s StreamingChat on a plain channel (a worker's own, not a Connection's)."""
    return channel.unary_stream(f"/{agent}.AgentService/StreamingChat",
                                request_serializer=agent_pb2.ChatRequest.SerializeToString,
                                response_deserializer=agent_pb2.ChatResponse.FromString)

"""`uibus serve --workers N`: real processes on one gRPC and one HTTP port, sharing a real Redis.

A stream subscribed on one worker gets what a host publishes through another; every response names
its worker (`x-uibus-worker`); health is SERVING only while every worker is ready; SIGTERM drains
them all and the parent exits 0 with no worker left; a worker that cannot start is one line, and one
that dies stops the rest with a non-zero exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import Config, ServerProcess, free_port, replace, start_app, wait_for
from tests.redisproc import RedisProcess, redis_server
from tests.webclient import call, call_stream
from uibus.app import App
from uibus.infra.worker_table import DOWN, READY, STARTING, Worker, WorkerTable
from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2
from uibus.pb.uibus.v1 import host_pb2_grpc

__all__ = ["redis_server"]

SESSION = (("x-uibus-session", "workers"),)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def fresh_channel(target: str) -> grpc.aio.Channel:
    """A channel with its own TCP connection (grpc shares connections between channels by default),
    so the kernel picks a worker for it anew."""
    return grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


async def subscribe(channel: grpc.aio.Channel) -> tuple[int, Any]:
    """A live partial-message stream on `channel`, and the worker that holds it (from its headers)."""
    call = ui_pb2_grpc.UiServiceStub(channel).subscribeToPartialMessage(common_pb2.EmptyRequest(), metadata=SESSION)
    headers = await asyncio.wait_for(call.initial_metadata(), 5)
    return int(headers["x-uibus-worker"]), call


def parent_line(server: ServerProcess, msg: str) -> dict[str, Any]:
    """The parent's JSON log line `msg` (the workers' lines carry a `worker` field)."""
    for line in server.log.read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("msg") == msg and entry.get("logger") == "uibus.app.workers":
                return entry  # type: ignore[no-any-return]
    raise AssertionError(f"no parent {msg!r} line in: {server.log.read_text()}")


async def started(spawn: Any, redis: RedisProcess) -> tuple[ServerProcess, list[int]]:
    """`uibus serve --workers 2 --port 0` on `redis`, with HTTP, ready; and its worker pids. The
    gRPC port is the one the parent's "serving" line names (logged once every worker serves)."""
    server: ServerProcess = spawn("--workers", "2", "--redis-url", redis.url, "--grace-seconds", "1",
                                  "--port", "0", "--http-port", str(free_port()))
    line = '"uibus.app.workers", "msg": "serving"'
    await wait_for(lambda: line in server.log.read_text() or server.proc.poll() is not None, 10, "the parent's line")
    serving = parent_line(server, "serving")
    server.target = serving["grpc"]
    await server.wait_ready(timeout=5)
    pids = serving["pids"]
    assert len(pids) == 2 and server.proc.pid not in pids
    return server, pids


async def health(channel: grpc.aio.Channel, worker: str | None = None) -> int:
    """gRPC health of "" on `channel`; checks the `x-uibus-worker` header when `worker` is given."""
    call = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    if worker is not None:
        assert (await call.initial_metadata())["x-uibus-worker"] == worker
    return (await call).status  # type: ignore[no-any-return]


async def becomes(read: Callable[[], Awaitable[int]], want: int, timeout: float = 2.0) -> None:
    """Polls `read` until it gives `want`: a worker re-reads the others' readiness every 0.5 s."""
    deadline = time.monotonic() + timeout
    while (got := await read()) != want:
        assert time.monotonic() < deadline, f"still {got}, not {want}, after {timeout} s"
        await asyncio.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def exited(proc: subprocess.Popen[bytes], timeout: float) -> int:
    await wait_for(lambda: proc.poll() is not None, timeout, "the parent to exit")
    return proc.returncode


async def test_two_workers_serve_one_port_share_events_and_stop_together(
        spawn: Any, redis_server: RedisProcess) -> None:
    server, pids = await started(spawn, redis_server)
    serving = parent_line(server, "serving")
    assert serving["grpc"] != "127.0.0.1:0" and serving["http"] > 0  # the real ports
    workers = [json.loads(line) for line in server.log.read_text().splitlines() if '"worker": ' in line]
    assert sorted((w["worker"], w["grpc"], w["http"]) for w in workers if w["msg"] == "serving") == [
        (0, serving["grpc"], serving["http"]), (1, serving["grpc"], serving["http"])]  # one port each, for all

    channels: list[grpc.aio.Channel] = []
    try:
        # Fresh connections until two different workers answered: the kernel spreads them.
        held: dict[int, tuple[grpc.aio.Channel, Any]] = {}
        for _ in range(40):
            channel = fresh_channel(server.target)
            channels.append(channel)
            worker, call = await subscribe(channel)
            if worker in held:
                call.cancel()
                continue
            held[worker] = (channel, call)
            if len(held) == 2:
                break
        assert sorted(held) == [0, 1], f"only reached workers {sorted(held)}"
        (_, (sub_channel, stream)), (pub_worker, (pub_channel, _)) = sorted(held.items())

        # Published through worker 1, received by the stream worker 0 holds (through Redis).
        publish = host_pb2_grpc.HostServiceStub(pub_channel).PublishPartialMessage(
            ui_pb2.ClineMessage(ts=1700000000001, type=ui_pb2.SAY, say=ui_pb2.TEXT, text="across"), metadata=SESSION)
        await publish
        assert (await publish.initial_metadata())["x-uibus-worker"] == str(pub_worker)
        message = await asyncio.wait_for(stream.read(), 5)
        assert message.text == "across" and message.ts == 1700000000001

        for channel in (sub_channel, pub_channel):  # both up: each says SERVING (within a health poll)
            await becomes(lambda channel=channel: health(channel), SERVING)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{serving['http']}") as http:
            assert (await http.get("/readyz")).status_code == 200
            metrics = (await http.get("/metrics")).text
            assert any(f'uibus_worker{{index="{i}",pid="{pids[i]}"}} 1.0' in metrics for i in (0, 1)), metrics

        server.proc.send_signal(signal.SIGTERM)
        assert await exited(server.proc, 6) == 0, server.log.read_text()
    finally:
        for channel in channels:
            await channel.close(None)
    assert all(gone(pid) for pid in pids)
    assert "Traceback" not in server.log.read_text()


async def test_a_dead_worker_stops_the_rest(spawn: Any, redis_server: RedisProcess) -> None:
    server, pids = await started(spawn, redis_server)
    os.kill(pids[0], signal.SIGKILL)
    assert await exited(server.proc, 6) == 1
    died = parent_line(server, "worker exited")
    assert (died["worker"], died["pid"], died["exit"]) == (0, pids[0], "signal SIGKILL")
    assert all(gone(pid) for pid in pids)


def serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UIBUS_")}
    return subprocess.run([sys.executable, "-m", "uibus", "serve", "--host", "127.0.0.1", "--port", "0",
                           "--http-port", "0", "--store", str(tmp_path / "u.db"), *args],
                          env=env, capture_output=True, text=True, timeout=20)


def test_workers_need_redis(tmp_path: Path) -> None:
    proc = serve(tmp_path, "--workers", "2")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["uibus serve: --workers: more than 1 needs --redis-url (the workers share "
                                        "sessions and events through Redis)"]


def test_a_worker_that_cannot_start_is_one_line(tmp_path: Path, redis_server: RedisProcess) -> None:
    (tmp_path / "shape.json").write_text('{"agents": {"name": "a"}}\n')
    proc = serve(tmp_path, "--workers", "2", "--redis-url", redis_server.url, "--agents", str(tmp_path / "shape.json"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"uibus serve: --agents: {tmp_path}/shape.json: `agents` must be a "
                                        "non-empty list"]


async def test_health_waits_for_every_worker(config: Config) -> None:
    """In one process, as worker 0 of 2: NOT_SERVING until the other slot says ready, and again once
    it is down; every response names the worker."""
    table = WorkerTable(2)
    app = App(replace(config, store=":memory:"), worker=Worker(0, table))
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            assert table.state(0) == READY and table.state(1) == STARTING
            assert app.not_ready() == "worker 1 of 2 is starting"
            assert await health(channel, worker="0") == NOT_SERVING
            table.set_state(1, READY)
            assert app.not_ready() is None
            await becomes(lambda: health(channel, worker="0"), SERVING)
            table.set_state(1, DOWN)  # as the parent marks a worker that exited
            assert app.not_ready() == "worker 1 of 2 is down"
            await becomes(lambda: health(channel, worker="0"), NOT_SERVING)
    finally:
        await app.aclose(grace=0.5)
    assert table.state(0) == DOWN  # it marked itself down when it stopped


async def test_a_workers_headers_change_no_transports_answer(config: Config) -> None:
    """As worker 0 of 2, every response carries `x-uibus-worker`, and nothing else changes: a
    gRPC-Web stream whose first message comes after the transport opened its response on its own
    still ends OK, a gRPC-Web subscription names the worker in its headers, and an MCP call that
    never waits is answered with JSON as by a single process (no event stream)."""
    table = WorkerTable(2)
    table.set_state(1, READY)
    app = await start_app(replace(config, store=":memory:", http_port=free_port()), worker=Worker(0, table))
    base = f"http://127.0.0.1:{app.http_port}"
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            # MINIMAL: only the final reply, after 3 pieces 80 ms apart, well after gRPC-Web's own headers.
            request = agent_pb2.ChatRequest(user_message=chat_pb2.ChatMessage(type=chat_pb2.ChatMessage.HUMAN,
                                                                              text="hi"))
            request.sly_data.update({"chunks": 3, "delay_ms": 80})
            reply = await call(http, f"{base}/hello_world.AgentService/StreamingChat", request.SerializeToString())
            assert reply.status == 0, reply.message
            [only] = [agent_pb2.ChatResponse.FromString(m) for m in reply.messages]
            assert only.response.type == chat_pb2.ChatMessage.AGENT_FRAMEWORK

            # A subscription's headers (sent once subscribed) name the worker.
            stream = call_stream(http, f"{base}/cline.UiService/subscribeToPartialMessage",
                                 common_pb2.EmptyRequest().SerializeToString(), headers={"x-uibus-session": "w"})
            async with aclosing(stream):
                kind, headers = await anext(stream)
                assert kind == "headers" and headers.headers["x-uibus-worker"] == "0"  # type: ignore[attr-defined]

            mcp = await http.post(f"{base}/mcp", json={
                "jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "notify_user", "arguments": {"message": "hi"}}},
                headers={"accept": "application/json, text/event-stream", "x-uibus-session": "w"})
            assert mcp.status_code == 200 and mcp.headers["content-type"] == "application/json", mcp.text
            assert mcp.json()["result"]["isError"] is False
    finally:
        await app.aclose(grace=0.5)

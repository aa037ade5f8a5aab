"""Acknowledged is durable: a chat reply its caller received is in the session's log, so a
SIGKILL of `uibus serve` right after the turn loses nothing any caller saw (20 tries, each a
real process killed with no goodbye, the next one reading the same SQLite file; and with two
replicas on Redis, the killed one's replies read on the other)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tests.chatkit import answer
from tests.conftest import ServerProcess
from tests.redisproc import RedisProcess, redis_server
from uibus.clients.connection import Connection
from uibus.pb.uibus.v1 import webview_pb2, webview_pb2_grpc

__all__ = ["redis_server"]  # the fixture, imported to be used here
pytestmark = pytest.mark.timeout(300)
TRIES = 20


async def _replayed(target: str, session: str) -> list[str]:
    """The texts a webview opened now starts with (the recent messages, a view of the log)."""
    async with Connection(target, session=session) as conn:
        stub = webview_pb2_grpc.WebviewServiceStub(conn.channel)
        call = stub.Subscribe(webview_pb2.WebviewSubscribeRequest(client_id="check", mark_replay_end=True))
        texts = []
        while True:
            event = await asyncio.wait_for(call.read(), 10)
            if event.replay_complete:
                break
            if event.HasField("partial_message"):
                texts.append(event.partial_message.text)
        call.cancel()
        return texts


async def test_sigkill_right_after_a_turn_loses_no_acknowledged_reply(spawn: Callable[..., ServerProcess]) -> None:
    acknowledged: list[str] = []
    server = spawn()
    for i in range(TRIES):
        await server.wait_ready()
        async with Connection(server.target, session="kill") as conn:
            reply = await answer(conn, "hello_world", f"turn {i}")
        server.proc.kill()  # SIGKILL the moment the caller has its reply: no flush, no goodbye
        server.proc.wait(10)
        acknowledged.append(reply.text)
        server = spawn()
    await server.wait_ready()
    shown = await _replayed(server.target, "kill")
    missing = [text for text in acknowledged if text not in shown]
    assert not missing, f"{len(missing)} of {TRIES} acknowledged replies lost: {missing[:3]}"
    for i in range(TRIES):
        assert f"turn {i}" in shown  # the questions too


async def test_sigkill_of_a_replica_right_after_a_turn_loses_nothing_on_redis(
        spawn: Callable[..., ServerProcess], redis_server: RedisProcess) -> None:
    """Two replicas on one Redis: turns on replica A, A SIGKILLed right after each; replica B (never
    killed) shows every acknowledged reply from the shared log."""
    acknowledged: list[str] = []
    b = spawn("--redis-url", redis_server.url)
    await b.wait_ready()
    a = spawn("--redis-url", redis_server.url)
    for i in range(TRIES):
        await a.wait_ready()
        async with Connection(a.target, session="kill-r") as conn:
            reply = await answer(conn, "hello_world", f"turn {i}")
        a.proc.kill()
        a.proc.wait(10)
        acknowledged.append(reply.text)
        a = spawn("--redis-url", redis_server.url)
    shown = await _replayed(b.target, "kill-r")
    missing = [text for text in acknowledged if text not in shown]
    assert not missing, f"{len(missing)} of {TRIES} acknowledged replies lost: {missing[:3]}"

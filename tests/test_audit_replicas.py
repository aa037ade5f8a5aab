"""Two replicas on one real redis-server write ONE audit chain (uibus.infra.redis.audit): acts on both
at once each get their own seq and the chain verifies (in process, and with `uibus audit verify
--redis-url` as a subprocess); an answer given on one replica to a dialog the other holds is recorded
once, where it was given; a changed entry in Redis breaks the chain at that seq."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from tests.redisproc import RedisProcess, redis_server
from tests.replicakit import replicas
from tests.test_acp_agent import fixture_agent
from uibus.infra.audit import AuditLog, Query
from uibus.infra.redis.audit import RedisAudit
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc as ext_grpc
from uibus.pb.uibus.v1 import sessions_pb2, sessions_pb2_grpc

pytestmark = pytest.mark.timeout(90)
__all__ = ["redis_server"]
ROUNDS = 25  # session creations per replica, all at once


def _verify(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "uibus", "audit", "verify", "--redis-url", url],
                          capture_output=True, text=True, timeout=30)


async def test_two_replicas_write_one_chain(tmp_path: Path, redis_server: RedisProcess) -> None:
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)]) as apps:
        logs = [a.audit for a in apps]
        assert all(isinstance(log, AuditLog) for log in logs)
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") for a in apps]
        try:
            async def create(i: int) -> None:
                stub = sessions_pb2_grpc.SessionServiceStub(channels[i % 2])
                await stub.CreateSession(sessions_pb2.CreateSessionRequest(), metadata=(("x-uibus-session", f"r-{i}"),))

            await asyncio.gather(*(create(i) for i in range(2 * ROUNDS)))
            await asyncio.gather(*(log.record("test.burst", session="burst", n=i)  # type: ignore[union-attr]
                                   for i in range(ROUNDS) for log in logs))

            # a dialog held by replica 0, answered on replica 1: one entry, on replica 1's door
            ui = ext_grpc.ExtensionUiServiceStub(channels[1])
            watch = ui.Subscribe(ext.SubscribeRequest(), metadata=(("x-uibus-session", "held"),))
            asked = asyncio.ensure_future(ext_grpc.ExtensionUiServiceStub(channels[0]).Confirm(
                ext.ConfirmRequest(title="deploy?"), metadata=(("x-uibus-session", "held"),)))
            dialog = ""
            async for event in watch:
                if event.WhichOneof("event") == "request" and event.request.WhichOneof("method") == "confirm":
                    dialog = event.request.id
                    break
            watch.cancel()
            await ui.Respond(ext.RespondRequest(id=dialog, confirmed=True), metadata=(("x-uibus-session", "held"),))
            assert (await asyncio.wait_for(asked, 10)).confirmed is True
        finally:
            for ch in channels:
                await ch.close()

        count, broken = await logs[0].verify()  # type: ignore[union-attr]
        assert broken is None and count == 4 * ROUNDS + 1, (count, broken)
        entries = await logs[1].list(Query(limit=1000))  # type: ignore[union-attr]
        assert [e["seq"] for e in entries] == list(range(1, 4 * ROUNDS + 2))
        assert sum(e["act"] == "session.create" for e in entries) == 2 * ROUNDS
        # a session's entries come through its index (in order, paged), nothing of another session's
        burst = await logs[0].list(Query(session="burst", limit=1000))  # type: ignore[union-attr]
        assert len(burst) == 2 * ROUNDS and all(e["session"] == "burst" for e in burst)
        assert [e["seq"] for e in burst] == sorted(e["seq"] for e in burst)
        page = await logs[1].list(Query(session="burst", limit=7, after=burst[2]["seq"]))  # type: ignore[union-attr]
        assert [e["seq"] for e in page] == [e["seq"] for e in burst[3:10]]
        held = await logs[1].list(Query(session="held"))  # type: ignore[union-attr]
        assert [e["act"] for e in held] == ["dialog.approve"]
        answered = [e for e in entries if e["act"].startswith("dialog.")]
        assert len(answered) == 1 and answered[0]["detail"]["forwarded"] is True
        assert answered[0]["detail"]["title"] == "deploy?" and answered[0]["who"] == "local user"

    done = _verify(redis_server.url)
    assert done.returncode == 0 and done.stdout.strip() == f"chain of {4 * ROUNDS + 1} entries verified", done

    client = aioredis.from_url(redis_server.url)
    try:
        key = "uibus:{audit}:log"
        (text,) = await client.zrangebyscore(key, 7, 7)
        entry = json.loads(text)
        entry["detail"]["n"] = 99
        await client.zrem(key, text)
        await client.zadd(key, {json.dumps(entry, sort_keys=True): 7})
    finally:
        await client.aclose()
    bad = _verify(redis_server.url)
    assert bad.returncode == 1 and "broken at seq 7" in bad.stderr and "changed" in bad.stderr, bad.stderr

    # retention (all but the newest entry, the answer in "held") trims the sessions' indexes too
    client = aioredis.from_url(redis_server.url)
    try:
        backend = RedisAudit(client)
        assert await backend.trim(int(time.time() * 1000) + 60_000) == 4 * ROUNDS
        assert await client.zcard("uibus:{audit}:s:burst") == 0
        assert await client.smembers("uibus:{audit}:sessions") == {b"held"}
        assert [e["act"] for e in await backend.query(Query(session="held"))] == ["dialog.approve"]
        assert await backend.query(Query(session="burst")) == []
    finally:
        await client.aclose()

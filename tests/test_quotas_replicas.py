"""Quotas across replicas and fair shares (docs/security/quotas.md): two replicas on one real
redis-server hold ONE quota per tenant (a rate quota exactly, a held quota within its refresh), a
SIGKILLed replica's leases stop counting within the TTL, Redis gone means local counting (not
refusals); a tenant over its concurrency limit waits, then is refused naming the limit, while
another tenant's call is answered."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.conftest import free_port, start_app, wait_for
from tests.redisproc import RedisProcess, redis_server
from uibus.app import App
from uibus.infra.config import Config
from uibus.infra.quotas import QuotaExceeded
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc
from uibus.replicas.shared_quotas import TTL_S, SharedQuotas

__all__ = ["redis_server"]
pytestmark = pytest.mark.timeout(120)

TOKENS = "a-token (team-a) team-a-*\nb-token (team-b) team-b-*\n"
A, B = "team-a", "team-b"


def md(token: str, session: str | None = None) -> tuple[tuple[str, str], ...]:
    out = (("authorization", f"Bearer {token}"),)
    return (*out, ("x-uibus-session", session)) if session else out


def tokens_file(tmp_path: Path) -> str:
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    return str(path)


@contextlib.asynccontextmanager
async def two(tmp_path: Path, redis: RedisProcess, **changes: Any) -> AsyncIterator[list[App]]:
    """Two replicas on `redis` with the tokens above and `changes` (quotas)."""
    apps: list[App] = []
    try:
        for i in range(2):
            apps.append(await start_app(Config(
                host="127.0.0.1", port=0, http_port=free_port(), store=str(tmp_path / f"{i}.db"),
                redis_url=redis.url, grace_seconds=1.0, tokens_file=tokens_file(tmp_path), **changes)))
        await wait_for(lambda: all(a.bus.connected for a in apps), what="every replica on redis")
        yield apps
    finally:
        for app in apps:
            await app.aclose(grace=0.5)


async def create(channel: grpc.aio.Channel, token: str, session: str) -> str:
    """CreateSession's outcome: "OK", or "CODE: details"."""
    try:
        await sessions_pb2_grpc.SessionServiceStub(channel).CreateSession(pb.CreateSessionRequest(),
                                                                          metadata=md(token, session), timeout=10)
        return "OK"
    except grpc.aio.AioRpcError as err:
        return f"{err.code().name}: {err.details()}"


async def test_sessions_per_minute_is_one_quota_across_two_replicas(tmp_path: Path, redis_server: RedisProcess) -> None:
    async with two(tmp_path, redis_server, quota_sessions_per_minute=5) as apps:
        assert all(isinstance(app.quotas, SharedQuotas) for app in apps)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{apps[0].port}") as one, \
                grpc.aio.insecure_channel(f"127.0.0.1:{apps[1].port}") as other:
            channels = (one, other)
            for i in range(5):  # through both replicas, in turn: 5 in all
                assert await create(channels[i % 2], "a-token", f"team-a-{i}") == "OK", i
            for channel in channels:  # the 6th is refused by either replica
                refused = await create(channel, "a-token", "team-a-9")
                assert refused.startswith("RESOURCE_EXHAUSTED") and "quota sessions_per_minute" in refused, refused
                assert "--quota-sessions-per-minute" in refused and "limit of 5" in refused, refused
            for i in range(2):  # another tenant is not affected
                assert await create(channels[i], "b-token", f"team-b-{i}") == "OK"


async def test_a_held_quota_is_one_quota_across_two_replicas(tmp_path: Path, redis_server: RedisProcess) -> None:
    async with two(tmp_path, redis_server, quota_watches=2) as apps:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{apps[0].port}") as one, \
                grpc.aio.insecure_channel(f"127.0.0.1:{apps[1].port}") as other:
            held = []
            for channel in (one, other):  # one watch on each replica: 2 in all
                watch = sessions_pb2_grpc.SessionServiceStub(channel).WatchSessions(pb.ListSessionsRequest(),
                                                                                     metadata=md("a-token"))
                await asyncio.wait_for(watch.read(), 10)
                held.append(watch)
            await wait_for(lambda: all(app.quotas.in_use("watches", A) == 2 for app in apps), timeout=5,
                           what="each replica counting the other's watch")
            for channel in (one, other):
                third = sessions_pb2_grpc.SessionServiceStub(channel).WatchSessions(pb.ListSessionsRequest(),
                                                                                     metadata=md("a-token"))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await asyncio.wait_for(third.read(), 10)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "quota watches" in (refused.value.details() or "")
            b_watch = sessions_pb2_grpc.SessionServiceStub(other).WatchSessions(pb.ListSessionsRequest(),
                                                                                 metadata=md("b-token"))
            await asyncio.wait_for(b_watch.read(), 10)  # B is not refused because of A
            held[0].cancel()  # given back on one replica: the other may open one again
            await wait_for(lambda: apps[1].quotas.in_use("watches", A) == 1, timeout=5, what="the lease given back")
            again = sessions_pb2_grpc.SessionServiceStub(other).WatchSessions(pb.ListSessionsRequest(),
                                                                               metadata=md("a-token"))
            await asyncio.wait_for(again.read(), 10)
            for call in (held[1], b_watch, again):
                call.cancel()


async def test_a_killed_replicas_leases_expire_within_the_ttl(tmp_path: Path, redis_server: RedisProcess,
                                                             spawn: Any) -> None:
    server = spawn("--redis-url", redis_server.url, "--tokens-file", tokens_file(tmp_path), "--quota-watches", "2",
                   "--grace-seconds", "1")
    await server.wait_ready()
    async with two(tmp_path, redis_server, quota_watches=2) as apps:
        here = apps[0]
        async with grpc.aio.insecure_channel(server.target) as there, \
                grpc.aio.insecure_channel(f"127.0.0.1:{here.port}") as near:
            held = [sessions_pb2_grpc.SessionServiceStub(there).WatchSessions(pb.ListSessionsRequest(),
                                                                              metadata=md("a-token"))
                    for _ in range(2)]
            for watch in held:
                await asyncio.wait_for(watch.read(), 10)
            await wait_for(lambda: here.quotas.in_use("watches", A) == 2, timeout=5, what="the other's watches read")
            refused = sessions_pb2_grpc.SessionServiceStub(near).WatchSessions(pb.ListSessionsRequest(),
                                                                                metadata=md("a-token"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(refused.read(), 10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            server.proc.kill()  # SIGKILL: it gives nothing back; its counts expire
            took = await wait_for(lambda: here.quotas.in_use("watches", A) == 0, timeout=TTL_S + 3,
                                  what="the killed replica's leases expiring")
            assert took <= TTL_S + 3
            watch = sessions_pb2_grpc.SessionServiceStub(near).WatchSessions(pb.ListSessionsRequest(),
                                                                              metadata=md("a-token"))
            await asyncio.wait_for(watch.read(), 10)
            watch.cancel()
            for call in held:
                call.cancel()


async def test_without_redis_each_replica_counts_alone(caplog: pytest.LogCaptureFixture) -> None:
    """Redis unreachable: nothing is refused because of it; the counts are this replica's own (warned once)."""
    async with SharedQuotas({"sessions_per_minute": 2, "watches": 1}, f"redis://127.0.0.1:{free_port()}/0",
                            "r1") as quotas:
        await quotas.take("sessions_per_minute", A)
        await quotas.take("sessions_per_minute", A)
        with pytest.raises(QuotaExceeded, match="quota sessions_per_minute"):
            await quotas.take("sessions_per_minute", A)
        await quotas.take("sessions_per_minute", B)
        with quotas.hold("watches", A):
            with pytest.raises(QuotaExceeded, match="quota watches"):
                quotas.hold("watches", A)
            quotas.hold("watches", B).release()
    warned = [r for r in caplog.records if "Redis unreachable" in r.getMessage()]
    assert 1 <= len(warned) <= 2  # once for held counts, once for rate counts


# ---- fair shares: a tenant's unary calls in flight (uibus.edge.calls.admission) ----------------------

SLOW = "/uibustest.Slow/Wait"


def slow_service(release: asyncio.Event) -> Any:
    """An installer serving SLOW, a unary call that waits for `release`: calls a test holds open, run
    through the real pipeline like every handler."""

    @contextlib.asynccontextmanager
    async def install(setup: Any) -> AsyncIterator[None]:
        async def wait(request: bytes, context: Any) -> bytes:
            await release.wait()
            return request

        handler = grpc.unary_unary_rpc_method_handler(wait)
        setup.registry.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "uibustest.Slow", {"Wait": handler})])
        yield
    install.__name__ = "slow test service"
    return install


async def test_a_tenant_over_its_concurrency_waits_then_is_refused_and_others_are_answered(
        web_config: Config, tmp_path: Path) -> None:
    from dataclasses import replace

    from uibus.app.installers import INSTALLERS

    release = asyncio.Event()
    app = await start_app(replace(web_config, tokens_file=tokens_file(tmp_path), tenant_concurrency=2),
                          installers=[*INSTALLERS, slow_service(release)])
    gate = app.registry.pipeline.admission  # type: ignore[union-attr]
    assert gate is not None and gate.limit == 2 and gate.queue == 32
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            slow = ch.unary_unary(SLOW)
            api = sessions_pb2_grpc.SessionServiceStub(ch)
            running = [asyncio.ensure_future(slow(b"run", metadata=md("a-token", "team-a-1"), timeout=30))
                       for _ in range(2)]
            await wait_for(lambda: gate.running(A) == 2, timeout=10, what="A's two slots taken")
            # A's next call waits its turn (a real method) ...
            listing = asyncio.ensure_future(api.ListSessions(pb.ListSessionsRequest(), metadata=md("a-token"),
                                                             timeout=30))
            await wait_for(lambda: gate.waiting(A) == 1, timeout=10, what="A's third call waiting")
            # ... while B's calls are answered at once: B is not behind A
            for _ in range(3):
                reply = await api.ListSessions(pb.ListSessionsRequest(), metadata=md("b-token"), timeout=10)
                assert reply.sessions == []
            assert not listing.done()
            # A's queue (16 per slot: 32) fills; the next is refused, naming the limit and its option
            queued = [asyncio.ensure_future(slow(b"q", metadata=md("a-token", "team-a-1"), timeout=30))
                      for _ in range(31)]
            await wait_for(lambda: gate.waiting(A) == 32, timeout=10, what="A's queue full")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await slow(b"over", metadata=md("a-token", "team-a-1"), timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = refused.value.details() or ""
            assert "tenant 'team-a'" in details and "--tenant-concurrency 2" in details, details
            queued[0].cancel()  # a waiting caller that goes away gives up its place, not a slot
            with contextlib.suppress(asyncio.CancelledError):
                await queued[0]
            release.set()  # every waiting call gets its turn, in order
            assert [await call for call in running] == [b"run", b"run"]
            assert (await listing).sessions == []
            assert [await call for call in queued[1:]] == [b"q"] * 30
            await wait_for(lambda: gate.running(A) == 0 and gate.waiting(A) == 0, timeout=5, what="slots given back")
            assert gate.running(B) == 0 and gate.refused == 1
    finally:
        await app.aclose(grace=0.5)

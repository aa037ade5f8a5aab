"""Fair shares: a tenant's call rate (`--quota-calls-per-second`, uibus.edge.calls.admission's token
bucket). A tenant over its rate is slowed (its call waits for its token), then refused
RESOURCE_EXHAUSTED naming the quota, its limit and its option (counted on /metrics), while another
tenant's calls are answered meanwhile; a waiter that goes away gives its token back and leaks no
count; without tokens nothing is rate-limited. Functional checks, never timing assertions beyond
"a sleep is not shorter than asked" (bench/fairness.py measures the latencies)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest

from tests.conftest import start_app, wait_for
from tests.support import scrape
from uibus.app import App
from uibus.edge.calls.admission import Admission, Rate
from uibus.infra.config import Config
from uibus.infra.quotas import QuotaExceeded, Quotas
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc

pytestmark = pytest.mark.timeout(60)

TOKENS = "a-token (team-a) team-a-*\nb-token (team-b) team-b-*\nadmin-token *\n"
A, B = "team-a", "team-b"


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture
async def rated(web_config: Config, tmp_path: Path) -> AsyncIterator[App]:
    """Tokens for two tenants and one call per second each (a bucket of one): a second call waits up to
    1 s for its token, a third at once is refused."""
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    app = await start_app(replace(web_config, tokens_file=str(path), quota_calls_per_second=1))
    try:
        yield app
    finally:
        await app.aclose(grace=0.5)


async def test_a_tenant_over_its_rate_waits_then_is_refused_and_others_are_answered(rated: App) -> None:
    gate = rated.registry.pipeline.admission  # type: ignore[union-attr]
    assert gate is not None and gate.rate is not None and gate.rate.per_second == 1
    rate = gate.rate
    async with grpc.aio.insecure_channel(f"127.0.0.1:{rated.port}") as ch:
        api = sessions_pb2_grpc.SessionServiceStub(ch)
        started = time.monotonic()
        assert (await api.ListSessions(pb.ListSessionsRequest(), metadata=md("a-token"), timeout=10)).sessions == []
        assert rate.waited == 0  # the bucket's token: at once
        # A's second call waits for the next token (slowed, not refused) ...
        second = asyncio.ensure_future(api.ListSessions(pb.ListSessionsRequest(), metadata=md("a-token"), timeout=10))
        await wait_for(lambda: rate.waiting(A) == 1, timeout=5, what="A's second call waiting for its token")
        # ... its third would wait past 1 s: refused, naming the quota, its limit and its option
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await api.ListSessions(pb.ListSessionsRequest(), metadata=md("a-token"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = refused.value.details() or ""
        assert "quota calls_per_second exceeded: tenant 'team-a'" in details, details
        assert "limit of 1 unary calls per second" in details and "--quota-calls-per-second" in details, details
        # B is not behind A: answered while A's call still waits
        assert (await api.ListSessions(pb.ListSessionsRequest(), metadata=md("b-token"), timeout=10)).sessions == []
        assert rate.waiting(A) == 1 and not second.done()
        assert (await second).sessions == []
        assert time.monotonic() - started >= 0.95  # two calls at one per second (a bucket of one)
        assert rate.waiting(A) == 0 and rate.waiting(B) == 0
        # a waiter whose caller goes away gives back its place (the server's call is cancelled)
        gone = asyncio.ensure_future(api.ListSessions(pb.ListSessionsRequest(), metadata=md("a-token"), timeout=10))
        await wait_for(lambda: rate.waiting(A) == 1, timeout=5, what="A's call waiting for its token")
        gone.cancel()
        await wait_for(lambda: rate.waiting(A) == 0 and gate.running(A) == 0, timeout=5, what="the waiter gone")
    # the refusal counts on /metrics like every quota's
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{rated.http_port}",
                                 headers={"Authorization": "Bearer admin-token"}, timeout=10) as http:
        samples = await scrape(http)
    assert samples[("uibus_quota_refused_total", (("quota", "calls_per_second"), ("tenant", A)))] == 1
    assert ("uibus_quota_refused_total", (("quota", "calls_per_second"), ("tenant", B))) not in samples
    assert samples[("uibus_quota_waited_total", (("quota", "calls_per_second"), ("tenant", A)))] == 2  # slowed


async def test_health_probes_are_never_rated(rated: App) -> None:
    """A probe carries no token (tenant `anonymous`): it must never wait behind a rate."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{rated.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        replies = await asyncio.gather(*(health.Check(health_pb2.HealthCheckRequest(), timeout=10) for _ in range(10)))
    assert {r.status for r in replies} == {health_pb2.HealthCheckResponse.SERVING}
    assert rated.registry.pipeline.admission.rate.waited == 0  # type: ignore[union-attr]


async def test_the_http_door_is_rated_too(rated: App) -> None:
    """The same bucket on every door (one pipeline): the HTTP API's refusal is 429 naming the quota."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{rated.http_port}", timeout=10) as http:
        headers = {"Authorization": "Bearer a-token"}
        replies = []
        for _ in range(3):  # at once: the bucket's token; the next waits (gathered); a third is refused
            replies = await asyncio.gather(*(http.get("/api/v1/sessions", headers=headers) for _ in range(3)))
            if any(r.status_code == 429 for r in replies):
                break
        codes = [r.status_code for r in replies]
        assert 429 in codes and 200 in codes, codes
        refused = next(r for r in replies if r.status_code == 429).json()
        assert refused["code"] == "RESOURCE_EXHAUSTED" and "--quota-calls-per-second" in refused["error"], refused
        r = await http.get("/api/v1/sessions", headers={"Authorization": "Bearer b-token"})
        assert r.status_code == 200, r.text


async def test_a_cancelled_waiter_gives_its_token_back_and_the_waiters_are_bounded() -> None:
    quotas = Quotas({"calls_per_second": 10})
    rate = Rate(10, quotas, burst_s=0.1, max_wait_s=5.0, max_waiters=2)  # a bucket of one token
    assert rate.reserve(A) == 0.0
    first = rate.reserve(A)
    assert 0 < first <= 0.1
    waiter = asyncio.ensure_future(rate.wait(A, first))
    second = rate.reserve(A)
    assert second > first  # in turn: each reservation is one token later
    later = asyncio.ensure_future(rate.wait(A, second))
    await asyncio.sleep(0)
    assert rate.waiting(A) == 2
    with pytest.raises(QuotaExceeded, match="2 of its calls already wait") as over:  # the bound on waiters
        rate.reserve(A)
    assert over.value.quota == "calls_per_second"
    tokens = rate._buckets[A].tokens
    later.cancel()
    with pytest.raises(asyncio.CancelledError):
        await later  # the cancel goes on ...
    assert rate._buckets[A].tokens == tokens + 1 and rate.waiting(A) == 1  # ... and its token is back
    await waiter
    assert rate.waiting(A) == 0
    assert rate.reserve(B) == 0.0  # another tenant's bucket is its own
    assert quotas.refused == {("calls_per_second", A): 1}


async def test_without_tokens_nothing_is_rate_limited(web_config: Config) -> None:
    app = await start_app(replace(web_config, quota_calls_per_second=1))
    try:
        gate = app.registry.pipeline.admission  # type: ignore[union-attr]
        assert gate is None or gate.rate is None  # no tokens: one tenant, nobody to share with
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            api = sessions_pb2_grpc.SessionServiceStub(ch)
            replies = await asyncio.gather(*(api.ListSessions(pb.ListSessionsRequest(), timeout=10)
                                             for _ in range(20)))
        assert len(replies) == 20  # 20 calls at one per second would have waited, then been refused
    finally:
        await app.aclose(grace=0.5)


async def test_admission_with_the_rate_alone() -> None:
    """`--tenant-concurrency 0` with a rate: the rate's step alone (no slots counted)."""
    gate = Admission(0, rate=Rate(1000, Quotas()))
    assert await gate.take(A) == A and gate.running(A) == 0
    gate.leave(A)
    assert gate.running(A) == 0

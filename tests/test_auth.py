"""Tokens beyond the per-transport matrix (tests/test_policy_matrix.py): what each kind of call
needs, the HTTP pages (/metrics, the webview page, health), and a real `uibus serve` reloading its
tokens file on SIGHUP without ever printing a token."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import REPO, ServerProcess, start_app
from uibus.app import App
from uibus.infra.auth import Tokens, parse_tokens_file
from uibus.infra.config import Config
from uibus.infra.errors import ConfigError
from uibus.pb.cline import common_pb2
from uibus.pb.neuro_san.api.grpc import concierge_pb2, concierge_pb2_grpc
from uibus.pb.uibus.v1 import host_pb2, host_pb2_grpc

TOKENS = """\
# token          sessions
team-a-token     team-a-*  demo
admin-token      *
"""
TEAM_A = (("authorization", "Bearer team-a-token"),)
ADMIN = (("authorization", "Bearer admin-token"),)


@pytest.fixture
async def tenants(web_config: Config, tmp_path: Path) -> AsyncIterator[App]:
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    app = await start_app(replace(web_config, tokens_file=str(path), metrics_token="metrics-token"))
    try:
        yield app
    finally:
        await app.aclose(grace=0.5)


async def _code(call: object) -> str:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return "OK"


async def test_what_each_kind_of_call_needs(tenants: App) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tenants.port}") as ch:
        host = host_pb2_grpc.HostServiceStub(ch)
        # Process-wide statistics: only an all-sessions token.
        assert await _code(host.GetBusStats(common_pb2.Empty(), metadata=TEAM_A)) == "PERMISSION_DENIED"
        assert await _code(host.GetBusStats(common_pb2.Empty(), metadata=ADMIN)) == "OK"
        # A call with no session key is a call on session "default": not one of team A's.
        assert await _code(host.GetSessionState(common_pb2.Empty(), metadata=TEAM_A)) == "PERMISSION_DENIED"
        assert await _code(host.GetSessionState(common_pb2.Empty(),
                                                metadata=(*TEAM_A, ("x-uibus-session", "demo")))) == "OK"
        # A bad session name is still a bad argument, not a permission question.
        assert await _code(host.GetSessionState(common_pb2.Empty(),
                                                metadata=(*TEAM_A, ("x-uibus-session", "bad name")))) == \
            "INVALID_ARGUMENT"
        # Calls about no session: any valid token (agent list, reflection); none without one.
        concierge = concierge_pb2_grpc.ConciergeServiceStub(ch)
        assert await _code(concierge.List(concierge_pb2.ConciergeRequest(), metadata=TEAM_A)) == "OK"
        assert await _code(concierge.List(concierge_pb2.ConciergeRequest())) == "UNAUTHENTICATED"
        reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
        listing = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = [r async for r in reflection.ServerReflectionInfo(iter([listing]), metadata=TEAM_A)]
        assert "uibus.v1.HostService" in {s.name for s in replies[0].list_services_response.service}
        # Health stays open for probes.
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_http_pages_need_a_token_but_health_does_not(tenants: App) -> None:
    base = f"http://127.0.0.1:{tenants.http_port}"
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        for path in ("/healthz", "/livez", "/readyz"):
            assert (await http.get(path)).status_code == 200, path
        # /metrics: the metrics token or an all-sessions token (any scheme case); a tenant's is refused.
        r = await http.get("/metrics")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert (await http.get("/metrics", headers={"authorization": "Bearer wrong"})).status_code == 401
        assert (await http.get("/metrics", headers={"authorization": "Bearer team-a-token"})).status_code == 403
        for value in ("Bearer metrics-token", "bearer metrics-token", "BEARER admin-token"):
            r = await http.get("/metrics", headers={"authorization": value})
            assert r.status_code == 200 and "uibus_rpc_duration_seconds" in r.text, value
        # The page: without a token, the sign-in page (401); with any valid token, the webview.
        r = await http.get("/")
        assert r.status_code == 401 and 'id="login"' in r.text and "webview" not in r.text.lower()
        assert r.headers["cache-control"] == "no-store"
        r = await http.get("/", headers={"authorization": "Bearer team-a-token"})
        assert r.status_code == 200 and 'id="login"' not in r.text and "<script>" in r.text


async def test_no_tokens_configured_leaves_everything_open(web: App) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{web.http_port}", timeout=10) as http:
        assert (await http.get("/metrics")).status_code == 200
        assert (await http.get("/")).status_code == 200


async def test_unknown_websocket_path_is_404(web: App) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus) as refused:
        async with connect(f"ws://127.0.0.1:{web.http_port}/no/such/socket"):
            pass
    assert refused.value.response.status_code == 404


def test_tokens_file_errors_name_the_line(tmp_path: Path) -> None:
    cases = {
        "lonely-token\n": "line 1: a token needs at least one session pattern",
        "# c\n\ntok team-a-*\ntok team-b-*\n": "line 4: the same token is already on --tokens-file line 3",
        "tok team a\ntok2 bad\"pattern\n": "line 2: 'bad\"pattern' is not a session pattern",
        "tok (a) (b) team-*\n": "line 1: one (tenant) per token",
        "tok (a b) team-*\n": "line 1: '(a' is not a tenant name",
        "tok (operator) team-*\n": "line 1: tenant name 'operator' is reserved",
        "tok (t-x) team-*\n": "line 1: tenant name 't-x' is reserved",
        "tok (team-a)\n": "line 1: a token needs at least one session pattern",
    }
    for text, message in cases.items():
        with pytest.raises(ConfigError) as err:
            parse_tokens_file(text, "tokens")
        assert err.value.source == "--tokens-file" and message in err.value.what, (text, err.value.what)
    with pytest.raises(ConfigError, match="cannot read"):
        Tokens(tokens_file=str(tmp_path / "missing"))
    grants = parse_tokens_file("t1 team-?-[0-9]* exact\n", "f")
    (grant,) = grants.values()
    assert [s for s in ("team-a-1", "team-ab-1", "team-b-", "team-c-9x", "exact", "exactly") if grant.allows(s)] == \
        ["team-a-1", "team-c-9x", "exact"]
    assert "t1" not in repr(grant)


async def test_sighup_reloads_the_tokens_file_and_never_prints_a_token(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("rotating-secret-1 team-a-*\n")
    server = ServerProcess(tmp_path, "--tokens-file", str(tokens), "--auth-token", "operator-secret-9")
    try:
        await server.wait_ready()

        async def set_theme(token: str, session: str) -> str:
            async with grpc.aio.insecure_channel(server.target) as ch:
                call = host_pb2_grpc.HostServiceStub(ch).SetTheme(
                    host_pb2.TextEvent(text='{"kind": "dark"}'),
                    metadata=(("authorization", f"Bearer {token}"), ("x-uibus-session", session)))
                return await _code(call)

        assert await set_theme("rotating-secret-1", "team-a-1") == "OK"
        assert await set_theme("rotating-secret-1", "team-b-1") == "PERMISSION_DENIED"
        assert await set_theme("operator-secret-9", "team-b-1") == "OK"
        # Rotate: the old token goes, a new one covers team B.
        tokens.write_text("rotating-secret-2 team-b-*\n")
        server.proc.send_signal(signal.SIGHUP)
        for _ in range(100):
            if await set_theme("rotating-secret-2", "team-b-1") == "OK":
                break
            await asyncio.sleep(0.05)
        assert await set_theme("rotating-secret-2", "team-b-1") == "OK"
        assert await set_theme("rotating-secret-1", "team-a-1") == "UNAUTHENTICATED"
        # A broken file on reload keeps the tokens in force.
        tokens.write_text("only-a-token-and-no-pattern\n")
        server.proc.send_signal(signal.SIGHUP)
        await asyncio.sleep(0.3)
        assert await set_theme("rotating-secret-2", "team-b-1") == "OK"
        assert await set_theme("operator-secret-9", "anything") == "OK"  # --auth-token survives every reload
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(15) == 0
    finally:
        server.stop()
    log = server.log.read_text()
    assert "tokens reloaded" in log and "tokens file not reloaded" in log and "line 1" in log
    for secret in ("rotating-secret-1", "rotating-secret-2", "operator-secret-9", "only-a-token"):
        assert secret not in log, secret
    # `--help` shows that a token is set, never its value.
    shown = subprocess.run([sys.executable, "-m", "uibus", "serve", "--help"], capture_output=True, text=True,
                           cwd=REPO, env={"UIBUS_AUTH_TOKEN": "operator-secret-9", "PATH": "/usr/bin:/bin"},
                           timeout=30)
    assert shown.returncode == 0 and "operator-secret-9" not in shown.stdout + shown.stderr

"""One behaviour, every way in: each policy of the handler pipeline gives the same status on every
transport, and is counted in the same metrics series.

Transports: native gRPC, gRPC-Web (binary and text), the neuro-san HTTP API, the CodeBolt
WebSocket, MCP (JSON-RPC on `/mcp`) and an in-process channel. Policies: undecodable input, a missing or wrong token, a
token bound to other sessions (and its reload), the store unreachable (a real redis-server,
stopped), and an unexpected exception in a handler (a store that breaks for one session). Each
case is a real call over a real connection to a real App; the status is read the way that
transport's client reads it (gRPC status, grpc-status trailer, HTTP status and JSON `code`, the
CodeBolt reply's `code`, the JSON-RPC error's `data.status`).
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from tests.conftest import free_port, start_app, wait_for
from tests.redisproc import RedisProcess, redis_server
from tests.support import scrape_text
from tests.webclient import call
from uibus.app import App
from uibus.infra.config import Config
from uibus.infra.sqlite_store import SqliteStore
from uibus.pb.uibus.v1 import host_pb2

__all__ = ["redis_server"]

TRANSPORTS = ("grpc", "grpc-web", "grpc-web-text", "http", "websocket", "mcp", "inprocess")
SET_THEME = "/uibus.v1.HostService/SetTheme"
CHAT = "/hello_world.AgentService/StreamingChat"
MEMORY_SET = "/codebolt.AgentToApp/memoryEvent.memorySet"
GARBAGE = b"\xff\xff\xff"  # not a protobuf message: a field with an invalid wire type
THEME = host_pb2.TextEvent(text='{"kind": "dark"}').SerializeToString()
TOKEN = "s3cret"


class FaultyStore(SqliteStore):
    """A store with a bug: every operation of session "faulty" raises an unexpected exception."""

    def _check(self, session: str) -> None:
        if session == "faulty":
            raise RuntimeError("the disk is on fire")

    async def get(self, session: str, key: str) -> Any:
        self._check(session)
        return await super().get(session, key)

    async def put(self, session: str, key: str, value: Any) -> None:
        self._check(session)
        await super().put(session, key, value)

    async def scan(self, session: str, prefix: str) -> dict[str, Any]:
        self._check(session)
        return await super().scan(session, prefix)

    async def append(self, session: str, key: str, value: Any, max_len: int = 10_000, max_bytes: int = 0) -> None:
        self._check(session)
        await super().append(session, key, value, max_len, max_bytes)

    async def items(self, session: str, key: str, last: int = 0) -> list[Any]:
        self._check(session)
        return await super().items(session, key, last)


@dataclass
class Outcome:
    code: str  # the gRPC status name the client read
    message: str
    method: str  # the metrics label the call is counted under


Attempt = Callable[[App, str, dict[str, str], bool], Awaitable[Outcome]]


def _grpc_web_body(payload: bytes, text: bool) -> bytes:
    body = b"\x00" + len(payload).to_bytes(4, "big") + payload
    return base64.b64encode(body) if text else body


async def via_grpc(app: App, session: str, headers: dict[str, str], garbage: bool) -> Outcome:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        try:
            await channel.unary_unary(SET_THEME)(GARBAGE if garbage else THEME,
                                                 metadata=(("x-uibus-session", session), *headers.items()))
        except grpc.aio.AioRpcError as exc:
            return Outcome(exc.code().name, exc.details() or "", SET_THEME)
    return Outcome("OK", "", SET_THEME)


async def _via_grpc_web(app: App, session: str, headers: dict[str, str], garbage: bool, text: bool) -> Outcome:
    async with httpx.AsyncClient(timeout=10) as http:
        reply = await call(http, f"http://127.0.0.1:{app.http_port}{SET_THEME}", GARBAGE if garbage else THEME,
                           text=text, headers={"x-uibus-session": session, **headers})
    return Outcome(grpc.StatusCode.OK.name if reply.status == 0 else
                   next(c.name for c in grpc.StatusCode if c.value[0] == reply.status), reply.message, SET_THEME)


async def via_grpc_web(app: App, session: str, headers: dict[str, str], garbage: bool) -> Outcome:
    return await _via_grpc_web(app, session, headers, garbage, text=False)


async def via_grpc_web_text(app: App, session: str, headers: dict[str, str], garbage: bool) -> Outcome:
    return await _via_grpc_web(app, session, headers, garbage, text=True)


async def via_http(app: App, session: str, headers: dict[str, str], garbage: bool) -> Outcome:
    body = b"{not json" if garbage else json.dumps({"user_message": {"text": "hi"}}).encode()
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"http://127.0.0.1:{app.http_port}/api/v1/hello_world/streaming_chat", content=body,
                            headers={"x-uibus-session": session, **headers})
    if r.status_code == 200:
        return Outcome("OK", "", CHAT)
    error = r.json()
    assert r.status_code == {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403,
                             "UNAVAILABLE": 503, "INTERNAL": 500}[error["code"]], (r.status_code, error)
    return Outcome(error["code"], error["error"], CHAT)


async def via_websocket(app: App, session: str, headers: dict[str, str], garbage: bool) -> Outcome:
    url = f"ws://127.0.0.1:{app.http_port}/agent-to-app?session={session}"
    try:
        async with ws_connect(url, additional_headers=headers) as ws:
            frame = "{not json" if garbage else json.dumps(
                {"type": "memoryEvent", "action": "memorySet", "requestId": "m1", "message": {"key": "k", "value": 1}})
            await ws.send(frame)
            reply = json.loads(await ws.recv())
    except InvalidStatus as exc:  # the upgrade itself was refused: HTTP status, JSON body
        error = json.loads(exc.response.body)
        assert exc.response.status_code == {"UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403}[error["code"]], error
        return Outcome(error["code"], error["error"], "/codebolt.AgentToApp/connect")
    method = "/codebolt.AgentToApp/frame" if garbage else MEMORY_SET
    if reply["success"]:
        return Outcome("OK", "", method)
    return Outcome(reply["code"], reply["error"], method)


async def via_mcp(app: App, session: str, headers: dict[str, str], garbage: bool) -> Outcome:
    body = b"{not json" if garbage else json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "hello_world", "arguments": {"user_message": {"text": "hi"}}}}).encode()
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"http://127.0.0.1:{app.http_port}/mcp", content=body,
                            headers={"content-type": "application/json", "x-uibus-session": session, **headers})
    method = "/mcp/invalid" if garbage else "/mcp/tools/call"
    reply = r.json()
    if "result" in reply:
        assert r.status_code == 200 and not reply["result"]["isError"], reply
        return Outcome("OK", "", method)
    code = reply["error"]["data"]["status"]
    # Refused for the token: MCP's HTTP statuses; input that is no message: 400; every answered call: 200.
    assert r.status_code == {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403}.get(
        code, 200), (r.status_code, reply)
    return Outcome(code, reply["error"]["message"], method)


async def via_inprocess(app: App, session: str, headers: dict[str, str], garbage: bool) -> Outcome:
    channel = app.channel([("x-uibus-session", session), *headers.items()])
    try:
        await channel.unary_unary(SET_THEME)(GARBAGE if garbage else THEME)
    except grpc.aio.AioRpcError as exc:
        return Outcome(exc.code().name, exc.details() or "", SET_THEME)
    return Outcome("OK", "", SET_THEME)


ATTEMPTS: dict[str, Attempt] = {"grpc": via_grpc, "grpc-web": via_grpc_web, "grpc-web-text": via_grpc_web_text,
                                "http": via_http, "websocket": via_websocket, "mcp": via_mcp,
                                "inprocess": via_inprocess}
# The metrics `transport` label of each (both gRPC-Web forms are one transport).
LABELS = {"grpc": "grpc", "grpc-web": "grpc-web", "grpc-web-text": "grpc-web", "http": "http",
          "websocket": "websocket", "mcp": "mcp", "inprocess": "inprocess"}


def rpc_count(app: App, method: str, code: str, transport: str) -> float:
    assert app.metrics is not None
    for family in text_string_to_metric_families(app.metrics.render().decode()):
        for s in family.samples:
            if s.name == "uibus_rpc_duration_seconds_count" and s.labels == {
                    "method": method, "code": code, "transport": transport}:
                return s.value
    return 0.0


@pytest.fixture
def matrix_config(tmp_path: Path) -> Config:
    return Config(host="127.0.0.1", port=0, http_port=free_port(), store=str(tmp_path / "m.db"), grace_seconds=1.0)


@pytest.fixture
async def started() -> AsyncIterator[Callable[..., Awaitable[App]]]:
    apps: list[App] = []

    async def start(config: Config, **kw: Any) -> App:
        app = await start_app(config, **kw)
        apps.append(app)
        return app

    yield start
    for app in apps:
        await app.aclose(grace=0.5)


async def check(app: App, transport: str, outcome: Outcome, code: str) -> None:
    assert outcome.code == code, f"{transport}: {outcome}"
    assert "Traceback" not in outcome.message and outcome.message, outcome
    # grpc.aio sends an aborted call's status before the handler's `finally` has run: wait a moment.
    await wait_for(lambda: rpc_count(app, outcome.method, code, LABELS[transport]) == 1, timeout=2,
                   what=f"{transport} counted once as {code}")
    page = await scrape_text(app)  # the same series, as served on /metrics
    assert (f'uibus_rpc_duration_seconds_count{{code="{code}",method="{outcome.method}",'
            f'transport="{LABELS[transport]}"}} 1.0') in page


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_undecodable_input_is_invalid_argument(transport: str, matrix_config: Config, started: Any,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    app = await started(matrix_config)
    with caplog.at_level(logging.INFO, logger="uibus"):
        outcome = await ATTEMPTS[transport](app, "s1", {}, True)
    await check(app, transport, outcome, "INVALID_ARGUMENT")
    lines = [r for r in caplog.records if r.name == "uibus.edge.calls"]
    assert len(lines) == 1 and lines[0].getMessage() == "request refused" and lines[0].exc_info is None, lines
    # Nothing was lost: the same client's next good call works.
    assert (await ATTEMPTS[transport](app, "s1", {}, False)).code == "OK"


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("token", ["", "wrong"])
async def test_missing_or_wrong_token_is_unauthenticated(transport: str, token: str, matrix_config: Config,
                                                         started: Any) -> None:
    app = await started(replace(matrix_config, auth_token=TOKEN))
    headers = {"authorization": f"Bearer {token}"} if token else {}
    outcome = await ATTEMPTS[transport](app, "s1", headers, False)
    await check(app, transport, outcome, "UNAUTHENTICATED")
    # RFC 7235: the scheme is case-insensitive.
    assert (await ATTEMPTS[transport](app, "s1", {"authorization": f"bearer {TOKEN}"}, False)).code == "OK"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_token_bound_to_other_sessions_is_permission_denied(transport: str, matrix_config: Config,
                                                                  started: Any, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# tenant tokens\nteam-a-token  team-a-*  demo\nadmin-token *  # the operator\n")
    app = await started(replace(matrix_config, tokens_file=str(tokens), metrics_token="metrics-token"))
    team_a = {"authorization": "Bearer team-a-token"}
    assert (await ATTEMPTS[transport](app, "team-a-1", team_a, False)).code == "OK"
    outcome = await ATTEMPTS[transport](app, "team-b-1", team_a, False)
    await check(app, transport, outcome, "PERMISSION_DENIED")
    assert "'team-b-1'" in outcome.message and "team-a-*" in outcome.message and "team-a-token" not in outcome.message
    admin = {"authorization": "bearer admin-token"}
    for session in ("team-a-1", "team-b-1"):
        assert (await ATTEMPTS[transport](app, session, admin, False)).code == "OK"
    # The file is edited and reloaded (SIGHUP in `uibus serve`): the new grants hold for new calls.
    tokens.write_text("team-a-token team-b-*\n")
    assert app.reload_tokens()
    assert (await ATTEMPTS[transport](app, "team-b-1", team_a, False)).code == "OK"
    assert (await ATTEMPTS[transport](app, "team-a-1", team_a, False)).code == "PERMISSION_DENIED"
    assert (await ATTEMPTS[transport](app, "team-a-1", admin, False)).code == "UNAUTHENTICATED"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_store_unreachable_is_unavailable(transport: str, matrix_config: Config, started: Any,
                                                redis_server: RedisProcess) -> None:
    app = await started(replace(matrix_config, redis_url=redis_server.url))
    assert (await ATTEMPTS[transport](app, "s1", {}, False)).code == "OK"
    redis_server.kill()
    outcome = await ATTEMPTS[transport](app, "s1", {}, False)
    await check(app, transport, outcome, "UNAVAILABLE")
    assert "unreachable" in outcome.message


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_unexpected_exception_is_internal(transport: str, matrix_config: Config, started: Any,
                                                caplog: pytest.LogCaptureFixture) -> None:
    app = await started(matrix_config, store=FaultyStore(matrix_config.store))
    with caplog.at_level(logging.INFO, logger="uibus"):
        outcome = await ATTEMPTS[transport](app, "faulty", {}, False)
    await check(app, transport, outcome, "INTERNAL")
    assert "the disk is on fire" not in outcome.message  # no internals to the client …
    failed = [r for r in caplog.records if r.name == "uibus.edge.calls"]
    assert len(failed) == 1 and failed[0].getMessage() == "handler failed" and failed[0].exc_info  # … one log line
    # Every other session (and client) keeps working.
    assert (await ATTEMPTS[transport](app, "healthy", {}, False)).code == "OK"

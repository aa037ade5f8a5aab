"""Each role × a representative method of each least role, on every door: gRPC, gRPC-Web, the HTTP
API, MCP and /acp — allowed when the role is at least the method's least role in the roles table
(uibus.edge.calls.roles, which this test reads: the expectation is generated from the table, so a
changed row changes what is asserted), else PERMISSION_DENIED (HTTP 403, MCP's 403 with its
`data.status`, ACP's error naming it). And every gRPC method of the table, called by an observer
and by the session's owner on the native door: refused exactly when the table says so.

"Allowed" is any answer but PERMISSION_DENIED: the representative calls name agents and dialogs that
need not exist (NOT_FOUND and INVALID_ARGUMENT then say the role check passed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

from tests.conftest import free_port, start_app, wait_for
from tests.webclient import call as grpc_web_call
from uibus.app import App
from uibus.edge.calls.access import ITS_SESSION, access_of
from uibus.edge.calls.roles import MCP_TOOLS, TABLE, least_for
from uibus.infra.config import Config
from uibus.infra.roles import ROLES, at_least
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
from uibus.pb.uibus.v1 import host_pb2
from uibus.pb.uibus.v1 import sessions_pb2 as spb

SESSION = "team-a-m"
# One person per role on SESSION: `own` creates it (owner); the others hold a tenant-wide role.
TOKENS = """\
own (team-a) team-a-* person=own role=participant
approver (team-a) team-a-* person=appr role=approver
participant (team-a) team-a-* person=part role=participant
observer (team-a) team-a-* person=obs role=observer
"""
TOKEN_OF = {"owner": "own", "approver": "approver", "participant": "participant", "observer": "observer"}
GET_STATE = "/uibus.v1.HostService/GetSessionState"
SET_THEME = "/uibus.v1.HostService/SetTheme"
STOP_TURN = "/uibus.v1.SessionService/StopTurn"
# Representative gRPC calls (path, request bytes), one per least role.
GRPC_CALLS = {GET_STATE: b"", SET_THEME: host_pb2.TextEvent(text="{}").SerializeToString(),
              STOP_TURN: spb.AgentRequest(agent="hello_world").SerializeToString()}

Door = Callable[[App, str, str], Awaitable[str]]  # (app, method key, token) -> status name


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[App]:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    app = await start_app(Config(host="127.0.0.1", port=0, http_port=free_port(), store=str(tmp_path / "m.db"),
                                 tokens_file=str(tokens), grace_seconds=1.0))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            create = channel.unary_unary("/uibus.v1.SessionService/CreateSession")
            await create(b"", metadata=(("authorization", "Bearer own"), ("x-uibus-session", SESSION)))
        yield app
    finally:
        await app.aclose(grace=0.5)


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"), ("x-uibus-session", SESSION))


async def via_grpc(app: App, method: str, token: str) -> str:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        try:
            await channel.unary_unary(method)(GRPC_CALLS[method], metadata=_md(token))
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return "OK"


async def via_grpc_web(app: App, method: str, token: str) -> str:
    async with httpx.AsyncClient(timeout=10) as http:
        reply = await grpc_web_call(http, f"http://127.0.0.1:{app.http_port}{method}", GRPC_CALLS[method],
                                    headers=dict(_md(token)))
    return "OK" if reply.status == 0 else next(c.name for c in grpc.StatusCode if c.value[0] == reply.status)


HTTP_CALLS = {  # least role -> (path, JSON body)
    "observer": ("/api/v1/sessions/GetWorkspaceDiff", {"agent": "hello_world"}),
    "participant": ("/api/v1/hello_world/streaming_chat", {"user_message": {"text": "hi"}}),
    "owner": ("/api/v1/sessions/StopTurn", {"agent": "hello_world"}),
}


async def via_http(app: App, least: str, token: str) -> str:
    path, body = HTTP_CALLS[least]
    async with httpx.AsyncClient(timeout=20) as http:
        r = await http.post(f"http://127.0.0.1:{app.http_port}{path}", json=body, headers=dict(_md(token)))
    if r.status_code == 200:
        return "OK"
    code = r.json()["code"]
    assert (r.status_code == 403) == (code == "PERMISSION_DENIED"), r.text
    return str(code)


MCP_CALLS = {  # least role -> (method, params)
    "observer": ("tasks/get", {"taskId": "no-such-task"}),
    "participant": ("tools/call", {"name": "hello_world", "arguments": {"user_message": {"text": "hi"}}}),
    "owner": ("tools/call", {"name": "stop_turn", "arguments": {"agent": "hello_world"}}),
}


async def via_mcp(app: App, least: str, token: str) -> str:
    method, params = MCP_CALLS[least]
    async with httpx.AsyncClient(timeout=20) as http:
        r = await http.post(f"http://127.0.0.1:{app.http_port}/mcp", json={
            "jsonrpc": "2.0", "id": 1, "method": method, "params": params},
            headers=dict(_md(token)))
    reply = r.json()
    if "result" in reply:
        return "OK"
    code = reply["error"]["data"]["status"]
    assert (r.status_code == 403) == (code == "PERMISSION_DENIED"), r.text
    return str(code)


ACP_CALLS = {  # least role -> (method, params)
    "observer": ("session/load", {"sessionId": SESSION, "cwd": "/tmp", "mcpServers": []}),
    "participant": ("session/prompt", {"sessionId": SESSION, "prompt": [{"type": "text", "text": "hi"}]}),
    "owner": ("session/set_mode", {"sessionId": SESSION, "modeId": "plan"}),
}


async def via_acp(app: App, least: str, token: str) -> str:
    method, params = ACP_CALLS[least]
    async with ws_connect(f"ws://127.0.0.1:{app.http_port}/acp?prefix=team-a-&agent=hello_world",
                          additional_headers={"authorization": f"Bearer {token}"}, max_size=None) as ws:
        frames = [{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}}]
        if method != "session/load":  # the editor attaches to the session first (as observer)
            frames.append({"jsonrpc": "2.0", "id": 2, "method": "session/resume", "params": {
                "sessionId": SESSION, "cwd": "/tmp", "mcpServers": []}})
        frames.append({"jsonrpc": "2.0", "id": 9, "method": method, "params": params})
        for frame in frames:
            await ws.send(json.dumps(frame))
            answer: dict[str, Any] = {}
            async with asyncio.timeout(30):
                while answer.get("id") != frame["id"] or "method" in answer:
                    answer = json.loads(await ws.recv())
            if "error" in answer:
                message = str(answer["error"].get("message", ""))
                if "PERMISSION_DENIED" in message:
                    return "PERMISSION_DENIED" if frame["id"] == 9 else "ATTACH_DENIED"
                if frame["id"] == 9:
                    return "ERROR"
    return "OK"


DOORS: dict[str, tuple[Door, dict[str, str]]] = {
    # door -> (attempt, least role -> what the attempt is given)
    "grpc": (via_grpc, {"observer": GET_STATE, "participant": SET_THEME, "owner": STOP_TURN}),
    "grpc-web": (via_grpc_web, {"observer": GET_STATE, "participant": SET_THEME, "owner": STOP_TURN}),
    "http": (via_http, {r: r for r in HTTP_CALLS}),
    "mcp": (via_mcp, {r: r for r in MCP_CALLS}),
    "acp": (via_acp, {r: r for r in ACP_CALLS}),
}


def _expected_least(door: str, key: str) -> str:
    """The least role of a door's representative call, read from the roles table."""
    if door in ("grpc", "grpc-web"):
        return least_for(key, None)
    if door == "mcp":
        method, params = MCP_CALLS[key]
        return MCP_TOOLS.get(params.get("name", ""), "participant") if method == "tools/call" \
            else least_for(f"/mcp/{method}", None)
    return key  # HTTP and ACP representatives are chosen by their least role (asserted in the table test)


@pytest.mark.parametrize("door", list(DOORS))
@pytest.mark.parametrize("role", ROLES)
async def test_role_by_least_role_on_every_door(app: App, door: str, role: str) -> None:
    attempt, calls = DOORS[door]
    for least_key, key in calls.items():
        least = _expected_least(door, key)
        assert least == least_key, (door, key, least)
        got = await attempt(app, key, TOKEN_OF[role])
        if at_least(role, least):
            assert got not in ("PERMISSION_DENIED", "ATTACH_DENIED"), (door, role, key, got)
        else:
            assert got == "PERMISSION_DENIED", (door, role, key, got)


def test_the_representatives_match_the_table() -> None:
    assert TABLE["/uibus.v1.SessionService/GetWorkspaceDiff"] == "observer"
    assert TABLE["/uibus.v1.SessionService/StopTurn"] == "owner" and TABLE[SET_THEME] == "participant"
    assert least_for("/hello_world.AgentService/StreamingChat", None) == "participant"
    assert TABLE["/uibus.v1.WebviewService/Subscribe"] == "observer"  # ACP's session/load
    assert TABLE["/uibus.v1.SessionService/SetMode"] == "owner"  # ACP's session/set_mode


@pytest.mark.parametrize("role", ROLES)
async def test_answering_a_permission_dialog_needs_approver(app: App, role: str) -> None:
    """The approver row: a confirm an agent asks (addressed to approver by default), answered by
    each role over gRPC and gRPC-Web; below approver it stays open."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        confirm = channel.unary_unary("/uibus.v1.ExtensionUiService/Confirm",
                                      request_serializer=ext.ConfirmRequest.SerializeToString,
                                      response_deserializer=ext.DialogResult.FromString)
        asked = asyncio.ensure_future(confirm(ext.ConfirmRequest(title="allow?", timeout_ms=20_000),
                                              metadata=_md("own")))
        dialogs = app.core.dialogs.pending
        await wait_for(lambda: bool(dialogs.waiting(SESSION)), timeout=5, what="the dialog open")
        answer = ext.RespondRequest(id=dialogs.waiting(SESSION)[0].id, confirmed=True).SerializeToString()
        async with httpx.AsyncClient(timeout=10) as http:
            web = await grpc_web_call(http, f"http://127.0.0.1:{app.http_port}/uibus.v1.ExtensionUiService/Respond",
                                      answer, headers=dict(_md(TOKEN_OF[role])))
        if at_least(role, "approver"):
            assert web.status == 0, web.message
        else:
            assert web.status == grpc.StatusCode.PERMISSION_DENIED.value[0], web.message
            assert ("participant" if role == "observer" else "approver") in web.message, web.message
            try:
                await channel.unary_unary("/uibus.v1.ExtensionUiService/Respond")(answer, metadata=_md(TOKEN_OF[role]))
                raise AssertionError("answered below approver")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
            assert not asked.done()
            await channel.unary_unary("/uibus.v1.ExtensionUiService/Respond")(answer, metadata=_md("approver"))
        assert (await asyncio.wait_for(asked, 5)).confirmed


async def test_every_session_method_on_the_native_door(app: App) -> None:
    """Every ITS_SESSION gRPC method of the table, by an observer and by the owner (empty requests):
    the observer is refused exactly where the table asks more than observer; the owner never."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        async def code_of(method: str, token: str) -> str:
            unary = method.rsplit("/", 1)[1].startswith(("subscribe", "Subscribe", "Watch")) is False
            try:
                if unary:
                    await asyncio.wait_for(channel.unary_unary(method)(b"", metadata=_md(token)), 5)
                else:
                    stream = channel.unary_stream(method)(b"", metadata=_md(token))
                    await asyncio.wait_for(stream.initial_metadata(), 5)
                    code = await asyncio.wait_for(stream.code(), 0.3) if stream.done() else None
                    stream.cancel()
                    return code.name if code is not None else "OK"
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            except TimeoutError:
                return "TIMEOUT"  # the call ran (a dialog waits): past the role check
            return "OK"

        skip = ("Select", "Confirm", "Input", "Editor")  # they wait for an answer (the test above asks one)
        methods = [m for m in TABLE if access_of(m) == ITS_SESSION and not m.endswith(skip)
                   and not m.startswith("/uibus.v1.AuditService/")]
        methods.sort(key=lambda m: m.endswith("/DeleteSession"))  # last: it takes the owner's record with it
        assert len(methods) > 60
        for method in methods:
            owner = await code_of(method, "own")
            assert owner != "PERMISSION_DENIED", method
            observer = await code_of(method, "observer")
            if TABLE[method] == "observer":
                assert observer != "PERMISSION_DENIED", method
            else:
                assert observer == "PERMISSION_DENIED", (method, observer)

"""The sessions API (uibus.v1.SessionService) over native gRPC and gRPC-Web, with tenant tokens:
a token lists only the sessions its grant allows, creates and deletes only those, and a watch
sees a session appear and go."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest
from mcp.shared.exceptions import MCPError

from tests.conftest import start_app
from tests.webclient import call
from uibus.app import App
from uibus.infra.config import Config
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc as ext_grpc
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc

TOKENS = """\
team-a-token     team-a-*
team-b-token     team-b-*
admin-token      *
"""
SERVICE = "/uibus.v1.SessionService/"


def auth(token: str, session: str | None = None) -> tuple[tuple[str, str], ...]:
    meta = (("authorization", f"Bearer {token}"),)
    return (*meta, ("x-uibus-session", session)) if session else meta


@pytest.fixture
async def tenants(web_config: Config, tmp_path: Path) -> AsyncIterator[App]:
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    app = await start_app(replace(web_config, tokens_file=str(path)))
    try:
        yield app
    finally:
        await app.aclose(grace=0.5)


async def _code(call_: object) -> str:
    try:
        await call_  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return "OK"


async def test_tenants_list_create_and_delete_only_their_own(tenants: App) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tenants.port}") as ch:
        api = sessions_pb2_grpc.SessionServiceStub(ch)
        made = await api.CreateSession(pb.CreateSessionRequest(title="fix the parser", agent="pi"),
                                       metadata=auth("team-a-token", "team-a-1"))
        assert (made.session, made.title, made.agent) == ("team-a-1", "fix the parser", "pi")
        await api.CreateSession(pb.CreateSessionRequest(), metadata=auth("team-a-token", "team-a-2"))
        await api.CreateSession(pb.CreateSessionRequest(title="b's"), metadata=auth("team-b-token", "team-b-1"))
        # pi's setTitle (the extension-UI title) wins over the title given at creation
        await ext_grpc.ExtensionUiServiceStub(ch).SetTitle(ext.SetTitleRequest(title="Parser fixed"),
                                                           metadata=auth("team-a-token", "team-a-1"))

        a = await api.ListSessions(pb.ListSessionsRequest(), metadata=auth("team-a-token"))
        assert [s.session for s in a.sessions] == ["team-a-1", "team-a-2"]  # most recent first
        assert a.sessions[0].title == "Parser fixed" and a.sessions[0].last_activity_ms > 0
        b = await api.ListSessions(pb.ListSessionsRequest(), metadata=auth("team-b-token"))
        assert [s.session for s in b.sessions] == ["team-b-1"]
        admin = await api.ListSessions(pb.ListSessionsRequest(prefix="team-"), metadata=auth("admin-token"))
        assert {s.session for s in admin.sessions} == {"team-a-1", "team-a-2", "team-b-1"}

        # another tenant's session can be neither created, deleted, nor steered
        assert await _code(api.CreateSession(pb.CreateSessionRequest(),
                                             metadata=auth("team-a-token", "team-b-9"))) == "PERMISSION_DENIED"
        assert await _code(api.DeleteSession(pb.DeleteSessionRequest(),
                                             metadata=auth("team-a-token", "team-b-1"))) == "PERMISSION_DENIED"
        assert await _code(api.StopTurn(pb.AgentRequest(agent="pi"),
                                        metadata=auth("team-a-token", "team-b-1"))) == "PERMISSION_DENIED"
        assert await _code(api.ListSessions(pb.ListSessionsRequest())) == "UNAUTHENTICATED"
        assert await _code(api.ListSessions(pb.ListSessionsRequest(prefix="bad name"),
                                            metadata=auth("admin-token"))) == "INVALID_ARGUMENT"

        # steering an agent that is not running says so
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await api.SetMode(pb.SetModeRequest(agent="pi", mode_id="plan"), metadata=auth("team-a-token", "team-a-1"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "pi is not running" in err.value.details()
        assert (await api.StopTurn(pb.AgentRequest(agent="pi"),
                                   metadata=auth("team-a-token", "team-a-1"))).stopped is False

        # a waiting dialog is counted and named in the listing
        asking = asyncio.ensure_future(ext_grpc.ExtensionUiServiceStub(ch).Confirm(
            ext.ConfirmRequest(title="Ship it?"), metadata=auth("team-a-token", "team-a-2")))
        for _ in range(100):
            a = await api.ListSessions(pb.ListSessionsRequest(prefix="team-a-2"), metadata=auth("team-a-token"))
            if a.sessions[0].waiting_dialogs:
                break
            await asyncio.sleep(0.02)
        assert a.sessions[0].waiting_dialogs == 1
        assert [(d.kind, d.title) for d in a.sessions[0].waiting] == [("confirm", "Ship it?")]
        asking.cancel()

        # a watch sees the list now, then a session go
        watch = api.WatchSessions(pb.ListSessionsRequest(), metadata=auth("team-a-token"))
        first = await asyncio.wait_for(watch.read(), 5)
        # the dialog is an event of team-a-2 (kept in its log): team-a-2 was active last
        assert [s.session for s in first.sessions] == ["team-a-2", "team-a-1"]
        await api.DeleteSession(pb.DeleteSessionRequest(), metadata=auth("team-a-token", "team-a-2"))
        second = await asyncio.wait_for(watch.read(), 5)
        assert [s.session for s in second.sessions] == ["team-a-1"]
        watch.cancel()
        assert await _code(api.DeleteSession(pb.DeleteSessionRequest(),
                                             metadata=auth("team-a-token", "team-a-2"))) == "NOT_FOUND"


async def test_grpc_web_lists_a_tenants_sessions(tenants: App) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{tenants.http_port}", timeout=10) as http:
        made = await call(http, SERVICE + "CreateSession", pb.CreateSessionRequest(title="t").SerializeToString(),
                          headers=dict(auth("team-b-token", "team-b-web")))
        assert made.status == 0, made.message
        reply = await call(http, SERVICE + "ListSessions", pb.ListSessionsRequest().SerializeToString(),
                           headers=dict(auth("team-b-token")))
        assert reply.status == 0, reply.message
        listed = pb.SessionList.FromString(reply.messages[0])
        assert [s.session for s in listed.sessions] == ["team-b-web"]
        reply = await call(http, SERVICE + "ListSessions", pb.ListSessionsRequest().SerializeToString(),
                           headers=dict(auth("team-a-token")))
        assert reply.status == 0 and pb.SessionList.FromString(reply.messages[0]).sessions == []


async def test_http_api_lists_creates_and_deletes(tenants: App) -> None:
    base = f"http://127.0.0.1:{tenants.http_port}/api/v1/sessions"
    async with httpx.AsyncClient(timeout=10) as http:
        made = await http.post(base + "/CreateSession", json={"title": "from curl", "agent": "pi"},
                               headers=dict(auth("team-a-token", "team-a-http")))
        assert made.status_code == 200, made.text
        assert made.json()["session"] == "team-a-http" and made.json()["title"] == "from curl"
        listed = await http.get(base, headers=dict(auth("team-a-token")))
        assert [s["session"] for s in listed.json()["sessions"]] == ["team-a-http"]
        assert (await http.get(base, headers=dict(auth("team-b-token")))).json() == {}
        denied = await http.post(base + "/DeleteSession", headers=dict(auth("team-b-token", "team-a-http")))
        assert denied.status_code == 403 and denied.json()["code"] == "PERMISSION_DENIED"
        bad = await http.post(base + "/SetMode", content=b'{"agent": 3}',
                              headers=dict(auth("team-a-token", "team-a-http")))
        assert bad.status_code == 400, bad.text
        assert (await http.get(base, headers={})).status_code == 401
        assert (await http.get(base + "/Nope", headers=dict(auth("team-a-token")))).status_code == 404
        gone = await http.post(base + "/DeleteSession", headers=dict(auth("team-a-token", "team-a-http")))
        assert gone.status_code == 200 and (await http.get(base, headers=dict(auth("team-a-token")))).json() == {}


async def test_mcp_list_sessions_tool_is_tenant_scoped(tenants: App) -> None:
    from tests.test_mcp import mcp_client

    async with grpc.aio.insecure_channel(f"127.0.0.1:{tenants.port}") as ch:
        api = sessions_pb2_grpc.SessionServiceStub(ch)
        for token, session in (("team-a-token", "team-a-x"), ("team-b-token", "team-b-x")):
            await api.CreateSession(pb.CreateSessionRequest(title=session), metadata=auth(token, session))
    async with mcp_client(tenants, "team-b-x", token="team-b-token") as client:
        result = await client.call_tool("list_sessions", {})
        assert not result.is_error
        assert [s["session"] for s in result.structured_content["sessions"]] == ["team-b-x"]
        stop = await client.call_tool("stop_turn", {"agent": "pi"})
        assert stop.structured_content == {"stopped": False}
        with pytest.raises(MCPError, match="pi is not running in session 'team-b-x'"):
            await client.call_tool("set_agent_mode", {"agent": "pi", "mode_id": "plan"})


async def test_http_watch_streams_json_lines(tenants: App) -> None:
    base = f"http://127.0.0.1:{tenants.http_port}/api/v1/sessions"
    async with httpx.AsyncClient(timeout=10) as http, \
            http.stream("GET", base + "/watch", headers=dict(auth("team-b-token"))) as watch:
        assert watch.status_code == 200 and watch.headers["content-type"] == "application/json-lines"
        lines = watch.aiter_lines()
        assert json.loads(await asyncio.wait_for(anext(lines), 5)) == {}
        made = await http.post(base + "/CreateSession", json={"title": "watched"},
                               headers=dict(auth("team-b-token", "team-b-w")))
        assert made.status_code == 200
        seen = json.loads(await asyncio.wait_for(anext(lines), 5))
        assert [(s["session"], s["title"]) for s in seen["sessions"]] == [("team-b-w", "watched")]

"""Every field bounded, every door the same limits (docs/security/quotas.md): CreateSession's title and
agent name, a listing's prefix (gRPC, the HTTP API and MCP's list_sessions alike), and a listing that
never fails because of one big title. Real server, real gRPC, the MCP SDK's client over HTTP.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from mcp.shared.exceptions import MCPError

from tests.pikit import turn_of
from tests.test_mcp import mcp_client
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.domain.sessions import LISTED_TITLE_CHARS, MAX_TITLE_CHARS
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc

pytestmark = pytest.mark.timeout(60)


def named(session: str) -> tuple[tuple[str, str], ...]:
    return (("x-uibus-session", session),)


async def _code(call: object) -> str:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return "OK"


async def test_create_session_bounds_its_title_and_agent_name_and_listings_stay_small(web: App) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{web.port}",
                                         options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        api = sessions_pb2_grpc.SessionServiceStub(ch)
        huge = "t" * (3 * 1024 * 1024 + 512 * 1024)  # 3.5 MiB: two of them broke every listing
        for i in range(2):
            assert await _code(api.CreateSession(pb.CreateSessionRequest(title=huge),
                                                 metadata=named(f"big-{i}"))) == "INVALID_ARGUMENT"
        assert await _code(api.CreateSession(pb.CreateSessionRequest(title="t" * (MAX_TITLE_CHARS + 1)),
                                             metadata=named("big-2"))) == "INVALID_ARGUMENT"
        for agent in ("a" * 129, "no spaces", "../x", "é"):
            assert await _code(api.CreateSession(pb.CreateSessionRequest(agent=agent),
                                                 metadata=named("bad-agent"))) == "INVALID_ARGUMENT", agent
        made = await api.CreateSession(pb.CreateSessionRequest(title="é" * MAX_TITLE_CHARS, agent="pi"),
                                       metadata=named("long-title"))
        assert made.agent == "pi"
        listed = await api.ListSessions(pb.ListSessionsRequest())
        assert [s.session for s in listed.sessions] == ["long-title"]  # the refused ones were never made
        assert len(listed.sessions[0].title) == LISTED_TITLE_CHARS and listed.sessions[0].title.endswith("…")
        for prefix in ("x" * 300, "a b", "a\nb"):
            assert await _code(api.ListSessions(pb.ListSessionsRequest(prefix=prefix))) == "INVALID_ARGUMENT"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{web.http_port}") as http:
        r = await http.get("/api/v1/sessions", params={"prefix": "x" * 300})
        assert r.status_code == 400, r.text


async def test_mcp_list_sessions_checks_its_prefix_as_every_other_door(web: App) -> None:
    async with mcp_client(web) as client:
        for prefix in ("x" * 300, "a b"):
            with pytest.raises(MCPError, match="session"):
                await client.call_tool("list_sessions", {"prefix": prefix})
        result = await client.call_tool("list_sessions", {"prefix": "acp-"})
        assert not result.is_error


async def test_delete_session_right_after_a_turn_is_final(web: App) -> None:
    """Seen by a tenant: DeleteSession right after a turn: the session was listed again within 1 s with its
    recent messages back (the write-behind buffer outlived the delete). Now it is dropped first."""
    for i in range(5):
        session = f"gone-{i}"
        async with Connection(f"127.0.0.1:{web.port}", session=session) as conn:
            assert (await turn_of(conn, "hello_world", "x" * 2000))[-1].response.text
            api = sessions_pb2_grpc.SessionServiceStub(conn.channel)
            await api.DeleteSession(pb.DeleteSessionRequest(), metadata=named(session))
        await asyncio.sleep(1.0)  # longer than the write-behind interval (0.25 s)
        listed = await web.core.sessions.list(lambda _s: True)
        assert session not in [s.session for s in listed.sessions], i
        assert await web.core.feed.recent.read(session) == {}, i

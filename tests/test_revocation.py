"""Final means final (docs/security/quotas.md): a token removed from --tokens-file and reloaded (SIGHUP)
ends that token's open streams within seconds, UNAUTHENTICATED, on every kind of door: a native gRPC
stream (WatchSessions), the HTTP API's watch, an MCP call's event stream, a CodeBolt agent's WebSocket,
an /acp WebSocket and an /acp HTTP connection's event stream. Another tenant's streams go on. Real server, real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import start_app, wait_for
from uibus.edge.codebolt.gateway import REVOKED as CODEBOLT_REVOKED
from uibus.edge.transports.acp_ws import REVOKED
from uibus.infra.config import Config
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc

pytestmark = pytest.mark.timeout(60)
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}}


async def test_a_revoked_tokens_open_streams_end_within_seconds(web_config: Config, tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("a-token team-a-*\nb-token team-b-*\n")
    app = await start_app(replace(web_config, tokens_file=str(path)))
    a, b = {"authorization": "Bearer a-token"}, {"authorization": "Bearer b-token"}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=30) as http, \
                connect(f"ws://127.0.0.1:{app.http_port}/acp", additional_headers=a) as ws, \
                connect(f"ws://127.0.0.1:{app.http_port}/agent-to-app?session=team-a-1",
                        additional_headers=a) as codebolt:
            api = sessions_pb2_grpc.SessionServiceStub(ch)
            grpc_watch = api.WatchSessions(pb.ListSessionsRequest(), metadata=tuple(a.items()))
            b_watch = api.WatchSessions(pb.ListSessionsRequest(), metadata=tuple(b.items()))
            await asyncio.wait_for(grpc_watch.read(), 10)
            await asyncio.wait_for(b_watch.read(), 10)
            await ws.send(json.dumps(INIT))
            assert "protocolVersion" in await asyncio.wait_for(ws.recv(), 10)
            opened = await http.post("/acp", json=INIT, headers=a)
            conn = {**a, "Acp-Connection-Id": opened.headers["acp-connection-id"]}
            async with http.stream("GET", "/api/v1/sessions/watch", headers=a) as api_watch, \
                    http.stream("GET", "/acp", headers={**conn, "Accept": "text/event-stream"}) as acp_events:
                api_lines = api_watch.aiter_lines()
                await asyncio.wait_for(anext(api_lines), 10)  # the first listing
                assert acp_events.status_code == 200

                ask = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                       "params": {"name": "ask_user", "arguments": {"title": "still there?"}}}
                mcp_call = http.stream("POST", "/mcp", json=ask, headers={
                    **a, "x-uibus-session": "team-a-1", "accept": "application/json, text/event-stream"})
                mcp = await mcp_call.__aenter__()
                await wait_for(lambda: app.core.dialogs.count() == 1, 10, what="MCP's ask_user waiting")
                assert mcp.headers["content-type"].startswith("text/event-stream")

                path.write_text("b-token team-b-*\n")  # a-token removed
                started = asyncio.get_running_loop().time()
                assert app.reload_tokens()

                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    async def to_the_end() -> None:  # a listing the revocation changed may come first
                        while True:
                            await grpc_watch.read()
                    await asyncio.wait_for(to_the_end(), 5)
                assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "revoked" in (ended.value.details() or "")
                rest = [line async for line in api_lines]  # the HTTP API's watch ends, saying why
                assert any("UNAUTHENTICATED" in line for line in rest), rest
                with pytest.raises(ConnectionClosed) as closed:
                    await asyncio.wait_for(ws.recv(), 5)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == REVOKED
                with pytest.raises(ConnectionClosed) as closed:  # the CodeBolt agent's socket too
                    await asyncio.wait_for(codebolt.recv(), 5)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == CODEBOLT_REVOKED
                assert [line async for line in acp_events.aiter_lines() if line.startswith("data:")] == []
                mcp_events = [json.loads(line[6:]) async for line in mcp.aiter_lines()
                              if line.startswith("data: ") and line[6:]]  # (not the priming event: no data)
                await mcp_call.__aexit__(None, None, None)
                assert mcp_events[-1]["error"]["data"]["status"] == "UNAUTHENTICATED", mcp_events
                took = asyncio.get_running_loop().time() - started
                assert took < 5, took
            assert (await http.post("/acp", json=INIT, headers=a)).status_code == 401  # new ones refused too
            # B's stream goes on
            await api.CreateSession(pb.CreateSessionRequest(), metadata=(*b.items(), ("x-uibus-session", "team-b-1")))
            listed = await asyncio.wait_for(b_watch.read(), 10)
            assert [s.session for s in listed.sessions] == ["team-b-1"]
            b_watch.cancel()
    finally:
        await app.aclose(grace=0.5)


@pytest.mark.parametrize("path", ["/acp", "/api/v1/sessions/CreateSession"])
async def test_a_body_sent_a_byte_a_second_is_timed_out(web_config: Config, path: str) -> None:
    """Seen by a tenant: a request body sent at 1 byte/s to /acp or the sessions API was never timed out (a
    slowloris path: --http-max-connections is global). Now --http-body-timeout-seconds bounds it."""
    app = await start_app(replace(web_config, http_body_timeout_seconds=1.0))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", app.http_port)
        body = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}'
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode())
        await writer.drain()
        started = asyncio.get_running_loop().time()

        async def trickle() -> None:
            for byte in body:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.2)

        sending = asyncio.ensure_future(trickle())
        try:
            status = await asyncio.wait_for(reader.readline(), 10)
        finally:
            sending.cancel()
            with contextlib.suppress(BaseException):
                await sending
        took = asyncio.get_running_loop().time() - started
        assert status.startswith(b"HTTP/1.1 408"), status
        assert 0.9 < took < 3, took
        writer.close()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}") as http:  # the port goes on
            assert (await http.get("/api/v1/sessions")).status_code == 200
    finally:
        await app.aclose(grace=0.5)

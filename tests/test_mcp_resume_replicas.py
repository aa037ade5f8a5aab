"""Resuming a `/mcp` call's event stream on another replica (uibus.edge.transports.mcp_resume), with
two uibus replicas on one real redis-server: the client loses the POST's stream on replica A, the
call goes on there, and a GET with `Last-Event-ID` to replica B gets exactly the events it missed,
once, in order, then the rest of the call live and its result. Before the stream was kept in the
session log and followed on the bus, B answered 404 (it had no such stream in memory).

What B must still refuse is refused as A would: another MCP session's resume, another token's, an
id the stream never gave. And a reader on B keeps the call going: A does not cancel it as
abandoned while B reads (B tells A so on the bus).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import wait_for
from tests.redisproc import RedisProcess, redis_server
from tests.test_redis_replicas import Replica, two_replicas
from uibus.app.installers import MCP
from uibus.infra import kinds

__all__ = ["redis_server"]  # the fixture
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def pair(redis_server: RedisProcess, tmp_path: Path) -> AsyncIterator[tuple[Replica, Replica]]:
    async with two_replicas(redis_server.url, tmp_path, Replica, http=True) as (a, b):
        yield a, b
    for replica in (a, b):  # every stream's subscriptions gone with it (the call's and the reader's)
        assert replica.app.bus.count(kinds.MCP_EVENT) == 0


def _url(replica: Replica) -> str:
    return f"http://127.0.0.1:{replica.app.http_port}/mcp"


async def _events(lines: Any, n: int) -> list[tuple[str, str]]:
    """The next `n` events (id, data) of an SSE body's lines."""
    out: list[tuple[str, str]] = []
    ident = ""
    while len(out) < n:
        line = await asyncio.wait_for(anext(lines), 20)
        if line.startswith("id: "):
            ident = line[4:]
        elif line.startswith("data: "):
            out.append((ident, line[6:]))
    return out


async def _rest(lines: Any, ident: int) -> list[dict[str, Any]]:
    """Every event's message until the call's response (the one with its id)."""
    out: list[dict[str, Any]] = []
    while True:
        line = await asyncio.wait_for(anext(lines), 20)
        if line.startswith("data: "):
            message = json.loads(line[6:])
            out.append(message)
            if message.get("id") == ident:
                return out


async def _start_call(http: httpx.AsyncClient, url: str, headers: dict[str, str], ident: int, chunks: int,
                      delay_ms: int) -> tuple[list[tuple[str, str]], Any]:
    """A tool call whose stream is read to its priming event and three progress pieces, then lost."""
    body = {"jsonrpc": "2.0", "id": ident, "method": "tools/call", "params": {
        "name": "hello_world", "arguments": {"user_message": {"type": "HUMAN", "text": "across replicas"},
                                             "sly_data": {"chunks": chunks, "delay_ms": delay_ms}},
        "_meta": {"progressToken": f"p{ident}"}}}
    stream = http.stream("POST", url, json=body, headers={**headers, "accept": "application/json, text/event-stream"})
    response = await stream.__aenter__()
    assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
    got = await _events(response.aiter_lines(), 4)
    await stream.__aexit__(None, None, None)  # the client lost its stream (a cut network, a crashed editor)
    assert got[0][1] == "" and [json.loads(d)["params"]["progress"] for _, d in got[1:]] == [1, 2, 3]
    return got, response


async def test_a_stream_lost_on_one_replica_resumes_on_the_other(pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    async with httpx.AsyncClient(timeout=20) as http:
        init = await http.post(_url(a), json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}}})
        headers = {"mcp-session-id": init.headers["mcp-session-id"], "x-uibus-session": "mcp-replicas"}
        got, _ = await _start_call(http, _url(a), headers, 2, chunks=20, delay_ms=60)
        name = got[0][0].rpartition(".")[0]
        assert name in a.app[MCP].streams and name not in b.app[MCP].streams  # B never saw this stream

        # what B refuses, as A would: another MCP session, another token, an id never given, no stream
        for bad_headers, bad_id in (({**headers, "mcp-session-id": "someone-else"}, got[2][0]),
                                    ({**headers, "authorization": "Bearer another"}, got[2][0]),
                                    (headers, f"{name}.999"), (headers, "nope.1")):
            answer = await http.get(_url(b), headers={**bad_headers, "last-event-id": bad_id,
                                                      "accept": "text/event-stream"})
            assert answer.status_code == 404, (bad_id, answer.text)
            assert answer.json()["error"]["data"]["status"] == "NOT_FOUND"

        # the resume on B: exactly the pieces after the second, once, in order, then the result
        async with http.stream("GET", _url(b), headers={**headers, "last-event-id": got[2][0],
                                                        "accept": "text/event-stream"}) as resumed:
            assert resumed.status_code == 200, await resumed.aread()
            rest = await _rest(resumed.aiter_lines(), 2)
        assert [m["params"]["progress"] for m in rest[:-1]] == list(range(3, 21))
        assert rest[-1]["id"] == 2 and "result" in rest[-1]
        text = rest[-1]["result"]["content"][0]["text"]
        pieces = [json.loads(d)["params"]["message"] for _, d in got[1:3]] + [m["params"]["message"] for m in rest[:-1]]
        assert "".join(pieces) == text and 'You said: "across replicas"' in text


async def test_a_reader_on_the_other_replica_keeps_the_call_going(pair: tuple[Replica, Replica]) -> None:
    """A cancels a call whose stream nobody reads for `resume_s`; a reader on B counts."""
    a, b = pair
    for replica in pair:
        replica.app[MCP].resume_s = 2.0
    async with httpx.AsyncClient(timeout=20) as http:
        init = await http.post(_url(a), json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}}})
        headers = {"mcp-session-id": init.headers["mcp-session-id"], "x-uibus-session": "mcp-replicas-long"}
        got, _ = await _start_call(http, _url(a), headers, 7, chunks=80, delay_ms=75)  # ~6 s: 3 x resume_s
        async with http.stream("GET", _url(b), headers={**headers, "last-event-id": got[-1][0],
                                                        "accept": "text/event-stream"}) as resumed:
            assert resumed.status_code == 200
            rest = await _rest(resumed.aiter_lines(), 7)
        assert [m["params"]["progress"] for m in rest[:-1]] == list(range(4, 81))
        assert "result" in rest[-1], rest[-1]
    await wait_for(lambda: not any(x.ended_at is None for x in a.app[MCP].streams.values()), 5,
                   what="the call ended on A")

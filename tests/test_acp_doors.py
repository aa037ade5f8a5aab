"""The ACP doors (`/acp` HTTP POST, `/acp` WebSocket frames, `uibus acp` stdio) behind the same guards
as `/api/v1/*` and `/mcp` (issue 43): one JSON-RPC reader (uibus.jsonrpc) that takes hostile JSON
through the shared reader and checks `jsonrpc` and `id` before anything waits on the message. Each
bad message is answered at once with its JSON-RPC error; the connection or process goes on.
Raw sockets: no SDK client sends these.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.conftest import free_port, running
from tests.support import scrape_by_name
from uibus.app import App
from uibus.config import Config

pytestmark = pytest.mark.timeout(120)
UIBUS = str(Path(sys.executable).parent / "uibus")
DEEP = "[" * 200000 + "]" * 200000
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}}
BAD_IDS: list[Any] = [1.5, {}, True, [1]]


@pytest.fixture
async def app(config: Config) -> AsyncIterator[App]:
    async with running(replace(config, http_port=free_port())) as app:
        yield app


async def test_post_acp_answers_hostile_json_with_a_parse_error_and_goes_on(app: App) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}") as http:
        deep = await http.post("/acp", content=DEEP, headers={"content-type": "application/json"})
        assert deep.status_code == 400, deep.text
        body = deep.json()
        assert body["id"] is None and body["error"]["code"] == -32700
        assert "nested deeper than 64 levels" in body["error"]["message"]
        poisoned = '{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1,"x":"\\ud800"}}'
        surrogate = await http.post("/acp", content=poisoned, headers={"content-type": "application/json"})
        assert (surrogate.status_code, surrogate.json()["error"]["code"], surrogate.json()["id"]) == (400, -32602, 1)
        opened = await http.post("/acp", json=INIT)
        assert opened.status_code == 200 and opened.json()["result"]["protocolVersion"] == 1


@pytest.mark.parametrize("bad", [*({"id": i} for i in BAD_IDS), {"jsonrpc": "1.0"}, {"id": None}],
                         ids=["float", "object", "bool", "array", "jsonrpc-1.0", "null"])
async def test_post_acp_initialize_with_a_bad_id_or_version_is_refused_at_once_holding_no_slot(
        app: App, bad: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}") as http:
        started = time.monotonic()
        refused = await http.post("/acp", json={**INIT, **bad})
        took = time.monotonic() - started
        assert refused.status_code == 400 and took < 3, (refused.status_code, took)
        if "jsonrpc" in bad or bad["id"] is not None:
            assert refused.json()["error"]["code"] == -32600
        assert (await scrape_by_name(app))["uibus_acp_editor_connections"] == 0  # no slot held
        assert (await http.post("/acp", json=INIT)).status_code == 200


async def test_acp_websocket_answers_a_hostile_frame_and_keeps_the_connection(app: App) -> None:
    async with connect(f"ws://127.0.0.1:{app.http_port}/acp", max_size=None) as ws:
        await ws.send(DEEP)
        answer = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert answer["id"] is None and answer["error"]["code"] == -32700
        for ident in BAD_IDS:
            await ws.send(json.dumps({**INIT, "id": ident}))
            answer = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert (answer["id"], answer["error"]["code"]) == (None, -32600)
        await ws.send(json.dumps({**INIT, "jsonrpc": "1.0", "id": 5}))
        answer = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert (answer["id"], answer["error"]["code"]) == (5, -32600)
        await ws.send(json.dumps(INIT))
        answer = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert answer["id"] == 1 and answer["result"]["protocolVersion"] == 1


async def test_uibus_acp_stdio_answers_a_hostile_line_and_goes_on(app: App) -> None:
    proc = await asyncio.create_subprocess_exec(UIBUS, "acp", "--target", f"127.0.0.1:{app.port}",
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, limit=1 << 20)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(DEEP.encode() + b"\n" + json.dumps({**INIT, "id": 1.5}).encode() + b"\n"
                         + json.dumps(INIT).encode() + b"\n")
        answers = [json.loads(await asyncio.wait_for(proc.stdout.readline(), 20)) for _ in range(3)]
        assert [(a.get("id"), a.get("error", {}).get("code")) for a in answers] == [
            (None, -32700), (None, -32600), (1, None)]
        assert "nested deeper than 64 levels" in answers[0]["error"]["message"]
    finally:
        proc.stdin.close()
        code = await asyncio.wait_for(proc.wait(), 10)
    stderr = (await proc.stderr.read()).decode()
    assert code == 0 and "Traceback" not in stderr, stderr

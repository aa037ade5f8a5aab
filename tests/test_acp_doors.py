"""The ACP doors (`/acp` HTTP POST, `/acp` WebSocket frames, `uibus acp` stdio) behind the same guards
as `/api/v1/*` and `/mcp` (docs/security/quotas.md): one JSON-RPC reader (uibus.infra.jsonrpc) that takes hostile JSON
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
from uibus.infra.config import Config

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


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_acp_http_output_nobody_reads_is_bounded_in_bytes_and_the_client_told(app: App) -> None:
    """Seen by a tenant: 100 prompts of 900 KB with no reader grew RSS 147 -> 221 MB (the bound was 4,096
    messages, each up to 16 MiB). Now the events waiting for a reader are bounded in bytes per
    connection (MAX_BUFFERED_BYTES, 8 MiB): past it the connection is cut, and its next request
    hears why (410), instead of anything growing or a response vanishing."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=30) as http:
        opened = await http.post("/acp", json=INIT)
        conn = {"Acp-Connection-Id": opened.headers["acp-connection-id"]}
        new = {"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": "/tmp", "mcpServers": []}}
        async with http.stream("GET", "/acp", headers={**conn, "Accept": "text/event-stream"}) as events:
            assert (await http.post("/acp", json=new, headers=conn)).status_code == 202
            lines = events.aiter_lines()
            while not (line := await asyncio.wait_for(anext(lines), 10)).startswith("data: "):
                assert line.startswith("id: ") or not line, line  # every event has its id
            session = json.loads(line.removeprefix("data: "))["result"]["sessionId"]
        before = rss_mb()
        text = "x" * 900_000
        statuses = []
        for i in range(100):  # the hello_world agent repeats each prompt: ~900 KB per turn, never read
            prompt = {"jsonrpc": "2.0", "id": 10 + i, "method": "session/prompt",
                      "params": {"sessionId": session, "prompt": [{"type": "text", "text": text}]}}
            r = await http.post("/acp", json=prompt, headers={**conn, "Acp-Session-Id": session})
            statuses.append(r.status_code)
            if r.status_code == 410:
                assert "stopped reading" in r.text and "bound of 8388608" in r.text, r.text
                break
            await asyncio.sleep(0.05)
        grown = rss_mb() - before
        print(f"\nRSS growth under the unread-output flood: {grown:.1f} MB after {len(statuses)} prompts")
        assert statuses[-1] == 410, statuses
        assert grown < 60, grown
        assert (await http.post("/acp", json=INIT)).status_code == 200  # the door goes on


async def test_acp_http_routes_of_bad_requests_leave_nothing_behind(app: App) -> None:
    """Seen by a tenant: 100 POSTs with 1 MB ids answered with id null left their routes (RSS 202 -> 311 MB).
    Now a message is checked before it is routed (an overlong id is -32600 at once), and ids are keys
    of their own, not re-serialized text."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=30) as http:
        opened = await http.post("/acp", json=INIT)
        conn = {"Acp-Connection-Id": opened.headers["acp-connection-id"]}
        before = rss_mb()
        for i in range(100):
            bad = {"jsonrpc": "1.0", "id": f"{i}" + "i" * 1_000_000, "method": "session/list", "params": {}}
            r = await http.post("/acp", json=bad, headers=conn)
            assert r.status_code == 400 and r.json()["error"]["code"] == -32600
        grown = rss_mb() - before
        print(f"\nRSS growth after 100 POSTs with 1 MB ids: {grown:.1f} MB")
        assert grown < 30, grown


async def _answers(ws: Any, ids: set[int], timeout: float = 10) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    async with asyncio.timeout(timeout):
        while not ids <= set(found):
            message = json.loads(await ws.recv())
            if message.get("id") in ids and "method" not in message:
                found[message["id"]] = message
    return found


async def test_load_and_resume_of_one_session_at_once_always_answer_and_leak_nothing(app: App) -> None:
    """Seen by a tenant: session/load and session/resume of one session sent together over /acp: the load
    never answered (48 of 60 tries) and 12 subscriptions per try stayed open for good. 60 tries: both
    answer every time, and once the sockets close the subscriptions are back to their baseline."""
    url = f"ws://127.0.0.1:{app.http_port}/acp"
    async with connect(url, max_size=None) as ws:
        await ws.send(json.dumps(INIT))
        await _answers(ws, {1})
        await ws.send(json.dumps({"jsonrpc": "2.0", "id": 2, "method": "session/new",
                                  "params": {"cwd": "/tmp", "mcpServers": []}}))
        session = (await _answers(ws, {2}))[2]["result"]["sessionId"]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}") as http:
            listed = [s["session"] for s in (await http.get("/api/v1/sessions")).json()["sessions"]]
            assert session in listed  # session/new's session is listed at once, before any turn
        await ws.send(json.dumps({"jsonrpc": "2.0", "id": 3, "method": "session/prompt", "params": {
            "sessionId": session, "prompt": [{"type": "text", "text": "remember me"}]}}))
        assert (await _answers(ws, {3}, 30))[3]["result"]["stopReason"] == "end_turn"
    baseline = (await scrape_by_name(app))["uibus_subscriptions_total_open"]
    params = {"sessionId": session, "cwd": "/tmp", "mcpServers": []}
    outcomes: dict[str, int] = {}
    for _ in range(60):
        async with connect(url, max_size=None) as ws:
            await ws.send(json.dumps(INIT))
            await _answers(ws, {1})
            await ws.send(json.dumps({"jsonrpc": "2.0", "id": 10, "method": "session/load", "params": params}))
            await ws.send(json.dumps({"jsonrpc": "2.0", "id": 11, "method": "session/resume", "params": params}))
            answers = await _answers(ws, {10, 11})  # both answer: no hang
            for ident, answer in answers.items():
                key = f"{ident}:{'ok' if 'result' in answer else answer['error']['code']}"
                outcomes[key] = outcomes.get(key, 0) + 1
            assert "result" in answers[11], answers[11]  # the later one holds the session
    print(f"\nload/resume outcomes over 60 tries: {outcomes}")
    await wait_for_subscriptions(app, baseline)


async def wait_for_subscriptions(app: App, baseline: float) -> None:
    for _ in range(100):
        now = (await scrape_by_name(app))["uibus_subscriptions_total_open"]
        if now == baseline:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"subscriptions {now}, baseline {baseline}")

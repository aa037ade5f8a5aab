"""neuro-san's HTTP API on the HTTP port, over real HTTP, dispatched to the chat service handlers.

These need the AgentService/ConciergeService handlers (the chat service) to be installed.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import httpx

from tests.conftest import free_port
from uibus.app import App
from uibus.infra.config import Config

AGENT = "hello_world"  # the built-in local agent


async def chat(http: httpx.AsyncClient, body: dict, session: str = "default") -> tuple[list[dict], list[float], float]:
    """Posts a streaming_chat; returns the JSON lines, their arrival times and the end time."""
    lines, arrivals = [], []
    async with http.stream("POST", f"/api/v1/{AGENT}/streaming_chat", json=body,
                           headers={"x-uibus-session": session}) as resp:
        assert resp.status_code == 200, await resp.aread()
        assert resp.headers["content-type"].startswith("application/json-lines")
        async for line in resp.aiter_lines():
            if line.strip():
                lines.append(json.loads(line))
                arrivals.append(time.monotonic())
    return lines, arrivals, time.monotonic()


async def test_list_function_connectivity(web_http: httpx.AsyncClient) -> None:
    listed = (await web_http.get("/api/v1/list")).json()
    names = [a["agent_name"] for a in listed["agents"]]  # proto field names, not camelCase
    assert AGENT in names
    fn = await web_http.get(f"/api/v1/{AGENT}/function")
    assert fn.status_code == 200 and "function" in fn.json()
    conn = await web_http.get(f"/api/v1/{AGENT}/connectivity")
    assert conn.status_code == 200 and isinstance(conn.json(), dict)


async def test_streams_lines_as_produced(web_http: httpx.AsyncClient) -> None:
    body = {"user_message": {"type": "HUMAN", "text": "stream please"},
            "chat_filter": {"chat_filter_type": "MAXIMAL"}, "sly_data": {"chunks": 5, "delay_ms": 150}}
    start = time.monotonic()
    lines, arrivals, end = await chat(web_http, body, session="stream")
    print(f"\nline arrivals after request (ms): {[round((a - start) * 1000) for a in arrivals]}, "
          f"complete at {round((end - start) * 1000)} ms")
    assert len(lines) >= 3
    assert end - arrivals[0] >= 0.4  # the first line was in hand long before the reply ended
    final = lines[-1]["response"]
    assert final["type"] == "AGENT_FRAMEWORK" and "stream please" in final["text"]
    assert "chat_context" in final


async def test_multi_turn_context_through_http(web_http: httpx.AsyncClient) -> None:
    first, _, _ = await chat(web_http, {"user_message": {"text": "my name is Ada"}}, session="turns")
    assert len(first) == 1  # MINIMAL (default): only the final answer
    second, _, _ = await chat(web_http, {"user_message": {"text": "what is my name?"}}, session="turns")
    assert "my name is Ada" in second[-1]["response"]["text"]  # session store carried the context
    # a client that sends the chat_context (as neuro-san clients do) continues it in any session
    ctx = second[-1]["response"]["chat_context"]
    third, _, _ = await chat(web_http, {"user_message": {"text": "third"}, "chat_context": ctx}, session="other")
    assert "what is my name?" in third[-1]["response"]["text"]


async def test_errors(web_http: httpx.AsyncClient) -> None:
    r = await web_http.get("/api/v1/no_such_agent/function")
    assert r.status_code == 404 and "error" in r.json()
    r = await web_http.post("/api/v1/no_such_agent/streaming_chat", json={"user_message": {"text": "hi"}})
    assert r.status_code == 404 and "error" in r.json()
    r = await web_http.post(f"/api/v1/{AGENT}/streaming_chat", content=b"{not json")
    assert r.status_code == 400 and "ChatRequest" in r.json()["error"]
    r = await web_http.post(f"/api/v1/{AGENT}/streaming_chat", json={"no_such_field": 1})
    assert r.status_code == 400
    r = await web_http.get(f"/api/v1/{AGENT}/streaming_chat")
    assert r.status_code == 405
    r = await web_http.get("/api/v1/bad%20name/function")
    assert r.status_code in (400, 404)
    assert (await web_http.get("/api/v1/list")).status_code == 200  # still serving


async def test_bearer_token(config: Config) -> None:
    app = App(replace(config, http_port=free_port(), auth_token="tok"))
    await app.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}") as client:
            assert (await client.get("/api/v1/list")).status_code == 401
            ok = await client.get("/api/v1/list", headers={"authorization": "Bearer tok"})
            assert ok.status_code == 200
            assert (await client.get("/healthz")).status_code == 200
    finally:
        await app.aclose(grace=1.0)

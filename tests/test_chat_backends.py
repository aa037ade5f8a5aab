"""The HTTP backends against real servers on loopback that speak the upstream wire formats:
an OpenAI-compatible `/v1/chat/completions` SSE stream and neuro-san's JSON-lines HTTP API."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.chatkit import AI, FRAMEWORK, MAXIMAL, Agent, answer, chat, request, running, write_agents
from tests.conftest import free_port, wait_for
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.pb.neuro_san.api.grpc import chat_pb2

AGENT = chat_pb2.ChatMessage.AGENT


@dataclass
class Upstream:
    """A small aiohttp server; records what it was asked and when a client went away."""

    port: int
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    disconnected_at: list[float] = field(default_factory=list)
    url: str = ""


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    runners: list[web.AppRunner] = []

    async def start(route: str, handler: Callable[[web.Request, Upstream], Any]) -> Upstream:
        up = Upstream(port=free_port())
        up.url = f"http://127.0.0.1:{up.port}"

        async def wrapped(req: web.Request) -> web.StreamResponse:
            up.requests.append(await req.json())
            up.headers.append(dict(req.headers))
            try:
                return await handler(req, up)
            except (asyncio.CancelledError, ConnectionResetError):
                up.disconnected_at.append(time.monotonic())
                raise

        app = web.Application()
        app.router.add_post(route, wrapped)
        runner = web.AppRunner(app, handler_cancellation=True)  # a client's disconnect cancels the handler
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", up.port).start()
        runners.append(runner)
        return up

    yield start
    for runner in runners:
        await runner.cleanup()


def sse_handler(pieces: list[str], delay: float = 0.0) -> Callable[[web.Request, Upstream], Any]:
    async def handle(req: web.Request, up: Upstream) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        await resp.write(b": a comment line, to be ignored\n\n")
        for i, piece in enumerate(pieces):
            event = {"id": "c1", "object": "chat.completion.chunk", "model": "m1",
                     "choices": [{"index": 0, "delta": {"content": piece} if i else {"role": "assistant",
                                                                                      "content": piece},
                                  "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            if delay:
                await asyncio.sleep(delay)
        done = {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await resp.write(f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())
        return resp
    return handle


def openai_agent(up: Upstream, name: str = "gpt", **options: Any) -> dict[str, Any]:
    return {"name": name, "backend": "openai", "description": "an OpenAI-compatible model",
            "options": {"base_url": f"{up.url}/v1", "model": "m1", **options}}


async def test_openai_compatible_backend_streams_and_carries_the_conversation(config, serve, tmp_path: Path,
                                                                              monkeypatch):
    monkeypatch.setenv("UIBUS_TEST_KEY", "sk-test-123")
    up = await serve("/v1/chat/completions", sse_handler(["The ", "answer ", "is ", "42."]))
    path = write_agents(tmp_path, [openai_agent(up, api_key_env="UIBUS_TEST_KEY", system_prompt="Be brief.",
                                                temperature=0.2)])
    async with running(config, path) as app, Connection(f"127.0.0.1:{app.port}", session="oa") as conn:
        responses = await chat(conn, "gpt", "what is the answer?", filter_type=MAXIMAL)
        assert [r.response.type for r in responses] == [AI] * 4 + [FRAMEWORK]
        assert [r.response.text for r in responses[:4]] == ["The ", "answer ", "is ", "42."]
        assert [o.tool for o in responses[0].response.origin] == ["gpt"]
        assert responses[-1].response.text == "The answer is 42."
        assert up.headers[0]["Authorization"] == "Bearer sk-test-123"
        first = up.requests[0]
        assert (first["model"], first["stream"], first["temperature"]) == ("m1", True, 0.2)
        assert first["messages"] == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "what is the answer?"}]
        # The second turn sends the conversation, rebuilt from the session's stored ChatContext.
        await answer(conn, "gpt", "why?")
        assert up.requests[1]["messages"][1:] == [
            {"role": "user", "content": "what is the answer?"},
            {"role": "assistant", "content": "The answer is 42."},
            {"role": "user", "content": "why?"}]
        assert await app.store.get("oa", "chat/context/gpt") is not None


async def test_openai_failures_end_the_stream_normally_with_the_error(config, serve, tmp_path: Path, monkeypatch):
    async def broken(req: web.Request, up: Upstream) -> web.Response:
        return web.json_response({"error": {"message": "model m1 is overloaded"}}, status=503)

    up = await serve("/v1/chat/completions", broken)
    monkeypatch.delenv("UIBUS_MISSING_KEY", raising=False)
    closed = free_port()
    path = write_agents(tmp_path, [
        openai_agent(up),
        openai_agent(up, name="keyless", api_key_env="UIBUS_MISSING_KEY"),
        {"name": "offline", "backend": "openai", "options": {"base_url": f"http://127.0.0.1:{closed}/v1",
                                                              "model": "m1", "connect_timeout_s": 2}},
    ])
    async with running(config, path) as app, Connection(f"127.0.0.1:{app.port}", session="fail") as conn:
        final = await answer(conn, "gpt", "hello")
        assert final.text.startswith("Error from gpt: ")
        assert "HTTP 503" in final.text and "overloaded" in final.text
        assert final.chat_context == chat_pb2.ChatContext()  # the failed turn is not part of the conversation
        final = await answer(conn, "keyless", "hello")
        assert final.text == "Error from keyless: the API key variable UIBUS_MISSING_KEY is not set on the server"
        final = await answer(conn, "offline", "hello", filter_type=MAXIMAL)
        assert final.text.startswith("Error from offline: cannot reach http://127.0.0.1:")
        assert await app.store.get("fail", "chat/context/gpt") is None
        history = await app.core.history.read("fail")
        assert [e.get("error", False) for e in history if e["role"] == "assistant"] == [True, True, True]
        # A bad event in the middle of a stream is a failure too.

    async def garbage(req: web.Request, up: Upstream) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        await resp.write(b'data: {"choices": [{"delta": {"content": "part"}}]}\n\ndata: {not json\n\n')
        return resp

    bad = await serve("/v1/chat/completions", garbage)
    path = write_agents(tmp_path, [openai_agent(bad)])
    async with running(config, path) as app, Connection(f"127.0.0.1:{app.port}") as conn:
        responses = await chat(conn, "gpt", "x", filter_type=MAXIMAL)
        assert responses[0].response.text == "part"
        assert "sent an event that is not JSON" in responses[-1].response.text


async def test_cancelling_a_chat_reaches_the_openai_upstream_within_100ms(config, serve, tmp_path: Path):
    long, short = sse_handler([f"w{i} " for i in range(500)], delay=0.02), sse_handler(["ok"])

    async def handle(req: web.Request, up: Upstream) -> web.StreamResponse:
        last = up.requests[-1]["messages"][-1]["content"]
        return await (short if last == "short?" else long)(req, up)

    up = await serve("/v1/chat/completions", handle)
    path = write_agents(tmp_path, [openai_agent(up)])
    async with running(config, path) as app, Connection(f"127.0.0.1:{app.port}", session="cut") as conn:
        call = Agent(conn, "gpt").StreamingChat(request("go on and on", filter_type=MAXIMAL))
        for _ in range(3):
            assert (await call.read()).response.type == AI
        cancelled_at = time.monotonic()
        call.cancel()
        await wait_for(lambda: bool(up.disconnected_at), timeout=2, what="upstream to see the disconnect")
        took = up.disconnected_at[0] - cancelled_at
        print(f"cancel -> upstream saw the disconnect: {took * 1000:.1f} ms")
        assert took < 0.1, f"the upstream saw the cancel only after {took * 1000:.0f} ms"
        assert await app.store.get("cut", "chat/context/gpt") is None
        # The connection pool is fine afterwards: the next turn works.
        assert (await chat(conn, "gpt", "short?", filter_type=MAXIMAL))[-1].response.type == FRAMEWORK


def neurosan_handler(answer_text: str) -> Callable[[web.Request, Upstream], Any]:
    """neuro-san's POST /api/v1/{agent}/streaming_chat: JSON lines, types as enum names."""

    async def handle(req: web.Request, up: Upstream) -> web.StreamResponse:
        body = up.requests[-1]
        agent = req.match_info["agent"]
        resp = web.StreamResponse(headers={"Content-Type": "application/json-lines"})
        await resp.prepare(req)
        previous = body.get("chat_context", {}).get("chat_histories", [{}])[0].get("messages", [])
        origin = [{"tool": agent, "instantiation_index": 1}]
        lines = [
            {},  # keep-alive
            {"response": {"type": "AGENT", "text": "Received", "origin": origin}},
            {"response": {"type": "AI", "text": answer_text, "origin": [*origin, {"tool": "synonymizer"}]}},
            {"response": {"type": "AGENT_FRAMEWORK", "text": answer_text, "sly_data": {"echo": body.get("sly_data")},
                          "chat_context": {"chat_histories": [{"origin": origin, "messages": [
                              *previous,
                              {"type": "HUMAN", "text": body["user_message"]["text"]},
                              {"type": "AI", "text": answer_text}]}]}}},
        ]
        for line in lines:
            await resp.write((json.dumps(line) + "\n").encode())
        return resp
    return handle


async def test_neuro_san_upstream_proxy(config, serve, tmp_path: Path):
    up = await serve("/api/v1/{agent}/streaming_chat", neurosan_handler("Bonjour!"))
    path = write_agents(tmp_path, [{"name": "proxy", "backend": "neuro-san", "description": "upstream hello",
                                    "options": {"base_url": up.url, "agent": "announcer"}}])
    async with running(config, path) as app, Connection(f"127.0.0.1:{app.port}", session="px") as conn:
        responses = await chat(conn, "proxy", "hello there", filter_type=MAXIMAL, sly={"k": "v"},
                               metadata=(("user_id", "u7"),))
        got = [(r.response.type, r.response.text, [o.tool for o in r.response.origin]) for r in responses]
        assert got == [(AGENT, "Received", ["announcer"]), (AI, "Bonjour!", ["announcer", "synonymizer"]),
                       (FRAMEWORK, "Bonjour!", [])]
        final = responses[-1].response
        assert final.sly_data["echo"]["k"] == "v"
        sent = up.requests[0]
        assert sent["user_message"] == {"type": "HUMAN", "text": "hello there"}
        assert sent["chat_filter"] == {"chat_filter_type": "MAXIMAL"} and sent["sly_data"] == {"k": "v"}
        assert "chat_context" not in sent
        assert up.headers[0]["user_id"] == "u7"
        # MINIMAL: just the final message; the upstream's own ChatContext went back to it.
        responses = await chat(conn, "proxy", "again")
        assert [r.response.type for r in responses] == [FRAMEWORK]
        messages = up.requests[1]["chat_context"]["chat_histories"][0]["messages"]
        assert [(m["type"], m["text"]) for m in messages] == [("HUMAN", "hello there"), ("AI", "Bonjour!")]
        assert [m.text for m in responses[0].response.chat_context.chat_histories[0].messages] == [
            "hello there", "Bonjour!", "again", "Bonjour!"]


async def test_neuro_san_upstream_failures(config, serve, tmp_path: Path):
    async def no_final(req: web.Request, up: Upstream) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json-lines"})
        await resp.prepare(req)
        await resp.write(b'{"response": {"type": "AGENT", "text": "thinking"}}\n')
        return resp

    async def missing(req: web.Request, up: Upstream) -> web.Response:
        return web.Response(status=404, text="agent not found")

    truncated = await serve("/api/v1/{agent}/streaming_chat", no_final)
    gone = await serve("/api/v1/{agent}/streaming_chat", missing)
    path = write_agents(tmp_path, [
        {"name": "cut", "backend": "neuro-san", "options": {"base_url": truncated.url}},
        {"name": "gone", "backend": "neuro-san", "options": {"base_url": gone.url}},
    ])
    async with running(config, path) as app, Connection(f"127.0.0.1:{app.port}") as conn:
        final = await answer(conn, "cut", "hi")
        assert final.text == f"Error from cut: {truncated.url}/api/v1/cut/streaming_chat ended its stream " \
                             "without a final answer"
        final = await answer(conn, "gone", "hi")
        assert "HTTP 404" in final.text and "agent not found" in final.text


async def test_backends_are_closed_at_shutdown(config, serve, tmp_path: Path):
    up = await serve("/v1/chat/completions", sse_handler(["ok"]))
    path = write_agents(tmp_path, [openai_agent(up)])
    async with running(config, path) as app, Connection(f"127.0.0.1:{app.port}") as conn:
        await answer(conn, "gpt", "hi")
        backend = app.core.chat.backend("gpt")
        session = backend.http._session  # type: ignore[attr-defined]
        assert session is not None and not session.closed
    assert isinstance(app, App)
    await wait_for(lambda: session.closed, what="the HTTP client session to close")

"""Scripted model APIs on loopback, the one stand-in when real ACP agents run behind uibus
(tests/test_acp_agent.py): each plays a paid model; the agents and their tools are the real ones.

* `claude_model`: Anthropic's Messages API (`POST /v1/messages`, server-sent events), for Claude Code;
* `gemini_model`: the Gemini API (`:streamGenerateContent?alt=sse`), for Gemini CLI;
* `responses_model`: OpenAI's Responses API (`POST /v1/responses`, events), for Codex.

A scripted reply (`Say`: text, then perhaps one tool call) answers each request of the agent's own
loop; what an agent asks on the side (Claude Code's one-token count of its MCP tools, Gemini's
model router) gets a short fixed answer, so the script is not used up.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.conftest import free_port
from tests.pikit import words


@dataclass
class Say:
    """One scripted assistant message: text (streamed word by word), then perhaps one tool call."""

    text: str = ""
    tool: tuple[str, dict[str, Any]] | None = None


@dataclass
class ScriptedModel:
    port: int
    replies: list[Say] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)  # the agent loop's (with tools)
    side: list[dict[str, Any]] = field(default_factory=list)  # the others

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def script(self, *replies: Say) -> None:
        self.replies.extend(replies)


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


async def _stream(request: web.Request, say: Say, n: int) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    usage = {"input_tokens": 10, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    await response.write(_event("message_start", {"type": "message_start", "message": {
        "id": f"msg_{n}", "type": "message", "role": "assistant", "model": "claude-scripted", "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage}}))
    index = 0
    if say.text:
        await response.write(_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                            "content_block": {"type": "text", "text": ""}}))
        for word in words(say.text):
            await response.write(_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                                "delta": {"type": "text_delta", "text": word}}))
            await asyncio.sleep(0)
        await response.write(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
        index = 1
    if say.tool is not None:
        name, args = say.tool
        await response.write(_event("content_block_start", {"type": "content_block_start", "index": index,
                                                            "content_block": {"type": "tool_use", "id": f"toolu_{n}",
                                                                              "name": name, "input": {}}}))
        await response.write(_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(args)}}))
        await response.write(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
    stop = "tool_use" if say.tool is not None else "end_turn"
    await response.write(_event("message_delta", {"type": "message_delta", "delta": {
        "stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 5}}))
    await response.write(_event("message_stop", {"type": "message_stop"}))
    return response


@asynccontextmanager
async def claude_model() -> AsyncIterator[ScriptedModel]:
    model = ScriptedModel(port=free_port())

    async def messages(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        looping = bool(body.get("stream")) and bool(body.get("system"))
        (model.requests if looping else model.side).append(body)
        say = (model.replies.pop(0) if model.replies else Say("(no scripted reply)")) if looping else Say("Title")
        n = len(model.requests) + len(model.side)
        if body.get("stream"):
            return await _stream(request, say, n)
        return web.json_response({"id": f"msg_{n}", "type": "message", "role": "assistant", "model": "claude-scripted",
                                  "content": [{"type": "text", "text": say.text or "ok"}], "stop_reason": "end_turn",
                                  "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 5}})

    async def anything(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", model.port).start()
    try:
        yield model
    finally:
        await runner.cleanup()


async def _serve(handler: Any, port: int) -> web.AppRunner:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@asynccontextmanager
async def gemini_model() -> AsyncIterator[ScriptedModel]:
    """The Gemini API as Gemini CLI calls it (GOOGLE_GEMINI_BASE_URL): one SSE chunk per part."""
    model = ScriptedModel(port=free_port())
    usage = {"promptTokenCount": 10, "candidatesTokenCount": 2, "totalTokenCount": 12}

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else {}
        path = request.path
        if path.endswith(":streamGenerateContent"):
            looping = bool(body.get("tools"))
            (model.requests if looping else model.side).append(body)
            say = (model.replies.pop(0) if model.replies else Say("(no scripted reply)")) if looping else Say("ok")
            parts: list[dict[str, Any]] = [{"text": w} for w in words(say.text)]
            if say.tool is not None:
                parts.append({"functionCall": {"name": say.tool[0], "args": say.tool[1]}})
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i, part in enumerate(parts or [{"text": ""}]):
                candidate: dict[str, Any] = {"content": {"role": "model", "parts": [part]}, "index": 0}
                if i == len(parts) - 1 or not parts:
                    candidate["finishReason"] = "STOP"
                await response.write(f"data: {json.dumps({'candidates': [candidate], 'usageMetadata': usage})}\n\n"
                                     .encode())
            return response
        model.side.append(body)
        if path.endswith(":countTokens"):
            return web.json_response({"totalTokens": 10})
        return web.json_response({"candidates": [{"content": {"role": "model", "parts": [{"text": "{}"}]},
                                                  "finishReason": "STOP", "index": 0}], "usageMetadata": usage})

    runner = await _serve(handle, model.port)
    try:
        yield model
    finally:
        await runner.cleanup()


@asynccontextmanager
async def responses_model() -> AsyncIterator[ScriptedModel]:
    """OpenAI's Responses API as Codex calls it (a `model_providers` entry with wire_api "responses")."""
    model = ScriptedModel(port=free_port())

    def event(kind: str, data: dict[str, Any]) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    async def handle(request: web.Request) -> web.StreamResponse:
        if not (request.method == "POST" and request.path.endswith("/responses")):
            return web.json_response({"data": []})
        body = await request.json()
        model.requests.append(body)
        say = model.replies.pop(0) if model.replies else Say("(no scripted reply)")
        n = len(model.requests)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(event("response.created", {"response": {"id": f"resp_{n}"}}))
        index = 0
        if say.text:
            item = {"type": "message", "role": "assistant", "id": f"msg_{n}"}
            await response.write(event("response.output_item.added", {"output_index": 0, "item": {**item,
                                                                                                  "content": []}}))
            for word in words(say.text):
                await response.write(event("response.output_text.delta", {
                    "item_id": f"msg_{n}", "output_index": 0, "content_index": 0, "delta": word}))
            await response.write(event("response.output_item.done", {"output_index": 0, "item": {
                **item, "content": [{"type": "output_text", "text": say.text}]}}))
            index = 1
        if say.tool is not None:
            await response.write(event("response.output_item.done", {"output_index": index, "item": {
                "type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": say.tool[0],
                "arguments": json.dumps(say.tool[1])}}))
        await response.write(event("response.completed", {"response": {"id": f"resp_{n}", "usage": {
            "input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}}}))
        return response

    runner = await _serve(handle, model.port)
    try:
        yield model
    finally:
        await runner.cleanup()

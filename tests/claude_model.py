"""A scripted Anthropic Messages API on loopback (`POST /v1/messages`, streamed as server-sent
events), the one stand-in when Claude Code runs behind uibus (tests/test_acp_agent.py): it plays
the paid model; Claude Code, its ACP adapter and its tools are the real ones.

Scripted replies answer the agent loop's requests (streamed, with Claude Code's system prompt);
anything else it asks on the side (a one-token count of the MCP tools' size, a title) gets a short
fixed reply, so the script is not used up.
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
class ClaudeModel:
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
async def claude_model() -> AsyncIterator[ClaudeModel]:
    model = ClaudeModel(port=free_port())

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

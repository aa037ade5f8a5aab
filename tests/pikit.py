"""The real pi agent behind uibus: a scripted OpenAI-compatible model on loopback, pi's config for
it, and the agents file that hosts pi as an `rpc` agent (tests/test_pi_agent.py, the browser test
and the bench use it).

The model is the one stand-in: it plays a paid LLM API, streaming a scripted reply per request as
`/v1/chat/completions` server-sent events (reasoning_content, content and tool_calls deltas, the
shapes pi's openai-completions provider reads). pi, its extensions and its tools are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.chatkit import MAXIMAL, Agent, request, write_agents
from tests.conftest import REPO, free_port, start_app
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config

PI_DIR = REPO / "tests" / "pi"
PI = PI_DIR / "node_modules" / ".bin" / "pi"
UI_TOUR = PI_DIR / "ui-tour.ts"
GATE = REPO / "examples" / "pi" / "gate.ts"  # the gate the example config ships


@dataclass
class Reply:
    """One scripted model answer: thinking, then text (streamed word by word), then a tool call."""

    text: str = ""
    thinking: str = ""
    tool: tuple[str, dict[str, Any]] | None = None
    hang: bool = False  # stream the first piece, then never finish (a cancel must end the request)
    delay_s: float = 0.0  # between pieces


@dataclass
class Model:
    port: int
    replies: list[Reply] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    open_requests: int = 0
    cancelled: int = 0  # requests whose client went away before the reply ended

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def script(self, *replies: Reply) -> None:
        self.replies.extend(replies)


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {"id": "chatcmpl-script", "object": "chat.completion.chunk", "created": 0, "model": "scripted",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def words(text: str) -> list[str]:
    """`text` in pieces that end after each space (how the scripted models stream a reply)."""
    out, word = [], ""
    for ch in text:
        word += ch
        if ch == " ":
            out.append(word)
            word = ""
    return [*out, word] if word else out


@asynccontextmanager
async def scripted_model() -> AsyncIterator[Model]:
    model = Model(port=free_port())

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model.requests.append(body)
        reply = model.replies.pop(0) if model.replies else Reply(text="(no scripted reply)")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        model.open_requests += 1
        finished = False
        try:
            await response.write(_chunk({"role": "assistant", "content": ""}))
            for piece in words(reply.thinking):
                await response.write(_chunk({"reasoning_content": piece}))
                await asyncio.sleep(reply.delay_s)
            for piece in words(reply.text):
                await response.write(_chunk({"content": piece}))
                await asyncio.sleep(reply.delay_s)
            if reply.hang:  # until the client goes (aiohttp does not cancel a handler when it does)
                while request.transport is not None and not request.transport.is_closing():  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
                return response
            if reply.tool is not None:
                name, args = reply.tool
                await response.write(_chunk({"tool_calls": [{"index": 0, "id": f"call_{len(model.requests)}",
                                                             "type": "function", "function": {
                                                                 "name": name, "arguments": json.dumps(args)}}]}))
                await response.write(_chunk({}, "tool_calls"))
            else:
                await response.write(_chunk({}, "stop"))
            await response.write(b"data: [DONE]\n\n")
            finished = True
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        finally:
            model.open_requests -= 1
            if not finished:
                model.cancelled += 1
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", model.port)
    await site.start()
    try:
        yield model
    finally:
        await runner.cleanup()


def pi_home(tmp_path: Path, model: Model) -> Path:
    """A HOME whose ~/.pi/agent/models.json names the scripted model (provider `script`)."""
    home = tmp_path / "pi-home"
    agent_dir = home / ".pi" / "agent"
    agent_dir.mkdir(parents=True, exist_ok=True)
    prompts = agent_dir / "prompts"  # a prompt template: `/summarize` is a model run, not a command
    prompts.mkdir(exist_ok=True)
    (prompts / "summarize.md").write_text("---\ndescription: Summarize the work so far\n---\nSummarize the work "
                                          "so far in one line.\n")
    (agent_dir / "models.json").write_text(json.dumps({"providers": {"script": {
        "baseUrl": model.url, "api": "openai-completions", "apiKey": "scripted-key",
        "compat": {"supportsDeveloperRole": False},
        "models": [{"id": "scripted", "name": "Scripted", "reasoning": True, "input": ["text"],
                    "contextWindow": 128000, "maxTokens": 4096}]}}}))
    return home


def pi_agent(tmp_path: Path, model: Model, name: str = "pi", **options: Any) -> dict[str, Any]:
    """The agents-file entry hosting the real pi in RPC mode with the test extensions."""
    home = pi_home(tmp_path, model)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return {"name": name, "backend": "rpc", "description": "the pi coding agent (RPC mode)", "options": {
        "command": [str(PI), "--mode", "rpc", "--no-session", "-e", str(UI_TOUR), "-e", str(GATE),
                    "--provider", "script", "--model", "scripted"],
        "cwd": str(work), "env": {"HOME": str(home), "PI_OFFLINE": "1"}, **options}}


def agent_pids(work: Path) -> list[int]:
    """Processes running in the agent's working directory `work` (pi and whatever it started): pi
    renames itself (`process.title = "pi"`), so its command line cannot tell which test it belongs
    to, but the cwd given to it in the agents file can."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if Path(os.readlink(entry / "cwd")) == work:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@asynccontextmanager
async def hosting(config: Config, tmp_path: Path, agents: list[dict[str, Any]], **changes: Any) -> AsyncIterator[App]:
    """An app serving `agents`; after it closes, no agent session (so no agent process) is left."""
    app = await start_app(replace(config, agents=write_agents(tmp_path, agents), **changes))
    try:
        yield app
    finally:
        await app.aclose()
    assert app.core.agent_sessions.count() == 0


async def turn_of(conn: Connection, agent: str, text: str, *, maximal: bool = False) -> list[Any]:
    """Every ChatResponse of one StreamingChat turn of `agent`."""
    call = Agent(conn, agent).StreamingChat(request(text, filter_type=MAXIMAL if maximal else 0))
    return [r async for r in call]

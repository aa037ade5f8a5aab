"""ACP agents hosted by uibus (`backend = "acp"`): uibus as the Agent Client Protocol client.

The agent is a fixture written with the official `@agentclientprotocol/sdk` (tests/acp/, pinned by
its package-lock.json and installed by `.ci/setup`) that shows every side of the protocol on cue:
each session/update kind, a permission request, a cancel, a JSON-RPC error, and a call of uibus's
own /mcp (offered in session/new). It is driven through uibus's own ways in, as pi is
(tests/test_pi_agent.py), and shares the same agent sessions and dialogs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.chatkit import AI, FRAMEWORK, MAXIMAL, Agent, request
from tests.conftest import REPO, chat_on_page, free_port, require, shots, wait_for
from tests.ext_ui_helpers import ext, open_uis, read
from tests.pikit import hosting, turn_of
from tests.scripted_models import Say, ScriptedModel, claude_model, gemini_model, responses_model
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra import kinds
from uibus.infra.config import Config
from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc
from uibus.pb.neuro_san.api.grpc import chat_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

pytestmark = [pytest.mark.timeout(120), pytest.mark.node]
ACP_DIR = REPO / "tests" / "acp"
FIXTURE = ACP_DIR / "fixture-agent.mjs"
AGENT_MSG, TOOL_RESULT = chat_pb2.ChatMessage.AGENT, chat_pb2.ChatMessage.AGENT_TOOL_RESULT


def fixture_agent(tmp_path: Path, name: str = "acp", **options: Any) -> dict[str, Any]:
    node = shutil.which("node") or "node"
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return {"name": name, "backend": "acp", "description": "an ACP fixture agent", "options": {
        "command": [node, str(FIXTURE)], "cwd": str(work), "env": {"ACP_FIXTURE_LOG": str(tmp_path / "acp.log")},
        **options}}


def fixture_log(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "acp.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
async def acp_app(config: Config, tmp_path: Path) -> AsyncIterator[App]:
    require("the ACP SDK (npm ci --prefix tests/acp)", (ACP_DIR / "node_modules" / "@agentclientprotocol").is_dir(),
            "node")
    async with hosting(config, tmp_path, [fixture_agent(tmp_path)], http_port=free_port()) as app:
        yield app


async def chat(conn: Connection, text: str, *, maximal: bool = False) -> list[Any]:
    return await turn_of(conn, "acp", text, maximal=maximal)


async def test_initialize_offers_nothing_but_uibus_mcp_and_sessions_are_per_uibus_session(acp_app: App,
                                                                                         tmp_path: Path) -> None:
    async with Connection(f"127.0.0.1:{acp_app.port}", session="one") as one, \
            Connection(f"127.0.0.1:{acp_app.port}", session="two") as two:
        assert (await chat(one, "hello"))[-1].response.text == "Turn 1: hello"
        assert (await chat(one, "again"))[-1].response.text == "Turn 2: again"  # the agent keeps its session
        assert (await chat(two, "hi"))[-1].response.text == "Turn 1: hi"  # another uibus session: another
    log = fixture_log(tmp_path)
    init = [e["initialize"] for e in log if "initialize" in e]
    assert len(init) == 2 and init[0]["protocolVersion"] == 1
    caps = init[0]["clientCapabilities"]  # (the SDK fills in the defaults of what uibus left out)
    assert (caps["fs"], caps["terminal"]) == ({"readTextFile": False, "writeTextFile": False}, False)
    new = [e["session/new"] for e in log if "session/new" in e]
    assert new[0]["cwd"] == str(tmp_path / "work")
    (server,) = new[0]["mcpServers"]
    assert (server["type"], server["name"], server["url"]) == ("http", "uibus",
                                                              f"http://127.0.0.1:{acp_app.http_port}/mcp")
    assert {"name": "x-uibus-session", "value": "one"} in server["headers"]
    assert {"name": "x-uibus-agent", "value": "acp"} in server["headers"]


async def test_uibus_mcp_neither_lists_a_hosted_agent_to_itself_nor_lets_it_call_itself(acp_app: App) -> None:
    """Its own turn holds its agent session: calling itself through /mcp would wait for itself."""
    from tests.test_mcp import chat_args, rpc

    init = await rpc(acp_app, {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                               "params": {"protocolVersion": "2025-06-18", "capabilities": {}}})
    headers = {"mcp-session-id": init.headers["mcp-session-id"], "mcp-protocol-version": "2025-06-18",
               "x-uibus-session": "self", "x-uibus-agent": "acp"}
    listed = await rpc(acp_app, {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, headers)
    names = [t["name"] for t in listed.json()["result"]["tools"]]
    assert "acp" not in names and "ask_user" in names
    called = await rpc(acp_app, {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                                 "params": {"name": "acp", "arguments": chat_args("hi")}}, headers)
    assert "acp cannot call itself" in called.json()["error"]["message"]
    others = {k: v for k, v in headers.items() if k != "x-uibus-agent"}
    assert "acp" in [t["name"] for t in (await rpc(acp_app, {"jsonrpc": "2.0", "id": 4, "method": "tools/list"},
                                                  others)).json()["result"]["tools"]]


async def test_every_update_kind_and_a_permission_answered_at_a_ui(acp_app: App,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="uibus.agents.acp")
    async with Connection(f"127.0.0.1:{acp_app.port}", session="tour") as conn:
        (ui,) = await open_uis(acp_app, conn, 1, "tour")
        webview = ui_pb2_grpc.UiServiceStub(conn.channel).subscribeToPartialMessage(common_pb2.EmptyRequest())
        await wait_for(lambda: acp_app.bus.count(kinds.PARTIAL_MESSAGE, "tour") == 1, what="webview")
        call = asyncio.ensure_future(chat(conn, "tour", maximal=True))
        asked = (await read(ui, 30)).request
        assert (asked.select.title, list(asked.select.options)) == ("rm -rf build", ["Always Allow", "Allow", "Reject"])
        await ext(conn).Respond(pb.RespondRequest(id=asked.id, value="Reject"))
        responses = await asyncio.wait_for(call, 30)
        assert responses[-1].response.type == FRAMEWORK
        assert responses[-1].response.text == "Permission: reject."
        assert "".join(r.response.text for r in responses if r.response.type == AI) == "Permission: reject."
        agent = [r.response for r in responses if r.response.type == AGENT_MSG]
        assert "".join(m.text for m in agent if m.structure["kind"] == "thinking") == "I should clean the build."
        assert [m.structure["kind"] for m in agent if m.structure["kind"] != "thinking"] == [
            "plan", "tool_start", "tool_start"]
        ends = [r.response for r in responses if r.response.type == TOOL_RESULT]
        assert [(e.structure["tool_call_id"], e.structure["status"]) for e in ends] == [
            ("read-1", "completed"), ("cmd-1", "failed")]
        seen: dict[int, ui_pb2.ClineMessage] = {}
        async with asyncio.timeout(10):
            while not any(m.say == ui_pb2.TEXT and not m.partial and m.text == "Permission: reject."
                          for m in seen.values()):
                m = await webview.read()
                seen[m.ts] = m
        by = {say: [m for m in seen.values() if m.say == say] for say in (
            ui_pb2.REASONING, ui_pb2.INFO, ui_pb2.TOOL_SAY, ui_pb2.COMMAND_SAY, ui_pb2.COMMAND_OUTPUT_SAY)}
        assert by[ui_pb2.REASONING][-1].text == "I should clean the build."
        assert by[ui_pb2.INFO][-1].text == "Plan\n\n- [x] Look at the build\n- [ ] Remove the cache *(in progress)*"
        assert json.loads(by[ui_pb2.TOOL_SAY][-1].text) == {"tool": "readFile", "path": "/work/package.json",
                                                           "content": '{"name": "demo"}'}
        assert [m.text for m in by[ui_pb2.COMMAND_SAY]] == ["rm -rf build"]
        assert by[ui_pb2.COMMAND_OUTPUT_SAY][-1].text == "The user rejected this."
        assert all(not m.partial for m in seen.values() if m.say != ui_pb2.TEXT)
    unknown = [r for r in caplog.records if r.getMessage() == "unknown session/update kind; ignored"]
    assert len(unknown) == 1 and unknown[0].fields["update"] == "mystery_update"  # type: ignore[attr-defined]


async def test_cancel_reaches_the_agent_as_session_cancel(acp_app: App, tmp_path: Path) -> None:
    async with Connection(f"127.0.0.1:{acp_app.port}", session="cancel") as conn:
        call = Agent(conn, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
        first = await asyncio.wait_for(call.read(), 30)
        assert first.response.text == "Working "
        call.cancel()
        await wait_for(lambda: any("cancelled" in e for e in fixture_log(tmp_path)), timeout=10,
                       what="session/cancel at the agent")
        assert (await chat(conn, "next"))[-1].response.text == "Turn 2: next"  # same process and session
        assert acp_app.core.chat.agents.backends["acp"].started == 1


async def test_a_permission_left_open_closes_at_every_ui_when_the_turn_is_cancelled(acp_app: App) -> None:
    async with Connection(f"127.0.0.1:{acp_app.port}", session="gone") as conn:
        (ui,) = await open_uis(acp_app, conn, 1, "gone")
        call = Agent(conn, "acp").StreamingChat(request("tour"))
        asked = (await read(ui, 30)).request
        call.cancel()
        closed = await read(ui, 5)
        assert (closed.closed.id, closed.closed.reason) == (asked.id, pb.DIALOG_OUTCOME_CALLER_CANCELLED)
        # The agent got `cancelled` for its permission request and finished its prompt.
        assert (await chat(conn, "still here?"))[-1].response.text == "Turn 2: still here?"


async def test_a_json_rpc_error_is_the_turns_error(acp_app: App) -> None:
    async with Connection(f"127.0.0.1:{acp_app.port}", session="err") as conn:
        final = (await chat(conn, "fail"))[-1].response
        assert final.text == "Error from acp: the fixture was told to fail (JSON-RPC -32603)"


async def test_the_agent_asks_the_user_through_uibus_own_mcp(acp_app: App) -> None:
    """The agent calls `ask_user` on the MCP server uibus offered in session/new; the dialog opens at
    the session's UIs and the answer comes back to the agent, then into its reply."""
    async with Connection(f"127.0.0.1:{acp_app.port}", session="mcp") as conn:
        (ui,) = await open_uis(acp_app, conn, 1, "mcp")
        call = asyncio.ensure_future(chat(conn, "mcp"))
        asked = (await read(ui, 30)).request
        assert (asked.select.title, list(asked.select.options)) == ("Which branch?", ["main", "dev"])
        await ext(conn).Respond(pb.RespondRequest(id=asked.id, value="dev"))
        final = (await asyncio.wait_for(call, 30))[-1].response.text
        assert final.startswith("The user said {") and '"value": "dev"' in final.replace('":"', '": "'), final


async def test_a_killed_acp_agent_ends_the_turn_and_the_next_starts_another(acp_app: App, tmp_path: Path) -> None:
    async with Connection(f"127.0.0.1:{acp_app.port}", session="kill") as conn:
        call = Agent(conn, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
        await asyncio.wait_for(call.read(), 30)
        (live,) = [s for s in acp_app.core.agent_sessions._live.values()]
        pid = live.agent.process.proc.pid  # type: ignore[attr-defined]
        os.kill(pid, 9)
        rest = [r async for r in call]
        assert "the agent process exited (code -9) during the turn" in rest[-1].response.text
        assert (await chat(conn, "hello"))[-1].response.text == "Turn 1: hello"
        assert acp_app.core.chat.agents.backends["acp"].started == 2


# ---- the real Claude Code, through its ACP adapter (@zed-industries/claude-code-acp, unmodified) ----

CLAUDE_ACP = ACP_DIR / "node_modules" / ".bin" / "claude-code-acp"


def claude_agent(tmp_path: Path, model: ScriptedModel, **options: Any) -> dict[str, Any]:
    home = tmp_path / "claude-home"
    home.mkdir(exist_ok=True)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return {"name": "claude", "backend": "acp", "description": "Claude Code (ACP adapter)", "options": {
        "command": [str(CLAUDE_ACP)], "cwd": str(work), "start_timeout_seconds": 60, "env": {
            "HOME": str(home), "ANTHROPIC_BASE_URL": model.url, "ANTHROPIC_API_KEY": "sk-scripted",
            "IS_SANDBOX": "1",  # as root, Claude Code refuses to start its session without it
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}, **options}}


@pytest.fixture
async def claude(config: Config, tmp_path: Path) -> AsyncIterator[tuple[App, ScriptedModel]]:
    require("Claude Code's ACP adapter (npm ci --prefix tests/acp)", CLAUDE_ACP.exists(), "node")
    async with claude_model() as model, \
            hosting(config, tmp_path, [claude_agent(tmp_path, model)], http_port=free_port()) as app:
        yield app, model


async def claude_chat(conn: Connection, text: str, *, maximal: bool = False) -> list[Any]:
    return await turn_of(conn, "claude", text, maximal=maximal)


async def test_claude_code_answers_and_streams_through_uibus(claude: tuple[App, ScriptedModel]) -> None:
    app, model = claude
    model.script(Say("Hello from Claude Code, scripted."), Say("Still the same conversation."))
    async with Connection(f"127.0.0.1:{app.port}", session="cc") as conn:
        responses = await claude_chat(conn, "hi", maximal=True)
        assert "".join(r.response.text for r in responses if r.response.type == AI) == \
            "Hello from Claude Code, scripted."
        assert responses[-1].response.text == "Hello from Claude Code, scripted."
        assert (await claude_chat(conn, "and now?"))[-1].response.text == "Still the same conversation."
        second = json.dumps(model.requests[1]["messages"])  # Claude Code kept its own conversation
        assert "Hello from Claude Code, scripted." in second and "and now?" in second


async def test_claude_codes_bash_permission_rejected_at_a_ui(claude: tuple[App, ScriptedModel], tmp_path: Path) -> None:
    app, model = claude
    victim = tmp_path / "work" / "build"
    victim.mkdir(parents=True)
    command = "rm -rf build"
    model.script(Say("I will remove the build directory.", tool=("Bash", {"command": command,
                                                                          "description": "Remove build"})))
    async with Connection(f"127.0.0.1:{app.port}", session="ccperm") as conn:
        (ui,) = await open_uis(app, conn, 1, "ccperm")
        webview = ui_pb2_grpc.UiServiceStub(conn.channel).subscribeToPartialMessage(common_pb2.EmptyRequest())
        await wait_for(lambda: app.bus.count(kinds.PARTIAL_MESSAGE, "ccperm") == 1, what="webview")
        call = asyncio.ensure_future(claude_chat(conn, "clean the build", maximal=True))
        asked = (await read(ui, 60)).request
        assert list(asked.select.options) == ["Always Allow", "Allow", "Reject"]
        assert asked.select.title == f"`{command}`"  # Claude Code's title of the tool call
        await ext(conn).Respond(pb.RespondRequest(id=asked.id, value="Reject"))
        responses = await asyncio.wait_for(call, 60)
        # A rejected tool ends Claude Code's turn (end_turn) with what it said before it.
        assert responses[-1].response.text == "I will remove the build directory."
        assert victim.is_dir() and len(model.requests) == 1  # the command never ran
        ends = [r.response for r in responses if r.response.type == TOOL_RESULT]
        assert ends and ends[-1].structure["status"] == "failed"
        seen: dict[int, ui_pb2.ClineMessage] = {}
        async with asyncio.timeout(10):
            while not any(m.say == ui_pb2.TEXT and not m.partial and "remove the build" in m.text
                          for m in seen.values()):
                m = await webview.read()
                seen[m.ts] = m
        assert any(m.say == ui_pb2.COMMAND_SAY and command in m.text for m in seen.values()), seen


async def test_claude_code_asks_the_user_through_uibus_mcp(claude: tuple[App, ScriptedModel]) -> None:
    """uibus offered its /mcp in session/new; the scripted model calls its ask_user tool. Claude Code
    first asks permission to use the MCP tool (a dialog), then the tool opens the question (a second
    dialog); both are answered at the session's UI and the answer reaches the model."""
    app, model = claude
    model.script(Say("Let me ask.", tool=("mcp__uibus__ask_user", {"title": "Deploy to which cluster?",
                                                                   "kind": "select", "options": ["staging", "prod"]})),
                 Say("Deploying to staging."))
    async with Connection(f"127.0.0.1:{app.port}", session="ccmcp") as conn:
        (ui,) = await open_uis(app, conn, 1, "ccmcp")
        call = asyncio.ensure_future(claude_chat(conn, "deploy it"))
        dialogs = []
        while True:
            event = await read(ui, 60)
            if event.WhichOneof("event") != "request" or event.request.WhichOneof("method") != "select":
                continue
            dialogs.append(event.request)
            if event.request.select.title == "Deploy to which cluster?":
                await ext(conn).Respond(pb.RespondRequest(id=event.request.id, value="staging"))
                break
            await ext(conn).Respond(pb.RespondRequest(id=event.request.id, value="Allow"))  # the tool's permission
        final = (await asyncio.wait_for(call, 60))[-1].response.text
        assert [(d.select.title, list(d.select.options)) for d in dialogs] == [
            ("mcp__uibus__ask_user", ["Always Allow", "Allow", "Reject"]),
            ("Deploy to which cluster?", ["staging", "prod"])]
        assert final.endswith("Deploying to staging.")
        result = json.dumps(model.requests[1]["messages"][-1])  # the tool result the model was given
        assert "staging" in result


async def test_a_permission_answered_from_ext_ui_stdio(acp_app: App) -> None:
    """The stdio UI (`uibus ext-ui-stdio`) shows the agent's permission request as a select of its option names; the
    name typed back is the optionId the agent gets."""
    before = acp_app.bus.count(kinds.EXTENSION_UI, "stdio")
    bridge = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "clients.cli", "ext-ui-stdio", "--target", f"127.0.0.1:{acp_app.port}",
        "--session", "stdio", cwd=REPO, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert bridge.stdin is not None and bridge.stdout is not None
    try:
        await wait_for(lambda: acp_app.bus.count(kinds.EXTENSION_UI, "stdio") == before + 1, timeout=30,
                       what="the bridge to subscribe")
        async with Connection(f"127.0.0.1:{acp_app.port}", session="stdio") as conn:
            call = asyncio.ensure_future(chat(conn, "tour"))
            line = json.loads(await asyncio.wait_for(bridge.stdout.readline(), 30))
            assert {k: line[k] for k in ("type", "method", "title", "options")} == {
                "type": "extension_ui_request", "method": "select", "title": "rm -rf build",
                "options": ["Always Allow", "Allow", "Reject"]}
            bridge.stdin.write(json.dumps({"type": "extension_ui_response", "id": line["id"],
                                           "value": "Allow"}).encode() + b"\n")
            await bridge.stdin.drain()
            assert (await asyncio.wait_for(call, 30))[-1].response.text == "Permission: allow."
    finally:
        if bridge.returncode is None:
            bridge.kill()
            await bridge.wait()


async def test_a_permission_answered_by_a_click_on_the_page(acp_app: App, browser: Any, tmp_path: Path) -> None:
    """The browser page: the permission as buttons, clicked; the agent's reasoning, plan, tools,
    command output and reply rendered (screenshot: acp-agent.png)."""
    page = await chat_on_page(browser, acp_app.http_port, "acppage", "acp", "tour", height=1100)
    try:
        dialog = '.dialog[data-kind="select"]'
        await page.wait_for_selector(dialog, timeout=30_000)
        assert "rm -rf build" in (await page.text_content(dialog) or "")
        await page.click(f'{dialog} button:text("Always Allow")')
        await page.wait_for_function("() => document.querySelector('.msg.agent.done .text')?.textContent"
                                     ".includes('Permission: allow-always.')", timeout=30_000)
        assert await page.text_content('[data-say="command"] pre.command code') == "rm -rf build"
        await page.wait_for_function("() => document.querySelector('[data-say=\"command_output\"] pre.output')"
                                     "?.textContent === 'removing build\\nremoved\\n'", timeout=5000)
        assert await page.text_content('[data-say="reasoning"] details .text') == "I should clean the build."
        assert await page.text_content('[data-say="tool"] .tool-name') == "readFile"
        assert "Remove the cache" in (await page.text_content('[data-say="info"]') or "")
        await page.click('[data-say="reasoning"] summary')
        await page.screenshot(path=str(shots(tmp_path) / "acp-agent.png"), full_page=True)
    finally:
        await page.close()



def test_the_example_acp_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/acp-agents.toml as docs/hosting/acp-agents.md gives it, claude-code-acp found on PATH
    (as after `npm i -g`)."""
    from uibus.agents.config import load_agents

    require("Claude Code's ACP adapter (npm ci --prefix tests/acp)", CLAUDE_ACP.exists(), "node")
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PATH", f"{CLAUDE_ACP.parent}{os.pathsep}{os.environ['PATH']}")
    table = load_agents(str(REPO / "examples" / "acp-agents.toml"))
    assert [(s.name, s.backend) for s in table.specs.values()] == [("claude", "acp"), ("gemini", "acp"),
                                                                   ("codex", "acp")]
    assert table.backends["claude"].options.max_processes == 16  # type: ignore[attr-defined]


# ---- Gemini CLI's ACP mode and Codex's ACP adapter, unmodified, on scripted APIs ----

GEMINI = ACP_DIR / "node_modules" / ".bin" / "gemini"
CODEX = ACP_DIR / "node_modules" / "@zed-industries" / "codex-acp-linux-x64" / "bin" / "codex-acp"


def gemini_agent(tmp_path: Path, model: ScriptedModel) -> dict[str, Any]:
    home = tmp_path / "gemini-home"
    (home / ".gemini").mkdir(parents=True, exist_ok=True)
    (home / ".gemini" / "settings.json").write_text(json.dumps({"privacy": {"usageStatisticsEnabled": False}}))
    (tmp_path / "work").mkdir(exist_ok=True)
    return {"name": "gemini", "backend": "acp", "options": {
        "command": [str(GEMINI), "--acp", "--model", "gemini-2.5-flash"], "cwd": str(tmp_path / "work"),
        "start_timeout_seconds": 60, "env": {
            "HOME": str(home), "GEMINI_API_KEY": "scripted-key", "GOOGLE_GEMINI_BASE_URL": model.url,
            "GEMINI_CLI_NO_RELAUNCH": "true"}}}


def codex_agent(tmp_path: Path, model: ScriptedModel) -> dict[str, Any]:
    home = tmp_path / "codex-home"
    home.mkdir(exist_ok=True)
    # Codex reads its provider from CODEX_HOME/config.toml (OPENAI_BASE_URL alone is not used). No
    # sandbox: Linux sandboxing needs bubblewrap, which this machine lacks; `untrusted` still asks
    # permission for every command that is not known to be safe.
    (home / "config.toml").write_text(
        'model = "gpt-5.4"\nmodel_provider = "scripted"\nsandbox_mode = "danger-full-access"\n'
        'approval_policy = "untrusted"\n[model_providers.scripted]\nname = "Scripted"\n'
        f'base_url = "{model.url}/v1"\nwire_api = "responses"\nrequest_max_retries = 0\nstream_max_retries = 0\n')
    (tmp_path / "work").mkdir(exist_ok=True)
    return {"name": "codex", "backend": "acp", "options": {
        "command": [str(CODEX)], "cwd": str(tmp_path / "work"), "start_timeout_seconds": 60,
        "env": {"HOME": str(home), "CODEX_HOME": str(home)}}}


async def test_gemini_cli_answers_and_a_shell_permission_is_rejected_at_a_ui(config: Config, tmp_path: Path) -> None:
    require("Gemini CLI (npm ci --prefix tests/acp)", GEMINI.exists(), "node")
    victim = tmp_path / "work" / "build"
    victim.mkdir(parents=True)
    async with gemini_model() as model, \
            hosting(config, tmp_path, [gemini_agent(tmp_path, model)], http_port=free_port()) as app, \
            Connection(f"127.0.0.1:{app.port}", session="gem") as conn:
        model.script(Say("Hello from Gemini, scripted."),
                     Say(tool=("run_shell_command", {"command": "rm -rf build", "description": "Remove build"})),
                     Say("I left the build directory alone."))
        assert (await turn_of(conn, "gemini", "hi"))[-1].response.text == "Hello from Gemini, scripted."
        (ui,) = await open_uis(app, conn, 1, "gem")
        call = asyncio.ensure_future(turn_of(conn, "gemini", "clean the build", maximal=True))
        asked = (await read(ui, 60)).request
        assert (asked.select.title, list(asked.select.options)) == (
            "rm -rf build", ["Allow for this session", "Allow", "Reject"])
        await ext(conn).Respond(pb.RespondRequest(id=asked.id, value="Reject"))
        final = (await asyncio.wait_for(call, 60))[-1].response.text
        assert final.endswith("I left the build directory alone.") and victim.is_dir()
        assert "canceled by the user" in json.dumps(model.requests[-1]["contents"][-1])


async def test_codex_answers_and_a_command_permission_is_rejected_at_a_ui(config: Config, tmp_path: Path) -> None:
    require("codex-acp with its linux-x64 binary (npm ci --prefix tests/acp)", CODEX.exists(), "node")
    victim = tmp_path / "work" / "build"
    victim.mkdir(parents=True)
    async with responses_model() as model, \
            hosting(config, tmp_path, [codex_agent(tmp_path, model)], http_port=free_port()) as app, \
            Connection(f"127.0.0.1:{app.port}", session="codex") as conn:
        model.script(Say("Hello from Codex, scripted."), Say("I will remove it.", tool=("exec_command",
                                                                                       {"cmd": "rm -rf build"})))
        assert (await turn_of(conn, "codex", "hi"))[-1].response.text == "Hello from Codex, scripted."
        (ui,) = await open_uis(app, conn, 1, "codex")
        call = asyncio.ensure_future(turn_of(conn, "codex", "clean the build", maximal=True))
        asked = (await read(ui, 60)).request
        assert asked.select.title == "rm -rf build"
        assert asked.select.options[0] == "Yes, proceed" and asked.select.options[-1].startswith("No, and tell Codex")
        await ext(conn).Respond(pb.RespondRequest(id=asked.id, value=asked.select.options[-1]))
        final = (await asyncio.wait_for(call, 60))[-1].response.text  # a rejected command ends the turn
        assert final == "I will remove it." and victim.is_dir() and len(model.requests) == 2

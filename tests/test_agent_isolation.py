"""Agents in rooms of their own (docs/hosting/isolation.md): no keys of uibus's, the bubblewrap sandbox, homes per
tenant, the /mcp token minted per agent session.

Real parts throughout: the real pi and the real claude-code-acp, each driven by a scripted model
(tests/pikit.py, tests/scripted_models.py) that asks it to run shell commands hunting for uibus's
tokens — as a model steered by a hostile prompt would — real bwrap, real uibus with a tokens file
of two tenants and an all-sessions token in its own environment (`UIBUS_AUTH_TOKEN`). What the
agent's commands printed comes back to the model as the tool's result: that is what is searched.
The tokens file and the store lie inside the agent's own working directory on purpose (an
operator running uibus from a checkout), so the sandbox's masks are what keeps them out.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from tests.chatkit import Agent, request
from tests.conftest import REPO, free_port, require, start_app
from tests.ext_ui_helpers import ext, open_uis, read
from tests.pikit import PI, PI_DIR, Model, Reply, pi_agent, scripted_model
from tests.redisproc import RedisProcess, redis_server
from tests.scripted_models import Say, ScriptedModel, claude_model
from uibus.agents.config import load_agents
from uibus.agents.launcher import agent_env
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config, InvalidConfig
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2, sessions_pb2_grpc

pytestmark = [pytest.mark.timeout(180), pytest.mark.node]
__all__ = ["redis_server"]  # the fixture

TOKEN_A = "tokA-5be1c07a9d2f4e61b3c8aa70"
TOKEN_B = "tokB-0c9e44d1a8b7f2e5d6c3bb81"
OPERATOR = "tokOP-93d2f1e0c4b5a6978e7fcc92"
SECRETS = (TOKEN_A, TOKEN_B, OPERATOR)
FIXTURE = REPO / "tests" / "acp" / "fixture-agent.mjs"
CLAUDE_ACP = REPO / "tests" / "acp" / "node_modules" / ".bin" / "claude-code-acp"
HUNT = ("env; echo ---proc; for f in /proc/*/environ; do tr '\\0' '\\n' < $f; done 2>/dev/null; ls /proc; "
        "echo ---files; cat {tokens} {store}; echo ---end")


def bwrap() -> str:
    path = shutil.which("bwrap")
    require("bubblewrap (bwrap: .ci/setup --system installs it)", path is not None)
    return path  # type: ignore[return-value]


def leaked(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def tenancy(tmp_path: Path, config: Config, monkeypatch: pytest.MonkeyPatch,
            named: bool = False) -> tuple[Config, Path, Path]:
    """uibus as the issue's new user set it up: two tenants (`named`: their lines name them), an
    all-sessions token in its own environment too; the tokens file and the store inside the
    agents' working directory."""
    work = tmp_path / "work"
    (work / ".uibus").mkdir(parents=True, exist_ok=True)
    tokens = work / "tokens.txt"
    a, b = ("(team-a) ", "(team-b) ") if named else ("", "")
    tokens.write_text(f"{TOKEN_A} {a}team-a-*\n{TOKEN_B} {b}team-b-*\n")
    store = work / ".uibus" / "uibus.db"
    monkeypatch.setenv("UIBUS_AUTH_TOKEN", OPERATOR)
    monkeypatch.setenv("UIBUS_REDIS_URL", f"redis://:{OPERATOR}@127.0.0.1:1/0")
    return replace(config, tokens_file=str(tokens), auth_token=OPERATOR, store=str(store)), tokens, store


def agents_file(tmp_path: Path, agents: list[dict[str, Any]]) -> str:
    path = tmp_path / "agents.json"
    path.write_text(json.dumps({"workspaces_dir": str(tmp_path / "ws"), "agents": agents}))
    return str(path)


@pytest.fixture
async def model() -> AsyncIterator[Model]:
    async with scripted_model() as m:
        yield m


def sandboxed_pi(tmp_path: Path, model: Model, **options: Any) -> dict[str, Any]:
    """pi as tests/pikit.py hosts it, its test extensions shown read-only in its sandbox; its own
    network ("outbound", the default) reaches the scripted model on the host's loopback by
    `loopback_ports` (tests/test_agent_network.py tests the network itself)."""
    return pi_agent(tmp_path, model, sandbox=True, bwrap=bwrap(), loopback_ports=[model.port],
                    read_only=[str(PI_DIR), str(REPO / "examples" / "pi")], **options)


@pytest.fixture
async def hosted(tmp_path: Path) -> AsyncIterator[list[App]]:
    apps: list[App] = []
    yield apps
    for app in apps:
        await app.aclose()
        assert app.core.agent_sessions.count() == 0
        assert app.tokens.minted == 0  # every minted token went with its agent session


async def pi_turn(app: App, session: str, token: str, text: str = "go") -> str:
    async with Connection(f"127.0.0.1:{app.port}", session=session, token=token) as conn:
        responses = [r async for r in Agent(conn, "pi").StreamingChat(request(text))]
    return responses[-1].response.text


def tool_results(model: Model | ScriptedModel) -> str:
    return "\n".join(json.dumps(r) for r in model.requests)


# ---- no keys, ever: the environment ---------------------------------------------------------------


def test_the_environment_is_an_allow_list() -> None:
    environ = {"PATH": "/usr/bin", "HOME": "/h", "LANG": "C.UTF-8", "LC_ALL": "C", "TERM": "xterm",
               "UIBUS_AUTH_TOKEN": "x", "REDIS_URL": "redis://:pw@h", "OTEL_EXPORTER_OTLP_HEADERS": "a=b",
               "UIBUS_TLS_KEY": "/k", "AWS_SECRET_ACCESS_KEY": "s", "ANTHROPIC_API_KEY": "k"}
    assert agent_env([], {}, environ) == {"PATH": "/usr/bin", "HOME": "/h", "LANG": "C.UTF-8", "LC_ALL": "C",
                                          "TERM": "xterm"}
    got = agent_env(["ANTHROPIC_API_KEY"], {"HOME": "/agent"}, environ)
    assert got["ANTHROPIC_API_KEY"] == "k" and got["HOME"] == "/agent" and "AWS_SECRET_ACCESS_KEY" not in got


@pytest.mark.parametrize("name", ["UIBUS_AUTH_TOKEN", "REDIS_URL", "OTEL_EXPORTER_OTLP_HEADERS", "UIBUS_TLS_KEY"])
def test_uibus_own_variables_cannot_be_inherited(tmp_path: Path, name: str) -> None:
    path = agents_file(tmp_path, [{"name": "a", "backend": "rpc",
                                   "options": {"command": ["/bin/cat"], "inherit_env": [name]}}])
    with pytest.raises(InvalidConfig, match=f"option inherit_env: {name} belong"):
        load_agents(path)


def test_sandbox_options_are_checked(tmp_path: Path) -> None:
    path = agents_file(tmp_path, [{"name": "a", "backend": "rpc", "options": {"command": ["/bin/cat"],
                                                                                "network": False}}])
    with pytest.raises(InvalidConfig, match="option network needs sandbox = true"):
        load_agents(path)
    path = agents_file(tmp_path, [{"name": "a", "backend": "rpc", "options": {"command": ["/bin/cat"],
                                                                                "sandbox": True}}])
    with pytest.raises(InvalidConfig, match="option sandbox = true needs option cwd"):
        load_agents(path)


def test_a_sandbox_that_cannot_start_stops_serve_with_one_line(tmp_path: Path) -> None:
    path = agents_file(tmp_path, [{"name": "a", "backend": "rpc", "options": {
        "command": ["/bin/cat"], "cwd": str(tmp_path), "sandbox": True, "bwrap": str(tmp_path / "no-bwrap")}}])
    env = {k: v for k, v in os.environ.items() if not k.startswith("UIBUS_")}
    done = subprocess.run([sys.executable, "-m", "uibus", "serve", "--agents", path, "--port", "0",
                           "--store", ":memory:"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "option sandbox = true cannot start here" in lines[0] and "no-bwrap" in lines[0], lines


@pytest.mark.parametrize("sandbox", [False, True], ids=["plain", "sandbox"])
async def test_pi_hunting_for_tokens_finds_none(config: Config, tmp_path: Path, model: Model,
                                                monkeypatch: pytest.MonkeyPatch, hosted: list[App],
                                                sandbox: bool) -> None:
    cfg, tokens, store = tenancy(tmp_path, config, monkeypatch)
    entry = sandboxed_pi(tmp_path, model) if sandbox else pi_agent(tmp_path, model)
    # without a sandbox, what uibus hands over: the environment and the open files pi (bash's parent)
    # got (a descriptor uibus leaked would be there: its store is open the whole time)
    hunt = HUNT.format(tokens=tokens, store=store) if sandbox else "env; ls -l /proc/$PPID/fd/ /proc/self/fd/"
    model.script(Reply(tool=("bash", {"command": hunt})), Reply(text="Nothing found."))
    app = await start_app(replace(cfg, agents=agents_file(tmp_path, [entry])))
    hosted.append(app)
    assert await pi_turn(app, "team-a-1", TOKEN_A) == "Nothing found."
    seen = json.dumps(model.requests[1]["messages"][-1])
    assert "PATH=" in seen and "HOME=" in seen  # the command ran and its output came back
    assert leaked(seen) == [] and "UIBUS_" not in seen and "redis://" not in seen
    if not sandbox:
        assert "pipe:" in seen and store.name not in seen and tokens.name not in seen
    if sandbox:
        assert "---files" in seen and "---end" in seen
        procs = [w for w in seen.split("---proc")[1].split("---files")[0].split("\\n") if w.isdigit()]
        assert len(procs) < 10, procs  # its own /proc: the sandbox's few processes, not the host's


async def test_claude_code_hunting_for_tokens_finds_none(config: Config, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, hosted: list[App]) -> None:
    require("Claude Code's ACP adapter (npm ci --prefix tests/acp)", CLAUDE_ACP.exists(), "node")
    from tests.test_acp_agent import claude_agent

    cfg, tokens, store = tenancy(tmp_path, config, monkeypatch)
    async with claude_model() as model:
        plain = claude_agent(tmp_path, model)
        boxed = {**claude_agent(tmp_path, model), "name": "boxed"}
        boxed["options"] = {**boxed["options"], "sandbox": True, "bwrap": bwrap(), "loopback_ports": [model.port]}
        app = await start_app(replace(cfg, agents=agents_file(tmp_path, [plain, boxed]), http_port=free_port()))
        hosted.append(app)
        for agent, command in (("claude", "env"), ("boxed", HUNT.format(tokens=tokens, store=store))):
            model.replies.clear()  # Claude Code's own side requests (a command's prefix, …) take some
            model.script(Say("Looking.", tool=("Bash", {"command": command, "description": "look"})),
                         *[Say("Done.")] * 4)
            before = len(model.requests)
            session = f"team-a-{agent}"
            async with Connection(f"127.0.0.1:{app.port}", session=session, token=TOKEN_A) as conn:
                (ui,) = await open_uis(app, conn, 1, session)
                call = asyncio.ensure_future(_collect(Agent(conn, agent).StreamingChat(request("look around"))))
                while not call.done():
                    event = await read(ui, 60)
                    if event.WhichOneof("event") == "request" and event.request.WhichOneof("method") == "select":
                        await ext(conn).Respond(pb.RespondRequest(id=event.request.id, value="Allow"))
                        break
                await asyncio.wait_for(call, 60)
            seen = json.dumps(model.requests[before:])
            assert "tool_result" in seen and "PATH=" in seen, seen[-2000:]
            assert leaked(seen) == [] and "UIBUS_" not in seen and "redis://" not in seen
            if agent == "boxed":
                assert "---end" in seen


async def _collect(call: Any) -> list[Any]:
    return [r async for r in call]


# ---- the /mcp token offered to an ACP agent -------------------------------------------------------


async def test_the_offered_mcp_token_reaches_its_own_session_only_and_dies_with_it(
        config: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hosted: list[App]) -> None:
    node = require_node()
    cfg, _, _ = tenancy(tmp_path, config, monkeypatch)
    log = tmp_path / "acp.log"
    entry = {"name": "acp", "backend": "acp", "options": {
        "command": [node, str(FIXTURE)], "cwd": str(tmp_path / "work"), "env": {"ACP_FIXTURE_LOG": str(log)}}}
    app = await start_app(replace(cfg, agents=agents_file(tmp_path, [entry]), http_port=free_port()))
    hosted.append(app)
    target = f"127.0.0.1:{app.port}"
    for session, token in (("team-a-1", TOKEN_A), ("team-a-2", TOKEN_A), ("team-b-1", TOKEN_B)):
        async with Connection(target, session=session, token=token) as conn:
            assert (await _collect(Agent(conn, "acp").StreamingChat(request("hi"))))[-1].response.text == "Turn 1: hi"
    offered = [e["session/new"]["mcpServers"][0]["headers"] for e in map(json.loads, log.read_text().splitlines())
               if "session/new" in e]
    assert len(offered) == 3
    first = {h["name"]: h["value"] for h in offered[0]}
    assert first["x-uibus-session"] == "team-a-1"
    minted = first["authorization"].removeprefix("Bearer ")
    assert minted not in SECRETS and leaked(json.dumps(offered)) == []
    assert len({h["value"] for o in offered for h in o if h["name"] == "authorization"}) == 3  # one each

    async with grpc.aio.insecure_channel(target) as ch:
        api = sessions_pb2_grpc.SessionServiceStub(ch)

        def auth(session: str | None = None) -> tuple[tuple[str, str], ...]:
            meta = (("authorization", f"Bearer {minted}"),)
            return (*meta, ("x-uibus-session", session)) if session else meta

        listed = await api.ListSessions(sessions_pb2.ListSessionsRequest(), metadata=auth())
        assert [s.session for s in listed.sessions] == ["team-a-1"]  # not team-a-2, not team-b-1
        for other in ("team-a-2", "team-b-1"):
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await api.DeleteSession(sessions_pb2.DeleteSessionRequest(), metadata=auth(other))
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        mcp = await _mcp_list_sessions(app, minted, "team-a-1")
        assert "team-a-1" in mcp and "team-a-2" not in mcp and "team-b-1" not in mcp
        for other in ("team-a-2", "team-b-1"):  # /mcp naming another session: refused at the door
            assert (await _mcp_initialize(app, minted, other)).status_code == 403
        await _web_doors_see_one_session(app, minted, "team-a-1", ("team-a-2", "team-b-1"))

        # its agent session ends (the session is deleted by its tenant): the token stops working
        await api.DeleteSession(sessions_pb2.DeleteSessionRequest(),
                                metadata=(("authorization", f"Bearer {TOKEN_A}"), ("x-uibus-session", "team-a-1")))
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await api.ListSessions(sessions_pb2.ListSessionsRequest(), metadata=auth())
        assert gone.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await _web_doors_see_one_session(app, minted, "", ())  # the HTTP API and gRPC-Web refuse it too
    assert (await _mcp_initialize(app, minted, "team-a-1")).status_code == 401
    assert app.tokens.minted == 2


async def _web_doors_see_one_session(app: App, token: str, own: str, others: tuple[str, ...]) -> None:
    """The HTTP port's doors with a minted token: the sessions HTTP API and gRPC-Web list `own`
    alone and refuse `others` (403 / PERMISSION_DENIED); with `own` empty, the token is revoked
    and both answer 401 / UNAUTHENTICATED."""
    from tests.webclient import call

    base = f"http://127.0.0.1:{app.http_port}"
    bearer = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(timeout=10) as http:
        listed = await http.get(base + "/api/v1/sessions", headers=bearer)
        web = await call(http, base + "/uibus.v1.SessionService/ListSessions",
                         sessions_pb2.ListSessionsRequest().SerializeToString(), headers=bearer)
        if not own:
            assert listed.status_code == 401, listed.text
            assert web.status == grpc.StatusCode.UNAUTHENTICATED.value[0], web
            return
        assert listed.status_code == 200 and [s["session"] for s in listed.json()["sessions"]] == [own]
        assert web.status == 0 and [s.session for s in sessions_pb2.SessionList.FromString(
            web.messages[0]).sessions] == [own]
        for other in others:
            headers = {**bearer, "x-uibus-session": other}
            denied = await http.post(base + "/api/v1/sessions/DeleteSession", headers=headers)
            assert denied.status_code == 403 and denied.json()["code"] == "PERMISSION_DENIED", denied.text
            web = await call(http, base + "/uibus.v1.SessionService/DeleteSession",
                             sessions_pb2.DeleteSessionRequest().SerializeToString(), headers=headers)
            assert web.status == grpc.StatusCode.PERMISSION_DENIED.value[0], web


async def _mcp_initialize(app: App, token: str, session: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.post(f"http://127.0.0.1:{app.http_port}/mcp", json={
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {}}},
            headers={"authorization": f"Bearer {token}", "x-uibus-session": session,
                     "content-type": "application/json", "accept": "application/json, text/event-stream"})


def require_node() -> str:
    node = shutil.which("node")
    require("node", node is not None, "node")
    return node  # type: ignore[return-value]


async def _mcp_list_sessions(app: App, token: str, session: str) -> str:
    url = f"http://127.0.0.1:{app.http_port}/mcp"
    headers = {"authorization": f"Bearer {token}", "x-uibus-session": session, "content-type": "application/json",
               "accept": "application/json, text/event-stream"}
    async with httpx.AsyncClient(timeout=10) as http:
        init = await http.post(url, headers=headers, json={
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {}}})
        assert init.status_code == 200, init.text
        headers = {**headers, "mcp-session-id": init.headers["mcp-session-id"], "mcp-protocol-version": "2025-06-18"}
        done = await http.post(url, headers=headers, json={"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                                           "params": {"name": "list_sessions", "arguments": {}}})
        assert done.status_code == 200, done.text
        return done.text


# ---- homes per tenant, and nothing of uibus's ------------------------------------------------------


async def test_tenant_b_cannot_read_tenant_a_home_or_uibus_files(config: Config, tmp_path: Path, model: Model,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 hosted: list[App]) -> None:
    cfg, tokens, store = tenancy(tmp_path, config, monkeypatch)
    app = await start_app(replace(cfg, agents=agents_file(tmp_path, [sandboxed_pi(tmp_path, model)])))
    hosted.append(app)
    homes = tmp_path / "ws" / "homes"
    home_a = homes / app.tokens.tenant("team-a-1")
    assert app.tokens.tenant("team-a-1") == app.tokens.tenant("team-a-2") != app.tokens.tenant("team-b-1")
    model.script(Reply(tool=("bash", {"command": "echo A-PRIVATE-NOTE > ~/note.txt; cat ~/.pi/agent/models.json"})),
                 Reply(text="Written."))
    assert await pi_turn(app, "team-a-1", TOKEN_A) == "Written."
    assert (home_a / "note.txt").read_text() == "A-PRIVATE-NOTE\n"  # in A's own home, on the host
    assert "scripted-key" in json.dumps(model.requests[1]["messages"][-1])  # the operator's config, seen
    assert not (tmp_path / "pi-home" / "note.txt").exists()  # not in the operator's home

    pi_home = tmp_path / "pi-home"
    look = (f"cat ~/note.txt {home_a}/note.txt; ls -a {homes} {tmp_path} {tmp_path / 'ws'}; cat {tokens} {store}; "
            f"cat {tmp_path / 'agents.json'}; echo x >> ~/.pi/agent/models.json; echo ---end")
    model.script(Reply(tool=("bash", {"command": look})), Reply(text="Looked."))
    assert await pi_turn(app, "team-b-1", TOKEN_B) == "Looked."
    seen = json.dumps(model.requests[3]["messages"][-1])
    assert "---end" in seen
    assert "A-PRIVATE-NOTE" not in seen and leaked(seen) == [] and "workspaces_dir" not in seen
    assert "Read-only file system" in seen  # the operator's models.json
    assert json.loads((pi_home / ".pi" / "agent" / "models.json").read_text())["providers"]
    assert await pi_turn(app, "team-a-2", TOKEN_A, "again") == "(no scripted reply)"


async def test_a_sandboxed_pi_resumes_from_its_tenant_home_after_a_restart(config: Config, tmp_path: Path,
                                                                           model: Model,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, _, _ = tenancy(tmp_path, config, monkeypatch, named=True)
    entry = sandboxed_pi(tmp_path, model)
    entry["options"]["command"] = [a for a in entry["options"]["command"] if a != "--no-session"]
    cfg = replace(cfg, agents=agents_file(tmp_path, [entry]))
    model.script(Reply(text="First answer."), Reply(text="Second answer."))
    for turn, text in enumerate(("remember the word walnut", "which word?")):
        app = await start_app(cfg)
        try:
            assert await pi_turn(app, "team-a-1", TOKEN_A, text) == ("First answer.", "Second answer.")[turn]
            tenant = app.tokens.tenant("team-a-1")
        finally:
            await app.aclose()
    assert "remember the word walnut" in json.dumps(model.requests[1])  # the new process read the old conversation
    assert tenant == "team-a"  # the tokens file's name for it
    sessions = tmp_path / "ws" / "homes" / tenant / ".pi" / "agent" / "sessions"
    assert any(sessions.rglob("*.jsonl"))  # kept in the tenant's home
    assert not (tmp_path / "pi-home" / ".pi" / "agent" / "sessions").exists()


def test_pi_program_is_found(tmp_path: Path) -> None:
    """The sandbox shows the agent's installation: pi's node_modules (by both its names) and node's."""
    from uibus.agents.bubblewrap import installation_of

    require("pi (npm ci --prefix tests/pi)", PI.exists())
    found = installation_of(str(PI), os.environ.get("PATH", ""))
    assert os.path.realpath(PI_DIR / "node_modules") in found


# ---- codex runs its own sandbox inside ours -------------------------------------------------------


async def test_codex_runs_its_own_sandbox_inside_ours(config: Config, tmp_path: Path, hosted: list[App]) -> None:
    """Codex confines the commands it runs itself (sandbox_mode = "workspace-write": its own
    bubblewrap sandbox, through its `codex-linux-sandbox` helper); inside uibus's sandbox that
    still works — a nested sandbox needs only user namespaces of its own, holding no capability
    over ours. What codex-acp needs, sandbox or not: its helper on PATH (a link named
    codex-linux-sandbox to the codex-acp binary; its npm package ships none), shown read-only, and
    option nested_sandbox (without it, no user namespace can be made inside ours: see
    tests/test_sandbox_walls.py)."""
    from tests.scripted_models import responses_model
    from tests.test_acp_agent import CODEX, codex_agent

    require("codex-acp with its linux-x64 binary (npm ci --prefix tests/acp)", CODEX.exists(), "node")
    async with responses_model() as model:
        entry = codex_agent(tmp_path, model)
        home = tmp_path / "codex-home"
        config_toml = (home / "config.toml").read_text()
        (home / "config.toml").write_text(config_toml.replace('sandbox_mode = "danger-full-access"',
                                                              'sandbox_mode = "workspace-write"')
                                          .replace('approval_policy = "untrusted"', 'approval_policy = "never"'))
        helper = tmp_path / "codex-bin"
        helper.mkdir()
        (helper / "codex-linux-sandbox").symlink_to(CODEX)
        entry["options"]["env"]["PATH"] = f"{helper}:{os.environ['PATH']}"
        entry["options"].update(sandbox=True, bwrap=bwrap(), home_files=["config.toml"], read_only=[str(helper)],
                                nested_sandbox=True, loopback_ports=[model.port])
        app = await start_app(replace(config, agents=agents_file(tmp_path, [entry]), http_port=free_port()))
        hosted.append(app)
        model.script(Say("Writing.", tool=("exec_command", {"cmd": "echo inner > inner.txt; cat inner.txt; "
                                                                    "touch /var/tmp/escape.txt; echo touched=$?"})),
                     Say("Written."))
        async with Connection(f"127.0.0.1:{app.port}", session="codex") as conn:
            final = (await _collect(Agent(conn, "codex").StreamingChat(request("write it"))))[-1].response.text
        (output,) = [i["output"] for i in model.requests[-1]["input"] if i.get("type") == "function_call_output"]
        assert final.endswith("Written.") and "inner" in output, output
        assert (tmp_path / "work" / "inner.txt").read_text() == "inner\n"  # codex's sandbox: cwd writable
        # /var/tmp is writable in uibus's sandbox (a tmpfs of its own), not in codex's
        assert "Read-only file system" in output and "touched=1" in output, output


async def test_a_sandboxed_agent_commits_in_its_git_worktree(config: Config, tmp_path: Path, model: Model,
                                                             hosted: list[App]) -> None:
    """The working directory is a `git worktree` of a repository elsewhere: the sandbox binds the
    repository's common .git too (git writes objects and refs there), not its checkout."""
    git = shutil.which("git")
    require("git", git is not None)
    repo, tree = tmp_path / "repo", tmp_path / "tree"
    repo.mkdir()
    who = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    run = {"check": True, "capture_output": True, "env": {**os.environ, **who}}
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], **run)  # type: ignore[call-overload]
    (repo / "checkout-only.txt").write_text("in the main checkout\n")
    subprocess.run(["git", "-C", str(repo), "add", "."], **run)  # type: ignore[call-overload]
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", "base"], **run)  # type: ignore[call-overload]
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "-q", "-b", "uibus/s1", str(tree)],
                   **run)  # type: ignore[call-overload]
    entry = sandboxed_pi(tmp_path, model)
    entry["options"]["cwd"] = str(tree)
    entry["options"]["env"].update(GIT_AUTHOR_NAME="agent", GIT_AUTHOR_EMAIL="a@a", GIT_COMMITTER_NAME="agent",
                                   GIT_COMMITTER_EMAIL="a@a")
    command = (f"echo work > note.txt && git add note.txt && git commit -qm 'by the agent' && echo committed; "
               f"cat {repo}/checkout-only.txt; echo ---end")
    model.script(Reply(tool=("bash", {"command": command})), Reply(text="Done."))
    app = await start_app(replace(config, agents=agents_file(tmp_path, [entry])))
    hosted.append(app)
    assert await pi_turn(app, "s1", "") == "Done."
    seen = json.dumps(model.requests[1]["messages"][-1])
    assert "committed" in seen and "---end" in seen and "in the main checkout" not in seen, seen
    log = subprocess.run(["git", "-C", str(repo), "log", "--format=%s", "uibus/s1"], **run)  # type: ignore[call-overload]
    assert log.stdout.decode().splitlines()[0] == "by the agent"
    assert not (repo / "note.txt").exists()


async def test_a_sandboxed_claude_code_resumes_from_its_tenant_home_after_a_restart(
        config: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require("Claude Code's ACP adapter (npm ci --prefix tests/acp)", CLAUDE_ACP.exists(), "node")
    from tests.test_acp_agent import claude_agent

    cfg, _, _ = tenancy(tmp_path, config, monkeypatch)
    async with claude_model() as model:
        entry = claude_agent(tmp_path, model)
        entry["options"].update(sandbox=True, bwrap=bwrap(), loopback_ports=[model.port])
        cfg = replace(cfg, agents=agents_file(tmp_path, [entry]), http_port=free_port())
        model.script(Say("Noted: walnut."), Say("The word was walnut."))
        for text, answer in (("remember walnut", "Noted: walnut."), ("which word?", "The word was walnut.")):
            app = await start_app(cfg)
            try:
                async with Connection(f"127.0.0.1:{app.port}", session="team-a-cc", token=TOKEN_A) as conn:
                    responses = await _collect(Agent(conn, "claude").StreamingChat(request(text)))
                assert responses[-1].response.text == answer
                tenant = app.tokens.tenant("team-a-cc")
            finally:
                await app.aclose()
            assert app.tokens.minted == 0
        seen = json.dumps(model.requests[-1]["messages"])
        assert "remember walnut" in seen and "Noted: walnut." in seen  # the conversation came back
        assert any((tmp_path / "ws" / "homes" / tenant / ".claude" / "projects").rglob("*.jsonl"))
        assert not (tmp_path / "claude-home" / ".claude" / "projects").exists()  # not the operator's home


def test_tenants_are_named_by_their_tokens(tmp_path: Path) -> None:
    from uibus.infra.auth import Tokens

    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN_A} team-a-*\n{TOKEN_B} team-b-* shared-*\nadmin *\n")
    tokens = Tokens(OPERATOR, str(path))
    a, b = tokens.tenant("team-a-1"), tokens.tenant("team-b-1")
    assert a == tokens.tenant("team-a-2") and a != b and a.startswith("t-") and TOKEN_A not in a
    assert tokens.tenant("elsewhere") == "operator"  # only `*` tokens reach it
    path.write_text(f"# moved\n{TOKEN_B} team-b-* shared-*\n\n{TOKEN_A} team-a-*\n")
    assert tokens.reload() and tokens.tenant("team-a-1") == a  # lines moved: the same tenant
    minted = tokens.mint("team-a-1", "pi")
    assert tokens.tenant("team-a-1") == a  # a minted token is no tenant
    grant = tokens.grant(minted.encode())
    assert grant is not None and grant.allows("team-a-1") and not grant.allows("team-a-2") and not grant.all_sessions
    assert grant.tenant == a  # an agent's calls are its session's tenant's (per-tenant quotas)
    tokens.revoke(minted)
    assert tokens.grant(minted.encode()) is None and tokens.minted == 0
    # callers' tenants: a lone unnamed token's digest is its session's tenant; the operator's is `operator`
    assert tokens.grant(TOKEN_A.encode()).tenant == a  # type: ignore[union-attr]
    assert tokens.grant(OPERATOR.encode()).tenant == "operator"  # type: ignore[union-attr]


def test_a_tenant_home_is_one_directory_named_after_its_tenant(tmp_path: Path) -> None:
    from uibus.agents.launcher import Launch, Sandbox

    homes = tmp_path / "homes"
    box = Sandbox(bwrap="/usr/bin/bwrap", homes_dir=str(homes))

    def home(tenant: str) -> str | None:
        return Launch(agent="a", session="s", tenant=tenant, argv=("x",), cwd=None, env={"HOME": "/h"},
                      sandbox=box).tenant_home()

    assert home("team-a") == str(homes / "team-a") and home("") == str(homes / "operator")
    assert home("team-a+team-b") == str(homes / "team-a+team-b") != home("team-a_team-b")
    assert [Path(home(t)).parent for t in ("..", ".", "../x", "a/b")] == [homes] * 4  # type: ignore[arg-type]


def test_a_token_line_may_name_its_tenant_and_names_win(tmp_path: Path) -> None:
    from uibus.infra.auth import Tokens

    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN_A} team-a-*\n{TOKEN_B} team-b-*\n")
    tokens = Tokens(OPERATOR, str(path))
    before = tokens.tenant("team-a-1")
    # the same tokens, now named; team-a's token rotated: old and new one tenant, one home
    path.write_text(f"{TOKEN_A} (team-a) team-a-*\nnext-{TOKEN_A} team-a-* (team-a)\n{TOKEN_B} team-b-*\n")
    assert tokens.reload()
    assert tokens.tenant("team-a-1") == "team-a" != before
    assert tokens.grant(TOKEN_A.encode()).tenant == tokens.grant(f"next-{TOKEN_A}".encode()).tenant == "team-a"  # type: ignore[union-attr]
    assert tokens.grant(TOKEN_B.encode()).tenant == tokens.tenant("team-b-1")  # type: ignore[union-attr]
    assert tokens.tenant("team-b-1").startswith("t-")  # unnamed: the digest it always had
    assert tokens.grant(tokens.mint("team-a-1", "pi").encode()).tenant == "team-a"  # type: ignore[union-attr]
    path.write_text(f"{TOKEN_A} (team-a) team-*\n{TOKEN_B} (team-b) team-b-*\n")
    assert tokens.reload() and tokens.tenant("team-b-1") == "team-a+team-b"  # both may use it


async def test_network_false_leaves_only_a_loopback_of_its_own(tmp_path: Path) -> None:
    from uibus.agents.launcher import Launch, Sandbox
    from uibus.agents.local_launcher import LOCAL

    (tmp_path / "home").mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home")}
    seen = {}
    for network in (True, False):
        box = Sandbox(bwrap=bwrap(), network=network, homes_dir=str(tmp_path / "homes"))
        launch = Launch(agent="a", session="s", tenant="t", argv=("/bin/sh", "-c", "cat /proc/net/dev"),
                        cwd=str(tmp_path), env=env, sandbox=box)
        async with LOCAL.start(launch) as proc:  # (its watcher holds its output open: the group goes at the end)
            await asyncio.wait_for(proc.wait(), 30)
        assert proc.stdout is not None
        out = await asyncio.wait_for(proc.stdout.read(), 30)
        seen[network] = [line.split(":")[0].strip() for line in out.decode().splitlines() if ":" in line]
    assert seen[False] == ["lo"]
    assert len(seen[True]) > 1  # the host's interfaces


async def test_the_start_up_log_says_what_an_agent_inherits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("UIBUS_AUTH_TOKEN", OPERATOR)
    monkeypatch.setenv("MY_KEY", "k")
    caplog.set_level("INFO", logger="uibus.agents.stdio")
    path = agents_file(tmp_path, [{"name": "a", "backend": "rpc", "options": {
        "command": ["/bin/cat"], "inherit_env": ["MY_KEY"], "env": {"OWN": "1"}}}])
    await load_agents(path).aclose()
    (record,) = [r for r in caplog.records if r.getMessage() == "agent environment"]
    fields = record.fields  # type: ignore[attr-defined]
    assert "MY_KEY" in fields["inherits"] and "PATH" in fields["inherits"] and fields["sets"] == ["OWN"]
    assert not [n for n in fields["inherits"] if n.startswith("UIBUS_")] and fields["sandbox"] is False
    assert OPERATOR not in repr(fields)


@pytest.mark.redis
async def test_a_second_replica_resumes_a_sandboxed_pi_from_the_shared_tenant_home(
        tmp_path: Path, model: Model, redis_server: RedisProcess) -> None:
    """Two replicas on one Redis, one workspaces directory (a volume both mount): the conversation
    pi kept in its tenant's home on the first is picked up by the second."""
    entry = sandboxed_pi(tmp_path, model)
    entry["options"]["command"] = [a for a in entry["options"]["command"] if a != "--no-session"]
    path = agents_file(tmp_path, [entry])
    apps = [await start_app(Config(host="127.0.0.1", port=0, http_port=free_port(), store=str(tmp_path / f"{i}.db"),
                                   redis_url=redis_server.url, grace_seconds=1.0, agents=path, agent_lease_seconds=2.0))
            for i in range(2)]
    try:
        model.script(Reply(text="First answer."), Reply(text="Second answer."))
        assert await pi_turn(apps[0], "s", "", "remember the word walnut") == "First answer."
        await apps[0].aclose()
        assert await pi_turn(apps[1], "s", "", "which word?") == "Second answer."
        assert "remember the word walnut" in json.dumps(model.requests[1])  # resumed on the second replica
    finally:
        for app in apps:
            await app.aclose()


async def test_sandboxed_agents_in_worktrees_see_their_own_only(config: Config, tmp_path: Path, model: Model,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                hosted: list[App]) -> None:
    """`sandbox = true` with `workspace = "worktree"`: tenant A's agent writes and commits in its
    worktree; tenant B's agent, in its own, cannot read A's worktree, A's home, the main checkout
    or uibus's files by any absolute path, yet commits in its own."""
    from tests.test_workspaces import make_repo

    require("git", shutil.which("git") is not None)
    cfg, tokens, store = tenancy(tmp_path, config, monkeypatch)
    repo = make_repo(tmp_path)
    entry = sandboxed_pi(tmp_path, model, workspace="worktree")
    entry["options"]["cwd"] = str(repo)
    entry["options"]["env"].update(GIT_AUTHOR_NAME="agent", GIT_AUTHOR_EMAIL="a@a", GIT_COMMITTER_NAME="agent",
                                   GIT_COMMITTER_EMAIL="a@a")
    app = await start_app(replace(cfg, agents=agents_file(tmp_path, [entry])))
    hosted.append(app)
    model.script(Reply(tool=("bash", {"command": "echo A-SECRET > note.txt && git add note.txt && "
                                                 "git commit -qm 'by A' && echo committed && pwd"})),
                 Reply(text="A done."))
    assert await pi_turn(app, "team-a-1", TOKEN_A) == "A done."
    first = json.dumps(model.requests[1]["messages"][-1])
    assert "committed" in first, first
    (a_tree,) = [p for p in (tmp_path / "ws" / "sessions").rglob("note.txt")]
    home_a = tmp_path / "ws" / "homes" / app.tokens.tenant("team-a-1")
    look = (f"cat {a_tree} {repo}/README.md {home_a}/.tmp/x; ls {tmp_path / 'ws' / 'sessions'}; cat {tokens} {store}; "
            "echo B > mine.txt && git add mine.txt && git commit -qm 'by B' && echo committed-b; echo ---end")
    model.script(Reply(tool=("bash", {"command": look})), Reply(text="B done."))
    assert await pi_turn(app, "team-b-1", TOKEN_B) == "B done."
    seen = json.dumps(model.requests[3]["messages"][-1])
    assert "---end" in seen and "committed-b" in seen, seen
    assert "A-SECRET" not in seen and "# the project" not in seen and leaked(seen) == [] and "No such file" in seen
    assert not (repo / "note.txt").exists() and not (repo / "mine.txt").exists()  # the checkout untouched

    # B's repository is its own: it may write its config, hooks and attributes. It plants what would
    # make uibus's own git (summary, diff, export) run code as uibus, outside any sandbox — an
    # fsmonitor, a filter its attributes name, a hook, an external diff — each touching a file only
    # uibus could write. uibus reads B's workspace all the same, and runs none of it.
    pwned = tmp_path / "pwned"
    touch = f"touch {pwned}"
    plant = (f"git config core.fsmonitor '{touch}' && git config filter.x.clean '{touch}; cat' && "
             f"git config filter.x.smudge '{touch}; cat' && git config diff.x.textconv '{touch}; cat' && "
             f"git config diff.external '{touch}' && echo '* filter=x diff=x' > .gitattributes && "
             f"mkdir -p .git/hooks && printf '#!/bin/sh\\n{touch}\\n' > .git/hooks/post-index-change && "
             "chmod +x .git/hooks/post-index-change && echo B2 > more.txt && git add more.txt && "
             "git commit -qm 'by B again' && echo committed-again; echo ---end")
    model.script(Reply(tool=("bash", {"command": plant})), Reply(text="Planted."))
    assert await pi_turn(app, "team-b-1", TOKEN_B, "plant") == "Planted."
    seen = json.dumps(model.requests[5]["messages"][-1])
    assert "---end" in seen and "committed-again" in seen, seen
    listed = await _web_summary(app, TOKEN_B)  # uibus reads B's workspace: git still sees it whole
    assert "commits: 2" in listed, listed
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
        diff = await sessions_pb2_grpc.SessionServiceStub(ch).GetWorkspaceDiff(
            sessions_pb2.AgentRequest(agent="pi"), metadata=(("authorization", f"Bearer {TOKEN_B}"),
                                                             ("x-uibus-session", "team-b-1")))
    # (the agent's own git ran its fsmonitor in its sandbox: `touch` made files there, not `pwned`)
    assert {"mine.txt", "more.txt", ".gitattributes"} <= {f.path for f in diff.files}, diff.files
    assert "+B2" in diff.diff and not pwned.exists()
    assert "fsmonitor" not in (repo / ".git" / "config").read_text()  # the base repository untouched


async def _web_summary(app: App, token: str) -> str:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
        listed = await sessions_pb2_grpc.SessionServiceStub(ch).ListSessions(
            sessions_pb2.ListSessionsRequest(), metadata=(("authorization", f"Bearer {token}"),))
    return str(listed)

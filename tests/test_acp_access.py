"""ACP 1.7's access surface, both directions, with the official TypeScript SDK unmodified
(tests/acp/editor.mjs as the editor, tests/acp/fixture-agent.mjs as the hosted agent) against real
uibus servers on loopback:

* as the agent editors attach to: `additionalDirectories` on session/new, load and resume (only
  what the hosted agent's configuration shows it; refused -32602 naming the directory and the rule),
  `logout` (the connection's sign-in ends: auth_required after), `auth/status` (the connection's
  state and tenant), and their capabilities in `initialize`;
* as the host of an ACP agent: the editor's directories reach the agent by `session/resume` of the
  open session when it advertises them; a symbolic link out of the allowed roots is refused on the
  agent's side; an agent that needs a terminal sign-in is never run with its login arguments, the
  turn says what the operator configured instead, and uibus never sends it `logout`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.acpkit import need, prompt
from tests.conftest import free_port
from tests.pikit import hosting, turn_of
from tests.test_acp_agent import fixture_agent, fixture_log
from tests.test_acp_serve import UIBUS, EditorProc, editor
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config

pytestmark = [pytest.mark.timeout(120), pytest.mark.node]
SDK = "@agentclientprotocol/sdk"


def roots_agent(tmp_path: Path, name: str = "roots", **env: str) -> dict[str, Any]:
    spec = fixture_agent(tmp_path, name)
    spec["options"]["env"].update({"ACP_FIXTURE_ROOTS": "1", **env})
    return spec


@pytest.fixture
async def app(config: Config, tmp_path: Path) -> AsyncIterator[App]:
    need(SDK)
    (tmp_path / "work" / "lib").mkdir(parents=True)
    (tmp_path / "work" / "docs").mkdir()
    (tmp_path / "work" / "out").symlink_to("/etc")
    async with hosting(config, tmp_path, [roots_agent(tmp_path), fixture_agent(tmp_path, "plain")],
                       http_port=free_port()) as app:
        yield app


async def stdio(app: App, agent: str) -> tuple[EditorProc, dict[str, Any]]:
    ed = await editor("stdio", UIBUS, "acp", "--agent", agent, "--target", f"127.0.0.1:{app.port}")
    return ed, await ed.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})


def new(cwd: str, dirs: list[str] | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"cwd": cwd, "mcpServers": []}
    if dirs is not None:
        params["additionalDirectories"] = dirs
    return params


async def test_additional_directories_reach_the_hosted_agent_and_load_and_resume_replace_them(
        app: App, tmp_path: Path) -> None:
    work = tmp_path / "work"
    ed, init = await stdio(app, "roots")
    try:
        caps = init["agentCapabilities"]
        assert caps["sessionCapabilities"]["additionalDirectories"] == {}
        assert caps["auth"] == {"logout": {}, "status": {}} and init["authMethods"] == []
        lib, docs = str(work / "lib"), str(work / "docs")
        session = (await ed.call("session/new", new(str(work), [lib, docs + "/"])))["sessionId"]
        assert (await ed.call("session/prompt", prompt(session, "roots")))["stopReason"] == "end_turn"
        # normalized (the trailing / gone), in the editor's order
        assert ed.text(session) == "Roots: " + json.dumps([lib, docs], separators=(",", ":"))
        resumed = [e["session/resume"] for e in fixture_log(tmp_path) if "session/resume" in e]
        assert [r["additionalDirectories"] for r in resumed] == [[lib, docs]]  # the open session, re-rooted
        # session/resume names the full list again (here: one); session/load with none clears them
        mark = len(ed.events)
        await ed.call("session/resume", {"sessionId": session, **new(str(work), [docs])})
        await ed.call("session/prompt", prompt(session, "roots"))
        assert ed.text(session, start=mark) == f"Roots: {json.dumps([docs])}"
        mark = len(ed.events)
        await ed.call("session/load", {"sessionId": session, **new(str(work))})
        await ed.call("session/prompt", prompt(session, "roots"))
        assert ed.text(session, start=mark).endswith("Roots: []")
    finally:
        await ed.close()


async def test_directories_outside_the_agents_roots_are_refused_naming_the_directory_and_the_rule(
        app: App, tmp_path: Path) -> None:
    work = tmp_path / "work"
    ed, _ = await stdio(app, "roots")
    try:
        code, message = await ed.fails("session/new", new(str(work), ["/etc"]))
        assert code == -32602 and "/etc is outside what agent 'roots' may see" in message
        assert f"Allowed roots: {work}" in message and "never uibus's own files" in message
        code, message = await ed.fails("session/new", new(str(work), ["lib"]))
        assert code == -32602 and "'lib' is not an absolute path" in message
        code, _ = await ed.fails("session/new", new(str(work), [str(work / ".." / "elsewhere")]))
        assert code == -32602  # normalized first: .. cannot climb out
        # a link inside the roots that leads out passes the editor's lexical check; the agent's side
        # resolves it and refuses before the agent hears of it
        session = (await ed.call("session/new", new(str(work), [str(work / "out")])))["sessionId"]
        await ed.call("session/prompt", prompt(session, "roots"))
        said = ed.text(session)
        assert said.startswith("Error from roots: additionalDirectories:") and "/out is outside" in said
        assert not [e for e in fixture_log(tmp_path) if "session/resume" in e]
        # resume and load check the same
        code, _ = await ed.fails("session/resume", {"sessionId": session, **new(str(work), ["/root"])})
        assert code == -32602
    finally:
        await ed.close()


async def test_an_agent_that_does_not_take_directories_is_refused_clearly(app: App, tmp_path: Path) -> None:
    work = tmp_path / "work"
    ed, init = await stdio(app, "plain")
    try:
        assert "additionalDirectories" in init["agentCapabilities"]["sessionCapabilities"]  # not known yet
        session = (await ed.call("session/new", new(str(work), [str(work / "lib")])))["sessionId"]
        await ed.call("session/prompt", prompt(session, "hello"))
        assert "takes no additionalDirectories (its initialize advertises no sessionCapabilities" in ed.text(session)
    finally:
        await ed.close()
    ed, init = await stdio(app, "plain")  # now it has started: known, not advertised, refused at once
    try:
        assert "additionalDirectories" not in init["agentCapabilities"]["sessionCapabilities"]
        code, message = await ed.fails("session/new", new(str(work), [str(work / "lib")]))
        assert code == -32602 and "agent plain takes none" in message
        assert "sessionId" in await ed.call("session/new", new(str(work)))  # without them: fine
    finally:
        await ed.close()


async def test_auth_status_and_logout_over_streamable_http_with_a_tenants_token(
        config: Config, tmp_path: Path) -> None:
    need(SDK)
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("t0ken-a (team-a) team-a-*\n")
    async with hosting(config, tmp_path, [fixture_agent(tmp_path)], tokens_file=str(tokens),
                       http_port=free_port()) as app:
        ed = await editor("http", f"http://127.0.0.1:{app.http_port}/acp?agent=acp&prefix=team-a-",
                          json.dumps({"Authorization": "Bearer t0ken-a"}))
        try:
            await ed.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            assert await ed.call("auth/status", {}) == {"state": "authenticated", "accounts": [
                {"label": "uibus bearer token", "active": True, "organization": "team-a"}]}
            session = (await ed.call("session/new", new("/tmp")))["sessionId"]
            assert (await ed.call("session/prompt", prompt(session, "hi")))["stopReason"] == "end_turn"
            assert await ed.call("logout", {}) == {}
            assert await ed.call("auth/status", {}) == {"state": "unauthenticated"}
            for method, params in (("session/new", new("/tmp")), ("session/prompt", prompt(session, "again")),
                                   ("session/list", {})):
                code, message = await ed.fails(method, params)
                assert code == -32000 and "logged out" in message, method
            # the token itself goes on: another connection with it works
            async with Connection(f"127.0.0.1:{app.port}", session=session, token="t0ken-a") as conn:
                assert (await turn_of(conn, "acp", "still here"))[-1].response.text.startswith("Turn 2")
        finally:
            await ed.close()


async def test_auth_status_without_tokens_is_not_required(app: App) -> None:
    ed, _ = await stdio(app, "plain")
    try:
        assert await ed.call("auth/status", {}) == {"state": "not_required"}
    finally:
        await ed.close()


async def test_a_hosted_agent_needing_terminal_sign_in_is_never_run_for_it(config: Config, tmp_path: Path) -> None:
    need(SDK)
    spec = fixture_agent(tmp_path, "needs_login", login=["sudo", "-u", "agents", "fixture-login"])
    spec["options"]["env"]["ACP_FIXTURE_AUTH"] = "terminal"
    async with hosting(config, tmp_path, [spec]) as app:
        async with Connection(f"127.0.0.1:{app.port}", session="s1") as conn:
            said = (await turn_of(conn, "needs_login", "hello"))[-1].response.text
        assert "agent 'needs_login' is not signed in (its auth/status says unauthenticated)" in said
        assert "terminal sign-in ('Log in from the terminal' (terminal-login))" in said
        assert "uibus never runs a command an agent names" in said
        assert "run `sudo -u agents fixture-login` once on the uibus host" in said  # the operator's, from config
        assert "--login" not in said  # the agent's own arguments are not offered as a command
        log = fixture_log(tmp_path)
        # one process, started once: uibus offers no terminal sign-in (the SDK reads the omission as false)
        assert [e["initialize"]["clientCapabilities"].get("auth", {}).get("terminal") for e in log
                if "initialize" in e] == [False]
        assert any("auth/status" in e for e in log)
        assert not any("logout" in e or "session/new" in e for e in log)  # never logged out, no session made


async def test_a_v2_request_is_answered_with_the_v2_draft_and_a_v1_one_with_1(app: App) -> None:
    """Negotiation (docs/protocols/acp.md): an initialize asking for 2 is answered with the v2
    draft's shape (tests/test_acp_v2.py serves the rest to the SDK's v2 client); one asking for 1
    still gets v1's, untouched."""
    ed = await editor("stdio", UIBUS, "acp", "--agent", "plain", "--target", f"127.0.0.1:{app.port}")
    v1 = await editor("stdio", UIBUS, "acp", "--agent", "plain", "--target", f"127.0.0.1:{app.port}")
    try:
        init = await ed.call("initialize", {"protocolVersion": 2, "info": {"name": "t", "version": "1"}})
        assert init["protocolVersion"] == 2 and init["info"]["name"] == "uibus" and "session" in init["capabilities"]
        assert "agentCapabilities" not in init
        init = await v1.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        assert init["protocolVersion"] == 1 and init["agentCapabilities"]["loadSession"] is True
    finally:
        await v1.close()
        await ed.close()

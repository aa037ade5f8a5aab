"""The audit log's scripted day through the doors an agent's world uses besides gRPC: a hosted ACP
agent (tests/acp/fixture-agent.mjs) asks permission and an editor attached over `/acp` (the
SDK's client, tests/acp/editor.mjs) answers it and sets the agent's mode; the same agent's
permission answered by another person at a gRPC UI; `ask_user` answered by an MCP client itself
(the stateless era's input_required) and a mode set over `/mcp` (today's sessions). Each entry names
the person, the door and the client as it named itself (ACP's and MCP's clientInfo); the minting of
the hosted agent's own /mcp token is recorded, and no token value — the tokens file's nor the
minted one — is anywhere in the store."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port, require
from tests.ext_ui_helpers import open_uis, read
from tests.pikit import hosting, turn_of
from tests.support import ext
from tests.test_acp_agent import ACP_DIR, fixture_agent, fixture_log
from tests.test_acp_serve import editor
from uibus.clients.connection import Connection
from uibus.edge.mcp import era
from uibus.infra.audit import AuditLog, Query
from uibus.infra.config import Config
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

pytestmark = [pytest.mark.timeout(120), pytest.mark.node]

TOKENS = {"alice": "alice-doors-token-4e1b9c", "bob": "bob-doors-token-a07d3e", "admin": "admin-doors-token-5c2f81"}
TOKENS_FILE = f"""\
{TOKENS['alice']}  (team)  day-*  person=alice
{TOKENS['bob']}    (team)  day-*  person=bob  role=approver
{TOKENS['admin']}  *
"""
CWD = "/tmp"
MODERN = "2026-07-28"


async def mcp_post(port: int, who: str, session: str, method: str, params: dict[str, Any], *, ident: int = 1,
                   modern: bool = False, mcp_session: str = "") -> httpx.Response:
    headers = {"authorization": f"Bearer {TOKENS[who]}", "x-uibus-session": session,
               "accept": "application/json, text/event-stream"}
    if modern:
        headers |= {"mcp-protocol-version": MODERN, "mcp-method": method}
        if method == "tools/call":
            headers["mcp-name"] = params["name"]
    if mcp_session:
        headers |= {"mcp-session-id": mcp_session, "mcp-protocol-version": "2025-06-18"}
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(f"http://127.0.0.1:{port}/mcp", headers=headers,
                               json={"jsonrpc": "2.0", "id": ident, "method": method, "params": params})


async def test_answers_and_steering_through_acp_and_mcp_name_the_person_door_and_client(
        config: Config, tmp_path: Path) -> None:
    require("the ACP SDK (npm ci --prefix tests/acp)", (ACP_DIR / "node_modules" / "@agentclientprotocol").is_dir(),
            "node")
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS_FILE)
    async with hosting(config, tmp_path, [fixture_agent(tmp_path)], tokens_file=str(tokens),
                       http_port=free_port()) as app:
        # 1. alice's editor over /acp (WebSocket): it names itself in initialize, answers the hosted
        #    agent's permission request, sets the agent's mode
        url = f"ws://127.0.0.1:{app.http_port}/acp?agent=acp&prefix=day-"
        ed = await editor("ws", url, json.dumps({"Authorization": f"Bearer {TOKENS['alice']}"}))
        try:
            await ed.call("initialize", {"protocolVersion": 1, "clientCapabilities": {},
                                         "clientInfo": {"name": "zed", "version": "0.201.5"}})
            session = (await ed.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
            assert session.startswith("day-")
            tag = ed.start("session/prompt", {"sessionId": session, "prompt": [{"type": "text", "text": "tour"}]})
            question = await ed.until(lambda e: e["ev"] == "ask", what="the permission request")
            assert question["method"] == "session/request_permission"
            ed.send(op="answer", id=question["id"], result={"outcome": {"outcome": "selected", "optionId": "Allow"}})
            assert (await ed.answer_of(tag))["result"] == {"stopReason": "end_turn"}
            assert await ed.call("session/set_mode", {"sessionId": session, "modeId": "plan"}) == {}
        finally:
            await ed.close()

        # 2. the same agent's permission, on alice's gRPC turn, answered by bob at his gRPC UI
        async with Connection(f"127.0.0.1:{app.port}", session=session, token=TOKENS["bob"]) as bob, \
                Connection(f"127.0.0.1:{app.port}", session=session, token=TOKENS["alice"]) as alice:
            (ui,) = await open_uis(app, bob, 1, session)
            turn = asyncio.ensure_future(turn_of(alice, "acp", "tour"))
            while (event := await read(ui, 30)).WhichOneof("event") != "request" or \
                    event.request.WhichOneof("method") != "select":
                pass
            assert event.request.select.title == "rm -rf build"
            await ext(bob).Respond(pb.RespondRequest(id=event.request.id, value="Reject"))
            assert (await asyncio.wait_for(turn, 30))[-1].response.text == "Permission: reject."
            ui.cancel()

        # 3. /mcp, the stateless era: bob's MCP client answers ask_user itself (input_required)
        client = {"name": "claude-code", "version": "2.1.7"}
        meta = {era.PROTOCOL_VERSION: MODERN, era.CLIENT_CAPABILITIES: {"elicitation": {"form": {}}},
                era.CLIENT_INFO: client}
        args = {"title": "Ship it?", "kind": "confirm", "message": "v2 to production"}
        first = (await mcp_post(app.http_port, "bob", session, "tools/call",
                                {"_meta": meta, "name": "ask_user", "arguments": args}, modern=True)).json()
        assert first["result"]["resultType"] == "input_required", first
        answered = await mcp_post(app.http_port, "bob", session, "tools/call", {
            "_meta": meta, "name": "ask_user", "arguments": args, "requestState": first["result"]["requestState"],
            "inputResponses": {"ask_user": {"action": "accept", "content": {"confirmed": True}}}}, modern=True)
        assert answered.json()["result"]["structuredContent"]["outcome"] == "answered", answered.text

        # 4. /mcp, today's sessions: alice's client initializes (naming itself), then sets the mode
        init = await mcp_post(app.http_port, "alice", session, "initialize", {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "cursor", "version": "1.4"}})
        assert init.status_code == 200, init.text
        mcp_session = init.headers["mcp-session-id"]
        moded = await mcp_post(app.http_port, "alice", session, "tools/call", {
            "name": "set_agent_mode", "arguments": {"agent": "acp", "mode_id": "default"}}, ident=2,
            mcp_session=mcp_session)
        assert moded.status_code == 200 and "error" not in moded.text, moded.text

        audit = app.audit
        assert isinstance(audit, AuditLog)
        entries = await audit.list(Query(session=session, limit=1000))
        count, broken = await audit.verify()
        assert broken is None and count >= len(entries)

    got = [(e["act"], e["who"], e["door"]) for e in entries]
    assert got == [
        ("session.create", "alice", "acp"),
        ("token.mint", "alice", "acp"),
        ("dialog.answer", "alice", "acp"),
        ("steer.set_mode", "alice", "acp"),
        ("dialog.answer", "bob", "grpc"),
        ("dialog.approve", "bob", "mcp"),
        ("steer.set_mode", "alice", "mcp"),
    ], got
    create, mint, acp_answer, acp_mode, grpc_answer, mcp_answer, mcp_mode = entries
    assert mint["detail"] == {"agent": "acp"}
    assert acp_answer["client"].startswith("zed/0.201.5"), acp_answer["client"]
    assert create["client"].startswith("zed/0.201.5") and acp_mode["client"].startswith("zed/0.201.5")
    assert acp_answer["detail"]["title"] == "rm -rf build" and acp_answer["detail"]["value"] == "Allow"
    assert acp_answer["detail"]["options"] == "Always Allow, Allow, Reject"
    assert acp_mode["detail"] == {"agent": "acp", "mode_id": "plan"}
    assert grpc_answer["detail"]["value"] == "Reject" and grpc_answer["client"].startswith("grpc-python")
    assert mcp_answer["client"].startswith("claude-code/2.1.7 ("), mcp_answer["client"]
    assert mcp_answer["detail"]["title"] == "Ship it?" and mcp_answer["detail"]["answer"] == "approved"
    assert mcp_answer["detail"]["message"] == "v2 to production"
    assert mcp_mode["client"].startswith("cursor/1.4 ("), mcp_mode["client"]
    assert mcp_mode["detail"] == {"agent": "acp", "mode_id": "default"}
    assert all(e.get("person") == e["who"] and e["tenant"] == "team" for e in entries)

    # nothing secret in the store: no token of the tokens file, nor the one minted for the agent
    minted = [server["headers"] for line in fixture_log(tmp_path) if "session/new" in line
              for server in line["session/new"]["mcpServers"]]
    bearer = [h["value"] for headers in minted for h in headers if h["name"].lower() == "authorization"]
    assert bearer and all(b.startswith("Bearer ") for b in bearer), minted
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("uibus.db*"))
    assert b"token.mint" in raw
    for secret in [*TOKENS.values(), *(b.removeprefix("Bearer ") for b in bearer)]:
        assert secret.encode() not in raw, secret[:6]

"""`/mcp` in MCP's stateless era (protocol 2026-07-28), next to today's sessions: the official
`mcp` 2.3.0 client in its modern mode (it probes `server/discover` and never sends `initialize`),
and raw JSON-RPC over real HTTP for what the SDK has no client for (the tasks extension) and for
every mismatch the specification names an error for.

Across replicas (a real redis-server): an `ask_user` answered through `input_required` whose retry
reaches the other replica, and a hosted ACP agent's turn run as a task, polled on both replicas,
its permission question answered with `tasks/update` on the replica that does not hold it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import REPO, require, wait_for
from tests.mcp_tasks_client import Tasks
from tests.redisproc import RedisProcess, redis_server
from tests.replicakit import replicas
from tests.test_acp_agent import fixture_agent
from tests.test_mcp import chat_args, url
from uibus.app import App
from uibus.app.installers import MCP
from uibus.edge.mcp import era

__all__ = ["redis_server"]  # the fixture

MODERN = "2026-07-28"
CAPS: dict[str, Any] = {}


def meta(capabilities: dict[str, Any] | None = None, **more: Any) -> dict[str, Any]:
    return {era.PROTOCOL_VERSION: MODERN, era.CLIENT_CAPABILITIES: capabilities if capabilities is not None else CAPS,
            **more}


def headers(method: str, name: str | None = None, session: str = "modern", **more: str) -> dict[str, str]:
    out = {"mcp-protocol-version": MODERN, "mcp-method": method, "x-uibus-session": session,
           "accept": "application/json, text/event-stream", **more}
    if name is not None:
        out["mcp-name"] = name
    return out


async def post(base: str, method: str, params: dict[str, Any], *, ident: int = 1, name: str | None = None,
               session: str = "modern", extra: dict[str, str] | None = None) -> httpx.Response:
    body = {"jsonrpc": "2.0", "id": ident, "method": method, "params": params}
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(base, json=body, headers={**headers(method, name, session), **(extra or {})})


@asynccontextmanager
async def modern_client(urls: list[str], session: str, seen: list[tuple[str, dict[str, Any]]],
                        **kw: Any) -> AsyncIterator[Client]:
    """The SDK's client in its default (auto) mode, behind a balancer with no affinity: each POST goes
    to the next of `urls`; `seen` gets (url, body) of every request sent."""
    turn = {"n": 0}

    async def spread(request: httpx2.Request) -> None:
        target = httpx2.URL(urls[turn["n"] % len(urls)])
        turn["n"] += 1
        request.url = request.url.copy_with(port=target.port)
        if request.method == "POST":
            seen.append((str(request.url), json.loads(request.content or b"{}")))

    async with httpx2.AsyncClient(headers={"x-uibus-session": session}, timeout=httpx2.Timeout(30, read=60),
                                  event_hooks={"request": [spread]}) as http, \
            Client(streamable_http_client(urls[0], http_client=http), **kw) as client:
        yield client


# ---- one server: the era, discover, the results, the errors ------------------------------------


async def test_the_sdk_discovers_the_modern_era_and_never_initializes(web: App) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    async with modern_client([url(web)], "modern-sdk", seen) as client:
        assert client.session.discover_result is not None and client.session.initialize_result is None
        assert client.protocol_version == MODERN
        assert client.server_info is not None and client.server_info.name == "uibus"
        assert "io.modelcontextprotocol/tasks" in (client.server_capabilities.extensions or {})
        tools = [t.name for t in (await client.list_tools()).tools]
        pieces: list[str] = []

        async def progress(value: float, total: float | None, message: str | None) -> None:
            pieces.append(message or "")

        result = await client.call_tool("hello_world", chat_args("my name is Ada"), progress_callback=progress)
        again = await client.call_tool("hello_world", chat_args("what is my name?"))
    agents = sorted(a.agent_name for a in web.core.chat.directory.agents)
    assert tools == [*agents, "ask_user", "notify_user", "set_status", "list_sessions", "stop_turn", "set_agent_mode"]
    assert 'You said: "my name is Ada"' in result.content[0].text
    assert len(pieces) > 1 and "".join(pieces) == result.content[0].text  # progress on the call's stream
    assert "(this is turn 2)" in again.content[0].text  # the uibus session keeps the conversation
    methods = [body.get("method") for _, body in seen]
    assert methods[0] == "server/discover" and "initialize" not in methods
    assert all(body["params"]["_meta"][era.PROTOCOL_VERSION] == MODERN for _, body in seen if "params" in body)


async def test_every_modern_result_says_its_type_who_answered_and_how_long_to_keep_it(web: App) -> None:
    listed = (await post(url(web), "tools/list", {"_meta": meta()})).json()["result"]
    assert listed["resultType"] == "complete" and listed["cacheScope"] == "private" and listed["ttlMs"] > 0
    assert listed["_meta"][era.SERVER_INFO]["name"] == "uibus"
    found = (await post(url(web), "server/discover", {"_meta": meta()})).json()["result"]
    assert MODERN in found["supportedVersions"] and "2025-11-25" in found["supportedVersions"]
    assert (found["resultType"], found["cacheScope"]) == ("complete", "public")
    called = await post(url(web), "tools/call", {"_meta": meta(), "name": "notify_user",
                                                 "arguments": {"message": "hi"}}, name="notify_user")
    assert called.status_code == 200 and called.json()["result"]["resultType"] == "complete"
    assert "mcp-session-id" not in called.headers  # no sessions in this era
    # Today's sessions are untouched: no resultType, no cache hints.
    init = await post(url(web), "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}},
                      extra={"mcp-protocol-version": "", "mcp-method": ""})
    sid = init.headers["mcp-session-id"]
    async with httpx.AsyncClient(timeout=10) as http:
        old = (await http.post(url(web), json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
                               headers={"mcp-session-id": sid, "mcp-protocol-version": "2025-11-25"})).json()
    assert "resultType" not in old["result"] and "ttlMs" not in old["result"]


@pytest.mark.parametrize(("method", "params", "name", "extra", "http", "code", "words"), [
    ("tools/list", {}, None, {}, 400, -32602, "params._meta must be an object"),
    ("tools/list", {"_meta": {era.PROTOCOL_VERSION: MODERN}}, None, {}, 400, -32602, "lacks"),
    ("tools/list", {"_meta": meta()}, None, {"mcp-method": "tools/call"}, 400, -32020, "Mcp-Method"),
    ("tools/list", {"_meta": meta()}, None, {"mcp-protocol-version": "2025-11-25"}, 400, -32020,
     "MCP-Protocol-Version header"),
    ("tools/call", {"_meta": meta(), "name": "notify_user", "arguments": {"message": "x"}}, "set_status", {}, 400,
     -32020, "Mcp-Name"),
    ("tools/call", {"_meta": meta(), "name": "notify_user", "arguments": {"message": "x"}}, None, {}, 400,
     -32020, "Mcp-Name"),
    ("tools/list", {"_meta": {**meta(), era.PROTOCOL_VERSION: "2099-01-01"}}, None,
     {"mcp-protocol-version": "2099-01-01"}, 400, -32022, "not served here"),
    ("tools/list", {}, None, {"mcp-protocol-version": "1999-01-01"}, 400, -32022, "is not supported"),
    ("nonsense/method", {"_meta": meta()}, None, {"mcp-method": "nonsense/method"}, 404, -32601,
     "is not served here"),
    ("tools/call", {"_meta": meta(), "name": "no_such_tool", "arguments": {}}, "no_such_tool", {}, 400, -32602,
     "unknown tool"),
    ("tasks/get", {"_meta": meta(), "taskId": "feed"}, "feed", {}, 200, -32000, "no task"),
    ("subscriptions/listen", {"_meta": meta(), "notifications": {}}, None,
     {"accept": "application/json"}, 406, -32600, "event stream"),
])
async def test_every_mismatch_gets_the_specifications_error(web: App, method: str, params: dict[str, Any],
                                                            name: str | None, extra: dict[str, str], http: int,
                                                            code: int, words: str) -> None:
    answer = await post(url(web), method, params, name=name, extra=extra)
    assert answer.status_code == http, answer.text
    error = answer.json()["error"]
    assert error["code"] == code and words in error["message"], error
    if code == -32022:
        assert MODERN in error["data"]["supported"]
    # and the server goes on
    assert (await post(url(web), "tools/list", {"_meta": meta()})).status_code == 200


async def test_a_routing_header_sent_twice_is_a_mismatch(web: App) -> None:
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": meta()}}).encode()
    raw = [(b"content-type", b"application/json"), (b"mcp-protocol-version", MODERN.encode()),
           (b"mcp-method", b"tools/list"), (b"mcp-method", b"tools/call")]
    async with httpx.AsyncClient(timeout=10) as http:
        answer = await http.post(url(web), content=body, headers=raw)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == -32020


async def test_ask_user_is_answered_through_input_required_and_checked(web: App) -> None:
    args = {"title": "Deploy now?", "options": ["yes", "later"]}
    caps = {"elicitation": {"form": {}}}
    first = (await post(url(web), "tools/call", {"_meta": meta(caps), "name": "ask_user", "arguments": args},
                        name="ask_user")).json()["result"]
    assert first["resultType"] == "input_required"
    form = first["inputRequests"]["ask_user"]
    assert form["method"] == "elicitation/create"
    assert form["params"]["requestedSchema"]["properties"]["value"]["enum"] == ["yes", "later"]
    state = first["requestState"]
    retry = {"_meta": meta(caps), "name": "ask_user", "arguments": args, "requestState": state}
    answered = {"ask_user": {"action": "accept", "content": {"value": "later"}}}
    done = (await post(url(web), "tools/call", {**retry, "inputResponses": answered}, name="ask_user")).json()
    assert done["result"]["structuredContent"]["value"] == "later" and done["result"]["resultType"] == "complete"
    # an answer that is not an option, another question's state, no answer: each a clear error
    wrong = {"ask_user": {"action": "accept", "content": {"value": "never"}}}
    bad = (await post(url(web), "tools/call", {**retry, "inputResponses": wrong}, name="ask_user")).json()
    assert "not one of the options" in bad["error"]["message"]
    other = {**retry, "arguments": {**args, "title": "Something else?"}, "inputResponses": answered}
    bad = (await post(url(web), "tools/call", other, name="ask_user")).json()
    assert "requestState does not belong" in bad["error"]["message"]
    declined = (await post(url(web), "tools/call", {**retry, "inputResponses": {"ask_user": {"action": "decline"}}},
                           name="ask_user")).json()["result"]
    assert declined["structuredContent"]["outcome"] == "cancelled"


async def test_subscriptions_listen_announces_new_sessions(web: App) -> None:
    body = {"jsonrpc": "2.0", "id": "sub-1", "method": "subscriptions/listen",
            "params": {"_meta": meta(), "notifications": {"resourcesListChanged": True, "toolsListChanged": True,
                                                          "promptsListChanged": True}}}
    async with httpx.AsyncClient(timeout=30) as http, \
            http.stream("POST", url(web), json=body, headers=headers("subscriptions/listen")) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.aiter_lines()

        async def message() -> dict[str, Any]:
            async for line in lines:
                if line.startswith("data:") and line[5:].strip():
                    return json.loads(line[5:])
            raise AssertionError("the stream ended")

        ack = await asyncio.wait_for(message(), 10)
        assert ack["method"] == "notifications/subscriptions/acknowledged"
        assert ack["params"]["notifications"] == {"resourcesListChanged": True, "toolsListChanged": True}
        assert ack["params"]["_meta"][era.SUBSCRIPTION_ID] == "sub-1"
        await post(url(web), "tools/call", {"_meta": meta(), "name": "hello_world", "arguments": chat_args("hi")},
                   name="hello_world", session="listened-new")
        web.core.sessions.poke()
        changed = await asyncio.wait_for(message(), 10)
        assert changed["method"] == "notifications/resources/list_changed"
        assert changed["params"]["_meta"][era.SUBSCRIPTION_ID] == "sub-1"
    listed = (await post(url(web), "resources/list", {"_meta": meta()})).json()["result"]
    assert "uibus://sessions/listened-new" in [r["uri"] for r in listed["resources"]]
    read = (await post(url(web), "resources/read", {"_meta": meta(), "uri": "uibus://sessions/listened-new"},
                       name="uibus://sessions/listened-new")).json()["result"]
    assert json.loads(read["contents"][0]["text"])["session"] == "listened-new"


# ---- the TypeScript side: the SDK's v2 client and the MCP Inspector --------------------------------

MCPJS = REPO / "tests" / "mcpjs"


async def node(*args: str) -> tuple[int, str, str]:
    require("the MCP TypeScript clients (npm ci --prefix tests/mcpjs)",
            (MCPJS / "node_modules" / "@modelcontextprotocol" / "inspector").is_dir(), "node")
    proc = await asyncio.create_subprocess_exec(shutil.which("node") or "node", *args, cwd=MCPJS,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(MCPJS)})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


@pytest.mark.node
@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_the_typescript_sdk_v2_client_in_both_eras(web: App, mode: str) -> None:
    rc, out, err = await node("modern.mjs", url(web), f"ts-{mode}", mode)
    assert rc == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["version"] == (MODERN if mode == "auto" else "2025-11-25") and seen["server"] == "uibus"
    assert seen["tools"][-6:] == ["ask_user", "notify_user", "set_status", "list_sessions", "stop_turn",
                                  "set_agent_mode"]
    assert 'You said: "hi from ts"' in seen["chat"]
    if mode == "auto":  # ask_user answered by the client's own elicitation handler, through input_required
        assert seen["asked"]["structured"] == {"outcome": "answered", "dialog_id": "", "value": "later"}
        assert seen["forms"][0]["requestedSchema"]["properties"]["value"]["enum"] == ["yes", "later"]


@pytest.mark.node
@pytest.mark.parametrize("era", ["legacy", "modern"])
async def test_the_mcp_inspector_cli_lists_and_calls_in_both_eras(web: App, era: str) -> None:
    inspector = MCPJS / "node_modules" / "@modelcontextprotocol" / "inspector"
    entry = json.loads((inspector / "package.json").read_text())["bin"]
    entry = entry if isinstance(entry, str) else entry.get("mcp-inspector") or next(iter(entry.values()))
    common = [str(inspector / entry), "--cli", url(web), "--header", f"x-uibus-session: inspector-{era}",
              "--protocol-era", era, "--format", "json", "-q"]
    rc, out, err = await node(*common, "--method", "tools/list")
    assert rc == 0, err
    listed = json.loads(out)
    names = [t["name"] for t in listed.get("result", listed)["tools"]]
    assert names[:1] == ["hello_world"] and "ask_user" in names
    rc, out, err = await node(*common, "--method", "tools/call", "--tool-name", "notify_user",
                              "--tool-arg", "message=hi")
    assert rc == 0, err
    called = json.loads(out)
    assert called.get("result", called)["structuredContent"]["subscribers"] == 0
    metrics = web.metrics.render().decode()  # type: ignore[union-attr]
    start = "/mcp/server/discover" if era == "modern" else "/mcp/initialize"
    assert f'method="{start}"' in metrics  # the era the Inspector spoke


# ---- replicas: no sticky sessions ----------------------------------------------------------------


async def test_ask_user_answered_by_the_sdk_client_with_its_retry_on_the_other_replica(
        redis_server: RedisProcess, tmp_path: Path) -> None:
    asked: list[types.ElicitRequestParams] = []

    async def elicit(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params)
        return types.ElicitResult(action="accept", content={"confirmed": True})

    seen: list[tuple[str, dict[str, Any]]] = []
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)]) as apps:
        urls = [url(a) for a in apps]
        async with modern_client(urls, "asked-across", seen, elicitation_callback=elicit) as client:
            result = await client.call_tool("ask_user", {"kind": "confirm", "title": "Push to main?",
                                                         "message": "CI is green."})
    assert result.structured_content == {"outcome": "answered", "confirmed": True, "dialog_id": ""}
    assert asked and asked[0].message == "Push to main?\n\nCI is green."
    calls = [(where, body) for where, body in seen if body.get("method") == "tools/call"]
    assert len(calls) == 2 and calls[0][0] != calls[1][0]  # the retry went to the other replica
    assert "inputResponses" in calls[1][1]["params"] and "requestState" in calls[1][1]["params"]


async def test_a_hosted_agents_turn_as_a_task_polled_and_answered_across_replicas(
        redis_server: RedisProcess, tmp_path: Path) -> None:
    caps = {"elicitation": {"form": {}}, "extensions": {era.TASKS: {}}}
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)]) as apps:
        a, b = (url(app) for app in apps)
        created = (await post(a, "tools/call", {"_meta": meta(caps), "name": "acp", "arguments": chat_args("tour")},
                              name="acp", session="tasked")).json()["result"]
        assert created["resultType"] == "task" and created["status"] == "working"
        task = created["taskId"]

        async def poll(where: str, until: str) -> dict[str, Any]:
            for _ in range(300):
                got = (await post(where, "tasks/get", {"_meta": meta(caps), "taskId": task}, name=task,
                                  session="tasked")).json()
                assert "result" in got, got
                if got["result"]["status"] == until:
                    return got["result"]
                await asyncio.sleep(0.1)
            raise AssertionError(f"task never {until}: {got}")

        waiting = await poll(b, "input_required")  # read on the replica that does not run it
        (key, form), = waiting["inputRequests"].items()
        assert form["params"]["requestedSchema"]["properties"]["value"]["enum"] == ["Always Allow", "Allow", "Reject"]
        # another token cannot see it
        stranger = await post(b, "tasks/get", {"_meta": meta(caps), "taskId": task}, name=task, session="tasked",
                              extra={"authorization": "Bearer someone-else"})
        assert "no task" in stranger.json()["error"]["message"]
        answered = await post(b, "tasks/update", {"_meta": meta(caps), "taskId": task, "inputResponses": {
            key: {"action": "accept", "content": {"value": "Reject"}}}}, name=task, session="tasked")
        assert answered.json()["result"]["resultType"] == "complete"
        done = await poll(a, "completed")
        assert "Permission: reject." in done["result"]["content"][0]["text"]
        assert (await poll(b, "completed"))["result"] == done["result"]
        await wait_for(lambda: sum(len(app[MCP].server.tasks) for app in apps) == 0, what="no task running")


async def test_the_sdk_client_follows_a_task_and_answers_its_permission_on_either_replica(
        redis_server: RedisProcess, tmp_path: Path) -> None:
    """The SDK client with the tasks extension (tests/mcp_tasks_client.py): its call of the ACP
    agent's tour comes back as a task, polled through a balancer with no affinity; the agent's
    permission question comes as an input request and the answer reaches the replica holding it."""
    forms: list[dict[str, Any]] = []

    async def answer(key: str, request: dict[str, Any]) -> dict[str, Any]:
        forms.append(request)
        return {"action": "accept", "content": {"value": "Allow"}}

    tasks = Tasks(answer)
    seen: list[tuple[str, dict[str, Any]]] = []
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)]) as apps:
        async with modern_client([url(a) for a in apps], "sdk-tasked", seen, extensions=[tasks]) as client:
            result = await client.call_tool("acp", chat_args("tour"))
        await wait_for(lambda: sum(len(app[MCP].server.tasks) for app in apps) == 0, what="no task running")
    assert "Permission: allow." in result.content[0].text
    assert tasks.created and "input_required" in tasks.statuses and tasks.statuses[-1] == "completed"
    assert forms[0]["params"]["requestedSchema"]["properties"]["value"]["enum"] == ["Always Allow", "Allow",
                                                                                   "Reject"]
    polled = {where for where, body in seen if body.get("method") == "tasks/get"}
    assert len(polled) == 2  # both replicas answered polls
    assert all(body["params"]["_meta"][era.PROTOCOL_VERSION] == MODERN for _, body in seen if "params" in body)


async def test_a_task_cancelled_ends_its_turn(web: App) -> None:
    caps = {"extensions": {era.TASKS: {}}}
    created = (await post(url(web), "tools/call", {"_meta": meta(caps), "name": "hello_world", "arguments": chat_args(
        "slow", sly_data={"delay_ms": 5000})}, name="hello_world", session="cancelled-task")).json()["result"]
    task = created["taskId"]
    cancelled = await post(url(web), "tasks/cancel", {"_meta": meta(caps), "taskId": task}, name=task,
                           session="cancelled-task")
    assert cancelled.json()["result"]["resultType"] == "complete"
    mcp = web[MCP].server
    await wait_for(lambda: len(mcp.tasks) == 0, timeout=5, what="the task's runner ended")
    got = (await post(url(web), "tasks/get", {"_meta": meta(caps), "taskId": task}, name=task,
                      session="cancelled-task")).json()["result"]
    assert got["status"] == "cancelled"


async def test_a_tenants_running_tasks_are_held_to_its_quota(web_config: Any) -> None:
    from dataclasses import replace

    from tests.conftest import running

    caps = {"extensions": {era.TASKS: {}}}
    slow = {"_meta": meta(caps), "name": "hello_world", "arguments": chat_args("slow", sly_data={"delay_ms": 5000})}
    async with running(replace(web_config, quota_mcp_tasks=1)) as app:
        first = (await post(url(app), "tools/call", slow, name="hello_world", session="quota")).json()["result"]
        refused = (await post(url(app), "tools/call", slow, name="hello_world", session="quota")).json()
        assert "quota mcp_tasks exceeded" in refused["error"]["message"]
        assert refused["error"]["data"]["status"] == "RESOURCE_EXHAUSTED"
        task = first["taskId"]
        await post(url(app), "tasks/cancel", {"_meta": meta(caps), "taskId": task}, name=task, session="quota")
        await wait_for(lambda: len(app[MCP].server.tasks) == 0, timeout=5, what="the first task ended")
        again = (await post(url(app), "tools/call", slow, name="hello_world", session="quota")).json()["result"]
        assert again["resultType"] == "task"  # the lease came back

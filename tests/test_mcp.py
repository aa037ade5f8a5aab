"""`/mcp` as MCP clients see it: the official `mcp` SDK client (streamable HTTP, unmodified) and raw
JSON-RPC over real HTTP, against a real App on loopback.

Agents are tools (a call is a chat turn in the caller's uibus session: the context continues, the
session's UIs see it, cancelling stops it); the person at the UI is a tool (`ask_user` answered
from an ExtensionUiService subscriber, timed out, dismissed, cancelled by the caller); bad input
is a JSON-RPC error, never a 500; the pipeline's token, session and metrics rules hold.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from tests.conftest import REPO, free_port, running, wait_for
from tests.ext_ui_helpers import ext, open_uis, read
from uibus.app import App
from uibus.app.installers import MCP
from uibus.edge.mcp import protocol
from uibus.infra import kinds
from uibus.infra.config import Config
from uibus.pb.cline import common_pb2, ui_pb2_grpc
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

TOKEN = "mcp-secret"


def url(app: App) -> str:
    return f"http://127.0.0.1:{app.http_port}/mcp"


@asynccontextmanager
async def mcp_client(app: App, session: str = "default", token: str | None = None, mode: str = "legacy",
                     **kw: Any) -> AsyncIterator[Client]:
    """The SDK's own client over streamable HTTP, with uibus's two headers (as an MCP client config
    would set them); in the 2025-11-25 era (`mode="legacy"`, initialize) unless told otherwise
    (tests/test_mcp_modern.py has the stateless era)."""
    headers = {"x-uibus-session": session}
    if token:
        headers["authorization"] = f"Bearer {token}"
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as http, \
            Client(streamable_http_client(url(app), http_client=http), mode=mode, **kw) as client:
        yield client


async def rpc(app: App, body: bytes | dict[str, Any] | list[Any], headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.post(url(app), content=data, headers={"content-type": content_type, **(headers or {})})


def chat_args(text: str, **more: Any) -> dict[str, Any]:
    return {"user_message": {"type": "HUMAN", "text": text}, **more}


@pytest.mark.filterwarnings("ignore:ping is removed")
async def test_handshake_lists_agents_and_user_tools(web: App) -> None:
    async with mcp_client(web) as client:
        assert client.server_info is not None and client.server_info.name == "uibus"
        assert client.protocol_version in protocol.VERSIONS
        assert client.server_capabilities.tools is not None
        tools = {t.name: t for t in (await client.list_tools()).tools}
        await client.send_ping()
        assert (await client.list_resources()).resources == []
        assert (await client.list_prompts()).prompts == []
    directory = {a.agent_name: a.description for a in web.core.chat.directory.agents}
    assert set(tools) == {*directory, "ask_user", "notify_user", "set_status", "list_sessions", "stop_turn",
                          "set_agent_mode"}
    for name, description in directory.items():  # as ConciergeService.List reports them
        assert tools[name].description == description
        schema = tools[name].input_schema
        assert schema["type"] == "object" and "user_message" in schema["properties"]
        assert schema["required"] == ["user_message"]
    assert tools["ask_user"].input_schema["required"] == ["title"]


async def test_agent_tool_keeps_the_conversation_and_the_session_ui_sees_it(web: App, web_connect: Any) -> None:
    ui = ui_pb2_grpc.UiServiceStub(web_connect("mcp-chat").channel)
    partials = ui.subscribeToPartialMessage(common_pb2.EmptyRequest())
    await wait_for(lambda: web.bus.count(kinds.PARTIAL_MESSAGE, "mcp-chat") == 1, what="the webview subscribed")
    async with mcp_client(web, "mcp-chat") as client:
        first = await client.call_tool("hello_world", chat_args("my name is Ada"))
        second = await client.call_tool("hello_world", chat_args("what is my name?"))
    assert not first.is_error and not second.is_error
    assert 'You said: "my name is Ada"' in first.content[0].text
    assert 'Earlier you said: "my name is Ada" (this is turn 2).' in second.content[0].text
    context = second.structured_content["chat_context"]
    texts = [m["text"] for m in context["chat_histories"][0]["messages"]]
    assert texts[0::2] == ["my name is Ada", "what is my name?"]
    seen = []
    while not any("turn 2" in t for t in seen):
        seen.append((await asyncio.wait_for(partials.read(), 5)).text)
    partials.cancel()
    # Another uibus session starts its own conversation.
    async with mcp_client(web, "mcp-other") as client:
        other = await client.call_tool("hello_world", chat_args("hi"))
    assert "This is the start of our conversation." in other.content[0].text


async def test_agent_tool_reports_pieces_as_progress(web: App) -> None:
    pieces: list[str] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        pieces.append(message or "")

    async with mcp_client(web, "mcp-progress") as client:
        result = await client.call_tool("hello_world", chat_args("stream please"), progress_callback=progress)
    assert len(pieces) > 1
    assert "".join(pieces) == result.content[0].text


async def test_a_chat_context_in_the_arguments_wins(web: App) -> None:
    async with mcp_client(web, "mcp-ctx") as client:
        await client.call_tool("hello_world", chat_args("my name is Ada"))
        fresh = await client.call_tool("hello_world", chat_args("who am I?", chat_context={}))
    assert "This is the start of our conversation." in fresh.content[0].text


async def test_cancelling_an_agent_call_stops_the_turn(web: App) -> None:
    async with mcp_client(web, "mcp-cancel") as client:
        with anyio.move_on_after(0.5) as scope:
            await client.call_tool("hello_world", chat_args("take your time", sly_data={"delay_ms": 1000}))
        assert scope.cancelled_caught
        await wait_for(lambda: _gauge(web, "uibus_mcp_calls_in_flight") == 0, timeout=3, what="the call ended")
        # The turn never finished: no answer was kept, and the next call works.
        history = await web.core.history.load_context("mcp-cancel", "hello_world")
        assert not history.chat_histories
        again = await client.call_tool("hello_world", chat_args("hi"))
    assert "This is the start of our conversation." in again.content[0].text


async def next_request(stream: Any) -> pb.ExtensionUiEvent:
    """The next dialog or fire-and-forget request a UI gets (the closings of earlier ones skipped)."""
    while True:
        event = await read(stream, 5)
        if event.WhichOneof("event") == "request":
            return event


def _gauge(app: App, name: str) -> float:
    for line in app.metrics.render().decode().splitlines():  # type: ignore[union-attr]
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no gauge {name}")


# ---- the user as tools -----------------------------------------------------------------------------


async def test_ask_user_is_answered_from_a_subscribed_ui(web: App, web_connect: Any) -> None:
    conn = web_connect("mcp-ask")
    [stream] = await open_uis(web, conn, 1, "mcp-ask")
    async with mcp_client(web, "mcp-ask") as client:
        call = asyncio.ensure_future(client.call_tool(
            "ask_user", {"title": "Deploy now?", "options": ["yes", "later"]}))
        event = await next_request(stream)
        assert event.request.WhichOneof("method") == "select"
        assert event.request.select.title == "Deploy now?" and list(event.request.select.options) == ["yes", "later"]
        await ext(conn).Respond(pb.RespondRequest(id=event.request.id, value="later"))
        result = await asyncio.wait_for(call, 5)
        assert result.content[0].text == "later" and not result.is_error
        assert result.structured_content == {"outcome": "answered", "value": "later", "dialog_id": event.request.id}

        confirm = asyncio.ensure_future(client.call_tool(
            "ask_user", {"kind": "confirm", "title": "Delete branch?", "message": "It has no upstream."}))
        event = await next_request(stream)
        assert event.request.confirm.message == "It has no upstream."
        await ext(conn).Respond(pb.RespondRequest(id=event.request.id, confirmed=True))
        result = await asyncio.wait_for(confirm, 5)
        assert result.content[0].text == "The user confirmed." and result.structured_content["confirmed"] is True

        dismissed = asyncio.ensure_future(client.call_tool("ask_user", {"title": "Your name?"}))
        event = await next_request(stream)
        assert event.request.WhichOneof("method") == "input"
        await ext(conn).Respond(pb.RespondRequest(id=event.request.id, cancelled=True))
        result = await asyncio.wait_for(dismissed, 5)
        assert result.structured_content["outcome"] == "cancelled" and not result.is_error
    stream.cancel()


async def test_ask_user_times_out(web: App, web_connect: Any) -> None:
    conn = web_connect("mcp-timeout")
    [stream] = await open_uis(web, conn, 1, "mcp-timeout")
    async with mcp_client(web, "mcp-timeout") as client:
        result = await client.call_tool("ask_user", {"kind": "editor", "title": "Edit", "prefill": "x",
                                                     "timeout_seconds": 0.2})
    assert result.structured_content["outcome"] == "timed_out"
    assert result.content[0].text == "The user did not answer in time."
    opened = await read(stream, 5)
    assert opened.request.editor.prefill == "x"
    closed = await read(stream, 5)
    assert closed.closed.id == opened.request.id and closed.closed.reason == pb.DIALOG_OUTCOME_TIMED_OUT
    stream.cancel()


async def test_a_caller_that_gives_up_closes_the_dialog_for_every_ui(web: App, web_connect: Any) -> None:
    conn = web_connect("mcp-gone")
    [stream] = await open_uis(web, conn, 1, "mcp-gone")
    async with mcp_client(web, "mcp-gone") as client:
        with anyio.move_on_after(0.5):
            await client.call_tool("ask_user", {"title": "Still there?"})
    opened = await read(stream, 5)
    closed = await read(stream, 5)
    assert closed.closed.id == opened.request.id and closed.closed.reason == pb.DIALOG_OUTCOME_CALLER_CANCELLED
    await wait_for(lambda: web.core.dialogs.count() == 0, what="no dialog left")
    await wait_for(lambda: _gauge(web, "uibus_mcp_calls_in_flight") == 0, what="no call left")
    stream.cancel()


async def test_notify_user_and_set_status_are_fire_and_forget(web: App, web_connect: Any) -> None:
    conn = web_connect("mcp-fire")
    [stream] = await open_uis(web, conn, 1, "mcp-fire")
    async with mcp_client(web, "mcp-fire") as client:
        told = await client.call_tool("notify_user", {"message": "Build finished", "level": "warning"})
        status = await client.call_tool("set_status", {"key": "build", "text": "green"})
        nobody = None
        async with mcp_client(web, "mcp-nobody") as alone:
            nobody = await alone.call_tool("notify_user", {"message": "anyone?"})
    assert told.structured_content["subscribers"] == 1 and "reached 1 UI" in told.content[0].text
    assert status.structured_content["subscribers"] == 1
    assert nobody.structured_content["subscribers"] == 0 and "nobody saw" in nobody.content[0].text
    notify = await next_request(stream)
    assert notify.request.notify.message == "Build finished"
    assert notify.request.notify.notify_type == pb.NOTIFY_TYPE_WARNING
    assert (await next_request(stream)).request.set_status.text == "green"
    stream.cancel()


@pytest.mark.parametrize(("tool", "args", "words"), [
    ("ask_user", {}, "ask_user needs arguments.title"),
    ("ask_user", {"title": "x", "kind": "dance"}, "kind must be select, confirm, input or editor"),
    ("ask_user", {"title": "x", "options": "a,b"}, "options must be a list of strings"),
    ("ask_user", {"title": "x", "kind": "input", "options": ["a"]}, "options is for kind select"),
    ("ask_user", {"title": "x", "timeout_seconds": -1}, "timeout_seconds must be a positive number"),
    ("ask_user", {"title": "x", "colour": "red"}, "takes no argument colour"),
    ("notify_user", {"message": "x", "level": "loud"}, "level must be one of info, warning, error"),
    ("hello_world", {}, "needs arguments.user_message"),
    ("hello_world", {"user_message": {"text": 5}}, "not a neuro-san ChatRequest"),
    ("no_such_tool", {}, "unknown tool 'no_such_tool'"),
])
async def test_bad_tool_arguments_are_invalid_params(web: App, tool: str, args: dict[str, Any], words: str) -> None:
    async with mcp_client(web) as client:
        with pytest.raises(MCPError) as caught:
            await client.call_tool(tool, args)
        assert caught.value.error.code == protocol.INVALID_PARAMS
        assert words in caught.value.error.message
        assert (await client.call_tool("hello_world", chat_args("still fine"))).is_error is False


# ---- raw JSON-RPC: bad input is an error, never a 500, and nothing breaks -------------------------


@pytest.mark.parametrize(("body", "content_type", "http", "code", "words"), [
    (b"{not json", "application/json", 400, protocol.PARSE_ERROR, "not valid JSON"),
    (b"[" * 100_000, "application/json", 400, protocol.PARSE_ERROR, "nested deeper than"),
    (b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]', "application/json", 400, protocol.INVALID_REQUEST,
     "batches are not supported"),
    (b'{"id": 1, "method": "ping"}', "application/json", 400, protocol.INVALID_REQUEST, '"jsonrpc": "2.0"'),
    (b'{"jsonrpc": "2.0", "id": true, "method": "ping"}', "application/json", 400, protocol.INVALID_REQUEST,
     '"id" must be'),
    (b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": [1]}', "application/json", 400,
     protocol.INVALID_REQUEST, "must be an object"),
    (b'{"jsonrpc": "2.0", "id": 1, "method": "ping"}', "text/plain", 400, protocol.INVALID_REQUEST,
     "Content-Type: application/json"),
    (b'{"jsonrpc": "2.0", "id": 7, "method": "sampling/dance"}', "application/json", 200,
     protocol.METHOD_NOT_FOUND, "'sampling/dance' is not served here"),
    (b'{"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {}}', "application/json", 200,
     protocol.INVALID_PARAMS, "needs params.name"),
])
async def test_bad_json_rpc_gets_a_json_rpc_error(web: App, body: bytes, content_type: str, http: int, code: int,
                                                  words: str) -> None:
    r = await rpc(web, body, content_type=content_type)
    assert r.status_code == http, r.text
    error = r.json()
    assert error["jsonrpc"] == "2.0" and error["error"]["code"] == code and words in error["error"]["message"]
    assert error["id"] == (json.loads(body)["id"] if http == 200 else None)
    ok = await rpc(web, {"jsonrpc": "2.0", "id": 2, "method": "ping"})
    assert ok.status_code == 200 and ok.json() == {"jsonrpc": "2.0", "id": 2, "result": {}}


async def test_http_edges_of_the_endpoint(web: App) -> None:
    big = web.config.max_message_bytes + 1
    r = await rpc(web, b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"pad": "' + b"x" * big + b'"}}')
    assert r.status_code == 429 and r.json()["error"]["data"]["status"] == "RESOURCE_EXHAUSTED"
    async with httpx.AsyncClient(timeout=10) as http:
        get = await http.get(url(web))
        assert get.status_code == 405 and get.headers["allow"] == "GET, POST, DELETE"  # GET: with Last-Event-ID
        assert (await http.get(url(web) + "/x")).status_code == 404
    # A notification and a client's response are accepted without a body.
    for message in ({"jsonrpc": "2.0", "method": "notifications/initialized"},
                    {"jsonrpc": "2.0", "id": 5, "result": {}}):
        r = await rpc(web, message)
        assert r.status_code == 202 and r.content == b""
    # A session id is handed out by initialize, ended by DELETE, and then answered 404.
    init = await rpc(web, {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                           "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                                      "clientInfo": {"name": "t", "version": "1"}}})
    assert init.json()["result"]["protocolVersion"] == "2025-06-18"
    sid = init.headers["mcp-session-id"]
    headers = {"mcp-session-id": sid, "mcp-protocol-version": "2025-06-18"}
    assert (await rpc(web, {"jsonrpc": "2.0", "id": 2, "method": "ping"}, headers)).status_code == 200
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.delete(url(web), headers=headers)).status_code == 204
        assert (await http.delete(url(web))).status_code == 400
    gone = await rpc(web, {"jsonrpc": "2.0", "id": 3, "method": "ping"}, headers)
    assert gone.status_code == 404 and "has ended" in gone.json()["error"]["message"]
    # An unknown protocol version is refused by name; an unknown one offered at initialize gets ours.
    bad = await rpc(web, {"jsonrpc": "2.0", "id": 4, "method": "ping"}, {"mcp-protocol-version": "1999-01-01"})
    assert bad.status_code == 400 and "'1999-01-01' is not supported" in bad.json()["error"]["message"]
    newer = await rpc(web, {"jsonrpc": "2.0", "id": 5, "method": "initialize",
                            "params": {"protocolVersion": "2099-01-01", "capabilities": {}}})
    assert newer.json()["result"]["protocolVersion"] == protocol.LATEST


# ---- the pipeline's rules hold on /mcp --------------------------------------------------------------


async def test_tokens_and_session_binding(config: Config, tmp_path: Any) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("team-a-token team-a-*\n")
    async with running(replace(config, http_port=free_port(), tokens_file=str(tokens), auth_token=TOKEN)) as app:
        ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
        none = await rpc(app, ping)
        assert none.status_code == 401 and none.headers["www-authenticate"].startswith("Bearer")
        assert none.json()["error"]["data"]["status"] == "UNAUTHENTICATED"
        # Garbage without a token is refused for the token first: nothing about the input leaks.
        assert (await rpc(app, b"{not json")).status_code == 401
        denied = await rpc(app, ping, {"authorization": "Bearer team-a-token", "x-uibus-session": "team-b-1"})
        assert denied.status_code == 403 and "may not use session 'team-b-1'" in denied.json()["error"]["message"]
        async with mcp_client(app, "team-a-1", token="team-a-token") as client:
            result = await client.call_tool("hello_world", chat_args("hi"))
            assert not result.is_error
        with pytest.raises(Exception):  # noqa: B017 - the SDK reports the refused handshake its own way
            async with mcp_client(app, "team-b-1", token="team-a-token") as client:
                pass
        page = app.metrics.render().decode()  # type: ignore[union-attr]
        assert 'uibus_rpc_duration_seconds_count{code="OK",method="/mcp/tools/call",transport="mcp"} 1.0' in page
        assert 'uibus_rpc_duration_seconds_count{code="PERMISSION_DENIED",method="/mcp/ping",transport="mcp"}' in page


async def test_notifications_cancelled_stops_a_running_call(web: App) -> None:
    """The JSON-RPC way to cancel (a client that keeps its connection open): the call ends with
    CANCELLED at once, the turn is not kept, and no call stays registered."""
    init = await rpc(web, {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                           "params": {"protocolVersion": "2025-06-18", "capabilities": {}}})
    headers = {"mcp-session-id": init.headers["mcp-session-id"], "mcp-protocol-version": "2025-06-18",
               "x-uibus-session": "mcp-cancel-rpc"}
    slow = asyncio.ensure_future(rpc(web, {"jsonrpc": "2.0", "id": "slow-1", "method": "tools/call", "params": {
        "name": "hello_world", "arguments": chat_args("slowly", sly_data={"delay_ms": 2000})}}, headers))
    await wait_for(lambda: _gauge(web, "uibus_mcp_calls_in_flight") == 1, timeout=3, what="the call running")
    # Another session's id cannot cancel it.
    other = {**headers, "mcp-session-id": "someone-else"}
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "slow-1"}}
    assert (await rpc(web, cancel, other)).status_code == 202
    await asyncio.sleep(0.1)
    assert not slow.done()
    started = asyncio.get_running_loop().time()
    assert (await rpc(web, cancel, headers)).status_code == 202
    answer = await asyncio.wait_for(slow, 3)
    assert asyncio.get_running_loop().time() - started < 1.0
    assert answer.status_code == 200 and answer.json()["error"]["data"]["status"] == "CANCELLED"
    assert answer.json()["id"] == "slow-1"
    assert _gauge(web, "uibus_mcp_calls_in_flight") == 0
    assert not (await web.core.history.load_context("mcp-cancel-rpc", "hello_world")).chat_histories


async def test_the_docs_example_config_connects(config: Config) -> None:
    """The Cline settings the MCP docs page shows (examples/mcp/cline_mcp_settings.json), used as they are
    but for the port: its headers carry the token and the session."""
    example = REPO / "examples" / "mcp" / "cline_mcp_settings.json"
    assert example.read_text() in (REPO / "docs" / "protocols" / "mcp.md").read_text()
    server = json.loads(example.read_text())["mcpServers"]["uibus"]
    assert server["type"] == "streamableHttp"
    token = server["headers"]["Authorization"].removeprefix("Bearer ")
    async with running(replace(config, http_port=free_port(), auth_token=token)) as app:
        address = server["url"].replace(":8080/", f":{app.http_port}/")
        async with httpx2.AsyncClient(headers=server["headers"]) as http, \
                Client(streamable_http_client(address, http_client=http)) as client:
            names = {t.name for t in (await client.list_tools()).tools}
            assert {"hello_world", "ask_user", *server["autoApprove"]} <= names
            told = await client.call_tool("notify_user", {"message": "hello from the example"})
    assert "session default" in told.content[0].text


async def test_a_waiting_call_streams_keep_alives_until_the_answer(web: App, web_connect: Any) -> None:
    """On the wire: the event stream opens as soon as the call is admitted, keeps the connection
    alive while the person thinks, and ends with the response as one `message` event."""
    web[MCP].keepalive_s = 0.1
    conn = web_connect("mcp-sse")
    [stream] = await open_uis(web, conn, 1, "mcp-sse")
    body = {"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "ask_user", "arguments": {
        "title": "Ready?", "kind": "confirm"}}}
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
               "x-uibus-session": "mcp-sse"}
    async with httpx.AsyncClient(timeout=10) as http, http.stream("POST", url(web), json=body,
                                                                   headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        lines = r.aiter_lines()
        priming = [await anext(lines) for _ in range(3)]  # an id and no data: resumable from the start
        assert priming[0].startswith("id: ") and priming[0].endswith(".1") and priming[1:] == ["data: ", ""]
        assert await anext(lines) == ": keep-alive"
        event = await next_request(stream)
        await ext(conn).Respond(pb.RespondRequest(id=event.request.id, confirmed=False))
        rest = [line async for line in lines]
    data = [json.loads(line.removeprefix("data: ")) for line in rest if line.startswith("data: ")]
    assert next(x for x in rest if x.startswith("event:")) == "event: message"
    assert data == [{"jsonrpc": "2.0", "id": 9, "result": {
        "content": [{"type": "text", "text": "The user declined."}], "isError": False,
        "structuredContent": {"outcome": "answered", "dialog_id": event.request.id, "confirmed": False}}}]
    stream.cancel()

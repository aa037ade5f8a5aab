"""JSON that is legal but poisonous, and replies without a bound: each row of the fuzz findings
(lone surrogates, non-finite and huge numbers, NaN tokens, open-enum numbers, a truncated client
stream, replies past the frame limit, 405s without Allow), answered with the status that says what
was wrong, on a real App over real HTTP, WebSocket, gRPC-Web and native gRPC channels.

Every test also asserts that no route let an exception escape (uvicorn's "Exception in ASGI
application") and that no handler failed (the pipeline's "handler failed"): the poison is refused
at the door, never discovered later in a writer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from tests.fuzzgen import strict_json
from tests.webclient import call
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.edge.codebolt.actions import MAX_STATE_BYTES
from uibus.edge.codebolt.gateway import MAX_MESSAGE_BYTES
from uibus.edge.transports.codebolt_ws import PATH as CODEBOLT
from uibus.pb.neuro_san.api.grpc import agent_pb2, agent_pb2_grpc, chat_pb2

SURROGATE = "\ud800"  # json.dumps writes it as the escape \ud800, which RFC 8259's grammar allows
CHAT = "/dev.cognizant_ai.neuro_san.api.grpc.agent.AgentService/StreamingChat"




@pytest.fixture(autouse=True)
def no_escapes(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Bad input never reaches uvicorn as an exception, nor a handler as a bug (INTERNAL)."""
    with caplog.at_level(logging.ERROR):
        yield
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR
           and (r.name.startswith("uvicorn") or r.getMessage() in ("handler failed", "codebolt reply not encodable"))]
    assert not bad, [f"{r.name}: {r.getMessage()}" for r in bad]


def base(app: App) -> str:
    return f"http://127.0.0.1:{app.http_port}"


async def mcp(http: httpx.AsyncClient, app: App, body: str | dict[str, Any], **headers: str) -> httpx.Response:
    data = body if isinstance(body, str) else json.dumps(body)
    return await http.post(f"{base(app)}/mcp", content=data.encode(),
                           headers={"content-type": "application/json", "accept": "application/json, text/event-stream",
                                    **headers})


def tool(name: str, arguments: dict[str, Any], ident: int = 7, **params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": ident, "method": "tools/call",
            "params": {"name": name, "arguments": arguments, **params}}


# ---- rows 1-4: /mcp ------------------------------------------------------------------------------

async def test_row1_a_poisoned_id_is_a_json_rpc_error_at_400(web: App, http: httpx.AsyncClient) -> None:
    r = await mcp(http, web, '{"jsonrpc":"2.0","id":"\\ud800","method":"ping"}')
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    body = strict_json(r.content)
    assert body["id"] is None and body["error"]["code"] == -32600 and "id" in body["error"]["message"]
    assert "surrogate" in body["error"]["message"]
    # on an event-stream call: the poisoned progress token is the request's invalid params, said at once
    r = await mcp(http, web, tool("set_status", {"key": "k"}, _meta={"progressToken": SURROGATE}))
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    body = strict_json(r.content)
    assert body["id"] == 7 and body["error"]["code"] == -32602
    assert "params._meta.progressToken" in body["error"]["message"]
    assert (await mcp(http, web, {"jsonrpc": "2.0", "id": 1, "method": "ping"})).json()["result"] == {}


@pytest.mark.parametrize("name,arguments,where", [
    ("set_status", {"key": SURROGATE}, "params.arguments.key"),
    ("notify_user", {"message": "a" + SURROGATE}, "params.arguments.message"),
    ("ask_user", {"title": "t", "options": ["x", SURROGATE]}, "params.arguments.options[1]"),
    ("hello_world", {"user_message": {"text": SURROGATE}}, "params.arguments.user_message.text"),
    ("ask_user", {SURROGATE: 1, "title": "t"}, "params.arguments.\\ud800"),
])
async def test_row2_every_text_argument_is_invalid_params(web: App, http: httpx.AsyncClient, name: str,
                                                         arguments: dict[str, Any], where: str) -> None:
    r = await mcp(http, web, tool(name, arguments))
    body = strict_json(r.content)
    assert r.status_code == 400 and body["id"] == 7 and body["error"]["code"] == -32602, body
    assert where in body["error"]["message"] and body["error"]["data"]["status"] == "INVALID_ARGUMENT"


@pytest.mark.parametrize("timeout", ["1e400", "-1e400", "1e30", "86401", "NaN", "Infinity", "0"])
async def test_row3_ask_user_timeouts_out_of_range(web: App, http: httpx.AsyncClient, timeout: str) -> None:
    r = await mcp(http, web, '{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"ask_user",'
                             f'"arguments":{{"title":"t","timeout_seconds":{timeout}}}}}}}')
    body = strict_json(r.content)
    assert body["id"] == 3 and body["error"]["code"] == -32602, body
    assert "timeout_seconds" in body["error"]["message"]


@pytest.mark.parametrize("request_id", [[1], {}, 1.5, None, True])
async def test_row4_cancelled_with_an_unhashable_id_is_ignored(web: App, http: httpx.AsyncClient,
                                                               request_id: Any) -> None:
    r = await mcp(http, web, {"jsonrpc": "2.0", "method": "notifications/cancelled",
                              "params": {"requestId": request_id}}, **{"mcp-session-id": "abc"})
    assert r.status_code == 202 and r.content == b""


# ---- row 5: non-finite numbers in a Struct, every way in ----------------------------------------

@pytest.mark.parametrize("sly", ["1e400", "-1e400", "NaN", "Infinity", "1" + "0" * 400])
async def test_row5_http_api_refuses_numbers_json_cannot_hold(web: App, http: httpx.AsyncClient, sly: str) -> None:
    r = await http.post(f"{base(web)}/api/v1/hello_world/streaming_chat",
                        content=f'{{"user_message":{{"text":"hi"}},"sly_data":{{"a":{sly}}}}}'.encode())
    assert r.status_code == 400, r.text
    body = strict_json(r.content)
    assert body["code"] == "INVALID_ARGUMENT" and "sly_data.a" in body["error"]


@pytest.mark.parametrize("number", [float("inf"), float("-inf"), float("nan")])
async def test_row5_native_and_grpc_web_struct_numbers_must_be_finite(web: App, web_connect: Callable[..., Connection],
                                                                      http: httpx.AsyncClient, number: float) -> None:
    request = agent_pb2.ChatRequest(user_message={"text": "hi"})
    request.sly_data.update({"ok": 1, "nested": {"list": [1, number]}})
    stub = agent_pb2_grpc.AgentServiceStub(web_connect().channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.StreamingChat(request, timeout=5):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sly_data.nested.list[1]" in (err.value.details() or "") and "finite" in (err.value.details() or "")
    reply = await call(http, base(web) + CHAT, request.SerializeToString())
    assert reply.status == 3 and "sly_data.nested.list[1]" in reply.message
    # a finite Struct still goes through, on the same connection
    fine = agent_pb2.ChatRequest(user_message={"text": "hi"})
    fine.sly_data.update({"a": 1.5e308})
    replies = [r async for r in stub.StreamingChat(fine, timeout=10)]
    assert replies and replies[-1].response.text


async def test_row5_mcp_agent_tool_refuses_them_too(web: App, http: httpx.AsyncClient) -> None:
    r = await mcp(http, web, '{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"hello_world",'
                             '"arguments":{"user_message":{"text":"hi"},"sly_data":{"a":1e400}}}}')
    body = strict_json(r.content)
    assert body["id"] == 5 and body["error"]["code"] == -32602 and "sly_data.a" in body["error"]["message"]


# ---- rows 6-8, 10: the CodeBolt socket ------------------------------------------------------------

class Agent:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws

    async def call(self, raw: str | dict[str, Any]) -> dict[str, Any]:
        await self.ws.send(raw if isinstance(raw, str) else json.dumps(raw))
        text = await asyncio.wait_for(self.ws.recv(), 5)
        return strict_json(text)  # type: ignore[no-any-return]


@pytest.fixture
async def agent(web: App) -> AsyncIterator[Callable[[str], Any]]:
    opened: list[ClientConnection] = []

    async def open_(session: str = "hj") -> Agent:
        ws = await ws_connect(f"ws://127.0.0.1:{web.http_port}{CODEBOLT}?session={session}", max_size=None)
        opened.append(ws)
        return Agent(ws)

    yield open_
    for ws in opened:
        await ws.close()


@pytest.mark.parametrize("frame_text", [
    '{"type":"getChatHistory","requestId":"\\ud800"}',
    '{"type":"chatEvent","action":"getChatHistory","requestId":"r","agentId":"\\udfff"}',
    '{"type":"\\ud800"}',
])
async def test_row6_a_poisoned_frame_is_answered(agent: Callable[[str], Any], frame_text: str) -> None:
    a = await agent()
    reply = await a.call(frame_text)
    assert reply["success"] is False and reply["code"] == "INVALID_ARGUMENT" and "surrogate" in reply["error"]
    ok = await a.call({"type": "chatEvent", "action": "getChatHistory", "requestId": "after"})
    assert ok["success"] is True and ok["requestId"] == "after"


@pytest.mark.parametrize("frame_obj", [
    {"type": "memoryEvent", "action": "memorySet", "requestId": "m", "message": {"key": "k", "value": SURROGATE}},
    {"type": "memoryEvent", "action": "memorySet", "requestId": "m", "message": {"key": SURROGATE, "value": 1}},
    {"type": "stateEvent", "action": "addToAgentState", "requestId": "s",
     "message": {"key": "k", "value": {"deep": [SURROGATE]}}},
    {"type": "chatEvent", "action": "sendMessage", "requestId": "c", "message": {"text": "x" + SURROGATE}},
])
async def test_row7_nothing_poisonous_is_stored(agent: Callable[[str], Any], frame_obj: dict[str, Any]) -> None:
    a, b = await agent(), await agent()
    reply = await a.call(frame_obj)
    assert reply["success"] is False and reply["code"] == "INVALID_ARGUMENT"
    # every later read answers, on this connection and another
    for conn in (a, b):
        state = await conn.call({"type": "stateEvent", "action": "getApplicationState", "requestId": "g"})
        assert state["success"] is True and state["data"]["agentState"] == {}
        memory = await conn.call({"type": "memoryEvent", "action": "memoryGet", "requestId": "r",
                                  "message": {"key": "k"}})
        assert memory["success"] is True and memory["data"]["found"] is False
        history = await conn.call({"type": "chatEvent", "action": "getChatHistory", "requestId": "h"})
        assert history["success"] is True and history["data"] == []


@pytest.mark.parametrize("value", ["1e400", "-1e400", "NaN", "Infinity", "-Infinity", "9" * 400])
async def test_row8_replies_are_always_json(agent: Callable[[str], Any], value: str) -> None:
    a = await agent()
    reply = await a.call('{"type":"memoryEvent","action":"memorySet","requestId":"m",'
                         f'"message":{{"key":"k","value":{value}}}}}')
    assert reply["success"] is False and reply["code"] == "INVALID_ARGUMENT" and "message.value" in reply["error"]
    memory = await a.call({"type": "memoryEvent", "action": "memoryGet", "requestId": "r", "message": {"key": "k"}})
    assert memory["success"] is True and memory["data"]["value"] is None
    big = await a.call('{"type":"memoryEvent","action":"memorySet","requestId":"m",'
                       '"message":{"key":"k","value":1.7976931348623157e308}}')
    assert big["success"] is True and big["value"] == 1.7976931348623157e308


async def test_row10_state_is_bounded_in_bytes_and_replies_by_the_frame_limit(web: App,
                                                                           agent: Callable[[str], Any]) -> None:
    a = await agent()
    chunk = "x" * (MAX_STATE_BYTES // 4)
    for i in range(3):
        reply = await a.call({"type": "stateEvent", "action": "addToAgentState", "requestId": f"p{i}",
                              "message": {"key": f"k{i}", "value": chunk}})
        assert reply["success"] is True, reply
    over = await a.call({"type": "stateEvent", "action": "addToAgentState", "requestId": "over",
                         "message": {"key": "k3", "value": chunk + chunk}})
    assert over["success"] is False and over["code"] == "RESOURCE_EXHAUSTED" and str(MAX_STATE_BYTES) in over["error"]
    # replacing a key counts its new size, not both
    again = await a.call({"type": "stateEvent", "action": "addToAgentState", "requestId": "again",
                          "message": {"key": "k0", "value": chunk}})
    assert again["success"] is True
    # the read carries the whole state (three times over, for codeboltjs) and stays under the frame limit
    await a.ws.send(json.dumps({"type": "stateEvent", "action": "getApplicationState", "requestId": "g"}))
    text = await asyncio.wait_for(a.ws.recv(), 5)
    assert isinstance(text, str) and len(text.encode()) < MAX_MESSAGE_BYTES
    assert strict_json(text)["success"] is True
    # a read past the frame limit answers a clear error: the chat history, at its 64 KiB per message
    for i in range(9):  # each entry goes out twice (data, and codeboltjs' `messages`): 1.15 MB
        sent = await a.call({"type": "chatEvent", "action": "sendMessage", "requestId": f"m{i}",
                             "message": {"text": "y" * 64_000}})
        assert sent["success"] is True
    history = await a.call({"type": "chatEvent", "action": "getChatHistory", "requestId": "h"})
    assert history["success"] is False and history["code"] == "RESOURCE_EXHAUSTED" and "limit" in history["error"]
    assert history["requestId"] == "h"
    few = await a.call({"type": "chatEvent", "action": "getChatHistory", "requestId": "h2", "limit": 3})
    assert few["success"] is True and len(few["data"]) == 3


# ---- row 9: a client stream whose framing is broken ----------------------------------------------

@pytest.mark.parametrize("service", ["grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"])
@pytest.mark.parametrize("body", [b"\x00\x00\x00", b"\x00\x00\x00\x00\x09abc", b"\x07"])
async def test_row9_truncated_grpc_web_client_stream(web: App, http: httpx.AsyncClient, service: str,
                                                     body: bytes) -> None:
    r = await http.post(f"{base(web)}/{service}/ServerReflectionInfo", content=body,
                        headers={"content-type": "application/grpc-web+proto", "x-grpc-web": "1"})
    status = r.headers.get("grpc-status")
    if status is None:  # the status went in a trailer frame
        assert b"grpc-status:3" in r.content.replace(b" ", b""), r.content
    else:
        assert status == "3", (status, r.headers.get("grpc-message"))
    ok = await call(http, f"{base(web)}/{service}/ServerReflectionInfo", b"\x3a\x00")  # list_services
    assert ok.status == 0 and ok.messages


# ---- row 11: the document says what is accepted --------------------------------------------------

async def test_row11_enums_are_their_names_and_the_numbers_that_exist(web: App, http: httpx.AsyncClient) -> None:
    doc = (await http.get(f"{base(web)}/api/v1/docs")).json()
    spelled, null = doc["components"]["schemas"]["ChatMessage"]["properties"]["type"]["anyOf"]
    assert null == {"type": "null"}  # proto3 JSON: null is an absent field
    numbers = next(s for s in spelled["anyOf"] if s.get("type") == "integer")
    defined = set(chat_pb2.ChatMessage.ChatMessageType.values())
    assert 2632 not in numbers["enum"] and set(numbers["enum"]) == defined
    for body in ({"user_message": {"type": 2632}},
                 {"user_message": {"text": "hi"}, "chat_context": {"chat_histories": [{"messages": [{"type": 77}]}]}}):
        r = await http.post(f"{base(web)}/api/v1/hello_world/streaming_chat", json=body)
        assert r.status_code == 400 and "is not a ChatMessageType" in r.json()["error"], r.text
    r = await http.post(f"{base(web)}/api/v1/hello_world/streaming_chat", json={"user_message": {"type": 2}})
    assert r.status_code == 200


# ---- row 12: a wrong method says which are right ------------------------------------------------

@pytest.mark.parametrize("method,path,allow", [
    ("TRACE", "/api/v1/list", "GET"), ("POST", "/api/v1/list", "GET"), ("DELETE", "/api/v1/docs", "GET, HEAD"),
    ("GET", "/api/v1/hello_world/streaming_chat", "POST"), ("PUT", "/api/v1/hello_world/function", "GET"),
    ("POST", "/healthz", "GET, HEAD"), ("PATCH", "/metrics", "GET, HEAD"), ("GET", "/mcp", "GET, POST, DELETE"),
])
async def test_row12_405_carries_allow(web: App, http: httpx.AsyncClient, method: str, path: str, allow: str) -> None:
    r = await http.request(method, base(web) + path)
    assert r.status_code == 405 and r.headers["allow"] == allow
    if path.startswith("/api/"):
        assert r.json()["error"].startswith(method)


def test_fuzz_findings_are_each_a_test_here() -> None:
    """The rows of the issue, so a reader can map each to its test (and none is dropped)."""
    rows = {int(name.split("_")[1][3:]) for name in globals() if name.startswith("test_row")}
    assert rows == set(range(1, 13)), sorted(rows)


"""The one call driver (uibus.edge.calls.drive) as every transport shows it, and answers on the HTTP port
that survive the connection's close.

* Unknown paths answer every time: a request answered before its body was read used to lose its
  answer to the TCP reset of the closing connection now and then (about 1 in 16 for a browser's
  gRPC-Web POST to `/`). Each try here is a fresh connection with `Connection: close` whose body
  goes out in a segment of its own after the headers, the case that raced.
* Deadlines are DEADLINE_EXCEEDED "Deadline Exceeded" on gRPC-Web and in-process; the HTTP API
  takes no timeout, so there a client's disconnect is what ends a call: its subscription ends at
  once and its done callbacks run exactly once, cancelled.
* An encoder failure is INTERNAL, the same on gRPC-Web and the HTTP API.

A test-only `probe.AgentService` (installed first, so the HTTP API's `/api/v1/probe/...` reaches it)
records each call's done callbacks and holds a real bus subscription while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

from tests.conftest import start_app, wait_for
from tests.webclient import call, frame
from uibus.app import App
from uibus.app.installers import CODEBOLT, INSTALLERS
from uibus.edge.wiring import Installer, Setup
from uibus.pb.cline import common_pb2
from uibus.pb.neuro_san.api.grpc import agent_pb2

PROBE = "/probe.AgentService/"
UI = "/cline.UiService/"
GRPC_WEB = "application/grpc-web+proto"


class Probe:
    """Handlers that wait until they are cancelled, and remember how their calls ended."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.finished: list[tuple[str, bool]] = []  # (method, ctx.cancelled()) per done callback
        self.ended: list[str] = []  # handlers whose own `finally` ran

    def _watch(self, method: str, context: Any) -> None:
        context.add_done_callback(lambda ctx: self.finished.append((method, ctx.cancelled())))

    async def Function(self, request: agent_pb2.FunctionRequest, context: Any) -> agent_pb2.FunctionResponse:
        """Waits for ever, subscribed (as a live call is), until its call is cancelled or timed out."""
        self._watch("Function", context)
        sub = self.setup.core.history.follow("probe", 4)
        try:
            await asyncio.Event().wait()
        finally:
            self.setup.core.bus.unsubscribe(sub)
            self.ended.append("Function")
        raise AssertionError("unreachable")

    async def StreamingChat(self, request: agent_pb2.ChatRequest, context: Any) -> AsyncIterator[Any]:
        """One message (the HTTP API's status line goes out with it), then waits subscribed."""
        self._watch("StreamingChat", context)
        sub = self.setup.core.history.follow("probe", 4)
        try:
            yield agent_pb2.ChatResponse()
            await asyncio.Event().wait()
        finally:
            self.setup.core.bus.unsubscribe(sub)
            self.ended.append("StreamingChat")

    async def Connectivity(self, request: agent_pb2.ConnectivityRequest, context: Any) -> Any:
        """A reply of the wrong type: no encoder takes it."""
        self._watch("Connectivity", context)
        return "not a ConnectivityResponse"


PROBES: list[Probe] = []


@asynccontextmanager
async def install_probe(setup: Setup) -> AsyncIterator[None]:
    probe = Probe(setup)
    PROBES.append(probe)
    methods = {
        "Function": grpc.unary_unary_rpc_method_handler(
            probe.Function, agent_pb2.FunctionRequest.FromString, agent_pb2.FunctionResponse.SerializeToString),
        "StreamingChat": grpc.unary_stream_rpc_method_handler(
            probe.StreamingChat, agent_pb2.ChatRequest.FromString, agent_pb2.ChatResponse.SerializeToString),
        "Connectivity": grpc.unary_unary_rpc_method_handler(
            probe.Connectivity, agent_pb2.ConnectivityRequest.FromString,
            agent_pb2.ConnectivityResponse.SerializeToString),
    }
    setup.registry.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("probe.AgentService", methods)])
    try:
        yield
    finally:
        PROBES.remove(probe)


@pytest.fixture
def installers() -> tuple[Installer, ...]:
    return (install_probe, *INSTALLERS)


@pytest.fixture
def probe(web: App) -> Probe:
    return PROBES[-1]


def url(app: App, path: str) -> str:
    return f"http://127.0.0.1:{app.http_port}{path}"


# ---- answers that survive the close ---------------------------------------------------------------

async def _exchange(port: int, method: str, path: str, content_type: str, body: bytes) -> bytes:
    """One request on its own connection (`Connection: close`), the body in a segment of its own
    after the headers; the whole answer up to the server's close. A reset raises."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        await asyncio.sleep(0)  # let the server see the headers alone first: the case that raced
        writer.write(body)
        await writer.drain()
        return await reader.read()  # to EOF
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _tries(n: int, port: int, method: str, path: str, content_type: str, body: bytes,
                 check: Callable[[bytes], bool], budget_s: float) -> None:
    resets: list[str] = []
    wrong: list[bytes] = []
    async with asyncio.timeout(budget_s):
        for _ in range(n):
            try:
                answer = await _exchange(port, method, path, content_type, body)
            except (ConnectionResetError, BrokenPipeError) as exc:
                resets.append(type(exc).__name__)
                continue
            if not check(answer):
                wrong.append(answer[:300])
    assert resets == [], f"{len(resets)} of {n} answers were reset away"
    assert wrong == [], f"{len(wrong)} of {n} answers were wrong, e.g. {wrong[0]!r}"


def _head(answer: bytes) -> tuple[str, dict[str, str]]:
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
    return head[0], {k.lower(): v for k, v in fields.items()}


def _grpc_status(answer: bytes, code: int) -> bool:
    status, fields = _head(answer)
    return status.startswith("HTTP/1.1 200") and fields.get("grpc-status") == str(code)


async def test_grpc_web_post_to_root_answers_unimplemented_every_time(web: App) -> None:
    body = frame(common_pb2.StringRequest(value="x" * 2000).SerializeToString())
    await _tries(1000, web.http_port, "POST", "/", GRPC_WEB, body,
                 lambda a: _grpc_status(a, grpc.StatusCode.UNIMPLEMENTED.value[0]), budget_s=120)


async def test_unknown_grpc_web_method_answers_every_time(web: App) -> None:
    body = frame(common_pb2.StringRequest(value="y" * 500).SerializeToString())
    await _tries(200, web.http_port, "POST", "/no.Such/Method", GRPC_WEB, body,
                 lambda a: _grpc_status(a, grpc.StatusCode.UNIMPLEMENTED.value[0]) and b"Method not found" in a,
                 budget_s=60)


async def test_unknown_http_api_path_answers_404_every_time(web: App) -> None:
    body = json.dumps({"user_message": {"text": "z" * 500}}).encode()

    def is_404(answer: bytes) -> bool:
        status, _ = _head(answer)
        return status.startswith("HTTP/1.1 404") and b"no such API endpoint" in answer

    await _tries(200, web.http_port, "POST", "/api/v1/probe/nothing_here", "application/json", body, is_404,
                 budget_s=60)


async def test_other_refusals_read_the_body_first(web: App) -> None:
    """The HTTP API's 405 and 400, a page route's 404 and MCP's refusal: each answered whole."""
    body = b"{" + b" " * 3000 + b"}"
    cases = [
        ("PUT", "/api/v1/list", "application/json", b"HTTP/1.1 405"),
        ("POST", "/api/v1/bad%20name!/streaming_chat", "application/json", b"HTTP/1.1 400"),
        ("POST", "/nowhere", "application/json", b"HTTP/1.1 404"),
        ("POST", "/mcp", "text/plain", b"HTTP/1.1 400"),
        ("PUT", "/mcp", "application/json", b"HTTP/1.1 405"),
    ]
    for method, path, ctype, status in cases:
        await _tries(50, web.http_port, method, path, ctype, body, lambda a, s=status: a.startswith(s), budget_s=30)


# ---- deadlines --------------------------------------------------------------------------------

async def test_grpc_web_deadline_is_deadline_exceeded_and_finishes_once(web: App, probe: Probe) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        reply = await call(http, url(web, PROBE + "Function"), agent_pb2.FunctionRequest().SerializeToString(),
                           headers={"grpc-timeout": "200m"})
    assert reply.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert reply.message == "Deadline Exceeded"
    await wait_for(lambda: probe.finished == [("Function", True)], what="the done callback, once, cancelled")
    assert probe.ended == ["Function"] and web.bus.count() == 0


async def test_grpc_web_stream_deadline(web: App) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        reply = await call(http, url(web, UI + "subscribeToTheme"), common_pb2.EmptyRequest().SerializeToString(),
                           headers={"x-uibus-session": "dl", "grpc-timeout": "200m"})
    assert reply.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and reply.message == "Deadline Exceeded"
    assert web.bus.count() == 0


async def test_in_process_deadlines(web: App, probe: Probe) -> None:
    channel = web.channel()
    function = channel.unary_unary(PROBE + "Function", agent_pb2.FunctionRequest.SerializeToString,
                                   agent_pb2.FunctionResponse.FromString)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await function(agent_pb2.FunctionRequest(), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and err.value.details() == "Deadline Exceeded"
    assert probe.finished == [("Function", True)] and probe.ended == ["Function"]

    themes = channel.unary_stream(UI + "subscribeToTheme", common_pb2.EmptyRequest.SerializeToString,
                                  common_pb2.String.FromString)
    got: list[Any] = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for message in themes(common_pb2.EmptyRequest(), timeout=0.3, metadata=[("x-uibus-session", "dl")]):
            got.append(message)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and err.value.details() == "Deadline Exceeded"
    assert web.bus.count() == 0


async def test_in_process_unknown_method_raises_when_iterated(web: App) -> None:
    stream = web.channel().unary_stream("/no.Such/Method")(b"")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await anext(stream)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


# ---- the HTTP API: disconnects and done callbacks ----------------------------------------------

async def test_http_api_stream_disconnect_ends_the_call_at_once(web: App, probe: Probe) -> None:
    """The HTTP API takes no timeout: a client that goes away is what ends a call. Its handler is
    cancelled at once (the subscription ends), and its done callbacks run exactly once."""
    async with httpx.AsyncClient(timeout=10) as http:
        async with http.stream("POST", url(web, "/api/v1/probe/streaming_chat"), json={}) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            assert json.loads(await anext(lines)) == {}
            await wait_for(lambda: web.bus.count(session="probe") == 1, what="subscribed")
    await wait_for(lambda: web.bus.count() == 0, timeout=1.0, what="the subscription ended at once")
    await wait_for(lambda: probe.finished == [("StreamingChat", True)], what="the done callback, once")
    await asyncio.sleep(0.1)
    assert probe.finished == [("StreamingChat", True)] and probe.ended == ["StreamingChat"]


async def test_http_api_unary_disconnect_runs_done_callbacks_once(web: App, probe: Probe) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=0.3)) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.get(url(web, "/api/v1/probe/function"))
    await wait_for(lambda: probe.finished == [("Function", True)], what="the done callback, once, cancelled")
    await asyncio.sleep(0.1)
    assert probe.finished == [("Function", True)] and probe.ended == ["Function"] and web.bus.count() == 0


async def test_shutdown_runs_done_callbacks_of_http_api_calls(web_config: Any, installers: Any) -> None:
    """A call the server itself ends (shutdown cancels the HTTP task) still finishes: its done
    callbacks run, once, cancelled (they were skipped when the HTTP API finished by hand)."""
    app = await start_app(web_config, installers)
    probe = PROBES[-1]
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            async with http.stream("POST", url(app, "/api/v1/probe/streaming_chat"), json={}) as resp:
                await anext(resp.aiter_lines())
                await app.aclose()
    finally:
        await app.aclose()
    assert probe.finished == [("StreamingChat", True)] and probe.ended == ["StreamingChat"]


# ---- encoder failures -------------------------------------------------------------------------

async def test_unencodable_reply_is_internal_everywhere(web: App, probe: Probe) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        reply = await call(http, url(web, PROBE + "Connectivity"), b"")
        assert reply.status == grpc.StatusCode.INTERNAL.value[0]
        assert reply.message.startswith("could not serialize the response")
        resp = await http.get(url(web, "/api/v1/probe/connectivity"))
        assert resp.status_code == 500 and resp.json()["code"] == "INTERNAL"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await web.channel().unary_unary(PROBE + "Connectivity")(b"")
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert probe.finished == [("Connectivity", False)] * 3


# ---- owned tasks ----------------------------------------------------------------------------------

async def test_codebolt_shutdown_leaves_no_task_behind(web: App) -> None:
    """The closings the CodeBolt gateway's shutdown hook starts belong to the gateway, whose
    teardown joins them: once the app has closed, none of its connection tasks runs."""
    async with ws_connect(f"ws://127.0.0.1:{web.http_port}/agent-to-app?session=own") as ws:
        await ws.send(json.dumps({"type": "chatEvent", "action": "waitforReply", "requestId": "w1",
                                  "message": {"text": "?"}}))
        await wait_for(lambda: web[CODEBOLT].pending() == 1, what="the wait is in flight")
        await web.aclose(grace=1.0)
        reply = json.loads(await asyncio.wait_for(ws.recv(), 3))
        assert reply["requestId"] == "w1" and reply["success"] is False
    left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("uibus-codebolt")]
    assert left == [] and web[CODEBOLT].count() == 0

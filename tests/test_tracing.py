"""OpenTelemetry traces (uibus.infra.telemetry), checked at real OTLP receivers on loopback.

The receivers decode the official opentelemetry-proto messages: one speaks OTLP/HTTP (protobuf,
aiohttp), one OTLP/gRPC (TraceService, grpc.aio). uibus is configured only by the standard
OTEL_* environment, callers send W3C `traceparent` the way instrumented clients do (grpc-js with
the metadata set, curl with the header), and the spans are read after the app closed (which
flushes its exporter).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.conftest import REPO, free_port, require, running, spawn, wait_for
from tests.ext_ui_helpers import open_uis, read
from tests.redisproc import redis_server
from tests.support import ext, scrape_text
from tests.test_chat_backends import serve
from uibus.clients.connection import Connection
from uibus.infra import telemetry
from uibus.infra.config import Config
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

pytestmark = pytest.mark.timeout(90)
__all__ = ["redis_server", "serve", "spawn"]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status: int
    links: list[tuple[str, str]]


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Received:
    """What a receiver was sent, decoded."""

    spans: list[Span] = field(default_factory=list)
    requests: int = 0

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        self.requests += 1
        for rs in request.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                           s.kind, _attrs(s.attributes), resource, s.status.code,
                                           [(link.trace_id.hex(), link.span_id.hex()) for link in s.links]))

    def named(self, prefix: str) -> list[Span]:
        return [s for s in self.spans if s.name.startswith(prefix)]

    def one(self, prefix: str) -> Span:
        found = self.named(prefix)
        assert len(found) == 1, (prefix, [s.name for s in self.spans])
        return found[0]

    def children(self, span: Span) -> list[Span]:
        return [s for s in self.spans if s.parent_id == span.span_id]


@asynccontextmanager
async def http_receiver() -> AsyncIterator[tuple[str, Received]]:
    """An OTLP/HTTP receiver: POST /v1/traces, protobuf."""
    got = Received()

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        got.add(trace_service_pb2.ExportTraceServiceRequest.FromString(await request.read()))
        return web.Response(body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}", got
    finally:
        await runner.cleanup()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, got: Received) -> None:
        self.got = got

    async def Export(self, request: Any, context: Any) -> Any:
        self.got.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@asynccontextmanager
async def grpc_receiver() -> AsyncIterator[tuple[str, Received]]:
    """An OTLP/gRPC receiver: opentelemetry.proto.collector.trace.v1.TraceService/Export."""
    got = Received()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(got), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"http://127.0.0.1:{port}", got
    finally:
        await server.stop(None)


@pytest.fixture
def otlp_http(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """OTEL_* for OTLP/HTTP; the endpoint is set by the test once its receiver runs."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "uibus-test")
    monkeypatch.setenv("POD_NAME", "uibus-0")
    yield
    assert telemetry.tracer is None  # the app that turned tracing on turned it off


def test_off_unless_configured() -> None:
    assert not telemetry.configured({})
    assert not telemetry.configured({"OTEL_SERVICE_NAME": "x"})
    assert telemetry.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"})
    assert telemetry.configured({"OTEL_TRACES_EXPORTER": "console"})
    assert not telemetry.configured({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"})
    assert not telemetry.configured({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"})
    assert telemetry.instance_id(3, {"POD_NAME": "uibus-7f9c"}) == "uibus-7f9c/worker-3"


async def test_off_makes_no_spans(config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(key, raising=False)
    async with running(config) as app:
        assert telemetry.tracer is None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                               metadata=(("traceparent", TRACEPARENT),))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_grpc_and_http_calls_continue_the_callers_trace_otlp_http(config: Config, otlp_http: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Native gRPC metadata and an HTTP header (curl) continue the caller's trace; one SERVER span
    per call with the RPC conventions' attributes; the resource names the pod."""
    curl = shutil.which("curl")
    require("curl", curl is not None)
    async with http_receiver() as (endpoint, got):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with running(replace(config, http_port=free_port())) as app:
            assert telemetry.tracer is not None
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), metadata=(
                    ("traceparent", TRACEPARENT), ("tracestate", "vendor=1"), ("baggage", "user=alice")))
            other = f"00-{'ab' * 16}-{'cd' * 8}-01"
            proc = await asyncio.create_subprocess_exec(
                curl, "-sS", "-H", f"traceparent: {other}", f"http://127.0.0.1:{app.http_port}/api/v1/list",
                stdout=subprocess.PIPE)
            out, _ = await proc.communicate()
            assert proc.returncode == 0 and b"agents" in out
        await asyncio.sleep(0)
    check = got.one("grpc.health.v1.Health/Check")
    assert (check.trace_id, check.parent_id, check.kind) == (TRACE_ID, PARENT_ID, trace_pb2.Span.SPAN_KIND_SERVER)
    assert check.attributes["rpc.system"] == "grpc"
    assert (check.attributes["rpc.service"], check.attributes["rpc.method"]) == ("grpc.health.v1.Health", "Check")
    assert check.attributes["rpc.grpc.status_code"] == 0 and check.attributes["uibus.transport"] == "grpc"
    assert check.resource["service.name"] == "uibus-test"
    assert check.resource["service.instance.id"].startswith("uibus-0/")
    (listed,) = [s for s in got.spans if s.name.endswith("ConciergeService/List")]
    assert (listed.trace_id, listed.parent_id) == ("ab" * 16, "cd" * 8)
    assert listed.attributes["uibus.transport"] == "http"
    assert listed.attributes["http.route"] == "/api/v1/list"


async def test_a_dialog_is_a_span_in_the_asking_calls_trace_otlp_grpc(config: Config, otlp_http: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """ExtensionUiService: ask (Select) → a UI answers → the dialog's span, child of the asking
    call's span, with kind, outcome, the wait and the answering transport; /metrics has the wait."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    async with grpc_receiver() as (endpoint, got):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with running(replace(config, http_port=free_port())) as app, \
                Connection(f"127.0.0.1:{app.port}", session="dlg") as conn:
            (ui,) = await open_uis(app, conn, 1, "dlg")
            ask = asyncio.ensure_future(ext(conn).Select(pb.SelectRequest(title="Deploy?", options=["yes", "no"]),
                                                         metadata=(("traceparent", TRACEPARENT),)))
            asked = (await read(ui, 10)).request
            await asyncio.sleep(0.05)
            await ext(conn).Respond(pb.RespondRequest(id=asked.id, value="yes"))
            assert (await ask).value == "yes"
            timed = await ext(conn).Confirm(pb.ConfirmRequest(title="Sure?", timeout_ms=50),
                                            metadata=(("traceparent", TRACEPARENT),))
            assert timed.outcome == pb.DIALOG_OUTCOME_TIMED_OUT
            metrics = await scrape_text(app)
    call = got.one("uibus.v1.ExtensionUiService/Select")
    assert (call.trace_id, call.parent_id) == (TRACE_ID, PARENT_ID)
    (dialog,) = [s for s in got.children(call) if s.name == "dialog select"]
    assert dialog.trace_id == TRACE_ID
    assert dialog.attributes["uibus.dialog.kind"] == "select"
    assert dialog.attributes["uibus.dialog.outcome"] == "answered"
    assert dialog.attributes["uibus.dialog.answered_via"] == "grpc"
    assert dialog.attributes["uibus.dialog.wait_s"] >= 0.05
    confirm = got.one("dialog confirm")
    assert confirm.attributes["uibus.dialog.outcome"] == "timed_out"
    assert "uibus.dialog.answered_via" not in confirm.attributes
    assert 'uibus_dialog_wait_seconds_count{kind="select",outcome="answered"} 1.0' in metrics
    assert 'uibus_dialog_wait_seconds_count{kind="confirm",outcome="timed_out"} 1.0' in metrics


ACP_DIR = REPO / "tests" / "acp"


@pytest.mark.node
async def test_the_span_tree_of_a_hosted_agent_turn_with_a_permission(config: Config, tmp_path: Path,
                                                                      otlp_http: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The ACP fixture agent's tour: call → chat turn → agent process start, its tool calls (from
    its own tool_call / tool_call_update events) and the permission dialog (answered at a UI,
    with its wait) → the reply."""
    from tests.chatkit import MAXIMAL, Agent, request
    from tests.pikit import hosting
    from tests.test_acp_agent import fixture_agent

    require("the ACP SDK (npm ci --prefix tests/acp)", (ACP_DIR / "node_modules" / "@agentclientprotocol").is_dir(),
            "node")
    async with http_receiver() as (endpoint, got):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with hosting(config, tmp_path, [fixture_agent(tmp_path)], http_port=free_port()) as app, \
                Connection(f"127.0.0.1:{app.port}", session="tour") as conn:
            (ui,) = await open_uis(app, conn, 1, "tour")

            async def chat() -> list[Any]:
                stream = Agent(conn, "acp").StreamingChat(request("tour", filter_type=MAXIMAL),
                                                          metadata=(("traceparent", TRACEPARENT),))
                return [r async for r in stream]
            call = asyncio.ensure_future(chat())
            asked = (await read(ui, 30)).request
            await ext(conn).Respond(pb.RespondRequest(id=asked.id, value="Allow"))
            responses = await asyncio.wait_for(call, 30)
            assert responses[-1].response.text == "Permission: allow."
    server = got.one("acp.AgentService/StreamingChat")
    assert (server.trace_id, server.parent_id) == (TRACE_ID, PARENT_ID)
    (turn,) = [s for s in got.children(server) if s.name == "chat turn acp"]
    assert turn.attributes["uibus.agent.backend"] == "acp"
    assert turn.attributes["uibus.chat.outcome"] == "completed"
    assert turn.attributes["uibus.chat.pieces"] == len(responses)
    under = {s.name: s for s in got.children(turn)}
    assert "agent process start acp" in under
    assert under["agent process start acp"].attributes["process.pid"] > 0
    tools = sorted((s.attributes["gen_ai.tool.call.id"], s.attributes["uibus.tool.status"])
                   for s in got.children(turn) if s.name.startswith("tool "))
    assert tools == [("cmd-1", "completed"), ("read-1", "completed")]
    dialog = under["dialog select"]
    assert dialog.attributes["uibus.dialog.outcome"] == "answered"
    assert dialog.attributes["uibus.dialog.answered_via"] == "grpc"
    assert dialog.attributes["uibus.dialog.wait_s"] > 0
    assert all(s.trace_id == TRACE_ID for s in got.spans if s.name in under)


@pytest.mark.redis
async def test_across_two_replicas_the_trace_travels_in_the_bus_envelope(redis_server: Any, tmp_path: Path,
                                                                        otlp_http: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A dialog asked on replica A is shown by a UI on replica B and answered there: the request's
    delivery on B is a child of A's publish (one publish span, one receive span), the answer B
    forwards to A is in the answering call's trace, and A's dialog span says the answer came by
    gRPC."""
    from tests.test_dialog_replicas import Replica
    from tests.test_redis_replicas import two_replicas

    answer_trace, answer_parent = "cd" * 16, "ef" * 8
    async with http_receiver() as (endpoint, got):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with two_replicas(redis_server.url, tmp_path, Replica) as (a, b):
            ui_b = await b.ui("x")
            ask = asyncio.ensure_future(a.ext("x").Confirm(pb.ConfirmRequest(title="Deploy?", timeout_ms=10_000),
                                                           metadata=(("traceparent", TRACEPARENT),)))
            asked = (await ui_b.next(5)).request
            await b.ext("x").Respond(pb.RespondRequest(id=asked.id, confirmed=True),
                                     metadata=(("traceparent", f"00-{answer_trace}-{answer_parent}-01"),))
            assert (await ask).confirmed
    ext_ui = "uibus.v1.ExtensionUiService"
    confirm = got.one(f"{ext_ui}/Confirm")
    assert confirm.trace_id == TRACE_ID
    # The request to the UIs: published once on A (a child of the call), received once on B.
    (publish,) = [s for s in got.children(confirm) if s.name.startswith("publish ")]
    assert publish.kind == trace_pb2.Span.SPAN_KIND_PRODUCER
    (receive,) = got.children(publish)
    assert receive.kind == trace_pb2.Span.SPAN_KIND_CONSUMER and receive.name.startswith("receive ")
    assert receive.trace_id == TRACE_ID
    # The answer: B's call publishes it to A, and A's delivery is in the answering trace.
    respond = got.one(f"{ext_ui}/Respond")
    assert (respond.trace_id, respond.parent_id) == (answer_trace, answer_parent)
    forwards = [s for s in got.children(respond) if s.name.startswith("publish ")]
    assert forwards and all(any(r.name.startswith("receive ") for r in got.children(f)) for f in forwards[:1])
    # The store: the waiting dialog's shared entry is written to Redis inside the asking call.
    stored = [s for s in got.spans if s.name.startswith("redis ") and s.trace_id == TRACE_ID]
    assert stored and all(s.kind == trace_pb2.Span.SPAN_KIND_CLIENT for s in stored), [s.name for s in got.spans]
    assert all(s.attributes["db.system.name"] == "redis" for s in stored)
    dialog = got.one("dialog confirm")
    assert dialog.trace_id == TRACE_ID and dialog.parent_id == confirm.span_id
    assert dialog.attributes["uibus.dialog.outcome"] == "answered"
    assert dialog.attributes["uibus.dialog.answered_via"] == "grpc"


@pytest.mark.browser
async def test_an_mcp_ask_user_answered_at_the_page_says_grpc_web(config: Config, browser: Any, otlp_http: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An MCP agent's `ask_user` (its HTTP request carrying a traceparent) is answered by a click in
    headless Chromium: the MCP call continues the agent's trace, and its dialog's span says the
    answer came by gRPC-Web."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    from tests.test_web_browser import STREAMS_PER_PAGE, WITHIN

    async with http_receiver() as (endpoint, got):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with running(replace(config, http_port=free_port())) as app:
            page = await browser.new_page()
            await page.goto(f"http://127.0.0.1:{app.http_port}/?session=mcp-page")
            await wait_for(lambda: app.bus.count(session="mcp-page") == STREAMS_PER_PAGE, timeout=5,
                           what="page subscribed")
            headers = {"x-uibus-session": "mcp-page", "traceparent": TRACEPARENT}
            async with httpx2.AsyncClient(headers=headers) as http, \
                    Client(streamable_http_client(f"http://127.0.0.1:{app.http_port}/mcp", http_client=http)) as mcp:
                asked = asyncio.ensure_future(mcp.call_tool("ask_user", {"title": "Ship it?",
                                                                         "options": ["ship", "wait"]}))
                await page.wait_for_selector('.dialog[data-kind="select"] h3:text("Ship it?")', timeout=WITHIN)
                await page.click('.dialog[data-kind="select"] button:text("ship")')
                result = await asyncio.wait_for(asked, 5)
                assert result.content[0].text == "ship"
            await page.close()
    dialog = got.one("dialog select")
    assert dialog.trace_id == TRACE_ID
    assert dialog.attributes["uibus.dialog.outcome"] == "answered"
    assert dialog.attributes["uibus.dialog.answered_via"] == "grpc-web"
    (asking,) = [s for s in got.spans if s.span_id == dialog.parent_id]
    assert asking.attributes["uibus.transport"] == "mcp" and asking.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert asking.attributes["http.route"] == "/mcp"
    (answering,) = [s for s in got.spans if s.name.endswith("ExtensionUiService/Respond")]
    assert answering.attributes["uibus.transport"] == "grpc-web"
    assert answering.attributes["http.route"].endswith("/uibus.v1.ExtensionUiService/Respond")


async def test_a_modern_mcp_request_joins_the_trace_its_meta_names(config: Config, otlp_http: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """MCP 2026-07-28 carries trace context in `params._meta` (no header needed): the call's span
    continues that trace."""
    import httpx

    from tests.test_mcp_modern import headers, meta

    async with http_receiver() as (endpoint, got):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with running(replace(config, http_port=free_port())) as app, httpx.AsyncClient(timeout=10) as http:
            body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": meta(
                traceparent=TRACEPARENT, tracestate="vendor=1")}}
            answer = await http.post(f"http://127.0.0.1:{app.http_port}/mcp", json=body,
                                     headers=headers("tools/list"))
            assert answer.json()["result"]["resultType"] == "complete"
    (listed,) = [s for s in got.spans if s.attributes.get("uibus.transport") == "mcp"]
    assert (listed.trace_id, listed.parent_id) == (TRACE_ID, PARENT_ID)
    assert listed.kind == trace_pb2.Span.SPAN_KIND_SERVER


@pytest.mark.node
async def test_a_grpc_js_clients_unary_call_and_stream_join_its_trace(config: Config, otlp_http: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """grpc-js (the pinned @grpc/grpc-js) sends `traceparent` as metadata: the unary call and the
    server stream are SERVER spans in its trace; the stream's span ends when the client cancels,
    saying so."""
    node = shutil.which("node")
    here = REPO / "tests" / "grpcjs"
    require("the pinned @grpc/grpc-js (bash .ci/setup)", node is not None and (
        here / "node_modules" / "@grpc" / "grpc-js").is_dir(), "node")
    async with http_receiver() as (endpoint, got):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with running(config) as app:
            proc = await asyncio.create_subprocess_exec(node, str(here / "traced.js"), f"127.0.0.1:{app.port}", "js",
                                                        TRACEPARENT, stdout=subprocess.PIPE)
            out, _ = await asyncio.wait_for(proc.communicate(), 30)
            assert json.loads(out) == {"subscribers": 1, "got": "traced"}
            await wait_for(lambda: app.bus.count(session="js") == 0, what="the cancelled stream gone")
    publish = got.one("uibus.v1.HostService/PublishAddToInput")
    stream = got.one("cline.UiService/subscribeToAddToInput")
    for span in (publish, stream):
        assert (span.trace_id, span.parent_id) == (TRACE_ID, PARENT_ID)
        assert span.attributes["uibus.session"] == "js"
    assert publish.attributes["uibus.call.end"] == "completed"
    assert stream.attributes["uibus.call.end"] == "cancelled"
    assert stream.attributes["rpc.grpc.status_code"] == 1


async def test_the_codebolt_websocket_upgrade_carries_the_trace(config: Config, otlp_http: None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The CodeBolt agent's WebSocket upgrade sends `traceparent`: the connection's admission and
    every frame it sends are SERVER spans in that trace (transport websocket)."""
    from websockets.asyncio.client import connect as ws_connect

    from uibus.edge.transports.codebolt_ws import PATH

    async with http_receiver() as (endpoint, got):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with running(replace(config, http_port=free_port())) as app:
            async with ws_connect(f"ws://127.0.0.1:{app.http_port}{PATH}?session=cb",
                                  additional_headers={"traceparent": TRACEPARENT}) as ws:
                await ws.send(json.dumps({"type": "chatEvent", "action": "sendMessage", "requestId": "r1",
                                          "message": {"message": "hello"}}))
                reply = json.loads(await asyncio.wait_for(ws.recv(), 5))
                assert reply["success"] is True, reply
    spans = [s for s in got.spans if s.attributes.get("uibus.transport") == "websocket"]
    assert len(spans) >= 2, [s.name for s in got.spans]  # the admission and the frame
    assert all((s.trace_id, s.parent_id, s.kind) == (TRACE_ID, PARENT_ID, trace_pb2.Span.SPAN_KIND_SERVER)
               for s in spans)
    assert any(s.name.endswith("sendMessage") for s in spans), [s.name for s in spans]


async def test_a_model_backend_request_continues_the_trace_and_logs_name_it(
        config: Config, serve: Any, tmp_path: Path, otlp_http: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OpenAI-compatible backend's HTTP request is a CLIENT span under the chat turn, and the
    model server receives its traceparent (an instrumented backend joins the trace). A log line
    written inside a traced call (uibus's JSON lines) carries its trace_id / span_id."""
    import logging

    from tests.chatkit import MAXIMAL, Agent, request, write_agents
    from tests.test_chat_backends import openai_agent, sse_handler
    from uibus.infra.logs import JsonFormatter

    class Lines(logging.Handler):  # formats as it is written, as the server's stderr handler does
        def __init__(self) -> None:
            super().__init__()
            self.setFormatter(JsonFormatter())
            self.lines: list[dict[str, Any]] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(json.loads(self.format(record)))

    up = await serve("/v1/chat/completions", sse_handler(["The ", "answer."]))
    agents = write_agents(tmp_path, [openai_agent(up), {"name": "down", "backend": "openai", "options": {
        "base_url": f"http://127.0.0.1:{free_port()}/v1", "model": "m1"}}])
    lines = Lines()
    logger = logging.getLogger("uibus.chat")
    logger.addHandler(lines)
    try:
        async with http_receiver() as (endpoint, got):
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
            async with running(replace(config, agents=agents)) as app, Connection(f"127.0.0.1:{app.port}") as conn:
                for agent in ("gpt", "down"):
                    stream = Agent(conn, agent).StreamingChat(request("hi", filter_type=MAXIMAL),
                                                              metadata=(("traceparent", TRACEPARENT),))
                    replies = [r async for r in stream]
                assert replies[-1].response.text.startswith("Error from down:")
    finally:
        logger.removeHandler(lines)
    turn = got.one("chat turn gpt")
    (post,) = [s for s in got.children(turn) if s.kind == trace_pb2.Span.SPAN_KIND_CLIENT]
    assert post.attributes["http.request.method"] == "POST" and post.attributes["http.response.status_code"] == 200
    assert up.headers[0]["traceparent"] == f"00-{TRACE_ID}-{post.span_id}-01"
    down = got.one("chat turn down")
    assert down.attributes["uibus.chat.outcome"] == "agent_error" and down.status == 2
    (failed,) = [line for line in lines.lines if line["msg"] == "agent failed"]
    assert failed["trace_id"] == TRACE_ID and failed["span_id"] == down.span_id


@pytest.mark.node
async def test_the_span_tree_of_a_pi_turn_whose_tool_call_a_person_blocked(config: Config, tmp_path: Path,
                                                                          otlp_http: None,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """pi in RPC mode (its extension gates dangerous commands): call → chat turn → the bash tool
    call (from pi's tool_execution_* events; failed: blocked) and the gate's dialog (answered
    "Block" at a UI, with its wait) → the reply."""
    from tests.chatkit import MAXIMAL, Agent, request
    from tests.pikit import PI, Reply, hosting, pi_agent, scripted_model

    require("the pinned pi agent (npm ci --prefix tests/pi)", PI.exists(), "node")
    blocked = "rm -rf victim && echo gone"
    async with scripted_model() as model, http_receiver() as (endpoint, got):
        model.script(Reply(text="Let me clean up. ", tool=("bash", {"command": blocked})),
                     Reply(text="It was blocked."))
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with hosting(config, tmp_path, [pi_agent(tmp_path, model)]) as app, \
                Connection(f"127.0.0.1:{app.port}", session="gate") as conn:
            (ui,) = await open_uis(app, conn, 1, "gate")

            async def chat() -> list[Any]:
                stream = Agent(conn, "pi").StreamingChat(request("clean up", filter_type=MAXIMAL),
                                                         metadata=(("traceparent", TRACEPARENT),))
                return [r async for r in stream]
            call = asyncio.ensure_future(chat())
            gate = (await read(ui, 30)).request
            await asyncio.sleep(0.05)
            await ext(conn).Respond(pb.RespondRequest(id=gate.id, value="Block"))
            responses = await asyncio.wait_for(call, 30)
            assert responses[-1].response.text == "Let me clean up. \n\nIt was blocked."
    server = got.one("pi.AgentService/StreamingChat")
    assert (server.trace_id, server.parent_id) == (TRACE_ID, PARENT_ID)
    (turn,) = got.children(server)
    assert turn.name == "chat turn pi" and turn.attributes["uibus.agent.backend"] == "rpc"
    under = {s.name: s for s in got.children(turn)}
    tool = under["tool bash"]
    assert tool.attributes["uibus.tool.status"] == "failed" and tool.status == 2
    assert tool.attributes["uibus.tool.duration_s"] >= 0.05  # it waited for the person
    dialog = under["dialog select"]
    assert dialog.attributes["uibus.dialog.outcome"] == "answered"
    assert dialog.attributes["uibus.dialog.answered_via"] == "grpc"
    assert dialog.attributes["uibus.dialog.wait_s"] >= 0.05


async def test_with_tokens_the_spans_name_who_asked_and_who_answered(config: Config, tmp_path: Path,
                                                                     otlp_http: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With --tokens-file, a call's span names its token (`enduser.id`) and a dialog's span names
    the token of the UI that answered it: the audit trail of who allowed what."""
    tokens = tmp_path / "tokens"
    tokens.write_text("agent-secret team-*\nui-secret team-*\n")
    async with grpc_receiver() as (endpoint, got):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with running(replace(config, tokens_file=str(tokens))) as app, \
                Connection(f"127.0.0.1:{app.port}", session="team-a", token="agent-secret") as agent, \
                Connection(f"127.0.0.1:{app.port}", session="team-a", token="ui-secret") as person:
            (ui,) = await open_uis(app, person, 1, "team-a")
            ask = asyncio.ensure_future(ext(agent).Confirm(pb.ConfirmRequest(title="Push to main?")))
            asked = (await read(ui, 10)).request
            await ext(person).Respond(pb.RespondRequest(id=asked.id, confirmed=False))
            assert not (await ask).confirmed
    confirm = got.one("uibus.v1.ExtensionUiService/Confirm")
    assert confirm.attributes["enduser.id"] == "--tokens-file line 1"
    dialog = got.one("dialog confirm")
    assert dialog.attributes["uibus.dialog.outcome"] == "answered"
    assert dialog.attributes["uibus.dialog.answered_by"] == "--tokens-file line 2"
    assert got.one("uibus.v1.ExtensionUiService/Respond").attributes["enduser.id"] == "--tokens-file line 2"


async def test_a_caller_that_sampled_its_trace_out_gets_no_spans(config: Config, otlp_http: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The default sampler follows the caller: `traceparent` flags 00 means no span of that call
    (nor of the stream and turn it started) is recorded, and the calls work as ever."""
    from tests.chatkit import MAXIMAL, Agent, request

    unsampled = f"00-{TRACE_ID}-{PARENT_ID}-00"
    async with http_receiver() as (endpoint, got):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with running(config) as app, Connection(f"127.0.0.1:{app.port}") as conn:
            md = (("traceparent", unsampled),)
            replies = [r async for r in Agent(conn, "").StreamingChat(request("hi", filter_type=MAXIMAL), metadata=md)]
            assert replies[-1].response.text
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), metadata=md)
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())  # a root: sampled
    assert [s.name for s in got.spans] == ["grpc.health.v1.Health/Check"]
    assert got.spans[0].trace_id != TRACE_ID


async def test_a_traced_page_of_an_allowed_origin_may_send_trace_headers(config: Config) -> None:
    """CORS: a page (an OpenTelemetry-instrumented web app) of an allowed origin may send
    traceparent, tracestate and baggage with its gRPC-Web calls."""
    import httpx

    async with running(replace(config, http_port=free_port(), cors_origins="http://allowed.test")) as app, \
            httpx.AsyncClient() as http:
        pre = await http.options(f"http://127.0.0.1:{app.http_port}/cline.UiService/scrollToSettings", headers={
            "origin": "http://allowed.test", "access-control-request-method": "POST",
            "access-control-request-headers": "content-type,x-grpc-web,traceparent,tracestate,baggage"})
    assert pre.status_code == 204
    allowed = {h.strip() for h in pre.headers["access-control-allow-headers"].split(",")}
    assert {"traceparent", "tracestate", "baggage"} <= allowed


async def test_settings_that_cannot_work_stop_the_start_with_a_clear_error(config: Config,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from uibus.infra.errors import ConfigError

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ConfigError, match="carrier-pigeon"):
        async with running(config):
            pass
    assert telemetry.tracer is None


@pytest.mark.redis
async def test_each_worker_is_its_own_service_instance(spawn: Any, redis_server: Any) -> None:
    """`uibus serve --workers 2` with OTEL_* set: each worker exports as its own
    `service.instance.id` (the pod's name and the worker index), and what it exported before
    SIGTERM arrives."""
    import signal

    from tests.test_workers import fresh_channel, parent_line

    async with http_receiver() as (endpoint, got):
        server = spawn("--workers", "2", "--redis-url", redis_server.url, "--grace-seconds", "1", "--port", "0",
                       "--http-port", str(free_port()), env={
                           "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                           "OTEL_BSP_SCHEDULE_DELAY": "50", "POD_NAME": "uibus-7f9c"})
        line = '"uibus.app.workers", "msg": "serving"'
        await wait_for(lambda: line in server.log.read_text() or server.proc.poll() is not None, 15,
                       "the parent's line")
        server.target = parent_line(server, "serving")["grpc"]
        seen: set[str] = set()
        for _ in range(40):
            async with fresh_channel(server.target) as channel:
                call = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                 metadata=(("traceparent", TRACEPARENT),))
                seen.add((await call.initial_metadata())["x-uibus-worker"])
                await call
            if len(seen) == 2:
                break
        assert seen == {"0", "1"}
        lines = [json.loads(x) for x in server.log.read_text().splitlines() if x.startswith("{")]
        tracing = sorted(x["tracing"]["service.instance.id"] for x in lines if x["msg"] == "serving" and "worker" in x)
        assert tracing == ["uibus-7f9c/worker-0", "uibus-7f9c/worker-1"]  # the workers' "serving" lines say so
        server.proc.send_signal(signal.SIGTERM)
        await wait_for(lambda: server.proc.poll() is not None, 15, "the parent to exit")
        assert server.proc.returncode == 0
    checks = [s for s in got.spans if s.name == "grpc.health.v1.Health/Check" and s.trace_id == TRACE_ID]
    assert {s.resource["service.instance.id"] for s in checks} == {"uibus-7f9c/worker-0", "uibus-7f9c/worker-1"}
    assert {s.resource["service.name"] for s in checks} == {"uibus"}

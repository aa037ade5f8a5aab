"""gRPC-Web on the HTTP port, from Python over real HTTP (httpx): every edge case of the adapter.

The real UiService/HostService are used wherever they show the case; a small test-only service
(installed the same way every uibus service is) covers what no shipped RPC does on demand:
an empty OK stream, an error after some messages, and metadata echoed both ways.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import grpc
import httpx
import pytest

from tests.conftest import free_port, wait_for
from tests.webclient import call, call_stream, frame
from uibus.app import App
from uibus.app.installers import INSTALLERS
from uibus.edge.wiring import Installer, Setup
from uibus.infra.config import Config
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2

UI = "/cline.UiService/"
EDGE = "/test.Edge/"
_S = common_pb2.String


class EdgeService:
    """Test-only servicer: shapes of streams the shipped services do not produce on demand."""

    async def Empty(self, request: _S, context: grpc.aio.ServicerContext) -> AsyncIterator[_S]:
        if False:
            yield request

    async def FailAfter(self, request: _S, context: grpc.aio.ServicerContext) -> AsyncIterator[_S]:
        for i in range(int(request.value)):
            yield _S(value=f"m{i}")
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "broke after messages: ünïcode & 100%")

    async def Echo(self, request: _S, context: grpc.aio.ServicerContext) -> _S:
        md = dict(context.invocation_metadata())
        await context.send_initial_metadata([("x-echo-session", md.get("x-uibus-session", "?"))])
        context.set_trailing_metadata([("x-echo-auth", md.get("authorization", "none")),
                                       ("x-echo-bin", b"\x00\x01bin")])
        return _S(value=f"{request.value}|{md.get('x-custom', '')}|{md.get('x-blob-bin', b'')!r}")

    async def Written(self, request: _S, context: grpc.aio.ServicerContext) -> None:
        for i in range(3):
            await context.write(_S(value=f"w{i}"))


@asynccontextmanager
async def install_edge(setup: Setup) -> AsyncIterator[None]:
    """Installer of the test-only test.Edge service."""
    svc = EdgeService()
    kw = {"request_deserializer": _S.FromString, "response_serializer": _S.SerializeToString}
    setup.registry.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Edge", {
        "Empty": grpc.unary_stream_rpc_method_handler(svc.Empty, **kw),
        "FailAfter": grpc.unary_stream_rpc_method_handler(svc.FailAfter, **kw),
        "Echo": grpc.unary_unary_rpc_method_handler(svc.Echo, **kw),
        "Written": grpc.unary_stream_rpc_method_handler(svc.Written, **kw),
    })])
    yield


EDGE_INSTALLERS = (*INSTALLERS, install_edge)


async def _start(cfg: Config) -> App:
    app = App(cfg, installers=EDGE_INSTALLERS)
    await app.start()
    return app


@pytest.fixture
def installers() -> tuple[Installer, ...]:
    """Every App built here also serves test.Edge (edge cases no real service has)."""
    return EDGE_INSTALLERS


def url(app: App, path: str) -> str:
    return f"http://127.0.0.1:{app.http_port}{path}"


async def test_unary(web: App, http: httpx.AsyncClient) -> None:
    reply = await call(http, url(web, UI + "scrollToSettings"),
                       common_pb2.StringRequest(value="general").SerializeToString())
    assert reply.http_status == 200
    assert reply.headers["content-type"] == "application/grpc-web+proto"
    assert reply.status == 0, reply.message
    kv = common_pb2.KeyValuePair.FromString(reply.messages[0])
    assert (kv.key, kv.value) == ("scrollToSettings", "general")
    assert len(reply.messages) == 1 and reply.trailers["grpc-status"] == "0"  # trailer frame, not headers


async def test_live_stream_delivers_each_message_as_published(web: App, http: httpx.AsyncClient, web_connect) -> None:
    host = web_connect(session="live").host
    stream = call_stream(http, url(web, UI + "subscribeToPartialMessage"),
                         common_pb2.EmptyRequest().SerializeToString(), headers={"x-uibus-session": "live"})
    kind, _reply = await anext(stream)
    assert kind == "headers"
    await wait_for(lambda: web.bus.count(session="live") == 1, what="gRPC-Web subscription")
    published, arrived = [], []
    for i in range(4):
        published.append(time.monotonic())
        await host.PublishPartialMessage(ui_pb2.ClineMessage(ts=1000, type=ui_pb2.SAY, text="x" * (i + 1),
                                                             partial=i < 3))
        kind, payload = await asyncio.wait_for(anext(stream), 2)
        arrived.append(time.monotonic())
        assert kind == "message"
        assert ui_pb2.ClineMessage.FromString(payload).text == "x" * (i + 1)
        await asyncio.sleep(0.15)  # the next publish happens only after this message was received
    gaps = [round((a - p) * 1000, 1) for p, a in zip(published, arrived, strict=True)]
    print(f"\npublish->browser latency per message (ms): {gaps}; "
          f"inter-arrival (ms): {[round((b - a) * 1000) for a, b in itertools.pairwise(arrived)]}")
    await stream.aclose()
    await wait_for(lambda: web.bus.count() == 0, what="subscription removed after the client closed")


async def test_empty_stream_is_trailers_only(web: App, http: httpx.AsyncClient) -> None:
    reply = await call(http, url(web, EDGE + "Empty"), _S().SerializeToString())
    assert reply.http_status == 200 and reply.messages == []
    assert reply.headers["grpc-status"] == "0"  # status in the headers, no body at all
    assert reply.trailers == {}


async def test_error_after_messages_goes_in_trailer_frame(web: App, http: httpx.AsyncClient) -> None:
    reply = await call(http, url(web, EDGE + "FailAfter"), _S(value="2").SerializeToString())
    assert [_S.FromString(m).value for m in reply.messages] == ["m0", "m1"]
    assert "grpc-status" not in reply.headers
    assert reply.status == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert reply.message == "broke after messages: ünïcode & 100%"


async def test_early_error_is_trailers_only(web: App, http: httpx.AsyncClient) -> None:
    reply = await call(http, url(web, UI + "subscribeToFocusChatInput"), common_pb2.StringRequest().SerializeToString())
    assert reply.messages == []
    assert reply.headers["grpc-status"] == str(grpc.StatusCode.INVALID_ARGUMENT.value[0])
    assert "Client ID is required" in reply.message
    assert web.bus.count() == 0


async def test_context_write_handlers_stream(web: App, http: httpx.AsyncClient) -> None:
    reply = await call(http, url(web, EDGE + "Written"), _S().SerializeToString())
    assert [_S.FromString(m).value for m in reply.messages] == ["w0", "w1", "w2"] and reply.status == 0


async def test_deadline_ends_live_stream_and_unsubscribes(web: App, http: httpx.AsyncClient, web_connect) -> None:
    await web_connect(session="dl").host.SetTheme(host_pb2.TextEvent(text='{"kind":"dark"}'))
    start = time.monotonic()
    reply = await call(http, url(web, UI + "subscribeToTheme"), common_pb2.EmptyRequest().SerializeToString(),
                       headers={"x-uibus-session": "dl", "grpc-timeout": "300m"})
    took = time.monotonic() - start
    assert [_S.FromString(m).value for m in reply.messages] == ['{"kind":"dark"}']  # current theme first
    assert reply.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert 0.25 < took < 2.0
    assert web.bus.count() == 0


async def test_bad_timeout_header(web: App, http: httpx.AsyncClient) -> None:
    reply = await call(http, url(web, UI + "getWebviewHtml"), b"", headers={"grpc-timeout": "soon"})
    assert reply.status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "grpc-timeout" in reply.message


async def test_client_abort_removes_subscription(web: App, http: httpx.AsyncClient, web_connect) -> None:
    for rpc in ("subscribeToPartialMessage", "subscribeToAddToInput", "subscribeToTheme"):
        stream = call_stream(http, url(web, UI + rpc), common_pb2.EmptyRequest().SerializeToString(),
                             headers={"x-uibus-session": "abort"})
        await anext(stream)
        await wait_for(lambda: web.bus.count(session="abort") == 1, what=f"{rpc} subscribed")
        await stream.aclose()  # closes the HTTP connection mid-stream, as a browser's abort does
        await wait_for(lambda: web.bus.count() == 0, what=f"{rpc} subscription removed")
    # the server keeps working after the aborts
    n = await web_connect(session="abort").host.PublishAddToInput(host_pb2.TextEvent(text="hi"))
    assert n.subscribers == 0


async def test_metadata_both_ways(web: App, http: httpx.AsyncClient) -> None:
    blob = base64.b64encode(b"\xff\x00").decode()
    reply = await call(http, url(web, EDGE + "Echo"), _S(value="v").SerializeToString(),
                       headers={"x-uibus-session": "meta", "authorization": "Bearer t", "x-custom": "c",
                                "x-blob-bin": blob})
    assert reply.status == 0
    assert _S.FromString(reply.messages[0]).value == "v|c|b'\\xff\\x00'"
    assert reply.headers["x-echo-session"] == "meta"
    assert reply.trailers["x-echo-auth"] == "Bearer t"
    assert base64.b64decode(reply.trailers["x-echo-bin"] + "==") == b"\x00\x01bin"


async def test_grpc_web_text(web: App, http: httpx.AsyncClient, web_connect) -> None:
    reply = await call(http, url(web, UI + "scrollToSettings"),
                       common_pb2.StringRequest(value="t").SerializeToString(), text=True)
    assert reply.headers["content-type"].startswith("application/grpc-web-text")
    assert reply.status == 0 and common_pb2.KeyValuePair.FromString(reply.messages[0]).value == "t"
    reply = await call(http, url(web, EDGE + "FailAfter"), _S(value="3").SerializeToString(), text=True)
    assert [_S.FromString(m).value for m in reply.messages] == ["m0", "m1", "m2"]
    assert reply.status == grpc.StatusCode.FAILED_PRECONDITION.value[0]


async def test_bad_requests(web: App, http: httpx.AsyncClient) -> None:
    reply = await call(http, url(web, "/nope.Service/Method"), b"")
    assert reply.status == grpc.StatusCode.UNIMPLEMENTED.value[0] and "/nope.Service/Method" in reply.message
    r = await http.post(url(web, UI + "getWebviewHtml"), content=b"\x00\x00\x00\x00\x09abc",
                        headers={"content-type": "application/grpc-web+proto"})
    assert r.headers["grpc-status"] == str(grpc.StatusCode.INVALID_ARGUMENT.value[0])  # as native gRPC answers
    reply = await call(http, url(web, UI + "subscribeToTheme"), b"", headers={"x-uibus-session": "bad session!"})
    assert reply.status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "session" in reply.message
    reply = await call(http, url(web, UI + "scrollToSettings"), b"\xff\xff\xff")
    assert reply.status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # after all that, the server still answers
    ok = await call(http, url(web, UI + "getWebviewHtml"), b"")
    assert ok.status == 0 and b"<html" in common_pb2.String.FromString(ok.messages[0]).value.encode().lower()


async def test_cors(web_config: Config, http: httpx.AsyncClient) -> None:
    app = await _start(replace(web_config, cors_origins="http://allowed.test"))
    try:
        pre = {"access-control-request-method": "POST",
               "access-control-request-headers": "content-type,x-grpc-web,x-uibus-session,grpc-timeout"}
        ok = await http.options(url(app, UI + "subscribeToTheme"), headers={"origin": "http://allowed.test", **pre})
        assert ok.status_code == 204
        assert ok.headers["access-control-allow-origin"] == "http://allowed.test"
        allowed = {h.strip() for h in ok.headers["access-control-allow-headers"].split(",")}
        assert {"content-type", "x-grpc-web", "x-user-agent", "grpc-timeout", "x-uibus-session",
                "authorization"} <= allowed
        refused = await http.options(url(app, UI + "subscribeToTheme"), headers={"origin": "http://evil.test", **pre})
        assert refused.status_code == 403
        assert not [k for k in refused.headers if k.startswith("access-control-")]
        # actual calls: allowed origin gets the echo and exposed grpc headers, refused gets 403
        reply = await call(http, url(app, UI + "scrollToSettings"), common_pb2.StringRequest().SerializeToString(),
                           headers={"origin": "http://allowed.test"})
        assert reply.status == 0 and reply.headers["access-control-allow-origin"] == "http://allowed.test"
        assert "grpc-status" in reply.headers["access-control-expose-headers"]
        r = await http.post(url(app, UI + "scrollToSettings"), content=frame(b""),
                            headers={"content-type": "application/grpc-web+proto", "origin": "http://evil.test"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        # the page's own origin is always allowed (browsers send Origin on same-origin POSTs)
        own = f"http://127.0.0.1:{app.http_port}"
        reply = await call(http, url(app, UI + "scrollToSettings"), b"", headers={"origin": own})
        assert reply.status == 0
    finally:
        await app.aclose(grace=1.0)


async def test_bearer_token_required(web_config: Config, http: httpx.AsyncClient) -> None:
    app = await _start(replace(web_config, auth_token="s3cret"))
    try:
        reply = await call(http, url(app, UI + "scrollToSettings"), b"")
        assert reply.status == grpc.StatusCode.UNAUTHENTICATED.value[0]
        reply = await call(http, url(app, UI + "scrollToSettings"), b"", headers={"authorization": "Bearer nope"})
        assert reply.status == grpc.StatusCode.UNAUTHENTICATED.value[0]
        reply = await call(http, url(app, UI + "scrollToSettings"), b"", headers={"authorization": "Bearer s3cret"})
        assert reply.status == 0
        health = await call(http, url(app, "/grpc.health.v1.Health/Check"), b"")
        assert health.status == 0  # probes carry no token
    finally:
        await app.aclose(grace=1.0)


async def test_shutdown_ends_open_streams_and_readyz(web: App, http: httpx.AsyncClient) -> None:
    assert (await http.get(url(web, "/readyz"))).status_code == 200
    assert (await http.get(url(web, "/healthz"))).text == "ok\n"
    assert (await http.get(url(web, "/livez"))).status_code == 200
    stream = call_stream(http, url(web, UI + "subscribeToAddToInput"), b"")
    await anext(stream)
    await wait_for(lambda: web.bus.count() == 1, what="subscribed")
    stopping = asyncio.ensure_future(web.aclose(grace=2.0))
    rest = [item async for item in stream]
    assert rest[-1][0] == "trailers"  # the stream ended cleanly with a status
    await stopping
    assert web.bus.count() == 0


async def test_served_process_http_port_and_sigterm(spawn: Callable[..., Any], http: httpx.AsyncClient) -> None:
    """`python -m uibus serve` binds the HTTP port, fails readiness during the drain, and exits 0."""
    port = free_port()
    proc = spawn("--http-port", str(port), "--drain-seconds", "1.0")
    await proc.wait_ready()
    base = f"http://127.0.0.1:{port}"
    assert (await http.get(base + "/readyz")).status_code == 200
    assert (await http.get(base + "/")).headers["content-type"].startswith("text/html")
    proc.proc.send_signal(signal.SIGTERM)
    await wait_for(lambda: _status(base + "/readyz") == 503, timeout=1.0, what="readyz 503 while draining")
    assert _status(base + "/livez") == 200
    assert await asyncio.to_thread(proc.proc.wait, 10) == 0


def _status(address: str) -> int:
    try:
        return httpx.get(address, timeout=0.5).status_code
    except httpx.HTTPError:
        return 0


async def test_reflection_over_grpc_web(web: App, http: httpx.AsyncClient) -> None:
    """A bidi-streaming service (reflection) answers over gRPC-Web too (requests sent in one body)."""
    from grpc_reflection.v1alpha import reflection_pb2

    req = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    reply = await call(http, url(web, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"), req,
                       frames=[req, req])
    assert reply.status == 0 and len(reply.messages) == 2
    names = {s.name for s in reflection_pb2.ServerReflectionResponse.FromString(reply.messages[0])
             .list_services_response.service}
    assert {"cline.UiService", "uibus.v1.HostService", "uibus.v1.WebviewService"} <= names


async def test_a_stream_resumes_after_its_cursor_over_grpc_web(web: App, http: httpx.AsyncClient, web_connect) -> None:
    """The HTTP port's resumable streams are gRPC-Web's: `x-uibus-since` as a request header means
    what the gRPC metadata means (what came after the cursor, then live), and a bad cursor is
    INVALID_ARGUMENT in the gRPC-Web status."""
    host = web_connect(session="since").host
    await host.PublishPartialMessage(ui_pb2.ClineMessage(ts=1, type=ui_pb2.SAY, say=ui_pb2.TEXT, text="had"))
    cursor = (await web.core.feed.log.read("since")).head
    for ts in (2, 3):
        await host.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=ui_pb2.TEXT, text=f"m{ts}"))
    empty = common_pb2.EmptyRequest().SerializeToString()
    stream = call_stream(http, url(web, UI + "subscribeToPartialMessage"), empty,
                         headers={"x-uibus-session": "since", "x-uibus-since": str(cursor)})
    kind, _reply = await anext(stream)
    assert kind == "headers"
    missed = []
    for _ in range(2):
        kind, payload = await asyncio.wait_for(anext(stream), 5)
        assert kind == "message"
        missed.append(ui_pb2.ClineMessage.FromString(payload))
    assert [(m.ts, m.text) for m in missed] == [(2, "m2"), (3, "m3")] and cursor < missed[0].seq < missed[1].seq
    await host.PublishPartialMessage(ui_pb2.ClineMessage(ts=4, type=ui_pb2.SAY, say=ui_pb2.TEXT, text="live"))
    kind, payload = await asyncio.wait_for(anext(stream), 5)
    assert kind == "message" and ui_pb2.ClineMessage.FromString(payload).ts == 4
    await stream.aclose()
    bad = await call(http, url(web, UI + "subscribeToPartialMessage"), empty,
                     headers={"x-uibus-session": "since", "x-uibus-since": "-1"})
    assert bad.status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "x-uibus-since" in bad.message
    await wait_for(lambda: web.bus.count() == 0, what="subscriptions removed")

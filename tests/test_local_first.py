"""Local-first safety: a default uibus is reachable by its own user only (docs/security.md).

* `uibus serve` with no flags listens on loopback only; a non-loopback bind serves only with tokens
  or `--trust-network` (the refusals themselves are cases of tests/test_startup_errors.py).
* DNS rebinding: a `Host` the server does not answer to is refused on every route of the HTTP port
  (gRPC-Web, the HTTP API, `/mcp`, the page, the WebSocket), and `--allowed-hosts` admits it.
* The Origin policy: which pages may call, on every route, preflights included.
* A web page on another local port, in real headless Chromium, cannot answer a waiting dialog, chat,
  call an MCP tool or open the CodeBolt socket; uibus's own page in the same browser still can.
* Callers that name no session never inherit a conversation (HTTP API, gRPC, gRPC-Web, MCP).
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from tests.conftest import REPO, free_port, running, wait_for
from tests.webclient import call, frame
from uibus.app import App
from uibus.infra.config import Config
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc as ext_grpc

GRPC_WEB = {"content-type": "application/grpc-web+proto", "x-grpc-web": "1"}
SCROLL = "/cline.UiService/scrollToSettings"
MCP_CALL = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "hello_world", "arguments": {"user_message": {"type": "HUMAN", "text": "hi"}}}}
MCP_HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream"}


def _refused(app: App, reason: str) -> float:
    assert app.metrics is not None
    value = app.metrics.registry.get_sample_value("uibus_http_refused_total", {"reason": reason})
    return value or 0.0


async def _upgrade(port: int, path: str, headers: dict[str, str]) -> bytes:
    """A WebSocket upgrade written by hand (so Host can be anything; HTTP/1.1 needs one, so a request
    that names none gets this server's address); returns the response head."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        lines = [f"GET {path} HTTP/1.1", "upgrade: websocket", "connection: Upgrade", "sec-websocket-version: 13",
                 "sec-websocket-key: " + base64.b64encode(os.urandom(16)).decode(),
                 *(f"{k}: {v}" for k, v in {"host": f"127.0.0.1:{port}", **headers}.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    finally:
        writer.close()


async def _every_route(app: App, headers: dict[str, str]) -> dict[str, int]:
    """The HTTP status each kind of route answers a browser-like request with `headers`."""
    base = f"http://127.0.0.1:{app.http_port}"
    async with httpx.AsyncClient(timeout=10) as http:
        grpc_web = await http.post(base + SCROLL, content=frame(b""), headers={**GRPC_WEB, **headers})
        api = await http.get(base + "/api/v1/list", headers=headers)
        chat = await http.post(base + "/api/v1/hello_world/streaming_chat", headers=headers,
                               content=json.dumps({"user_message": {"text": "hi"}}))
        mcp = await http.post(base + "/mcp", content=json.dumps(MCP_CALL), headers={**MCP_HEADERS, **headers})
        page = await http.get(base + "/", headers=headers)
    ws = await _upgrade(app.http_port, "/agent-to-app?session=s1", headers)
    return {"grpc-web": grpc_web.status_code, "api": api.status_code, "chat": chat.status_code,
            "mcp": mcp.status_code, "page": page.status_code, "websocket": int(ws.split()[1])}


OK = {"grpc-web": 200, "api": 200, "chat": 200, "mcp": 200, "page": 200, "websocket": 101}


# ---- the bind ---------------------------------------------------------------------------------------


def _listening(port: int) -> set[str]:
    """The local addresses of every listening TCP socket on `port` (IPv4 and IPv6), from /proc; an
    IPv4-mapped IPv6 address (grpc binds `::ffff:127.0.0.1`) as its IPv4 address."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            hex_address, port_hex = local.rsplit(":", 1)
            if state != "0A" or int(port_hex, 16) != port:  # 0A = LISTEN
                continue
            raw = b"".join(bytes.fromhex(hex_address[i:i + 8])[::-1] for i in range(0, len(hex_address), 8))
            address = ipaddress.ip_address(raw)
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
                address = address.ipv4_mapped
            found.add(str(address))
    return found


def _serve(tmp_path: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UIBUS_")}
    clean.update(XDG_STATE_HOME=str(tmp_path / "state"), **env)
    return subprocess.Popen([sys.executable, "-m", "uibus", "serve", *args], cwd=REPO, env=clean,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


async def _wait_serving(target: str, proc: subprocess.Popen[bytes]) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + 20
    async with grpc.aio.insecure_channel(target) as channel:
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            assert time.monotonic() < deadline, "not serving"
            await asyncio.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


async def test_serve_with_no_flags_listens_on_loopback_only(tmp_path: Path) -> None:
    """No flags at all (ports from the env only, so the test can pick free ones): both ports listen on
    127.0.0.1 and nowhere else."""
    grpc_port, http_port = free_port(), free_port()
    proc = _serve(tmp_path, [], {"UIBUS_PORT": str(grpc_port), "UIBUS_HTTP_PORT": str(http_port)})
    try:
        await _wait_serving(f"127.0.0.1:{grpc_port}", proc)
        assert _listening(grpc_port) == {"127.0.0.1"}, _listening(grpc_port)
        assert _listening(http_port) == {"127.0.0.1"}, _listening(http_port)
    finally:
        _stop(proc)


@pytest.mark.parametrize("opening", [["--trust-network"], ["--auth-token", "t0ken"]], ids=["trust-network", "token"])
async def test_a_non_loopback_bind_serves_with_tokens_or_trust_network(tmp_path: Path, opening: list[str]) -> None:
    grpc_port = free_port()
    proc = _serve(tmp_path, ["--host", "0.0.0.0", "--port", str(grpc_port), "--http-port", "0", *opening], {})
    try:
        await _wait_serving(f"127.0.0.1:{grpc_port}", proc)
        assert _listening(grpc_port) & {"0.0.0.0", "::"}, _listening(grpc_port)  # every interface, as asked
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            scroll = channel.unary_unary(SCROLL, request_serializer=common_pb2.StringRequest.SerializeToString,
                                         response_deserializer=common_pb2.KeyValuePair.FromString)
            if "--auth-token" in opening:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await scroll(common_pb2.StringRequest(value="x"), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            else:
                assert (await scroll(common_pb2.StringRequest(value="x"), timeout=5)).value == "x"
    finally:
        _stop(proc)


# ---- Host: DNS rebinding ----------------------------------------------------------------------------


async def test_a_rebinding_host_is_refused_on_every_route_and_allowed_hosts_admits_it(web: App) -> None:
    """The page of a rebinding attack is same-origin with itself: `Host` and `Origin` both name the
    attacker's DNS name. Refused (421 naming the flag) on every route, WebSocket included; nothing runs."""
    port = web.http_port
    rebinding = {"host": f"evil.example:{port}", "origin": f"http://evil.example:{port}"}
    answers = await _every_route(web, rebinding)
    assert answers == dict.fromkeys(OK, 421), answers
    async with httpx.AsyncClient(timeout=10) as http:
        refusal = await http.post(f"http://127.0.0.1:{port}/mcp", content=json.dumps(MCP_CALL),
                                  headers={**MCP_HEADERS, **rebinding})
    assert "--allowed-hosts" in refusal.json()["error"] and refusal.json()["code"] == "PERMISSION_DENIED"
    assert not [k for k in refusal.headers if k.startswith("access-control-")]
    assert _refused(web, "host") == 7
    assert _turns(web) == 0  # no chat ran

    # Without Origin too (a rebinding page's GET navigations send none), and for any other odd Host.
    for host in (f"evil.example:{port}", "evil.example", "127.0.0.1.evil.example", "localhost.evil.example",
                 "a b", "[::1"):
        assert (await _every_route(web, {"host": host}))["api"] == 421, host

    # Loopback names and addresses, and no Host at all (not a browser), are served.
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", f"app.localhost:{port}", "127.0.0.2"):
        assert (await _every_route(web, {"host": host}))["api"] == 200, host


async def test_allowed_hosts_admits_the_names_a_proxy_forwards(web_config: Config) -> None:
    async with running(replace(web_config, allowed_hosts="evil.example, *.ide.example, pinned.example:8443")) as app:
        port = app.http_port
        answers = await _every_route(app, {"host": f"evil.example:{port}", "origin": f"http://evil.example:{port}"})
        assert answers == OK, answers
        # behind a TLS-terminating proxy: the page is https on the default port, Host has no port
        assert (await _every_route(app, {"host": "a.b.ide.example", "origin": "https://a.b.ide.example"})) == OK
        assert (await _every_route(app, {"host": "pinned.example:8443"}))["api"] == 200
        assert (await _every_route(app, {"host": "pinned.example:8444"}))["api"] == 421
        assert (await _every_route(app, {"host": "ide.example"}))["api"] == 421  # `*.` is for subdomains
    async with running(replace(web_config, allowed_hosts="*")) as app:
        assert (await _every_route(app, {"host": "anything.example"}))["api"] == 200


async def test_bound_to_every_interface_ip_addresses_are_served(web_config: Config) -> None:
    """An IP address cannot be rebound: bound to every interface, a client naming any of this machine's
    addresses (a pod IP, a container IP behind a port mapping) is served; a DNS name still is not."""
    async with running(replace(web_config, host="0.0.0.0", auth_token="t")) as app:
        bearer = {"authorization": "Bearer t"}
        assert (await _every_route(app, {"host": "10.1.2.3:8080", **bearer}))["api"] == 200
        assert (await _every_route(app, {"host": "[fd00::1]:8080", **bearer}))["api"] == 200
        assert (await _every_route(app, {"host": "uibus.example", **bearer}))["api"] == 421


# ---- Origin -----------------------------------------------------------------------------------------


async def test_the_origin_policy_on_every_route(web: App) -> None:
    port = web.http_port
    admitted = [f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://[::1]:{port}",
                f"http://app.localhost:{port}", "vscode-webview://1cf0a7f2-3a5e-4f0e-9a39-4c5d3b6b6d2e"]
    for origin in admitted:
        assert await _every_route(web, {"host": f"127.0.0.1:{port}", "origin": origin}) == OK, origin
    refused = [f"http://127.0.0.1:{free_port()}", f"http://localhost:{port + 1}", "https://evil.example", "null",
               f"https://127.0.0.1:{port}x", "file://", "chrome-extension://abcdefgh", f"http://evil.example:{port}"]
    before = _refused(web, "origin")
    for origin in refused:
        answers = await _every_route(web, {"host": f"127.0.0.1:{port}", "origin": origin})
        assert answers == dict.fromkeys(OK, 403), (origin, answers)
    assert _refused(web, "origin") - before == 6 * len(refused)
    # the page's own origin follows the (checked) Host it was reached by, whatever the scheme
    assert (await _every_route(web, {"host": "localhost", "origin": "http://localhost"}))["grpc-web"] == 200
    assert (await _every_route(web, {"host": "localhost", "origin": "https://localhost"}))["grpc-web"] == 200
    # a request without Origin is no cross-site browser request: native clients and curl are unaffected
    assert await _every_route(web, {}) == OK


async def test_preflights_and_cors_headers(web: App) -> None:
    port = web.http_port
    url = f"http://127.0.0.1:{port}{SCROLL}"
    ask = {"access-control-request-method": "POST",
           "access-control-request-headers": "content-type,x-grpc-web,x-uibus-session,authorization"}
    async with httpx.AsyncClient(timeout=10) as http:
        ide = "vscode-webview://abc"
        ok = await http.options(url, headers={"origin": ide, **ask})
        assert ok.status_code == 204 and ok.headers["access-control-allow-origin"] == ide
        assert "access-control-allow-private-network" not in ok.headers
        pna = await http.options(url, headers={"origin": ide, "access-control-request-private-network": "true", **ask})
        assert pna.headers["access-control-allow-private-network"] == "true"
        no = await http.options(url, headers={"origin": "https://evil.example",
                                              "access-control-request-private-network": "true", **ask})
        assert no.status_code == 403 and not [k for k in no.headers if k.startswith("access-control-")]
        page = await http.get(f"http://127.0.0.1:{port}/")
        frames = page.headers["content-security-policy"]
        assert frames == "frame-ancestors 'self' vscode-webview:", frames


async def test_cors_origins_extends_the_defaults_and_star_admits_every_page(web_config: Config) -> None:
    async with running(replace(web_config, cors_origins="https://ide.example:443, https://*.corp.example:8443")) as app:
        host = {"host": f"127.0.0.1:{app.http_port}"}
        for origin, status in (("https://ide.example", 200), ("https://IDE.example/", 200),
                               ("https://a.b.corp.example:8443", 200), ("https://corp.example:8443", 403),
                               ("https://a.corp.example", 403), ("https://evil.example/.corp.example:8443", 403),
                               (f"http://127.0.0.1:{app.http_port}", 200), ("vscode-webview://x", 200),
                               ("http://ide.example", 403)):
            assert (await _every_route(app, {**host, "origin": origin}))["grpc-web"] == status, origin
        async with httpx.AsyncClient(timeout=10) as http:
            page = await http.get(f"http://127.0.0.1:{app.http_port}/")
        assert page.headers["content-security-policy"] == \
            "frame-ancestors 'self' vscode-webview: https://ide.example https://*.corp.example:8443"
    async with running(replace(web_config, cors_origins="*")) as app:
        answers = await _every_route(app, {"host": f"127.0.0.1:{app.http_port}", "origin": "https://evil.example"})
        assert answers == OK
    async with running(replace(web_config, cors_origins="null")) as app:
        assert (await _every_route(app, {"origin": "null"}))["grpc-web"] == 200


# ---- a page on another local port, in a real browser --------------------------------------------------


ATTACK = """<!doctype html><meta charset="utf-8"><title>a page the developer visits</title><script>
const U = "http://127.0.0.1:%(port)d", W = "ws://127.0.0.1:%(port)d";
const RESPOND = Uint8Array.from(atob("%(respond)s"), c => c.charCodeAt(0));
const CHAT = Uint8Array.from(atob("%(chat)s"), c => c.charCodeAt(0));
function grpcWeb(message) {
  const body = new Uint8Array(5 + message.length);
  new DataView(body.buffer).setUint32(1, message.length);
  body.set(message, 5);
  return body;
}
async function attempt(name, run) {
  try { results[name] = "reached: " + await run(); } catch (e) { results[name] = "blocked: " + e.name; }
}
const results = {};
window.done = (async () => {
  const session = {"x-uibus-session": "victim"};
  await attempt("grpc-web Respond", async () => (await fetch(U + "/uibus.v1.ExtensionUiService/Respond", {
    method: "POST", headers: {"content-type": "application/grpc-web+proto", "x-grpc-web": "1", ...session},
    body: grpcWeb(RESPOND)})).status);
  await attempt("grpc-web StreamingChat", async () => (await fetch(U + "/hello_world.AgentService/StreamingChat", {
    method: "POST", headers: {"content-type": "application/grpc-web+proto", "x-grpc-web": "1", ...session},
    body: grpcWeb(CHAT)})).status);
  await attempt("mcp tools/call", async () => (await fetch(U + "/mcp", {
    method: "POST", headers: {"content-type": "application/json", "accept": "application/json, text/event-stream",
                              ...session},
    body: JSON.stringify({jsonrpc: "2.0", id: 1, method: "tools/call", params: {name: "ask_user",
                          arguments: {title: "from the attacker", kind: "confirm"}}})})).status);
  // Simple requests: no preflight, the browser sends them whatever the server says. The server must
  // refuse them itself (the page cannot tell: the answer is opaque).
  await attempt("no-cors chat", async () => (await fetch(U + "/api/v1/hello_world/streaming_chat", {
    method: "POST", mode: "no-cors", body: JSON.stringify({user_message: {text: "pwned"}})})).type);
  await attempt("no-cors mcp", async () => (await fetch(U + "/mcp", {
    method: "POST", mode: "no-cors", body: JSON.stringify({jsonrpc: "2.0", id: 2, method: "tools/call",
      params: {name: "hello_world", arguments: {user_message: {text: "pwned"}}}})})).type);
  results["websocket"] = await new Promise(resolve => {
    const ws = new WebSocket(W + "/agent-to-app?session=victim");
    ws.onopen = () => { ws.send(JSON.stringify({type: "sendMessage", message: "pwned"})); resolve("reached: open"); };
    ws.onerror = () => resolve("blocked: error");
  });
  return results;
})();
</script><p>nothing to see here</p>"""


@pytest.fixture
def attacker() -> Iterator[dict[str, Any]]:
    """A second local HTTP server (another port: another origin) that serves the page `ATTACK`."""
    state: dict[str, Any] = {"page": b""}

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = state["page"]
            self.send_response(200)
            self.send_header("content-type", "text/html; charset=utf-8")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _turns(app: App) -> int:
    assert app.metrics is not None
    return sum(app.metrics.chat_turns.values())


async def test_a_page_on_another_local_port_cannot_drive_uibus(web: App, browser: Any,
                                                               attacker: dict[str, Any], tmp_path: Path) -> None:
    md = (("x-uibus-session", "victim"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{web.port}") as channel:
        ui = ext_grpc.ExtensionUiServiceStub(channel)
        events = ui.Subscribe(ext.SubscribeRequest(), metadata=md)
        confirm = asyncio.ensure_future(ui.Confirm(ext.ConfirmRequest(title="Run rm -rf build?"), metadata=md))
        while not (event := await asyncio.wait_for(events.read(), 5)).HasField("request"):
            pass
        dialog = event.request.id  # the attacker even knows the id: it still cannot answer
        respond = ext.RespondRequest(id=dialog, confirmed=True).SerializeToString()
        chat = agent_pb2.ChatRequest(user_message=chat_pb2.ChatMessage(text="pwned")).SerializeToString()
        attacker["page"] = (ATTACK % {"port": web.http_port, "respond": base64.b64encode(respond).decode(),
                                      "chat": base64.b64encode(chat).decode()}).encode()
        origin_refusals = _refused(web, "origin")

        evil = await browser.new_page()
        await evil.goto(attacker["url"])
        results = await evil.evaluate("window.done")
        print("\nattacker's page:", results)
        for name in ("grpc-web Respond", "grpc-web StreamingChat", "mcp tools/call", "websocket"):
            assert results[name].startswith("blocked"), (name, results)
        assert results["no-cors chat"] == results["no-cors mcp"] == "reached: opaque"  # sent, answer unreadable
        # Refused by the server itself, not only by the browser: 3 preflights, 2 simple POSTs, 1 upgrade.
        assert _refused(web, "origin") - origin_refusals == 6
        assert not confirm.done() and web.core.dialogs.count("victim") == 1  # the dialog still waits
        assert _turns(web) == 0  # no chat ran
        await evil.close()

        # uibus's own page, in the same browser, still answers it.
        page = await browser.new_page()
        await page.goto(f"http://127.0.0.1:{web.http_port}/?session=victim")
        await page.wait_for_selector('.dialog[data-kind="confirm"] h3:text("Run rm -rf build?")', timeout=5000)
        await page.click('.dialog[data-kind="confirm"] button:text("Yes")')
        result = await asyncio.wait_for(confirm, 5)
        assert result.outcome == ext.DIALOG_OUTCOME_ANSWERED and result.confirmed
        events.cancel()
        await page.close()
    await wait_for(lambda: web.bus.count() == 0, timeout=5, what="subscriptions removed")


# ---- callers that name no session -------------------------------------------------------------------


async def _http_chat(app: App, text: str, **more: Any) -> dict[str, Any]:
    headers = more.pop("headers", {})
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(f"http://127.0.0.1:{app.http_port}/api/v1/hello_world/streaming_chat",
                            json={"user_message": {"text": text}, **more}, headers=headers)
    assert r.status_code == 200, r.text
    return json.loads(r.text.strip().splitlines()[-1])["response"]


async def _grpc_chat(channel: grpc.aio.Channel, text: str, metadata: tuple[tuple[str, str], ...] = (),
                     context: chat_pb2.ChatContext | None = None) -> chat_pb2.ChatMessage:
    streaming = channel.unary_stream("/hello_world.AgentService/StreamingChat",
                                     request_serializer=agent_pb2.ChatRequest.SerializeToString,
                                     response_deserializer=agent_pb2.ChatResponse.FromString)
    request = agent_pb2.ChatRequest(user_message=chat_pb2.ChatMessage(text=text))
    if context is not None:
        request.chat_context.CopyFrom(context)
    replies = [r async for r in streaming(request, metadata=metadata, timeout=30)]
    return replies[-1].response


async def _mcp_chat(app: App, text: str, headers: dict[str, str] | None = None) -> str:
    body = {**MCP_CALL, "params": {"name": "hello_world",
                                   "arguments": {"user_message": {"type": "HUMAN", "text": text}}}}
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(f"http://127.0.0.1:{app.http_port}/mcp", json=body, headers={**MCP_HEADERS,
                                                                                            **(headers or {})})
    assert r.status_code == 200, r.text
    data = r.json() if r.headers["content-type"].startswith("application/json") else \
        json.loads([line for line in r.text.splitlines() if line.startswith("data:")][-1][5:])
    return str(data["result"]["content"][0]["text"])


FRESH = "This is the start of our conversation."


async def test_callers_that_name_no_session_never_inherit_a_conversation(web: App) -> None:
    # The neuro-san HTTP API, as neuro-san's own clients and curl call it: no session, no context.
    first = await _http_chat(web, "my secret is 1234")
    assert FRESH in first["text"]
    second = await _http_chat(web, "what did I say?")
    assert FRESH in second["text"] and "1234" not in json.dumps(second), second
    # The first caller continues its own conversation by sending back the context it was given.
    own = await _http_chat(web, "and now?", chat_context=first["chat_context"])
    assert 'Earlier you said: "my secret is 1234"' in own["text"]

    # Native gRPC and gRPC-Web alike.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{web.port}") as channel:
        one = await _grpc_chat(channel, "grpc secret 5678")
        two = await _grpc_chat(channel, "anything?")
        assert FRESH in one.text and FRESH in two.text and "5678" not in str(two.chat_context)
        assert "5678" in (await _grpc_chat(channel, "go on", context=one.chat_context)).text
        # A caller that names its session (the page, `uibus chat`, which names `default` itself) keeps
        # the server-side continuation, and what unnamed callers said is not in it.
        named = (("x-uibus-session", "default"),)
        await _grpc_chat(channel, "named first", named)
        reply = await _grpc_chat(channel, "named second", named)
        assert 'Earlier you said: "named first"' in reply.text
        assert "1234" not in str(reply.chat_context) and "5678" not in str(reply.chat_context)
    async with httpx.AsyncClient(timeout=30) as http:
        body = agent_pb2.ChatRequest(user_message=chat_pb2.ChatMessage(text="web secret")).SerializeToString()
        url = f"http://127.0.0.1:{web.http_port}/hello_world.AgentService/StreamingChat"
        await call(http, url, body)
        again = await call(http, url, agent_pb2.ChatRequest(
            user_message=chat_pb2.ChatMessage(text="and?")).SerializeToString())
        last = agent_pb2.ChatResponse.FromString(again.messages[-1]).response
        assert FRESH in last.text and "web secret" not in str(last.chat_context)

    # MCP (an inspector that sends no x-uibus-session): each call starts fresh; a named one continues.
    assert FRESH in await _mcp_chat(web, "mcp secret")
    assert FRESH in await _mcp_chat(web, "mcp again")
    assert FRESH in await _mcp_chat(web, "mcp named", {"x-uibus-session": "m1"})
    assert 'Earlier you said: "mcp named"' in await _mcp_chat(web, "mcp named 2", {"x-uibus-session": "m1"})

    # And over the HTTP API with a named session: the server continues it.
    await _http_chat(web, "http named", headers={"x-uibus-session": "h1"})
    assert 'Earlier you said: "http named"' in (await _http_chat(web, "next", headers={"x-uibus-session": "h1"}))[
        "text"]
    # The `default` session's stored conversation holds only what named callers said there.
    stored = await web.core.chat.history.load_context("default", "hello_world")
    said = [m.text for h in stored.chat_histories for m in h.messages if m.type == chat_pb2.ChatMessage.HUMAN]
    assert said == ["named first", "named second"], said


async def test_an_unnamed_caller_still_shows_on_the_default_sessions_ui(web: App) -> None:
    """What unnamed callers still share (docs/security.md): the `default` session's UI feed."""
    from uibus.clients.connection import Connection

    async with Connection(f"127.0.0.1:{web.port}", session="default") as conn:
        stream = conn.ui.subscribeToPartialMessage(common_pb2.EmptyRequest())
        await asyncio.wait_for(stream.initial_metadata(), 5)
        await _http_chat(web, "seen on the default page")
        asked = await asyncio.wait_for(stream.read(), 5)  # the question first, as every UI shows it
        assert (asked.say, asked.text) == (ui_pb2.USER_FEEDBACK, "seen on the default page")
        while (message := await asyncio.wait_for(stream.read(), 5)).partial:
            pass
        assert 'You said: "seen on the default page"' in message.text
        stream.cancel()

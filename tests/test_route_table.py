"""The HTTP port's route table (uibus.edge.transports.routes.TABLE), walked and checked from outside:
every route, over real HTTP (and WebSocket upgrades where it takes them) against a real server on
loopback with tokens configured, meets the policy its entry declares:

* behind the browser policy: a foreign Origin is refused 403 and a foreign Host 421, before anything
  of the route runs;
* a door that takes a token (the page, /metrics, /acp): none is refused 401 with the Bearer
  challenge, a valid one is let in; /metrics refuses a tenant's token 403;
* a route whose handler runs calls: no token gets the call refused UNAUTHENTICATED by the pipeline,
  in the route's own framing;
* probes and public routes answer without a token.

A route added to the table without an example here fails `test_every_route_has_an_example`, so no
door goes unchecked.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.conftest import start_app
from uibus.app import App
from uibus.edge.calls.access import ANY_TOKEN, METRICS_READER
from uibus.edge.transports.routes import MOUNT, PER_CALL, PROBE, PUBLIC, TABLE, Route
from uibus.infra.config import Config

TOKENS = "team-a-token  team-a-*\n"
OPERATOR = {"authorization": "Bearer operator-token"}
TENANT = {"authorization": "Bearer team-a-token"}
FOREIGN_ORIGIN = "http://evil.example"
FOREIGN_HOST = "evil.example"
GRPC_WEB = {"content-type": "application/grpc-web+proto", "x-grpc-web": "1"}
MCP_PING = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}).encode()


@dataclass(frozen=True)
class Example:
    """A request the route takes, and what it answers without a token."""

    method: str
    path: str
    no_token: int  # the HTTP status without a token
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    websocket: bool = False  # also upgraded (the route takes WebSockets): same policy there


# One example per route, keyed as the table names it (path, handler).
EXAMPLES: dict[tuple[str, str], Example] = {
    ("/agent-to-app", MOUNT): Example("GET", "/agent-to-app?session=demo", 426, websocket=True),
    ("/codebolt", MOUNT): Example("GET", "/codebolt", 426, websocket=True),
    ("/mcp", MOUNT): Example("POST", "/mcp", 401, {"content-type": "application/json",
                                                   "accept": "application/json, text/event-stream"}, MCP_PING),
    ("/api/v1/sessions", MOUNT): Example("GET", "/api/v1/sessions", 401),
    ("/api/sessions", MOUNT): Example("GET", "/api/sessions/demo/whoami", 401),  # TeamService
    ("/api/invites", MOUNT): Example("POST", "/api/invites/accept", 401, {"content-type": "application/json"},
                                     b'{"token": "x"}'),
    ("/api/audit", MOUNT): Example("GET", "/api/audit?session=demo", 401),  # AuditService/List
    ("/acp", MOUNT): Example("GET", "/acp", 401, {"accept": "text/event-stream"}, websocket=True),
    ("/", "grpc-web"): Example("POST", "/uibus.v1.HostService/GetSessionState", 200, GRPC_WEB, b"\0\0\0\0\0"),
    ("/auth/", "signin"): Example("GET", "/auth/me", 404),  # sign-in is off without --oidc-issuer
    ("/api/v1/docs", "docs"): Example("GET", "/api/v1/docs", 200),
    # RFC 9728 metadata: 404 without --oidc-issuer (tests/test_oidc_bearer.py serves it with one)
    ("/.well-known/oauth-protected-resource", "resource metadata"):
        Example("GET", "/.well-known/oauth-protected-resource", 404),
    ("/.well-known/oauth-protected-resource/mcp", "resource metadata"):
        Example("GET", "/.well-known/oauth-protected-resource/mcp", 404),
    ("/api/v1/", "api"): Example("GET", "/api/v1/list", 401),
    ("/", "page"): Example("GET", "/", 401),
    ("/invite/", "invite"): Example("GET", "/invite/abc", 200),  # on to the page, the token in the fragment
    ("/favicon.ico", "favicon"): Example("GET", "/favicon.ico", 200),
    ("/favicon.svg", "favicon"): Example("GET", "/favicon.svg", 200),
    ("/healthz", "ok"): Example("GET", "/healthz", 200),
    ("/livez", "ok"): Example("GET", "/livez", 200),
    ("/readyz", "ready"): Example("GET", "/readyz", 200),
    ("/metrics", "metrics"): Example("GET", "/metrics", 401),
    ("/", "not found"): Example("GET", "/no/such/route", 404, websocket=True),
}
# Upgrades the table refuses itself (its catch-all's 404), whatever the path: a part that takes none.
NO_UPGRADE: dict[tuple[str, str], str] = {
    ("/mcp", MOUNT): "/mcp", ("/api/v1/sessions", MOUNT): "/api/v1/sessions", ("/", "page"): "/",
}


def _route_of(example: Example, kind: str = "http") -> Route:
    """The route the table gives the example (every mount is installed in the app under test)."""
    scope = {"type": kind, "path": example.path.split("?")[0], "method": example.method,
             "headers": [(k.encode(), v.encode()) for k, v in example.headers.items()]}
    return next(route for route in TABLE if route.takes(scope))


@pytest.fixture
async def guarded(web_config: Config, tmp_path: Path) -> AsyncIterator[App]:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    app = await start_app(replace(web_config, auth_token="operator-token", tokens_file=str(tokens),
                                  metrics_token="metrics-token"))
    try:
        yield app
    finally:
        await app.aclose(grace=0.5)


def test_every_route_has_an_example() -> None:
    """Each example is taken by its own route (first match wins), and each route has one."""
    assert sorted(EXAMPLES) == sorted((route.path, route.handler) for route in TABLE)
    for route in TABLE:
        example = EXAMPLES[(route.path, route.handler)]
        assert _route_of(example) == route, example
        if example.websocket:
            assert route.websocket and _route_of(example, "websocket") == route, example
    assert all(route.tokens in (PROBE, PUBLIC, PER_CALL, ANY_TOKEN, METRICS_READER) for route in TABLE)


async def _request(app: App, example: Example, headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10) as http:
        return await http.request(example.method, example.path, headers={**example.headers, **(headers or {})},
                                  content=example.body)


async def _upgrade_status(app: App, example: Example, headers: dict[str, str] | None = None) -> int:
    """The status of a WebSocket upgrade of the example's path (101 when accepted)."""
    try:
        async with connect(f"ws://127.0.0.1:{app.http_port}{example.path}", additional_headers=headers or {},
                           open_timeout=10):
            return 101
    except InvalidStatus as refused:
        return refused.response.status_code


@pytest.mark.parametrize("key", list(EXAMPLES), ids=lambda key: f"{key[1]}:{key[0]}")
async def test_each_route_meets_its_declared_policy_over_http(guarded: App, key: tuple[str, str]) -> None:
    route = next(r for r in TABLE if (r.path, r.handler) == key)
    example = EXAMPLES[key]

    # The browser policy, first of all: nothing of the route runs for a foreign page or a rebound name.
    if route.browser:
        r = await _request(guarded, example, {"origin": FOREIGN_ORIGIN, **OPERATOR})
        assert r.status_code == 403 and "--cors-origins" in r.json()["error"], (key, r.status_code, r.text)
        r = await _request(guarded, example, {"host": FOREIGN_HOST, **OPERATOR})
        assert r.status_code == 421 and "--allowed-hosts" in r.json()["error"], (key, r.status_code, r.text)
        if example.websocket:
            assert await _upgrade_status(guarded, example, {"origin": FOREIGN_ORIGIN, **OPERATOR}) == 403, key

    # Without a token: what the route's policy says.
    r = await _request(guarded, example)
    assert r.status_code == example.no_token, (key, r.status_code, r.text)
    if route.tokens in (ANY_TOKEN, METRICS_READER):
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), key
        assert (await _request(guarded, example, {"authorization": "Bearer wrong"})).status_code == 401, key
        admitted = await _request(guarded, example, OPERATOR)
        assert admitted.status_code not in (401, 403, 421), (key, admitted.status_code, admitted.text)
        if example.websocket:
            assert await _upgrade_status(guarded, example) == 401, key
    if route.tokens == METRICS_READER:
        assert (await _request(guarded, example, TENANT)).status_code == 403
        assert (await _request(guarded, example, {"authorization": "Bearer metrics-token"})).status_code == 200
    if route.tokens == PER_CALL:  # the door lets it through; the call it makes is refused
        if key == ("/", "grpc-web"):
            assert r.headers.get("grpc-status") == "16", (r.headers, r.content)  # UNAUTHENTICATED
        elif example.websocket:  # the upgrade is the call (CodeBolt's connect)
            assert await _upgrade_status(guarded, example) == 401, key
        else:
            body = r.json()  # the HTTP API's {"error", "code"}, or MCP's JSON-RPC error naming the status
            code = body["code"] if "code" in body else body["error"]["data"]["status"]
            assert code == "UNAUTHENTICATED", (key, r.text)
    if route.tokens in (PROBE, PUBLIC):
        assert r.status_code in (200, 404), key  # answered without a token (404: the table's catch-all)


async def test_an_upgrade_where_no_route_takes_one_is_404(guarded: App) -> None:
    """A WebSocket upgrade reaches only a route that says it takes them; elsewhere the table's
    catch-all refuses it 404 (behind the browser policy too), with a token or without."""
    for key, path in NO_UPGRADE.items():
        assert not next(r for r in TABLE if (r.path, r.handler) == key).websocket, key
        example = Example("GET", path, 404)
        assert _route_of(example, "websocket") == TABLE[-1], key
        assert await _upgrade_status(guarded, example, OPERATOR) == 404, key
        assert await _upgrade_status(guarded, example, {"origin": FOREIGN_ORIGIN, **OPERATOR}) == 403, key

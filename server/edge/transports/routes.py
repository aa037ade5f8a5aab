"""The HTTP port's one route table, and the one gate that applies it (Starlette's `Router` idea:
routes and their policy declared once, in order, first match wins).

Each `Route` says which requests it takes (a path, or a prefix and everything below it; upgrades
too or not; a content type, for gRPC-Web's any-path POSTs), the handler that answers them, which
token its door takes, and whether the browser policy (Host, Origin, CORS:
uibus.edge.transports.browser) stands in front of it. `Routes` runs the gate for every request:

1. the browser policy, for a route that says so (every route a browser can reach: all of them);
2. no tokens on a loopback bind: the caller's socket must be uibus's own user's (uibus.infra.peers),
   for every route but the probes;
3. the method, for a route that names its methods (405 with `Allow`);
4. the token the route takes, checked by the pipeline's one bearer check (uibus.edge.pipeline:
   `check_bearer`); the grant goes to the handler in the scope (`asgi.GRANT`), so no handler reads
   the token again. A route whose handler runs calls (gRPC-Web, the HTTP APIs, /mcp, CodeBolt)
   leaves the token to the pipeline, which checks it per call (its session, an agent's scope).

Then the handler runs, framing only. The parts installers mount (`Routes.mounts`, by path) are
served by their route here, whose policy this table declares: a mount with no route is an error
at start, never a door without a policy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from uibus.edge.calls.access import ANY_TOKEN, METRICS_READER, check_bearer
from uibus.edge.metrics import CONTENT_TYPE, Metrics
from uibus.edge.transports.acp_ws import PATH as ACP_PATH
from uibus.edge.transports.asgi import (
    CHALLENGE,
    GRANT,
    ASGIApp,
    Receive,
    Scope,
    Send,
    drain_first,
    error_body,
    header,
    refuse,
    respond,
    wrong_method,
)
from uibus.edge.transports.audit_http import PATH as AUDIT_PATH
from uibus.edge.transports.browser import BrowserGuard, BrowserPolicy
from uibus.edge.transports.codebolt_ws import CODEBOLTJS_PATH
from uibus.edge.transports.codebolt_ws import PATH as CODEBOLT_PATH
from uibus.edge.transports.grpcweb import GrpcWeb, Lookup, peer_of
from uibus.edge.transports.mcp_http import PATH as MCP_PATH
from uibus.edge.transports.neurosan_http import PREFIX, NeuroSanHttp
from uibus.edge.transports.oauth_resource import PATHS as RESOURCE_METADATA
from uibus.edge.transports.oauth_resource import ProtectedResource, challenging
from uibus.edge.transports.openapi import DOCS_PATH, document_json
from uibus.edge.transports.sessions_http import PATH as SESSIONS_PATH
from uibus.edge.transports.signin import EXPIRED, SignIn
from uibus.edge.transports.signin import PREFIX as SIGNIN_PREFIX
from uibus.edge.transports.team_http import INVITE_LINK, INVITES_PATH, invite_link
from uibus.edge.transports.team_http import SESSIONS_PATH as TEAM_PATH
from uibus.infra.auth import Tokens
from uibus.infra.errors import PermissionDenied, Unauthenticated
from uibus.infra.json_input import dump_json
from uibus.infra.peers import OwnUserOnly
from uibus.infra.webview import login_html

# The tokens a route's door takes, besides the pipeline's ANY_TOKEN (any token of ours: the operator's,
# a tenant's, an agent's minted one) and METRICS_READER (the metrics token or an all-sessions token):
PROBE = "probe"  # none, and open to every local user too: probes say nothing of sessions
PUBLIC = "public"  # none (the same for everyone); only uibus's own user on a token-less loopback bind
PER_CALL = "per call"  # whatever each call's method needs: the pipeline checks it per call
DOOR_TOKENS = (PROBE, PUBLIC, PER_CALL, ANY_TOKEN, METRICS_READER)
# How a route's refusals are framed: its handler's own framing, so a client reads one kind of answer.
TEXT, JSON, LOGIN = "text", "json", "login"
MOUNT = "mount"  # the handler of a route is the app an installer mounted at its path
_ROUTE = "uibus.route"  # the scope key of the route the gate chose, for its steps behind the browser policy
GET = ("GET", "HEAD")


@dataclass(frozen=True, slots=True)
class Route:
    """One entry of the table: which requests, which handler, and the door's policy."""

    path: str  # the path; with `prefix`, it and everything below it ("/x/" : only below it)
    handler: str  # a name in `Routes.handlers`, or MOUNT
    tokens: str  # one of DOOR_TOKENS
    browser: bool = True  # behind the browser policy (Host, Origin, CORS)
    prefix: bool = False
    websocket: bool = False  # takes WebSocket upgrades too (else HTTP requests only)
    methods: tuple[str, ...] = ()  # the HTTP methods it takes (empty: its handler decides)
    content_type: str = ""  # only requests whose content type starts so (gRPC-Web's any-path POSTs)
    answer: str = TEXT  # how a refusal of the door is framed: TEXT, JSON, or LOGIN (the sign-in page)

    def takes(self, scope: Scope) -> bool:
        if scope["type"] == "websocket" and not self.websocket:
            return False
        path: str = scope["path"]
        if not self.prefix:
            if path != self.path:
                return False
        elif not (path.startswith(self.path) if self.path.endswith("/") else
                  path == self.path or path.startswith(self.path + "/")):
            return False
        return not self.content_type or header(scope, b"content-type").startswith(self.content_type)


# The HTTP port, first match wins. Mounted parts first (a gRPC-Web POST to /mcp is MCP's), then gRPC-Web
# (`/pkg.Service/Method`, any path), the HTTP APIs, the page and the probes; the last entry takes the rest.
TABLE: tuple[Route, ...] = (
    Route(CODEBOLT_PATH, MOUNT, PER_CALL, prefix=True, websocket=True),  # the upgrade is a call
    Route(CODEBOLTJS_PATH, MOUNT, PER_CALL, prefix=True, websocket=True),
    Route(MCP_PATH, MOUNT, PER_CALL),  # /mcp alone; each JSON-RPC message is a call
    Route(SESSIONS_PATH, MOUNT, PER_CALL, prefix=True),
    Route(TEAM_PATH, MOUNT, PER_CALL, prefix=True),  # /api/sessions/<name>/members …: TeamService
    Route(INVITES_PATH, MOUNT, PER_CALL, prefix=True),
    Route(AUDIT_PATH, MOUNT, PER_CALL, prefix=True),  # each request a call of uibus.v1.AuditService
    # The editor's connection runs its calls in process, after the door: the door takes the token.
    Route(ACP_PATH, MOUNT, ANY_TOKEN, prefix=True, websocket=True, answer=JSON),
    Route("/", "grpc-web", PER_CALL, prefix=True, content_type="application/grpc-web"),
    # The page's sign-in (OIDC code flow, the session cookie): before any token, so open to all.
    Route(SIGNIN_PREFIX, "signin", PUBLIC, prefix=True),
    Route(DOCS_PATH, "docs", PUBLIC, methods=GET, answer=JSON),  # the same for everyone: message schemas
    # Where a client gets a token (RFC 9728, MCP authorization): uibus.edge.transports.oauth_resource.
    *(Route(path, "resource metadata", PUBLIC, methods=GET, answer=JSON) for path in RESOURCE_METADATA),
    Route(PREFIX, "api", PER_CALL, prefix=True),
    # The browser cannot send a header when it navigates: a refusal is the page that asks for the token.
    Route("/", "page", ANY_TOKEN, methods=GET, answer=LOGIN),
    Route(INVITE_LINK, "invite", PUBLIC, prefix=True, methods=GET),  # on to the page: /#invite=<token>
    Route("/favicon.ico", "favicon", PUBLIC, methods=GET),  # fetched without the page's token
    Route("/favicon.svg", "favicon", PUBLIC, methods=GET),
    Route("/healthz", "ok", PROBE, methods=GET),
    Route("/livez", "ok", PROBE, methods=GET),
    Route("/readyz", "ready", PROBE, methods=GET),
    Route("/metrics", "metrics", METRICS_READER, methods=GET),  # every tenant's traffic
    Route("/", "not found", PUBLIC, prefix=True, websocket=True),
)

if TYPE_CHECKING:  # the provider's JOSE stack loads only with --oidc-issuer
    from uibus.infra.oidc import Oidc


class Routes:
    """The HTTP port's one ASGI app: the gate, then the route's handler (see the module docstring)."""

    def __init__(self, lookup: Lookup, metrics: Metrics, page: Callable[[], str],
                 not_ready: Callable[[], str | None],
                 max_message_bytes: int = 4 * 1024 * 1024, mounts: Mapping[str, ASGIApp] | None = None,
                 tokens: Tokens | None = None, own_user: OwnUserOnly | None = None,
                 table: tuple[Route, ...] = TABLE, oidc: Oidc | None = None) -> None:
        self.grpc_web = GrpcWeb(lookup, max_message_bytes)
        self.api = NeuroSanHttp(lookup, max_message_bytes)
        self.metrics = metrics
        self.page = page
        # Why calls would fail right now (shutting down, the store failing), None when ready: /readyz
        # says it, so an operator sees the reason where the probe fails.
        self.not_ready = not_ready
        # Other parts that live on the HTTP port, by path: each is served by its route in `table`.
        self.mounts: dict[str, ASGIApp] = dict(mounts or {})
        self.tokens = tokens or Tokens()
        # No tokens on a loopback bind: uibus's own user only (uibus.infra.peers); tokens, when set, decide.
        self.own_user = own_user if not self.tokens.enabled else None
        # What the page's responses carry besides their content type: the HTTP server sets the CSP
        # `frame-ancestors` of its browser policy here (who may frame the page that answers dialogs).
        self.page_headers: list[tuple[bytes, bytes]] = []
        self.table = table
        self.handlers: dict[str, ASGIApp] = {
            "grpc-web": self.grpc_web, "api": self.api, "docs": _docs, "page": self._page, "favicon": _favicon,
            "ok": _ok, "ready": self._ready, "metrics": self._metrics, "not found": _not_found,
            "signin": self._signin, "resource metadata": ProtectedResource(oidc), "invite": invite_link}
        # With a provider, every 401 names where a token comes from (uibus.edge.transports.oauth_resource).
        self.oidc = oidc
        self.guard: ASGIApp | None = None  # the browser policy in front of `_admit`: set by `build`
        # The page's sign-in (uibus.edge.transports.signin), when --oidc-issuer is set: its routes, and
        # the one place a session cookie becomes the request's authorization (`_admit`).
        self.signin: SignIn | None = None

    def check(self) -> None:
        """Raises ValueError for a table that is not whole: a route of an unknown handler or token,
        a mount no route serves (a door without a declared policy), a request no route takes."""
        for route in self.table:
            if route.tokens not in DOOR_TOKENS or (route.handler != MOUNT and route.handler not in self.handlers):
                raise ValueError(f"route {route.path}: unknown handler {route.handler!r} or tokens {route.tokens!r}")
        declared = {r.path for r in self.table if r.handler == MOUNT}
        if undeclared := sorted(set(self.mounts) - declared):
            raise ValueError(f"mounted at {', '.join(undeclared)} but the route table declares no route (and so no "
                             "token or browser policy) for it: add one to uibus.edge.transports.routes.TABLE")
        if not (self.table and self.table[-1].prefix and self.table[-1].path == "/" and self.table[-1].websocket):
            raise ValueError("the route table's last route must take every request (its 404)")

    def route_of(self, scope: Scope) -> Route:
        """The first route that takes the request (a mount's route only while it is mounted)."""
        for route in self.table:
            if route.takes(scope) and (route.handler != MOUNT or route.path in self.mounts):
                return route
        raise AssertionError("the last route takes every request")  # `check` made sure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return  # lifespan is off: nothing else reaches an app of uvicorn's
        route = self.route_of(scope)
        scope[_ROUTE] = route
        if not route.browser:
            await self._admit(scope, receive, send)
        elif self.guard is None:
            raise RuntimeError("the routes are served without the browser policy: serve build(routes, policy)")
        else:
            await self.guard(scope, receive, send)

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The gate's steps 2 to 4 (the module docstring), then the route's handler."""
        route: Route = scope[_ROUTE]
        if self.oidc is not None:
            send = challenging(scope, send)
        if route.tokens != PROBE and self.own_user is not None and \
                (why := self.own_user.refusal(peer_of(scope))) is not None:
            await refuse(scope, send, 401, why + "\n")
            return
        if route.methods and scope["type"] == "http" and scope["method"] not in route.methods:
            if route.answer == JSON:
                await wrong_method(send, scope["method"], scope["path"], ", ".join(route.methods))
            else:  # RFC 9110: a 405 says what the path takes
                await respond(send, 405, f"no {scope['method']} route for {scope['path']}: use {route.methods[0]}\n",
                              headers=[(b"allow", ", ".join(route.methods).encode())])
            return
        if self.signin is not None and route.handler != "signin":  # the cookie, as a bearer (SignIn.admit)
            safe = scope["type"] == "http" and scope["method"] in GET and route.methods == GET
            if (refused := self.signin.admit(scope, safe)) is not None:
                status, why = refused
                await self._denied(route, scope, send, Unauthenticated(why) if status == 401 else PermissionDenied(why))
                return
        if route.tokens in (ANY_TOKEN, METRICS_READER):
            try:
                scope[GRANT] = check_bearer(self.tokens, route.tokens, header(scope, b"authorization"))
            except (Unauthenticated, PermissionDenied) as exc:
                await self._denied(route, scope, send, exc)
                return
        handler = self.mounts[route.path] if route.handler == MOUNT else self.handlers[route.handler]
        await handler(scope, receive, send)

    async def _denied(self, route: Route, scope: Scope, send: Send, exc: Unauthenticated | PermissionDenied) -> None:
        """A refused token, framed as the route's handler frames its answers: 401 with the Bearer
        challenge (RFC 6750) for a missing or unknown token, 403 for one that may not use the route."""
        status = 401 if isinstance(exc, Unauthenticated) else 403
        extra = [CHALLENGE] if status == 401 else []
        if route.answer == LOGIN:  # the page asks for the token (URL fragment, or a prompt): uibus.infra.webview
            page = login_html(signin=self.signin is not None, notice=scope.get(EXPIRED, ""))
            await respond(send, 401, page, "text/html; charset=utf-8",
                          [*extra, (b"cache-control", b"no-store"), *self.page_headers])
        elif route.answer == JSON:
            await refuse(scope, send, status, dump_json(error_body(grpc.StatusCode[exc.code], f"{route.path} {exc}")),
                         "application/json", extra)
        else:
            await refuse(scope, send, status, f"{route.path} {exc}\n", headers=extra)

    # ---- the port's own handlers ------------------------------------------------------------------

    async def _page(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, self.page(), "text/html; charset=utf-8",
                      [(b"cache-control", b"no-cache"), *self.page_headers])

    async def _signin(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.signin is None:
            await respond(send, 404, "sign-in is off: start uibus with --oidc-issuer (docs/security/sign-in.md)\n")
        else:
            await self.signin(scope, receive, send)

    async def _ready(self, scope: Scope, receive: Receive, send: Send) -> None:
        reason = self.not_ready()
        await respond(send, 503 if reason else 200, f"not ready: {reason}\n" if reason else "ok\n")

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, self.metrics.render(), CONTENT_TYPE)


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:
    await respond(send, 200, "ok\n")


async def _docs(scope: Scope, receive: Receive, send: Send) -> None:
    await respond(send, 200, document_json(), "application/json")


async def _favicon(scope: Scope, receive: Receive, send: Send) -> None:
    # SVG under both names (every current browser takes SVG at /favicon.ico too), so no binary asset.
    await respond(send, 200, FAVICON_SVG, "image/svg+xml", [(b"cache-control", b"max-age=86400")])


async def _not_found(scope: Scope, receive: Receive, send: Send) -> None:
    path = scope["path"]
    if scope["type"] != "http":
        await refuse(scope, send, 404, f"no WebSocket endpoint at {path}\n")
    elif scope["method"] not in GET:
        await respond(send, 404, f"no {scope['method']} route for {path}\n")
    else:
        await respond(send, 404, f"not found: {path}\n")


# The page's icon (web/src/index.html links `favicon.svg`): a speech bubble on the page's accent blue.
FAVICON_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
               '<rect width="32" height="32" rx="7" fill="#3b82f6"/>'
               '<path d="M8 9h16a2 2 0 0 1 2 2v8a2 2 0 0 1-2 2h-9l-5 4v-4H8a2 2 0 0 1-2-2v-8a2 2 0 0 1 2-2z" '
               'fill="#fff"/></svg>\n')


def build(routes: Routes, policy: BrowserPolicy) -> ASGIApp:
    """The routes behind the gate: the one place every request to the HTTP port enters (a table
    that is not whole fails here, at start). No answer (a route's, a mount's or the gate's refusal)
    starts before the request body has arrived (`drain_first`: else the connection's close can
    reset the answer away)."""
    routes.check()
    routes.guard = BrowserGuard(routes._admit, policy, routes.metrics.refused)
    return drain_first(routes, routes.grpc_web.max_body)

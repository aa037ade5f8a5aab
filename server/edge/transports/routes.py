"""The HTTP port's one ASGI app: routing between the parts, behind the browser policy (Host, Origin,
CORS: uibus.edge.transports.browser), which every route and mount passes.

Routing is a handful of prefix/exact checks rather than a framework router: gRPC-Web is chosen
by content type (any `/pkg.Service/Method` path), everything else by path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from uibus.edge.metrics import CONTENT_TYPE, Metrics
from uibus.edge.transports.asgi import CHALLENGE, ASGIApp, Receive, Scope, Send, drain_first, header, refuse, respond
from uibus.edge.transports.browser import BrowserGuard, BrowserPolicy
from uibus.edge.transports.grpcweb import GrpcWeb, Lookup, is_grpc_web, peer_of
from uibus.edge.transports.neurosan_http import PREFIX, NeuroSanHttp
from uibus.infra.auth import Tokens, bearer
from uibus.infra.peers import OwnUserOnly
from uibus.infra.webview import login_html


class Routes:
    def __init__(self, lookup: Lookup, metrics: Metrics, page: Callable[[], str],
                 not_ready: Callable[[], str | None],
                 max_message_bytes: int = 4 * 1024 * 1024, mounts: Mapping[str, ASGIApp] | None = None,
                 tokens: Tokens | None = None, own_user: OwnUserOnly | None = None) -> None:
        self.grpc_web = GrpcWeb(lookup, max_message_bytes)
        self.api = NeuroSanHttp(lookup, max_message_bytes)
        self.metrics = metrics
        self.page = page
        # Why calls would fail right now (shutting down, the store failing), None when ready: /readyz
        # says it, so an operator sees the reason where the probe fails.
        self.not_ready = not_ready
        # Other parts that live on the HTTP port, by path prefix (the CodeBolt WebSocket).
        self.mounts: dict[str, ASGIApp] = dict(mounts or {})
        # With tokens configured, the page and /metrics need one too (health stays open for probes);
        # gRPC-Web, the HTTP API and the WebSocket are checked by the handler pipeline.
        self.tokens = tokens or Tokens()
        # No tokens on a loopback bind: every request but the probes' must come from a socket of
        # uibus's own user (the pipeline's rule, uibus.infra.peers), here for what passes no handler too
        # (the page, /metrics, the WebSocket upgrades): 401 with the reason.
        self.own_user = own_user if not self.tokens.enabled else None
        # What the page's responses carry besides their content type: the HTTP server sets the CSP
        # `frame-ancestors` of its browser policy here (who may frame the page that answers dialogs).
        self.page_headers: list[tuple[bytes, bytes]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if self.own_user is not None and path not in _PROBES and \
                (why := self.own_user.refusal(peer_of(scope))) is not None:
            await refuse(scope, send, 401, why + "\n")
            return
        for prefix, mounted in self.mounts.items():
            if path == prefix or path.startswith(prefix + "/"):
                await mounted(scope, receive, send)
                return
        if scope["type"] != "http":
            await refuse(scope, send, 404, f"no WebSocket endpoint at {path}\n")
            return
        if is_grpc_web(header(scope, b"content-type")):
            await self.grpc_web(scope, receive, send)
        elif path.startswith(PREFIX):
            await self.api(scope, receive, send)
        elif scope["method"] not in ("GET", "HEAD"):
            if path in _GET_PATHS:  # RFC 9110: a 405 says what the path takes
                await respond(send, 405, f"no {scope['method']} route for {path}: use GET\n",
                              headers=[(b"allow", b"GET, HEAD")])
            else:
                await respond(send, 404, f"no {scope['method']} route for {path}\n")
        elif path == "/":
            if self.tokens.enabled and self.tokens.grant(bearer(header(scope, b"authorization"))) is None:
                # The browser cannot send a header when it navigates: this page asks for the token
                # (URL fragment, or a prompt), then loads the real page with it (uibus.infra.webview).
                await respond(send, 401, login_html(), "text/html; charset=utf-8",
                              [*_LOGIN_HEADERS, *self.page_headers])
            else:
                await respond(send, 200, self.page(), "text/html; charset=utf-8",
                              [(b"cache-control", b"no-cache"), *self.page_headers])
        elif path in ("/favicon.ico", "/favicon.svg"):
            # Public like health: a browser fetches it without the page's token. SVG under both
            # names (every current browser takes SVG at /favicon.ico too), so no binary asset.
            await respond(send, 200, FAVICON_SVG, "image/svg+xml", [(b"cache-control", b"max-age=86400")])
        elif path in ("/healthz", "/livez"):
            await respond(send, 200, "ok\n")
        elif path == "/readyz":
            reason = self.not_ready()
            if reason:
                await respond(send, 503, f"not ready: {reason}\n")
            else:
                await respond(send, 200, "ok\n")
        elif path == "/metrics":
            token = bearer(header(scope, b"authorization"))
            if not self.tokens.enabled or self.tokens.may_read_metrics(token):
                await respond(send, 200, self.metrics.render(), CONTENT_TYPE)
            elif self.tokens.grant(token) is None:
                await respond(send, 401, "/metrics needs `Authorization: Bearer <token>` (--metrics-token or an "
                                         "all-sessions token)\n", headers=[CHALLENGE])
            else:  # a tenant's token: /metrics shows every tenant's traffic
                await respond(send, 403, "/metrics needs --metrics-token or a token that may use all sessions\n")
        else:
            await respond(send, 404, f"not found: {path}\n")


_PROBES = frozenset({"/healthz", "/livez", "/readyz"})  # open to every local user: they say nothing of sessions
_GET_PATHS = frozenset({"/", "/healthz", "/livez", "/readyz", "/metrics", "/favicon.ico", "/favicon.svg"})
# The page's icon (web/src/index.html links `favicon.svg`): a speech bubble on the page's accent blue.
FAVICON_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
               '<rect width="32" height="32" rx="7" fill="#3b82f6"/>'
               '<path d="M8 9h16a2 2 0 0 1 2 2v8a2 2 0 0 1-2 2h-9l-5 4v-4H8a2 2 0 0 1-2-2v-8a2 2 0 0 1 2-2z" '
               'fill="#fff"/></svg>\n')
_LOGIN_HEADERS = [CHALLENGE, (b"cache-control", b"no-store")]


def build(routes: Routes, policy: BrowserPolicy) -> ASGIApp:
    """The routes behind the policy: the one place every request to the HTTP port enters. No answer
    (a route's, a mount's or the policy's refusal) starts before the request body has arrived
    (`drain_first`: else the connection's close can reset the answer away)."""
    return drain_first(BrowserGuard(routes, policy, routes.metrics.refused), routes.grpc_web.max_body)

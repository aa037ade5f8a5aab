"""The HTTP port's one ASGI app: routing between the parts, wrapped in CORS.

Routing is a handful of prefix/exact checks rather than a framework router: gRPC-Web is chosen
by content type (any `/pkg.Service/Method` path), everything else by path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from uibus.metrics import CONTENT_TYPE, Metrics
from uibus.transports.asgi import ASGIApp, Receive, Scope, Send, header, respond
from uibus.transports.cors import Cors
from uibus.transports.grpcweb import GrpcWeb, Lookup, is_grpc_web
from uibus.transports.neurosan_http import PREFIX, NeuroSanHttp


class Routes:
    def __init__(self, lookup: Lookup, metrics: Metrics, page: Callable[[], str], stopping: Callable[[], bool],
                 max_message_bytes: int = 4 * 1024 * 1024, mounts: Mapping[str, ASGIApp] | None = None) -> None:
        self.grpc_web = GrpcWeb(lookup, max_message_bytes)
        self.api = NeuroSanHttp(lookup, max_message_bytes)
        self.metrics = metrics
        self.page = page
        self.stopping = stopping
        # Other parts that live on the HTTP port, by path prefix (the CodeBolt WebSocket).
        self.mounts: dict[str, ASGIApp] = dict(mounts or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        for prefix, mounted in self.mounts.items():
            if path == prefix or path.startswith(prefix + "/"):
                await mounted(scope, receive, send)
                return
        if scope["type"] != "http":
            return  # no WebSocket route here: returning makes the server refuse the upgrade
        if is_grpc_web(header(scope, b"content-type")):
            await self.grpc_web(scope, receive, send)
        elif path.startswith(PREFIX):
            await self.api(scope, receive, send)
        elif scope["method"] not in ("GET", "HEAD"):
            await respond(send, 405 if path in _GET_PATHS else 404, f"no {scope['method']} route for {path}\n")
        elif path == "/":
            await respond(send, 200, self.page(), "text/html; charset=utf-8",
                          [(b"cache-control", b"no-cache")])
        elif path in ("/healthz", "/livez"):
            await respond(send, 200, "ok\n")
        elif path == "/readyz":
            if self.stopping():
                await respond(send, 503, "shutting down\n")
            else:
                await respond(send, 200, "ok\n")
        elif path == "/metrics":
            await respond(send, 200, self.metrics.render(), CONTENT_TYPE)
        else:
            await respond(send, 404, f"not found: {path}\n")


_GET_PATHS = frozenset({"/", "/healthz", "/livez", "/readyz", "/metrics"})


def build(routes: Routes, cors_origins: str) -> ASGIApp:
    return Cors(routes, cors_origins)

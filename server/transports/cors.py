"""CORS for gRPC-Web and the HTTP API: an allow-list of origins from `Config.cors_origins`.

An allowed origin is echoed back (never a blanket `*`, so requests carrying `authorization` work);
a refused origin gets a 403 without any CORS header, so the browser blocks it and a script learns
nothing. The page's own origin is always allowed: browsers send `Origin` on same-origin POSTs.
"""

from __future__ import annotations

from uibus.transports.asgi import ASGIApp, Message, Receive, Scope, Send, header, respond

ALLOW_HEADERS = ("content-type, x-grpc-web, x-user-agent, grpc-timeout, x-uibus-session, authorization, "
                 "service_version, user_id, request_id, mcp-session-id, mcp-protocol-version, last-event-id")
EXPOSE_HEADERS = "grpc-status, grpc-message, grpc-status-details-bin, content-type, mcp-session-id"
MAX_AGE = "600"


class Cors:
    def __init__(self, app: ASGIApp, origins: str) -> None:
        self.app = app
        items = [o.strip().rstrip("/") for o in origins.split(",") if o.strip()]
        self.any = "*" in items
        self.origins = frozenset(items)

    def allowed(self, origin: str, scope: Scope) -> bool:
        if self.any or origin in self.origins:
            return True
        host = header(scope, b"host")
        return bool(host) and origin == f"{scope.get('scheme', 'http')}://{host}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = header(scope, b"origin")
        if not origin:  # not a cross-origin browser request: nothing to add
            await self.app(scope, receive, send)
            return
        preflight = scope["method"] == "OPTIONS" and header(scope, b"access-control-request-method")
        if not self.allowed(origin, scope):
            await respond(send, 403, f"origin {origin} is not allowed (see --cors-origins)\n")
            return
        echo = [(b"access-control-allow-origin", origin.encode()), (b"vary", b"Origin")]
        if preflight:
            await respond(send, 204, b"", headers=[
                *echo, (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                (b"access-control-allow-headers", ALLOW_HEADERS.encode()),
                (b"access-control-max-age", MAX_AGE.encode())])
            return
        extra = [*echo, (b"access-control-expose-headers", EXPOSE_HEADERS.encode())]

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

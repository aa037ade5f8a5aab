"""uibus as an OAuth protected resource (RFC 9728), as the MCP specification's authorization asks:
what tells an MCP client (or any client) where to get a token, when `--oidc-issuer` is set.

* `GET /.well-known/oauth-protected-resource` and its path-suffixed form for /mcp
  (`/.well-known/oauth-protected-resource/mcp`) answer the resource's metadata: `resource` (this
  server's /mcp URL as the request reached it: its Host, which the browser policy has checked, and
  its scheme, or `X-Forwarded-Proto` from a TLS-terminating proxy), `authorization_servers` (the
  issuer), `bearer_methods_supported` (the header only). Without a provider they are 404.
* Every 401 the HTTP port answers (any door: /mcp, /acp, the HTTP APIs, CodeBolt's upgrade, the
  page) carries `WWW-Authenticate: Bearer realm="uibus", resource_metadata="<that document>"`, and
  `error="invalid_token"` when the request had a token that was refused (RFC 6750 §3.1); the gate
  rewrites the challenge of whichever handler answered, so no transport needs to know of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from uibus.edge.transports.asgi import Message, Receive, Scope, Send, header, respond, respond_json
from uibus.edge.transports.mcp_http import PATH as MCP_PATH

if TYPE_CHECKING:  # the provider's JOSE stack loads only with --oidc-issuer
    from uibus.infra.oidc import Oidc

METADATA_PATH = "/.well-known/oauth-protected-resource"
PATHS = (METADATA_PATH, METADATA_PATH + MCP_PATH)
_STARTS = ("http.response.start", "websocket.http.response.start")


def origin_of(scope: Scope) -> str:
    """`scheme://host[:port]` of the request as its client addressed it."""
    proto = header(scope, b"x-forwarded-proto").split(",")[0].strip().lower()
    scheme = proto if proto in ("http", "https") else \
        {"ws": "http", "wss": "https"}.get(scope.get("scheme", "http"), scope.get("scheme", "http"))
    host = header(scope, b"host")
    if not host:
        server = scope.get("server") or ("127.0.0.1", 80)
        host = f"[{server[0]}]:{server[1]}" if ":" in str(server[0]) else f"{server[0]}:{server[1]}"
    return f"{scheme}://{host}"


def metadata_url(scope: Scope) -> str:
    return origin_of(scope) + METADATA_PATH + MCP_PATH


def metadata(oidc: Oidc, scope: Scope) -> dict[str, object]:
    """The RFC 9728 document of /mcp as this request reached it."""
    return {"resource": origin_of(scope) + MCP_PATH, "authorization_servers": [oidc.issuer],
            "bearer_methods_supported": ["header"], "resource_name": "uibus"}


def challenge(scope: Scope) -> tuple[bytes, bytes]:
    """The `WWW-Authenticate` of a 401 to this request (the module docstring)."""
    value = f'Bearer realm="uibus", resource_metadata="{metadata_url(scope)}"'
    if header(scope, b"authorization"):
        value += ', error="invalid_token"'
    return b"www-authenticate", value.encode("latin-1", errors="replace")


def challenging(scope: Scope, send: Send) -> Send:
    """`send` with every 401's challenge replaced by `challenge(scope)`."""
    async def send_(message: Message) -> None:
        if message.get("type") in _STARTS and message.get("status") == 401:
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"www-authenticate"]
            message = {**message, "headers": [*headers, challenge(scope)]}
        await send(message)
    return send_


class ProtectedResource:
    """The metadata routes' handler (uibus.edge.transports.routes)."""

    def __init__(self, oidc: Oidc | None) -> None:
        self.oidc = oidc

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.oidc is None:
            await respond(send, 404, f"not found: {scope['path']} (no --oidc-issuer: uibus names no "
                                     "authorization server)\n")
            return
        await respond_json(send, 200, metadata(self.oidc, scope),
                           headers=[(b"cache-control", b"max-age=300")])

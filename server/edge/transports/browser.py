"""What a web browser may reach on the HTTP port: one Host check and one Origin policy, applied as
ASGI middleware in front of every route (gRPC-Web, the neuro-san HTTP API, `/mcp`, the page, the
CodeBolt WebSocket and every other mount), for HTTP requests and WebSocket upgrades alike.

Why both, and why here rather than in each route (see docs/security.md, "Security model"):

* **Host** defeats DNS rebinding. A page on `http://evil.example:8080` whose name the attacker later
  points at 127.0.0.1 is, to the browser, same-origin with itself: its requests carry
  `Host: evil.example:8080` and `Origin: http://evil.example:8080`, so an Origin check that trusts
  the Host header (the page's own origin) lets it in. Only a Host this server answers to is served:
  loopback names and addresses, the address it was bound to, any IP literal when it listens on
  every interface (an IP cannot be rebound), and `--allowed-hosts` (the names an ingress forwards).
  This is what Jupyter Server and the MCP SDK's transport security do.
* **Origin** stops cross-site requests (CSRF, cross-site WebSocket hijacking): a page the developer
  merely visits can POST gRPC-Web, call `/mcp` or open a WebSocket to localhost. Admitted by
  default: the page's own origin (from the *checked* Host), loopback pages on this server's own
  port (`localhost` vs `127.0.0.1` aliases of it; another port is another site) and IDE webviews
  (`vscode-webview://…`: VS Code and its forks — Cursor, Windsurf, VSCodium — give every webview
  that origin, and no web page can have it). `--cors-origins` adds origins or `*.`-patterns; `*`
  admits every page, and only when asked for. `Origin: null` (sandboxed frames, `file:` pages) is
  never admitted unless listed. A request without `Origin` is not a cross-site browser request
  (browsers send it on every POST, CORS fetch and WebSocket) and is not this policy's business:
  native clients, agents and curl are governed by tokens.

An admitted origin is echoed in the CORS headers (never a blanket `*`, so `authorization` works);
a refused request gets one JSON error naming the flag to change, and nothing else reaches a route.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from uibus.edge.transports.asgi import ASGIApp, Message, Receive, Scope, Send, header, refuse, respond
from uibus.infra.config import Config, is_loopback
from uibus.infra.errors import ConfigError
from uibus.infra.json_input import dump_json
from uibus.infra.logs import Throttle

log = logging.getLogger("uibus.web")

ALLOW_HEADERS = ("content-type, x-grpc-web, x-user-agent, grpc-timeout, x-uibus-session, x-uibus-since, authorization, "
                 "x-uibus-csrf, service_version, user_id, request_id, mcp-session-id, mcp-protocol-version, "
                 # W3C trace context: a traced page's calls join its trace
                 "last-event-id, traceparent, tracestate, baggage")
EXPOSE_HEADERS = "grpc-status, grpc-message, grpc-status-details-bin, content-type, mcp-session-id"
MAX_AGE = "600"
# Origins of IDE webviews, by scheme: a web page can never have these.
IDE_WEBVIEW_SCHEMES = frozenset({"vscode-webview"})
_DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header's (lower-case name, port or None); None when it is not a host[:port] at all."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else ""
    else:
        name, _, port_text = value.partition(":")
        if ":" in port_text:
            return None
    if not name or any(c in name for c in "/@?#\\ \t") or (port_text and not port_text.isdigit()):
        return None
    port = int(port_text) if port_text else None
    if port is not None and not 0 < port < 65536:
        return None
    return name.rstrip("."), port


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class _Origin:
    scheme: str
    name: str
    port: int | None  # the effective port (the scheme's default when the origin names none)


def parse_origin(value: str) -> _Origin | None:
    """A serialized origin (`scheme://host[:port]`, nothing else), or None."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    if not parts.scheme or not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment \
            or parts.username is not None:
        return None
    scheme = parts.scheme.lower()
    return _Origin(scheme, parts.hostname.lower().rstrip("."), port if port is not None else _DEFAULT_PORTS.get(scheme))


def _serialized(origin: _Origin) -> str:
    """The origin as browsers serialize it: lower case, the scheme's default port left out."""
    name = f"[{origin.name}]" if ":" in origin.name else origin.name
    port = "" if origin.port is None or origin.port == _DEFAULT_PORTS.get(origin.scheme) else f":{origin.port}"
    return f"{origin.scheme}://{name}{port}"


def _matches(pattern: str, value: str) -> bool:
    """`pattern` is a value or has one `*.` wildcard for any run of DNS labels (`*.example.com`,
    `https://*.example.com:8443`); no other glob syntax, so `[` in an IPv6 origin is literal."""
    if "*." not in pattern:
        return pattern == value
    before, _, after = pattern.partition("*.")
    if not (value.startswith(before) and value.endswith("." + after)):
        return False
    labels = value[len(before):len(value) - len(after) - 1]
    return bool(labels) and not any(c in labels for c in "/:@[]")


def _patterns(text: str) -> tuple[bool, tuple[str, ...]]:
    items = tuple(i.strip().lower().rstrip("/") for i in text.split(",") if i.strip())
    return "*" in items, tuple(i for i in items if i != "*")


@dataclass(frozen=True, slots=True)
class BrowserPolicy:
    """The Host and Origin rules of one HTTP port (from `Config`; see the module docstring)."""

    bind: str = "127.0.0.1"
    any_host: bool = False
    hosts: tuple[tuple[str, int | None], ...] = ()  # (name or `*.` pattern, port or None: any)
    any_origin: bool = False
    origins: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: Config) -> BrowserPolicy:
        """The policy of `config`; a list entry that can never match is a ConfigError naming its flag
        (a typo there would otherwise only show as refused pages)."""
        any_host, entries = _patterns(config.allowed_hosts)
        hosts = []
        for entry in entries:
            parsed = split_host(entry)
            if parsed is None:
                raise ConfigError("--allowed-hosts", f"{entry[:60]!r} is not a host name or address "
                                  "(with an optional :port; `*.example.com` for subdomains)")
            hosts.append(parsed)
        any_origin, entries = _patterns(config.cors_origins)
        origins = []
        for entry in entries:
            wildcard = "://*." in entry
            parsed = parse_origin(entry.replace("://*.", "://x.", 1))
            if entry == "null":
                origins.append(entry)
            elif parsed is None:
                raise ConfigError("--cors-origins", f"{entry[:60]!r} is not an origin: scheme://host[:port] "
                                  "(`https://*.example.com` for subdomains, `*` for every page)")
            else:  # as browsers send it (`https://ide.example:443` is sent as `https://ide.example`)
                origins.append(_serialized(parsed).replace("://x.", "://*.", 1) if wildcard else _serialized(parsed))
        return cls(config.host.strip().strip("[]").lower(), any_host, tuple(hosts), any_origin, tuple(origins))

    def host_allowed(self, host: str) -> bool:
        """Whether a request naming `host` (its Host header, "" when absent) is for this server."""
        if self.any_host or not host:  # every browser sends Host: a request without one is no page's
            return True
        parsed = split_host(host)
        if parsed is None:
            return False
        name, port = parsed
        if is_loopback(name) or name == self.bind or (self.bind in _WILDCARD_BINDS and _is_ip(name)):
            return True
        return any(_matches(pattern, name) and wanted in (None, port) for pattern, wanted in self.hosts)

    def origin_allowed(self, origin: str, host: str, local_port: int | None) -> bool:
        """Whether a page of `origin` may call this server, reached as `host` (a Host header that
        passed `host_allowed`) on its listening port `local_port`."""
        if self.any_origin:
            return True
        parsed = parse_origin(origin)
        if parsed is None:  # `null` and anything that is no origin
            return origin.strip() == "null" and "null" in self.origins
        value = _serialized(parsed)
        if any(_matches(p, value) for p in self.origins):
            return True
        if parsed.scheme in IDE_WEBVIEW_SCHEMES:
            return True
        if parsed.scheme not in _DEFAULT_PORTS:
            return False
        target = split_host(host) if host else None
        if target is not None:
            name, port = target
            if parsed.name == name and parsed.port == (port if port is not None else _DEFAULT_PORTS[parsed.scheme]):
                return True  # the page's own origin, whatever scheme a proxy in front of us terminated
        return local_port is not None and is_loopback(parsed.name) and parsed.port == local_port

    def frame_ancestors(self) -> str:
        """The CSP `frame-ancestors` of the page: itself, IDE webviews and `--cors-origins`, no other page
        (one that frames the webview could trick a click on a dialog's answer). Loopback pages on other
        ports are as foreign here as they are to the Origin policy."""
        if self.any_origin:
            return "*"
        sources = ["'self'", *(f"{s}:" for s in sorted(IDE_WEBVIEW_SCHEMES)), *(o for o in self.origins if o != "null")]
        return " ".join(sources)


def _local_port(scope: Scope) -> int | None:
    server = scope.get("server")
    return server[1] if server and len(server) > 1 and isinstance(server[1], int) else None


class BrowserGuard:
    """The middleware: Host first (a rebinding name fails before its Origin could look like our own),
    then Origin, then CORS headers on what passes. `refused(reason)` counts each refusal."""

    def __init__(self, app: ASGIApp, policy: BrowserPolicy,
                 refused: Callable[[str], None] = lambda _reason: None) -> None:
        self.app = app
        self.policy = policy
        self.refused = refused
        self._log = {"host": Throttle(burst=3, window_s=60.0), "origin": Throttle(burst=3, window_s=60.0)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = header(scope, b"host")
        if not self.policy.host_allowed(host):
            await self._refuse(scope, send, "host", 421, f"Host {host[:100]!r} is not a name this server answers "
                               "to (DNS rebinding protection): start uibus with --allowed-hosts naming it")
            return
        origin = header(scope, b"origin")
        if not origin:
            await self.app(scope, receive, send)
            return
        if not self.policy.origin_allowed(origin, host, _local_port(scope)):
            await self._refuse(scope, send, "origin", 403, f"pages of origin {origin[:100]!r} may not call this "
                               "server: start uibus with --cors-origins naming it")
            return
        if kind == "websocket":
            await self.app(scope, receive, send)
            return
        echo = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and header(scope, b"access-control-request-method"):
            extra = [(b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                     (b"access-control-allow-headers", ALLOW_HEADERS.encode()),
                     (b"access-control-max-age", MAX_AGE.encode())]
            if header(scope, b"access-control-request-private-network"):  # Chrome's Private Network Access
                extra.append((b"access-control-allow-private-network", b"true"))
            await respond(send, 204, b"", headers=[*echo, *extra])
            return
        added = [*echo, (b"access-control-expose-headers", EXPOSE_HEADERS.encode())]

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *added]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _refuse(self, scope: Scope, send: Send, reason: str, status: int, why: str) -> None:
        self.refused(reason)
        skipped = self._log[reason].allow()
        if skipped is not None:
            fields: dict[str, object] = {"reason": why, "path": scope.get("path", "")[:200]}
            if skipped:
                fields["not_logged_before"] = skipped
            log.warning("browser request refused", extra={"fields": fields})
        await refuse(scope, send, status, dump_json({"error": why, "code": "PERMISSION_DENIED"}), "application/json")

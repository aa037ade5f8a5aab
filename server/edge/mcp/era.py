"""MCP's stateless era (protocol 2026-07-28) as uibus speaks it: which era a request is in, the
per-request envelope every modern request carries, the checks the specification asks of a server
before it runs one (the "validation ladder"), and what every modern result carries.

Why an era per request, not per connection: 2026-07-28 has no handshake and no `Mcp-Session-Id`.
Each request names its protocol version and the client's capabilities in `params._meta`, so one
`/mcp` serves a modern client and a 2025-11-25 client side by side, and any replica can answer any
modern request (nothing is remembered between them). A request is modern when its envelope names
a protocol version, or when its `MCP-Protocol-Version` header names one that is not a handshake
version; `initialize` always starts today's sessions.

Pure data and functions: no I/O. `uibus.edge.mcp.server` runs the methods, the transport
(`uibus.edge.transports.mcp_http`) hands the headers in and maps the codes to HTTP statuses.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from typing import Any

from uibus.edge.mcp.protocol import (
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    VERSIONS,
    Envelope,
    ProtocolError,
)

MODERN = ("2026-07-28",)  # the per-request-envelope revisions uibus serves
SUPPORTED = (*VERSIONS, *MODERN)  # what server/discover lists: every revision, either era

# the envelope's keys (reserved `io.modelcontextprotocol/` names in `_meta`)
PROTOCOL_VERSION = "io.modelcontextprotocol/protocolVersion"
CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
CLIENT_INFO = "io.modelcontextprotocol/clientInfo"
LOG_LEVEL = "io.modelcontextprotocol/logLevel"
SERVER_INFO = "io.modelcontextprotocol/serverInfo"
SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId"
TASKS = "io.modelcontextprotocol/tasks"  # the tasks extension (uibus.edge.mcp.tasks)

# the specification's error codes of the era (its -32020.. range)
HEADER_MISMATCH = -32020
MISSING_CLIENT_CAPABILITY = -32021
UNSUPPORTED_VERSION = -32022
# The HTTP status of each code, as the specification requires (every other error: 200).
HTTP_STATUS = {HEADER_MISMATCH: 400, MISSING_CLIENT_CAPABILITY: 400, UNSUPPORTED_VERSION: 400,
               INVALID_PARAMS: 400, INVALID_REQUEST: 400, PARSE_ERROR: 400, METHOD_NOT_FOUND: 404}

# Methods whose target is mirrored in the `Mcp-Name` header, and the param it mirrors. The tasks
# extension asks it of its methods too (the task id).
NAMED = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri",
         "tasks/get": "taskId", "tasks/update": "taskId", "tasks/cancel": "taskId"}
ROUTING_HEADERS = ("mcp-protocol-version", "mcp-method", "mcp-name")

# Trace context an MCP client may carry in `_meta` (the W3C names): joined to uibus's traces as if
# it had come as headers.
TRACE_KEYS = ("traceparent", "tracestate", "baggage")

_SENTINEL = re.compile(r"^=\?base64\?(?P<payload>.*)\?=$")


class EraError(ProtocolError):
    """A modern request refused before it runs: its JSON-RPC code, and the error's `data`."""

    def __init__(self, rpc_code: int, message: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.rpc_code = rpc_code
        self.rpc_data = data or {}


def is_modern(method: str | None, params: Mapping[str, Any], version_header: str) -> bool:
    """Whether a request is in the stateless era: its envelope names a version, its header names
    one that no handshake speaks, or it is the era's own probe."""
    if method == "initialize":
        return False
    meta = params.get("_meta")
    if isinstance(meta, dict) and PROTOCOL_VERSION in meta:
        return True
    if method == "server/discover":
        return True
    return bool(version_header) and version_header not in VERSIONS


def decode_header(value: str | None) -> str | None:
    """A header's value as the client meant it: verbatim, or the `=?base64?…?=` form MCP uses for
    values that are not plain printable ASCII (None when that form is broken)."""
    if value is None:
        return None
    found = _SENTINEL.fullmatch(value)
    if found is None:
        return value
    payload = found.group("payload")
    try:
        raw = base64.b64decode(payload, validate=True)
        if base64.b64encode(raw).decode("ascii") != payload:
            return None
        return raw.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None


def envelope(method: str, params: Mapping[str, Any], headers: Mapping[str, str] | None) -> Envelope:
    """The request's envelope, checked as the specification orders it (the first failure wins):
    the envelope's two required keys; the routing headers agree with the body (so a proxy routing
    on headers and the server reading the body see the same request); the version is served.
    `headers`: lower-case names, each once (None: a transport without headers)."""
    meta = params.get("_meta")
    sent = (headers or {}).get("mcp-protocol-version")
    if not isinstance(meta, dict) and sent and sent not in SUPPORTED:  # a version nobody here speaks
        raise EraError(UNSUPPORTED_VERSION, f"MCP-Protocol-Version {sent[:40]!r} is not supported; uibus speaks "
                                            f"{', '.join(SUPPORTED)}", {"supported": list(SUPPORTED),
                                                                         "requested": sent})
    if not isinstance(meta, dict):
        raise EraError(INVALID_PARAMS, f"{method}: params._meta must be an object carrying {PROTOCOL_VERSION!r} and "
                                       f"{CLIENT_CAPABILITIES!r} (protocol {MODERN[-1]}: every request says its "
                                       "version and capabilities)")
    missing = [key for key in (PROTOCOL_VERSION, CLIENT_CAPABILITIES) if key not in meta]
    if missing:
        raise EraError(INVALID_PARAMS, f"{method}: params._meta lacks {', '.join(missing)}")
    version = meta[PROTOCOL_VERSION]
    if headers is not None:
        header = headers.get("mcp-protocol-version")
        if header is None or header != version:
            raise EraError(HEADER_MISMATCH, f"the MCP-Protocol-Version header ({_shown(header)}) does not match "
                                            f"params._meta's protocol version ({_shown(version)})")
        if headers.get("mcp-method") != method:
            raise EraError(HEADER_MISMATCH, f"the Mcp-Method header ({_shown(headers.get('mcp-method'))}) does not "
                                            f"match the request's method ({method})")
        key = NAMED.get(method)
        value = params.get(key) if key else None
        if key and value is not None and decode_header(headers.get("mcp-name")) != value:
            raise EraError(HEADER_MISMATCH, f"the Mcp-Name header ({_shown(headers.get('mcp-name'))}) does not match "
                                            f"params.{key} ({_shown(value)})")
    if not isinstance(version, str):
        raise EraError(INVALID_PARAMS, "params._meta's protocol version must be a string")
    if version not in MODERN:
        raise EraError(UNSUPPORTED_VERSION, f"protocol version {version[:40]!r} is not served here; uibus speaks "
                                            f"{', '.join(MODERN)} per request, and {', '.join(VERSIONS)} after "
                                            "initialize", {"supported": list(MODERN), "requested": version})
    capabilities = meta[CLIENT_CAPABILITIES]
    if not isinstance(capabilities, dict):
        raise EraError(INVALID_PARAMS, f"params._meta's {CLIENT_CAPABILITIES!r} must be an object")
    client = meta.get(CLIENT_INFO)
    level = meta.get(LOG_LEVEL)
    return Envelope(version, capabilities, client if isinstance(client, dict) else {},
                    level if isinstance(level, str) else None)


def _shown(value: Any) -> str:
    return "none" if value is None else repr(value)[:80]


def complete(result: dict[str, Any], server_info: dict[str, Any], *, ttl_ms: int | None = None,
             scope: str = "private") -> dict[str, Any]:
    """A modern result: `resultType` (kept when the method set it, e.g. input_required or a task),
    the server's identity in `_meta`, and, for cacheable results, how long and for whom a client
    may keep it (`private`: what a token may see differs by token)."""
    result.setdefault("resultType", "complete")
    meta = result.setdefault("_meta", {})
    if isinstance(meta, dict):
        meta.setdefault(SERVER_INFO, server_info)
    if ttl_ms is not None:
        result.setdefault("ttlMs", ttl_ms)
        result.setdefault("cacheScope", scope)
    return result


def trace_context(params: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The W3C trace context a request carries in `_meta`, as the metadata pairs uibus's tracing
    reads (a call then joins the client's trace whichever way it sent it)."""
    meta = params.get("_meta")
    if not isinstance(meta, dict):
        return []
    return [(key, value) for key in TRACE_KEYS if isinstance(value := meta.get(key), str) and len(value) <= 1024]

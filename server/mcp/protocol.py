"""The Model Context Protocol's wire vocabulary, as uibus speaks it: versions, JSON-RPC envelopes,
error codes, and the translation between JSON-RPC and the gRPC status names every other transport
uses (so one failure has one meaning, whichever way it came in).

Pure data and functions: no I/O, no domain objects. `uibus.mcp.server` runs the methods,
`uibus.transports.mcp_http` carries them over streamable HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from uibus.errors import InvalidArgument, UibusError, Unimplemented

# The initialize-handshake revisions uibus speaks, oldest first. neuro-san 0.7's client asks for
# 2025-06-18 and accepts only that answer; a client asking for another one we know gets it back,
# any other request gets the newest (the spec's negotiation). The methods served here are the
# same in all four revisions.
VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
LATEST = VERSIONS[-1]

# JSON-RPC 2.0 error codes (the standard ones), plus one server-defined code for everything that
# is a uibus status rather than a protocol mistake; its `data.status` names that status.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
SERVER_ERROR = -32000

# Every MCP method runs as a call of this service in the handler pipeline: `/mcp/<method>` is its
# label in metrics and logs, its access rule is the session's (uibus.pipeline.access_of).
SERVICE = "mcp"
INVALID = f"/{SERVICE}/invalid"          # a body that is not a JSON-RPC message (answered with its error)
UNKNOWN = f"/{SERVICE}/unknown"          # a method uibus does not serve (-32601)
NOTIFICATION = f"/{SERVICE}/notification"  # notifications and responses from the client (202)


def path_of(method: str) -> str:
    return f"/{SERVICE}/{method}"


class ProtocolError(InvalidArgument):
    """Input that is not a JSON-RPC message uibus can take; `rpc_code` is its JSON-RPC code."""

    rpc_code = INVALID_REQUEST


class ParseError(ProtocolError):
    rpc_code = PARSE_ERROR


class InvalidParams(InvalidArgument):
    """The method exists, its params do not fit (including an unknown tool name)."""


class MethodNotFound(Unimplemented):
    pass


@dataclass
class Message:
    """One JSON-RPC message from the client, checked for shape (not yet for its params)."""

    method: str | None  # None: a response to a request of ours (we send none, so it is ignored)
    id: Any = None  # str | int for requests; None for notifications
    params: dict[str, Any] = field(default_factory=dict)
    is_request: bool = False

    @property
    def progress_token(self) -> str | int | None:
        meta = self.params.get("_meta")
        token = meta.get("progressToken") if isinstance(meta, dict) else None
        return token if isinstance(token, str | int) and not isinstance(token, bool) else None


def parse_message(value: Any) -> Message:
    """The JSON-RPC message `value` is, or ProtocolError saying why it is none."""
    if isinstance(value, list):
        raise ProtocolError("JSON-RPC batches are not supported (MCP 2025-06-18 removed them): send one "
                            "message per POST")
    if not isinstance(value, dict):
        raise ProtocolError(f"a JSON-RPC message is a JSON object, not {type(value).__name__}")
    if value.get("jsonrpc") != "2.0":
        raise ProtocolError('a JSON-RPC message needs "jsonrpc": "2.0"')
    has_id = "id" in value
    ident = value.get("id")
    if has_id and (isinstance(ident, bool) or not isinstance(ident, str | int)):
        raise ProtocolError('"id" must be a string or an integer')
    method = value.get("method")
    if method is None:
        if "result" in value or "error" in value:
            return Message(None, ident)  # a client's response: nothing of ours is waiting for it
        raise ProtocolError('a JSON-RPC message needs "method" (or "result"/"error" for a response)')
    if not isinstance(method, str) or not method:
        raise ProtocolError('"method" must be a non-empty string')
    params = value.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ProtocolError(f'"params" of {method} must be an object')
    return Message(method, ident, params, is_request=has_id)


def response(ident: Any, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": ident, "result": result}


def notification(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": params}


def error(ident: Any, status: str, message: str, rpc_code: int | None = None) -> dict[str, Any]:
    """A JSON-RPC error for a uibus status; `data.status` names the status as every transport does."""
    return {"jsonrpc": "2.0", "id": ident, "error": {
        "code": rpc_code if rpc_code is not None else rpc_code_of(status), "message": message or status,
        "data": {"status": status}}}


def rpc_code_of(status: str) -> int:
    """The JSON-RPC code of a status: bad params and unknown methods have standard codes; every
    other failure (no room, store down, shutting down, …) is a server error naming its status."""
    if status == "INVALID_ARGUMENT":
        return INVALID_PARAMS
    if status == "UNIMPLEMENTED":
        return METHOD_NOT_FOUND
    if status == "INTERNAL":
        return INTERNAL_ERROR
    return SERVER_ERROR


def rpc_code_of_error(exc: UibusError) -> int:
    return exc.rpc_code if isinstance(exc, ProtocolError) else rpc_code_of(exc.code)


def negotiate(requested: Any) -> str:
    """The revision to speak: the client's when uibus knows it, else the newest (the client then
    decides whether it can go on)."""
    return requested if requested in VERSIONS else LATEST


def text_result(text: str, structured: dict[str, Any] | None = None, is_error: bool = False) -> dict[str, Any]:
    """A tools/call result: the text for the model, the structured part for programs."""
    result: dict[str, Any] = {"content": [{"type": "text", "text": text}], "isError": is_error}
    if structured is not None:
        result["structuredContent"] = structured
    return result

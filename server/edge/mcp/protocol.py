"""The Model Context Protocol's wire vocabulary, as uibus speaks it: versions, JSON-RPC envelopes
(built by the one JSON-RPC core, uibus.infra.jsonrpc), error codes, and the translation between
JSON-RPC and the gRPC status names every other transport uses (so one failure has one meaning,
whichever way it came in).

Pure data and functions: no I/O, no domain objects. `uibus.edge.mcp.server` runs the methods,
`uibus.edge.transports.mcp_http` carries them over streamable HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import grpc.aio

from uibus.infra.errors import InvalidArgument, UibusError, Unimplemented
from uibus.infra.jsonrpc import INTERNAL_ERROR as INTERNAL_ERROR
from uibus.infra.jsonrpc import INVALID_PARAMS as INVALID_PARAMS
from uibus.infra.jsonrpc import INVALID_REQUEST as INVALID_REQUEST
from uibus.infra.jsonrpc import METHOD_NOT_FOUND as METHOD_NOT_FOUND
from uibus.infra.jsonrpc import PARSE_ERROR as PARSE_ERROR
from uibus.infra.jsonrpc import SERVER_ERROR as SERVER_ERROR
from uibus.infra.jsonrpc import RpcError, check, error_frame, notification_frame, result_frame

# The initialize-handshake revisions uibus speaks, oldest first. neuro-san 0.7's client asks for
# 2025-06-18 and accepts only that answer; a client asking for another one we know gets it back,
# any other request gets the newest (the spec's negotiation). The methods served here are the
# same in all four revisions.
VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
LATEST = VERSIONS[-1]

# JSON-RPC 2.0 error codes: the one table (uibus.infra.jsonrpc). SERVER_ERROR is for everything that is
# a uibus status rather than a protocol mistake; its `data.status` names that status.

# Every MCP method runs as a call of this service in the handler pipeline: `/mcp/<method>` is its
# label in metrics and logs, its access rule is the session's (uibus.edge.calls.access.access_of).
SERVICE = "mcp"
INVALID = f"/{SERVICE}/invalid"          # a body that is not a JSON-RPC message (answered with its error)
UNKNOWN = f"/{SERVICE}/unknown"          # a method uibus does not serve (-32601)
NOTIFICATION = f"/{SERVICE}/notification"  # notifications and responses from the client (202)


def path_of(method: str) -> str:
    return f"/{SERVICE}/{method}"


class ProtocolError(InvalidArgument):
    """Input that is not a JSON-RPC message uibus can take; `rpc_code` is its JSON-RPC code,
    `rpc_data` what its error's `data` says besides the status."""

    rpc_code = INVALID_REQUEST
    rpc_data: ClassVar[dict[str, Any]] = {}  # (an instance of a subclass sets its own)


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
    """The JSON-RPC message `value` is, or ProtocolError saying why it is none: the one JSON-RPC
    check (uibus.infra.jsonrpc.check; MCP ids are never null)."""
    try:
        checked = check(value, null_id=False)
    except RpcError as exc:
        raise ProtocolError(exc.message) from None
    ident = checked.get("id")
    method = checked.get("method")
    if method is None:
        return Message(None, ident)  # a client's response: nothing of ours is waiting for it
    params = checked.get("params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ProtocolError(f'"params" of {method} must be an object')
    return Message(method, ident, params, is_request="id" in checked)


def response(ident: Any, result: dict[str, Any]) -> dict[str, Any]:
    return result_frame(ident, result)


def notification(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return notification_frame(method, params)


def error(ident: Any, status: str, message: str, rpc_code: int | None = None,
          data: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON-RPC error for a uibus status; `data.status` names the status as every transport does."""
    return error_frame(ident, RpcError(rpc_code if rpc_code is not None else rpc_code_of(status), message or status,
                                       {**(data or {}), "status": status}))


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


@dataclass(frozen=True)
class Envelope:
    """What a request of MCP's stateless era (uibus.edge.mcp.era) says of itself: it is all the
    state there is."""

    version: str
    capabilities: Mapping[str, Any] = field(default_factory=dict)
    client: Mapping[str, Any] = field(default_factory=dict)
    log_level: str | None = None

    def can(self, capability: str) -> bool:
        """Whether the client declared `capability` (e.g. "elicitation") for this request."""
        return isinstance(self.capabilities.get(capability), dict)

    def extension(self, name: str) -> bool:
        """Whether the client declared the extension `name` (e.g. the tasks extension)."""
        extensions = self.capabilities.get("extensions")
        return isinstance(extensions, dict) and isinstance(extensions.get(name), dict)

    def elicits_forms(self) -> bool:
        """Whether the client can fill in a form for its user (elicitation, form mode: the default
        when the capability names no mode)."""
        elicitation = self.capabilities.get("elicitation")
        if not isinstance(elicitation, dict):
            return False
        return "form" in elicitation or "url" not in elicitation


@dataclass
class Reply:
    """A method's result: the JSON-RPC `result` object."""

    result: dict[str, Any]


class Call:
    """One JSON-RPC message as a handler sees it (the pipeline's request object)."""

    __slots__ = ("envelope", "message", "new_session", "session_id", "streaming")

    def __init__(self, message: Message, session_id: str | None, streaming: bool = False,
                 envelope: Envelope | None = None) -> None:
        self.message = message
        self.session_id = session_id  # the client's Mcp-Session-Id, if it sent one
        self.streaming = streaming  # the transport can send notifications before the result
        self.new_session: str | None = None  # set by initialize: the id the transport hands out
        self.envelope = envelope  # a modern (2026-07-28) request's: what it says of itself


Handler = Callable[[Call, grpc.aio.ServicerContext], AsyncIterator[Any]]

AGENT_HEADER = "x-uibus-agent"  # set by uibus for the agents it hosts: who is calling (see McpServer.tools)


def caller_of(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The hosted agent a call comes from (its AGENT_HEADER), or ""."""
    for key, value in metadata or ():
        if key == AGENT_HEADER:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""

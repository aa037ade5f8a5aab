"""JSON-RPC 2.0, once, for every way uibus speaks it: the hosted agents' stdio (uibus.agents.jsonrpc),
the editors' ACP over stdio, WebSocket and HTTP (uibus.edge.editors), and MCP (uibus.edge.mcp.protocol).

What lives here is what those protocols share, so each of their doors has the same guards:

* the error codes, in one table (JSON-RPC 2.0's, and the server-range codes ACP and MCP use);
* `read`: one incoming message through the shared hostile-JSON reader (uibus.infra.json_input: size,
  depth, numbers a double cannot hold, lone surrogates), then `check`: `"jsonrpc": "2.0"`, an id
  that is a string, an integer (or null where the protocol allows it), a method that is a string —
  all *before* anything waits on the message, so a malformed one is answered at once with -32700 /
  -32600 and never holds a slot;
* the frames (`request_frame`, `notification_frame`, `result_frame`, `error_frame`, `dump`): no
  other module builds one;
* `Pending`: one in-flight map of our own requests to the peer (id -> future), bounded.

The session loop on top — one receive loop, outgoing requests, incoming requests as owned tasks with
cancel, the end — is `uibus.infra.peer.Peer`.

The models were the MCP SDK's `BaseSession` and the ACP SDKs' `Connection` (one reader, one map of
response streams by request id); this is written for uibus's limits, not copied. Framing (lines,
WebSocket frames, HTTP bodies, SSE) belongs to each way in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from uibus.infra.errors import InvalidArgument
from uibus.infra.json_input import PoisonedJson, dump_json, load_json

# ---- the error codes (JSON-RPC 2.0 §5.1, and the server range ACP and MCP use) -------------------
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
SERVER_ERROR = -32000  # MCP: a uibus status (data.status names it); ACP: auth required
AUTH_REQUIRED = -32000
RESOURCE_NOT_FOUND = -32002  # ACP
QUOTA_EXCEEDED = -32029  # a tenant's quota (data.quota names it): uibus's, in the server range
REQUEST_CANCELLED = -32800  # ACP (LSP's number)
CODES = {"parse error": PARSE_ERROR, "invalid request": INVALID_REQUEST, "method not found": METHOD_NOT_FOUND,
         "invalid params": INVALID_PARAMS, "internal error": INTERNAL_ERROR,
         "server error / auth required": SERVER_ERROR, "resource not found": RESOURCE_NOT_FOUND,
         "quota exceeded": QUOTA_EXCEEDED, "request cancelled": REQUEST_CANCELLED}
CANCEL_REQUEST = "$/cancel_request"
MAX_OUTSTANDING = 256  # our requests to one peer awaiting an answer at once
MAX_ID_CHARS = 1024  # a string id (a UUID is 36): a peer's id is kept until its answer, so it is bounded

Send = Callable[[dict[str, Any]], Awaitable[None]]


class RpcError(Exception):
    """An error answer: its code (one of the above), a message that says what was wrong, and the
    id of the request it answers when that id is sound (None otherwise: the answer's id is null)."""

    def __init__(self, code: int, message: str, data: Any = None, ident: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.ident = ident

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error

    def answer(self) -> dict[str, Any]:
        """The whole error response."""
        return error_frame(self.ident, self)


# ---- the frames: built here only (tests/test_architecture.py holds every other module to that) -----

def request_frame(ident: Any, method: str, params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": ident, "method": method, "params": params}


def notification_frame(method: str, params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": params}


def result_frame(ident: Any, result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": ident, "result": result}


def error_frame(ident: Any, error: RpcError | dict[str, Any]) -> dict[str, Any]:
    """An error response: `error` as RpcError, or its body (code, message, data) as a protocol words it."""
    return {"jsonrpc": "2.0", "id": ident, "error": error.body() if isinstance(error, RpcError) else error}


def valid_id(ident: Any, null: bool = True) -> bool:
    """A JSON-RPC id: a string or an integer (a bool is not one), or null where `null` allows it."""
    return (null and ident is None) or (isinstance(ident, str | int) and not isinstance(ident, bool))


def check(value: Any, *, null_id: bool = True, version_optional: bool = False) -> dict[str, Any]:
    """`value` as a JSON-RPC 2.0 message (request, notification or response), or RpcError
    (-32600, with the id when it is sound) saying what is wrong. No batches: neither ACP nor MCP
    (since 2025-06-18) sends them. `version_optional`: a message without `"jsonrpc"` is taken (the
    agents uibus runs, as the ACP SDKs tolerate them); one with another version never is."""
    if isinstance(value, list):
        raise RpcError(INVALID_REQUEST, "JSON-RPC batches are not supported: send one message at a time")
    if not isinstance(value, dict):
        raise RpcError(INVALID_REQUEST, f"a JSON-RPC message is a JSON object, not {type(value).__name__}")
    ident = value.get("id")
    sound = ident if "id" in value and valid_id(ident, null_id) and len(str(ident)) <= MAX_ID_CHARS else None
    if value.get("jsonrpc", "2.0" if version_optional else None) != "2.0":
        raise RpcError(INVALID_REQUEST, 'a JSON-RPC message needs "jsonrpc": "2.0"', ident=sound)
    if "id" in value and not valid_id(ident, null_id):
        raise RpcError(INVALID_REQUEST, '"id" must be a string or an integer' + (" (or null)" if null_id else ""))
    if isinstance(ident, str) and len(ident) > MAX_ID_CHARS:
        raise RpcError(INVALID_REQUEST, f'"id" is {len(ident)} characters long; the limit is {MAX_ID_CHARS}')
    method = value.get("method")
    if method is None:
        if "id" in value and ("result" in value or "error" in value):
            return value  # a response to one of ours
        raise RpcError(INVALID_REQUEST, 'a JSON-RPC message needs "method" (or "result"/"error" for a response)',
                       ident=sound)
    if not isinstance(method, str) or not method:
        raise RpcError(INVALID_REQUEST, '"method" must be a non-empty string', ident=sound)
    params = value.get("params")
    if params is not None and not isinstance(params, dict | list):
        raise RpcError(INVALID_PARAMS, f'"params" of {method[:80]} must be an object', ident=sound)
    return value


def read(text: str | bytes, *, max_bytes: int = 0, null_id: bool = True, what: str = "the message") -> dict[str, Any]:
    """One incoming message from a peer, through the hostile-JSON reader and `check`: RpcError
    (-32700 not JSON / too deep / too long; -32600 not a message; -32602 poison inside params of a
    request with a sound id) for anything else. `max_bytes` (0: no bound) is the door's limit."""
    if max_bytes and len(text) > max_bytes:
        raise RpcError(INVALID_REQUEST, f"{what} is longer than {max_bytes} bytes (the limit): it was dropped")
    try:
        value = load_json(text, what)
    except PoisonedJson as exc:
        # Poison inside `params`: that request's invalid params, answered with its id if sound.
        if exc.path[:1] == ("params",) and isinstance(exc.value, dict):
            try:
                message = check(exc.value, null_id=null_id)
                load_json(dump_json(message.get("id")), "id")
            except (RpcError, InvalidArgument, ValueError):
                pass
            else:
                raise RpcError(INVALID_PARAMS, str(exc), ident=message.get("id")) from None
        raise RpcError(INVALID_REQUEST, str(exc)) from None
    except InvalidArgument as exc:
        raise RpcError(PARSE_ERROR, str(exc)) from None
    return check(value, null_id=null_id)


def dump(message: dict[str, Any]) -> str:
    """One message as RFC 8259 JSON on one line (U+2028/U+2029 escaped: line-based JavaScript
    readers split on them)."""
    return dump_json(message).replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


class Pending:
    """Our requests in flight to one peer, by id, at most `limit` at once. A future leaves the map
    when it is done (answered, failed, or cancelled by its waiter)."""

    def __init__(self, limit: int = MAX_OUTSTANDING, gone: Callable[[str], BaseException] | None = None,
                 failed: Callable[[RpcError], BaseException] | None = None) -> None:
        """`gone(why)`: the error every wait ends with when the peer goes; `failed(error)`: the
        error a waiter gets for the peer's error answer (a protocol may say it in its own words)."""
        self._waiting: dict[Hashable, asyncio.Future[Any]] = {}
        self.limit = limit
        self._gone = gone or (lambda why: RpcError(INTERNAL_ERROR, why))
        self._failed = failed or (lambda error: error)

    def __len__(self) -> int:
        return len(self._waiting)

    def gone(self, why: str) -> BaseException:
        """The error a wait on a peer that is gone ends with (`why` it is)."""
        return self._gone(why)

    def open(self, ident: Hashable) -> asyncio.Future[Any]:
        """The future of request `ident`, which the caller is sending (a reply is read by the
        reader task, never inside the send, so registering before or right after it is in time).
        RpcError when `limit` requests already wait: the peer is not answering."""
        if len(self._waiting) >= self.limit:
            raise self._gone(f"{self.limit} requests to the peer are waiting for an answer: it is not answering")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = future
        future.add_done_callback(lambda _f: self._forget(ident, future))
        return future

    def _forget(self, ident: Hashable, future: asyncio.Future[Any]) -> None:
        if self._waiting.get(ident) is future:
            del self._waiting[ident]

    def pending(self, ident: Any) -> asyncio.Future[Any] | None:
        """The future still waiting for request `ident` (a peer may send any id, even unhashable)."""
        future = self._waiting.get(ident) if isinstance(ident, Hashable) else None
        return None if future is None or future.done() else future

    def resolve(self, ident: Any, result: Any) -> bool:
        """Settles request `ident` with `result`; False when no such request waits (not ours)."""
        if (future := self.pending(ident)) is None:
            return False
        future.set_result(result)
        return True

    def reject(self, ident: Any, error: BaseException) -> bool:
        if (future := self.pending(ident)) is None:
            return False
        future.set_exception(error)
        return True

    def answered(self, message: dict[str, Any]) -> bool:
        """A response from the peer settles the request it answers: its `error` as RpcError."""
        error = message.get("error")
        if isinstance(error, dict):
            code = error.get("code")
            return self.reject(message.get("id"), self._failed(RpcError(
                code if isinstance(code, int) and not isinstance(code, bool) else INTERNAL_ERROR,
                str(error.get("message") or "error"), error.get("data"))))
        return self.resolve(message.get("id"), message.get("result"))

    def fail_all(self, why: str) -> None:
        """The peer is gone: every wait on it ends now, with `why`."""
        for future in list(self._waiting.values()):
            if not future.done():
                future.set_exception(self._gone(why))

    def cancel_all(self) -> None:
        for future in list(self._waiting.values()):
            future.cancel()
        self._waiting.clear()

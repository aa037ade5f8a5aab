"""JSON-RPC 2.0 as ACP uses it, the agent's side: the error codes the ACP schema names, parsing
one incoming message, and our own requests to the editor (ids, their answers, `$/cancel_request`).

Framing (stdio lines, WebSocket text frames) belongs to the way in; this module sees messages.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable
from typing import Any

# The codes of the ACP schema's ErrorCode (JSON-RPC 2.0's, and ACP's own in the server range).
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
AUTH_REQUIRED = -32000
RESOURCE_NOT_FOUND = -32002
REQUEST_CANCELLED = -32800
CANCEL_REQUEST = "$/cancel_request"

Send = Callable[[dict[str, Any]], Awaitable[None]]


class RpcError(Exception):
    """A request's error answer: its code (one of the above) and a message that says what was wrong."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


def parse(text: str | bytes) -> dict[str, Any]:
    """One incoming message as a dict; RpcError (parse error / invalid request) for anything else.
    ACP sends no batches, so an array is an invalid request, as the SDK answers it."""
    try:
        message = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RpcError(PARSE_ERROR, f"not JSON: {exc}") from None
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, "a JSON-RPC 2.0 object is expected (ACP sends no batches)")
    return message


def valid_id(ident: Any) -> bool:
    return ident is None or (isinstance(ident, str | int) and not isinstance(ident, bool))


def dump(message: dict[str, Any]) -> str:
    """One message as compact JSON on one line (json.dumps escapes U+2028/U+2029 and newlines)."""
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False).replace("\u2028", "\\u2028") \
        .replace("\u2029", "\\u2029")


class Outgoing:
    """Our requests to the editor (session/request_permission, elicitation/create) and their
    answers; `cancel` withdraws one with `$/cancel_request` when another UI answered first."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}

    async def request(self, method: str, params: dict[str, Any], sent: Callable[[int], None] | None = None) -> Any:
        """The editor's result; RpcError for its error answer. `sent(id)` is told the request's id
        (so the caller can withdraw it). Cancelling the awaiting task forgets the request."""
        ident = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = future
        try:
            await self._send({"jsonrpc": "2.0", "id": ident, "method": method, "params": params})
            if sent is not None:
                sent(ident)
            return await future
        finally:
            self._waiting.pop(ident, None)

    async def cancel(self, ident: int) -> None:
        """Withdraws a request the editor has not answered yet (ACP's `$/cancel_request`)."""
        future = self._waiting.pop(ident, None)
        if future is None or future.done():
            return
        future.set_exception(RpcError(REQUEST_CANCELLED, "withdrawn: another UI answered first"))
        await self._send({"jsonrpc": "2.0", "method": CANCEL_REQUEST, "params": {"requestId": ident}})

    def answered(self, message: dict[str, Any]) -> None:
        """A response from the editor: resolves the request it answers (unknown ids are ignored:
        a late answer to a withdrawn request)."""
        future = self._waiting.get(message.get("id")) if isinstance(message.get("id"), int) else None
        if future is None or future.done():
            return
        error = message.get("error")
        if isinstance(error, dict):
            future.set_exception(RpcError(error.get("code") if isinstance(error.get("code"), int) else INTERNAL_ERROR,
                                          str(error.get("message") or "error"), error.get("data")))
        else:
            future.set_result(message.get("result"))

    def close(self) -> None:
        for future in self._waiting.values():
            future.cancel()
        self._waiting.clear()

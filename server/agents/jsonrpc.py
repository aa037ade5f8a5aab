"""JSON-RPC 2.0 on an agent's stdio, for the protocols that speak it (the Agent Client Protocol):
our requests and their responses matched through the session's `Requests`, the agent's requests
answered with `reply` (a method we do not offer: "method not found"), its notifications.

One message per line, as uibus.agents.stdio frames them. A response's `error` is the request's
AgentError ("message (JSON-RPC code)"), which a turn shows as its error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

from uibus.agents import AgentError, SessionUi
from uibus.agents.stdio import StdioBackend, text
from uibus.agents.turns import Event, StdioSession
from uibus.infra.jsonrpc import METHOD_NOT_FOUND, RpcError, check


class JsonRpcSession(StdioSession):
    """A `StdioSession` whose agent speaks JSON-RPC 2.0. A protocol implements `on_request` (the
    agent asks something of us) and `on_notification`, besides the turn hooks."""

    def __init__(self, backend: StdioBackend, ui: SessionUi) -> None:
        super().__init__(backend, ui)
        self._ids = itertools.count(1)

    def request(self, method: str, params: dict[str, Any]) -> asyncio.Future[Any]:
        """Sends a request (buffered: `call` drains) and returns the future of its result."""
        ident = next(self._ids)
        self.process.send({"jsonrpc": "2.0", "id": ident, "method": method, "params": params})
        return self.requests.open(ident)

    async def call(self, method: str, params: dict[str, Any]) -> Any:
        """A request to the agent and its result; its JSON-RPC error as AgentError."""
        future = self.request(method, params)
        try:
            await self.process.drain()
            return await future
        finally:
            future.cancel()  # a wait given up (or a failed drain) leaves nothing behind; no-op once answered

    def notify(self, method: str, params: dict[str, Any]) -> None:
        """A notification to the agent, if it still runs (a gone agent needs none)."""
        with contextlib.suppress(AgentError):
            self.process.send({"jsonrpc": "2.0", "method": method, "params": params})

    def reply(self, ident: Any, result: Any = None, error: dict[str, Any] | None = None) -> None:
        """The response to one of the agent's requests, if it still runs."""
        body: dict[str, Any] = {"jsonrpc": "2.0", "id": ident}
        if error is not None:
            body["error"] = error
        else:
            body["result"] = result if result is not None else {}
        with contextlib.suppress(AgentError):
            self.process.send(body)

    def on_message(self, message: Event) -> None:
        try:  # the one JSON-RPC check (the id's type, the method's); a missing "jsonrpc" is tolerated
            check({**message, "jsonrpc": "2.0"})  # from the agent we run, as the ACP SDKs tolerate it
        except RpcError as exc:
            self.log.warn("method", "agent message that is not JSON-RPC 2.0; ignored", error=exc.message[:200],
                          method=text(message.get("method"))[:80])
            return
        method = message.get("method")
        if method is None:  # a response to one of ours
            ident, error = message.get("id"), message.get("error")
            if isinstance(error, dict):
                self.requests.reject(ident, AgentError(f"{text(error.get('message')) or 'error'} "
                                                       f"(JSON-RPC {error.get('code')})"))
            else:
                self.requests.resolve(ident, message.get("result"))
            return
        params = message.get("params")
        params = params if isinstance(params, dict) else {}
        if "id" in message:
            self.on_request(message["id"], method, params)
        else:
            self.on_notification(method, params)

    def on_request(self, ident: Any, method: Any, params: dict[str, Any]) -> None:
        """The agent asks something of us; by default nothing is offered."""
        self.log.warn("method", "agent request uibus does not offer; answered method-not-found",
                      method=text(method)[:80])
        self.reply(ident, error={"code": METHOD_NOT_FOUND, "message": f"{text(method)} is not offered"})

    def on_notification(self, method: Any, params: dict[str, Any]) -> None:
        self.log.warn("unknown", "unknown agent notification; ignored", method=text(method)[:80])

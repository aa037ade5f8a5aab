"""JSON-RPC 2.0 on an agent's stdio, for the protocols that speak it (the Agent Client Protocol),
through the one JSON-RPC core (uibus.infra.peer.Peer): our requests and their responses matched in
the session's `Requests`, the agent's requests answered by the methods the protocol offers (one
owned task each in the session's `asks`; anything else "method not found"), its notifications.

One message per line, as uibus.agents.stdio frames them: the process's reader hands each object to
the peer (so this framing pushes; it has no loop of its own), and writes are buffered on the
agent's stdin (`call` drains). A response's `error` is the request's AgentError ("message (JSON-RPC
code)"), which a turn shows as its error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from uibus.agents import AgentError, SessionUi
from uibus.agents.stdio import StdioBackend, text
from uibus.agents.turns import Event, StdioSession
from uibus.infra.jsonrpc import METHOD_NOT_FOUND, RpcError, check, notification_frame
from uibus.infra.peer import Method, Peer


class JsonRpcSession(StdioSession):
    """A `StdioSession` whose agent speaks JSON-RPC 2.0. A protocol offers `methods` (the agent
    asks something of us), `cancelled_result` (what such a request is answered when our side
    cancels it: a turn cancelled, the process gone) and `on_notification`, besides the turn hooks."""

    def __init__(self, backend: StdioBackend, ui: SessionUi) -> None:
        super().__init__(backend, ui)
        self.peer = Peer(self._write, name=f"agent {backend.spec.name}", methods=self.methods(),
                         notified=self.on_notification, not_found=self._not_offered,
                         cancelled_result=self.cancelled_result, version_optional=True,
                         pending=self.requests, incoming=self.asks)

    def methods(self) -> Mapping[str, Method]:
        """The agent's requests uibus answers; by default none."""
        return {}

    def cancelled_result(self, method: str, params: dict[str, Any]) -> Any:
        """The result an agent's request gets when our side cancels it (None: no answer)."""
        return None

    async def _write(self, message: dict[str, Any]) -> None:
        """The peer's answers and notifications: buffered, if the agent still runs (a gone agent needs none)."""
        with contextlib.suppress(AgentError):
            self.process.send(message)

    def request(self, method: str, params: dict[str, Any]) -> asyncio.Future[Any]:
        """Sends a request (buffered: `call` drains) and returns the future of its result."""
        frame, future = self.peer.open_request(method, params)
        try:
            self.process.send(frame)
        except BaseException:
            future.cancel()  # never sent: nothing waits for it
            raise
        return future

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
            self.process.send(notification_frame(method, params))

    def on_message(self, message: Event) -> None:
        try:  # the one JSON-RPC check (the id's type, the method's); a missing "jsonrpc" is tolerated
            checked = check(message, version_optional=True)  # from the agent we run, as the ACP SDKs do
        except RpcError as exc:
            self.log.warn("method", "agent message that is not JSON-RPC 2.0; ignored", error=exc.message[:200],
                          method=text(message.get("method"))[:80])
            return
        self.peer.deliver(checked)  # no bound on the agent's requests: never refused at once

    def _not_offered(self, method: str) -> RpcError:
        self.log.warn("method", "agent request uibus does not offer; answered method-not-found",
                      method=text(method)[:80])
        return RpcError(METHOD_NOT_FOUND, f"{text(method)} is not offered")

    def on_notification(self, method: str, params: dict[str, Any]) -> None:
        self.log.warn("unknown", "unknown agent notification; ignored", method=text(method)[:80])

"""The methods only the stateless era (MCP 2026-07-28) has: `server/discover`, the tasks
extension's `tasks/get`, `tasks/update`, `tasks/cancel`, and `subscriptions/listen`; and what
every modern result carries (`resultType`, the server's identity, cache hints on lists).

The tools themselves are not here: a modern `tools/call` runs the one implementation both eras
share (uibus.edge.mcp.server), which only differs where the era offers something better — asking
the client itself (`input_required`) and handing back a task instead of holding the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc.aio
from google.protobuf import json_format

from uibus.domain.sessions import Sessions
from uibus.edge.mcp import era, protocol
from uibus.edge.mcp.protocol import Call, Handler, InvalidParams, Reply
from uibus.edge.mcp.session_tools import RESOURCE_PREFIX
from uibus.edge.mcp.tasks import McpTasks, shown
from uibus.infra.bus import LIVE
from uibus.infra.session import session_of

# How long a client may keep a list (ms), and for whom. What a token may see differs by token, so
# most lists are `private`; a change is announced on subscriptions/listen.
CACHE = {"tools/list": (60_000, "private"), "resources/list": (0, "private"),
         "resources/templates/list": (3_600_000, "public"), "prompts/list": (3_600_000, "public")}
DISCOVER_TTL_MS = 3_600_000


class Modern:
    """The stateless era's own methods, over the server's tools, sessions and tasks."""

    def __init__(self, *, server_info: dict[str, Any], capabilities: Callable[[], dict[str, Any]], instructions: str,
                 tasks: McpTasks, sessions: Sessions, auth_of: Callable[[Any], str],
                 tool_names: Callable[[grpc.aio.ServicerContext], list[str]],
                 visible: Callable[[Any], Callable[[str], bool]]) -> None:
        self.server_info = server_info
        self.capabilities = capabilities
        self.instructions = instructions
        self.tasks = tasks
        self.sessions = sessions
        self.auth_of = auth_of
        self.tool_names = tool_names
        self.visible = visible

    def finish(self, call: Call, result: dict[str, Any]) -> dict[str, Any]:
        """`result` as a modern request's result (unchanged for today's sessions)."""
        if call.envelope is None:
            return result
        ttl, scope = CACHE.get(call.message.method or "", (None, "private"))
        return era.complete(result, self.server_info, ttl_ms=ttl, scope=scope)

    def methods(self) -> dict[str, Handler]:
        async def discover(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            yield Reply(era.complete({"supportedVersions": list(era.SUPPORTED), "capabilities": self.capabilities(),
                                      "instructions": self.instructions}, self.server_info,
                                     ttl_ms=DISCOVER_TTL_MS, scope="public"))

        async def tasks_get(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            _modern(call)
            record = await self.tasks.get(session_of(context), self._auth(context), call.message.params.get("taskId"))
            yield Reply(self.finish(call, shown(record)))

        async def tasks_update(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            _modern(call)
            params = call.message.params
            await self.tasks.update(session_of(context), self._auth(context), params.get("taskId"),
                                    params.get("inputResponses"))
            yield Reply(self.finish(call, {}))

        async def tasks_cancel(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            _modern(call)
            await self.tasks.cancel(session_of(context), self._auth(context), call.message.params.get("taskId"))
            yield Reply(self.finish(call, {}))

        async def listen(call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            _modern(call)
            async for item in self._listen(call, context):
                yield item

        return {protocol.path_of("server/discover"): discover, protocol.path_of("tasks/get"): tasks_get,
                protocol.path_of("tasks/update"): tasks_update, protocol.path_of("tasks/cancel"): tasks_cancel,
                protocol.path_of("subscriptions/listen"): listen}

    def _auth(self, context: grpc.aio.ServicerContext) -> str:
        return self.auth_of(context.invocation_metadata())

    async def _listen(self, call: Call, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """The listen stream: the acknowledgement (what of the asked uibus sends), then each change
        of the caller's tool list, session list (as resources) and the sessions it named, until the
        client closes the stream. Everything is computed for the caller: a change it may not see is
        no change to it."""
        asked = call.message.params.get("notifications")
        if not isinstance(asked, dict):
            raise InvalidParams("subscriptions/listen needs params.notifications, the notifications wanted "
                                "(toolsListChanged, resourcesListChanged, resourceSubscriptions)")
        if not call.streaming:
            raise InvalidParams("subscriptions/listen is an event stream: send Accept: text/event-stream")
        uris = asked.get("resourceSubscriptions") or []
        if not isinstance(uris, list) or not all(isinstance(u, str) for u in uris):
            raise InvalidParams("notifications.resourceSubscriptions must be a list of resource URIs")
        honoured: dict[str, Any] = {}
        if asked.get("toolsListChanged") is True:
            honoured["toolsListChanged"] = True
        if asked.get("resourcesListChanged") is True:
            honoured["resourcesListChanged"] = True
        watched = [u for u in uris if u.startswith(RESOURCE_PREFIX)][:256]
        if watched:
            honoured["resourceSubscriptions"] = watched
        sub = {era.SUBSCRIPTION_ID: call.message.id}
        visible = self.visible(context.invocation_metadata())
        yield LIVE
        yield protocol.notification("notifications/subscriptions/acknowledged",
                                    {"notifications": honoured, "_meta": sub})
        tools = self.tool_names(context)
        listed: list[str] | None = None
        entries: dict[str, Any] = {}
        async for current in self.sessions.watch(visible):
            names = [s.session for s in current.sessions]
            if listed is not None and names != listed and "resourcesListChanged" in honoured:
                yield protocol.notification("notifications/resources/list_changed", {"_meta": sub})
            listed = names
            for entry in current.sessions:
                uri = RESOURCE_PREFIX + entry.session
                if uri in watched:
                    now = json_format.MessageToDict(entry)
                    if uri in entries and entries[uri] != now:
                        yield protocol.notification("notifications/resources/updated", {"uri": uri, "_meta": sub})
                    entries[uri] = now
            now_tools = self.tool_names(context)
            if now_tools != tools and "toolsListChanged" in honoured:
                yield protocol.notification("notifications/tools/list_changed", {"_meta": sub})
            tools = now_tools
            await asyncio.sleep(0)


def _modern(call: Call) -> None:
    if call.envelope is None:
        raise InvalidParams(f"{call.message.method} is a method of protocol {era.MODERN[-1]}: send it with "
                            f"params._meta naming {era.PROTOCOL_VERSION!r} (no initialize, no Mcp-Session-Id)")


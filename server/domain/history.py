"""A session's chat state in the store, shared by every side that chats: neuro-san StreamingChat,
the UI, and the CodeBolt gateway.

* `chat/context/<agent>`: the neuro-san ChatContext of the session's conversation with that
  agent (proto3 JSON with proto field names), what a client that sends none continues from.
* `chat/history`: one list per session, oldest first, of entries
  `{"ts": ms, "role": "user"|"assistant"|"system", "text": str, "agent": str, "source": str}`
  (`"error": true` marks an agent failure).

Only whole messages are stored (never stream pieces), so a long streamed reply costs two writes.
Each appended entry is also published on the bus (kind CHAT_MESSAGE), so a side waiting for "the
next user message" (CodeBolt's waitforReply) subscribes instead of polling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from google.protobuf import json_format

from uibus.infra import kinds
from uibus.infra.bus import Bus, Subscription
from uibus.infra.store import Store
from uibus.pb.neuro_san.api.grpc import chat_pb2

HISTORY_KEY = "chat/history"
CONTEXT_PREFIX = "chat/context/"
MAX_HISTORY = 10_000  # entries kept per session; older ones are dropped by the store
# Besides the count, the history is bounded in bytes (config `history_bytes`, passed by Core): a
# count alone lets 10,000 long replies grow a session without limit.
ROLES = ("user", "assistant", "system")


def context_key(agent: str) -> str:
    return CONTEXT_PREFIX + agent


class ChatHistory:
    def __init__(self, store: Store, bus: Bus, max_bytes: int = 0) -> None:
        """`max_bytes` > 0 keeps only the newest entries within that many bytes of JSON (the newest
        entry always stays); 0 bounds the history by its count only."""
        self.store = store
        self.bus = bus
        self.max_bytes = max_bytes

    async def load_context(self, session: str, agent: str) -> chat_pb2.ChatContext:
        """The stored ChatContext (empty when the session never chatted with `agent`)."""
        data = await self.store.get(session, context_key(agent))
        ctx = chat_pb2.ChatContext()
        if data:
            json_format.ParseDict(data, ctx, ignore_unknown_fields=True)
        return ctx

    async def update_context(self, session: str, agent: str,
                             change: Callable[[chat_pb2.ChatContext], chat_pb2.ChatContext]) -> chat_pb2.ChatContext:
        """Replaces the stored context with `change(current)` in one store transaction (atomic
        across processes and replicas, see Store.update), so concurrent turns of one
        (session, agent) each add to the context instead of the last writer erasing the others.
        `change` may run more than once (after a conflict) and must not have side effects."""
        result: list[chat_pb2.ChatContext] = []

        def apply(data: Any | None) -> Any:
            ctx = chat_pb2.ChatContext()
            if data:
                json_format.ParseDict(data, ctx, ignore_unknown_fields=True)
            new = change(ctx)
            result[:] = [new]
            return json_format.MessageToDict(new, preserving_proto_field_name=True)

        await self.store.update(session, context_key(agent), apply)
        return result[0]

    async def save_context(self, session: str, agent: str, ctx: chat_pb2.ChatContext) -> None:
        await self.store.put(session, context_key(agent),
                             json_format.MessageToDict(ctx, preserving_proto_field_name=True))

    async def forget_context(self, session: str, agent: str) -> None:
        await self.store.put(session, context_key(agent), None)

    async def append(self, session: str, role: str, text: str, *, agent: str = "", source: str = "",
                     error: bool = False, ts: int = 0) -> dict[str, Any]:
        """Adds one whole message to the session's history and announces it; returns the entry."""
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
        entry: dict[str, Any] = {"ts": ts or int(time.time() * 1000), "role": role, "text": text, "agent": agent,
                                 "source": source}
        if error:
            entry["error"] = True
        await self.store.append(session, HISTORY_KEY, entry, max_len=MAX_HISTORY, max_bytes=self.max_bytes)
        self.bus.publish(session, kinds.CHAT_MESSAGE, entry)
        return entry

    async def read(self, session: str, last: int = 0) -> list[dict[str, Any]]:
        """The session's history, oldest first; `last` > 0 gives only the newest `last` entries."""
        return await self.store.items(session, HISTORY_KEY, last)

    def follow(self, session: str, maxsize: int) -> Subscription:
        """A subscription to the entries appended from now on (unsubscribe it with the bus)."""
        return self.bus.subscribe(session, kinds.CHAT_MESSAGE, maxsize=maxsize)

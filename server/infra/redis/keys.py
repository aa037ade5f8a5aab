"""The session store's key layout on Redis, and what an index strategy needs of its store.

Its own module so the store (uibus.infra.redis.store) and its two index strategies
(uibus.infra.redis.index_single, uibus.infra.redis.index_cluster) share the names without importing each other.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol
from urllib.parse import quote

from uibus.infra.errors import StoreFull, StoreUnavailable
from uibus.infra.store import StoreStats


def dumps(value: Any) -> bytes:
    """A value as stored: compact JSON."""
    return json.dumps(value, separators=(",", ":")).encode()


class Keys:
    """Key names of a namespace. `empty_tag` is the hash tag of the session "": on a cluster one of
    its own (Redis hashes a key with an empty `{}` whole, which would put its keys in different
    slots); one server has no slots, so there `{}` stays, as data written before expects."""

    def __init__(self, namespace: str, empty_tag: str = "") -> None:
        self.namespace = namespace
        self.empty_tag = empty_tag

    @staticmethod
    def member(session: str) -> str:
        """The session as it appears in key names and in the index."""
        return quote(session, safe="")

    def base(self, session: str) -> str:
        return self.base_of(self.member(session))

    def base_of(self, member: str) -> str:
        """The prefix of the session's keys."""
        return f"{self.namespace}:{{{member or self.empty_tag}}}"

    def kv(self, session: str) -> str:
        return self.base(session) + ":kv"

    def list(self, session: str, key: str) -> str:
        return f"{self.base(session)}:list:{key}"

    def lists(self, session: str) -> str:
        return self.base(session) + ":lists"

    def log(self, session: str) -> str:
        """The session's log: a Stream whose ids are the entries' seqs (`seq-0`)."""
        return self.base(session) + ":log"

    def log_index(self, session: str) -> str:
        """Which id holds each (kind, key) of the log, and its count, bytes and floor."""
        return self.base(session) + ":logidx"


class IndexHost(Protocol):
    """What an index strategy uses of its RedisStore: the client, the key names, retention's
    settings and counters, the fault mapping and the watched transaction."""

    redis: Any
    keys: Keys
    stats: StoreStats
    ttl_s: float
    max_sessions: int

    def guard(self) -> AbstractContextManager[None]: ...

    def _failed(self, kind: str, error: StoreUnavailable | StoreFull) -> StoreUnavailable | StoreFull: ...

    async def watched(self, session: str, key: str, change: Callable[[Any | None], Any | None],
                      stamp: Callable[[Any, bool], None]) -> tuple[Any | None, list[Any]]: ...

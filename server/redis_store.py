"""The session store on Redis, so several replicas share one state (SPEC.md §4).

Layout, for a session `s` (percent-quoted so it contains no ':' or braces):
  `uibus:{s}:kv`          hash: store key -> JSON value
  `uibus:{s}:list:<key>`  list of JSON values, oldest first, trimmed to the newest `max_len`
The `{s}` braces are a Redis Cluster hash tag: all keys of one session live in one slot, so a
multi-key operation on a session stays legal on a cluster. No operation uses KEYS.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

from uibus.errors import StoreUnavailable
from uibus.redis_conn import OUTAGE_ERRORS, make_client
from uibus.store import Store

_GLOB_SPECIAL = str.maketrans({c: "\\" + c for c in "*?[]\\"})


@contextlib.contextmanager
def _reachable() -> Iterator[None]:
    """Re-raises a lost or timed-out connection as StoreUnavailable (gRPC UNAVAILABLE)."""
    try:
        yield
    except OUTAGE_ERRORS as exc:
        raise StoreUnavailable(f"the session store (Redis) is unreachable: {exc}") from exc


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class RedisStore(Store):
    """Same semantics as SqliteStore; one client (and its pool) for the life of the store."""

    def __init__(self, url: str, namespace: str = "uibus") -> None:
        self.url = url
        self.namespace = namespace
        self._redis = make_client(url, f"{namespace}-store")

    def _base(self, session: str) -> str:
        return f"{self.namespace}:{{{quote(session, safe='')}}}"

    def _kv(self, session: str) -> str:
        return self._base(session) + ":kv"

    def _list(self, session: str, key: str) -> str:
        return f"{self._base(session)}:list:{key}"

    async def get(self, session: str, key: str) -> Any | None:
        with _reachable():
            raw = await self._redis.hget(self._kv(session), key)
            return json.loads(raw) if raw is not None else None

    async def put(self, session: str, key: str, value: Any | None) -> None:
        with _reachable():
            if value is None:
                await self._redis.hdel(self._kv(session), key)
            else:
                await self._redis.hset(self._kv(session), key, _dumps(value))

    async def update(self, session: str, key: str, change: Callable[[Any | None], Any | None]) -> Any | None:
        """Optimistic transaction: WATCH the session's hash, read, MULTI/EXEC the write; when
        another writer (any replica) changed the hash meanwhile, EXEC fails and it is redone on the
        fresh value. Redis decides who wins, so no write is lost across replicas."""
        name = self._kv(session)
        result: list[Any] = [None]

        async def attempt(pipe: Any) -> None:
            raw = await pipe.hget(name, key)
            value = result[0] = change(json.loads(raw) if raw is not None else None)
            pipe.multi()
            if value is None:
                pipe.hdel(name, key)
            else:
                pipe.hset(name, key, _dumps(value))

        with _reachable():
            await self._redis.transaction(attempt, name)
        return result[0]

    async def scan(self, session: str, prefix: str) -> dict[str, Any]:
        """HSCAN with a MATCH pattern: only matching fields cross the network, in sorted order."""
        with _reachable():
            pattern = prefix.translate(_GLOB_SPECIAL) + "*"
            found: dict[str, Any] = {}
            async for field, raw in self._redis.hscan_iter(self._kv(session), match=pattern, count=500):
                name = field.decode()
                if name.startswith(prefix):  # MATCH is a glob; the prefix test is the contract
                    found[name] = json.loads(raw)
            return dict(sorted(found.items()))

    async def append(self, session: str, key: str, value: Any, max_len: int = 10_000) -> None:
        """RPUSH and LTRIM in one MULTI/EXEC, so readers never see the list over its bound."""
        with _reachable():
            name = self._list(session, key)
            if max_len <= 0:  # as SqliteStore: a bound of 0 keeps nothing
                await self._redis.delete(name)
                return
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.rpush(name, _dumps(value))
                pipe.ltrim(name, -max_len, -1)
                await pipe.execute()

    async def items(self, session: str, key: str, last: int = 0) -> list[Any]:
        with _reachable():
            start = -last if last > 0 else 0
            return [json.loads(v) for v in await self._redis.lrange(self._list(session, key), start, -1)]

    async def close(self) -> None:
        await self._redis.aclose()

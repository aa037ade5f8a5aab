"""The Store contract, run against every backend: SQLite (embedded), Redis (real redis-server) and a
real Redis Cluster (3 masters, 3 replicas; shared by the session, emptied for each test)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tests.redisproc import RedisClusterProcess, RedisProcess, redis_cluster, redis_cluster_clean, redis_server
from uibus.infra.sqlite_store import SqliteStore
from uibus.infra.store import Store

__all__ = ["redis_cluster", "redis_cluster_clean", "redis_server"]

Opener = Callable[[], Store]


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("redis-cluster", marks=pytest.mark.redis)])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """Opens a store on the same backing data each time it is called (to check reopening)."""
    if request.param == "sqlite":
        path = str(tmp_path / "store.db")
        return lambda: SqliteStore(path)
    from uibus.infra.redis import RedisStore

    if request.param == "redis-cluster":
        cluster: RedisClusterProcess = request.getfixturevalue("redis_cluster_clean")
        return lambda: RedisStore(cluster.url, cluster=True)
    server: RedisProcess = request.getfixturevalue("redis_server")
    return lambda: RedisStore(server.url)


@pytest.fixture
async def store(opener: Opener) -> AsyncIterator[Store]:
    s = opener()
    try:
        yield s
    finally:
        await s.close()


VALUES = [{"dark": True, "colors": {"bg": "#000"}}, [1, 2.5, None, "x"], "täxt ✓", 0, -7, 3.25, False, True, ""]


async def test_get_missing_is_none(store: Store) -> None:
    assert await store.get("s", "nope") is None


@pytest.mark.parametrize("value", VALUES, ids=[type(v).__name__ + str(i) for i, v in enumerate(VALUES)])
async def test_put_get_round_trips_json(store: Store, value: object) -> None:
    await store.put("s", "k", value)
    got = await store.get("s", "k")
    assert got == value and type(got) is type(value)


async def test_put_overwrites_and_none_deletes(store: Store) -> None:
    await store.put("s", "k", {"v": 1})
    await store.put("s", "k", {"v": 2})
    assert await store.get("s", "k") == {"v": 2}
    await store.put("s", "k", None)
    assert await store.get("s", "k") is None
    assert await store.scan("s", "") == {}
    await store.put("s", "k", None)  # deleting a missing key is fine


async def test_scan_by_prefix_sorted(store: Store) -> None:
    for k in ["ctx/b", "ctx/a", "ctx", "ctxz", "cty/a", "other", "ctx/ä"]:
        await store.put("s", k, k.upper())
    got = await store.scan("s", "ctx/")
    assert list(got) == ["ctx/a", "ctx/b", "ctx/ä"]
    assert got["ctx/a"] == "CTX/A"
    assert list(await store.scan("s", "ctx")) == ["ctx", "ctx/a", "ctx/b", "ctx/ä", "ctxz"]
    assert len(await store.scan("s", "")) == 7
    assert await store.scan("s", "zzz") == {}


async def test_scan_prefix_with_glob_characters_is_literal(store: Store) -> None:
    for k in ["a*b/1", "a*b/2", "axb/1", "a?c", "abc", "[x]/1", "x/1", "a\\b", "a\\\\b"]:
        await store.put("s", k, 1)
    assert list(await store.scan("s", "a*b/")) == ["a*b/1", "a*b/2"]
    assert list(await store.scan("s", "a?")) == ["a?c"]
    assert list(await store.scan("s", "[x]")) == ["[x]/1"]
    assert list(await store.scan("s", "a\\")) == ["a\\\\b", "a\\b"]


async def test_sessions_are_isolated_even_with_separator_characters(store: Store) -> None:
    # If session and key were joined naively, ("a:b", "c") and ("a", "b:c") would share a name.
    await store.put("a:b", "c", 1)
    await store.put("a", "b:c", 2)
    await store.put("{a}", "x", 3)
    await store.append("a:b", "l", "one")
    await store.append("a", "b:l", "two")
    assert await store.get("a:b", "c") == 1
    assert await store.get("a", "b:c") == 2
    assert await store.get("a", "c") is None
    assert await store.scan("a", "") == {"b:c": 2}
    assert await store.scan("{a}", "") == {"x": 3}
    assert await store.items("a:b", "l") == ["one"]
    assert await store.items("a", "b:l") == ["two"]
    assert await store.items("a", "l") == []


async def test_values_and_lists_are_separate_namespaces(store: Store) -> None:
    await store.put("s", "x", "value")
    await store.append("s", "x", "item")
    assert await store.get("s", "x") == "value"
    assert await store.items("s", "x") == ["item"]
    assert await store.scan("s", "x") == {"x": "value"}


async def test_append_items_order_and_last(store: Store) -> None:
    assert await store.items("s", "hist") == []
    for i in range(5):
        await store.append("s", "hist", {"i": i})
    assert await store.items("s", "hist") == [{"i": i} for i in range(5)]
    assert await store.items("s", "hist", last=2) == [{"i": 3}, {"i": 4}]
    assert await store.items("s", "hist", last=50) == [{"i": i} for i in range(5)]
    assert await store.items("s", "hist", last=0) == [{"i": i} for i in range(5)]


async def test_append_keeps_newest_max_len(store: Store) -> None:
    for i in range(12):
        await store.append("s", "l", i, max_len=5)
        assert len(await store.items("s", "l")) == min(i + 1, 5)
    assert await store.items("s", "l") == [7, 8, 9, 10, 11]
    await store.append("s", "l", 12, max_len=3)  # a smaller bound trims at once
    assert await store.items("s", "l") == [10, 11, 12]
    await store.append("s", "l", 13, max_len=0)  # a bound of 0 keeps nothing
    assert await store.items("s", "l") == []
    await store.append("s", "l", 14)
    assert await store.items("s", "l") == [14]


async def test_data_survives_reopening(opener: Opener) -> None:
    first = opener()
    await first.put("s", "theme", '{"dark":true}')
    await first.append("s", "hist", "hello")
    await first.close()
    second = opener()
    try:
        assert await second.get("s", "theme") == '{"dark":true}'
        assert await second.items("s", "hist") == ["hello"]
    finally:
        await second.close()


async def test_concurrent_appends_lose_nothing(store: Store) -> None:
    import asyncio

    async def writer(w: int) -> None:
        for i in range(20):
            await store.append("s", "l", [w, i], max_len=1000)

    await asyncio.gather(*(writer(w) for w in range(5)))
    got = await store.items("s", "l")
    assert sorted(map(tuple, got)) == [(w, i) for w in range(5) for i in range(20)]
    for w in range(5):  # each writer's items stay in its order
        assert [i for ww, i in got if ww == w] == list(range(20))




async def test_redis_outage_is_store_unavailable_not_a_hang(redis_server: RedisProcess) -> None:
    import asyncio

    from uibus.infra.redis import RedisStore
    from uibus.infra.store import StoreUnavailable

    store = RedisStore(redis_server.url)
    try:
        await store.put("s", "k", 1)
        redis_server.kill()
        for call in (store.get("s", "k"), store.put("s", "k", 2), store.scan("s", ""),
                     store.append("s", "l", 1), store.items("s", "l")):
            with pytest.raises(StoreUnavailable, match="unreachable"):
                await asyncio.wait_for(call, 10)
        redis_server.start()  # empty again (no persistence): the same client reconnects by itself
        await store.put("s", "k", 3)
        assert await store.get("s", "k") == 3
    finally:
        await store.close()


async def test_sessions_are_listed_most_recent_first_and_dropped_whole(store: Store) -> None:
    """What the sessions API (uibus.domain.sessions) lists and deletes, on every backend."""
    await store.put("team/a", "k", 1)
    await store.append("team/a", "history", {"n": 1})
    await asyncio.sleep(0.01)
    await store.put("b b", "k", 2)  # a name that needs quoting in Redis keys
    listed = await store.sessions()
    names = [name for name, _stamp in listed]
    assert names[:2] == ["b b", "team/a"] and listed[0][1] >= listed[1][1] > 0
    assert await store.drop_session("team/a") is True
    assert await store.get("team/a", "k") is None and await store.items("team/a", "history") == []
    assert [name for name, _stamp in await store.sessions()] == ["b b"]
    assert await store.drop_session("team/a") is False

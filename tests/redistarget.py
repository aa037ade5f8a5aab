"""The Redis a multi-replica test runs on: one real redis-server, or the shared real Redis Cluster
(3 masters + 3 replicas, emptied per test). Tests that take `redis_target` run on both, so the
bus, the store and everything built on them are held to one contract on either topology."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.redisproc import redis_cluster, redis_cluster_clean, redis_server
from tests.support import needs

__all__ = ["RedisTarget", "redis_cluster", "redis_cluster_clean", "redis_server", "redis_target"]


@dataclass(frozen=True)
class RedisTarget:
    url: str
    cluster: bool

    def config(self) -> dict[str, object]:
        """The Config fields that point uibus at it."""
        return {"redis_url": self.url, "redis_cluster": self.cluster}


@pytest.fixture(params=["single", "cluster"])
@needs("redis")
def redis_target(request: pytest.FixtureRequest) -> RedisTarget:
    if request.param == "single":
        return RedisTarget(request.getfixturevalue("redis_server").url, False)
    return RedisTarget(request.getfixturevalue("redis_cluster_clean").url, True)

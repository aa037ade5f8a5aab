"""uibus on Redis: the replicated bus (`ReplicatedBus`) and the shared session store (`RedisStore`).

The parts, each its own module so each can be read (and tested) alone:
* `conn`: clients for the three topologies and the cluster `SlotMap`;
* `codec`: the envelope (what one replica tells the others) and its decoding;
* `outbox`: the bounded buffer of envelopes not yet written, across an outage too;
* `links`: the pub/sub connections (one per Redis, or per cluster master) and their channels;
* `shards`: which shard channels this replica listens to, and for how long;
* `presence`: subscriber counts of other replicas, hellos;
* `bus`: the facade composing them, a `uibus.infra.bus.Bus` whose topics span the replicas;
* `store`, `keys`, `index_single`, `index_cluster`, `scripts`: the session store, its key names,
  its two index strategies (one chosen at construction) and its Lua scripts.
"""

from uibus.infra.redis.bus import ReplicatedBus, ReplicationStats, shard_of
from uibus.infra.redis.index_cluster import EMPTY_TAG, INDEX_SHARDS
from uibus.infra.redis.store import RedisStore

__all__ = ["EMPTY_TAG", "INDEX_SHARDS", "RedisStore", "ReplicatedBus", "ReplicationStats", "shard_of"]

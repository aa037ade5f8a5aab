"""How uibus talks to Redis: one client (one connection pool) per owner, built the same way, for the
three topologies an operator runs: one server, a Redis Cluster, or a master set behind sentinels.

Timeouts are short and retries few on purpose: the store sits in the path of gRPC calls and the
bus in the path of publishes, so a Redis outage must turn into a quick error, never a hung call.
A failover is an outage of a few seconds to both; what follows it is the client's job (redis-py's
cluster client re-reads the slot map on MOVED and on a dead node, its Sentinel pool asks the
sentinels for the master again on every new connection), so no restart is needed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    ClusterError,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from uibus.infra.errors import ConfigError

log = logging.getLogger("uibus.infra.redis")

# What an unreachable, restarting or failing-over Redis raises; everything else is a programming
# error. (MasterNotFoundError is a ConnectionError: the sentinels know no master right now.)
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError,
                                                  ClusterDownError, TryAgainError, MasterNotFoundError)

# What redis-py's cluster client raises, with no reply of Redis, while it finds no node for a slot
# (a master is gone and no replica took over yet) or cannot reach any node to learn the slots.
CLUSTER_OUTAGE: tuple[type[BaseException], ...] = (SlotNotCoveredError, ClusterError)

CONNECT_TIMEOUT_S = 1.0
COMMAND_TIMEOUT_S = 2.0
SENTINEL_SCHEME = "redis+sentinel://"

AnyRedis = Redis | RedisCluster


def _common(name: str) -> dict[str, Any]:
    return {"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_timeout": COMMAND_TIMEOUT_S,
            "client_name": name, "decode_responses": False}


def make_client(url: str, name: str, *, cluster: bool = False) -> AnyRedis:
    """A client for `url` owning its pool; `aclose()` releases both.

    * `redis://`, `rediss://`, `unix://`: one server.
    * with `cluster`: `url` names any node of a Redis Cluster; the client learns the others.
    * `redis+sentinel://[user:password@]host:port[,host:port…]/MASTER[/db]`: the master of the set
      MASTER as the sentinels name it now (query `sentinel_password=` if they need one).

    A URL that cannot be parsed is a ConfigError (connecting is not tried here); Config has already
    refused other schemes, and redis-py's own refusal never repeats the URL (a password)."""
    try:
        if url.startswith(SENTINEL_SCHEME):
            return _sentinel_master(url, name)
        if cluster:
            return RedisCluster.from_url(url, **_common(name), require_full_coverage=False,
                                         retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=2))
        return Redis.from_url(
            url, **_common(name),
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=1),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            health_check_interval=10,
        )
    except ValueError as exc:  # a port that is not a number, an unknown query option
        raise ConfigError("--redis-url", f"cannot be parsed: {exc}") from exc


def sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, int, dict[str, Any]]:
    """(sentinels, master set, db, auth) of a `redis+sentinel://` URL; ValueError says what is wrong."""
    parts = urlsplit(url)
    auth: dict[str, Any] = {}
    if parts.password is not None:
        auth["password"] = unquote(parts.password)
    if parts.username:
        auth["username"] = unquote(parts.username)
    hosts = parts.netloc.rpartition("@")[2]
    sentinels: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "26379")
        if not host:
            raise ValueError(f"sentinel {item!r} has no host")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ValueError("no master set name: redis+sentinel://host:port/MASTER")
    db = int(path[1]) if len(path) > 1 else 0
    query = parse_qs(parts.query)
    if "sentinel_password" in query:
        auth["sentinel_password"] = query["sentinel_password"][0]
    return sentinels, unquote(path[0]), db, auth


def _sentinel_master(url: str, name: str) -> Redis:
    sentinels, master, db, auth = sentinel_parts(url)
    sentinel_password = auth.pop("sentinel_password", None)
    sentinel = Sentinel(sentinels, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=COMMAND_TIMEOUT_S,
                        sentinel_kwargs={"socket_connect_timeout": CONNECT_TIMEOUT_S,
                                         "socket_timeout": COMMAND_TIMEOUT_S,
                                         **({"password": sentinel_password} if sentinel_password else {})})
    client = sentinel.master_for(master, redis_class=Redis, db=db, **auth, **_common(name),
                                 retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=1),
                                 retry_on_error=[RedisConnectionError, RedisTimeoutError])
    return client


def node_client(cluster: RedisCluster, host: str, port: int, name: str) -> Redis:
    """A plain client to one node of `cluster`, with the cluster's credentials and TLS: the bus
    holds one pub/sub connection per node that owns a shard it listens to."""
    kwargs = dict(cluster.get_default_node().connection_kwargs) if cluster.get_default_node() else {}
    keep = {k: v for k, v in kwargs.items() if k in ("username", "password", "ssl", "ssl_ca_certs", "ssl_certfile",
                                                      "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname",
                                                      "connection_class", "credential_provider")}
    # No retry inside redis-py: a dead master must surface at once, so the bus marks its shards lost
    # (health NOT_SERVING) and moves them to the promoted replica (redis-py's default retries and
    # backoff hid a SIGKILLed master for 3.5 s here, longer than the failover itself).
    return Redis(host=host, port=port, **keep, **_common(name), retry=Retry(ExponentialBackoff(), retries=0))


class SlotMap:
    """A cluster client's slot map, read one reader at a time: redis-py's cluster client learns it
    (and its command parser, key -> slot) at its first command, and several first commands at once
    race: one can write on a connection another's learning just closed (a RuntimeError on uvloop,
    not an outage). `read()` learns it the first time and re-reads it after that (a failover, a
    slot move); the store and the bus each hold one for their client. A plain client has none."""

    def __init__(self, client: RedisCluster) -> None:
        self.client = client
        self.learned = False
        self._lock = asyncio.Lock()

    async def learn(self) -> None:
        """The first reading, once; a no-op after it."""
        if not self.learned:
            async with self._lock:
                if not self.learned:
                    await self.client.initialize()
                    self.learned = True

    async def read(self) -> None:
        """The first reading, or a fresh one of the map (the cluster changed)."""
        if not self.learned:
            await self.learn()
            return
        async with self._lock:
            await self.client.nodes_manager.initialize()


# ---- a Redis that needs no password -----------------------------------------------------------------

_WARNED: set[str] = set()  # the Redis addresses warned about in this process (once each)


def without_credentials(url: str) -> str | None:
    """`url` with its user, password and credential query options removed; None for a URL this
    check does not cover (sentinels: the master's address is theirs to say)."""
    if url.startswith(SENTINEL_SCHEME):
        return None
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    query = [(k, v) for k, vs in parse_qs(parts.query).items() for v in vs if k not in ("password", "username")]
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{urlencode(query)}" if query else "")


async def needs_no_password(url: str) -> bool | None:
    """Whether the Redis of `url` runs commands for a connection that presents no credentials: a
    fresh client without the URL's user and password runs one read (DBSIZE). True: it does (any
    local process, any agent sharing the host's loopback, can read and write every session); False:
    it refused (NOAUTH / authentication); None: not known (unreachable, a sentinel URL)."""
    bare = without_credentials(url)
    if bare is None:
        return None
    try:
        client = Redis.from_url(bare, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=COMMAND_TIMEOUT_S,
                                client_name="uibus-auth-probe")
    except ValueError:
        return None
    try:
        await client.execute_command("DBSIZE")
        return True
    except AuthenticationError:  # NOAUTH: it needs credentials
        return False
    except (RedisConnectionError, RedisTimeoutError, OSError):
        return None  # unreachable: the store and the bus say so
    except RedisError as exc:
        return False if "NOAUTH" in str(exc) else None
    finally:
        await client.aclose()


async def warn_if_open(url: str) -> bool:
    """Logs one warning (once per Redis address and process) when the Redis of `url` needs no
    password; True when it warned now."""
    address = where(url)
    if address in _WARNED or await needs_no_password(url) is not True:
        return False
    _WARNED.add(address)
    log.warning(f"Redis at {address} needs no password: any local process or agent on this host can read and "
                "write every session; set `requirepass` (or an ACL user) and put it in --redis-url "
                "(redis://:PASSWORD@host:port/0)", extra={"fields": {"redis": address}})
    return True


def where(url: str) -> str:
    """The address part of a Redis URL, without credentials (for a log line)."""
    parts = urlsplit(url)
    return parts.netloc.rpartition("@")[2] or parts.path or url.partition("://")[2].rpartition("@")[2]

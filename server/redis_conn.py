"""How uibus talks to Redis: one client (one connection pool) per owner, built the same way.

Timeouts are short and retries few on purpose: the store sits in the path of gRPC calls and the
bus in the path of publishes, so a Redis outage must turn into a quick error, never a hung call.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from uibus.errors import ConfigError

# What an unreachable or restarting Redis raises; everything else is a programming error.
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError)

CONNECT_TIMEOUT_S = 1.0
COMMAND_TIMEOUT_S = 2.0


def make_client(url: str, name: str) -> Redis:
    """A client for `url` (redis://, rediss:// or unix://) owning its pool; `aclose()` releases
    both. A URL that cannot be parsed is a ConfigError (connecting is not tried here); Config has
    already refused other schemes, and redis-py's own refusal never repeats the URL (a password)."""
    try:
        return Redis.from_url(
            url,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=COMMAND_TIMEOUT_S,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=1),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            health_check_interval=10,
            client_name=name,
            decode_responses=False,
        )
    except ValueError as exc:  # a port that is not a number, an unknown query option
        raise ConfigError("--redis-url", f"cannot be parsed: {exc}") from exc

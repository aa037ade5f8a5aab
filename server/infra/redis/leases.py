"""Agent ownership leases on Redis: one owner per (session, agent) across every replica and worker.

Layout: `uibus:{s}:lease:<agent>` hash {owner, token, until}. The `{s}` hash tag puts it in the
session's slot, so each step is one script on one key: atomic on one server, a master behind
sentinels and a Redis Cluster alike. Expiry is the `until` field, read against the server's own
clock (TIME), never a client's: replicas' clocks may disagree, Redis's is the one all of them see.
The key itself outlives `until` by KEEP_MS, so the token (the fencing token, +1 at every change of
hands) keeps growing across takeovers, and an abandoned lease still cleans itself up.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from uibus.infra.redis.keys import Keys
from uibus.infra.store import Lease

KEEP_MS = 24 * 3600 * 1000  # how long a lease key outlives its expiry (its token kept)

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: the lease. ARGV: owner, ttl (ms), keep (ms). Returns {owner, token, taken_from}: the caller's
# lease (taken or renewed) when it was free, expired or its own; else the live owner's, untouched.
TAKE = _NOW + """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'token', 'until')
local owner, token, till = cur[1] or '', tonumber(cur[2]) or 0, tonumber(cur[3]) or 0
if owner ~= '' and owner ~= ARGV[1] and till > now then
  return {owner, token, ''}
end
local from = ''
if owner ~= ARGV[1] or till <= now then
  token = token + 1
  if owner ~= '' and owner ~= ARGV[1] then from = owner end
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'token', token, 'until', now + tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) + tonumber(ARGV[3]))
return {ARGV[1], token, from}
"""

# KEYS: the lease. ARGV: owner, token, ttl (ms), keep (ms). 1 if still held (and extended), else 0.
RENEW = _NOW + """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'token', 'until')
if cur[1] ~= ARGV[1] or tonumber(cur[2]) ~= tonumber(ARGV[2]) or (tonumber(cur[3]) or 0) <= now then
  return 0
end
redis.call('HSET', KEYS[1], 'until', now + tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) + tonumber(ARGV[4]))
return 1
"""

# KEYS: the lease. ARGV: owner, token. Frees it now if still the caller's (the token stays, the owner
# is cleared: whoever takes it next takes a free lease, not one over).
DROP = """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'token')
if cur[1] == ARGV[1] and tonumber(cur[2]) == tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], 'owner', '', 'until', 0)
  return 1
end
return 0
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisLeases:
    """The three lease steps of a RedisStore (which maps their faults, see RedisStore.guard)."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.keys = keys
        self._take = redis.register_script(TAKE)
        self._renew = redis.register_script(RENEW)
        self._drop = redis.register_script(DROP)

    def key(self, session: str, name: str) -> str:
        return f"{self.keys.base(session)}:lease:{quote(name, safe='')}"

    async def take(self, session: str, name: str, owner: str, ttl_s: float) -> Lease:
        got = await self._take(keys=[self.key(session, name)], args=[owner, max(1, int(ttl_s * 1000)), KEEP_MS])
        return Lease(_text(got[0]), int(got[1]), _text(got[2]))

    async def renew(self, session: str, name: str, owner: str, token: int, ttl_s: float) -> bool:
        return bool(await self._renew(keys=[self.key(session, name)],
                                      args=[owner, token, max(1, int(ttl_s * 1000)), KEEP_MS]))

    async def drop(self, session: str, name: str, owner: str, token: int) -> None:
        await self._drop(keys=[self.key(session, name)], args=[owner, token])

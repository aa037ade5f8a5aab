"""The audit chain in Redis: one chain every replica appends to (uibus.infra.audit has the entries).

Keys, all in one hash slot (`{audit}`, so a Redis Cluster takes the scripts): `<ns>:{audit}:log`, a
sorted set of the entries' text scored by seq; `<ns>:{audit}:head` and `<ns>:{audit}:anchor`, hashes
{seq, hash} of the last entry written and of the last one retention removed; `<ns>:{audit}:s:<session>`,
each session's seqs (a sorted set, written by the append script with the entry), so a session's
entries — the page's audit view, every few seconds — are read without walking the whole chain, and
`<ns>:{audit}:sessions`, the sessions indexed (retention trims their indexes too). An index is
only a way in: every entry read through it comes from the log and is matched against the query
again, so a changed index can hide an entry from List, never show one the chain does not hold
(`verify` reads the log alone).

An append is optimistic: the replica reads the head, seals the entry in Python (seq + 1, prev =
the head's hash, SHA-256) and a script writes it only if the head is still that one, else returns
the head now and the replica seals again (bounded). Two replicas appending at once therefore
each get their own seq, and the chain never forks.
"""

from __future__ import annotations

import json
from typing import Any

from uibus.infra.audit import GENESIS, Query, Row, sealed, time_ms

__all__ = ["RedisAudit"]

TRIES = 200  # seals of one entry before an append gives up (each lost race means another replica wrote)
SCAN = 500  # entries read per round trip by a filtered query

# KEYS: log, head, the session's index, the indexed sessions. ARGV: expected seq, expected hash, seq,
# hash, entry, GENESIS, session ("" = none). 1 when written, else {seq, hash} now.
_APPEND = """
local h = redis.call('HMGET', KEYS[2], 'seq', 'hash')
local seq = h[1] or '0'
local hash = h[2] or ARGV[6]
if seq ~= ARGV[1] or hash ~= ARGV[2] then return {seq, hash} end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[5])
redis.call('HSET', KEYS[2], 'seq', ARGV[3], 'hash', ARGV[4])
if ARGV[7] ~= '' then
  redis.call('ZADD', KEYS[3], ARGV[3], ARGV[3])
  redis.call('SADD', KEYS[4], ARGV[7])
end
return 1
"""

# KEYS: log, a session's index. ARGV: after, count. {seqs scanned, the last one, entry texts…}: the next
# `count` seqs of the index after `after`, each entry as the log holds it (one retention removed: skipped).
_FETCH = """
local seqs = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[1], '+inf', 'LIMIT', 0, tonumber(ARGV[2]))
local out = {#seqs, #seqs > 0 and seqs[#seqs] or ARGV[1]}
for _, s in ipairs(seqs) do
  local found = redis.call('ZRANGEBYSCORE', KEYS[1], s, s)
  for _, text in ipairs(found) do out[#out + 1] = text end
end
return out
"""

# KEYS: log, anchor, the indexed sessions. ARGV: seq, hash, the index keys' prefix. Removes the entries
# up to seq (and their seqs from every session's index), moves the anchor (never back).
_TRIM = """
local a = tonumber(redis.call('HGET', KEYS[2], 'seq') or '0')
if tonumber(ARGV[1]) <= a then return 0 end
local n = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
redis.call('HSET', KEYS[2], 'seq', ARGV[1], 'hash', ARGV[2])
for _, session in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local index = ARGV[3] .. session
  redis.call('ZREMRANGEBYSCORE', index, '-inf', ARGV[1])
  if redis.call('ZCARD', index) == 0 then redis.call('SREM', KEYS[3], session) end
end
return n
"""


class RedisAudit:
    """The chain on a redis.asyncio client (the store's)."""

    def __init__(self, redis: Any, namespace: str = "uibus") -> None:
        self.redis = redis
        base = f"{namespace}:{{audit}}"
        self.log_key, self.head_key, self.anchor_key = f"{base}:log", f"{base}:head", f"{base}:anchor"
        self.index_prefix, self.sessions_key = f"{base}:s:", f"{base}:sessions"
        self._append = redis.register_script(_APPEND)
        self._fetch = redis.register_script(_FETCH)
        self._trim = redis.register_script(_TRIM)

    async def _mark(self, key: str) -> tuple[int, str]:
        seq, hash_ = await self.redis.hmget(key, "seq", "hash")
        return (int(seq), _text(hash_)) if seq is not None else (0, GENESIS)

    async def append(self, body: dict[str, Any]) -> dict[str, Any]:
        seq, prev = await self._mark(self.head_key)
        if seq == 0:
            seq, prev = await self._mark(self.anchor_key)
            # the head is absent: the script compares against "0" and GENESIS (or the anchor's)
            expected_seq, expected_hash = "0", GENESIS
        else:
            expected_seq, expected_hash = str(seq), prev
        session = str(body.get("session", ""))
        keys = [self.log_key, self.head_key, self.index_prefix + session, self.sessions_key]
        for _ in range(TRIES):
            entry = sealed(body, seq + 1, prev)
            text = json.dumps(entry, sort_keys=True, ensure_ascii=False)
            got = await self._append(keys=keys, args=[expected_seq, expected_hash, entry["seq"], entry["hash"], text,
                                                      GENESIS, session])
            if got == 1:
                return entry
            seq, prev = int(got[0]), _text(got[1])  # another replica wrote first: after its entry
            expected_seq, expected_hash = str(seq), prev
        raise RuntimeError(f"audit log: {TRIES} appends in a row lost the race for the head")

    async def query(self, query: Query) -> list[dict[str, Any]]:
        """Reads in seq order and filters here, SCAN entries per round trip, until the page asked
        for is full: a session's through its index, otherwise the whole chain."""
        found: list[dict[str, Any]] = []
        after = query.after
        while True:
            if query.session:
                scanned, last, *texts = await self._fetch(keys=[self.log_key, self.index_prefix + query.session],
                                                          args=[after, SCAN])
                scanned, after = int(scanned), int(last)
            else:
                pairs = await self.redis.zrangebyscore(self.log_key, f"({after}", "+inf", start=0, num=SCAN,
                                                       withscores=True)
                texts = [text for text, _ in pairs]  # paged by score: an entry's own text never moves the cursor
                scanned, after = len(pairs), int(pairs[-1][1]) if pairs else after
            for text in texts:
                entry = json.loads(text)
                if query.matches(entry):
                    found.append(entry)
                    if len(found) >= query.limit:
                        return found
            if scanned < SCAN:
                return found

    async def rows(self, after: int, limit: int) -> list[Row]:
        pairs = await self.redis.zrangebyscore(self.log_key, f"({after}", "+inf", start=0, num=limit, withscores=True)
        return [Row(int(score), _text(text)) for text, score in pairs]

    async def marks(self) -> tuple[tuple[int, str], tuple[int, str]]:
        return await self._mark(self.anchor_key), await self._mark(self.head_key)

    async def trim(self, before_ms: int) -> int:
        """Finds the last entry older than `before_ms` (never the newest), then one script removes
        up to it and moves the anchor, so two replicas trimming at once agree."""
        cut: tuple[int, str] | None = None
        after = 0
        newest = await self.redis.zrevrange(self.log_key, 0, 0, withscores=True)
        if not newest:
            return 0
        top = int(newest[0][1])
        while True:
            texts = await self.redis.zrangebyscore(self.log_key, f"({after}", "+inf", start=0, num=SCAN)
            for text in texts:
                entry = json.loads(text)
                after = entry["seq"]
                if time_ms(entry) >= before_ms or entry["seq"] >= top:
                    texts = []
                    break
                cut = (entry["seq"], entry["hash"])
            if len(texts) < SCAN:
                break
        if cut is None:
            return 0
        return int(await self._trim(keys=[self.log_key, self.anchor_key, self.sessions_key],
                                    args=[cut[0], cut[1], self.index_prefix]))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

"""The session store's Lua scripts (uibus.infra.redis.store has the layout they keep).

Each runs atomically on the server, which is what makes retention exact across replicas: a write
and its session's stamp (and, on one server, making room for a new session) are one step, and
an eviction takes each session exactly once. Scripts of the one-server index (`SingleIndex`) may
touch the index and the keys of sessions they derive; scripts of the cluster index
(`ClusterIndex`) touch the keys of one slot only (else CROSSSLOT), hence the two families.
Fragments (DROP, EVICT_OVER, PUSH) are Lua functions or statements prepended to the scripts that
share them.
"""

# ---- one server: the write, its stamp and making room in one script ------------------------------

# Deletes every key of session member `m` (its values, each list named in its `lists` hash).
DROP = """
local function drop(ns, m)
  local base = ns .. ':{' .. m .. '}'
  for _, k in ipairs(redis.call('HKEYS', base .. ':lists')) do
    redis.call('DEL', base .. ':list:' .. k)
  end
  redis.call('DEL', base .. ':kv', base .. ':lists', base .. ':log', base .. ':logidx')
end
"""

# Deletes the longest idle sessions (never `keep`; false = none) while more than `max` are indexed, at most
# `batch`; returns how many. Atomic with the write that called it, so replicas never over-evict.
EVICT_OVER = DROP + """
local function evict_over(index, ns, max, batch, keep)
  local over = math.min(redis.call('ZCARD', index) - max, batch)
  local n = 0
  if over > 0 then
    for _, m in ipairs(redis.call('ZRANGE', index, 0, over)) do
      if n == over then break end
      if m ~= keep then
        drop(ns, m)
        redis.call('ZREM', index, m)
        n = n + 1
      end
    end
  end
  return n
end
"""

# KEYS: index. ARGV: namespace, max_sessions, batch. Returns {deleted, sessions left}.
EVICT_OVER_MAX = EVICT_OVER + """
return {evict_over(KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), false), redis.call('ZCARD', KEYS[1])}
"""

# KEYS: the session's kv hash, index. ARGV: key, JSON value ('' deletes), now, member, namespace,
# max_sessions, batch. The write, its stamp and (for a new session) making room, in one step.
# Returns {sessions evicted, sessions stored}.
PUT = EVICT_OVER + """
local evicted = 0
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZADD', KEYS[2], 'XX', ARGV[3], ARGV[4])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  if redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4]) == 1 and tonumber(ARGV[6]) > 0 then
    evicted = evict_over(KEYS[2], ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[4])
  end
end
return {evicted, redis.call('ZCARD', KEYS[2])}
"""

# KEYS: index. ARGV: namespace, cutoff (ms), batch.
# Deletes up to `batch` sessions last written before the cutoff; returns {deleted, sessions left}.
EVICT_IDLE = DROP + """
local victims = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
for _, m in ipairs(victims) do
  drop(ARGV[1], m)
  redis.call('ZREM', KEYS[1], m)
end
return {#victims, redis.call('ZCARD', KEYS[1])}
"""

# KEYS: list, the session's lists hash, index. ARGV: JSON value, max_len, max_bytes, list key, now,
# member, namespace, max_sessions, batch. RPUSH, keep the byte total in the lists hash, drop the
# oldest over max_len (LTRIM) and, with max_bytes > 0, while over max_bytes (LPOP, never the item
# just pushed); stamp the session and, if it is new, make room.
# Returns {entries dropped for bytes, sessions evicted, sessions stored}. (PUSH is its first part, the
# list alone, which the cluster's APPEND_SESSION shares.)
PUSH = """
local max_len, max_bytes = tonumber(ARGV[2]), tonumber(ARGV[3])
local dropped = 0
if max_len <= 0 then
  redis.call('DEL', KEYS[1])
  redis.call('HDEL', KEYS[2], ARGV[4])
else
  local total = tonumber(redis.call('HGET', KEYS[2], ARGV[4]))
  if not total then
    total = 0
    for _, v in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do total = total + #v end
  end
  local n = redis.call('RPUSH', KEYS[1], ARGV[1])
  total = total + #ARGV[1]
  if n > max_len then
    for _, v in ipairs(redis.call('LRANGE', KEYS[1], 0, n - max_len - 1)) do total = total - #v end
    redis.call('LTRIM', KEYS[1], n - max_len, -1)
    n = max_len
  end
  while max_bytes > 0 and total > max_bytes and n > 1 do
    total = total - #redis.call('LPOP', KEYS[1])
    n = n - 1
    dropped = dropped + 1
  end
  redis.call('HSET', KEYS[2], ARGV[4], total)
end
"""

APPEND = EVICT_OVER + PUSH + """
local evicted = 0
if redis.call('ZADD', KEYS[3], ARGV[5], ARGV[6]) == 1 and tonumber(ARGV[8]) > 0 then
  evicted = evict_over(KEYS[3], ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[6])
end
return {dropped, evicted, redis.call('ZCARD', KEYS[3])}
"""

# ---- Redis Cluster: the session's own step, its index's step, the eviction lock -----------------

# KEYS: the session's kv hash, its seen key. ARGV: key, JSON value ('' deletes), now.
# The write and the session's `seen`; a delete refreshes `seen` only of a session that exists.
PUT_SESSION = """
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('SET', KEYS[2], ARGV[3], 'XX')
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3])
end
return 1
"""

# KEYS: list, the session's lists hash, its seen key. ARGV: as APPEND's first five (value, max_len,
# max_bytes, list key, now). The push and its bounds as APPEND, and `seen`; returns entries dropped.
APPEND_SESSION = PUSH + """
redis.call('SET', KEYS[3], ARGV[5])
return dropped
"""

# KEYS: the session's kv hash, lists hash, seen key. ARGV: the session's key prefix (`ns:{m}`), the
# index score it was taken at. Deletes every key of the session unless it was written after that
# score: returns {1} (deleted) or {0, seen} (kept: the caller stamps it again).
DROP_IF_IDLE = """
local seen = redis.call('GET', KEYS[3])
if seen and tonumber(seen) > tonumber(ARGV[2]) then
  return {0, seen}
end
for _, k in ipairs(redis.call('HKEYS', KEYS[2])) do
  redis.call('DEL', ARGV[1] .. ':list:' .. k)
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], ARGV[1] .. ':log', ARGV[1] .. ':logidx')
return {1}
"""

# KEYS: an index. ARGV: member, score, member, score, … Removes each member whose score is still
# the one given (compare and remove: not one written since); returns those removed.
TAKE = """
local taken = {}
for i = 1, #ARGV, 2 do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) == tonumber(ARGV[i + 1]) then
    redis.call('ZREM', KEYS[1], ARGV[i])
    taken[#taken + 1] = ARGV[i]
    taken[#taken + 1] = score
  end
end
return taken
"""

# KEYS: an index. ARGV: cutoff (ms), batch. Removes up to `batch` members last written before the
# cutoff; returns them as {member, score, …}.
TAKE_IDLE = """
local victims = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1], 'WITHSCORES', 'LIMIT', 0,
                           tonumber(ARGV[2]))
for i = 1, #victims, 2 do
  redis.call('ZREM', KEYS[1], victims[i])
end
return victims
"""

# KEYS: the eviction lock. ARGV: the holder's token. Releases the lock only if still held by it.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


# ---- the session log (uibus.domain.session_log): a Stream per session, ids `seq-0` -----------------

# KEYS: the session's log stream, its index hash (field "kind NUL key" -> "seq size"; `_count`,
# `_bytes`, `_floor`). ARGV: max_entries, max_bytes, cutoff (ms; -1 none), n, then per entry seq,
# kind, key, epoch, at, data. Each entry replaces its (kind, key)'s (XDEL of the old id), then
# retention trims from the oldest id, raising `_floor`; one step, so replicas never interleave
# inside a batch. Seqs are kept as strings (Lua's numbers print large integers in exponent form);
# an entry whose seq is not above the stream's last id (another replica wrote a higher one) is
# written at last + 1. Returns the last id's seq.
LOG_APPEND = """
local maxn, maxb, cutoff, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local meta = redis.call('HMGET', KEYS[2], '_count', '_bytes', '_floor')
local count, bytes, floor = tonumber(meta[1] or '0'), tonumber(meta[2] or '0'), tonumber(meta[3] or '0')
local last = 0
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #top > 0 then last = tonumber(string.match(top[1][1], '^(%d+)')) end
for i = 0, n - 1 do
  local b = 5 + i * 6
  local seq, kind, key, data = tonumber(ARGV[b]), ARGV[b + 1], ARGV[b + 2], ARGV[b + 5]
  local field = kind .. '\0' .. key
  local old = redis.call('HGET', KEYS[2], field)
  if old then
    local oseq, osize = string.match(old, '^(%d+) (%d+)$')
    if redis.call('XDEL', KEYS[1], oseq .. '-0') == 1 then
      count = count - 1
      bytes = bytes - tonumber(osize)
    end
  end
  if seq <= last then seq = last + 1 end
  local id = string.format('%.0f', seq)
  redis.call('XADD', KEYS[1], id .. '-0', 'k', kind, 'y', key, 'e', ARGV[b + 3], 'a', ARGV[b + 4], 'd', data)
  redis.call('HSET', KEYS[2], field, id .. ' ' .. #data)
  last = seq
  count = count + 1
  bytes = bytes + #data
end
while count > 1 do
  local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
  if #first == 0 then break end
  local f = first[1][2]
  local at, size = tonumber(f[8]), #f[10]
  if not ((maxn > 0 and count > maxn) or (maxb > 0 and bytes > maxb) or (cutoff >= 0 and at < cutoff)) then
    break
  end
  redis.call('XDEL', KEYS[1], first[1][1])
  redis.call('HDEL', KEYS[2], f[2] .. '\0' .. f[4])
  count = count - 1
  bytes = bytes - size
  local gone = tonumber(string.match(first[1][1], '^(%d+)'))
  if gone > floor then floor = gone end
end
redis.call('HSET', KEYS[2], '_count', string.format('%.0f', count), '_bytes', string.format('%.0f', bytes),
           '_floor', string.format('%.0f', floor))
return string.format('%.0f', last)
"""

"""Redis key layout and Lua scripts of the shared affinity store (router/affinity.py).

Every key lives in a bucket, b = crc32(session) % buckets, and every key of bucket b starts with
the hash tag `{<prefix>b<b>}`: Redis Cluster hashes only the tag, so a bucket's keys share one
slot. A bucket holds

    {<prefix>b<b>}s:<session>   hash: `home`, and `r:<router id>` = that router's in-flight count
    {<prefix>b<b>}lru           sorted set: session key -> last use (ms, Redis clock)
    {<prefix>b<b>}routers       sorted set: router id -> last heartbeat (ms)

Each script call is given keys of one bucket only (`BucketKeys` is the only way the store names
keys), and the keys a script reaches on its own (sessions it evicts, read from `lru`) are of the
same bucket: every script touches one slot. The router leases are kept per bucket for that
reason: reading a session's in-flight total checks its routers' heartbeats inside the script.
"""

from __future__ import annotations

import zlib

_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- The session's home and its in-flight total over routers whose heartbeat is younger than
-- `lease` ms; the counts of routers without one are removed.
local function live(key, routers, now, lease)
  local h = redis.call('HGETALL', key)
  local home = false
  local total = 0
  for i = 1, #h, 2 do
    local f = h[i]
    if f == 'home' then
      home = h[i + 1]
    elseif string.sub(f, 1, 2) == 'r:' then
      local beat = redis.call('ZSCORE', routers, string.sub(f, 3))
      if beat and now - tonumber(beat) <= lease then
        total = total + tonumber(h[i + 1])
      else
        redis.call('HDEL', key, f)
      end
    end
  end
  return home, total
end
-- Note a use of `key` in the bucket's LRU index, then evict the bucket's least recently used
-- idle sessions beyond `cap` (8 looked at at most; a busy one counts as used now). Returns how
-- many sessions were evicted.
local function used(key, lru, routers, now, lease, ttl, cap)
  redis.call('ZADD', lru, now, key)
  redis.call('EXPIRE', lru, ttl)
  redis.call('ZREMRANGEBYSCORE', lru, '-inf', now - ttl * 1000)  -- their keys have expired
  local excess = redis.call('ZCARD', lru) - cap
  local evicted = 0
  if excess <= 0 then return 0 end
  -- The 8 oldest, read once: a busy one re-scored `now` may tie with the newest, and ties sort by
  -- name, so reading the oldest again could return it again.
  for _, oldest in ipairs(redis.call('ZRANGE', lru, 0, 7)) do
    if excess <= 0 then break end
    local _, busy = live(oldest, routers, now, lease)
    if oldest == key or busy > 0 then
      redis.call('ZADD', lru, now, oldest)
    else
      evicted = evicted + redis.call('DEL', oldest)
      redis.call('ZREM', lru, oldest)
      excess = excess - 1
    end
  end
  return evicted
end
"""

# KEYS: session, routers, lru. ARGV: lease (ms), ttl (s), cap, and for `acquire` this router's
# id. Returns {home, in-flight total of the other requests, sessions evicted}.
GET = _PRELUDE + """
local now = now_ms()
local lease = tonumber(ARGV[1])
local home, total = live(KEYS[1], KEYS[2], now, lease)
local evicted = 0
if ARGV[4] then  -- acquire: count this request too (after reading the others)
  redis.call('HINCRBY', KEYS[1], 'r:' .. ARGV[4], 1)
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  evicted = used(KEYS[1], KEYS[3], KEYS[2], now, lease, tonumber(ARGV[2]), tonumber(ARGV[3]))
elseif home then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('ZADD', KEYS[3], 'XX', now, KEYS[1])
end
return {home, total, evicted}
"""

# KEYS: session, routers, lru. ARGV: ttl, home, force (1 = overwrite an existing home), lease,
# cap. Returns {the home now stored, sessions evicted}.
CLAIM = _PRELUDE + """
if ARGV[3] == '1' or redis.call('HEXISTS', KEYS[1], 'home') == 0 then
  redis.call('HSET', KEYS[1], 'home', ARGV[2])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
local evicted = used(KEYS[1], KEYS[3], KEYS[2], now_ms(), tonumber(ARGV[4]), tonumber(ARGV[1]),
                     tonumber(ARGV[5]))
return {redis.call('HGET', KEYS[1], 'home'), evicted}
"""

# KEYS: sessions of one bucket. ARGV: router id, then each session's decrement.
END = """
for i, key in ipairs(KEYS) do
  local n = redis.call('HINCRBY', key, 'r:' .. ARGV[1], -tonumber(ARGV[i + 1]))
  if n <= 0 then redis.call('HDEL', key, 'r:' .. ARGV[1]) end
end
return #KEYS
"""

# This router's own count of each session, set outright (after a call whose outcome is unknown).
# KEYS: lru, then sessions of its bucket. ARGV: router id, ttl, then each session's count.
SET_COUNTS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #KEYS do
  local key = KEYS[i]
  local n = tonumber(ARGV[i + 1])
  if n > 0 then
    redis.call('HSET', key, 'r:' .. ARGV[1], n)
    redis.call('EXPIRE', key, ARGV[2])
    redis.call('ZADD', KEYS[1], 'NX', now, key)  -- indexed, so the cap sees it
  else
    redis.call('HDEL', key, 'r:' .. ARGV[1])
  end
end
return #KEYS - 1
"""

# KEYS: one bucket's routers. ARGV: router id, lease (ms).
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]) * 10)
return now
"""


class BucketKeys:
    """Key names of one key prefix, `buckets` buckets: the only place the store names keys."""

    def __init__(self, prefix: str, buckets: int) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError("the key prefix must not contain '{' or '}' (Redis Cluster hash tags)")
        if buckets < 1:
            raise ValueError("buckets must be at least 1")
        self.buckets = buckets
        self.tags = [f"{{{prefix}b{b}}}" for b in range(buckets)]
        self.routers = [tag + "routers" for tag in self.tags]
        self.lru = [tag + "lru" for tag in self.tags]

    def bucket(self, session: str) -> int:
        return zlib.crc32(session.encode("utf-8", "surrogatepass")) % self.buckets

    def session(self, session: str, bucket: int | None = None) -> str:
        return self.tags[self.bucket(session) if bucket is None else bucket] + "s:" + session

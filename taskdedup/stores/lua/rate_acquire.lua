-- rate_acquire: record one start under a per-key rate limit, a sliding-window log
-- (SPEC §16).
--
-- KEYS[1]  the start log of one limit and one key value: a ZSET of start id -> start time
--          (milliseconds on the server's clock, TIME); the only key touched (Cluster-safe)
-- ARGV[1]  member  this start's id (unique per execution)
-- ARGV[2]  limit   starts allowed in any window of per_ms (>= 1)
-- ARGV[3]  per_ms  the window in milliseconds (> 0)
--
-- A start at t counts in the windows that hold t: until t + per_ms.
-- Returns {1, starts in the window now}: allowed (recorded); or {0, ms until the oldest
-- start leaves the window}: refused, nothing written.

local key = KEYS[1]
local member, limit, per_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

redis.call('ZREMRANGEBYSCORE', key, '-inf', now - per_ms)
local count = redis.call('ZCARD', key)
if count < limit then
  redis.call('ZADD', key, now, member)
  redis.call('PEXPIRE', key, per_ms)
  return {1, count + 1}
end
local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
return {0, math.max(1, tonumber(first[2]) + per_ms - now)}

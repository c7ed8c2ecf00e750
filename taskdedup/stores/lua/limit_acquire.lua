-- limit_acquire: take one slot of a per-key concurrency limit (SPEC §16).
--
-- KEYS[1]  the slot set of one limit and one key value: a ZSET of holder -> lease expiry
--          (milliseconds on the server's clock, TIME); the only key touched (Cluster-safe)
-- ARGV[1]  holder    this execution's slot id (its task id and a token of its own)
-- ARGV[2]  limit     how many holders may hold a slot at once (>= 1)
-- ARGV[3]  lease_ms  how long the slot lives without a heartbeat (> 0)
--
-- Holders whose lease has passed are dropped first: a killed worker's slot frees itself.
-- Returns {1, holders now}: taken; or {0, ms until the earliest lease ends}: all taken.

local key = KEYS[1]
local holder, limit, lease_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local held = redis.call('ZCARD', key)
if redis.call('ZSCORE', key, holder) or held < limit then
  redis.call('ZADD', key, now + lease_ms, holder)
  if redis.call('PTTL', key) < lease_ms then
    redis.call('PEXPIRE', key, lease_ms)
  end
  return {1, redis.call('ZCARD', key)}
end
local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
return {0, math.max(1, tonumber(first[2]) - now)}

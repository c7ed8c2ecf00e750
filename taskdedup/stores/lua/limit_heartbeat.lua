-- limit_heartbeat: renew the lease of a concurrency slot while its body runs (SPEC §16).
--
-- KEYS[1]  the slot set (see limit_acquire.lua)
-- ARGV[1]  holder    the slot id the acquire took (compared as an exact string: fenced)
-- ARGV[2]  lease_ms  the new lease in milliseconds (> 0)
--
-- Returns an Outcome: 4 OK (renewed), 5 NOT_OWNER (the slot lapsed or was never this
-- holder's; a lapsed entry is removed, nothing else is written).

local key = KEYS[1]
local holder, lease_ms = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local score = redis.call('ZSCORE', key, holder)
if not score then
  return 5
end
if tonumber(score) <= now then
  redis.call('ZREM', key, holder)
  return 5
end
redis.call('ZADD', key, now + lease_ms, holder)
if redis.call('PTTL', key) < lease_ms then
  redis.call('PEXPIRE', key, lease_ms)
end
return 4

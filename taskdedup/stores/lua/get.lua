-- get: read one lock for tools (read-only; not a transition, never used for decisions).
--
-- KEYS[1]  the lock key of one task identity (the only key touched: Cluster-safe)
-- ARGV     none
--
-- Returns {value or false, pttl}: the raw value ("<state>|<check>|<owner>", parsed by the
-- caller) and PTTL in milliseconds (-1 no expiry, -2 absent). A key of another type gives
-- {false, pttl} with pttl >= -1, so the caller can tell it from an absent key.

local key = KEYS[1]
local value = read(key)
if type(value) ~= 'string' then
  value = false
end
return {value, redis.call('PTTL', key)}

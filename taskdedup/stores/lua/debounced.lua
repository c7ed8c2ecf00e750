-- debounced: the claim of a debounced call at the worker (SPEC §15), one script.
--
-- KEYS[1]  the lock key; KEYS[2] the debounce record (see debounce.lua)
-- ARGV[1]  owner     the call's id
-- ARGV[2]  lease_ms  lease of the running lock (> 0)
-- ARGV[3]  the generation the message carries
--
-- Returns {code, state or false, owner or false}:
--   2 DUPLICATE   this very id runs now (R: another copy, deferred) or already ran (D/F:
--                 a redelivery, it ends without a new outcome); or a foreign value
--   8 SUPERSEDED  a later call of the burst exists: this one ends without running
--   9 WAIT        the burst's last call while another id still runs the identity (a
--                 previous burst's run): put off until it ends
--   1 ACQUIRED    the burst's last call -> R(owner), whatever else held the lock (queued or
--                 done: a success window does not stop the next burst); the burst ends
-- A record that expired (a call older than its keep) counts as the last call's.

local owner, lease_ms = ARGV[1], ARGV[2]
local value = read(KEYS[1])
local state, _, held_owner = parse(value)
if state and state ~= 'Q' and same(held_owner, owner) then
  return {2, state, held_owner}
end
local record = redis.call('GET', KEYS[2])
local gen = nil
if record then
  gen = tonumber(string.match(record, '^(%d+)|'))
end
if gen and (tonumber(ARGV[3]) or 0) < gen then
  return {8, false, false}
end
if state == 'R' then
  return {9, 'R', held_owner}
end
if value and not state then
  return {2, false, false}
end
redis.call('SET', KEYS[1], 'R||' .. owner, 'PX', lease_ms)
if gen then
  redis.call('SET', KEYS[2], gen .. '|', 'KEEPTTL')
end
return {1, false, false}

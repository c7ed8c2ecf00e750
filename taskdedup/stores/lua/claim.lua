-- claim: a worker is about to run the body (SPEC §5).
--
-- KEYS[1]  the lock key of one task identity (the only key touched: Cluster-safe)
-- ARGV[1]  owner     the worker's task id (compared as an exact string)
-- ARGV[2]  lease_ms  lease of the running lock in milliseconds (> 0), renewed by heartbeat
-- ARGV[3]  approximate window only: the window argument (seen in _lib.lua); KEYS[2..] its
--          slice keys (same hash tag as KEYS[1]: one slot); a caller whose clock is off by
--          more than a slice is answered {0, the server's time in ms}, nothing written
--
-- Value: "<state>|<check>|<owner>", state one of Q (queued), R (running), D (done).
--
-- Returns {code, state or false, owner or false}; code is an Outcome:
--   1 ACQUIRED   absent (reservation expired, or never made) or another owner's F
--                tombstone -> R(owner) with an empty check; or owner's own Q -> R (check
--                kept); PX lease_ms either way
--   2 DUPLICATE  held by another owner in any state but F, or a value not written by
--                taskdedup (state and owner false); or held by this very owner: R (another
--                copy of this message runs now, its lease live: the caller defers this one),
--                D or F (a redelivery after success: it ends without a new outcome); the
--                state and owner found are returned; under an approximate window also an
--                absent lock whose identity a live slice remembers ('D', owner false)

local key = KEYS[1]
local owner, lease_ms = ARGV[1], ARGV[2]

local value = read(key)
local state, held_check, held_owner = parse(value)
if state == 'F' and held_owner ~= owner then
  value = false  -- another call's tombstone: the identity is free
end
if not value then
  local known = seen(ARGV[3], '')
  if known then
    return known
  end
  redis.call('SET', key, 'R||' .. owner, 'PX', lease_ms)
  return {1, false, false}
end

if not state then
  return {2, false, false}
end

if held_owner == owner and state == 'Q' then
  redis.call('SET', key, 'R|' .. held_check .. '|' .. owner, 'PX', lease_ms)
  return {1, false, false}
end
return {2, state, held_owner}

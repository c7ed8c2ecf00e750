-- reserve: the enqueue gate (SPEC §5).
--
-- KEYS[1]  the lock key of one task identity (the only key touched: Cluster-safe)
-- ARGV[1]  owner   the caller's task id (compared as an exact string)
-- ARGV[2]  ttl_ms  expiry of the reservation in milliseconds (> 0)
-- ARGV[3]  check   "" or the 32-hex digest of the arguments (explicit idempotency keys)
--
-- Value: "<state>|<check>|<owner>", state one of Q (queued), R (running), D (done).
--
-- Returns {code, state or false, owner or false}; code is an Outcome:
--   1 ACQUIRED   absent -> Q(owner) PX ttl_ms; or owner's own Q/R -> Q (check kept), expiry
--                max(current PTTL, ttl_ms) (a retry or a republish)
--   2 DUPLICATE  done by this owner (a redelivery after success), held by another owner,
--                or a value not written by taskdedup (state and owner false)
--   3 MISMATCH   held by another owner with a different non-empty check
-- For 2 and 3 the state and owner found are returned.

local key = KEYS[1]
local owner, ttl_ms, check = ARGV[1], ARGV[2], ARGV[3]

-- pcall: a key of another type (WRONGTYPE) is someone else's, not an error.
local value = redis.pcall('GET', key)
if not value then
  redis.call('SET', key, 'Q|' .. check .. '|' .. owner, 'PX', ttl_ms)
  return {1, false, false}
end

local state, held_check, held_owner = parse(value)
if not state then
  return {2, false, false}
end

if held_owner == owner then
  if state == 'D' then
    return {2, state, held_owner}
  end
  -- Never shorten: a retry re-reserving for its countdown keeps the longer expiry.
  -- PTTL -1 (no expiry, set by hand) gets ttl_ms: a lock never lives forever.
  local px = ttl_ms
  local pttl = redis.call('PTTL', key)
  if pttl > tonumber(ttl_ms) then
    px = pttl
  end
  redis.call('SET', key, 'Q|' .. held_check .. '|' .. owner, 'PX', px)
  return {1, false, false}
end

if check ~= '' and held_check ~= '' and check ~= held_check then
  return {3, state, held_owner}
end
return {2, state, held_owner}

-- replace: the enqueue gate with on_duplicate="replace" (debounce, SPEC §4/§5).
--
-- KEYS[1]  the lock key of one task identity (the only key touched: Cluster-safe)
-- ARGV[1]  owner   the caller's task id (compared as an exact string)
-- ARGV[2]  ttl_ms  expiry of the reservation in milliseconds (> 0)
-- ARGV[3]  check   "" or the 32-hex digest of the arguments (explicit idempotency keys)
--
-- Value: "<state>|<check>|<owner>", state one of Q (queued), R (running), D (done).
--
-- Returns {code, state or false, owner or false}; code is an Outcome:
--   1 ACQUIRED   as reserve: absent -> Q(owner) PX ttl_ms; owner's own Q/R -> Q (check
--                kept), expiry max(current PTTL, ttl_ms)
--   6 REPLACED   another owner's Q -> Q(owner, check) PX ttl_ms; returns 'Q' and the
--                displaced owner (the caller revokes it)
--   2 DUPLICATE  another owner's R or D (a started original cannot be replaced), done by
--                this owner, or a value not written by taskdedup (state and owner false)
--   3 MISMATCH   held by another owner with a different non-empty check (nothing written)

local key = KEYS[1]
local owner, ttl_ms, check = ARGV[1], ARGV[2], ARGV[3]

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
if state == 'Q' then
  redis.call('SET', key, 'Q|' .. check .. '|' .. owner, 'PX', ttl_ms)
  return {6, state, held_owner}
end
return {2, state, held_owner}

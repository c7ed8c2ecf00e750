-- Prepended to every transition script by RedisStore (Redis has no includes): the value
-- parser and the enqueue gate, shared by the scripts.
--
-- A lock value is "<state>|<check>|<owner>": state one of Q (queued), R (running),
-- D (done), F (finished: a short tombstone left by a success that releases the identity,
-- which only the owner's own copies see; to any other call it is absent); check "" or a
-- 32-hex digest of the arguments; owner the task id (any text).
-- parse(v) -> state, check, owner; or nil for anything taskdedup did not write
-- (another type, garbage), which every script treats as someone else's lock.

-- read(key): GET, where a key of another type (WRONGTYPE) is someone else's value (a table,
-- which parse() refuses), not an error; any other error (a missing ACL permission, OOM) is
-- raised, so it reaches the caller instead of looking like a foreign lock.
local function read(key)
  local value = redis.pcall('GET', key)
  if type(value) == 'table' and value.err and not string.find(value.err, '^WRONGTYPE') then
    error(value)
  end
  return value
end

local function parse(v)
  if type(v) ~= 'string' then return nil end
  local state, check, owner = string.match(v, '^([QRDF])|([0-9a-f]*)|(.+)$')
  if state == nil or (#check ~= 0 and #check ~= 32) then return nil end
  return state, check, owner
end

-- seen(positions): whether an approximate window (SPEC §12) remembers the identity: every
-- bit of positions ("p1,p2,...", from the identity's digest) is set in one of the live slice
-- bitmaps KEYS[2..] (current first; a missing slice reads as zeros). false when no window.
local function seen(positions)
  if positions == nil or positions == '' or #KEYS < 2 then
    return false
  end
  local bits = {}
  for p in string.gmatch(positions, '%d+') do
    bits[#bits + 1] = p
  end
  for i = 2, #KEYS do
    local hit = true
    for j = 1, #bits do
      if redis.call('GETBIT', KEYS[i], bits[j]) == 0 then
        hit = false
        break
      end
    end
    if hit then
      return true
    end
  end
  return false
end

-- gate(key, owner, ttl_ms, check, replace, fresh[, value[, positions]])
--   -> {code, state or false, owner or false}
-- (value: the key's value when the caller has read it already; false when absent;
-- positions: the identity's bits under an approximate window, its live slices in KEYS[2..]:
-- an absent lock whose identity a live slice remembers is DUPLICATE {2, 'D', false}, done
-- by an owner the filter does not know)
-- The enqueue gate shared by reserve.lua, replace.lua and enqueue.lua (their headers give the
-- codes): absent, or another owner's F -> Q(owner); the owner's own Q/R -> Q, expiry never
-- shortened (a retry or a republish of that message), unless the call is fresh (a new call
-- reusing an explicit id: a duplicate of itself); done or finished by the owner ->
-- DUPLICATE; another owner -> MISMATCH (checks differ), REPLACED (replace and Q) or
-- DUPLICATE.
local function gate(key, owner, ttl_ms, check, replace, fresh, value, positions)
  if value == nil then
    value = read(key)
  end
  local state, held_check, held_owner = parse(value)
  if state == 'F' and held_owner ~= owner then
    value = false  -- another call's tombstone: the identity is free
  end
  if not value then
    if seen(positions) then
      return {2, 'D', false}
    end
    redis.call('SET', key, 'Q|' .. check .. '|' .. owner, 'PX', ttl_ms)
    return {1, false, false}
  end
  if not state then
    return {2, false, false}
  end
  if held_owner == owner then
    if state == 'D' or state == 'F' or fresh then
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
  if replace and state == 'Q' then
    redis.call('SET', key, 'Q|' .. check .. '|' .. owner, 'PX', ttl_ms)
    return {6, state, held_owner}
  end
  return {2, state, held_owner}
end

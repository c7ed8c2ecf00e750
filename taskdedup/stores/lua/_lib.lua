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

-- owner_text(o): the task id an owner names. A compact owner ("~" and a UUID's 16 bytes in
-- 22 base64url characters, written by a store with compact owners) is that UUID's text; any
-- other owner is itself.
local function owner_text(o)
  if type(o) ~= 'string' or #o ~= 23 or string.byte(o, 1) ~= 126 then
    return o
  end
  local alphabet = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_'
  local digits = '0123456789abcdef'
  local hex, acc, bits = {}, 0, 0
  for i = 2, 23 do
    local v = string.find(alphabet, string.sub(o, i, i), 1, true)
    if not v then
      return o
    end
    acc, bits = acc * 64 + v - 1, bits + 6
    while bits >= 4 do
      bits = bits - 4
      local d = math.floor(acc / 2 ^ bits)
      acc = acc - d * 2 ^ bits
      hex[#hex + 1] = string.sub(digits, d + 1, d + 1)
    end
  end
  if hex[33] ~= '0' then
    return o  -- not the padding of 16 bytes: not a compact owner
  end
  local t = table.concat(hex, '', 1, 32)
  return string.sub(t, 1, 8) .. '-' .. string.sub(t, 9, 12) .. '-' .. string.sub(t, 13, 16)
    .. '-' .. string.sub(t, 17, 20) .. '-' .. string.sub(t, 21, 32)
end

-- same(a, b): whether two owners name one task id, whichever form each was written in (a
-- store that writes compact owners and one that writes text share every lock). Equal
-- strings, or a compact and a text owner of one UUID; only the second decodes anything.
local function same(a, b)
  if a == b then
    return true
  end
  if type(a) ~= 'string' or type(b) ~= 'string' or #a == #b then
    return false
  end
  return owner_text(a) == owner_text(b)
end

-- Approximate windows (SPEC §12). The server's clock (TIME) decides which slices are live,
-- which one is current and when a slice expires. A window argument is
-- "first:slice_ms:ttl_ms:m:k:slices:p1,p2,...": KEYS[2..] are the slice bitmaps of indices
-- first, first + 1, ... (a span around the caller's clock), of which the live ones are
-- current - slices .. current on the server's clock; p1,p2,... the identity's bit positions.

-- window(spec) -> w; or nil and the server's time (unix ms) when KEYS miss a live slice (the
-- caller's clock is off by more than a slice: it calls again with keys around that time).
-- w: spec, live (the live slice keys, current first), index (current), now, slice_ms,
-- slices, bits (the identity's positions); sizes(w) reads ttl_ms, m and k when needed.
local function window(spec)
  local first, slice_ms, slices, tail = string.match(spec,
    '^(%-?%d+):(%d+):%d+:%d+:%d+:(%d+):()')
  if not first then
    error('taskdedup: malformed window argument')
  end
  first, slice_ms, slices = tonumber(first), tonumber(slice_ms), tonumber(slices)
  -- Writes after TIME need scripts replicated by their effects: the default since Redis 5
  -- (the only mode since 7), so Redis 6.2 runs this as is.
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local current = math.floor(now / slice_ms)
  if current - slices < first or current > first + #KEYS - 2 then
    return nil, now
  end
  local live = {}
  for index = current, current - slices, -1 do
    live[#live + 1] = KEYS[2 + index - first]
  end
  local bits = {}
  for p in string.gmatch(string.sub(spec, tail), '%d+') do
    bits[#bits + 1] = p
  end
  return {spec = spec, live = live, index = current, now = now, slice_ms = slice_ms,
          slices = slices, bits = bits}
end

-- sizes(w) -> ttl_ms, m, k of the window w.
local function sizes(w)
  local ttl_ms, m, k = string.match(w.spec, '^%-?%d+:%d+:(%d+):(%d+):(%d+):')
  return tonumber(ttl_ms), tonumber(m), tonumber(k)
end

-- check_bits(w, check): the positions of the filter identity of this identity (the digest
-- ending KEYS[1]) and the argument digest check: the first 32 hex digits of
-- SHA-1("<digest>:<check>"), placed as Approximate.positions places a digest (enhanced
-- double hashing of its digits 9-20 and 21-32).
local function check_bits(w, check)
  local _, m, k = sizes(w)
  local hex = redis.sha1hex(string.sub(KEYS[1], -32) .. ':' .. check)
  local function number(from)
    return (tonumber(string.sub(hex, from, from + 5), 16) * 16777216
            + tonumber(string.sub(hex, from + 6, from + 11), 16)) % m
  end
  local x, y = number(9), number(21)
  local bits = {}
  for i = 1, k do
    bits[i] = x
    x = (x + y) % m
    y = (y + i) % m
  end
  return bits
end

-- held(w, bits): whether one live slice has every bit of bits set (a missing slice reads as
-- zeros).
local function held(w, bits)
  for i = 1, #w.live do
    local hit = true
    for j = 1, #bits do
      if redis.call('GETBIT', w.live[i], bits[j]) == 0 then
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

-- seen(spec, check) -> false, or the reply for an absent lock under an approximate window:
-- {2, 'D', false} DUPLICATE when a live slice remembers the identity (done by an owner the
-- filter does not know), {3, 'D', false} MISMATCH when check (an explicit key's argument
-- digest) is not remembered with it (SPEC §3), or {0, now} when the caller's slice keys miss
-- the server's clock (nothing written). false when there is no window (spec nil or '').
local function seen(spec, check)
  if spec == nil or spec == '' or #KEYS < 2 then
    return false
  end
  local w, now = window(spec)
  if not w then
    return {0, now}
  end
  if not held(w, w.bits) then
    return false
  end
  if check ~= nil and check ~= '' and not held(w, check_bits(w, check)) then
    return {3, 'D', false}
  end
  return {2, 'D', false}
end

-- claim(key, owner, lease_ms, value[, positions]) -> {code, state or false, owner or false}
-- The worker's claim shared by claim.lua (its header gives the codes) and follow_up.lua (a
-- message that is not the waiting follow-up's): value is the key's value as read() gave it;
-- positions the window argument under an approximate window (an absent lock is answered by
-- seen(positions, '')). Absent, or another owner's F -> R(owner); the owner's own Q -> R (its
-- check kept); anything else -> DUPLICATE with the state and owner found.
local function claim(key, owner, lease_ms, value, positions)
  local state, held_check, held_owner = parse(value)
  if state == 'F' and not same(held_owner, owner) then
    value = false  -- another call's tombstone: the identity is free
  end
  if not value then
    local known = seen(positions, '')
    if known then
      return known
    end
    redis.call('SET', key, 'R||' .. owner, 'PX', lease_ms)
    return {1, false, false}
  end
  if not state then
    return {2, false, false}
  end
  if state == 'Q' and same(held_owner, owner) then
    redis.call('SET', key, 'R|' .. held_check .. '|' .. owner, 'PX', lease_ms)
    return {1, false, false}
  end
  return {2, state, held_owner}
end

-- follow_up_record(key) -> generation, follow-up id: a coalesced identity's follow-up record
-- "<generation>|<id>" (see coalesce.lua); 0, '' when it is absent or not in that form.
local function follow_up_record(key)
  local record = redis.call('GET', key)
  if record then
    local g, id = string.match(record, '^(%d+)|(.*)$')
    if g then
      return tonumber(g), id
    end
  end
  return 0, ''
end

-- gate(key, owner, ttl_ms, check, replace, fresh[, value[, positions]])
--   -> {code, state or false, owner or false}
-- (value: the key's value when the caller has read it already; false when absent;
-- positions: the window argument under an approximate window, its slices in KEYS[2..]:
-- an absent lock is answered by seen(positions, check): DUPLICATE {2, 'D', false}, MISMATCH
-- {3, 'D', false}, or {0, server ms} for a caller whose clock is off by more than a slice)
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
  if state == 'F' and not same(held_owner, owner) then
    value = false  -- another call's tombstone: the identity is free
  end
  if not value then
    local known = seen(positions, check)
    if known then
      return known
    end
    redis.call('SET', key, 'Q|' .. check .. '|' .. owner, 'PX', ttl_ms)
    return {1, false, false}
  end
  if not state then
    return {2, false, false}
  end
  if same(held_owner, owner) then
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

-- complete: the body succeeded (SPEC §5, the extend step of until_expired).
--
-- KEYS[1]  the lock key of one task identity (the only key touched: Cluster-safe)
-- ARGV[1]  owner   the worker's task id (compared as an exact string)
-- ARGV[2]  ttl_ms  how long the DONE marker lives in milliseconds; 0 releases the identity:
--                  then, exact locks only, ARGV[3] finished_ms > 0 leaves F(owner) for that
--                  long (a tombstone only this owner's copies see: they end without running
--                  again), else the lock is deleted
-- Approximate window (SPEC §12) only: ARGV[2] is finished_ms (0: the lock is deleted);
-- KEYS[2..] the slice bitmaps of a span of indices
-- around the caller's clock (same hash tag as KEYS[1]: one slot); ARGV[3] the window argument
-- (seen in _lib.lua). The lock is deleted and the identity added instead to the current slice
-- on the server's clock (TIME), with, for a lock holding a check (an explicit key's argument
-- digest), the filter identity of the digest and its check (check_bits in _lib.lua). A new
-- slice is written whole at once (m/8 zero bytes and a 14-byte tail, so the string is
-- allocated at its size, not grown by doubling): after the m bits, identities added (u32 at
-- m), k (u8 at m+32), slices (u8 at m+40) and the first slice index still counted (i64 at
-- m+48: copied from the newest older live slice, else this index); it expires (PEXPIREAT, on
-- the server's clock) when its last identity is ttl old.
--
-- Value: "<state>|<check>|<owner>", state one of Q (queued), R (running), D (done).
--
-- Returns an Outcome:
--   4 OK         owner's own R -> D(owner, check kept) PX ttl_ms, or when ttl_ms is 0
--                F(owner) PX finished_ms or DEL;
--                under an approximate window {4, added, created, index}: the
--                identities the current slice holds now, 1 when this call created the
--                slice, and its index; {0, the server's time in ms} when the slice keys
--                miss the server's clock by more than a slice (nothing written: call again);
--                owner's own Q/D -> left as it is (a pending retry re-reserved it: the
--                retry must still run; or it already completed)
--   5 NOT_OWNER  absent (lost to expiry), another owner's, or not written by taskdedup;
--                nothing is written (a former owner never touches its successor's lock)

local key = KEYS[1]
local owner, ttl_ms = ARGV[1], ARGV[2]

local state, held_check, held_owner = parse(read(key))
if not state or not same(held_owner, owner) then
  return 5
end
if state ~= 'R' then
  return 4
end
if #KEYS > 1 then
  local w, now = window(ARGV[3])
  if not w then
    return {0, now}
  end
  local ttl_window, m, k = sizes(w)
  local slice = w.live[1]
  local created = 0
  if redis.call('EXISTS', slice) == 0 then
    local origin = w.index
    for i = 2, #w.live do
      if redis.call('EXISTS', w.live[i]) == 1 then
        origin = redis.call('BITFIELD', w.live[i], 'GET', 'i64', m + 48)[1]
        break
      end
    end
    redis.call('SET', slice, string.rep('\0', m / 8 + 14))
    redis.call('BITFIELD', slice, 'SET', 'u8', m + 32, k, 'SET', 'u8', m + 40, w.slices,
               'SET', 'i64', m + 48, origin)
    redis.call('PEXPIREAT', slice, (w.index + 1) * w.slice_ms + ttl_window)
    created = 1
  end
  local function add(bits)
    local new = false
    for i = 1, #bits do
      if redis.call('SETBIT', slice, bits[i], 1) == 0 then
        new = true
      end
    end
    if new then
      return redis.call('BITFIELD', slice, 'OVERFLOW', 'SAT', 'INCRBY', 'u32', m, 1)[1]
    end
    return redis.call('BITFIELD', slice, 'GET', 'u32', m)[1]
  end
  local added = add(w.bits)
  if held_check ~= '' then
    added = add(check_bits(w, held_check))
  end
  -- Last: a script that fails half-way keeps what it wrote, so an error above (OOM, a
  -- missing ACL permission) leaves the running lock (it lapses with its lease), never a
  -- deleted lock whose identity the filter does not hold. ARGV[2] > 0 here: leave the F
  -- tombstone for that long instead (the owner's own copies end without a new outcome).
  if tonumber(ttl_ms) > 0 then
    redis.call('SET', key, 'F|' .. held_check .. '|' .. owner, 'PX', ttl_ms)
  else
    redis.call('DEL', key)
  end
  return {4, added, created, w.index}
end
if tonumber(ttl_ms) > 0 then
  redis.call('SET', key, 'D|' .. held_check .. '|' .. owner, 'PX', ttl_ms)
elseif ARGV[3] and tonumber(ARGV[3]) > 0 then
  redis.call('SET', key, 'F|' .. held_check .. '|' .. owner, 'PX', ARGV[3])
else
  redis.call('DEL', key)
end
return 4

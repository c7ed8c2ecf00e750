-- complete: the body succeeded (SPEC §5, the extend step of until_expired).
--
-- KEYS[1]  the lock key of one task identity (the only key touched: Cluster-safe)
-- ARGV[1]  owner   the worker's task id (compared as an exact string)
-- ARGV[2]  ttl_ms  how long the DONE marker lives in milliseconds; 0 releases the identity:
--                  then, exact locks only, ARGV[3] finished_ms > 0 leaves F(owner) for that
--                  long (a tombstone only this owner's copies see: they end without running
--                  again), else the lock is deleted
-- Approximate window (SPEC §12) only: KEYS[2..] the live slice bitmaps, current first (same
-- hash tag as KEYS[1]: one slot); the lock is deleted and the identity added instead:
-- ARGV[3]  its bit positions "p1,p2,..."     ARGV[4]  the current slice's time index
-- ARGV[5]  when the slice expires (unix ms)  ARGV[6]  m, the bits of a slice (a multiple of 8)
-- ARGV[7]  k                                 ARGV[8]  slices
-- A new slice is written whole at once (m/8 zero bytes and a 14-byte tail, so the string is
-- allocated at its size, not grown by doubling): after the m bits, identities added (u32 at
-- m), k (u8 at m+32), slices (u8 at m+40) and the first slice index still counted (i64 at
-- m+48: copied from the newest older live slice, else this index).
--
-- Value: "<state>|<check>|<owner>", state one of Q (queued), R (running), D (done).
--
-- Returns an Outcome:
--   4 OK         owner's own R -> D(owner, check kept) PX ttl_ms, or when ttl_ms is 0
--                F(owner) PX finished_ms or DEL;
--                under an approximate window {4, added, created}: the identities the
--                current slice holds now, and 1 when this call created the slice;
--                owner's own Q/D -> left as it is (a pending retry re-reserved it: the
--                retry must still run; or it already completed)
--   5 NOT_OWNER  absent (lost to expiry), another owner's, or not written by taskdedup;
--                nothing is written (a former owner never touches its successor's lock)

local key = KEYS[1]
local owner, ttl_ms = ARGV[1], ARGV[2]

local state, held_check, held_owner = parse(read(key))
if not state or held_owner ~= owner then
  return 5
end
if state ~= 'R' then
  return 4
end
if #KEYS > 1 then
  local live = {unpack(KEYS, 2)}
  local slice, m = live[1], tonumber(ARGV[6])
  local created = 0
  if redis.call('EXISTS', slice) == 0 then
    local origin = ARGV[4]
    for i = 2, #live do
      if redis.call('EXISTS', live[i]) == 1 then
        origin = redis.call('BITFIELD', live[i], 'GET', 'i64', m + 48)[1]
        break
      end
    end
    redis.call('SET', slice, string.rep('\0', m / 8 + 14))
    redis.call('BITFIELD', slice, 'SET', 'u8', m + 32, ARGV[7], 'SET', 'u8', m + 40, ARGV[8],
               'SET', 'i64', m + 48, origin)
    redis.call('PEXPIREAT', slice, ARGV[5])
    created = 1
  end
  local new = false
  for p in string.gmatch(ARGV[3], '%d+') do
    if redis.call('SETBIT', slice, p, 1) == 0 then
      new = true
    end
  end
  local added
  if new then
    added = redis.call('BITFIELD', slice, 'OVERFLOW', 'SAT', 'INCRBY', 'u32', m, 1)[1]
  else
    added = redis.call('BITFIELD', slice, 'GET', 'u32', m)[1]
  end
  -- Last: a script that fails half-way keeps what it wrote, so an error above (OOM, a
  -- missing ACL permission) leaves the running lock (it lapses with its lease), never a
  -- deleted lock whose identity the filter does not hold.
  redis.call('DEL', key)
  return {4, added, created}
end
if tonumber(ttl_ms) > 0 then
  redis.call('SET', key, 'D|' .. held_check .. '|' .. owner, 'PX', ttl_ms)
elseif ARGV[3] and tonumber(ARGV[3]) > 0 then
  redis.call('SET', key, 'F|' .. held_check .. '|' .. owner, 'PX', ARGV[3])
else
  redis.call('DEL', key)
end
return 4

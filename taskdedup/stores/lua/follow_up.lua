-- follow_up: the claim of a coalesced follow-up's message at the worker (SPEC §15).
--
-- KEYS[1]  the lock key; KEYS[2] its follow-up record (see coalesce.lua)
-- ARGV[1]  owner     the follow-up's id
-- ARGV[2]  lease_ms  lease of the running lock (> 0)
-- ARGV[3]  the generation the message carries
-- ARGV[4]  ttl_ms    the record is kept at least this long while its follow-up waits
--
-- Returns {code, state or false, owner or false}:
--   1 ACQUIRED    the newest message of the waiting follow-up, and nothing runs the identity
--                 (absent, queued, done or finished by another id: the follow-up was promised
--                 a run, a success window does not stop it) -> R(owner); the record keeps
--                 its generation, its id cleared
--   8 SUPERSEDED  an older message of the follow-up (a newer one carries later arguments)
--   9 WAIT        the newest message, while another id runs the identity: put it off
--   2 DUPLICATE   as claim.lua for a message whose follow-up has claimed already (a copy:
--                 R by owner -> deferred; D/F by owner -> finished) or whose record is gone
--                 (and 1 ACQUIRED for Q by owner: its own retry, re-reserved)

local gen, next_id = follow_up_record(KEYS[2])
local owner, lease_ms = ARGV[1], ARGV[2]
local mine = tonumber(ARGV[3]) or 0
local value = read(KEYS[1])
local state, _, held_owner = parse(value)
if mine < gen and not (state and same(held_owner, owner)) then
  return {8, false, false}
end
if mine == gen and same(next_id, owner) then
  if state == 'R' and not same(held_owner, owner) then
    if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[4]) then
      redis.call('PEXPIRE', KEYS[2], ARGV[4])
    end
    return {9, 'R', held_owner}
  end
  if value and not state then
    return {2, false, false}
  end
  redis.call('SET', KEYS[1], 'R||' .. owner, 'PX', lease_ms)
  redis.call('SET', KEYS[2], gen .. '|', 'KEEPTTL')
  return {1, false, false}
end
return claim(KEYS[1], owner, lease_ms, value)  -- the plain claim (claim.lua)

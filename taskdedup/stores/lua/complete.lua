-- complete: the body succeeded (SPEC §5, the extend step of until_expired).
--
-- KEYS[1]  the lock key of one task identity (the only key touched: Cluster-safe)
-- ARGV[1]  owner   the worker's task id (compared as an exact string)
-- ARGV[2]  ttl_ms  how long the DONE marker lives in milliseconds; 0 deletes the lock
--
-- Value: "<state>|<check>|<owner>", state one of Q (queued), R (running), D (done).
--
-- Returns an Outcome:
--   4 OK         owner's own R -> D(owner, check kept) PX ttl_ms, or DEL when ttl_ms is 0;
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
if tonumber(ttl_ms) > 0 then
  redis.call('SET', key, 'D|' .. held_check .. '|' .. owner, 'PX', ttl_ms)
else
  redis.call('DEL', key)
end
return 4

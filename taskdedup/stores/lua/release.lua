-- release: final failure, revoke, replace, publish failure (SPEC §5): compare-and-delete.
--
-- KEYS[1]  the lock key of one task identity (the only key touched: Cluster-safe)
-- ARGV[1]  owner   the task id giving the lock up (compared as an exact string)
--
-- Value: "<state>|<check>|<owner>", state one of Q (queued), R (running), D (done).
--
-- Returns an Outcome:
--   4 OK         owner's own lock in any state -> DEL
--   5 NOT_OWNER  absent (lost to expiry), another owner's, or not written by taskdedup;
--                nothing is deleted

local key = KEYS[1]
local owner = ARGV[1]

local state, _, held_owner = parse(redis.pcall('GET', key))
if not state or held_owner ~= owner then
  return 5
end
redis.call('DEL', key)
return 4

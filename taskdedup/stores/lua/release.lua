-- release: final failure, revoke, replace, publish failure (SPEC §5): compare-and-delete.
--
-- KEYS[1]  the lock key of one task identity (the only key touched: Cluster-safe)
-- ARGV[1]  owner   the task id giving the lock up (compared as an exact string)
-- ARGV[2]  "Q" to release only a QUEUED lock (cancel of a job that has not started: a lock
--          its worker claimed meanwhile stays), "" for any state
--
-- Value: "<state>|<check>|<owner>", state one of Q (queued), R (running), D (done).
--
-- Returns an Outcome:
--   4 OK         owner's own lock (in state ARGV[2] when given) -> DEL
--   5 NOT_OWNER  absent (lost to expiry), another owner's, in another state than ARGV[2], or
--                not written by taskdedup; nothing is deleted

local key = KEYS[1]
local owner, only_state = ARGV[1], ARGV[2] or ''

local state, _, held_owner = parse(read(key))
if not state or not same(held_owner, owner) or (only_state ~= '' and state ~= only_state) then
  return 5
end
redis.call('DEL', key)
return 4

-- heartbeat: renew the lease of a running lock while the body runs (SPEC §5).
--
-- KEYS[1]  the lock key of one task identity (the only key touched: Cluster-safe)
-- ARGV[1]  owner     the worker's task id (compared as an exact string)
-- ARGV[2]  lease_ms  the new lease in milliseconds (> 0)
--
-- Value: "<state>|<check>|<owner>", state one of Q (queued), R (running), D (done).
--
-- Returns an Outcome:
--   4 OK         owner's own R -> PEXPIRE lease_ms; owner's own Q/D -> left as it is (a
--                retry re-reserved it, or it already completed)
--   5 NOT_OWNER  absent (the lease was lost), another owner's, or not written by taskdedup;
--                nothing is written

local key = KEYS[1]
local owner, lease_ms = ARGV[1], ARGV[2]

local state, _, held_owner = parse(read(key))
if not state or not same(held_owner, owner) then
  return 5
end
if state == 'R' then
  redis.call('PEXPIRE', key, lease_ms)
end
return 4

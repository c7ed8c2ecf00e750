-- reserve: the enqueue gate (SPEC §5).
--
-- KEYS[1]  the lock key of one task identity (the only key touched: Cluster-safe)
-- ARGV[1]  owner   the caller's task id (compared as an exact string)
-- ARGV[2]  ttl_ms  expiry of the reservation in milliseconds (> 0)
-- ARGV[3]  check   "" or the 32-hex digest of the arguments (explicit idempotency keys)
--
-- Value: "<state>|<check>|<owner>", state one of Q (queued), R (running), D (done).
--
-- Returns {code, state or false, owner or false}; code is an Outcome:
--   1 ACQUIRED   absent -> Q(owner) PX ttl_ms; or owner's own Q/R -> Q (check kept), expiry
--                max(current PTTL, ttl_ms) (a retry or a republish)
--   2 DUPLICATE  done by this owner (a redelivery after success), held by another owner,
--                or a value not written by taskdedup (state and owner false)
--   3 MISMATCH   held by another owner with a different non-empty check
-- For 2 and 3 the state and owner found are returned.

return gate(KEYS[1], ARGV[1], ARGV[2], ARGV[3], false)

-- replace: the enqueue gate with on_duplicate="replace" (debounce, SPEC §4/§5).
--
-- KEYS[1]  the lock key of one task identity (the only key touched: Cluster-safe)
-- ARGV[1]  owner   the caller's task id (compared as an exact string)
-- ARGV[2]  ttl_ms  expiry of the reservation in milliseconds (> 0)
-- ARGV[3]  check   "" or the 32-hex digest of the arguments (explicit idempotency keys)
--
-- Value: "<state>|<check>|<owner>", state one of Q (queued), R (running), D (done).
--
-- Returns {code, state or false, owner or false}; code is an Outcome:
--   1 ACQUIRED   as reserve: absent -> Q(owner) PX ttl_ms; owner's own Q/R -> Q (check
--                kept), expiry max(current PTTL, ttl_ms)
--   6 REPLACED   another owner's Q -> Q(owner, check) PX ttl_ms; returns 'Q' and the
--                displaced owner (the caller revokes it)
--   2 DUPLICATE  another owner's R or D (a started original cannot be replaced), done by
--                this owner, or a value not written by taskdedup (state and owner false)
--   3 MISMATCH   held by another owner with a different non-empty check (nothing written)

return gate(KEYS[1], ARGV[1], ARGV[2], ARGV[3], true)

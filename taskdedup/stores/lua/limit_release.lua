-- limit_release: give back a concurrency slot, or take back a rate limit's start (SPEC §16).
--
-- KEYS[1]  the slot set or the start log (a ZSET; see limit_acquire.lua, rate_acquire.lua)
-- ARGV[1]  holder  the member the acquire wrote (fenced: only that member is removed)
--
-- Returns an Outcome: 4 OK (removed), 5 NOT_OWNER (it was not there: lapsed, or never ours).

if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  return 4
end
return 5

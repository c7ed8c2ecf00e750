-- fetch: take the next message for one worker of the reliable fetch (SPEC §17) in one atomic
-- step: from the first non-empty source list, in kombu's BRPOP order, into that source's
-- processing list owned by the worker. Renews the worker's lease and registers it first, so
-- nothing lands in a processing list that nobody would put back.
--
-- KEYS[1]            the owner's lease          {prefix}:fetch:{owner}:lease
-- KEYS[2]            the registry of owners     {prefix}:fetch:owners (hash)
-- KEYS[3]            the owner's sources        {prefix}:fetch:{owner}:sources (set)
-- KEYS[4 .. 3+n]     the source lists, in the order to try (kombu's: priority lists first,
--                    queues in round-robin order)
-- KEYS[4+n .. 3+2n]  the processing list of each source, in the same order
-- ARGV[1]  lease_ms  the lease, in milliseconds (> 0)
-- ARGV[2]  owner     the owner's name (the registry's field)
-- ARGV[3]  entry     its registry entry (JSON), written when missing
--
-- kombu pushes with LPUSH and pops from the right: the oldest message is at the right. It moves
-- to the left of its processing list (the newest taken is leftmost).
--
-- Returns {i, message}: the message taken from the i-th source; or {0}: every source was empty,
-- and the first source is recorded among the owner's sources (a BLMOVE into its processing list
-- may follow, for less than the lease).

redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3])
local n = (#KEYS - 3) / 2
for i = 1, n do
  local message = redis.call('LMOVE', KEYS[3 + i], KEYS[3 + n + i], 'RIGHT', 'LEFT')
  if message then
    redis.call('SADD', KEYS[3], KEYS[3 + i])
    return {i, message}
  end
end
if n > 0 then
  redis.call('SADD', KEYS[3], KEYS[4])
end
return {0}

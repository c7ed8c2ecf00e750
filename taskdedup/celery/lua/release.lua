-- release: an owner of processing lists leaves (SPEC §17): its own warm shutdown, or a live
-- worker clearing an orphan whose lease lapsed. Whatever is left in its processing lists goes
-- back to the head of each source list, in order, and the owner leaves the registry.
--
-- KEYS[1]  the owner's lease
-- KEYS[2]  the registry of owners
-- KEYS[3]  the owner's sources (set)
-- KEYS[4], KEYS[5], ...  pairs: a processing list, then its source list (every member of the
--          sources set)
-- ARGV[1]  owner
-- ARGV[2]  '1': only if the lease has lapsed; '0': the owner itself
--
-- Returns the number of messages moved; -1: the lease is alive, nothing was done; -2: the
-- sources set names a list that was not given (read it again), nothing was unregistered.

if ARGV[2] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then
  return -1
end
local given = {}
local moved = 0
for i = 4, #KEYS - 1, 2 do
  given[KEYS[i + 1]] = true
  while redis.call('LMOVE', KEYS[i], KEYS[i + 1], 'LEFT', 'RIGHT') do
    moved = moved + 1
  end
end
for _, source in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  if not given[source] then
    return -2
  end
end
redis.call('DEL', KEYS[3], KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return moved

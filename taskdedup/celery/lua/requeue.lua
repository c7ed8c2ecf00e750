-- requeue: put held messages back at the head of their source list (SPEC §17): a reject with
-- requeue, a warm shutdown, or a live worker putting back an orphan's messages. Each message
-- moves only if it is still in the processing list, so two callers never requeue one twice.
--
-- KEYS[1]  the processing list
-- KEYS[2]  its source list
-- KEYS[3]  the owner's lease
-- ARGV[1]  '1': only if the owner's lease has lapsed (a live worker requeues an orphan's
--          messages); '0': the owner itself
-- ARGV[2], ARGV[3], ...  pairs: the message as held (removed with LREM from the head, where the
--          newest are), then the message to push (kombu's restore marks it redelivered). Pairs
--          come newest first: the oldest is pushed last, to the right, where kombu pops next.
--
-- Returns the number of messages moved, or -1: the owner's lease is alive, nothing was moved.

if ARGV[1] == '1' and redis.call('EXISTS', KEYS[3]) == 1 then
  return -1
end
local moved = 0
for i = 2, #ARGV - 1, 2 do
  if redis.call('LREM', KEYS[1], 1, ARGV[i]) > 0 then
    redis.call('RPUSH', KEYS[2], ARGV[i + 1])
    moved = moved + 1
  end
end
return moved

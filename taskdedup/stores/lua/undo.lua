-- undo: take back the generation a publish's script gave a call whose message could not be
-- published (SPEC §15: coalesce.lua / enqueue.lua's coalesce, debounce.lua), so the earlier
-- messages of its follow-up or burst are not superseded by a message that does not exist.
--
-- KEYS[1]  the follow-up or debounce record ("<generation>|<rest>")
-- ARGV[1]  the generation given to the failed call
-- ARGV[2]  "1": the failed call created the follow-up (its id is the record's rest): the
--          record goes back to "<generation - 1>|" (no follow-up waiting); else "0"
--
-- Only when the record still holds that generation (a later call moved it on: its message
-- carries the later one, nothing to take back). Returns 1 when taken back, else 0.

local record = redis.call('GET', KEYS[1])
if not record then
  return 0
end
local gen, rest = string.match(record, '^(%d+)|(.*)$')
if not gen or gen ~= ARGV[1] then
  return 0
end
local before = tonumber(gen) - 1
if ARGV[2] == '1' then
  rest = ''
end
if before <= 0 and rest == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], before .. '|' .. rest, 'KEEPTTL')
end
return 1

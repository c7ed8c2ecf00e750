-- coalesce: the enqueue gate with on_duplicate="coalesce" (SPEC §15), one script.
--
-- KEYS[1]  the lock key of one task identity
-- KEYS[2]  its follow-up record, "<prefix>:next:{<lock key>}" (the lock key is its hash tag:
--          one slot, Cluster-safe)
-- ARGV[1]  owner   the caller's new task / job id (compared as an exact string)
-- ARGV[2]  ttl_ms  expiry of a reservation, and of the follow-up record (> 0)
-- ARGV[3]  check   "" or the 32-hex digest of the arguments (explicit idempotency keys)
-- ARGV[4]  "1" for a fresh call, else "0"
--
-- Follow-up record: "<generation>|<follow-up id>", the id "" once that follow-up has claimed
-- (the generation is kept, so older messages of it stay recognisable). No argument value is
-- stored: the latest arguments travel in the follow-up's newest message.
--
-- Returns {code, state or false, owner or false[, generation]}:
--   7 COALESCED  a follow-up waits (any state of the lock): the call joins it (generation
--                bumped, 'N', its id); or the lock is running by another id: this call's id
--                becomes the follow-up (generation bumped, 'R', this id). The caller
--                publishes its message under that id, carrying that generation.
--   else         the codes of reserve.lua (a queued original: 2 DUPLICATE, 'Q', its id).

local gen, next_id = follow_up_record(KEYS[2])
local keep = tonumber(ARGV[2])
if next_id ~= '' then
  gen = gen + 1
  local pttl = redis.call('PTTL', KEYS[2])
  if pttl > keep then keep = pttl end
  redis.call('SET', KEYS[2], gen .. '|' .. next_id, 'PX', keep)
  return {7, 'N', next_id, gen}
end
local value = read(KEYS[1])
local state, _, held_owner = parse(value)
if state == 'R' and not same(held_owner, ARGV[1]) then
  gen = gen + 1
  redis.call('SET', KEYS[2], gen .. '|' .. ARGV[1], 'PX', keep)
  return {7, 'R', ARGV[1], gen}
end
return gate(KEYS[1], ARGV[1], ARGV[2], ARGV[3], false, ARGV[4] == '1', value)

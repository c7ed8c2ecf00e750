-- publish: the enqueue gate and the broker's push in one script, one round trip (SPEC §10)
-- for a Celery broker on the same Redis (taskdedup.celery.RedisTransport).
--
-- KEYS[1]  the lock key of one task identity
-- KEYS[2]  the broker's list for the message (kombu's queue key, priority applied)
-- ARGV[1]  owner    the task id (compared as an exact string)
-- ARGV[2]  ttl_ms   expiry of the reservation in milliseconds (> 0)
-- ARGV[3]  check    "" or the 32-hex digest of the arguments (explicit idempotency keys)
-- ARGV[4]  "1" for on_duplicate="replace", else "0"
-- ARGV[5]  the serialized message, LPUSHed as kombu does only when the gate lets it through
--
-- Two keys: the broker is one Redis server (kombu's Redis transport has no Cluster mode).
-- Returns {code, state or false, owner or false}: the codes of reserve.lua / replace.lua.
-- The message is pushed for 1 ACQUIRED and 6 REPLACED, never for 2 DUPLICATE or 3 MISMATCH:
-- there is no moment where the message is queued without its reservation, or the other way.

local result = gate(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4] == '1')
if result[1] == 1 or result[1] == 6 then
  redis.call('LPUSH', KEYS[2], ARGV[5])
end
return result

-- debounce: the publish of a debounced call (SPEC §15): its generation and its countdown.
--
-- KEYS[1]  the identity's debounce record, "<prefix>:debounce:{<lock key>}"
-- ARGV[1]  wait_ms      quiet after the burst's last call
-- ARGV[2]  max_wait_ms  0, or the longest a burst waits from its first call
-- ARGV[3]  keep_ms      how long the record outlives the call's countdown (the policy's ttl)
--
-- Record: "<generation>|<burst start, server ms, or ''>"; the start is cleared when the
-- burst's run claims (the next call starts a new burst). No argument value is stored.
-- Returns {generation, countdown_ms}: the call's message carries the generation and is due
-- in countdown_ms (wait, or less: what is left of max_wait since the burst's first call).
-- The server's clock decides (TIME; scripts replicate by effects since Redis 5).

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gen, start = 0, nil
local record = redis.call('GET', KEYS[1])
if record then
  local g, s = string.match(record, '^(%d+)|(%d*)$')
  if g then
    gen = tonumber(g)
    if s ~= '' then start = tonumber(s) end
  end
end
gen = gen + 1
if not start then start = now end
local delay = tonumber(ARGV[1])
local most = tonumber(ARGV[2])
if most > 0 then
  local left = start + most - now
  if left < delay then delay = left end
  if delay < 0 then delay = 0 end
end
redis.call('SET', KEYS[1], gen .. '|' .. start, 'PX', delay + tonumber(ARGV[3]))
return {gen, delay}

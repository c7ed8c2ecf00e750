-- enqueue: the enqueue gate and the framework's own enqueue commands in one script, one round
-- trip (SPEC §10), for a broker on the same Redis: Celery's push (taskdedup.celery.
-- RedisTransport) or RQ's job write + push (taskdedup.rq.DedupQueue).
--
-- KEYS[1]  the lock key of one task identity
-- ARGV[1]  owner    the task / job id (compared as an exact string)
-- ARGV[2]  ttl_ms   expiry of the reservation in milliseconds (> 0)
-- ARGV[3]  check    "" or the 32-hex digest of the arguments (explicit idempotency keys)
-- ARGV[4]  flags: "1" for on_duplicate="replace", else "0"; then "1" for a fresh call (not a
--          retry or republish of the owner's message: the owner's own lock is a duplicate
--          of itself), else "0" or nothing; then "1" for on_duplicate="coalesce" (SPEC §15),
--          KEYS[2] then being the follow-up record: a call that joins a waiting follow-up
--          or finds the lock running by another id is answered as coalesce.lua answers
--          ({7, 'N' or 'R', the follow-up's id, its generation}) and runs no command (the
--          caller publishes the follow-up's message, which carries the generation); then
--          "1" for a guarded call (RQ's explicit job id; ARGV[5] a job hash prefix): a job
--          peek .. owner that exists and has not ended makes the call a duplicate of that
--          very job, answered {8, false, owner, HGETALL of its hash} before any gate or
--          command runs (what an HGET of its status before the call would have decided)
-- ARGV[5]  peek     "" or a key prefix of job hashes (RQ's "rq:job:"): on a duplicate the
--                   reply also carries HGETALL of peek .. holder (the original job's handle);
--                   and a call whose own job is already written and alive (a client retry
--                   after a lost reply re-sends the same call) runs no command again;
--                   or "=" for a call sent again (kombu's publish retry after a connection
--                   error): a queued lock of this very owner means the first script ran,
--                   so the call is accepted and runs no command again (a retry published
--                   by the worker finds its lock running, R, and pushes)
-- ARGV[6]  "" or, under an approximate window (SPEC §12), the window argument (seen in
--          _lib.lua); its slice keys are then KEYS[2..] (a remembered identity: 2 DUPLICATE or
--          3 MISMATCH, 'D'; {0, server ms} for keys off the server's clock: no command ran)
-- ARGV[7…] the enqueue commands, each as its argument count then its arguments, run in order
--          only when the gate lets the call through
--
-- The commands name keys of the broker (its queue, the job hash) that are not in KEYS: the
-- broker is one Redis server (neither kombu's Redis transport nor RQ has a Cluster mode).
-- Returns {code, state or false, owner or false, peeked hash or false}; the codes of
-- reserve.lua / replace.lua (and 7 / 8 above). The commands run for 1 ACQUIRED and 6 REPLACED, never for
-- 2 DUPLICATE or 3 MISMATCH: no moment where the job is queued without its reservation, or
-- the other way. A command that fails deletes the reservation this call made and raises the
-- error: the caller is told nothing was enqueued, and no lock is left behind.

local DEAD = {finished = true, failed = true, stopped = true, canceled = true}

if string.sub(ARGV[4], 4, 4) == '1' then
  local job = ARGV[5] .. owner_text(ARGV[1])
  local status = redis.call('HGET', job, 'status')
  if status and not DEAD[status] then
    return {8, false, ARGV[1], redis.call('HGETALL', job)}
  end
end

local value = read(KEYS[1])
local resent = ARGV[5] == '='
if ARGV[5] ~= '' then
  local held_state, _, held_owner = parse(value)
  if same(held_owner, ARGV[1]) then
    if resent then
      if held_state == 'Q' then
        return {1, false, false}  -- this very call, sent again: its push is queued
      end
    else
      local status = redis.call('HGET', ARGV[5] .. owner_text(ARGV[1]), 'status')
      if status and not DEAD[status] then
        return {1, false, false}  -- this very call, sent again: the lock and the job are there
      end
    end
  end
end
if string.sub(ARGV[4], 3, 3) == '1' then
  local gen, next_id = follow_up_record(KEYS[2])
  local held_state, _, held_owner = parse(value)
  if next_id == '' and held_state == 'R' and not same(held_owner, ARGV[1]) then
    next_id = ARGV[1]
  end
  if next_id ~= '' then
    local keep = tonumber(ARGV[2])
    local pttl = redis.call('PTTL', KEYS[2])
    if not same(next_id, ARGV[1]) and pttl > keep then keep = pttl end
    redis.call('SET', KEYS[2], (gen + 1) .. '|' .. next_id, 'PX', keep)
    return {7, same(next_id, ARGV[1]) and 'R' or 'N', next_id, gen + 1}
  end
end
local result = gate(KEYS[1], ARGV[1], ARGV[2], ARGV[3], string.sub(ARGV[4], 1, 1) == '1',
                    string.sub(ARGV[4], 2, 2) == '1', value, ARGV[6])
local code = result[1]
if code == 1 or code == 6 then
  local i = 7
  while i <= #ARGV do
    local n = tonumber(ARGV[i])
    local reply = redis.pcall(unpack(ARGV, i + 1, i + n))
    if type(reply) == 'table' and reply.err then
      local _, _, owner = parse(redis.call('GET', KEYS[1]))
      if same(owner, ARGV[1]) then
        redis.call('DEL', KEYS[1])
      end
      return redis.error_reply(reply.err)
    end
    i = i + n + 1
  end
elseif code == 2 and ARGV[5] ~= '' and not resent and result[3] then
  result[4] = redis.call('HGETALL', ARGV[5] .. owner_text(result[3]))
end
return result

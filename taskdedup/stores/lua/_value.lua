-- Prepended to every transition script by RedisStore (Redis has no includes).
--
-- A lock value is "<state>|<check>|<owner>": state one of Q (queued), R (running),
-- D (done); check "" or a 32-hex digest of the arguments; owner the task id (any text).
-- parse(v) -> state, check, owner; or nil for anything taskdedup did not write
-- (another type, garbage), which every script treats as someone else's lock.

local function parse(v)
  if type(v) ~= 'string' then return nil end
  local state, check, owner = string.match(v, '^([QRD])|([0-9a-f]*)|(.+)$')
  if state == nil or (#check ~= 0 and #check ~= 32) then return nil end
  return state, check, owner
end


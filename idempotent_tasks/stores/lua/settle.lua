-- The completed claim of this owner (one execution attempt) settles the message it owes (see
-- claim.lua): whether it still owes it, the debt cleared in the same step (its caller
-- publishes it now). take.lua clears the debt when the guard publishes that message instead.
-- KEYS[1]  record hash
-- ARGV[1]  owner id
-- Returns  1 if it owed the message, else 0
local found = redis.call('HMGET', KEYS[1], 'status', 'owner', 'owes_message')
if found[1] ~= 'completed' or found[2] ~= ARGV[1] or found[3] ~= '1' then
  return 0
end
redis.call('HDEL', KEYS[1], 'owes_message')
return 1

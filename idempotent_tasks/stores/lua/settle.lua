-- The claim of this owner (one execution attempt), completed or still held, settles the message
-- it owes (see claim.lua): whether it still owes it, the debt cleared in the same step (its
-- caller publishes it now: the key completed, or the claim about to be given up for a later
-- message of its call, whose release keeps that message in place of the one owed). take.lua
-- clears the debt when the guard publishes that message instead.
-- KEYS[1]  record hash
-- ARGV[1]  owner id
-- ARGV[2]  id of this settlement: the debt is cleared to it, so that the same script sent
--          again (redis-py re-sends a command whose reply was lost) answers 1 again, while
--          another settlement answers 0
-- Returns  1 if it owed the message, else 0
local found = redis.call('HMGET', KEYS[1], 'status', 'owner', 'owes_message')
if (found[1] ~= 'completed' and found[1] ~= 'processing') or found[2] ~= ARGV[1] then
  return 0
end
if found[3] == 'settled:' .. ARGV[2] then
  return 1
end
if found[3] ~= '1' then
  return 0
end
redis.call('HSET', KEYS[1], 'owes_message', 'settled:' .. ARGV[2])
return 1

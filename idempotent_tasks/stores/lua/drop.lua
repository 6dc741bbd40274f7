-- The call holding this key was terminated on purpose: forget the copy of its message kept for
-- the pickup guard, so it is never published again. The claim itself stays until its lease ends.
-- KEYS[1]  record hash       KEYS[2]  due index of the record's shard
-- ARGV[1]  task id           ARGV[2]  storage key (index member)
-- Only the call's own message goes: one this call took the key from stays (see claim.lua).
-- A completed record keeping this call's message (see complete.lua) forgets it too.
-- Returns  1 if the record is processing for this task id, or was keeping its message, else 0
local found = redis.call('HMGET', KEYS[1], 'status', 'task_id', 'envelope_of')
if found[1] == 'completed' and found[3] == ARGV[1]
    and redis.call('HEXISTS', KEYS[1], 'envelope') == 1 then
  redis.call('HDEL', KEYS[1], 'envelope', 'envelope_of', 'pickup_timeout', 'republished',
    'due_at')
  redis.call('ZREM', KEYS[2], ARGV[2])
  return 1
end
if found[1] ~= 'processing' then
  return 0
end
if (found[3] or found[2]) == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'envelope', 'envelope_of', 'owes_message', 'pickup_timeout',
    'republished', 'due_at')
  redis.call('ZREM', KEYS[2], ARGV[2])
  return 1
end
return found[2] == ARGV[1] and 1 or 0

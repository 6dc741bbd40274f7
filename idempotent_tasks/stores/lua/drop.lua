-- The call holding this key was terminated on purpose: forget the copy of its message kept for
-- the pickup guard, so it is never published again. The claim itself stays until its lease ends.
-- KEYS[1]  record hash       KEYS[2]  due index of the record's shard
-- ARGV[1]  task id           ARGV[2]  storage key (index member)
-- Returns  1 if a processing record of this task id had its pickup dropped, else 0
local found = redis.call('HMGET', KEYS[1], 'status', 'task_id')
if found[1] ~= 'processing' or found[2] ~= ARGV[1] then
  return 0
end
redis.call('HDEL', KEYS[1], 'envelope', 'pickup_timeout', 'republished', 'due_at')
redis.call('ZREM', KEYS[2], ARGV[2])
return 1

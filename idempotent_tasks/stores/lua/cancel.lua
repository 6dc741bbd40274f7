-- Delete a queued record reserved for this task id (its message could not be published), or
-- the pickup a completed record keeps for it (see complete.lua).
-- KEYS[1]  record hash       KEYS[2]  due index of the record's shard
-- ARGV[1]  task id           ARGV[2]  storage key (index member)
-- Returns  1 if deleted, else 0
local found = redis.call('HMGET', KEYS[1], 'status', 'task_id', 'envelope_of')
if found[1] == 'queued' and found[2] == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[2])
  return 1
end
if found[1] == 'completed' and found[3] == ARGV[1]
    and redis.call('HEXISTS', KEYS[1], 'envelope') == 1 then
  redis.call('HDEL', KEYS[1], 'envelope', 'envelope_of', 'pickup_timeout', 'republished',
    'due_at')
  redis.call('ZREM', KEYS[2], ARGV[2])
  return 1
end
return 0

-- Take a queued key whose message counts as lost, and move its due time on (backoff).
-- KEYS[1]  record hash       KEYS[2]  due index of the record's shard
-- ARGV[1]  storage key (index member)
-- Returns  {task id, task name, envelope, republished} when taken, else nil; a key no longer
--          queued leaves the index
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local found = redis.call('HMGET', KEYS[1], 'status', 'lease_expires_at', 'pickup_timeout',
  'republished', 'envelope', 'task_id', 'task_name')
if found[1] ~= 'queued' or not found[5] then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return nil
end
local due = tonumber(found[2])
if due > now then
  redis.call('ZADD', KEYS[2], due, ARGV[1])
  return nil
end
local republished = tonumber(found[4]) + 1
local next_due = now + tonumber(found[3]) * 2 ^ math.min(republished, 20)
redis.call('HSET', KEYS[1], 'lease_expires_at', next_due, 'republished', republished,
  'updated_at', now)
redis.call('ZADD', KEYS[2], next_due, ARGV[1])
return {found[6], found[7], found[5], republished}

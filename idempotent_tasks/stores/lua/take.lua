-- Take a key whose message counts as lost, and move its due time on (backoff): a queued key
-- past its due time, or a claimed one whose owner's lease ended a re-publication timeout ago
-- (the owner died and no redelivery took the key over: its message was lost too).
-- KEYS[1]  record hash       KEYS[2]  due index of the record's shard
-- ARGV[1]  storage key (index member)
-- Returns  {task id, task name, envelope, republished} when taken, else nil; a key neither
--          queued nor processing (or without a pickup) leaves the index
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local found = redis.call('HMGET', KEYS[1], 'status', 'lease_expires_at', 'pickup_timeout',
  'republished', 'envelope', 'task_id', 'task_name', 'due_at')
local status = found[1]
if (status ~= 'queued' and status ~= 'processing') or not found[5] then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return nil
end
local timeout = tonumber(found[3])
local due = tonumber(found[8] or found[2])
if status == 'processing' then
  due = math.max(due, tonumber(found[2]) + timeout)
end
if due > now then
  redis.call('ZADD', KEYS[2], due, ARGV[1])
  return nil
end
local republished = tonumber(found[4] or 0) + 1
local next_due = now + timeout * 2 ^ math.min(republished, 20)
redis.call('HSET', KEYS[1], 'due_at', next_due, 'republished', republished, 'updated_at', now)
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'lease_expires_at', next_due)
end
redis.call('ZADD', KEYS[2], next_due, ARGV[1])
return {found[6], found[7], found[5], republished}

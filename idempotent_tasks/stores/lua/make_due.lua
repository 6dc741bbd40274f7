-- Make the queued record reserved for this task id due at once: its message could not be
-- published, and the pickup guard is to publish it when it next looks. A processing record
-- keeping this task id's message (a dead owner's, taken for that lost message) has only its
-- pickup made due: its owner's lease still decides, in take.lua, when the message counts as
-- lost. When that message is another call's (the one the owner took the key from), the owner
-- owes it again, alive or not (take.lua cleared that debt as the guard took it): should the
-- owner complete before the guard's next try, it publishes the message itself (settle.lua).
-- A completed record keeping this task id's message (see complete.lua) has its pickup made due.
-- KEYS[1]  record hash       KEYS[2]  due index of the record's shard
-- ARGV[1]  task id           ARGV[2]  storage key (index member)
-- ARGV[3]  count of re-publications to set back to ("" to leave it)
-- Returns  1 if made due, else 0
local found = redis.call('HMGET', KEYS[1], 'status', 'task_id', 'envelope', 'lease_expires_at',
  'envelope_of')
-- The envelope's own call (see claim.lua); a completed record may keep another call's (see
-- complete.lua).
local kept = found[1] == 'completed' and found[5]
if (found[1] ~= 'queued' and found[1] ~= 'processing' and not kept)
    or (found[5] or found[2]) ~= ARGV[1] or not found[3] then
  return 0
end
local clock = redis.call('TIME')
local now = int(tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000))
if found[1] == 'processing' and found[5] then
  redis.call('HSET', KEYS[1], 'owes_message', '1')
end
if found[1] == 'processing' and (tonumber(found[4]) or 0) > tonumber(now) then
  return 0  -- its owner is alive (it renewed its lease since)
end
redis.call('HSET', KEYS[1], 'due_at', now, 'updated_at', now)
if found[1] == 'queued' then
  redis.call('HSET', KEYS[1], 'lease_expires_at', now)
end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'republished', ARGV[3])
end
redis.call('ZADD', KEYS[2], now, ARGV[2])
return 1

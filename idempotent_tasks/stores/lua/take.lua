-- Take a key whose message counts as lost, and move its due time on (backoff): a queued key
-- past its due time, a claimed one whose owner's lease ended a re-publication timeout ago
-- (the owner died and no redelivery took the key over: its message was lost too), or a
-- completed one keeping another call's message (see complete.lua) past its due time.
-- KEYS[1]  record hash       KEYS[2]  due index of the record's shard
-- ARGV[1]  storage key (index member)
-- ARGV[2]  re-publication timeout, ms, for a record whose own cannot be read
-- ARGV[3]  id of this take, kept in the record: the same script sent again (redis-py re-sends
--          a command whose reply was lost) answers as the first time, not nil
-- Returns  {task id, task name, envelope, republished} when taken, else nil; a key neither
--          queued nor processing nor keeping a message (or without a pickup, or not a record at
--          all) leaves the index; the task id is that of the envelope's own call (see
--          claim.lua), not always the owner's
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local found = redis.pcall('HMGET', KEYS[1], 'status', 'lease_expires_at', 'pickup_timeout',
  'republished', 'envelope', 'task_id', 'task_name', 'due_at', 'envelope_of', 'taken_by')
-- A key holding something else than a record (an error reply) protects nothing either.
local status = found.err == nil and found[1]
local kept = status == 'completed' and found[9]
-- Without its task id or name (a corrupt record) the message cannot be sent again either.
if (status ~= 'queued' and status ~= 'processing' and not kept) or not found[5] or not found[6]
    or not found[7] then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return nil
end
if found[10] == ARGV[3] then
  return {found[9] or found[6], found[7], found[5], tonumber(found[4])}
end
-- A number that cannot be read (a corrupt record) makes the message due now, not lost: as
-- with an unreadable lease in the claim, it protects nothing.
local function readable(value, low, high)
  local n = tonumber(value)
  if n and n >= low and n <= high then return n end  -- false for NaN too
  return nil
end
local timeout = readable(found[3], 1, 2 ^ 50) or tonumber(ARGV[2])
local lease_end = readable(found[2], 0, 2 ^ 53) or 0
local due = readable(found[8], 0, 2 ^ 53) or lease_end
if status == 'processing' then
  due = math.max(due, lease_end + timeout)
end
if due > now then
  redis.call('ZADD', KEYS[2], int(due), ARGV[1])
  return nil
end
local republished = (readable(found[4], 0, 2 ^ 40) or 0) + 1
local next_due = int(math.min(now + timeout * 2 ^ math.min(republished, 20), 2 ^ 53))
redis.call('HSET', KEYS[1], 'due_at', next_due, 'republished', int(republished),
  'updated_at', int(now), 'pickup_timeout', int(timeout), 'taken_by', ARGV[3])
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'lease_expires_at', next_due)
elseif status == 'processing' then
  redis.call('HDEL', KEYS[1], 'owes_message')  -- the guard publishes it: no owner owes it now
end
redis.call('ZADD', KEYS[2], next_due, ARGV[1])
return {found[9] or found[6], found[7], found[5], republished}

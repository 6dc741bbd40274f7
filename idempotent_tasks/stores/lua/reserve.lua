-- Reserve a key for a message about to be published, unless the key has a record already.
-- KEYS[1]  record hash
-- KEYS[2]  due index of the record's shard (sorted set: storage key -> due time)
-- ARGV[1]  task id          ARGV[2]  fingerprint       ARGV[3]  the caller's key
-- ARGV[4]  task name        ARGV[5]  due in, ms        ARGV[6]  re-publication timeout, ms
-- ARGV[7]  how long the record outlives its due time, ms
-- ARGV[8]  envelope         ARGV[9]  storage key (index member)
-- With a message to publish in the same step (the broker is this Redis server):
-- KEYS[3]  the broker's list (queue) to push it on, in database ARGV[11] ('': the store's)
-- ARGV[10] the message, as the broker's transport encodes it
-- Returns  0 when reserved (status "queued", the message pushed), else {now in ms, field,
--          value, ...}: the time and the record found (the message not pushed)
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

if redis.call('HGET', KEYS[1], 'status') then
  local reply = redis.call('HGETALL', KEYS[1])
  table.insert(reply, 1, now)
  return reply
end
-- No record, or a corrupt one without a status (it protects nothing).
redis.call('DEL', KEYS[1])
local due_in = tonumber(ARGV[5])
local ttl = tonumber(ARGV[7])
local now_s, due_at = int(now), int(now + due_in)
redis.call('HSET', KEYS[1],
  'status', 'queued', 'owner', '', 'token', '0', 'task_id', ARGV[1], 'fingerprint', ARGV[2],
  'key', ARGV[3], 'task_name', ARGV[4], 'lease_expires_at', due_at, 'created_at', now_s,
  'updated_at', now_s, 'expires_at', int(now + due_in + ttl), 'envelope', ARGV[8],
  'pickup_timeout', ARGV[6], 'republished', '0', 'due_at', due_at)
redis.call('PEXPIRE', KEYS[1], int(due_in + ttl))
redis.call('ZADD', KEYS[2], due_at, ARGV[9])
if KEYS[3] then
  -- Last: were the push refused, the reservation stands and the caller publishes by itself.
  if ARGV[11] ~= '' then
    redis.call('SELECT', ARGV[11])  -- for the script alone, not for the connection
  end
  redis.call('LPUSH', KEYS[3], ARGV[10])
end
return 0  -- (not {}: a table reply costs Redis more)

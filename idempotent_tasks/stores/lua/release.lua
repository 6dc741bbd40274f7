-- Give up a processing claim, only if this owner still holds it with this token: delete it,
-- or, when a pickup is given (a retry is being published), make the key queued for it.
-- Without a pickup, a key keeping another call's message (see claim.lua: the call this claim
-- took the key from) is handed back to it instead: queued for that message, due now, so the
-- pickup guard publishes it again (under its own task id) rather than lose it with the claim.
-- KEYS[1]  record hash       KEYS[2]  due index of the record's shard
-- KEYS[3]  fencing counter (kept at least as long as the queued record, so tokens only grow)
-- ARGV[1]  owner id          ARGV[2]  fencing token
-- ARGV[3]  due in, ms ("" for no pickup)    ARGV[4]  re-publication timeout, ms
-- ARGV[5]  how long the record outlives its due time, ms    ARGV[6]  envelope
-- ARGV[7]  task id           ARGV[8]  storage key
-- Returns  1 if released, 0 if the claim is not (or no longer) this owner's
local found = redis.call('HMGET', KEYS[1], 'status', 'owner', 'token', 'envelope_of')
if found[1] ~= 'processing' or found[2] ~= ARGV[1] or found[3] ~= ARGV[2] then
  return 0
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local ttl = tonumber(ARGV[5])

local function keep_fence(record_ttl)
  local fence_ttl = redis.call('PTTL', KEYS[3])
  if fence_ttl >= 0 and fence_ttl < record_ttl + 1000 then
    redis.call('PEXPIRE', KEYS[3], int(record_ttl + 1000))
  end
end

if ARGV[3] == '' then
  local kept_of = found[4]
  if kept_of and kept_of ~= ARGV[7] and redis.call('HEXISTS', KEYS[1], 'envelope') == 1 then
    redis.call('HSET', KEYS[1], 'status', 'queued', 'owner', '', 'task_id', kept_of,
      'lease_expires_at', int(now), 'updated_at', int(now), 'expires_at', int(now + ttl),
      'due_at', int(now))
    redis.call('HDEL', KEYS[1], 'envelope_of', 'taken_from', 'owes_message')
    redis.call('PEXPIRE', KEYS[1], int(ttl))
    keep_fence(ttl)
    redis.call('ZADD', KEYS[2], int(now), ARGV[8])
    return 1
  end
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[8])
  return 1
end
local due_in = tonumber(ARGV[3])
local due_at = int(now + due_in)
redis.call('HSET', KEYS[1], 'status', 'queued', 'owner', '', 'task_id', ARGV[7],
  'lease_expires_at', due_at, 'updated_at', int(now), 'expires_at', int(now + due_in + ttl),
  'envelope', ARGV[6], 'pickup_timeout', ARGV[4], 'republished', '0', 'due_at', due_at)
-- The envelope is this call's own now, and the call it took the key from is its retry's to
-- answer (the retry's message names it).
redis.call('HDEL', KEYS[1], 'envelope_of', 'taken_from', 'owes_message')
redis.call('PEXPIRE', KEYS[1], int(due_in + ttl))
keep_fence(due_in + ttl)
redis.call('ZADD', KEYS[2], due_at, ARGV[8])
return 1

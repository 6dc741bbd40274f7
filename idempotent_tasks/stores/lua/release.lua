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
-- ARGV[9]  with a pickup: the queued record's owner, the message it waits for ("retry N", or
--          "": see records.retry_marker)
-- Returns  1 if released, 0 if the claim is not (or no longer) this owner's, or if, given a
--          pickup, it still owes another call's message it keeps (see settle.lua): the pickup
--          would take that message's place, and nothing would publish it; the claim stays,
--          for the next message to take over, owing it in turn
local found = redis.call('HMGET', KEYS[1], 'status', 'owner', 'token', 'envelope_of',
  'owes_message')
if found[1] ~= 'processing' or found[2] ~= ARGV[1] or found[3] ~= ARGV[2] then
  return 0
end
if ARGV[3] ~= '' and found[5] == '1' then
  return 0
end
-- Without a pickup, and no other call's message kept: the claim goes, before any more work.
local kept_of = found[4]
local hand_back = ARGV[3] == '' and kept_of and kept_of ~= ARGV[7]
  and redis.call('HEXISTS', KEYS[1], 'envelope') == 1
if ARGV[3] == '' and not hand_back then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[8])
  return 1
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local ttl = tonumber(ARGV[5])
-- Queued for the retry's message (its envelope now the key's own), or handed back to the call
-- whose message the key keeps, due now. Either way the call this claim took the key from is
-- no longer its to answer (a retry's message names it).
local task_id, due_in = ARGV[7], tonumber(ARGV[3])
if hand_back then
  task_id, due_in = kept_of, 0
end
local due_at = int(now + due_in)
local fields = {'status', 'queued', 'owner', hand_back and '' or ARGV[9], 'task_id', task_id,
  'lease_expires_at', due_at,
  'updated_at', int(now), 'expires_at', int(now + due_in + ttl), 'due_at', due_at}
if not hand_back then
  for _, item in ipairs({'envelope', ARGV[6], 'pickup_timeout', ARGV[4], 'republished', '0'}) do
    fields[#fields + 1] = item
  end
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('HDEL', KEYS[1], 'envelope_of', 'taken_from', 'owes_message')
redis.call('PEXPIRE', KEYS[1], int(due_in + ttl))
-- The fence lives at least as long as the queued record, so tokens only grow.
local fence_ttl = redis.call('PTTL', KEYS[3])
if fence_ttl >= 0 and fence_ttl < due_in + ttl + 1000 then
  redis.call('PEXPIRE', KEYS[3], int(due_in + ttl + 1000))
end
redis.call('ZADD', KEYS[2], due_at, ARGV[8])
return 1

-- Claim a key for one execution attempt, atomically.
-- KEYS[1]  record hash
-- KEYS[2]  fencing counter (string; outlives the record so tokens only grow)
-- ARGV[1]  owner id of this attempt
-- ARGV[2]  fingerprint of the call's arguments
-- ARGV[3]  task id
-- ARGV[4]  lease, milliseconds
-- ARGV[5]  how long the claimed record outlives its lease, milliseconds
-- ARGV[6]  "1" to compare fingerprints, "0" not to
-- ARGV[7]  previous owner whose claim may be taken over at once ("" for none)
-- ARGV[8]  the caller's key (for display)
-- ARGV[9]  task name
-- ARGV[10] how many retries the claiming message counts (absent: none)
-- Returns  the token alone when acquired with nothing more to say (no takeover, no other call
--          replaced, no message owed: the usual claim);
--          {outcome, token, takeover, field, value, ...}, or when acquired
--          {"acquired", token, takeover, the task id of the other call whose record this one
--          replaced (or ""), and the message this claim owes (or ""/nil): its call's task id
--          and its envelope}; the same call's claim made again (its reply lost, or its message
--          redelivered) is told again what its first one was, the message while still owed
--          outcome: "acquired" | "completed" | "in_progress" | "mismatch"
--          token: the fencing token when acquired; else the time of the read, ms
--          takeover: 1 or 0; field/value pairs: the record found when not acquired
-- Owed: a queued message that counted as lost, of the call whose record the claim replaces,
-- to be published again once the key completes (its callers, callbacks and chord wait on it);
-- or the one a dead owner owed, which passes on to the claim that takes its key over.
-- Fields a claim by another call writes: "taken_from" (the call it took the key from),
-- "owes_message" ("1": the claim owes the message the record keeps; take.lua clears it when
-- the guard publishes that message instead), and "envelope_of" (whose message "envelope" is,
-- when not the record's call's: the envelope stays where it is, for the guard to publish it
-- under its own call's task id). A completed record may keep another call's message so too
-- (see complete.lua): that call's claim, answered "completed", drops it.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local lease = tonumber(ARGV[4])
local ttl = tonumber(ARGV[5])

-- created_at: the record's creation time, which its reservation or first claim wrote with the
-- key's names (the usual case: they stay as they are); nil or false for a new record, or a
-- corrupt one that lost it: the names are written, with now as that time.
-- fingerprint: the arguments the key stands for from now on.
-- taken_from: the task id of the other call whose live record this claim replaces (on the same
-- call's paths: its earlier claim's), or ''.
-- owed_task_id, envelope: the message this claim owes (see above), or '' and nil.
local function acquire(takeover, created_at, fingerprint, taken_from, owed_task_id, envelope)
  local token = redis.call('INCR', KEYS[2])
  redis.call('HSET', KEYS[1], 'status', 'processing', 'owner', ARGV[1], 'token', int(token),
    'task_id', ARGV[3], 'fingerprint', fingerprint, 'lease_expires_at', int(now + lease),
    'updated_at', int(now), 'expires_at', int(now + lease + ttl))
  if not created_at then
    redis.call('HSET', KEYS[1], 'created_at', int(now), 'key', ARGV[8], 'task_name', ARGV[9])
  end
  redis.call('PEXPIRE', KEYS[1], int(lease + ttl))
  redis.call('PEXPIRE', KEYS[2], int(lease + ttl + 1000))
  if takeover == 0 and taken_from == '' and (owed_task_id or '') == '' then
    return token  -- the usual claim: its token alone (a table reply costs Redis more)
  end
  return {'acquired', token, takeover, taken_from, owed_task_id or '', envelope}
end

local found = redis.call('HMGET', KEYS[1], 'status', 'owner', 'fingerprint', 'lease_expires_at',
  'created_at', 'token', 'task_id', 'envelope_of', 'taken_from', 'owes_message')
if not found[1] then
  -- No record, or a corrupt one without a status (it protects nothing): start afresh.
  redis.call('DEL', KEYS[1])
  return acquire(0, nil, ARGV[2], '')
end
-- The record's own message (a redelivery, or a retry, perhaps with other arguments): the same
-- call, whose fingerprint, the caller's, the key keeps.
local same_call = found[7] == ARGV[3]
local fingerprint = same_call and found[3] or ARGV[2]
local other_call = (not same_call and found[7]) or ''
local mismatch = ARGV[6] == '1' and found[3] ~= ARGV[2] and not same_call
local envelope_of = found[8]

-- Another call takes the key over: from a queued record (its message lost), or from a dead
-- owner, whose debt passes on (see above). Whether this claim owes the message kept.
local function take_from_other(from_queued)
  local owed = from_queued or found[10] == '1'
  if envelope_of == ARGV[3] then
    -- Its own message: this call's again, owed to no one.
    redis.call('HDEL', KEYS[1], 'envelope_of', 'owes_message')
    envelope_of = nil
    owed = false
  elseif not envelope_of and found[7] and redis.call('HEXISTS', KEYS[1], 'envelope') == 1 then
    envelope_of = found[7]
    redis.call('HSET', KEYS[1], 'envelope_of', envelope_of)
  end
  if owed then
    redis.call('HSET', KEYS[1], 'taken_from', other_call, 'owes_message', '1')
  else
    redis.call('HSET', KEYS[1], 'taken_from', other_call)
    redis.call('HDEL', KEYS[1], 'owes_message')
  end
  return owed
end

-- The message this claim owes, when it does: its call's task id and its envelope.
local function owed_message(owed)
  if not owed or not envelope_of then
    return '', nil
  end
  return envelope_of, redis.call('HGET', KEYS[1], 'envelope')
end

local function answer(outcome)
  local reply = {outcome, now, 0}
  for _, item in ipairs(redis.call('HGETALL', KEYS[1])) do
    reply[#reply + 1] = item
  end
  return reply
end

if found[1] == 'queued' then
  -- Published and not yet claimed. Its own message runs it; another one (a duplicate
  -- published without a look, or a waiting one while a retry sits out its countdown) waits for
  -- it, until it counts as lost. The pickup stays, and stays in the due index: should this
  -- owner die and its message be lost too, the sweep publishes it again.
  if mismatch then
    return answer('mismatch')
  end
  if same_call and found[2] and found[2] ~= '' then
    -- Queued for a retry (release.lua): a message of the call counting fewer retries is an
    -- older one, which would run the call early, its retries counted anew.
    local waits_for = tonumber(string.match(found[2], '^retry (%d+)$'))
    if waits_for and (tonumber(ARGV[10]) or 0) < waits_for then
      return answer('in_progress')
    end
  end
  if not same_call and (tonumber(found[4]) or 0) > now then
    return answer('in_progress')
  end
  if other_call == '' then
    return acquire(0, found[5], fingerprint, '')
  end
  -- Another call's message that counts as lost: owed by this claim.
  return acquire(0, found[5], fingerprint, other_call, owed_message(take_from_other(true)))
end
local owed_before = found[10] == '1'  -- by the same call's earlier claim
if found[2] == ARGV[1] and found[1] == 'processing' then
  local token = tonumber(found[6])
  if token then
    return {'acquired', token, 0, found[9] or '', owed_message(owed_before)}
  end
  -- Its token cannot be read (corrupt): a new one.
  return acquire(0, found[5], fingerprint, found[9] or '', owed_message(owed_before))
end
if mismatch then
  return answer('mismatch')
end
if found[1] == 'completed' then
  if envelope_of == ARGV[3] then
    -- This call's message, which the record kept for the guard (see complete.lua): it came.
    redis.call('HDEL', KEYS[1], 'envelope', 'envelope_of', 'pickup_timeout', 'republished',
      'due_at')
  end
  return answer('completed')
end
-- A lease that cannot be read (a corrupt record) protects nothing, as an expired one.
if (ARGV[7] ~= '' and found[2] == ARGV[7]) or (tonumber(found[4]) or 0) <= now then
  if not same_call then
    return acquire(1, found[5], fingerprint, other_call, owed_message(take_from_other(false)))
  end
  return acquire(1, found[5], fingerprint, found[9] or '', owed_message(owed_before))
end
return answer('in_progress')

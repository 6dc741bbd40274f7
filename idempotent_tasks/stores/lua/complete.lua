-- Mark a key completed with its result, only if this owner still holds it (fencing).
-- KEYS[1]  record hash
-- KEYS[2]  fencing counter
-- KEYS[3]  due index of the record's shard
-- ARGV[1]  owner id
-- ARGV[2]  fencing token
-- ARGV[3]  ttl, milliseconds
-- ARGV[4]  "1" if a result is cached, "0" if not (too big or not serializable)
-- ARGV[5]  result content type    ARGV[6]  result content encoding    ARGV[7]  result bytes
-- ARGV[8]  fingerprint   ARGV[9]  task id   ARGV[10]  key   ARGV[11]  task name
--          (ARGV[8..11] rebuild the record if it vanished)
-- ARGV[12] storage key (index member)
-- ARGV[13] "1" if this claim owes the message it took over (see claim.lua): a record written
--          anew keeps that debt, for settle.lua, unless a later claim queued the key since (its
--          token higher: it took the debt over, and settled it as it gave the key up for its
--          retry); else "0"
-- KEYS[4], ARGV[14], ARGV[15]  optional side write: a key, its value and ttl in ms (0: none),
--          set and published on that key when the outcome is "stored", never otherwise
-- Returns  "stored" | "recovered" (the record had vanished and was written anew) | "stale"
-- A record written anew over another call's reservation for the same fingerprint keeps that
-- call's pickup as it was ("envelope_of" naming its call): take.lua publishes its message when
-- due, and claim.lua drops it when that message comes (answered from this result).
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local ttl = tonumber(ARGV[3])

local function stored()
  if KEYS[4] then
    local side_ttl = tonumber(ARGV[15])
    if side_ttl > 0 then
      redis.call('SET', KEYS[4], ARGV[14], 'PX', ARGV[15])
    else
      redis.call('SET', KEYS[4], ARGV[14])
    end
    redis.call('PUBLISH', KEYS[4], ARGV[14])
  end
  return 'stored'
end

local found = redis.call('HMGET', KEYS[1], 'status', 'owner', 'token')
local outcome = 'stored'
local kept = nil
if not found[1] or found[1] == 'queued' then
  -- The claim vanished (a store that lost it, or an expiry), and perhaps a new publish
  -- queued the key since: this execution did finish, so its result is the key's.
  outcome = 'recovered'
  if found[1] == 'queued' then
    -- Another call's reservation, for the same arguments (another one's claim would fail
    -- with a mismatch): its pickup stays, or nothing would publish its message should the
    -- broker lose it. Read here only: the usual completion needs none of it.
    local queued = redis.call('HMGET', KEYS[1], 'task_id', 'fingerprint', 'envelope',
      'pickup_timeout', 'republished', 'due_at')
    if queued[1] and queued[1] ~= ARGV[9] and queued[2] == ARGV[8] and queued[3] then
      kept = queued
      -- The record lives on as long as the reservation would have (its due time and then
      -- some), should that be longer: the guard must find the pickup at its due time.
      ttl = math.max(ttl, redis.call('PTTL', KEYS[1]))
    end
  end
  -- Tokens never go back: the record keeps the key's highest token given, and the counter
  -- (gone if it expired) is raised to it.
  local token = int(math.max(tonumber(redis.call('GET', KEYS[2]) or '0'), tonumber(ARGV[2])))
  redis.call('SET', KEYS[2], token)
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[3], ARGV[12])
  redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'token', token, 'fingerprint', ARGV[8],
    'task_id', ARGV[9], 'key', ARGV[10], 'task_name', ARGV[11], 'created_at', int(now),
    'lease_expires_at', int(now))
  if ARGV[13] == '1' and (tonumber(found[3]) or 0) <= tonumber(ARGV[2]) then
    redis.call('HSET', KEYS[1], 'owes_message', '1')
  end
elseif found[1] == 'completed' and found[2] == ARGV[1] then
  return stored()  -- a repeated completion
elseif found[2] ~= ARGV[1] or found[3] ~= ARGV[2] then
  return 'stale'
end

-- One HSET either way: a cached result is the usual case, and each redis.call costs.
if ARGV[4] == '1' then
  redis.call('HSET', KEYS[1], 'status', 'completed', 'updated_at', int(now),
    'expires_at', int(now + ttl), 'result_cached', '1', 'content_type', ARGV[5],
    'content_encoding', ARGV[6], 'result', ARGV[7])
else
  redis.call('HSET', KEYS[1], 'status', 'completed', 'updated_at', int(now),
    'expires_at', int(now + ttl), 'result_cached', ARGV[4])
end
if kept then
  redis.call('HSET', KEYS[1], 'envelope', kept[3], 'envelope_of', kept[1],
    'pickup_timeout', kept[4] or '', 'republished', kept[5] or '0', 'due_at', kept[6] or '')
  redis.call('ZADD', KEYS[3], int(tonumber(kept[6]) or now), ARGV[12])
else
  -- ('envelope_of' may stay, naming a call this claim took the key from: without an
  -- envelope, it keeps nothing.)
  redis.call('HDEL', KEYS[1], 'envelope', 'pickup_timeout', 'republished', 'due_at')
  redis.call('ZREM', KEYS[3], ARGV[12])
end
redis.call('PEXPIRE', KEYS[1], kept and int(ttl) or ARGV[3])
if redis.call('PTTL', KEYS[2]) < ttl then
  redis.call('PEXPIRE', KEYS[2], int(ttl + 1000))
end
if outcome == 'stored' then
  return stored()
end
return outcome

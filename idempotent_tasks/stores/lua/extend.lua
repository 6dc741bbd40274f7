-- Renew the lease of a processing claim, only if this owner still holds it with this token.
-- KEYS[1]  record hash
-- KEYS[2]  fencing counter
-- ARGV[1]  owner id
-- ARGV[2]  fencing token
-- ARGV[3]  lease, milliseconds from now
-- ARGV[4]  how long the record outlives its lease, milliseconds
-- Returns  1 if renewed, 0 if the claim is not (or no longer) this owner's
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local lease = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
local found = redis.call('HMGET', KEYS[1], 'status', 'owner', 'token')
if found[1] == 'processing' and found[2] == ARGV[1] and found[3] == ARGV[2] then
  redis.call('HSET', KEYS[1], 'lease_expires_at', int(now + lease), 'updated_at', int(now),
    'expires_at', int(now + lease + ttl))
  redis.call('PEXPIRE', KEYS[1], int(lease + ttl))
  if redis.call('PTTL', KEYS[2]) < lease + ttl then
    redis.call('PEXPIRE', KEYS[2], int(lease + ttl + 1000))
  end
  return 1
end
return 0

-- Delete a processing claim, only if this owner still holds it with this token.
-- KEYS[1]  record hash
-- ARGV[1]  owner id
-- ARGV[2]  fencing token
-- Returns  1 if deleted, 0 if the claim is not (or no longer) this owner's
local found = redis.call('HMGET', KEYS[1], 'status', 'owner', 'token')
if found[1] == 'processing' and found[2] == ARGV[1] and found[3] == ARGV[2] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0

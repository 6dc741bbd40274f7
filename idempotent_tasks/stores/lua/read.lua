-- Read a key's record, with the time it was read.
-- KEYS[1]  record hash
-- Returns  {now in ms, field, value, ...} (only the time when there is no record)
local clock = redis.call('TIME')
local reply = redis.call('HGETALL', KEYS[1])
table.insert(reply, 1, tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000))
return reply

-- Put before every script by RedisStore (redis.py: _lua).
-- Integers go to Redis as strings made here: Redis 7.0 turns a Lua number argument into text
-- with %.17g, which costs it about as much as a whole command. %d is cheap, but it takes a C
-- long, which has 32 bits on some platforms; there %.0f (exact below 2^53) is used instead.
local int_format = string.format('%d', 2^40) == '1099511627776' and '%d' or '%.0f'
local function int(n) return string.format(int_format, n) end

-- Implements store::lifecycle::release (src/store/lifecycle.rs).
-- Gives a lease back without recording an attempt (shutdown, busy host).
-- KEYS: 1 message hash, 2 lease zset, 3 due zset, 4 in_flight index, 5 pending index
-- ARGV: 1 id, 2 lease token, 3 next attempt ms
local cur = redis.call('HMGET', KEYS[1], 'state', 'lease')
if cur[1] ~= 'in_flight' or cur[2] ~= ARGV[2] then
  return 0
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[1], 'state', 'pending')
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZADD', KEYS[5], 0, ARGV[1])
return 1

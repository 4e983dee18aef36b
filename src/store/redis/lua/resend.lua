-- Implements store::lifecycle::resend (src/store/lifecycle.rs).
-- Orders one more delivery of a message and records the operator's mark.
-- KEYS: 1 message hash, 2 attempts list, 3 due zset, 4 ordering queue, 5 pending index,
--       6 delivered index, 7 dead index
-- ARGV: 1 id, 2 mark json, 3 fresh deadline ms, 4 now ms, 5 history tail, 6 rows keeping bodies
local id = ARGV[1]
local cur = redis.call('HMGET', KEYS[1], 'state', 'resume', 'tries', 'end')
local state = cur[1]
if not state or state == 'recorded' then
  return 'skipped'
end
local now = tonumber(ARGV[4])
-- A finished message whose retention ended is gone, swept or not (store::lifecycle::resend).
if cur[4] and tonumber(cur[4]) <= now then
  return 'skipped'
end
append_history(KEYS[1], KEYS[2], ARGV[2], tonumber(ARGV[5]), tonumber(ARGV[6]))
if state == 'delivered' or state == 'dead' then
  redis.call('HSET', KEYS[1], 'state', 'pending', 'dl', ARGV[3], 'rb', cur[3] or 0)
  -- live again: the sweeper skips its expiry member (v1 stores also had TTLs on these keys)
  redis.call('HDEL', KEYS[1], 'end')
  redis.call('PERSIST', KEYS[1])
  redis.call('PERSIST', KEYS[2])
  redis.call('ZREM', KEYS[6], id)
  redis.call('ZREM', KEYS[7], id)
  redis.call('ZADD', KEYS[5], 0, id)
  redis.call('RPUSH', KEYS[4], id)
  if redis.call('LLEN', KEYS[4]) == 1 then
    redis.call('ZADD', KEYS[3], now, id)
  end
  return 'requeued'
end
if state == 'pending' then
  local score = redis.call('ZSCORE', KEYS[3], id)
  if not score then
    return 'queued'
  end
  if tonumber(score) > now then
    if tonumber(cur[2] or '0') == 0 then
      redis.call('HSET', KEYS[1], 'resume', score)
    end
    redis.call('ZADD', KEYS[3], now, id)
  end
  return 'expedited'
end
-- in flight: once more after the current attempt, with a fresh window
redis.call('HSET', KEYS[1], 'again', 1, 'dl', ARGV[3])
return 'after_current'

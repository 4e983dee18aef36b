-- Implements store::lifecycle::complete (src/store/lifecycle.rs).
-- Records a delivery attempt and its consequence, if the caller still holds the lease.
-- Answers 0 when it does not; 2 when something was made due (the message again, or the next
-- message of its key), which tells the caller's claim to count the partition again; else 1.
-- KEYS: 1 message hash, 2 attempts list, 3 lease zset, 4 due zset, 5 ordering queue,
--       6 in_flight index, 7 pending index, 8 index of the final state (delivered/dead),
--       9 expiry bucket index
-- ARGV: 1 id, 2 lease token, 3 outcome (delivered|retry|dead), 4 attempt json,
--       5 next attempt ms, 6 now ms, 7 retention secs, 8 history tail, 9 rows keeping bodies
local id = ARGV[1]
local cur = redis.call('HMGET', KEYS[1], 'state', 'lease', 'resume', 'again')
if cur[1] ~= 'in_flight' or cur[2] ~= ARGV[2] then
  return 0
end
redis.call('ZREM', KEYS[3], id)
-- An expired lease that claim.lua moved back to `due` but nobody re-leased yet is still
-- in_flight with this token: its worker may finish it, and then it must leave `due` too,
-- or a finished message would be claimed (and its successor promoted) again.
redis.call('ZREM', KEYS[4], id)
redis.call('ZREM', KEYS[6], id)
append_history(KEYS[1], KEYS[2], ARGV[4], tonumber(ARGV[8]), tonumber(ARGV[9]))
redis.call('HINCRBY', KEYS[1], 'tries', 1)
local outcome = ARGV[3]
if outcome == 'retry' or cur[4] == '1' then
  -- a retry, or a resend that arrived while this attempt was in flight (delivered once
  -- more, now, even if this attempt ended it): stay at the head
  local next_at = tonumber(ARGV[5])
  local resume = tonumber(cur[3] or '0')
  if outcome ~= 'retry' then next_at = tonumber(ARGV[6]) end
  -- an operator's resend brought this attempt forward: the automatic schedule resumes
  -- where it was, neither shortened nor pushed back
  if outcome == 'retry' and resume >= tonumber(ARGV[6]) then next_at = resume end
  redis.call('HSET', KEYS[1], 'state', 'pending')
  redis.call('HDEL', KEYS[1], 'resume', 'again')
  redis.call('ZADD', KEYS[4], next_at, id)
  redis.call('ZADD', KEYS[7], 0, id)
  return 2
end
redis.call('HSET', KEYS[1], 'state', outcome)
if cur[3] or cur[4] then redis.call('HDEL', KEYS[1], 'resume', 'again') end
redis.call('ZADD', KEYS[8], 0, id)
-- finished: kept for the retention, then the sweeper deletes it with its index entries
local now = tonumber(ARGV[6])
expire_message(KEYS[9], KEYS[1], id, now + tonumber(ARGV[7]) * 1000, now)
redis.call('LREM', KEYS[5], 1, id)
local head = redis.call('LINDEX', KEYS[5], 0)
if head then
  redis.call('ZADD', KEYS[4], ARGV[6], head)
  return 2
end
return 1

-- Applies store::lifecycle::expire_lease, then store::lifecycle::claim
-- (src/store/lifecycle/rules.rs), to the messages of one partition they pick: leases that ran
-- out by the lease clock (dead workers) are due again at `now`, then due messages are leased
-- under their next token until the lease clock plus the lease. Those effects are the same for
-- every message, so they are written here as the rules state them.
-- Answers {leased rows, what is left claimable, the next due ms after now, the earliest lease
-- end ms}: the caller shares its next claims by it (src/store/redis/claim.rs); each time nil
-- when there is none.
-- KEYS: 1 due zset, 2 lease zset, 3 pending index, 4 in_flight index
-- ARGV: 1 now ms, 2 limit, 3 lease ms, 4 partition key prefix, 5 '1' to time leases by
--       this server's clock, 6 the state of a leased message
local now = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
-- Leases are judged by one clock for all workers: with several processes, a worker whose
-- clock runs ahead would otherwise take over leases that have not expired yet.
local lease_now = now
if ARGV[5] == '1' then
  local t = redis.call('TIME')
  lease_now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local lease_until = lease_now + tonumber(ARGV[3])
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', lease_now, 'LIMIT', 0, limit)
for _, id in ipairs(expired) do
  redis.call('ZREM', KEYS[2], id)
  redis.call('ZADD', KEYS[1], now, id)
end
local out = {}
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, limit)
for _, id in ipairs(ids) do
  local key = ARGV[4] .. 'm:' .. id
  redis.call('ZREM', KEYS[1], id)
  -- the record is whole in `rec` (layout 4 and before), or in pieces from `r0` (accept.lua);
  -- its first 9 pieces (576 bytes, a typical compressed record) are read with the state
  local f = redis.call('HMGET', key, 'rec', 'tries', 'rb', 'dl', 'resume', 'again',
    'r0', 'r1', 'r2', 'r3', 'r4', 'r5', 'r6', 'r7', 'r8')
  if f[1] or f[7] then
    local token = redis.call('HINCRBY', key, 'lease', 1)
    redis.call('HSET', key, 'state', ARGV[6])
    redis.call('ZADD', KEYS[2], lease_until, id)
    redis.call('ZREM', KEYS[3], id)
    redis.call('ZADD', KEYS[4], 0, id)
    -- absent fields are their defaults; no `dl` is the record's deadline
    table.insert(out, {f[1] or joined(key, 'r', {unpack(f, 7, 15)}), tostring(token), f[2] or '0', f[3] or '0',
      f[4] or '', f[5] or '0', f[6] or '0'})
  end
end
-- Fewer due than the limit means none is left: expired leases beyond the limit would have
-- filled it.
local left = 0
if #ids == limit then
  left = redis.call('ZCOUNT', KEYS[1], '-inf', now) + redis.call('ZCOUNT', KEYS[2], '-inf', lease_now)
end
-- When what is left grows by itself: the next entry of `due` to come due, and the earliest
-- lease to run out.
local due_at, lease_at = false, false
local d = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
if d[2] then due_at = tonumber(d[2]) end
local l = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if l[2] then lease_at = tonumber(l[2]) end
return {out, left, due_at, lease_at}

-- Implements store::lifecycle::accept (src/store/lifecycle.rs), for a group of accepts of one
-- partition. Each claims a dedupe key and records a message in one atomic step; the group is
-- applied in its order, each accept seeing what the ones before it wrote, so its outcome is
-- the one it would have had called alone after them. A single accept is a group of one.
-- KEYS: 10 per accept, those of accept i (from 0) at i * 10 +
--       1 dedupe, 2 message hash, 3 ordering queue, 4 due zset, 5 index of all,
--       6 index of the initial state, 7 index of the ordering key, 8 payment status,
--       9 expiry index, 10 signature seal (a key that never exists when there is no seal)
-- ARGV: 1 payment retention secs, 2 message retention secs, 3 partition prefix; then 12 per
--       accept, those of accept i at 3 + i * 12 +
--       1 dedupe ttl secs, 2 fingerprint, 3 response, 4 id, 5 record json, 6 now ms,
--       7 deadline ms, 8 initial state, 9 payment target status ('' = none),
--       10 allowed previous statuses (space separated), 11 seal expiry ms ('' = no seal),
--       12 short hash of the ordering key
-- Returns one reply per accept, in order: {'ok'}, {'dup', response}, {'conflict'} or
-- {'transition', current status}.
--
-- Lifetimes are decided by the caller's clock: every expiring key has a member in the expiry
-- index scored by when it ends, a key past that is treated as absent, and the sweeper deletes
-- it. Redis TTLs are set as well, so memory is bounded even if no sweeper ever runs.
local payment_retention_ms = tonumber(ARGV[1]) * 1000
local retention_ms = tonumber(ARGV[2]) * 1000
local plen = string.len(ARGV[3])
local function member(key) return string.sub(key, plen + 1) end
local function live(key, expiry, now)
  local value = redis.call('GET', key)
  if not value then return nil end
  local ends = redis.call('ZSCORE', expiry, member(key))
  if ends and tonumber(ends) <= now then return nil end
  return value
end
local function expire_at(key, expiry, at_ms, now)
  redis.call('PEXPIRE', key, math.max(at_ms - now, 1))
  redis.call('ZADD', expiry, at_ms, member(key))
end
-- Remembers the answer to a signature while it could verify (nothing without a seal).
local function seal(k, a, now, response)
  if a[11] ~= '' then
    redis.call('SET', k[10], response)
    expire_at(k[10], k[9], tonumber(a[11]), now)
  end
end

local function accept(k, a)
  local now = tonumber(a[6])
  if a[11] ~= '' then
    local first = live(k[10], k[9], now)
    if first then return {'dup', first} end
  end
  local existing = live(k[1], k[9], now)
  if existing then
    local sep = string.find(existing, '\n', 1, true)
    if string.sub(existing, 1, sep - 1) ~= a[2] then
      return {'conflict'}
    end
    local response = string.sub(existing, sep + 1)
    seal(k, a, now, response)
    return {'dup', response}
  end
  if a[9] ~= '' then
    local current = live(k[8], k[9], now) or 'undefined'
    local allowed = false
    for status in string.gmatch(a[10], '%S+') do
      if status == current then allowed = true end
    end
    if not allowed then
      return {'transition', current}
    end
    redis.call('SET', k[8], a[9])
    expire_at(k[8], k[9], now + payment_retention_ms, now)
  end
  local id = a[4]
  redis.call('SET', k[1], a[2] .. '\n' .. a[3])
  expire_at(k[1], k[9], now + tonumber(a[1]) * 1000, now)
  seal(k, a, now, a[3])
  redis.call('HSET', k[2], 'rec', a[5], 'state', a[8], 'tries', 0, 'rb', 0,
    'lease', 0, 'dl', a[7], 'resume', 0, 'again', 0, 'kh', a[12], 'hn', 0)
  redis.call('ZADD', k[5], 0, id)
  redis.call('ZADD', k[6], 0, id)
  redis.call('ZADD', k[7], 0, id)
  if a[8] == 'pending' then
    redis.call('RPUSH', k[3], id)
    if redis.call('LLEN', k[3]) == 1 then
      redis.call('ZADD', k[4], a[6], id)
    end
  else
    -- recorded: nothing to deliver, kept for the message retention
    redis.call('ZADD', k[9], now + retention_ms, 'm:' .. id)
  end
  return {'ok'}
end

local replies = {}
for i = 0, #KEYS / 10 - 1 do
  replies[i + 1] = accept({unpack(KEYS, i * 10 + 1, i * 10 + 10)},
    {unpack(ARGV, 3 + i * 12 + 1, 3 + i * 12 + 12)})
end
return replies

-- Implements store::lifecycle::accept (src/store/lifecycle.rs).
-- Claims a dedupe key and records a message in one atomic step.
-- KEYS: 1 dedupe, 2 message hash, 3 ordering queue, 4 due zset, 5 index of all,
--       6 index of the initial state, 7 index of the ordering key, 8 payment status,
--       9 expiry index, 10 signature seal (a key that never exists when there is no seal)
-- ARGV: 1 dedupe ttl secs, 2 fingerprint, 3 response, 4 id, 5 record json, 6 now ms,
--       7 deadline ms, 8 initial state, 9 payment target status ('' = none),
--       10 allowed previous statuses (space separated), 11 payment retention secs,
--       12 message retention secs, 13 seal expiry ms ('' = no seal), 14 partition prefix,
--       15 short hash of the ordering key
--
-- Lifetimes are decided by the caller's clock: every expiring key has a member in the expiry
-- index scored by when it ends, a key past that is treated as absent, and the sweeper deletes
-- it. Redis TTLs are set as well, so memory is bounded even if no sweeper ever runs.
local now = tonumber(ARGV[6])
local plen = string.len(ARGV[14])
local function member(key) return string.sub(key, plen + 1) end
local function live(key)
  local value = redis.call('GET', key)
  if not value then return nil end
  local ends = redis.call('ZSCORE', KEYS[9], member(key))
  if ends and tonumber(ends) <= now then return nil end
  return value
end
local function expire_at(key, at_ms)
  redis.call('PEXPIRE', key, math.max(at_ms - now, 1))
  redis.call('ZADD', KEYS[9], at_ms, member(key))
end
local function seal(response)
  if ARGV[13] ~= '' then
    redis.call('SET', KEYS[10], response)
    expire_at(KEYS[10], tonumber(ARGV[13]))
  end
end
if ARGV[13] ~= '' then
  local first = live(KEYS[10])
  if first then return {'dup', first} end
end
local existing = live(KEYS[1])
if existing then
  local sep = string.find(existing, '\n', 1, true)
  if string.sub(existing, 1, sep - 1) ~= ARGV[2] then
    return {'conflict'}
  end
  local response = string.sub(existing, sep + 1)
  seal(response)
  return {'dup', response}
end
if ARGV[9] ~= '' then
  local current = live(KEYS[8]) or 'undefined'
  local allowed = false
  for status in string.gmatch(ARGV[10], '%S+') do
    if status == current then allowed = true end
  end
  if not allowed then
    return {'transition', current}
  end
  redis.call('SET', KEYS[8], ARGV[9])
  expire_at(KEYS[8], now + tonumber(ARGV[11]) * 1000)
end
local id = ARGV[4]
redis.call('SET', KEYS[1], ARGV[2] .. '\n' .. ARGV[3])
expire_at(KEYS[1], now + tonumber(ARGV[1]) * 1000)
seal(ARGV[3])
redis.call('HSET', KEYS[2], 'rec', ARGV[5], 'state', ARGV[8], 'tries', 0, 'rb', 0,
  'lease', 0, 'dl', ARGV[7], 'resume', 0, 'again', 0, 'kh', ARGV[15], 'hn', 0)
redis.call('ZADD', KEYS[5], 0, id)
redis.call('ZADD', KEYS[6], 0, id)
redis.call('ZADD', KEYS[7], 0, id)
if ARGV[8] == 'pending' then
  redis.call('RPUSH', KEYS[3], id)
  if redis.call('LLEN', KEYS[3]) == 1 then
    redis.call('ZADD', KEYS[4], ARGV[6], id)
  end
else
  -- recorded: nothing to deliver, kept for the message retention
  redis.call('ZADD', KEYS[9], now + tonumber(ARGV[12]) * 1000, 'm:' .. id)
end
return {'ok'}

-- Claims a dedupe key and records a message in one atomic step (DESIGN.md §3).
-- KEYS: 1 dedupe, 2 message hash, 3 ordering queue, 4 due zset, 5 index of all,
--       6 index of the initial state, 7 index of the ordering key, 8 payment status
-- ARGV: 1 dedupe ttl secs, 2 fingerprint, 3 response, 4 id, 5 record json, 6 now ms,
--       7 deadline ms, 8 initial state, 9 payment target status ('' = none),
--       10 allowed previous statuses (space separated), 11 oldest id kept in indexes
local existing = redis.call('GET', KEYS[1])
if existing then
  local sep = string.find(existing, '\n', 1, true)
  if string.sub(existing, 1, sep - 1) ~= ARGV[2] then
    return {'conflict'}
  end
  return {'dup', string.sub(existing, sep + 1)}
end
if ARGV[9] ~= '' then
  local current = redis.call('GET', KEYS[8]) or 'undefined'
  local allowed = false
  for status in string.gmatch(ARGV[10], '%S+') do
    if status == current then allowed = true end
  end
  if not allowed then
    return {'transition', current}
  end
  redis.call('SET', KEYS[8], ARGV[9], 'EX', ARGV[1])
end
local id = ARGV[4]
redis.call('SET', KEYS[1], ARGV[2] .. '\n' .. ARGV[3], 'EX', ARGV[1])
redis.call('HSET', KEYS[2], 'rec', ARGV[5], 'state', ARGV[8], 'tries', 0, 'rb', 0,
  'lease', 0, 'dl', ARGV[7], 'resume', 0, 'again', 0)
redis.call('ZADD', KEYS[5], 0, id)
redis.call('ZADD', KEYS[6], 0, id)
redis.call('ZADD', KEYS[7], 0, id)
redis.call('ZREMRANGEBYLEX', KEYS[5], '-', '(' .. ARGV[11])
redis.call('ZREMRANGEBYLEX', KEYS[7], '-', '(' .. ARGV[11])
if ARGV[8] == 'pending' then
  redis.call('RPUSH', KEYS[3], id)
  if redis.call('LLEN', KEYS[3]) == 1 then
    redis.call('ZADD', KEYS[4], ARGV[6], id)
  end
else
  redis.call('EXPIRE', KEYS[2], ARGV[1])
end
return {'ok'}

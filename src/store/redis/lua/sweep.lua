-- Implements store::lifecycle::sweep (src/store/lifecycle.rs).
-- Deletes what expired in one partition: everything whose expiry-index score is past `now`.
-- KEYS: 1 expiry index, 2 index of all, 3 delivered index, 4 dead index, 5 recorded index
-- ARGV: 1 now ms, 2 limit, 3 partition prefix
local prefix = ARGV[3]
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, member in ipairs(gone) do
  redis.call('ZREM', KEYS[1], member)
  if string.sub(member, 1, 2) == 'm:' then
    -- a finished message: its record, history and every index entry
    local id = string.sub(member, 3)
    local key = prefix .. member
    local kh = redis.call('HGET', key, 'kh')
    redis.call('DEL', key, prefix .. 'a:' .. id)
    for i = 2, 5 do redis.call('ZREM', KEYS[i], id) end
    if kh then redis.call('ZREM', prefix .. 'ix:k:' .. kh, id) end
  else
    redis.call('DEL', prefix .. member)
  end
end
return #gone

-- Applies store::lifecycle::sweep (src/store/lifecycle/rules.rs): what ended by `now` is gone.
-- Deletes what ended in one partition: the members of every expiry bucket that has begun
-- whose end is at or before `now`. A bucket's members were pushed in the order they were
-- written, nearly the order of their ends: a member still live stops its bucket (it and any
-- behind it are deleted by a later sweep, at the latest when the bucket has ended).
-- KEYS: 1 expiry bucket index
-- ARGV: 1 now ms, 2 limit
local now = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local prefix = string.sub(KEYS[1], 1, -3)
local done = 0
local function delete_message(member)
  local key = prefix .. member
  local id = string.sub(member, 3)
  local f = redis.call('HMGET', key, 'kh', 'state')
  redis.call('DEL', key, prefix .. 'a:' .. id)
  -- its state's index, bucketed or not (index.lua): the `fx:` name removes it from either
  if f[2] then index_remove(prefix .. 'fx:' .. f[2], id) end
  if f[1] then
    -- its entry in the key index (keys.rs), or, written by layout 5 and before, in its
    -- key's own sorted set
    redis.call('ZREM', prefix .. 'kx:' .. string.sub(f[1], 1, 1), string.sub(f[1], 2) .. ':' .. id)
    redis.call('ZREM', prefix .. 'ix:k:' .. f[1], id)
  end
end
local buckets = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, limit)
for _, bucket in ipairs(buckets) do
  local list = prefix .. bucket
  local messages = string.sub(bucket, 1, 3) == 'xm:'
  local b = tonumber(string.match(bucket, ':(%d+)$'))
  while done < limit do
    local member = redis.call('LINDEX', list, 0)
    if not member then break end
    local ends
    if messages then
      ends = tonumber(redis.call('HGET', prefix .. member, 'end') or '')
    else
      ends = end_of(redis.call('GET', prefix .. member))
    end
    if ends and ends <= now then
      if messages then delete_message(member) else redis.call('DEL', prefix .. member) end
    elseif ends and math.floor(ends / EXPIRY_BUCKET_MS) == b then
      break
    end
    -- over, gone, live again (a resent message), or written again with a later end (which
    -- put it in a later bucket): this member is done
    redis.call('LPOP', list)
    done = done + 1
  end
  if redis.call('EXISTS', list) == 0 then
    redis.call('ZREM', KEYS[1], bucket)
    done = done + 1
  end
  if done >= limit then break end
end
return done

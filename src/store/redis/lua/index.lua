-- Shared by the scripts that move a message between the state indexes (prepended to each).
-- A state's index is one of two shapes, and the key's name, chosen in keys.rs, says which:
--   `ix:<state>`, a sorted set of ids (lex, score 0), for the states whose size is asked for
--   (pending, in_flight and dead: the queue depth is their ZCARD);
--   `fx:<state>`, for delivered and recorded, which hold nearly all of the retention's
--   messages: a sorted set of bucket bounds, each bound `b` naming a bucket `fx:<state>:<b>`,
--   a sorted set of at most BUCKET_IDS ids, all at or above `b` and below the next bound. A
--   bucket stays a listpack (Redis' `zset-max-listpack-entries`, 128 by default), where an id
--   costs its bytes and a few more, instead of a skiplist node and a dict entry each.
-- Messages a layout before 7 ended are in `ix:<state>` for those states too, read beside the
-- buckets and removed from either.
local BUCKET_IDS = 128
local function bucketed(index)
  return string.find(index, '}:fx:[%a_]+$') ~= nil
end
-- The bound of the bucket `id` belongs in: the greatest at or below it, nil when none is.
local function bound_of(index, id)
  return redis.call('ZRANGE', index, '[' .. id, '-', 'BYLEX', 'REV', 'LIMIT', 0, 1)[1]
end
-- Lowers the bound `b` of a bucket to `id`, below every id it holds and above the bound
-- before it: the bucket is renamed (a bucket missing, as after an eviction, is simply made
-- again by the next ZADD).
local function lower_bound(index, b, id)
  if redis.call('EXISTS', index .. ':' .. b) == 1 then
    redis.call('RENAME', index .. ':' .. b, index .. ':' .. id)
  end
  redis.call('ZREM', index, b)
  redis.call('ZADD', index, 0, id)
end
local function index_add(index, id)
  if not bucketed(index) then
    redis.call('ZADD', index, 0, id)
    return
  end
  local b = bound_of(index, id)
  if not b then
    -- below every bound: the first bucket takes it, renamed so its bound is its least id
    b = redis.call('ZRANGE', index, 0, 0)[1]
    if b then lower_bound(index, b, id) else redis.call('ZADD', index, 0, id) end
    b = id
  end
  local bucket = index .. ':' .. b
  redis.call('ZADD', bucket, 0, id)
  local n = redis.call('ZCARD', bucket)
  if n < BUCKET_IDS then return end
  -- Full: the ids after a split point move on, so the bucket stays within a listpack. Ids
  -- come in order or nearly (completions of concurrent attempts), so the point is just above
  -- the new id (the newest itself when it is the last), and the full bucket stays nearly
  -- full; past half the bucket, at its middle. They join the next bucket when it has room,
  -- renamed down to the first of them (else ids a little out of order would each start a
  -- bucket behind a full one), or start a bucket of their own.
  local from = redis.call('ZRANK', bucket, id) + 1
  if from == n then from = n - 1 end
  if n - from > n / 2 then from = math.floor(n / 2) end
  local moved = redis.call('ZRANGE', bucket, from, -1)
  redis.call('ZREM', bucket, unpack(moved))
  local members = {}
  for i, m in ipairs(moved) do
    members[2 * i - 1] = 0
    members[2 * i] = m
  end
  local after = redis.call('ZRANGE', index, '(' .. b, '+', 'BYLEX', 'LIMIT', 0, 1)[1]
  if after and redis.call('ZCARD', index .. ':' .. after) + #moved < BUCKET_IDS then
    lower_bound(index, after, moved[1])
  else
    redis.call('ZADD', index, 0, moved[1])
  end
  redis.call('ZADD', index .. ':' .. moved[1], unpack(members))
end
local function index_remove(index, id)
  if not bucketed(index) then
    redis.call('ZREM', index, id)
    return
  end
  local b = bound_of(index, id)
  if b then
    local bucket = index .. ':' .. b
    if redis.call('ZREM', bucket, id) == 1 then
      if redis.call('EXISTS', bucket) == 0 then redis.call('ZREM', index, b) end
      return
    end
  end
  -- ended by layout 6 or before
  redis.call('ZREM', string.gsub(index, '}:fx:([%a_]+)$', '}:ix:%1'), id)
end

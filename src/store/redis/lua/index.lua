-- Shared by the scripts that move a message between the state indexes (prepended to each).
-- A state's index is one of two shapes, and the key's name, chosen in keys.rs, says which:
--   `ix:<state>`, a sorted set of ids (lex, score 0), for the states a message passes through
--   (few at a time, counted with ZCARD);
--   `fx:<state>`, for the states a message ends in, which hold the retention's messages: a
--   sorted set of bucket bounds, each bound `b` naming a bucket `fx:<state>:<b>`, a sorted set
--   of at most BUCKET_IDS ids, all at or above `b` and below the next bound. A bucket stays a
--   listpack (Redis' `zset-max-listpack-entries`, 128 by default), where an id costs its bytes
--   and two more, instead of a skiplist node and a dict entry each.
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
local function index_add(index, id)
  if not bucketed(index) then
    redis.call('ZADD', index, 0, id)
    return
  end
  local b = bound_of(index, id)
  if not b then
    -- below every bound: the first bucket takes it, renamed so its bound is its least id
    b = redis.call('ZRANGE', index, 0, 0)[1]
    if b then
      redis.call('RENAME', index .. ':' .. b, index .. ':' .. id)
      redis.call('ZREM', index, b)
    end
    redis.call('ZADD', index, 0, id)
    b = id
  end
  local bucket = index .. ':' .. b
  redis.call('ZADD', bucket, 0, id)
  local n = redis.call('ZCARD', bucket)
  if n < BUCKET_IDS then return end
  -- Full: ids after the split point move to a new bucket, bounded by the first of them. Ids
  -- mostly come in order, so the newest alone starts the next bucket and the full one stays
  -- full; an id inside the bucket splits it in halves.
  local from = math.floor(n / 2)
  if redis.call('ZRANGE', bucket, -1, -1)[1] == id then from = n - 1 end
  local moved = redis.call('ZRANGE', bucket, from, -1)
  redis.call('ZREM', bucket, unpack(moved))
  local members = {}
  for i, m in ipairs(moved) do
    members[2 * i - 1] = 0
    members[2 * i] = m
  end
  redis.call('ZADD', index .. ':' .. moved[1], unpack(members))
  redis.call('ZADD', index, 0, moved[1])
end
local function index_remove(index, id)
  if not bucketed(index) then
    redis.call('ZREM', index, id)
    return
  end
  local b = bound_of(index, id)
  if b then
    local bucket = index .. ':' .. b
    if redis.call('ZREM', bucket, id) == 1 and redis.call('EXISTS', bucket) == 0 then
      redis.call('ZREM', index, b)
    end
  end
  -- ended by layout 6 or before
  redis.call('ZREM', string.gsub(index, '}:fx:([%a_]+)$', '}:ix:%1'), id)
end

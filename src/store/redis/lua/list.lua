-- The first ids in a range of each of a partition's state indexes (index.lua), in one atomic
-- read: without a state filter a message is in exactly one index at any moment, so a listing
-- sees it once, never zero times (src/store/redis/reads.rs).
-- KEYS: the state indexes
-- ARGV: 1 the range's start, 2 its end (ZRANGE ... BYLEX bounds), 3 the most ids per index
-- Answers one list of ids: up to the limit from each index (the buckets' and, for a bucketed
-- state, as many again from layout 6's set), not merged; the caller sorts them.
local min, max, limit = ARGV[1], ARGV[2], tonumber(ARGV[3])
local ids = {}
local function range(key, n)
  local found = redis.call('ZRANGE', key, min, max, 'BYLEX', 'LIMIT', 0, n)
  for _, id in ipairs(found) do ids[#ids + 1] = id end
  return #found
end
-- The buckets that can hold ids in range: the one `min` belongs in, then those after it, each
-- holding at least one id past `min`, so a page reads at most `limit` buckets and two more.
local function bucket_range(index)
  local first
  if min ~= '-' then first = bound_of(index, string.sub(min, 2)) end
  first = first or redis.call('ZRANGE', index, 0, 0)[1]
  if not first then return end
  local from, left = '[' .. first, limit
  while left > 0 do
    local bounds = redis.call('ZRANGE', index, from, max, 'BYLEX', 'LIMIT', 0, left + 1)
    if #bounds == 0 then return end
    for _, b in ipairs(bounds) do
      left = left - range(index .. ':' .. b, left)
      if left == 0 then return end
    end
    from = '(' .. bounds[#bounds]
  end
end
for _, index in ipairs(KEYS) do
  if bucketed(index) then
    bucket_range(index)
    -- ended by layout 6 or before
    range(string.gsub(index, '}:fx:([%a_]+)$', '}:ix:%1'), limit)
  else
    range(index, limit)
  end
end
return ids

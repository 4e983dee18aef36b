-- Shared by the scripts that give things an end (prepended to each).
-- Every string is `<end ms>|<payload>`, or a compact dedupe claim that gives its end too: the
-- caller's clock judges it by that end, and Redis' TTL (set in the same SET) bounds memory. Whatever ends gets a member in the expiry bucket of
-- its end (keys.rs), found by the sweeper through the bucket index.
local EXPIRY_BUCKET_MS = 3600000
-- String buckets outlive their end by a day, so a sweeper that runs late still finds them.
local BUCKET_GRACE_MS = 86400000
-- A compact dedupe claim (accept.lua, keys.rs) is one integer: its acceptance ms, then its
-- lifetime in minutes as 5 digits. Answers the acceptance ms and the end, nil for a string.
local function compact_claim(value)
  if not value or not string.find(value, '^%d%d%d%d%d%d+$') then return nil end
  local accepted = tonumber(string.sub(value, 1, -6))
  return accepted, accepted + tonumber(string.sub(value, -5)) * 60000
end
local function end_of(value)
  if not value then return nil end
  local _, ends = compact_claim(value)
  return ends or tonumber(string.match(value, '^(%d+)|'))
end
-- The payload of a string value whose end is after `now`, nil when it is absent, over or a
-- compact claim (which has no payload).
local function live_payload(value, now)
  local ends = value and tonumber(string.match(value, '^(%d+)|'))
  if not ends or ends <= now then return nil end
  return string.sub(value, string.find(value, '|', 1, true) + 1)
end
local function live(key, now)
  return live_payload(redis.call('GET', key), now)
end
-- `kind` is 'x' (strings) or 'xm' (messages); `buckets` the bucket index of the partition.
local function add_expiry(buckets, kind, member, ends, now)
  local b = math.floor(ends / EXPIRY_BUCKET_MS)
  local name = kind .. ':' .. b
  local list = string.sub(buckets, 1, -3) .. name
  if redis.call('RPUSH', list, member) == 1 then
    redis.call('ZADD', buckets, b * EXPIRY_BUCKET_MS, name)
    if kind == 'x' then
      redis.call('PEXPIRE', list, math.max((b + 1) * EXPIRY_BUCKET_MS - now, 1) + BUCKET_GRACE_MS)
    end
  end
end
-- Writes `value`, which ends at `ends`.
local function put_value(buckets, key, value, ends, now)
  redis.call('SET', key, value, 'PX', math.max(ends - now, 1))
  add_expiry(buckets, 'x', string.sub(key, string.len(buckets) - 1), ends, now)
end
-- Writes a string that ends at `ends`.
local function put(buckets, key, payload, ends, now)
  put_value(buckets, key, ends .. '|' .. payload, ends, now)
end
-- A finished or recorded message, kept until `ends`.
local function expire_message(buckets, message_key, id, ends, now)
  redis.call('HSET', message_key, 'end', ends)
  add_expiry(buckets, 'xm', 'm:' .. id, ends, now)
end

-- Applies one effect of store::lifecycle (src/store/lifecycle/effect.rs) to a message, if the
-- message still reads as the rule that decided it read it. It decides nothing: every state,
-- time and lifetime comes from the caller (src/store/redis/apply.rs). What it makes due by `now`
-- wakes other processes' dispatchers (wake.lua).
-- Answers 0 when the guard fails (nothing written: the caller reads again and asks the rule
-- again); 2 when something was made due (which tells the caller's claim to count the
-- partition again); else 1.
-- KEYS: 1 message hash, 2 attempts list, 3 due zset, 4 lease zset, 5 ordering queue,
--       6 index of the state before, 7 index of the state after, 8 expiry bucket index,
--       9 (a completion's) the partition's attempts-per-minute hash of the hour (counts.rs)
-- ARGV: 1 id, 2 now ms, 3 history row as JSON ('' = none), 4 the same row in the form a first
--       row is kept in (store/record.rs), 5 history tail, 6 rows keeping bodies,
--       7 due ('' = leave, '-' = not due, else ms), 8 lease end (same), 9 message end
--       ('' = leave, '-' = live again, else ms), 10 queue move ('' | 'join' | 'leave'),
--       11 the time the move makes its new head due, 12 guard count g, then g pairs
--       (field, expected value: the state's name, or a number, 0 for none; the field `@due`
--       is the message's score in the due zset), then a count s and s pairs to HSET, then a
--       count d and d fields to HDEL, then a count c and c pairs (field, n) to HINCRBY in
--       KEYS[9], then KEYS[9]'s lifetime in ms
local id = ARGV[1]
local now = tonumber(ARGV[2])
local at = 13
local guards = tonumber(ARGV[12])
if guards > 0 then
  local fields = {}
  for i = 0, guards - 1 do fields[i + 1] = ARGV[at + 2 * i] end
  local current = redis.call('HMGET', KEYS[1], unpack(fields))
  for i = 1, guards do
    local field, expected, value = fields[i], ARGV[at + 2 * i - 1], current[i]
    if field == '@due' then value = redis.call('ZSCORE', KEYS[3], id) end
    if field == 'state' then
      if (value or '') ~= expected then return 0 end
    elseif (tonumber(value or '0') or 0) ~= tonumber(expected) then
      return 0
    end
  end
end
at = at + 2 * guards
local sets = tonumber(ARGV[at])
if sets > 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, at + 1, at + 2 * sets))
end
at = at + 2 * sets + 1
local dels = tonumber(ARGV[at])
if dels > 0 then
  redis.call('HDEL', KEYS[1], unpack(ARGV, at + 1, at + dels))
end
if KEYS[6] ~= KEYS[7] then
  index_remove(KEYS[6], id)
  index_add(KEYS[7], id)
end
if ARGV[3] ~= '' then
  append_history(KEYS[1], KEYS[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]))
end
local made_due = false
-- whether this makes something due by now: other processes' dispatchers are woken for it
local due_now = false
if ARGV[7] == '-' then
  redis.call('ZREM', KEYS[3], id)
elseif ARGV[7] ~= '' then
  redis.call('ZADD', KEYS[3], ARGV[7], id)
  made_due = true
  due_now = tonumber(ARGV[7]) <= now
end
if ARGV[8] == '-' then
  redis.call('ZREM', KEYS[4], id)
elseif ARGV[8] ~= '' then
  redis.call('ZADD', KEYS[4], ARGV[8], id)
end
if ARGV[9] == '-' then
  -- live again: the sweeper skips its expiry member (v1 stores also had TTLs on these keys)
  redis.call('HDEL', KEYS[1], 'end')
  redis.call('PERSIST', KEYS[1])
  redis.call('PERSIST', KEYS[2])
elseif ARGV[9] ~= '' then
  -- ended: kept until then, and the sweeper deletes it with its index entries
  expire_message(KEYS[8], KEYS[1], id, tonumber(ARGV[9]), now)
end
if ARGV[10] == 'join' then
  if redis.call('RPUSH', KEYS[5], id) == 1 then
    redis.call('ZADD', KEYS[3], ARGV[11], id)
    made_due = true
    due_now = due_now or tonumber(ARGV[11]) <= now
  end
elseif ARGV[10] == 'leave' then
  redis.call('LREM', KEYS[5], 1, id)
  local head = redis.call('LINDEX', KEYS[5], 0)
  if head then
    redis.call('ZADD', KEYS[3], ARGV[11], head)
    made_due = true
    due_now = due_now or tonumber(ARGV[11]) <= now
  end
end
-- a completion counts its attempt in its minute (src/store/redis/counts.rs)
at = at + dels + 1
local counted = tonumber(ARGV[at])
if counted > 0 then
  for i = 1, counted do
    redis.call('HINCRBY', KEYS[9], ARGV[at + 2 * i - 1], ARGV[at + 2 * i])
  end
  redis.call('PEXPIRE', KEYS[9], ARGV[at + 2 * counted + 1])
end
if due_now then wake_dispatchers(KEYS[3]) end
if made_due then return 2 end
return 1

-- Shared by the scripts that append to a message's history (prepended to each).
-- Keeps the first row and the latest `tail` rows, and counts every row in the `hn` field.
local function append_history(message_key, attempts_key, row, tail)
  redis.call('RPUSH', attempts_key, row)
  redis.call('HINCRBY', message_key, 'hn', 1)
  if redis.call('LLEN', attempts_key) > tail + 1 then
    -- drop the oldest row after the first: Redis has no remove-by-index, so mark it and
    -- remove the mark (found at once, it is the second element)
    redis.call('LSET', attempts_key, 1, '\0')
    redis.call('LREM', attempts_key, 1, '\0')
  end
end

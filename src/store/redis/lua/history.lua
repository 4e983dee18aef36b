-- Shared by the scripts that append to a message's history (prepended to each).
-- Keeps the first row and the latest `tail` rows, and counts every row in the `hn` field.
-- The row that leaves the latest `bodies` rows (unless it is the first) drops its answer's
-- body (store::lifecycle's append_history). Rows are JSON written by callbackd; the one that
-- changes is decoded and encoded again, which keeps its fields and values.
local function append_history(message_key, attempts_key, row, tail, bodies)
  redis.call('RPUSH', attempts_key, row)
  redis.call('HINCRBY', message_key, 'hn', 1)
  local len = redis.call('LLEN', attempts_key)
  if len > tail + 1 then
    -- drop the oldest row after the first: Redis has no remove-by-index, so mark it and
    -- remove the mark (found at once, it is the second element)
    redis.call('LSET', attempts_key, 1, '\0')
    redis.call('LREM', attempts_key, 1, '\0')
    len = len - 1
  end
  local older = len - 1 - bodies
  if older >= 1 then
    local text = redis.call('LINDEX', attempts_key, older)
    -- most rows have no body to drop: only those are decoded
    if text and string.find(text, '"body":"[^"]') then
      local decoded = cjson.decode(text)
      local answer = decoded.response
      if type(answer) == 'table' and type(answer.body) == 'string' and answer.body ~= '' then
        answer.body = ''
        answer.bodyDropped = true
        redis.call('LSET', attempts_key, older, cjson.encode(decoded))
      end
    end
  end
end

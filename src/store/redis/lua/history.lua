-- Shared by the scripts that append to a message's history (prepended to each, after
-- pieces.lua). Keeps the first row and the latest `tail` rows, and counts every row in the
-- `hn` field. The first row goes into the message hash in pieces `h0`, `h1`, ... (pieces.lua),
-- in the compact form Rust made of it (`first_form`, store/record.rs), so a message with one
-- row, as most are, has no list; the rows after it go to the list `attempts_key` as JSON. A
-- message whose first row is in the list (written by layout 4 or before) keeps it there.
-- The row that leaves the latest `bodies` rows (unless it is the first) drops its answer's
-- body (store::lifecycle's append_history). Rows are JSON written by callbackd; the one that
-- changes is decoded and encoded again, which keeps its fields and values.
local function append_history(message_key, attempts_key, row, first_form, tail, bodies)
  if redis.call('HINCRBY', message_key, 'hn', 1) == 1 then
    local fields = {}
    add_pieces(fields, 'h', first_form)
    redis.call('HSET', message_key, unpack(fields))
    return
  end
  -- the list's index of the oldest row after the first
  local after_first = 1
  if redis.call('HEXISTS', message_key, 'h0') == 1 then after_first = 0 end
  redis.call('RPUSH', attempts_key, row)
  local len = redis.call('LLEN', attempts_key)
  if len - after_first > tail then
    -- drop the oldest row after the first: Redis has no remove-by-index, so mark it and
    -- remove the mark (found at once, it is the first or second element)
    redis.call('LSET', attempts_key, after_first, '\0')
    redis.call('LREM', attempts_key, 1, '\0')
    len = len - 1
  end
  local older = len - 1 - bodies
  if older >= after_first then
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

-- Applies store::lifecycle::accept (src/store/lifecycle/rules.rs) in one atomic step: checks
-- the live claim, seal and payment status as the rule does, and writes the plan Rust made
-- (lifecycle::accept_plan): the claim's, seal's, payment's and message's ends, the message's
-- first state and its place in its queue. A message that heads its queue and is due now wakes
-- other processes' dispatchers (wake.lua).
-- KEYS: 1 dedupe, 2 message hash, 3 ordering queue, 4 due zset, 5 index of the initial state,
--       6 the ordering key's bucket of the key index (keys.rs), 7 payment status, 8 expiry bucket index,
--       9 signature seal (a key that never exists when there is no seal),
--       10 the source's inbound counts of the hour (recoveries.rs; never written when ARGV[18]
--       is '')
-- ARGV: 1 claim end ms, 2 fingerprint, 3 stored response, 4 id, 5 record (record.rs), 6 now ms,
--       7 first state, 8 payment target status ('' = none),
--       9 allowed previous statuses (space separated), 10 payment state end ms,
--       11 message end ms ('' = none), 12 seal expiry ms ('' = no seal), 13 short hash of the
--       ordering key, 14 the digits after the time of the id a compact claim of this claim
--       key names (partition, claim key hash), 15 the compact claim to write ('' = write
--       the string form), 16 the time the message is due if it heads its queue ('' = it
--       joins no queue), 17 the status a payment never seen counts as, 18 the minute of
--       the hour an inbound callback is counted in ('' = not counted), 19 how long (ms) the
--       counts' hash lives
--
-- Lifetimes are decided by the caller's clock (expiry.lua): a string past its end is treated
-- as absent, and the sweeper deletes it.
local now = tonumber(ARGV[6])
-- An inbound callback recorded ('n') or replayed ('r') counts in its source's minute, in this
-- same step (store/recoveries.rs).
local function arrived(kind)
  if ARGV[18] ~= '' then
    -- The hash's end is the end of its hour plus the counts' lifetime, the same for every
    -- accept of the hour: set once per minute and kind (when the field is created), not on
    -- every accept.
    if redis.call('HINCRBY', KEYS[10], ARGV[18] .. kind, 1) == 1 then
      redis.call('PEXPIRE', KEYS[10], ARGV[19])
    end
  end
end
-- The live claim of this request's dedupe key: its fingerprint, stored response and end.
local claim = redis.call('GET', KEYS[1])
local accepted, claim_ends = compact_claim(claim)
local claim_fingerprint, claim_response
if accepted then
  if claim_ends > now then
    -- It was written only for an empty fingerprint and the answer naming the derived id,
    -- rebuilt here in the stored-response form of that id (keys.rs).
    claim_fingerprint = ''
    claim_response = '#' .. string.format('%012x', accepted) .. ARGV[14]
  end
else
  local existing = live_payload(claim, now)
  if existing then
    local sep = string.find(existing, '\n', 1, true)
    claim_fingerprint = string.sub(existing, 1, sep - 1)
    claim_response = string.sub(existing, sep + 1)
    claim_ends = end_of(claim)
  end
end
-- A live seal holds the answer of the claim its signature was accepted under, which names
-- that claim's message: the same answer is a replay; anything else is the same signed bytes
-- under another dedupe key, refused with nothing written.
if ARGV[12] ~= '' then
  local first = live(KEYS[9], now)
  if first then
    if first == claim_response then
      arrived('r')
      return {'dup', first}
    end
    return {'reused'}
  end
end
-- A seal ends with its claim at the latest, so a live seal's claim is live.
local function seal(response, ends)
  if ARGV[12] ~= '' then
    put(KEYS[8], KEYS[9], response, math.min(tonumber(ARGV[12]), ends), now)
  end
end
if claim_response then
  if claim_fingerprint ~= ARGV[2] then
    return {'conflict'}
  end
  seal(claim_response, claim_ends)
  arrived('r')
  return {'dup', claim_response}
end
if ARGV[8] ~= '' then
  local current = live(KEYS[7], now) or ARGV[17]
  local allowed = false
  for status in string.gmatch(ARGV[9], '%S+') do
    if status == current then allowed = true end
  end
  if not allowed then
    return {'transition', current}
  end
  put(KEYS[8], KEYS[7], ARGV[8], tonumber(ARGV[10]), now)
end
local id = ARGV[4]
local claim_until = tonumber(ARGV[1])
if ARGV[15] ~= '' then
  put_value(KEYS[8], KEYS[1], ARGV[15], claim_until, now)
else
  put(KEYS[8], KEYS[1], ARGV[2] .. '\n' .. ARGV[3], claim_until, now)
end
seal(ARGV[3], claim_until)
-- The record goes in pieces `r0`, `r1`, ... (pieces.lua), so the hash stays a listpack, and
-- first: a listpack keeps its fields in the order they came, and a value that changes length
-- (a state, a count) moves every byte after it, which are then the few fields written later,
-- not the record.
local fields = {}
add_pieces(fields, 'r', ARGV[5])
fields[#fields + 1] = 'state'
fields[#fields + 1] = ARGV[7]
fields[#fields + 1] = 'kh'
fields[#fields + 1] = ARGV[13]
-- The other fields start at their defaults, which an absent field means.
if ARGV[11] ~= '' then
  local ends = tonumber(ARGV[11])
  fields[#fields + 1] = 'end'
  fields[#fields + 1] = ends
  add_expiry(KEYS[8], 'xm', 'm:' .. id, ends, now)
end
redis.call('HSET', KEYS[2], unpack(fields))
if ARGV[16] ~= '' and redis.call('RPUSH', KEYS[3], id) == 1 then
  redis.call('ZADD', KEYS[4], ARGV[16], id)
  if tonumber(ARGV[16]) <= now then wake_dispatchers(KEYS[4]) end
end
index_add(KEYS[5], id)
-- the bucket is named by the key hash's first character, the member by the rest (keys.rs)
redis.call('ZADD', KEYS[6], 0, string.sub(ARGV[13], 2) .. ':' .. id)
arrived('n')
return {'ok'}

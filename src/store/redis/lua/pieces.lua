-- Shared by the scripts that keep long values in a message hash (prepended to each).
-- A hash with a value longer than Redis' default `hash-max-listpack-value` (64 bytes) is a
-- hashtable, a dict with an entry and two strings per field, where a listpack is one
-- allocation. A long value (a message's record, its first history row) is therefore kept in
-- pieces `<prefix>0`, `<prefix>1`, ... of at most 64 bytes; record.rs puts them together in
-- Rust.
local PIECE = 64
-- Appends the fields and values of `value`'s pieces to `fields`, for an HSET.
local function add_pieces(fields, prefix, value)
  for i = 0, math.ceil(#value / PIECE) - 1 do
    fields[#fields + 1] = prefix .. i
    fields[#fields + 1] = string.sub(value, i * PIECE + 1, (i + 1) * PIECE)
  end
end
-- The value in pieces `<prefix>0`, ... of hash `key`, given its first pieces as the caller read
-- them with its other fields (`false` where absent): when they hold it all, it costs no more
-- commands; the rest are read 8 at a time up to the first absent one.
local function joined(key, prefix, first)
  local pieces = {}
  for _, piece in ipairs(first) do
    if not piece then return table.concat(pieces) end
    pieces[#pieces + 1] = piece
  end
  local next_piece = #first
  while true do
    local names = {}
    for i = next_piece, next_piece + 7 do names[#names + 1] = prefix .. i end
    for _, piece in ipairs(redis.call('HMGET', key, unpack(names))) do
      if not piece then return table.concat(pieces) end
      pieces[#pieces + 1] = piece
    end
    next_piece = next_piece + 8
  end
end

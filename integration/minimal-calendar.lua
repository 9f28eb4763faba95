-- The least a calendar period's decision does (a baseline of
-- integration/bench-script-ir.sh): TIME, GET the period's packed count,
-- and when admitted SET … PX until the period ends. ARGV: limit, the
-- period's start and end (Unix seconds), the next one's end.
local limit, start, stop = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local time = redis.call('TIME')
local now_s = tonumber(time[1])
if now_s >= stop then start, stop = stop, tonumber(ARGV[4]) end
local count = 0
local value = redis.call('GET', KEYS[1])
if value then
  local c, s = struct.unpack('<dd', value)
  if s == start then count = c end
end
if count + 1 > limit then
  return { 0, 0, stop - now_s, stop - now_s, 0, 0, 0 }
end
count = count + 1
redis.call('SET', KEYS[1], struct.pack('<dd', count, start), 'PX', (stop - now_s) * 1000)
return { 1, limit - count, -1, stop - now_s, 0, 0, 1 }

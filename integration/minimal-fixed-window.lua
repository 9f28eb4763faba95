-- The least a fixed-window decision does (the baseline of
-- integration/bench-script-ir.sh): GET the window's packed count, TIME,
-- count the hit when the window is the current one, SET … PX until the
-- window ends. ARGV: limit, window seconds.
local limit, length = tonumber(ARGV[1]), tonumber(ARGV[2])
local time = redis.call('TIME')
local now_s = tonumber(time[1])
local start = now_s - now_s % length
local count = 0
local value = redis.call('GET', KEYS[1])
if value then
  local c, s = struct.unpack('<dd', value)
  if s == start then count = c end
end
count = count + 1
local ms = (start + length - now_s) * 1000
redis.call('SET', KEYS[1], struct.pack('<dd', count, start), 'PX', ms)
if count > limit then
  return { 0, 0, start + length - now_s, start + length - now_s, 0, count, 0 }
end
return { 1, limit - count, -1, start + length - now_s, 0, count, 1 }

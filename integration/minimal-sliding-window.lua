-- The least a sliding-window decision does (a baseline of
-- integration/bench-script-ir.sh): TIME, GET the packed counts (the window
-- before's and the current one's, and the current window's start), the
-- weighted estimate, and when admitted SET … PX for two windows. ARGV:
-- limit, window seconds.
local SHIFT = 67108864
local limit, length = tonumber(ARGV[1]), tonumber(ARGV[2])
local time = redis.call('TIME')
local now_s = tonumber(time[1])
local now = now_s * 1000000 + tonumber(time[2])
local start = now_s - now_s % length
local prev, cur = 0, 0
local value = redis.call('GET', KEYS[1])
if value then
  local counts, s = struct.unpack('<dd', value)
  local p = math.floor(counts / SHIFT)
  if s == start then
    prev, cur = p, counts - p * SHIFT
  elseif s + length == start then
    prev = counts - p * SHIFT
  end
end
local estimate = prev * (1 - (now - start * 1000000) / (length * 1000000)) + cur
if estimate + 1 > limit then
  return { 0, 0, 1, length, 0, 0, 0 }
end
cur = cur + 1
redis.call('SET', KEYS[1], struct.pack('<dd', prev * SHIFT + cur, start), 'PX', (start + 2 * length - now_s) * 1000)
return { 1, math.floor(limit - estimate - 1), -1, length, 0, 0, 1 }

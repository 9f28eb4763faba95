-- The least a reservation's start does (a baseline of
-- integration/bench-script-ir.sh): the minimal dedupe start
-- (integration/minimal-dedupe.lua), plus the descriptor's unsettled
-- reservations (KEYS[3], a sorted set): the expired ones taken off, and
-- when admitted this one added and the set's expiry moved. ARGV as
-- minimal-dedupe.lua's, then the attempt id.
local cap, rate, unit = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local needed = tonumber(ARGV[2])
local ttl = tonumber(ARGV[10])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local now_ms = math.floor(now / 1000)
local record = redis.call('GET', KEYS[2])
if record then
  return { 1, 0, -1, 0, 0, 0, 0, 1, 0 }
end
local expired = redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
local t, u = cap, now
local value = redis.call('GET', KEYS[1])
if value then
  t, u = struct.unpack('<dd', value)
  if now > u then t = math.min(cap, t + (now - u) * rate / (unit * 1e6)); u = now end
end
local per_sec = rate / unit
if t < needed then
  return { 0, math.floor(t), math.ceil((needed - t) / per_sec), 0, 0, 0, 0, 0, expired }
end
t = t - needed
local ms = math.ceil((cap - t) / per_sec * 1000) + 1000
redis.call('SET', KEYS[1], struct.pack('<dd', t, u), 'PX', ms)
redis.call('SET', KEYS[2], struct.pack('<dddd', needed, 0, now_ms + ttl, now_ms + 2 * ttl), 'PX', 2 * ttl)
redis.call('ZADD', KEYS[3], now_ms + ttl, ARGV[11])
redis.call('PEXPIRE', KEYS[3], 2 * ttl)
return { 1, math.floor(t), -1, math.ceil((cap - t) / per_sec), 0, 0, needed, 0, expired }

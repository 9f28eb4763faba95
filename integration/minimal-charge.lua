-- The least an overdraft charge does (a baseline of
-- integration/bench-script-ir.sh): the minimal token-bucket decision
-- (integration/minimal-bucket.lua), deducting whatever the verdict, down
-- to minus the burst. ARGV as minimal-bucket.lua's.
local cap, rate, unit = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local needed = tonumber(ARGV[2])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local t, u = cap, now
local value = redis.call('GET', KEYS[1])
if value then
  t, u = struct.unpack('<dd', value)
  if now > u then t = math.min(cap, t + (now - u) * rate / (unit * 1e6)); u = now end
end
local per_sec = rate / unit
local admitted = t >= needed
t = math.max(-cap, t - needed)
local ms = math.ceil((cap - t) / per_sec * 1000) + 1000
redis.call('SET', KEYS[1], struct.pack('<dd', t, u), 'PX', ms)
if admitted then
  return { 1, math.floor(t), -1, math.ceil((cap - t) / per_sec), 0, 0, needed }
end
return { 0, 0, math.ceil((needed - t) / per_sec), math.ceil((cap - t) / per_sec), 0, 0, needed }

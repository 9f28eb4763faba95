-- the least a token-bucket decision can be: one GET, TIME, the refill, one SET
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
if t < needed then
  return { 0, math.floor(t), math.ceil((needed - t) / per_sec), 0, 0, 0, 0 }
end
t = t - needed
local ms = math.ceil((cap - t) / per_sec * 1000) + 1000
redis.call('SET', KEYS[1], struct.pack('<dd', t, u), 'PX', ms)
return { 1, math.floor(t), -1, math.ceil((cap - t) / per_sec), 0, 0, needed }

-- The least a concurrency slot's start does (a baseline of
-- integration/bench-script-ir.sh, beside src/store/redis/slots.lua): TIME,
-- the slots that returned by themselves taken off, the attempt's slot
-- looked up, and when one is free, taken, the set's expiry moved. ARGV as
-- slots.lua's: phase, the attempt id, the most slots, ttl ms, the most
-- repeats.
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local key, id = KEYS[1], ARGV[2]
local expired = redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms)
if redis.call('ZSCORE', key, id) then
  return { 1, 0, 1, expired }
end
local held = redis.call('ZCARD', key)
if held >= tonumber(ARGV[3]) then
  return { 0, held, 0, expired }
end
local ttl_ms = tonumber(ARGV[4])
redis.call('ZADD', key, now_ms + ttl_ms, id)
redis.call('PEXPIRE', key, 2 * ttl_ms)
return { 1, held + 1, 0, expired }

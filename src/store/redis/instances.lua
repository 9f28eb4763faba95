-- tokenbucket-rls: one instance's announcement that it is there.
--
-- KEYS[1]  the instances' sorted set (member: an instance's id, score: when
--          its announcement lapses, ms of this server's TIME)
-- ARGV[1]  this instance's id
-- ARGV[2]  how long the announcement counts (ms); 0 withdraws it
--
-- Returns {instances counted}: those whose announcement has not lapsed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
-- no instance announces further ahead than its time to live: a member
-- that lapses later was not written by one (ttl 0: withdrawn, keep them)
if ttl > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '(' .. (now + ttl), '+inf')
end
local n = redis.call('ZCARD', KEYS[1])
if n > 0 then
  redis.call('PEXPIRE', KEYS[1], math.max(ttl, 1000) * 2)
end
return {n}

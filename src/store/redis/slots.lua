-- tokenbucket-rls: a `concurrency` rule's slots, taken and released.
--
-- The Lua copy of `take_slot` and `release_slot` in src/attempt.rs;
-- tests/attempt_cases.rs checks that both give the same answers.
--
-- KEYS[1]: the descriptor's slots, a sorted set of attempt id -> the time
-- (ms, this server's TIME) its slot returns by itself. It expires a ttl
-- after its last slot (slots that returned by themselves are counted by
-- the next call within that ttl; later, not at all).
-- A slot's score also counts the repeats of its start, in 128ths (a
-- return time in ms is a whole number, so the fraction is free; it returns
-- at most a millisecond later for it).
-- ARGV: phase (0 take, 1 release), the attempt id, the most slots, ttl_ms,
-- the most repeats of a start that holds a slot (at most 100).
-- Returns {admitted (1/0), slots held after, result (0 first, 1 repeat, 4
-- not held: a release of no slot held, 5 released, 6 reused: a start
-- repeated past the most repeats, refused), slots that returned by
-- themselves before this call}.

local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local key, id = KEYS[1], ARGV[2]
local expired = redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms)
local held = redis.call('ZSCORE', key, id)
local admitted, result = 1, 0
if tonumber(ARGV[1]) == 0 then
  if held then
    local score = tonumber(held)
    local repeats = math.floor((score - math.floor(score)) * 128 + 0.5)
    if repeats < tonumber(ARGV[5]) then
      redis.call('ZADD', key, 'XX', score + 1 / 128, id)
      result = 1
    else
      admitted, result = 0, 6
    end
  else
    local count = redis.call('ZCARD', key)
    if count < tonumber(ARGV[3]) then
      local ttl_ms = tonumber(ARGV[4])
      redis.call('ZADD', key, now_ms + ttl_ms, id)
      -- the set goes a ttl after the slot that returns last: a call within
      -- that ttl still sees (and counts) the slots that returned by
      -- themselves. This slot returns last unless a reload shortened the
      -- ttl, and then the expiry already set (a longer one) stays
      if redis.call('PTTL', key) < 2 * ttl_ms then
        redis.call('PEXPIRE', key, 2 * ttl_ms)
      end
      return { admitted, count + 1, result, expired }
    end
    admitted = 0
    return { admitted, count, result, expired }
  end
elseif held then
  redis.call('ZREM', key, id)
  result = 5
else
  result = 4
end
return { admitted, redis.call('ZCARD', key), result, expired }

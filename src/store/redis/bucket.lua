-- tokenbucket-rls: decide one descriptor's token buckets atomically.
--
-- The Lua copy of src/bucket.rs; tests/bucket_cases.rs checks that
-- both give the same answers. Keep the expressions in the same order.
--
-- KEYS[i]  one hash per bucket: t = tokens (float), u = last update (µs)
-- ARGV[1]  tokens needed to admit
-- ARGV[2]  tokens to deduct when admitted (0 for a check, negative for a
--          refund); more than ARGV[1] for a lease: take as many whole tokens as
--          every bucket holds, up to ARGV[2], and at least ARGV[1]
-- ARGV[3]  expiry margin in ms, added to the time a bucket needs to refill
-- ARGV[4 + 3(i-1) ..]  per bucket: capacity, tokens_per_unit, unit_secs
--
-- Returns {admitted, then per bucket: remaining, retry_after (-1: none),
-- full_in, never (0: no, 1: zero rate, 2: cost above capacity), then the
-- tokens taken (0 unless admitted and spending or leasing)}.
-- Time is this server's TIME; an earlier time adds no tokens. A bucket is
-- only written when the request is admitted and spends; it expires once it
-- would be full again, plus the margin, never sooner. A bucket that would
-- take longer than MAX_TTL_MS to fill does not expire. A rejection or a check
-- writes no state, but lengthens an existing bucket's expiry when the rules'
-- numbers now need longer (a reload lowered the rate). Every number handed
-- to a command is formatted as an integer: Lua would print a large float in
-- exponent form, which Redis refuses.

local EPSILON = 1e-9
local MAX_TTL_MS = 3153600000000 -- 100 years
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local needed = tonumber(ARGV[1])
local deducted = tonumber(ARGV[2])
local margin_ms = tonumber(ARGV[3])

local n = #KEYS
local caps, rates, units, tokens, stamps, existed = {}, {}, {}, {}, {}, {}
local all_admit = true
local retry, never = {}, {}

for i = 1, n do
  local cap = tonumber(ARGV[4 + 3 * (i - 1)])
  local rate = tonumber(ARGV[5 + 3 * (i - 1)])
  local unit = tonumber(ARGV[6 + 3 * (i - 1)])
  caps[i], rates[i], units[i] = cap, rate, unit
  local state = redis.call('HMGET', KEYS[i], 't', 'u')
  local t, u
  existed[i] = state[1] and state[2]
  if not state[1] or not state[2] then
    t, u = cap, now
  else
    t, u = tonumber(state[1]), tonumber(state[2])
    if now > u then
      t = math.min(cap, t + (now - u) * rate / (unit * 1e6))
      u = now
    else
      t = math.min(cap, t)
    end
  end
  tokens[i], stamps[i] = t, u

  retry[i], never[i] = -1, 0
  if rate == 0 or unit == 0 then
    never[i] = 1
  elseif needed > cap then
    never[i] = 2
  elseif t + EPSILON < needed then
    local secs = math.ceil((needed - t) / (rate / unit) - EPSILON)
    retry[i] = math.max(1, secs)
  end
  if never[i] ~= 0 or retry[i] ~= -1 then
    all_admit = false
  end
end

if deducted > needed then
  local available = math.huge
  for i = 1, n do
    available = math.min(available, math.floor(tokens[i] + EPSILON))
  end
  deducted = math.max(needed, math.min(deducted, available))
end

-- Milliseconds until a bucket holding t is full, plus the margin; nil when
-- that is longer than MAX_TTL_MS or never (rate 0).
local function ttl_ms(i, t)
  local per_sec = 0
  if units[i] ~= 0 then per_sec = rates[i] / units[i] end
  if per_sec <= 0 then return nil end
  local ms = math.ceil((caps[i] - t) / per_sec * 1000) + margin_ms
  if ms > MAX_TTL_MS then return nil end
  return ms
end

local function expire(i, ms)
  if ms then
    redis.call('PEXPIRE', KEYS[i], string.format('%d', ms))
  else
    redis.call('PERSIST', KEYS[i])
  end
end

if all_admit and deducted ~= 0 then
  for i = 1, n do
    local t = math.min(caps[i], math.max(0, tokens[i] - deducted))
    tokens[i] = t
    redis.call('HSET', KEYS[i], 't', string.format('%.17g', t), 'u', string.format('%d', stamps[i]))
    expire(i, ttl_ms(i, t))
  end
else
  for i = 1, n do
    if existed[i] then
      local want = ttl_ms(i, tokens[i])
      local have = redis.call('PTTL', KEYS[i])
      -- more than the margin short: the rules changed (a rounding
      -- millisecond must not turn every rejection into a write)
      if have >= 0 and (want == nil or have + margin_ms < want) then
        expire(i, want)
      end
    end
  end
end

local out = { all_admit and 1 or 0 }
for i = 1, n do
  local t = tokens[i]
  local remaining = math.floor(t + EPSILON)
  if remaining < 0 or never[i] == 1 then remaining = 0 end
  local full_in = 0
  local missing = caps[i] - t
  local per_sec = 0
  if units[i] ~= 0 then per_sec = rates[i] / units[i] end
  if missing > EPSILON and per_sec > 0 then
    full_in = math.max(0, math.ceil(missing / per_sec - EPSILON))
  end
  local r = retry[i]
  if all_admit then r = -1 end
  out[#out + 1] = remaining
  out[#out + 1] = r
  out[#out + 1] = full_in
  out[#out + 1] = never[i]
end
if all_admit and deducted > 0 then
  out[#out + 1] = deducted
else
  out[#out + 1] = 0
end
return out

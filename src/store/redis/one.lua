-- tokenbucket-rls: decide one bucket of one descriptor, atomically.
--
-- The lean script of the commonest decision: one bucket (a rule of one
-- limit) of any kind (a token bucket, a fixed window, a sliding window, a
-- calendar period), not an attempt's call, its buckets written in the
-- packed layout. Everything else (several limits, attempts, the hash
-- layout of earlier versions written, a batch of decisions) runs
-- bucket.lua, whose header gives the arguments (this script takes the
-- same: one packed group, n = 1), the stored values and the answers; this
-- one reads and writes them alike (the hash layout of earlier versions
-- read too), and answers as bucket.lua does for one bucket, to the field
-- (tests/bucket_cases.rs runs every case table through both and through
-- the Rust copies in src/bucket.rs, src/window.rs and src/window/sliding.rs).
--
-- Why a script of its own: a redis-server pays per Lua operation, and
-- most for each call of a C function (tonumber, math.floor, type …: ~400
-- instructions each, a plain decision's whole work being ~50,000).
-- bucket.lua's general frame (a batch's loop, an attempt's record, a
-- table of every bucket's numbers) cost a window 1.22-1.31× a minimal
-- script doing only its work; here the one bucket's numbers stay in
-- locals, floors and ceilings are written as `x - x % 1` (Lua's `%`
-- floors), strings become numbers by arithmetic, and the microseconds
-- are read only by the kinds that need them. integration/bench-script-ir.sh
-- counts its instructions beside integration/minimal-*.lua.

local group = ARGV[1]
local _, _, charge, _, fixed, sliding, calendar, needed, deducted, margin_ms, a1, a2, a3, a4 =
  struct.unpack('<HBBBBBBddddddd', group)
local time = redis.call('TIME')
local now_s = time[1] + 0
local key = KEYS[1]
local value = redis.pcall('GET', key)
-- what is stored (su -1: nothing), and whether the key is a hash (the
-- layout of earlier versions, read by a token bucket; none to a window)
local st, su, se = -1, -1, 0
local hashed = false
if value then
  if #value == 24 then
    st, su, se = struct.unpack('<ddd', value)
  elseif value.err then
    if string.sub(value.err, 1, 9) ~= 'WRONGTYPE' then return value end
    hashed = true
  end
end

if fixed == 1 then
  -- a1 unused, a2 the limit, a3 the window's length (seconds)
  local limit, length = a2, a3
  if length < 1 then length = 1 end
  local into = now_s % length
  local start = (now_s - into) * 1000000
  local count = 0
  if su == start and st > 0 then count = st end
  local counted = 0
  if deducted > 0 then counted = deducted end
  local over = needed > 0 and count + counted > limit
  local after = count + counted
  local left = length - into
  if counted > 0 then
    -- expiring when the window ends, plus the margin
    local ms = left * 1000 + margin_ms
    redis.call('SET', key, struct.pack('<ddd', after, start, now_s * 1000 + ms), 'PX', ms)
  end
  if not over then
    local remaining = limit - after
    if remaining < 0 then remaining = 0 end
    return { 1, remaining, -1, left, 0, after, counted }
  end
  local retry, never = left, 0
  if limit == 0 then
    retry, never = -1, 1
  elseif counted > limit then
    retry, never = -1, 2
  end
  local taken = 0
  if charge == 1 then taken = counted end
  return { 0, 0, retry, left, never, after, taken }
end

if calendar == 1 then
  -- a1 the period's start, a2 the limit, a3 its end, a4 the next one's
  -- end (Unix seconds)
  local limit, start_s, stop_s = a2, a1, a3
  if now_s >= stop_s then start_s, stop_s = stop_s, a4 end
  local start = start_s * 1000000
  local count = 0
  if su == start and st > 0 then count = st end
  -- 0 fits, 1 wait, 2 never (a limit of 0), 3 never (cost)
  local verdict = 0
  if needed == 0 then
    verdict = 0
  elseif limit == 0 then
    verdict = 2
  elseif needed > limit then
    verdict = 3
  elseif count + needed > limit then
    verdict = 1
  end
  local left = stop_s - now_s
  local after = count
  local applies = verdict == 0 or (charge == 1 and verdict ~= 2)
  if applies and deducted ~= 0 then
    after = after + deducted
    if after < 0 then after = 0 end
    -- expiring when the period ends, plus the margin
    local ms = left * 1000 + margin_ms
    redis.call('SET', key, struct.pack('<ddd', after, start, now_s * 1000 + ms), 'PX', ms)
  end
  local remaining = limit - after
  if remaining < 0 then remaining = 0 end
  if left < 0 then left = 0 end
  local taken = 0
  if applies and deducted > 0 then taken = deducted end
  if verdict == 0 then return { 1, remaining, -1, left, 0, 0, taken } end
  local retry, never = -1, 0
  if verdict == 1 then
    retry = left
    if retry < 1 then retry = 1 end
  else
    never = verdict - 1
  end
  return { 0, remaining, retry, left, never, 0, taken }
end

local EPSILON = 1e-9

if sliding == 1 then
  -- a2 the limit, a3 the window's length (seconds)
  -- the window before's count and the current one's share one number
  local SHIFT = 67108864
  local limit, secs = a2, a3
  if secs < 1 then secs = 1 end
  local us = time[2] + 0
  local now = now_s * 1000000 + us
  local length = secs * 1000000
  local start = (now_s - now_s % secs) * 1000000
  local at_now, prev, cur = now, 0, 0
  if su >= 0 then
    local sp = st / SHIFT
    sp = sp - sp % 1
    local sc = st - sp * SHIFT
    if su == start then
      prev, cur = sp, sc
    elseif su + length == start then
      prev = sc
    elseif su > start then
      -- a clock stepped back: read at the stored window's start
      start, at_now, prev, cur = su, su, sp, sc
    end
  end
  local estimate = prev * (1 - (at_now - start) / length) + cur
  -- 0 fits, 1 wait, 2 never (zero rate), 3 never (cost)
  local verdict = 0
  if needed == 0 and deducted <= 0 then
    verdict = 0
  elseif limit == 0 then
    verdict = 2
  elseif needed > limit then
    verdict = 3
  elseif estimate + needed > limit + EPSILON then
    verdict = 1
  end
  local counted = needed
  if deducted < needed then counted = deducted end
  -- a charge counts whatever the verdict, except on a limit of 0
  local applies = verdict == 0 or (charge == 1 and verdict ~= 2)
  if applies and counted ~= 0 then
    cur = cur + counted
    if cur < 0 then cur = 0 elseif cur > SHIFT - 1 then cur = SHIFT - 1 end
    -- expiring two windows after the current one's start, plus the margin
    local until_us = start + 2 * length - now
    local ms = (until_us - until_us % 1000) / 1000
    if until_us % 1000 > 0 then ms = ms + 1 end
    ms = ms + margin_ms
    local now_ms = now_s * 1000 + (us - us % 1000) / 1000
    redis.call('SET', key, struct.pack('<ddd', prev * SHIFT + cur, start, now_ms + ms), 'PX', ms)
    estimate = prev * (1 - (at_now - start) / length) + cur
  end
  local remaining = 0
  if limit > estimate then
    remaining = limit - estimate + EPSILON
    remaining = remaining - remaining % 1
  end
  local full_in = 0
  if cur > 0 then
    full_in = start + 2 * length - at_now
  elseif prev > 0 then
    full_in = start + length - at_now
  end
  if full_in ~= 0 then
    local part = full_in % 1000000
    full_in = (full_in - part) / 1000000
    if part > 0 then full_in = full_in + 1 end
  end
  local taken = 0
  if applies and counted > 0 then taken = counted end
  if verdict == 0 then return { 1, remaining, -1, full_in, 0, 0, taken } end
  local retry, never = -1, 0
  if verdict == 1 then
    local until_us
    if cur + needed <= limit + EPSILON then
      until_us = start + (1 - (limit - cur - needed) / prev) * length
    else
      until_us = start + length + (1 - (limit - needed) / cur) * length
    end
    retry = (until_us - at_now) / 1000000 - EPSILON
    local part = retry % 1
    retry = retry - part
    if part > 0 then retry = retry + 1 end
    if retry < 1 then retry = 1 end
  else
    never = verdict - 1
  end
  return { 0, remaining, retry, full_in, never, 0, taken }
end

-- a token bucket: a1 its capacity (burst), a2 tokens per unit, a3 the
-- unit (seconds), a4 the most debt a charge may leave (-1: the capacity)
local MAX_TTL_MS = 3153600000000 -- 100 years
local cap, rate, unit, debt = a1, a2, a3, a4
if debt < 0 then debt = cap end
local per_sec = 0
if unit ~= 0 then per_sec = rate / unit end
local us = time[2] + 0
local now = now_s * 1000000 + us
-- layout: 0 no key, 1 packed, 2 hash
local layout = 0
if su >= 0 then
  layout = 1
elseif hashed then
  local state = redis.call('HMGET', key, 't', 'u')
  if state[1] and state[2] then
    layout = 2
    st, su = state[1] + 0, state[2] + 0
  end
end
local t, u = cap, now
if layout ~= 0 then
  t, u = st, su
  if now > u then
    t = t + (now - u) * rate / (unit * 1e6)
    u = now
  end
  if t > cap then t = cap end
end

local retry, never = -1, 0
if deducted < 0 then
  -- a refund is answered OK whatever the rule, rate 0 too
elseif rate == 0 or unit == 0 then
  never = 1
elseif needed > cap then
  never = 2
elseif t + EPSILON < needed then
  local secs = (needed - t) / (rate / unit) - EPSILON
  local part = secs % 1
  secs = secs - part
  if part > 0 then secs = secs + 1 end
  if secs < 1 then secs = 1 end
  retry = secs
end
local admit = never == 0 and retry == -1

-- a charge applies whatever the verdict, unless the bucket never refills
local applies = admit or (charge == 1 and never ~= 1)

if deducted > needed then
  -- a lease: as many whole tokens as the bucket holds, up to deducted
  local available = t + EPSILON
  available = available - available % 1
  if available < deducted then deducted = available end
  if deducted < needed then deducted = needed end
end

local forgiven = 0
local write, wt, wu, ms = false, 0, 0, nil
if applies and deducted ~= 0 then
  -- a charge may go into debt, down to -debt, and never raises a balance
  -- already below that; nothing else goes below where the bucket is
  local lowest = 0
  if charge == 1 then lowest = -debt end
  if t < lowest then lowest = t end
  local wanted = t - deducted
  if wanted < lowest then
    forgiven = lowest - wanted + 0.5
    forgiven = forgiven - forgiven % 1
    wanted = lowest
  end
  if wanted > cap then wanted = cap end
  t = wanted
  -- a charge answered OVER_LIMIT waits from where it left the bucket
  if charge == 1 and not admit and never == 0 then
    if t + EPSILON < needed then
      local secs = (needed - t) / per_sec - EPSILON
      local part = secs % 1
      secs = secs - part
      if part > 0 then secs = secs + 1 end
      if secs < 1 then secs = 1 end
      retry = secs
    else
      retry = -1
    end
  end
  -- a bucket of rate 0 (only a refund gets here) never refills: nothing
  -- of it is worth a key that would never expire
  if per_sec > 0 then
    write, wt, wu = true, t, u
    local x = (cap - t) / per_sec * 1000
    local part = x % 1
    ms = x - part
    if part > 0 then ms = ms + 1 end
    ms = ms + margin_ms
    if ms > MAX_TTL_MS then ms = nil end
  end
elseif layout ~= 0 then
  -- a rejection or a check: the expiry lengthened when the rules' numbers
  -- now need longer (more than the margin short: a rounding millisecond
  -- must not turn every rejection into a write)
  local want = nil
  if per_sec > 0 then
    local x = (cap - t) / per_sec * 1000
    local part = x % 1
    want = x - part
    if part > 0 then want = want + 1 end
    want = want + margin_ms
    if want > MAX_TTL_MS then want = nil end
  end
  local have = -1
  local now_ms = now_s * 1000 + (us - us % 1000) / 1000
  if layout == 2 then
    have = redis.call('PTTL', key)
  elseif se > 0 then
    have = se - now_ms
  end
  if have >= 0 and (want == nil or have + margin_ms < want) then
    if layout == 2 then
      if want then
        redis.call('PEXPIRE', key, want)
      else
        redis.call('PERSIST', key)
      end
    else
      write, wt, wu, ms = true, st, su, want
    end
  end
end
if write then
  if ms then
    local now_ms = now_s * 1000 + (us - us % 1000) / 1000
    redis.call('SET', key, struct.pack('<ddd', wt, wu, now_ms + ms), 'PX', ms)
  else
    redis.call('SET', key, struct.pack('<ddd', wt, wu, 0))
  end
end

local taken = 0
if applies and deducted > 0 then taken = deducted end
local remaining = t + EPSILON
remaining = remaining - remaining % 1
if remaining < 0 or never == 1 then remaining = 0 end
local full_in = 0
local missing = cap - t
if missing > EPSILON and per_sec > 0 then
  full_in = missing / per_sec - EPSILON
  local part = full_in % 1
  full_in = full_in - part
  if part > 0 then full_in = full_in + 1 end
  if full_in < 0 then full_in = 0 end
end
if admit then retry = -1 end
return { admit and 1 or 0, remaining, retry, full_in, never, forgiven, taken }

-- tokenbucket-rls: decide descriptors' token buckets, each atomically.
--
-- The Lua copy of src/bucket.rs; tests/bucket_cases.rs checks that
-- both give the same answers. Keep the expressions in the same order.
--
-- A call decides one descriptor, or several: a batch of the decisions
-- queued for this server at one moment by concurrent requests
-- (src/store/redis/batch.rs), each decided as if alone, at one TIME.
-- ARGV holds one group per decision: its numbers packed in one argument
-- (one struct.unpack costs less than a single tonumber of a decimal, of
-- which a decision needed nine: a fifth of its instructions), then, for a
-- call of an attempt, the attempt id, then, for each decision after the
-- first, its keys. The numbers, little-endian ('<HBBBBBBddd', then
-- '<dddd' per bucket, then '<BBdd' for an attempt):
--   n         its number of buckets (u16)
--   flags     one byte each, 0 or 1: the hash layout of earlier versions
--             is written (for a rolling upgrade: instances of both versions
--             read it), else the packed one; a charge (a rule's
--             `overdraft`): deducted whatever the verdict (not on a rate of
--             0), down to -capacity at most (a balance already below it
--             stays), its wait counted from after it; a call of an
--             attempt; a fixed window; a sliding one; a calendar period
--             (below)
--   needed    tokens needed to admit (a double, as every number below:
--             each an integer below 2^53, exact)
--   deducted  tokens to deduct when admitted (0 for a check, negative for a
--             refund); more than needed for a lease: take as many whole
--             tokens as every bucket holds, up to deducted, and at least
--             needed
--   margin    expiry margin in ms, added to the time a bucket needs to refill
--   then per bucket: capacity, tokens_per_unit, unit_secs, max_debt (the
--             most debt a charge may leave; -1: capacity)
--   then, for a call of an attempt: phase (a byte: 0 start, 1 done, 2
--             withdraw: the service takes back a start answered too late),
--             mode (a byte: 0 dedupe, 1 reserve), ttl_ms, the most repeats
--             of a live start; its keys end with the attempt's record (n +
--             1 keys), and for a reservation the descriptor's unsettled
--             reservations (n + 2 keys)
-- src/store/redis/script_args.rs writes them; integration/script_calls.py
-- sends them for the benchmarks.
--
-- An attempt's record (src/attempt.rs has the Rust copy, `plan` and
-- `record_after`): struct.pack('<dddd', tokens its admitted start took (-1:
-- none), done (0/1), expiry (ms: an unsettled reservation is kept as spent
-- from then), when it is forgotten (ms)), expiring then. A repeat of an
-- admitted call is answered OK and writes nothing (a start only while
-- the attempt is live: after its done call it starts a new attempt); a reservation's done
-- call (its cost a charge of what was used) charges or gives back the
-- difference to what its start took, once; with no record it is charged
-- in full. The answer then ends with the call's result: 0 first, 1 repeat,
-- 2 settled, 3 late, 4 unknown, 5 reused (a start of the live attempt
-- repeated past its bound: answered as a repeat, nothing charged, and
-- refused by the service); and the reservations of the descriptor
-- whose ttl passed unsettled since its last call (kept as spent: counted
-- here, once). Those are a sorted set of attempt id -> expiry (ms), kept
-- two ttls past its newest entry: an admitted reservation is added, a
-- settled one removed.
-- A fixed window (src/window.rs has the Rust copy): per bucket, capacity
-- is unused, tokens_per_unit is the limit and unit_secs the window's
-- length; windows are aligned to the epoch of this server's TIME. The
-- bucket's value packs (the window's count, its start in µs, expiry set);
-- a count of another window is none. Every hit counts, refused or not: the
-- count after it is stored whatever the verdict, and a bucket is over when
-- that count is above its limit (a check counts none, and is over when the
-- count already is, as envoyproxy/ratelimit's INCRBY 0; what needs nothing,
-- a refund or an attempt's repeat, is never over). A charge counts as a hit;
-- a reservation refused is not kept; an attempt's give-back takes off the
-- count only of the window that counted its start (back_since).
-- It answers as a bucket does: remaining (0 when over), the wait until the
-- window ends (for a bucket over, when refused, unless it can never pass),
-- that same wait as full_in, never (1 over a limit of 0, 2 over by a cost
-- above the limit, else 0), then in forgiven's place the window's count after the
-- hit (for envoyproxy/ratelimit's near/over statistics), then what was
-- counted when admitted.
-- A calendar period (src/window.rs, decide_calendar, has the Rust copy):
-- per bucket, capacity is the period's start, tokens_per_unit the limit,
-- unit_secs its end and max_debt the next one's end (Unix seconds, found by
-- the service in the rule's time zone); the period is the first, or the
-- second once this server's TIME has reached the first's end. The value
-- packs (the period's count, its start in µs, expiry set); a count of
-- another period is none. A hit is admitted when every count has room for
-- what it needs; only then does it count, but a charge counts whatever the
-- verdict (not on a limit of 0), and a refund takes off, never below 0 (an
-- attempt's give-back only from the period that counted its start). The
-- key expires when the period ends. It answers as a bucket does:
-- remaining (the limit less the count, at least 0), the wait until the
-- period ends (for a bucket refusing), that same wait as full_in, never
-- (1 a limit of 0, 2 a cost above the limit), forgiven 0, then what was
-- counted when it applied.
-- A sliding window (src/window/sliding.rs has the Rust copy): per bucket,
-- tokens_per_unit is the limit and unit_secs the window's length; windows
-- are aligned as a fixed window's. The bucket's value packs (the window
-- before's count * SHIFT + the current one's, the current window's start
-- in µs, expiry set); a stored window one before the current one is the
-- window before, one later than now (a clock stepped back) is read as at
-- its start, any other is none. The estimate, previous * (1 - elapsed
-- share of the current window) + current, must have room for the hit;
-- only an admitted hit counts (a refund takes off the current count, never
-- below 0; an attempt's give-back only if this window counted its start),
-- or a charge whatever the verdict (not on a limit of 0; the count held to
-- SHIFT - 1), and only then is the key written, expiring two windows after
-- the current one's start. It answers as a bucket does: remaining (of the
-- estimate), the wait until the estimate has room (for a bucket refusing),
-- the wait until the estimate is 0 as full_in, never (1 a limit of 0, 2 a
-- cost above the limit), forgiven 0, then what was counted when admitted.
-- KEYS holds the first decision's keys, declared, so that the server checks
-- their slot is its own before anything runs. A batch's other keys are not
-- declared (one call may declare one slot only): a batch runs as the same
-- script behind `#!lua flags=allow-cross-slot-keys` (Redis 7), and a later
-- decision whose keys this server does not hold now (a slot that moved or
-- is moving) is answered {-1}, nothing read or written, to be sent alone.
--
-- A key: one string per bucket, struct.pack('<ddd', tokens, last update
-- (µs), expiry set (ms, server time; 0: none)), 24 bytes. Read also: the
-- hash of earlier versions (t = tokens, u = last update), which a write in
-- the packed layout replaces.
--
-- Returns one decision's answer, or for a batch an array of them: {admitted,
-- then per bucket: remaining, retry_after (-1: none), full_in, never (0:
-- no, 1: zero rate, 2: cost above capacity), forgiven (whole tokens a
-- charge could not take for the debt bound), then the tokens taken (0
-- unless admitted and spending or leasing)}.
-- Time is this server's TIME; an earlier time adds no tokens. A bucket is
-- only written when the request is admitted and spends; it expires once it
-- would be full again, plus the margin, never sooner. A bucket that would
-- take longer than MAX_TTL_MS to fill does not expire. A rejection or a check
-- writes no state, but lengthens an existing bucket's expiry when the rules'
-- numbers now need longer (a reload lowered the rate). Every number handed
-- to a command is a whole number below 1e14 or formatted as an integer: Lua
-- would print a larger float in exponent form, which Redis refuses.
--
-- Written for Redis's CPU: one table for every bucket's numbers (a table is
-- the costliest thing a short script makes), made at the size one bucket
-- needs and used again by each decision; no function defined (Lua makes a
-- closure for each definition it runs: 0.8 µs of a 10 µs script), every
-- kind's answer ending in one shared tail (an attempt's record); the
-- numbers packed in one argument (each tonumber of a decimal ran strtod:
-- nine of them were a fifth of the instructions) and the flags compared
-- where read; C calls (math.max, type) written out as comparisons on the
-- hot paths; an answer built in one constructor for one bucket; one GET
-- and one SET … PX per bucket. integration/bench-script-ir.sh counts the
-- instructions. A script per kind made by keeping only its branch gains
-- nothing (Lua pays only for the code it runs); what a lean script saves is
-- this frame (the batch's loop, the attempt's record, the table of every
-- bucket's numbers): one bucket's decision (a rule of one limit, not an
-- attempt's call), the commonest, runs one.lua instead (its header says
-- why and how), chosen by the caller.

local min, max, floor, ceil = math.min, math.max, math.floor, math.ceil
local EPSILON = 1e-9
-- a sliding window's two counts share one number: previous * SHIFT + current
local SHIFT = 67108864
local MAX_TTL_MS = 3153600000000 -- 100 years
local time = redis.call('TIME')
-- strings made numbers by arithmetic, floors and ceilings written with
-- `%` (Lua's `%` floors): each C call would cost more (see above)
local now_s = time[1] + 0
local now = now_s * 1000000 + time[2]
local now_ms = (now - now % 1000) / 1000

-- Per bucket i, at B[S * (i - 1) + field]; every field is set for each
-- bucket of a decision before it is read, so decisions share the table
local S = 14
local CAP, RATE, UNIT, PER_SEC, TOKENS, STAMP = 1, 2, 3, 4, 5, 6
-- LAYOUT: 0 no key, 1 packed, 2 hash; then what is stored, and the answer
local LAYOUT, STORED_T, STORED_U, STORED_EXP, RETRY, NEVER = 7, 8, 9, 10, 11, 12
local DEBT, FORGIVEN = 13, 14
-- the bucket's four numbers as sent (see the header), unpacked where a
-- token bucket keeps them; a window or period reads them before it
-- writes its own
local A1, A2, A3, A4 = CAP, RATE, UNIT, DEBT
local B = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }
-- a batch's answers, one per decision (nil for one decision)
local answers = nil
local nargs = #ARGV
local a = 1 -- where the next decision's group starts in ARGV
local d = 0
while a <= nargs do
  d = d + 1
  -- the group's numbers, packed (one unpack costs less than one
  -- tonumber of a decimal argument)
  local group = ARGV[a]
  -- the flags stay bytes (0 or 1), compared where they are read: made
  -- booleans here, six of them cost more than the comparisons do
  local n, write_hash, charge, attempt, fixed, sliding, calendar, needed, deducted, margin_ms, pos =
    struct.unpack('<HBBBBBBddd', group)
  charge = charge == 1
  for i = 1, n do
    local k = S * (i - 1)
    B[k + A1], B[k + A2], B[k + A3], B[k + A4], pos = struct.unpack('<dddd', group, pos)
  end
  a = a + 1
  -- bucket i's key at keys[ka + i]
  local keys, ka = KEYS, 0
  local nk = n
  local phase, mode, ttl_ms, id, reps = 0, 0, 0, nil, 0
  if attempt == 1 then
    phase, mode, ttl_ms, reps = struct.unpack('<BBdd', group, pos)
    id = ARGV[a]
    a = a + 1
    nk = n + 1
    if mode == 1 then nk = n + 2 end
  end
  if d > 1 then
    keys, ka = ARGV, a - 1
    a = a + nk
  elseif a <= nargs then
    answers = {}
  end
  local all_admit = true
  local here = true
  -- an attempt's record, and what the call is (see the header)
  local r_started, r_done, r_exp, r_forget = -1, 0, 0, 0
  -- starts answered as repeats of the live start (kept in done's place,
  -- times 2: done + 2 x repeats)
  local r_reps = 0
  local result = 0
  local again = false
  local expired = 0
  -- for an attempt's give-back, when its start was admitted (ms): a
  -- window or period takes it off only if it counted it
  local back_since = -1
  -- the record's key, and a reservation's unsettled set
  local rk, pk = nil, nil
  if attempt == 1 then
    rk = keys[ka + n + 1]
    if mode == 1 then pk = keys[ka + n + 2] end
  end
  -- the decision's answer, made by its kind's branch
  local out = nil
  -- `repeat … until true`: a `break` from it ends this decision
  repeat
    if attempt == 1 then
      local value = redis.pcall('GET', rk)
      if not value then
        -- no record: a first call
      elseif type(value) == 'string' then
        if #value == 32 then
          r_started, r_done, r_exp, r_forget = struct.unpack('<dddd', value)
          if r_forget <= now_ms then r_started, r_done, r_exp, r_forget = -1, 0, 0, 0 end
          r_reps = (r_done - r_done % 2) / 2
          r_done = r_done % 2
        end
      elseif value.err then
        if d == 1 then return value end
        here = false
      end
      if not here then
        answers[d] = { -1 }
        break
      end
      if phase == 2 then
        -- a withdrawal (the start's answer came after the caller's
        -- deadline): what the live start took comes back, and its record
        -- goes (a done call after it is charged in full)
        if r_started >= 0 and r_done == 0 then
          needed, deducted, charge = 0, -r_started, false
          result = 2
          back_since = 2 * r_exp - r_forget
        else
          again = true
        end
      elseif phase == 0 then
        -- a start after its attempt ended (settled, released, given
        -- back) is a new attempt
        again = r_started >= 0 and r_done == 0
        -- a reservation whose done call came first was charged in full by
        -- it: the late start takes nothing
        if mode == 1 and r_started < 0 and r_done == 1 then again = true end
        -- a repeat of the live start: counted, up to the rule's bound;
        -- past it the call is a reuse (5), answered as a repeat here and
        -- refused by the service
        if again and r_started >= 0 then
          if r_reps < reps then
            local px = r_forget - now_ms
            if px < 1 then px = 1 end
            redis.call('SET', rk, struct.pack('<dddd', r_started, 2 * (r_reps + 1), r_exp, r_forget), 'PX', px)
          else
            result = 5
          end
        end
      elseif mode == 0 or r_done == 1 then
        again = r_done == 1
      elseif r_started >= 0 then
        -- a reservation settled: what was used against what it took
        local used = needed
        if used >= r_started then
          needed, deducted, charge = used - r_started, used - r_started, true
        else
          needed, deducted, charge = 0, used - r_started, false
          back_since = 2 * r_exp - r_forget
        end
        if now_ms < r_exp then result = 2 else result = 3 end
      else
        result = 4
      end
      if again then
        if result ~= 5 then result = 1 end
        needed, deducted, charge = 0, 0, false
      end
      if pk then
        expired = redis.call('ZREMRANGEBYSCORE', pk, '-inf', now_ms)
      end
    end
    if fixed == 1 then
      -- (comparisons written out where math.max would be a C call)
      local counted = 0
      if deducted > 0 then counted = deducted end
      local all_in = true
      for i = 1, n do
        local k = S * (i - 1)
        local limit = B[k + A2]
        local length = B[k + A3]
        if length < 1 then length = 1 end
        local into = now_s % length
        local start = (now_s - into) * 1000000
        local count = 0
        local value = redis.pcall('GET', keys[ka + i])
        if type(value) == 'string' then
          if #value == 24 then
            local st, su = struct.unpack('<ddd', value)
            if su == start and st > 0 then count = st end
          end
        elseif value and value.err then
          if string.sub(value.err, 1, 9) ~= 'WRONGTYPE' then
            if d == 1 then return value end
            here = false
            break
          end
        end
        local over = 0
        if needed > 0 and count + counted > limit then
          over = 1
          all_in = false
        end
        B[k + CAP], B[k + TOKENS], B[k + STAMP], B[k + UNIT], B[k + LAYOUT] =
          limit, count, start, length - into, over
        B[k + PER_SEC] = length
      end
      if not here then
        answers[d] = { -1 }
        break
      end
      -- one bucket: the answer made at its size (an attempt's two
      -- fields fill the nils), not grown field by field
      if n == 1 then
        out = { all_in and 1 or 0, 0, 0, 0, 0, 0, 0, nil, nil }
      else
        out = { all_in and 1 or 0 }
      end
      local o = 1
      for i = 1, n do
        local k = S * (i - 1)
        local after = B[k + TOKENS] + counted
        -- every hit counts, but a reservation refused took nothing
        local write = counted > 0 and (all_in or not (attempt == 1 and mode == 1 and phase == 0))
        -- an attempt's give-back, to the window that counted it
        if back_since >= 0 and back_since * 1000 >= B[k + STAMP]
            and back_since * 1000 < B[k + STAMP] + B[k + PER_SEC] * 1000000 then
          after = max(0, B[k + TOKENS] + deducted)
          write = true
        end
        if write then
          -- expiring when the window ends (to the second), plus the margin
          local ms = B[k + UNIT] * 1000 + margin_ms
          redis.call('SET', keys[ka + i], struct.pack('<ddd', after, B[k + STAMP], now_s * 1000 + ms), 'PX', ms)
        end
        local remaining, retry, never = 0, -1, 0
        if B[k + LAYOUT] == 0 then
          remaining = B[k + CAP] - after
          if remaining < 0 then remaining = 0 end
        elseif B[k + CAP] == 0 then
          -- over a limit of 0, or by a cost above the limit: waiting
          -- cannot cure it, no wait
          never = 1
        elseif counted > B[k + CAP] then
          never = 2
        end
        if not all_in and B[k + LAYOUT] == 1 and never == 0 then retry = B[k + UNIT] end
        out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = remaining, retry, B[k + UNIT], never, after
        o = o + 5
      end
      out[o + 1] = ((all_in or charge) and counted) or 0
      all_admit = all_in
      break
    end
    if calendar == 1 then
      local all_in, zero = true, false
      for i = 1, n do
        local k = S * (i - 1)
        local limit = B[k + A2]
        local start = B[k + A1] * 1000000
        local stop = B[k + A3] * 1000000
        if now >= stop then
          start, stop = stop, B[k + A4] * 1000000
        end
        local count = 0
        local value = redis.pcall('GET', keys[ka + i])
        if type(value) == 'string' then
          if #value == 24 then
            local st, su = struct.unpack('<ddd', value)
            if su == start and st > 0 then count = st end
          end
        elseif value and value.err then
          if string.sub(value.err, 1, 9) ~= 'WRONGTYPE' then
            if d == 1 then return value end
            here = false
            break
          end
        end
        -- LAYOUT: 0 fits, 1 wait, 2 never (a limit of 0), 3 never (cost)
        local verdict = 0
        if needed == 0 then
          verdict = 0
        elseif limit == 0 then
          verdict = 2
          zero = true
        elseif needed > limit then
          verdict = 3
        elseif count + needed > limit then
          verdict = 1
        end
        if verdict ~= 0 then all_in = false end
        B[k + CAP], B[k + TOKENS], B[k + STAMP], B[k + UNIT], B[k + LAYOUT] = limit, count, start, stop, verdict
      end
      if not here then
        answers[d] = { -1 }
        break
      end
      local applies = all_in or (charge and not zero)
      -- one bucket: the answer made at its size (an attempt's two
      -- fields fill the nils), not grown field by field
      if n == 1 then
        out = { all_in and 1 or 0, 0, 0, 0, 0, 0, 0, nil, nil }
      else
        out = { all_in and 1 or 0 }
      end
      local o = 1
      for i = 1, n do
        local k = S * (i - 1)
        local after = B[k + TOKENS]
        local stop = B[k + UNIT]
        -- (an attempt's give-back only to the period that counted it)
        if applies and deducted ~= 0 and (back_since < 0 or deducted > 0
            or (back_since * 1000 >= B[k + STAMP] and back_since * 1000 < stop)) then
          after = max(0, after + deducted)
          -- expiring when the period ends (to the second), plus the margin
          local ms = (stop / 1000000 - now_s) * 1000 + margin_ms
          redis.call('SET', keys[ka + i], struct.pack('<ddd', after, B[k + STAMP], now_s * 1000 + ms), 'PX', ms)
        end
        local left = ceil((stop - now) / 1000000)
        local retry, never = -1, 0
        local verdict = B[k + LAYOUT]
        if verdict == 1 then
          retry = max(1, left)
        elseif verdict == 2 then
          never = 1
        elseif verdict == 3 then
          never = 2
        end
        out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = max(0, B[k + CAP] - after), retry, max(0, left), never, 0
        o = o + 5
      end
      out[o + 1] = (applies and max(0, deducted)) or 0
      all_admit = all_in
      break
    end
    if sliding == 1 then
      local all_in = true
      for i = 1, n do
        local k = S * (i - 1)
        local limit = B[k + A2]
        local secs = max(1, B[k + A3])
        local length = secs * 1000000
        local start = (now_s - now_s % secs) * 1000000
        local at_now, prev, cur = now, 0, 0
        local value = redis.pcall('GET', keys[ka + i])
        if type(value) == 'string' then
          if #value == 24 then
            local st, su = struct.unpack('<ddd', value)
            local sp = floor(st / SHIFT)
            local sc = st - sp * SHIFT
            if su == start then
              prev, cur = sp, sc
            elseif su + length == start then
              prev = sc
            elseif su > start then
              start, at_now, prev, cur = su, su, sp, sc
            end
          end
        elseif value and value.err then
          if string.sub(value.err, 1, 9) ~= 'WRONGTYPE' then
            if d == 1 then return value end
            here = false
            break
          end
        end
        local estimate = prev * (1 - (at_now - start) / length) + cur
        -- LAYOUT: 0 fits, 1 wait, 2 never (zero rate), 3 never (cost)
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
        if verdict ~= 0 then all_in = false end
        B[k + CAP], B[k + RATE], B[k + UNIT], B[k + PER_SEC] = limit, length, start, at_now
        B[k + TOKENS], B[k + STAMP], B[k + LAYOUT] = prev, cur, verdict
      end
      if not here then
        answers[d] = { -1 }
        break
      end
      local counted = needed
      if deducted < needed then counted = deducted end
      -- a charge counts whatever the verdict, except on a limit of 0
      local applies = all_in
      if charge and not all_in then
        applies = true
        for i = 1, n do
          if B[S * (i - 1) + LAYOUT] == 2 then applies = false end
        end
      end
      -- one bucket: the answer made at its size (an attempt's two
      -- fields fill the nils), not grown field by field
      if n == 1 then
        out = { all_in and 1 or 0, 0, 0, 0, 0, 0, 0, nil, nil }
      else
        out = { all_in and 1 or 0 }
      end
      local o = 1
      for i = 1, n do
        local k = S * (i - 1)
        local limit, length, start, at_now = B[k + CAP], B[k + RATE], B[k + UNIT], B[k + PER_SEC]
        local prev, cur = B[k + TOKENS], B[k + STAMP]
        -- (an attempt's give-back only to the window that counted it)
        if applies and counted ~= 0 and (back_since < 0 or counted > 0
            or (back_since * 1000 >= start and back_since * 1000 < start + length)) then
          cur = min(SHIFT - 1, max(0, cur + counted))
          local ms = ceil((start + 2 * length - now) / 1000) + margin_ms
          redis.call('SET', keys[ka + i], struct.pack('<ddd', prev * SHIFT + cur, start, now_ms + ms), 'PX', ms)
        end
        local estimate = prev * (1 - (at_now - start) / length) + cur
        local remaining = max(0, floor(limit - estimate + EPSILON))
        local retry, never = -1, 0
        local verdict = B[k + LAYOUT]
        if verdict == 1 then
          local until_us
          if cur + needed <= limit + EPSILON then
            until_us = start + (1 - (limit - cur - needed) / prev) * length
          else
            until_us = start + length + (1 - (limit - needed) / cur) * length
          end
          retry = max(1, ceil((until_us - at_now) / 1000000 - EPSILON))
        elseif verdict == 2 then
          never = 1
        elseif verdict == 3 then
          never = 2
        end
        local full_in = 0
        if cur > 0 then
          full_in = ceil((start + 2 * length - at_now) / 1000000)
        elseif prev > 0 then
          full_in = ceil((start + length - at_now) / 1000000)
        end
        out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = remaining, retry, full_in, never, 0
        o = o + 5
      end
      out[o + 1] = (applies and max(0, counted)) or 0
      all_admit = all_in
      break
    end
    for i = 1, n do
      local k = S * (i - 1)
      local cap, rate, unit, debt = B[k + A1], B[k + A2], B[k + A3], B[k + A4]
      if debt < 0 then debt = cap end
      local per_sec = 0
      if unit ~= 0 then per_sec = rate / unit end
      B[k + CAP], B[k + RATE], B[k + UNIT], B[k + PER_SEC] = cap, rate, unit, per_sec
      B[k + DEBT], B[k + FORGIVEN] = debt, 0
      local layout, st, su, se = 0, 0, 0, 0
      local value = redis.pcall('GET', keys[ka + i])
      if type(value) == 'string' and #value == 24 then
        layout = 1
        st, su, se = struct.unpack('<ddd', value)
      elseif type(value) == 'table' and value.err then
        if string.sub(value.err, 1, 9) ~= 'WRONGTYPE' then
          -- not this server's key now (a batch's undeclared key in a slot
          -- that moved or is moving), or the cluster is down: the first
          -- decision (declared keys, nothing written yet) answers the error,
          -- a later one is sent again alone
          if d == 1 then return value end
          here = false
          break
        end
        -- the hash layout of earlier versions
        local state = redis.call('HMGET', keys[ka + i], 't', 'u')
        if state[1] and state[2] then
          layout = 2
          st, su = tonumber(state[1]), tonumber(state[2])
        end
      end
      B[k + LAYOUT], B[k + STORED_T], B[k + STORED_U], B[k + STORED_EXP] = layout, st, su, se
      local t, u
      if layout == 0 then
        t, u = cap, now
      else
        t, u = st, su
        if now > u then
          t = t + (now - u) * rate / (unit * 1e6)
          u = now
        end
        if t > cap then t = cap end
      end
      B[k + TOKENS], B[k + STAMP] = t, u

      local retry, never = -1, 0
      if deducted < 0 then
        -- a refund is answered OK whatever the rule, rate 0 too
      elseif rate == 0 or unit == 0 then
        never = 1
      elseif needed > cap then
        never = 2
      elseif t + EPSILON < needed then
        local secs = ceil((needed - t) / (rate / unit) - EPSILON)
        retry = max(1, secs)
      end
      B[k + RETRY], B[k + NEVER] = retry, never
      if never ~= 0 or retry ~= -1 then
        all_admit = false
      end
    end

    if not here then
      answers[d] = { -1 }
      break
    end
    -- a repeat is answered as the admitted call it repeats
    if again then
      all_admit = true
      for i = 1, n do B[S * (i - 1) + RETRY] = -1 end
    end

    -- a charge applies whatever the verdict, unless a bucket never refills
    local applies = all_admit
    if charge then
      applies = true
      for i = 1, n do
        if B[S * (i - 1) + NEVER] == 1 then applies = false end
      end
    end

    if deducted > needed then
      local available = math.huge
      for i = 1, n do
        available = min(available, floor(B[S * (i - 1) + TOKENS] + EPSILON))
      end
      deducted = max(needed, min(deducted, available))
    end

    -- Each bucket is written when the request spends (t at its stamp), or when
    -- a rejection or a check finds its expiry too short (what is stored, with
    -- the longer expiry), expiring ms from now: the time until it is full
    -- again plus the margin; nil (never) when that is longer than MAX_TTL_MS
    -- or the bucket never refills.
    local spend = applies and deducted ~= 0
    for i = 1, n do
      local k = S * (i - 1)
      local per_sec = B[k + PER_SEC]
      local write, wt, wu, ms = false, 0, 0, nil
      if spend then
        -- a charge may go into debt, down to -capacity, and never raises a
        -- balance already below that (a reload lowered the burst); nothing
        -- else goes below where the bucket is (a refund into a debt repays
        -- part of it)
        local lowest = 0
        if charge then lowest = -B[k + DEBT] end
        if B[k + TOKENS] < lowest then lowest = B[k + TOKENS] end
        local t = B[k + TOKENS] - deducted
        if t < lowest then
          local forgiven = lowest - t + 0.5
          B[k + FORGIVEN] = forgiven - forgiven % 1
          t = lowest
        end
        if t > B[k + CAP] then t = B[k + CAP] end
        B[k + TOKENS] = t
        -- a charge answered OVER_LIMIT waits from where it left the bucket
        if charge and not all_admit and B[k + NEVER] == 0 then
          if t + EPSILON < needed then
            B[k + RETRY] = max(1, ceil((needed - t) / per_sec - EPSILON))
          else
            B[k + RETRY] = -1
          end
        end
        -- a bucket of rate 0 (only a refund gets here) never refills: nothing
        -- of it is worth a key that would never expire
        if per_sec > 0 then
          write, wt, wu = true, t, B[k + STAMP]
          local x = (B[k + CAP] - t) / per_sec * 1000
          local part = x % 1
          ms = x - part + margin_ms
          if part > 0 then ms = ms + 1 end
          if ms > MAX_TTL_MS then ms = nil end
        end
      else
        local layout = B[k + LAYOUT]
        if layout ~= 0 then
          local want = nil
          if per_sec > 0 then
            want = ceil((B[k + CAP] - B[k + TOKENS]) / per_sec * 1000) + margin_ms
            if want > MAX_TTL_MS then want = nil end
          end
          local have = -1
          if layout == 2 then
            have = redis.call('PTTL', keys[ka + i])
          elseif B[k + STORED_EXP] > 0 then
            have = B[k + STORED_EXP] - now_ms
          end
          -- more than the margin short: the rules changed (a rounding
          -- millisecond must not turn every rejection into a write). What is
          -- stored stays as it was; only its expiry moves.
          if have >= 0 and (want == nil or have + margin_ms < want) then
            if layout == 2 then
              if want then
                redis.call('PEXPIRE', keys[ka + i], want)
              else
                redis.call('PERSIST', keys[ka + i])
              end
            else
              write, wt, wu, ms = true, B[k + STORED_T], B[k + STORED_U], want
            end
          end
        end
      end
      if write then
        if write_hash == 1 then
          if B[k + LAYOUT] == 1 then redis.call('DEL', keys[ka + i]) end
          redis.call('HSET', keys[ka + i], 't', string.format('%.17g', wt), 'u', string.format('%d', wu))
          if ms then
            redis.call('PEXPIRE', keys[ka + i], ms)
          else
            redis.call('PERSIST', keys[ka + i])
          end
        elseif ms then
          redis.call('SET', keys[ka + i], struct.pack('<ddd', wt, wu, now_ms + ms), 'PX', ms)
        else
          redis.call('SET', keys[ka + i], struct.pack('<ddd', wt, wu, 0))
        end
      end
    end

    local taken = 0
    if applies and deducted > 0 then taken = deducted end
    -- one bucket (most descriptors): the answer's table made at its size
    if n == 1 and attempt == 0 then
      out = { all_admit and 1 or 0, 0, 0, 0, 0, 0, taken }
    elseif n == 1 then
      -- an attempt's two fields fill the nils
      out = { all_admit and 1 or 0, 0, 0, 0, 0, 0, taken, nil, nil }
    else
      out = { all_admit and 1 or 0 }
    end
    local o = 1
    for i = 1, n do
      local k = S * (i - 1)
      local t = B[k + TOKENS]
      local remaining = t + EPSILON
      remaining = remaining - remaining % 1
      if remaining < 0 or B[k + NEVER] == 1 then remaining = 0 end
      local full_in = 0
      local missing = B[k + CAP] - t
      local per_sec = B[k + PER_SEC]
      if missing > EPSILON and per_sec > 0 then
        local secs = missing / per_sec - EPSILON
        local part = secs % 1
        secs = secs - part
        if part > 0 then secs = secs + 1 end
        if secs > 0 then full_in = secs end
      end
      local r = B[k + RETRY]
      if all_admit then r = -1 end
      out[o + 1], out[o + 2], out[o + 3], out[o + 4] = remaining, r, full_in, B[k + NEVER]
      out[o + 5] = B[k + FORGIVEN]
      o = o + 5
    end
    out[o + 1] = taken
  until true
  -- every kind's answer ends here (none for a decision sent again alone)
  if out then
    if attempt == 1 then
      if not again then
        -- what the call leaves in the attempt's record (rk) and, for a
        -- reservation, its descriptor's unsettled set (pk): see the header
        local keep = false
        if phase == 2 then
          redis.call('DEL', rk)
          if pk then redis.call('ZREM', pk, id) end
        elseif phase == 0 then
          -- an admitted start that took (or gave) something; a check took
          -- nothing and is not remembered
          if all_admit and (deducted ~= 0 or charge) then
            r_started, r_exp, r_forget = 0, now_ms + ttl_ms, now_ms + 2 * ttl_ms
            if deducted > 0 then r_started = deducted end
            r_done = 0
            keep = true
            if pk and r_started > 0 then
              redis.call('ZADD', pk, r_exp, id)
              redis.call('PEXPIRE', pk, 2 * ttl_ms)
            end
          end
        elseif mode == 0 then
          keep = all_admit and (deducted ~= 0 or charge)
        else
          -- a settlement, or an unknown attempt's charge: done whatever the
          -- verdict
          keep = true
          if pk and result == 2 then redis.call('ZREM', pk, id) end
        end
        if keep then
          if phase == 1 then
            r_done = 1
            if r_forget <= now_ms then
              r_exp, r_forget = now_ms + ttl_ms, now_ms + 2 * ttl_ms
            end
          end
          local px = r_forget - now_ms
          if px < 1 then px = 1 end
          redis.call('SET', rk, struct.pack('<dddd', r_started, r_done, r_exp, r_forget), 'PX', px)
        end
      end
      local o = 5 * n + 1
      out[o + 2], out[o + 3] = result, expired
    end
    if answers == nil then return out end
    answers[d] = out
  end
end
return answers

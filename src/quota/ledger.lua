-- tokenbucket-rls: one step of an RLQS bucket's shared ledger.
--
-- The Lua copy of src/quota/ledger.rs (Ledger::step); tests/rlqs.rs
-- checks that both give the same answers. Keep the expressions in the same
-- order.
--
-- KEYS[1]  the bucket's hash: one field per member (replica:stream), each
--          struct.pack('<dddddddd', demand (-1: not taking part), last step
--          (ms), current burst, rate, until (ms), earlier burst, rate, until)
-- ARGV[1]  the member's field
-- ARGV[2]  its smoothed demand (milli-requests/s; -1: it leaves)
-- ARGV[3]  budget burst (milli-tokens)        ARGV[4]  rate (milli-tokens/s)
-- ARGV[5]  time to live of the assignment (ms) ARGV[6]  stale after (ms)
-- ARGV[7]  floor (‰ of an equal share)        ARGV[8]  newcomer reserve (‰)
-- ARGV[9]  a share this close (‰) to the live one is kept as it is
--
-- Returns {share burst, share rate, active members, reserved burst, reserved
-- rate}, milli units, floored. Time is this server's TIME. The caller gets at
-- most what the other members' live assignments leave of the budget, so the
-- members' Σ never exceeds it. Members neither active nor reserving are
-- removed; the key expires when the last record would be of no use.

local min, max, floor = math.min, math.max, math.floor
local time = redis.call('TIME')
local now = floor((tonumber(time[1]) * 1000000 + tonumber(time[2])) / 1000)
local me = ARGV[1]
local demand = tonumber(ARGV[2])
local budget_b, budget_r = tonumber(ARGV[3]), tonumber(ARGV[4])
local ttl, stale = tonumber(ARGV[5]), tonumber(ARGV[6])
local floor_fraction = tonumber(ARGV[7]) / 1000
local reserve = tonumber(ARGV[8]) / 1000
local threshold = tonumber(ARGV[9]) / 1000

local function reserved(cb, cr, cu, pb, pr, pu)
  local b, r = 0, 0
  if cu > now then b, r = cb, cr end
  if pu > now then b, r = max(b, pb), max(r, pr) end
  return b, r
end

local fields = redis.call('HGETALL', KEYS[1])
local others_b, others_r, total, n = 0, 0, 0, 0
local keep = now + max(ttl, stale)
local md, ms, cb, cr, cu, pb, pr, pu = -1, 0, 0, 0, 0, 0, 0, 0
for i = 1, #fields, 2 do
  local d, s, b1, r1, u1, b2, r2, u2 = struct.unpack('<dddddddd', fields[i + 1])
  if fields[i] == me then
    md, ms, cb, cr, cu, pb, pr, pu = d, s, b1, r1, u1, b2, r2, u2
  else
    local active = d >= 0 and now - s <= stale
    if active then
      total = total + d
      n = n + 1
    end
    if not active and u1 <= now and u2 <= now then
      redis.call('HDEL', KEYS[1], fields[i])
    else
      local b, r = reserved(b1, r1, u1, b2, r2, u2)
      others_b = others_b + b
      others_r = others_r + r
      keep = max(keep, u1, u2, s + stale)
    end
  end
end

local share_b, share_r = 0, 0
if demand >= 0 then
  n = n + 1
  total = total + demand
  local weight
  if total > 0 then weight = demand / total else weight = 1 / n end
  local part = floor_fraction / n + (1 - floor_fraction) * weight
  local target_b = budget_b * (1 - reserve) * part
  local target_r = budget_r * (1 - reserve) * part
  share_b = min(target_b, max(0, budget_b - others_b))
  share_r = min(target_r, max(0, budget_r - others_r))
  local function near(a, b) return math.abs(a - b) <= threshold * max(a, b) end
  if cu > now and near(cb, share_b) and near(cr, share_r)
      and cb <= budget_b - others_b and cr <= budget_r - others_r then
    share_b, share_r = cb, cr
  end
  if cu > now and cb == share_b and cr == share_r then
    cu = now + ttl
  else
    local lb, lr = reserved(cb, cr, cu, pb, pr, pu)
    local lu = 0
    if cu > now then lu = cu end
    if pu > now then lu = max(lu, pu) end
    pb, pr, pu = lb, lr, lu
    cb, cr, cu = share_b, share_r, now + ttl
  end
end
keep = max(keep, cu, pu)
redis.call('HSET', KEYS[1], me, struct.pack('<dddddddd', demand, now, cb, cr, cu, pb, pr, pu))
redis.call('PEXPIRE', KEYS[1], string.format('%d', keep - now + 1000))
local mb, mr = reserved(cb, cr, cu, pb, pr, pu)
return {floor(share_b), floor(share_r), n, floor(others_b + mb), floor(others_r + mr)}

-- tokenbucket-rls: one step of an RLQS bucket's shared ledger.
--
-- The Lua copy of src/quota/ledger.rs (Ledger::step); tests/rlqs.rs
-- checks that both give the same answers. Keep the expressions in the same
-- order.
--
-- KEYS[1]  the bucket's hash: one field per member (a replica), each
--          struct.pack('<ddddddddd', demand (-1: not taking part), last step
--          (ms), current burst, rate, until (ms), earlier burst, rate, until,
--          the Envoys (pairs) whose demand it sums); a record of 8 numbers
--          (written before replicas summed their Envoys) counts as one
-- ARGV[1]  the member's field
-- ARGV[2]  its smoothed demand (milli-requests/s; -1: it leaves)
-- ARGV[3]  budget burst (milli-tokens)        ARGV[4]  rate (milli-tokens/s)
-- ARGV[5]  time to live of the assignment (ms) ARGV[6]  stale after (ms)
-- ARGV[7]  floor (‰ of an equal share)        ARGV[8]  newcomer reserve (‰)
-- ARGV[9]  a share this close (‰) to the live one is kept as it is
-- ARGV[10] the Envoys (pairs) the member's demand sums
--
-- Returns {share burst, share rate, active pairs, reserved burst, reserved
-- rate}, milli units, floored. A step reads every member's record: it costs
-- the replicas splitting the bucket, not the Envoys (each replica splits
-- its share between its own Envoys). Time is this server's TIME. The caller gets at
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
local my_pairs = tonumber(ARGV[10]) or 1

local function reserved(cb, cr, cu, pb, pr, pu)
  local b, r = 0, 0
  if cu > now then b, r = cb, cr end
  if pu > now then b, r = max(b, pb), max(r, pr) end
  return b, r
end

local fields = redis.call('HGETALL', KEYS[1])
local others_b, others_r, total, n = 0, 0, 0, 0
local keep = now + max(ttl, stale)
local cb, cr, cu, pb, pr, pu = 0, 0, 0, 0, 0, 0
for i = 1, #fields, 2 do
  local d, s, b1, r1, u1, b2, r2, u2 = struct.unpack('<dddddddd', fields[i + 1])
  local k = 1
  if #fields[i + 1] >= 72 then k = struct.unpack('<d', fields[i + 1], 65) end
  if fields[i] == me then
    cb, cr, cu, pb, pr, pu = b1, r1, u1, b2, r2, u2
  else
    local active = d >= 0 and now - s <= stale
    if active then
      total = total + d
      n = n + k
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
  n = n + my_pairs
  total = total + demand
  local weight
  if total > 0 then weight = demand / total else weight = my_pairs / n end
  local part = floor_fraction * my_pairs / n + (1 - floor_fraction) * weight
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
redis.call('HSET', KEYS[1], me,
  struct.pack('<ddddddddd', demand, now, cb, cr, cu, pb, pr, pu, my_pairs))
redis.call('PEXPIRE', KEYS[1], string.format('%d', keep - now + 1000))
local mb, mr = reserved(cb, cr, cu, pb, pr, pu)
return {floor(share_b), floor(share_r), n, floor(others_b + mb), floor(others_r + mr)}

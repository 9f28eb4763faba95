-- tokenbucket-rls: one step of an RLQS bucket's shared ledger.
--
-- The Lua copy of src/quota/ledger.rs (Ledger::step); tests/rlqs.rs
-- checks that both give the same answers. Keep the expressions in the same
-- order.
--
-- KEYS[1]  the bucket's hash: one field per member (a replica), each
--          struct.pack('<dddddddddddd', demand (-1: not taking part), last
--          step (ms), current burst, rate, until (ms), earlier burst, rate,
--          until, the Envoys (pairs) whose demand it sums, older burst,
--          rate, until); a record of 8 numbers (written before replicas
--          summed their Envoys) counts as one Envoy, and one of 8 or 9 has
--          no older envelope (written before 2026-12-06)
-- ARGV[1]  the member's field
-- ARGV[2]  its smoothed demand (milli-requests/s; -1: it leaves)
-- ARGV[3]  budget burst (milli-tokens)        ARGV[4]  rate (milli-tokens/s)
-- ARGV[5]  time to live of the assignment (ms) ARGV[6]  stale after (ms)
-- ARGV[7]  floor (‰ of an equal share)        ARGV[8]  newcomer reserve (‰)
-- ARGV[9]  a share this close (‰) to the live one is kept as it is
-- ARGV[10] the Envoys (pairs) the member's demand sums
-- ARGV[11] held burst, ARGV[12] held rate (milli), ARGV[13] held for (ms;
--          0: none): what the member's Envoys may enforce that the ledger
--          did not give (assigned while its steps failed), kept reserved
--          beside its earlier shares
-- ARGV[14] how long a share larger than the live one is reserved (ms): a
--          share that grows is tentative until a later step keeps it
--
-- Returns {share burst, share rate, active pairs, reserved burst, reserved
-- rate, active members (replicas), the share's life (ms)}, milli units,
-- floored. A step reads every member's record: it costs
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
local held_b, held_r = tonumber(ARGV[11]) or 0, tonumber(ARGV[12]) or 0
local held_ms = tonumber(ARGV[13]) or 0
local grow_ms = tonumber(ARGV[14]) or ttl
local life = ttl

-- what a record may enforce: the largest of its live entries
local function reserved(rec)
  local b, r = 0, 0
  for _, e in ipairs(rec) do
    if e[3] > now then b, r = max(b, e[1]), max(r, e[2]) end
  end
  return b, r
end

-- the record of one field: demand, last step, pairs, {current, earlier, older}
local function unpack_record(v)
  local d, s, b1, r1, u1, b2, r2, u2 = struct.unpack('<dddddddd', v)
  local k, b3, r3, u3 = 1, 0, 0, 0
  if #v >= 72 then k = struct.unpack('<d', v, 65) end
  if #v >= 96 then b3, r3, u3 = struct.unpack('<ddd', v, 73) end
  return d, s, k, {{b1, r1, u1}, {b2, r2, u2}, {b3, r3, u3}}
end

-- the entries of items still live and not covered by cover (no larger, no
-- longer), as at most two envelopes: the ones expiring first joined until
-- two are left (ordered by expiry, then burst, then rate, as fold() in
-- ledger.rs)
local function fold(items, cover)
  local live = {}
  for _, e in ipairs(items) do
    if e[3] > now and not (e[1] <= cover[1] and e[2] <= cover[2] and e[3] <= cover[3]) then
      live[#live + 1] = {e[1], e[2], e[3]}
    end
  end
  table.sort(live, function(x, y)
    if x[3] ~= y[3] then return x[3] < y[3] end
    if x[1] ~= y[1] then return x[1] < y[1] end
    return x[2] < y[2]
  end)
  while #live > 2 do
    local first = table.remove(live, 1)
    local nxt = live[1]
    live[1] = {max(first[1], nxt[1]), max(first[2], nxt[2]), max(first[3], nxt[3])}
  end
  return live[1] or {0, 0, 0}, live[2] or {0, 0, 0}
end

local fields = redis.call('HGETALL', KEYS[1])
local others_b, others_r, total, n = 0, 0, 0, 0
local replicas = 0
local keep = now + max(ttl, stale)
local mine = {{0, 0, 0}, {0, 0, 0}, {0, 0, 0}}
for i = 1, #fields, 2 do
  local d, s, k, rec = unpack_record(fields[i + 1])
  if fields[i] == me then
    mine = rec
  else
    local active = d >= 0 and now - s <= stale
    if active then
      total = total + d
      n = n + k
      replicas = replicas + 1
    end
    if not active and rec[1][3] <= now and rec[2][3] <= now and rec[3][3] <= now then
      redis.call('HDEL', KEYS[1], fields[i])
    else
      local b, r = reserved(rec)
      others_b = others_b + b
      others_r = others_r + r
      keep = max(keep, rec[1][3], rec[2][3], rec[3][3], s + stale)
    end
  end
end

-- what is still live besides the current share: the earlier ones, and what
-- it assigned without the ledger
local earlier = {mine[2], mine[3]}
if held_ms > 0 then earlier[#earlier + 1] = {held_b, held_r, now + held_ms} end

local cb, cr, cu = mine[1][1], mine[1][2], mine[1][3]
local share_b, share_r = 0, 0
if demand >= 0 then
  replicas = replicas + 1
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
    -- more than the live share: tentative until a step keeps it
    local live_b, live_r = 0, 0
    if cu > now then live_b, live_r = cb, cr end
    if share_b > live_b or share_r > live_r then life = min(ttl, grow_ms) end
    earlier[#earlier + 1] = {cb, cr, cu}
    cb, cr, cu = share_b, share_r, now + life
  end
end
local e1, e2 = fold(earlier, {cb, cr, cu})
mine = {{cb, cr, cu}, e1, e2}
keep = max(keep, cu, e1[3], e2[3])
redis.call('HSET', KEYS[1], me,
  struct.pack('<dddddddddddd', demand, now, cb, cr, cu, e1[1], e1[2], e1[3], my_pairs,
    e2[1], e2[2], e2[3]))
redis.call('PEXPIRE', KEYS[1], string.format('%d', keep - now + 1000))
local mb, mr = reserved(mine)
return {floor(share_b), floor(share_r), n, floor(others_b + mb), floor(others_r + mr), replicas, life}

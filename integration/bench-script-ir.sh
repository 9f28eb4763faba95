#!/usr/bin/env bash
# Instructions redis-server executes per script call (#55), counted by
# callgrind: deterministic where CPU time on a shared box is not (runs of
# the same script differ by 1-2 %, CPU time by 40 %). One hot key, one
# connection, 16 calls pipelined (integration/script_calls.py); only the
# calls are counted (instrumentation on around them). Rows: an empty
# script (what any EVALSHA costs), the minimal token-bucket script
# (integration/minimal-bucket.lua: GET, TIME, the refill, SET … PX; the
# baseline), and bucket.lua deciding the same plain token bucket, then an
# attempt's start (dedupe with a fresh id, its repeat, a reservation); a
# fixed window and a dedupe start beside minimal scripts doing only their
# work (integration/minimal-fixed-window.lua, minimal-dedupe.lua), and a
# fixed window as the service counts one of one limit: no script, INCRBY
# + EXPIRE (src/store/redis/counter.rs); a reservation's start, a sliding
# window, a calendar period, an overdraft's charge and a concurrency slot
# beside minimal scripts of their own (integration/minimal-*.lua); and
# one bucket's decisions as the service sends them alone, through the lean
# src/store/redis/one.lua (bucket.lua still decides several limits, an
# attempt's call, and every batch).
#   integration/bench-script-ir.sh [CALLS]   (default 2000)
# Needs valgrind, redis-server, python3.
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-2000}; port=18789
out=$(mktemp -d)
(cd "$out" && valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out/cg.out" \
  redis-server --port "$port" --save "" --appendonly no >"$out/log" 2>&1 &)
for _ in $(seq 300); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
vpid=$(pgrep -f "callgrind.*--port $port" | head -1)
trap 'redis-cli -p $port shutdown nosave >/dev/null 2>&1 || true; sleep 1; rm -rf "$out"' EXIT
# row LABEL SCRIPT KIND: instructions per call
row() {
  local sha ir
  sha=$(redis-cli -p "$port" script load "$(cat "$2")")
  redis-cli -p "$port" flushall >/dev/null
  python3 integration/script_calls.py "$port" "$sha" "$3" 16
  callgrind_control -z "$vpid" >/dev/null 2>&1
  callgrind_control -i on "$vpid" >/dev/null 2>&1
  python3 integration/script_calls.py "$port" "$sha" "$3" "$calls"
  ir=$(callgrind_control -e Ir "$vpid" 2>/dev/null | awk '$1 == "Th" {gsub(",", "", $3); s += $3} END {print s + 0}')
  callgrind_control -i off "$vpid" >/dev/null 2>&1
  echo "$1 $((ir / calls))"
}
printf 'return 1\n' >"$out/empty.lua"
{
  row empty "$out/empty.lua" minimal
  row minimal integration/minimal-bucket.lua minimal
  row bucket.lua src/store/redis/bucket.lua token_bucket
  row one.lua src/store/redis/one.lua token_bucket
  row minimal-fixed-window integration/minimal-fixed-window.lua minimal_fixed_window
  row bucket.lua,fixed-window src/store/redis/bucket.lua fixed_window
  row one.lua,fixed-window src/store/redis/one.lua fixed_window
  row incrby+expire,fixed-window "$out/empty.lua" ratelimit_counter
  row minimal-dedupe integration/minimal-dedupe.lua minimal_dedupe
  row bucket.lua,dedupe src/store/redis/bucket.lua dedupe
  row bucket.lua,dedupe-repeat src/store/redis/bucket.lua dedupe_repeat
  row bucket.lua,reserve src/store/redis/bucket.lua reserve
  row minimal-reserve integration/minimal-reserve.lua minimal_reserve
  row minimal-sliding-window integration/minimal-sliding-window.lua minimal_sliding_window
  row bucket.lua,sliding-window src/store/redis/bucket.lua sliding_window
  row one.lua,sliding-window src/store/redis/one.lua sliding_window
  row minimal-calendar integration/minimal-calendar.lua minimal_calendar
  row bucket.lua,calendar src/store/redis/bucket.lua calendar
  row one.lua,calendar src/store/redis/one.lua calendar
  row minimal-charge integration/minimal-charge.lua minimal_charge
  row bucket.lua,charge src/store/redis/bucket.lua charge
  row one.lua,charge src/store/redis/one.lua charge
  row minimal-slots integration/minimal-slots.lua minimal_slots
  row slots.lua src/store/redis/slots.lua slots
} | awk '{v[$1] = $2; print} END {
  printf "bucket.lua / minimal: %.2f (above an empty script: %.2f)\n", v["bucket.lua"] / v["minimal"], (v["bucket.lua"] - v["empty"]) / (v["minimal"] - v["empty"])
  printf "fixed window / its minimal: %.2f (bucket.lua), %.2f (INCRBY + EXPIRE, as the service counts one of one limit); dedupe start / its minimal: %.2f\n", v["bucket.lua,fixed-window"] / v["minimal-fixed-window"], v["incrby+expire,fixed-window"] / v["minimal-fixed-window"], v["bucket.lua,dedupe"] / v["minimal-dedupe"]
  printf "reservation start / its minimal: %.2f; sliding window: %.2f; calendar period: %.2f; overdraft charge: %.2f; concurrency slot (slots.lua): %.2f\n", v["bucket.lua,reserve"] / v["minimal-reserve"], v["bucket.lua,sliding-window"] / v["minimal-sliding-window"], v["bucket.lua,calendar"] / v["minimal-calendar"], v["bucket.lua,charge"] / v["minimal-charge"], v["slots.lua"] / v["minimal-slots"]
  printf "one bucket alone (one.lua) / its minimal: token bucket %.2f, fixed window %.2f, sliding %.2f, calendar %.2f, overdraft charge %.2f\n", v["one.lua"] / v["minimal"], v["one.lua,fixed-window"] / v["minimal-fixed-window"], v["one.lua,sliding-window"] / v["minimal-sliding-window"], v["one.lua,calendar"] / v["minimal-calendar"], v["one.lua,charge"] / v["minimal-charge"]
}'

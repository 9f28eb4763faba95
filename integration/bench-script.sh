#!/usr/bin/env bash
# Redis's CPU per decision for the bucket script alone, without the
# service: integration/script_calls.py (one connection, 16 calls pipelined;
# bucket.lua's packed arguments hold bytes redis-benchmark cannot send)
# sends EVALSHA of bucket.lua with one
# decision per call, then with a batch of K decisions per call (the batch
# script: `#!lua flags=allow-cross-slot-keys` + bucket.lua, as the service
# sends it; src/store/redis/batch.rs), on one hot key per decision and on
# keys drawn from 100,000. CPU per decision is redis-server's utime+stime
# from /proc; EVALSHA's own usec_per_call is printed beside it. One local
# redis-server on CPU 0, the client on CPU 1. Needs redis-server and
# python3.
#   integration/bench-script.sh [K] [ROUNDS]     (default 16, 2)
set -euo pipefail
cd "$(dirname "$0")/.."
k=${1:-16}; rounds=${2:-2}; port=18798
script=src/store/redis/bucket.lua
work=$(mktemp -d)
trap 'redis-cli -p $port shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
taskset -c 0 redis-server --port "$port" --save "" --appendonly no --daemonize yes --dir "$work" >/dev/null
for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
pid=$(redis-cli -p "$port" info server | awk -F: '/^process_id/ {print $2}' | tr -d '\r')
single=$(redis-cli -p "$port" script load "$(cat "$script")")
batch=$(redis-cli -p "$port" script load "$(printf '#!lua flags=allow-cross-slot-keys\n'; cat "$script")")
ticks() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
# run DECISIONS_PER_CALL hot|spread
run() {
  local per=$1 keys=$2 spread=()
  [ "$keys" = spread ] && spread=(--spread 100000)
  local sha=$single; [ "$per" -gt 1 ] && sha=$batch
  local calls=$((240000 / per))
  redis-cli -p "$port" flushall >/dev/null; redis-cli -p "$port" config resetstat >/dev/null
  local t0 t1
  t0=$(ticks)
  taskset -c 1 python3 integration/script_calls.py "$port" "$sha" token_bucket "$calls" --batch "$per" "${spread[@]}"
  t1=$(ticks)
  local usec
  usec=$(redis-cli -p "$port" info commandstats | grep -oE 'cmdstat_evalsha:.*usec_per_call=[0-9.]+' | grep -oE '[0-9.]+$')
  printf '%-26s redis-server %s us/decision  (EVALSHA %s us per call)\n' "$per per call, $keys keys" \
    "$(awk -v t=$((t1 - t0)) -v n=$((calls * per)) 'BEGIN {printf "%.1f", t * 10000 / n}')" "$usec"
}
for _ in $(seq "$rounds"); do
  for keys in hot spread; do run 1 "$keys"; run "$k" "$keys"; done
done

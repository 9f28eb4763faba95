#!/usr/bin/env bash
# CPU per decision with an attempt id against without (#39), on both stores,
# side by side in one run: the service's utime+stime from /proc over a fixed
# number of ShouldRateLimit calls (rls-bench closed loop, 8 connections x 16
# in flight, one hot key). "without": a rule with no `attempts:`; "dedupe":
# the same rule with `attempts:` and a fresh id per call (each a first call:
# a record written); "reserve": an `overdraft` rule with `attempts:` (each
# start a reservation, a record written, never settled: on Redis its sorted
# set of unsettled ones grows); "reserve + done call": each start followed
# by its done call (rls-bench --settle), as Envoy sends them, both calls
# counted (CPU per call). Rounds alternate the rows. On
# Redis, redis-server's CPU per decision beside it. Loopback only, bounded.
#   integration/bench-attempts.sh [CALLS] [ROUNDS]   (default 200000, 2)
#   STORES="redis" limits the run to one store (default: memory redis)
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-200000}; rounds=${2:-2}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; redis-cli -p 18699 shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
RULES
cat > "$work/attempts.yaml" <<'RULES'
domain: bench_attempts
descriptors:
  - key: key
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
    attempts: {key: request_id, ttl: 1m}
  - key: usage
    overdraft: true
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
    attempts: {key: request_id, ttl: 1m}
RULES
# shellcheck source=integration/cpu-per-decision.sh
. integration/cpu-per-decision.sh
for round in $(seq "$rounds"); do
  echo "round $round"
  for store in ${STORES:-memory redis}; do
    run "$store, without attempts" "$store" bench key
    run "$store, dedupe (an id per call)" "$store" bench_attempts key --attempt-key request_id
    run "$store, reserve (an id per call)" "$store" bench_attempts usage --attempt-key request_id
    run "$store, reserve + done call" "$store" bench_attempts usage --attempt-key request_id --settle
  done
done
# The script alone, without the service: bucket.lua as the store sends it
# (one bucket; a fresh attempt id per call; integration/script_calls.py, as
# its packed arguments hold bytes redis-benchmark cannot send), and the
# price of what an attempt adds, a new key with an expiry: a script that
# only SETs one with PX, on a fresh key per call against the same key.
if [[ " ${STORES:-memory redis} " == *" redis "* ]]; then
  echo "$calls calls each (redis-server CPU per call)"
  sha=$(redis-cli -p 18699 script load "$(cat src/store/redis/bucket.lua)")
  set_px=$(redis-cli -p 18699 script load "return redis.call('SET', KEYS[1], ARGV[1], 'PX', 120000)")
  cpu_per_call() { # LABEL R0 R1
    python3 -c "import os,sys; print(f'{sys.argv[1]:<34} {(int(sys.argv[3]) - int(sys.argv[2])) / os.sysconf(\"SC_CLK_TCK\") * 1e6 / int(sys.argv[4]):6.2f} us/call')" \
      "$1" "$2" "$3" "$calls"
  }
  bench_script() { # LABEL KIND
    redis-cli -p 18699 flushall >/dev/null
    local r0 r1
    r0=$(ticks "$redis_pid")
    python3 integration/script_calls.py 18699 "$sha" "$2" "$calls"
    r1=$(ticks "$redis_pid")
    cpu_per_call "$1" "$r0" "$r1"
  }
  bench_set() { # LABEL redis-benchmark arguments
    local label=$1; shift
    redis-cli -p 18699 flushall >/dev/null
    local r0 r1
    r0=$(ticks "$redis_pid")
    redis-benchmark -p 18699 -n "$calls" -r 100000000 -P 16 -c 8 -q "$@" >/dev/null
    r1=$(ticks "$redis_pid")
    cpu_per_call "$label" "$r0" "$r1"
  }
  for round in $(seq "$rounds"); do
    bench_script "bucket.lua, without attempts" token_bucket
    bench_script "bucket.lua, dedupe (an id per call)" dedupe
    bench_script "bucket.lua, dedupe (one id: repeats)" dedupe_repeat
    bench_script "bucket.lua, reserve (an id per call)" reserve
    bench_set "SET … PX, the same key" EVALSHA "$set_px" 1 'a:1' xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx
    bench_set "SET … PX, a new key per call" EVALSHA "$set_px" 1 'a:__rand_int__' xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx
  done
fi

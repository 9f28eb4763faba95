#!/usr/bin/env bash
# Instructions per decision of the service (#55), counted by callgrind:
# deterministic where CPU time on a shared box is not. Each server runs
# under callgrind (instrumentation off), takes a warm-up, then its
# instructions over CALLS ShouldRateLimit calls are counted (all its
# threads): rls-bench closed loop, 8 connections x 16 in flight, one
# descriptor, one hot key (the bar shape of bench-cpu.sh). Rows: the floor
# (examples/rls-floor.rs: a constant-OK tonic server from the same
# dependencies), the service on the memory store, and on the memory store
# with one serving thread, and without heavy hitters (--heavy-hitters 0:
# what they cost a decision); then the Redis store on a local redis-server
# (not under callgrind: the service's own instructions), with and without
# heavy hitters. Callgrind runs one thread at a time: what is counted is
# work, not contention.
#   integration/bench-service-ir.sh [CALLS]   (default 20000)
# Needs valgrind.
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-20000}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; pkill -f "callgrind.*18591" 2>/dev/null || true; redis-cli -p 18593 shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
cargo build --release --bins --example rls-floor --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
RULES
wait_port() { for _ in $(seq 600); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }
bench() { target/release/rls-bench --target http://127.0.0.1:18591 --domain bench --key key \
  --requests "$1" --duration 600s --warmup 0s --json >/dev/null 2>&1; }
# row LABEL ENV... -- COMMAND...: instructions per call
row() {
  local label=$1; shift
  local env=(); while [ "$1" != -- ]; do env+=("$1"); shift; done; shift
  (cd "$work" && env "${env[@]}" valgrind --tool=callgrind --instr-atstart=no \
    --callgrind-out-file="$work/cg.%p" "$@" >"$work/server.log" 2>&1 &)
  wait_port 18591
  local vpid; vpid=$(pgrep -f "callgrind.*18591" | head -1)
  bench 2000
  callgrind_control -z "$vpid" >/dev/null 2>&1
  callgrind_control -i on "$vpid" >/dev/null 2>&1
  bench "$calls"
  callgrind_control -i off "$vpid" >/dev/null 2>&1
  kill "$vpid"; while kill -0 "$vpid" 2>/dev/null; do sleep 0.2; done
  # what was collected while instrumentation was on, from valgrind's
  # summary at exit (callgrind_control -e can time out on a process whose
  # threads all sleep, and answer a part)
  local ir
  ir=$(awk '/Collected :/ {gsub(",", "", $4); print $4}' "$work/server.log" | tail -1)
  echo "$label $((ir / calls))"
}
rls=("$PWD/target/release/tokenbucket-rls" --config "$work" --grpc-addr 127.0.0.1:18591 --admin-addr 127.0.0.1:18592)
{
  row floor X=1 -- "$PWD/target/release/examples/rls-floor" 127.0.0.1:18591
  row memory X=1 -- "${rls[@]}"
  row memory,one-serving-thread X=1 -- "${rls[@]}" --serving-threads 1
  row memory,no-heavy-hitters X=1 -- "${rls[@]}" --heavy-hitters 0
  redis-server --port 18593 --save "" --appendonly no --daemonize yes --dir "$work" >/dev/null
  row redis X=1 -- "${rls[@]}" --store redis --redis-url redis://127.0.0.1:18593 --redis-timeout 10s --instances 1
  row redis,no-heavy-hitters X=1 -- "${rls[@]}" --store redis --redis-url redis://127.0.0.1:18593 --redis-timeout 10s --instances 1 --heavy-hitters 0
} | awk '{v[$1] = $2; printf "%-32s %9d instructions per call\n", $1, $2} END {
  printf "memory / floor: %.2f; one serving thread / floor: %.2f\n", v["memory"] / v["floor"], v["memory,one-serving-thread"] / v["floor"]
  printf "heavy hitters on / off: memory %.3f, redis %.3f\n", v["memory"] / v["memory,no-heavy-hitters"], v["redis"] / v["redis,no-heavy-hitters"]
}'

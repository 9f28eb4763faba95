#!/usr/bin/env bash
# CPU per decision by algorithm (#41): a token-bucket rule against the same
# rule with `algorithm: fixed_window`, on both stores, side by side in one
# run: the service's utime+stime from /proc over a fixed number of
# ShouldRateLimit calls (rls-bench closed loop, 8 connections x 16 in
# flight, one hot key), and on Redis redis-server's CPU beside it. Rounds
# alternate the rows. Loopback only, bounded.
#   integration/bench-algorithms.sh [CALLS] [ROUNDS]   (default 200000, 2)
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-200000}; rounds=${2:-2}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; redis-cli -p 18699 shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: bucket
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
  - key: fixed
    algorithm: fixed_window
    rate_limit: {unit: hour, requests_per_unit: 1000000000}
RULES
redis-server --port 18699 --save "" --appendonly no --daemonize yes --dir "$work" >/dev/null
until redis-cli -p 18699 ping 2>/dev/null | grep -q PONG; do sleep 0.05; done
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }
redis_pid=$(redis-cli -p 18699 info server | awk -F: '/^process_id/ {print $2}' | tr -d '\r')
run() { # LABEL STORE KEY
  local label=$1 store=$2 key=$3
  local args=(); [ "$store" = redis ] && args=(--store redis --redis-url redis://127.0.0.1:18699)
  redis-cli -p 18699 flushall >/dev/null
  target/release/tokenbucket-rls --config "$work" --grpc-addr 127.0.0.1:18581 --admin-addr 127.0.0.1:18582 "${args[@]}" >"$work/server.log" 2>&1 &
  local pid=$!
  wait_port 18581
  local b r0 a r1 out
  b=$(ticks "$pid"); r0=$(ticks "$redis_pid")
  out=$(target/release/rls-bench --target http://127.0.0.1:18581 --domain bench --key "$key" \
    --requests "$calls" --duration 120s --warmup 0s --json 2>/dev/null)
  a=$(ticks "$pid"); r1=$(ticks "$redis_pid")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  python3 - "$label" "$out" "$b" "$a" "$r0" "$r1" "$store" <<'PY'
import json, os, sys
label, out, b, a, r0, r1, store = sys.argv[1:8]
r = json.loads(out); hz = os.sysconf("SC_CLK_TCK"); n = r["requests"]
svc = (int(a) - int(b)) / hz * 1e6 / n
red = (int(r1) - int(r0)) / hz * 1e6 / n
extra = f"  redis-server {red:.1f} us" if store == "redis" else ""
print(f"{label:<28} {svc:6.1f} us/decision{extra}  {r['throughput_rps']:8.0f}/s  ok {r.get('ok', '?')}")
PY
  sleep 0.3
}
for round in $(seq "$rounds"); do
  echo "round $round"
  for store in ${STORES:-memory redis}; do
    run "$store, token bucket" "$store" bucket
    run "$store, fixed window" "$store" fixed
  done
done

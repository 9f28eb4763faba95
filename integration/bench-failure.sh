#!/usr/bin/env bash
# Decision latency when Redis is healthy, when one primary is hung (SIGSTOP:
# its keys answer by their failure mode, the others' by Redis; once with
# Redis's default cluster-require-full-coverage yes, then with no), when one
# is killed (its replica takes over within the phase), when every node
# is hung, and when every node is dead: rls-bench in open loop at a fixed rate
# against one instance on a local Redis Cluster, with --redis-timeout 10ms (as
# in the first recorded table; the default is 50ms) and rules that fail open.
# Loopback only, bounded in time.
#   integration/bench-failure.sh [SECONDS] [RATE]      (default 10 s at 2000/s)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}; rate=${2:-2000}
work=$(mktemp -d)
trap 'for p in $(seq 7401 7406); do kill -CONT $(cat "$work/cluster/$p/redis.pid" 2>/dev/null) 2>/dev/null || true; done; integration/redis-cluster.sh stop "$work/cluster" 7401; kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
url=$(integration/redis-cluster.sh start "$work/cluster" 7401)
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key
    failure_mode: open
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
RULES
target/release/tokenbucket-rls --config "$work/rules.yaml" --store redis --redis-url "$url" \
  --redis-timeout 10ms --grpc-addr 127.0.0.1:18281 --admin-addr 127.0.0.1:18282 >"$work/rls.log" 2>&1 &
until curl -sf 127.0.0.1:18282/readyz >/dev/null; do sleep 0.1; done
run() {
  target/release/rls-bench --target http://127.0.0.1:18281 --rate "$rate" --duration "${secs}s" --warmup 0s \
    --distribution uniform --keys 10000 --json \
  | python3 -c "import json,sys; r=json.load(sys.stdin); l=r['latency_us']; print(f\"$1: {r['throughput_rps']:.0f}/s ok {r['ok']} errors {r['errors']}  p50 {l['p50']}us p99 {l['p99']}us p999 {l['p999']}us max {l['max']}us\")" 2>/dev/null
  echo "  timeouts so far: $(curl -s 127.0.0.1:18282/metrics | awk '$1 == "rls_store_errors_total{kind=\"timeout\"}" {print $2}')"
}
metric() { curl -s 127.0.0.1:18282/metrics | awk -v m="$1" '$1 == m {print $2}'; }
run "healthy"
# One primary sick: its keys answer by their failure mode, the rest by Redis
# (except, with Redis's default cluster-require-full-coverage yes, during the
# window in which Redis itself refuses every key).
one_sick() { # LABEL SIGNAL
  local open_before open_after primary
  primary=$(for p in $(seq 7401 7406); do redis-cli -p "$p" role 2>/dev/null | head -n 1 | grep -q master && echo "$p" && break; done)
  open_before=$(metric 'rls_failure_policy_total{mode="open"}')
  kill "-$2" "$(cat "$work/cluster/$primary/redis.pid")"
  run "$1"
  kill -CONT "$(cat "$work/cluster/$primary/redis.pid")" 2>/dev/null || true
  open_after=$(metric 'rls_failure_policy_total{mode="open"}')
  echo "  one primary ($primary, SIG$2): $(python3 -c "print(int(float('$open_after' or 0) - float('$open_before' or 0)))") decisions by the failure mode, the rest by Redis"
  sleep 3
}
one_sick "1 hung, full coverage" STOP
for p in $(seq 7401 7406); do redis-cli -p "$p" config set cluster-require-full-coverage no >/dev/null || true; done
one_sick "1 hung " STOP
one_sick "1 killed" KILL
for p in $(seq 7401 7406); do kill -STOP "$(cat "$work/cluster/$p/redis.pid")" 2>/dev/null || true; done
run "hung   "
for p in $(seq 7401 7406); do kill -CONT "$(cat "$work/cluster/$p/redis.pid")" 2>/dev/null || true; done
sleep 2
integration/redis-cluster.sh stop "$work/cluster" 7401
sleep 1
run "dead   "
echo "store errors: $(curl -s 127.0.0.1:18282/metrics | grep -E '^rls_store_errors_total' | tr '\n' ' ')"
echo "failure policy: $(curl -s 127.0.0.1:18282/metrics | grep -E '^rls_failure_policy_total\{mode="open"' )"

#!/usr/bin/env bash
# A Redis outage of five minutes under steady load (#40): rls-bench in open
# loop at a fixed rate against one instance on a local redis-server, with a
# closed rule (every answer in the outage is UNAVAILABLE, the failure mode).
# Phases: healthy (20 s), Redis stopped (OUTAGE s), Redis started again.
# Reports per phase the answers and their latency, the service's resident
# memory (VmRSS, sampled every second: before, the most during the outage,
# after), how long after Redis answers PING again the first decision is
# made in Redis, and then whether decisions are exact (100 calls on a fresh
# bucket of 50: 50 admitted). Loopback only, bounded in time.
#   integration/bench-outage.sh [OUTAGE_SECONDS] [RATE]   (default 300 s at 2000/s)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-300}; rate=${2:-2000}
port=18799; grpc=18781; admin=18782
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; redis-cli -p $port shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key
    failure_mode: closed
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
  - key: exact
    failure_mode: closed
    rate_limit: {unit: day, requests_per_unit: 1, burst: 50}
RULES
start_redis() {
  redis-server --port $port --save "" --appendonly no --daemonize yes --dir "$work" >/dev/null
  until redis-cli -p $port ping 2>/dev/null | grep -q PONG; do sleep 0.01; done
}
start_redis
target/release/tokenbucket-rls --config "$work/rules.yaml" --store redis --redis-url "redis://127.0.0.1:$port" \
  --grpc-addr 127.0.0.1:$grpc --admin-addr 127.0.0.1:$admin >"$work/rls.log" 2>&1 &
pid=$!
until curl -sf 127.0.0.1:$admin/readyz >/dev/null; do sleep 0.1; done
rss() { awk '/^VmRSS/ {print $2}' "/proc/$pid/status"; }
bench() { # LABEL SECONDS
  # rls-bench exits non-zero when every call failed (the outage): its
  # figures are printed all the same
  { target/release/rls-bench --target http://127.0.0.1:$grpc --rate "$rate" --duration "$2s" --warmup 0s \
      --distribution uniform --keys 10000 --json --threads 1 2>/dev/null || true; } \
  | python3 -c "import json,sys; r=json.load(sys.stdin); l=r['latency_us']; print(f\"$1: {r['throughput_rps']:.0f}/s ok {r['ok']} over {r['over_limit']} errors {r['errors']}  p50 {l['p50']}us p99 {l['p99']}us p999 {l['p999']}us max {l['max']}us\")"
}
metric() { curl -s 127.0.0.1:$admin/metrics | awk -v m="$1" '$1 == m {s += $2} END {print s + 0}'; }
bench "healthy (20 s)" 20
before=$(rss)
echo "resident memory before the outage: $((before / 1024)) MB"
redis-cli -p $port shutdown nosave >/dev/null 2>&1 || true
echo 0 > "$work/max"
( while kill -0 $pid 2>/dev/null; do r=$(rss); [ "$r" -gt "$(cat "$work/max")" ] && echo "$r" > "$work/max"; sleep 1; done ) &
sampler=$!
bench "Redis stopped ($secs s)" "$secs"
kill $sampler 2>/dev/null || true
during=$(cat "$work/max")
echo "resident memory during the outage: at most $((during / 1024)) MB ($(( (during - before) / 1024 )) MB over before; $(( during - before )) kB)"
echo "store errors counted: $(metric 'rls_store_errors_total{kind="connection"}') connection, $(metric 'rls_store_errors_total{kind="timeout"}') timeout (the breaker answers the rest without asking Redis)"
curl -s 127.0.0.1:$admin/metrics | grep '^rls_failure_policy_total' | sed 's/^/  /'
start_redis
t0=$(date +%s%N)
until target/release/rls-bench --target http://127.0.0.1:$grpc --domain bench --key exact --requests 1 \
    --connections 1 --concurrency 1 --warmup 0s --json 2>/dev/null | python3 -c "import json,sys; sys.exit(0 if json.load(sys.stdin)['ok'] == 1 else 1)"; do
  sleep 0.02
done
t1=$(date +%s%N)
echo "first decision in Redis $(( (t1 - t0) / 1000000 )) ms after it answered PING"
redis-cli -p $port flushall >/dev/null
target/release/rls-bench --target http://127.0.0.1:$grpc --domain bench --key exact --requests 100 \
  --connections 1 --concurrency 1 --warmup 0s --json \
  | python3 -c "import json,sys; r=json.load(sys.stdin); print(f\"exact again: 100 calls on a bucket of 50: ok {r['ok']} over {r['over_limit']} errors {r['errors']}\")"
bench "after (20 s)" 20
echo "resident memory after: $(( $(rss) / 1024 )) MB"

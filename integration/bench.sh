#!/usr/bin/env bash
# One benchmark run on one machine, everything side by side:
#   - redis-benchmark running our Lua script (EVALSHA) directly on one shard:
#     the limit for one hot key;
#   - rls-bench against tokenbucket-rls with the Redis Cluster store (one hot
#     key, uniform over 10k keys, zipf over 10k keys) and with the memory store.
# Prints a summary with ratios. Loopback only, bounded in time.
#   integration/bench.sh [SECONDS]          (default 10 per run)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
work=$(mktemp -d)
trap 'integration/redis-cluster.sh stop "$work/cluster" 7101; kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

cargo build --release --bins --locked 2>&1 | tail -n 1
url=$(integration/redis-cluster.sh start "$work/cluster" 7101)

cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key                 # every request admitted: measures the decision, not rejections
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
RULES

# Baseline: the script itself on the shard that owns the hot key, 50 clients.
sha=$(redis-cli -p 7101 script load "$(cat src/store/redis/bucket.lua)")
port=""
for p in 7101 7102 7103; do
  if redis-cli -p "$p" role | head -n 1 | grep -q master; then
    slot=$(redis-cli -p "$p" cluster keyslot "rls:{hot}:k")
    if redis-cli -p "$p" cluster nodes | grep myself | tr ' ' '\n' | grep -E '^[0-9]+-[0-9]+$' | \
       awk -F- -v s="$slot" '$1 <= s && s <= $2 {found=1} END {exit !found}'; then port=$p; fi
  fi
done
redis-cli -p "$port" script load "$(cat src/store/redis/bucket.lua)" >/dev/null
baseline=$(redis-benchmark -p "$port" -c 50 -n $((secs * 60000)) -q \
  EVALSHA "$sha" 1 "rls:{hot}:k" 1 1 1000 1000000000 1000000000 1 | tr '\r' '\n' | grep -oE '[0-9.]+ requests per second' | tail -n 1 | cut -d' ' -f1)

run_service() {  # store, grpc port, extra args...
  local store=$1 port=$2; shift 2
  target/release/tokenbucket-rls --config "$work/rules.yaml" --store "$store" \
    --grpc-addr "127.0.0.1:$port" --admin-addr "127.0.0.1:$((port + 1))" "$@" >"$work/rls-$port.log" 2>&1 &
  until curl -sf "127.0.0.1:$((port + 1))/readyz" >/dev/null; do sleep 0.1; done
}
bench() {  # port, label, rls-bench args...
  local port=$1 label=$2; shift 2
  target/release/rls-bench --target "http://127.0.0.1:$port" --duration "${secs}s" --json "$@" | tee -a "$work/results.jsonl" \
    | python3 -c "import json,sys; r=json.load(sys.stdin); l=r['latency_us']; print(f\"$label: {r['throughput_rps']:.0f}/s  ok {r['ok']} over {r['over_limit']} errors {r['errors']}  p50 {l['p50']}us p99 {l['p99']}us p999 {l['p999']}us\")" \
    | tee -a "$work/summary.txt"
}

run_service redis 18181 --redis-url "$url" --redis-timeout 100ms
bench 18181 "redis store, hot key     " --distribution hot
bench 18181 "redis store, 10k uniform " --distribution uniform --keys 10000
bench 18181 "redis store, 10k zipf 1.0" --distribution zipf --keys 10000
run_service memory 18191
bench 18191 "memory store, hot key    " --distribution hot
bench 18191 "memory store, 10k uniform" --distribution uniform --keys 10000

echo
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u +%F)"
echo "redis-benchmark, EVALSHA bucket.lua on one shard, 50 clients: ${baseline}/s"
hot=$(grep -m1 'redis store, hot key' "$work/summary.txt" | grep -oE '^[^:]+: [0-9]+' | grep -oE '[0-9]+$')
echo "ratio redis store hot key / redis-benchmark on its shard: $(python3 -c "print(f'{$hot/$baseline:.2f}')")"

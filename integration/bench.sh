#!/usr/bin/env bash
# One benchmark run on one machine, everything side by side:
#   - redis-benchmark running our Lua script (EVALSHA) directly on one shard:
#     the limit for one hot key;
#   - h2load (-c8 -m16, one descriptor per call), an independent HTTP/2 load
#     generator, against the Redis Cluster store and the memory store;
#   - rls-bench closed loop: hot key, uniform over 10k keys, zipf over 10k keys;
#   - rls-bench open loop at half of each store's h2load saturation, for p99;
#   - one hot key with and without `lease` (redis store), with the Redis
#     calls per admitted request read from the service's metrics;
#   - CPU per decision (integration/bench-cpu.sh): the constant-answer floor,
#     the memory store, the Redis store (service and redis-server), and
#     Limitador when LIMITADOR_BIN is set, from /proc over a fixed count.
# Prints a summary with ratios. Loopback only, bounded in time. Needs
# redis-server and h2load (Debian: redis-server, nghttp2-client).
#   integration/bench.sh [SECONDS]          (default 10 per run)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
work=$(mktemp -d)
trap 'integration/redis-cluster.sh stop "$work/cluster" 7101; kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

command -v h2load >/dev/null || { echo "bench: h2load missing (apt-get install nghttp2-client)" >&2; exit 1; }
cargo build --release --bins --locked 2>&1 | tail -n 1
url=$(integration/redis-cluster.sh start "$work/cluster" 7101)

cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key                 # every request admitted: measures the decision, not rejections
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
  - key: leased              # the same bucket size, spent through leases of 1000 tokens
    lease: {size: 1000, ttl: 1s}
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
  EVALSHA "$sha" 1 "rls:{hot}:k" 1 1 1 1000 0 1000000000 1000000000 1 -1 | tr '\r' '\n' | grep -oE '[0-9.]+ requests per second' | tail -n 1 | cut -d' ' -f1)

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

# Store calls the service has made so far (lease calls and returns included).
store_calls() {  # admin port
  curl -sf "127.0.0.1:$1/metrics" | awk '/^rls_store_calls_total/ {n += $2} END {printf "%d", n}'
}
# rls-bench on one key, then the store calls per admitted request.
bench_calls() {  # port, label, rls-bench args...
  local port=$1 label=$2 before after ok; shift 2
  before=$(store_calls $((port + 1)))
  bench "$port" "$label" --warmup 0s "$@" >&2
  after=$(store_calls $((port + 1)))
  ok=$(tail -n 1 "$work/results.jsonl" | python3 -c "import json,sys; print(json.load(sys.stdin)['ok'])")
  echo "$label: $((after - before)) store calls for $ok admitted ($(python3 -c "print(f'{($after - $before) / max($ok, 1):.4f}')") per admitted request)" | tee -a "$work/summary.txt" >&2
  tail -n 1 "$work/results.jsonl" | python3 -c "import json,sys; print(int(json.load(sys.stdin)['throughput_rps']))"
}

# gRPC ShouldRateLimit bodies for h2load: domain bench, one descriptor,
# (key, k0) and (leased, k0).
python3 integration/h2load_body.py "$work" hot=key leased=leased
h2() {  # port, label[, body]
  local out rps
  out=$(h2load -D "$secs" -c 8 -m 16 -t 1 -d "$work/${3:-hot}.bin" -H content-type:application/grpc -H te:trailers \
    "http://127.0.0.1:$1/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" 2>&1)
  rps=$(echo "$out" | grep -oE '[0-9.]+ req/s' | head -n 1 | cut -d' ' -f1)
  echo "$2: $rps/s  (h2load -c8 -m16; $(echo "$out" | grep -E '^requests:' | sed 's/^requests: //'); latency $(echo "$out" | grep -E 'time for request' | awk '{print "min " $4 " max " $5 " mean " $6}'))" | tee -a "$work/summary.txt" >&2
  echo "${rps%.*}"
}

run_service redis 18181 --redis-url "$url" --redis-timeout 100ms
redis_h2=$(h2 18181 "h2load, redis store, hot key ")
leased_h2=$(h2 18181 "h2load, redis store, hot key, leased" leased)
unleased=$(bench_calls 18181 "redis store, hot key, no lease" --distribution hot --key key)
leased=$(bench_calls 18181 "redis store, hot key, leased  " --distribution hot --key leased)
bench 18181 "redis store, 10k uniform " --distribution uniform --keys 10000
redis_closed=$(tail -n 1 "$work/results.jsonl" | python3 -c "import json,sys; print(int(json.load(sys.stdin)['throughput_rps']))")
bench 18181 "redis store, 10k zipf 1.0" --distribution zipf --keys 10000
# Half of what this generator reaches in closed loop (h2load reaches more,
# but rls-bench itself cannot send that fast on these cores).
bench 18181 "redis store, open loop at half saturation" --distribution uniform --keys 10000 --rate $((redis_closed / 2))
run_service memory 18191
memory_h2=$(h2 18191 "h2load, memory store, hot key")
bench 18191 "memory store, hot key    " --distribution hot
bench 18191 "memory store, 10k uniform" --distribution uniform --keys 10000
memory_closed=$(tail -n 1 "$work/results.jsonl" | python3 -c "import json,sys; print(int(json.load(sys.stdin)['throughput_rps']))")
bench 18191 "memory store, open loop at half saturation" --distribution uniform --keys 10000 --rate $((memory_closed / 2))

echo
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u +%F)"
echo "redis-benchmark, EVALSHA bucket.lua on one shard, 50 clients: ${baseline}/s"
echo "h2load hot key: redis store ${redis_h2}/s, memory store ${memory_h2}/s"
echo "ratio redis store (h2load, hot key) / redis-benchmark on its shard: $(python3 -c "print(f'{$redis_h2/$baseline:.2f}')")"
echo "hot key, redis store, h2load: leased ${leased_h2}/s vs not ${redis_h2}/s: $(python3 -c "print(f'{$leased_h2/$redis_h2:.2f}')")x"
echo "hot key, redis store, rls-bench: leased ${leased}/s vs not ${unleased}/s: $(python3 -c "print(f'{$leased/$unleased:.2f}')")x; leased / redis-benchmark on its shard: $(python3 -c "print(f'{$leased/$baseline:.2f}')")x"
echo
echo "CPU per decision (utime+stime from /proc over a fixed number of calls):"
integration/bench-cpu.sh "${CPU_CALLS:-200000}" "${CPU_ROUNDS:-3}"

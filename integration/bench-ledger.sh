#!/usr/bin/env bash
# The shared RLQS ledger's cost on its Redis, in one run (release build, one
# redis-server, the Redis store, loopback, bounded):
#   1. members: one simulated Envoy (rls-bench --rlqs) reporting N bucket
#      ids every second under a `share_threshold` rule, so one shared bucket
#      of N (stream, id) members, N in 10 64 512 4096. Over 20 s once all
#      are held: redis-server's CPU (utime+stime from /proc) per report
#      message, the ledger calls (EVALSHA, from INFO commandstats) per
#      second, and their time inside Redis per call.
#   2. beside a fleet: ShouldRateLimit p50/p99 on the same Redis (rls-bench
#      open loop, 200 calls/s) alone, then beside 100 simulated Envoys
#      reporting the same 1,000 ordinary buckets every 5 s (100,000 pairs).
#   3. the same fleet and probe on the memory store (no ledger): what the
#      fleet costs ShouldRateLimit through the service's own CPU alone.
#   integration/bench-ledger.sh [members] [fleet] [memory]   (default: all)
# RLS_BIN picks the service binary (default target/release/tokenbucket-rls),
# so that an older build can be measured in the same way, beside.
# GENERATOR_NICE=19 runs the simulated Envoys at that niceness: on a box
# with few cores they then take only the CPU the service and Redis leave,
# as if they ran elsewhere (the probe keeps the normal priority).
# GENERATOR_CPUS and SERVICE_CPUS (taskset lists, e.g. 1 and 0) pin the
# simulated Envoys apart from the service, Redis and the probe.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
phases=" ${*:-members fleet memory} "
bin=${RLS_BIN:-target/release/tokenbucket-rls}
redis_port=18795
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key
    rate_limit: {unit: second, requests_per_unit: 1000000, burst: 1000000}
  - key: id
    value: "k*"
    share_threshold: true
    rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
RULES
pin() { # CPUS COMMAND...: becomes COMMAND, on those CPUs (all when CPUS is
  # empty); only in a background job or a pipeline, so that $! is its pid
  local cpus=$1
  shift
  if [[ -n $cpus ]]; then exec taskset -c "$cpus" "$@"; else exec "$@"; fi
}
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
metric() { # NAME_AND_LABELS
  curl -s 127.0.0.1:18792/metrics | awk -v m="$1" 'index($0, m " ") == 1 {print $2; f = 1} END {if (!f) print 0}'
}
evalsha() { # "calls usec" of EVALSHA so far
  redis-cli -p "$redis_port" info commandstats |
    awk -F'[=,:]' '/^cmdstat_evalsha:/ {print $3, $5; f = 1} END {if (!f) print 0, 0}'
}
redis() {
  if redis-cli -p "$redis_port" ping >/dev/null 2>&1; then
    echo "port $redis_port already has a Redis: stop it first" >&2
    exit 1
  fi
  pin "${SERVICE_CPUS:-}" redis-server --port "$redis_port" --save "" --appendonly no --daemonize no >"$work/redis.log" 2>&1 &
  rpid=$!
  until redis-cli -p "$redis_port" ping >/dev/null 2>&1; do sleep 0.1; done
}
serve() { # [STORE]
  RLS_CONFIG="$work/rules.yaml" RLS_GRPC_ADDR=127.0.0.1:18791 RLS_ADMIN_ADDR=127.0.0.1:18792 \
    RLS_STORE="${1:-redis}" RLS_REDIS_URL="redis://127.0.0.1:$redis_port" pin "${SERVICE_CPUS:-}" "$bin" >"$work/server.log" 2>&1 &
  pid=$!
  until curl -sf 127.0.0.1:18792/readyz >/dev/null; do sleep 0.1; done
}
stop() {
  kill "$pid" "$rpid"
  wait "$pid" "$rpid" 2>/dev/null || true
  sleep 0.3
}
probe() { # SECONDS: ShouldRateLimit p50/p99 in ms
  pin "${SERVICE_CPUS:-}" target/release/rls-bench --target http://127.0.0.1:18791 --domain bench --key key \
    --rate 200 --connections 4 --threads 1 --duration "$1s" --json |
    python3 -c 'import json,sys; j=json.load(sys.stdin); l=j["latency_us"]; print("p50 %.2f ms, p99 %.2f ms (%d calls, %d errors)" % (l["p50"] / 1000, l["p99"] / 1000, j["requests"], j["errors"]))'
}
envoys() { # STREAMS BUCKETS KEY EVERY SECONDS
  pin "${GENERATOR_CPUS:-}" nice -n "${GENERATOR_NICE:-0}" target/release/rls-bench --target http://127.0.0.1:18791 --domain bench --key "$3" \
    --rlqs throughput --streams "$1" --buckets "$2" --report-every "$4" --duration "$5s" \
    --threads 1 >/dev/null 2>&1 &
  load=$!
}
held() { # PAIRS: wait (at most 60 s) until that many bucket reports were processed
  for _ in $(seq 600); do
    n=$(metric 'rls_quota_reports_total{domain="bench"}')
    python3 -c "import sys; sys.exit(0 if float('$n') >= $1 else 1)" && return
    sleep 0.1
  done
}

echo "binary: $bin"
for members in 10 64 512 4096; do
  [[ $phases == *" members "* ]] || break
  redis
  serve
  envoys 1 "$members" id 1s 45
  held "$members"
  sleep 3
  c0=$(ticks "$rpid"); read -r e0 u0 <<<"$(evalsha)"; r0=$(metric 'rls_quota_reports_total{domain="bench"}')
  sleep 20
  c1=$(ticks "$rpid"); read -r e1 u1 <<<"$(evalsha)"; r1=$(metric 'rls_quota_reports_total{domain="bench"}')
  failed=$(metric 'rls_store_errors_total{kind="timeout"}')
  kill "$load" 2>/dev/null || true
  wait "$load" 2>/dev/null || true
  python3 - "$members" "$c0" "$c1" "$e0" "$e1" "$u0" "$u1" "$r0" "$r1" "$failed" <<'PY'
import os, sys
members, c0, c1, e0, e1, u0, u1, r0, r1, failed = sys.argv[1:]
hz = os.sysconf("SC_CLK_TCK")
cpu = (int(c1) - int(c0)) / hz
calls = int(e1) - int(e0)
messages = (float(r1) - float(r0)) / int(members)
print(f"{int(members):>5} members: {messages:.0f} report messages in 20 s; redis-server "
      f"{cpu * 1e3 / max(messages, 1):.2f} ms CPU per report message ({cpu / 20 * 100:.1f} % of a core); "
      f"ledger calls {calls / 20:.1f}/s, {(int(u1) - int(u0)) / max(calls, 1):.1f} us each inside Redis; "
      f"store timeouts {float(failed):.0f}")
PY
  stop
done

fleet() { # STORE
  redis
  serve "$1"
  echo "ShouldRateLimit alone on the $1 store: $(probe 20)"
  envoys 100 1000 key 5s 110
  held 100000
  # past the joins (one step per Envoy joining a bucket) to the steady state
  sleep 15
  # the ledger's calls, counted without the probe (whose warm-up decides too)
  read -r e0 _ <<<"$(evalsha)"
  sleep 10
  read -r e1 _ <<<"$(evalsha)"
  c0=$(ticks "$rpid"); s0=$(ticks "$pid")
  beside=$(probe 20)
  c1=$(ticks "$rpid"); s1=$(ticks "$pid")
  echo "ShouldRateLimit beside 100 Envoys x 1,000 buckets ($1 store): $beside; service $(python3 -c "import os; print('%.0f' % ((int('$s1') - int('$s0')) / os.sysconf('SC_CLK_TCK') / 20 * 100))") % of a core, redis-server $(python3 -c "import os; print('%.1f' % ((int('$c1') - int('$c0')) / os.sysconf('SC_CLK_TCK') / 20 * 100))") % of a core over the probe; $(( (e1 - e0) / 10 )) ledger calls/s before it"
  kill "$load" 2>/dev/null || true
  wait "$load" 2>/dev/null || true
  stop
}
[[ $phases != *" fleet "* ]] || fleet redis
[[ $phases != *" memory "* ]] || fleet memory

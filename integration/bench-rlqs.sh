#!/usr/bin/env bash
# The RLQS server's cost, in one run (release build, loopback, bounded):
#   - bucket reports processed per second and CPU per bucket report (the
#     service's utime+stime from /proc over its own rls_quota_reports_total),
#     `rls-bench --rlqs throughput --admin` with 10 simulated Envoys x 10
#     buckets reporting as fast as flow control lets them (counted: what the
#     service processed, until its count stops moving), with the memory store
#     (each instance splits its Envoys) and with the Redis store (the shared
#     ledger on one local redis-server: one script call per bucket report,
#     plus one per (stream, bucket) a second; redis-server CPU beside);
#   - memory per (Envoy, bucket): the service's resident set before and
#     while 10 Envoys x 5,000 buckets report once a second (as Envoy does),
#     over the 50,000 (stream, bucket) pairs;
#   - convergence: `rls-bench --rlqs converge` (seconds for shares to follow
#     a swap of demand 900:100 between two Envoys), memory and Redis stores.
# Needs redis-server.
#   integration/bench-rlqs.sh [SECONDS]       (default 10)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
work=$(mktemp -d)
rport=18799
trap 'kill $(jobs -p) 2>/dev/null || true; redis-cli -p '"$rport"' shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key
    rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
RULES
redis-server --port "$rport" --save "" --appendonly no --daemonize yes --dir "$work" >/dev/null
rpid=$(redis-cli -p "$rport" info server | awk -F: '/^process_id/ {print $2}' | tr -d '\r')
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rss_kb() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
reports() { curl -s 127.0.0.1:18782/metrics | awk '/^rls_quota_reports_total/ {s += $2} END {print s + 0}'; }
serve() { # STORE
  local extra=()
  [ "$1" = redis ] && extra=(RLS_STORE=redis RLS_REDIS_URL="redis://127.0.0.1:$rport" RLS_REDIS_TIMEOUT=500ms)
  env RLS_CONFIG="$work/rules.yaml" RLS_GRPC_ADDR=127.0.0.1:18781 RLS_ADMIN_ADDR=127.0.0.1:18782 \
    "${extra[@]}" target/release/tokenbucket-rls >"$work/server.log" 2>&1 &
  pid=$!
  until curl -sf 127.0.0.1:18782/readyz >/dev/null; do sleep 0.1; done
}
stop() { kill "$pid"; wait "$pid" 2>/dev/null || true; sleep 0.3; }
bench() { target/release/rls-bench --target http://127.0.0.1:18781 --domain bench --key key "$@"; }

# Baseline in the same run: the ledger script alone on a bucket of 10
# members (redis-benchmark EVALSHA, Redis's own usec_per_call).
sha=$(redis-cli -p "$rport" script load "$(cat src/quota/ledger.lua)")
args=(100000 200000 100000 15000 5000 200 100 50)
for m in $(seq 10); do redis-cli -p "$rport" evalsha "$sha" 1 'rls:{base}:quota' "1:$m" "${args[@]}" >/dev/null; done
redis-cli -p "$rport" config resetstat >/dev/null
redis-benchmark -p "$rport" -n 200000 -c 8 -q evalsha "$sha" 1 'rls:{base}:quota' 1:3 "${args[@]}" >/dev/null 2>&1
echo "ledger.lua alone, 10 members: $(redis-cli -p "$rport" info commandstats | awk -F'[=,]' '/^cmdstat_evalsha/ {print $6}' | tr -d '\r') us per call (redis-server)"
redis-cli -p "$rport" flushall >/dev/null

echo "RLQS throughput, 10 streams x 10 buckets, ${secs}s each:"
for store in memory redis; do
  serve "$store"
  b=$(ticks "$pid"); r0=$(ticks "$rpid"); n0=$(reports)
  # --admin: rls-bench counts what the service processed and returns once
  # that count has stopped moving; t is until its last move
  t=$(bench --rlqs throughput --streams 10 --buckets 10 --duration "${secs}s" --admin 127.0.0.1:18782 --json |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["seconds"])')
  a=$(ticks "$pid"); r1=$(ticks "$rpid"); n1=$(reports)
  python3 - "$store" "$b" "$a" "$r0" "$r1" "$n0" "$n1" "$t" <<'PY'
import os, sys
store, b, a, r0, r1, n0, n1, t = sys.argv[1:9]
hz = os.sysconf("SC_CLK_TCK"); n = float(n1) - float(n0); t = float(t)
svc = (int(a) - int(b)) / hz * 1e6 / n
red = (int(r1) - int(r0)) / hz * 1e6 / n
extra = f", redis-server {red:.1f} us" if store == "redis" else ""
print(f"  {store:<7} {n / t:9.0f} bucket reports/s processed, service {svc:.1f} us per bucket report{extra}")
PY
  stop
done

echo "Memory per (Envoy, bucket), 10 streams x 5,000 buckets reporting once a second:"
for store in memory redis; do
  serve "$store"
  before=$(rss_kb "$pid")
  bench --rlqs throughput --streams 10 --buckets 5000 --report-every 1s --duration 15s >/dev/null &
  load=$!
  sleep 12
  during=$(rss_kb "$pid")
  keys=$( [ "$store" = redis ] && redis-cli -p "$rport" dbsize || echo -)
  wait "$load"
  awk -v s="$store" -v b="$before" -v d="$during" -v k="$keys" 'BEGIN {
    printf "  %-7s resident %d -> %d KiB: %.0f bytes per (stream, bucket)%s\n", s, b, d, (d - b) * 1024 / 50000,
      (k == "-" ? "" : sprintf("; Redis keys %s", k)) }'
  [ "$store" = redis ] && echo "          redis-server used_memory: $(redis-cli -p "$rport" info memory | awk -F: '/^used_memory_human/ {print $2}' | tr -d '\r')"
  stop
  redis-cli -p "$rport" flushall >/dev/null
done

echo "Convergence after a swap of demand 900:100 between two Envoys:"
for store in memory redis; do
  serve "$store"
  echo "  $store: $(bench --rlqs converge --duration 30s)"
  stop
done

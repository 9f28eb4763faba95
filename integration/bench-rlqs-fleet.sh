#!/usr/bin/env bash
# RLQS at fleet scale beside ShouldRateLimit, in one run (release build,
# memory store, default serving threads, loopback, bounded):
#   - baseline: ShouldRateLimit latency (rls-bench open loop, 200 calls/s on
#     4 connections, one hot key) with no RLQS stream open;
#   - for 10k / 100k / 1M (stream, bucket) pairs: 100 simulated Envoys
#     (rls-bench --rlqs throughput --distinct-buckets, one stream each)
#     report pairs/100 buckets every 5 s, as Envoy does. Once every pair is
#     held, over a 20 s window: bucket reports processed, the rls-quota
#     thread's time per bucket report and per tick (rls_quota_busy_seconds_total),
#     the whole service's CPU (utime+stime from /proc) per bucket report,
#     its resident set per pair (messages in flight included), outbox drops,
#     and the same ShouldRateLimit probe's latency beside the load.
#   integration/bench-rlqs-fleet.sh [PAIRS...]   (default 10000 100000 1000000)
# GENERATOR_NICE=19 runs the simulated Envoys at that niceness: on a box
# with few cores they then take only the CPU the service leaves, as if they
# ran elsewhere (the probe keeps the normal priority).
set -euo pipefail
cd "$(dirname "$0")/.."
pairs_list=("${@:-10000 100000 1000000}")
# shellcheck disable=SC2206
pairs_list=(${pairs_list[*]})
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key
    rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
RULES
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rss_kb() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
metric() { # NAME_AND_LABELS
  curl -s 127.0.0.1:18792/metrics | awk -v m="$1" 'index($0, m " ") == 1 {print $2; f = 1} END {if (!f) print 0}'
}
serve() {
  env RLS_CONFIG="$work/rules.yaml" RLS_GRPC_ADDR=127.0.0.1:18791 RLS_ADMIN_ADDR=127.0.0.1:18792 \
    target/release/tokenbucket-rls >"$work/server.log" 2>&1 &
  pid=$!
  until curl -sf 127.0.0.1:18792/readyz >/dev/null; do sleep 0.1; done
}
stop() { kill "$pid"; wait "$pid" 2>/dev/null || true; sleep 0.3; }
probe() { # SECONDS: ShouldRateLimit p50/p99 in ms
  target/release/rls-bench --target http://127.0.0.1:18791 --domain bench --key key \
    --rate 200 --connections 4 --threads 1 --duration "$1s" --json |
    python3 -c 'import json,sys; j=json.load(sys.stdin); l=j["latency_us"]; print("p50 %.2f ms, p99 %.2f ms (%d calls, %d errors)" % (l["p50"] / 1000, l["p99"] / 1000, j["requests"], j["errors"]))'
}

serve
echo "ShouldRateLimit alone: $(probe 10)"
stop

for pairs in "${pairs_list[@]}"; do
  buckets=$((pairs / 100))
  serve
  before=$(rss_kb "$pid")
  nice -n "${GENERATOR_NICE:-0}" target/release/rls-bench --target http://127.0.0.1:18791 --domain bench --key key \
    --rlqs throughput --streams 100 --buckets "$buckets" --distinct-buckets \
    --report-every 5s --duration 120s --threads 1 >/dev/null 2>&1 &
  load=$!
  # every pair held (a first round processed), at most 100 s
  for _ in $(seq 1000); do
    n=$(metric 'rls_quota_reports_total{domain="bench"}')
    python3 -c "import sys; sys.exit(0 if float('$n') >= $pairs else 1)" && break
    sleep 0.1
  done
  sleep 2
  c0=$(ticks "$pid"); r0=$(metric 'rls_quota_reports_total{domain="bench"}')
  br0=$(metric 'rls_quota_busy_seconds_total{work="report"}'); bt0=$(metric 'rls_quota_busy_seconds_total{work="tick"}')
  latency=$(probe 20)
  c1=$(ticks "$pid"); r1=$(metric 'rls_quota_reports_total{domain="bench"}')
  br1=$(metric 'rls_quota_busy_seconds_total{work="report"}'); bt1=$(metric 'rls_quota_busy_seconds_total{work="tick"}')
  during=$(rss_kb "$pid")
  drops=$(metric 'rls_quota_dropped_total{reason="outbox_full"}')
  kill "$load" 2>/dev/null || true
  wait "$load" 2>/dev/null || true
  python3 - "$pairs" "$c0" "$c1" "$r0" "$r1" "$br0" "$br1" "$bt0" "$bt1" "$before" "$during" "$drops" "$latency" <<'PY'
import os, sys
pairs, c0, c1, r0, r1, br0, br1, bt0, bt1, before, during, drops = sys.argv[1:13]
latency = sys.argv[13]
hz = os.sysconf("SC_CLK_TCK")
n = float(r1) - float(r0)
cpu = (int(c1) - int(c0)) / hz
print(f"{int(pairs):>9,} pairs: {n / 20:,.0f} bucket reports/s processed; service {cpu * 1e6 / max(n, 1):.2f} us CPU per bucket report "
      f"({cpu / 20:.2f} cores); rls-quota thread {(float(br1) - float(br0)) * 1e6 / max(n, 1):.2f} us per bucket report, "
      f"ticks {(float(bt1) - float(bt0)) / 20 * 1e3:.1f} ms/s ({(float(bt1) - float(bt0)) / 20 * 1e9 / int(pairs):.0f} ns per pair per second); "
      f"resident {int(before) // 1024} -> {int(during) // 1024} MiB ({(int(during) - int(before)) * 1024 / int(pairs):.0f} B per pair); "
      f"outbox drops {float(drops):.0f}; ShouldRateLimit beside: {latency}")
PY
  stop
done

#!/usr/bin/env bash
# The memory store's cap: throughput and CPU per decision with every
# request creating a new bucket, below the cap (the default --max-buckets,
# never reached) and at it (--max-buckets 10000: shards make room all the
# time), two rounds each, alternating. rls-bench closed loop, uniform over
# 10,000,000 keys, one rule at 10 per day (no bucket refills during a run).
# CPU is the service's utime+stime from /proc over the run. Loopback only.
#   integration/bench-cap.sh [SECONDS]      (default 10 per run)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key
    rate_limit: {unit: day, requests_per_unit: 10, burst: 100}
RULES
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
run() { # LABEL EXTRA-ARGS...
  local label=$1; shift
  target/release/tokenbucket-rls --config "$work/rules.yaml" --grpc-addr 127.0.0.1:18481 \
    --admin-addr 127.0.0.1:18482 "$@" >"$work/rls.log" 2>&1 &
  local pid=$!
  until curl -sf 127.0.0.1:18482/readyz >/dev/null; do sleep 0.1; done
  local before; before=$(cpu_ticks "$pid")
  local out; out=$(target/release/rls-bench --target http://127.0.0.1:18481 --domain bench --key key \
    --distribution uniform --keys 10000000 --duration "${secs}s" --warmup 0s --json)
  local after; after=$(cpu_ticks "$pid")
  local metrics; metrics=$(curl -s 127.0.0.1:18482/metrics)
  kill "$pid"; wait "$pid" 2>/dev/null || true
  python3 - "$label" "$out" "$before" "$after" "$metrics" <<'PY'
import json, os, sys
label, out, before, after, metrics = sys.argv[1:6]
r = json.loads(out)
hz = os.sysconf("SC_CLK_TCK")
cpu_us = (int(after) - int(before)) / hz * 1e6
n = r["requests"]
held = next((l.split()[-1] for l in metrics.splitlines() if l.startswith('rls_buckets{store="memory"}')), "?")
ev = sum(float(l.split()[-1]) for l in metrics.splitlines() if l.startswith("rls_buckets_evicted_total{"))
l = r["latency_us"]
print(f"{label}: {r['throughput_rps']:.0f}/s  CPU {cpu_us / n:.1f} us/decision  p50 {l['p50']}us p99 {l['p99']}us  held {held} evicted {ev:.0f} of {n}")
PY
}
for round in 1 2; do
  run "below the cap (default)"
  run "at the cap (10000)    " --max-buckets 10000
done

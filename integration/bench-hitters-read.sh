#!/usr/bin/env bash
# What a read of the heavy hitters costs the decisions beside it (#65 item
# 7): the memory store at --heavy-hitters 256 (the most), its summaries
# filled with 100,000 distinct values (rls-bench's k<N>) admitted and then
# refused, then rls-bench in open loop at RATE calls/s for SECONDS, once
# alone and once beside a loop of GET /v1/hitters?n=100 (the most a read
# may ask), as fast as curl sends them, and beside the same loop on
# /healthz (what curl itself costs the box). Prints the decisions' latency both ways, the
# reads made, their size, and the service's resident memory before and
# after. Loopback only, bounded in time.
#   integration/bench-hitters-read.sh [SECONDS] [RATE]   (default 10 s at 2000/s)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}; rate=${2:-2000}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key
    rate_limit: {unit: hour, requests_per_unit: 1}
RULES
target/release/tokenbucket-rls --config "$work/rules.yaml" --heavy-hitters 256 \
  --grpc-addr 127.0.0.1:18381 --admin-addr 127.0.0.1:18382 >"$work/rls.log" 2>&1 &
rls=$!
until curl -sf 127.0.0.1:18382/readyz >/dev/null; do sleep 0.1; done
rss() { awk '/VmRSS/ {print $2 " kB"}' "/proc/$rls/status"; }
# 100,000 distinct keys, about twice each (admitted, then refused)
target/release/rls-bench --target http://127.0.0.1:18381 --domain bench --key key \
  --distribution uniform --keys 100000 --requests 200000 --duration 120s --warmup 0s --json >/dev/null
echo "resident before the reads: $(rss)"
run() {
  target/release/rls-bench --target http://127.0.0.1:18381 --domain bench --key key --rate "$rate" \
    --duration "${secs}s" --warmup 0s --distribution uniform --keys 100000 --json \
  | python3 -c "import json,sys; r=json.load(sys.stdin); l=r['latency_us']; print(f\"$1: {r['throughput_rps']:.0f}/s ok {r['ok']} errors {r['errors']}  p50 {l['p50']}us p99 {l['p99']}us p999 {l['p999']}us max {l['max']}us\")"
}
run "decisions alone"
# a loop of PATH reads beside a run labelled LABEL
beside() { # LABEL PATH
  (
    n=0
    end=$((SECONDS + secs + 1))
    while [ $SECONDS -lt $end ]; do
      curl -s -o "$work/read.out" "127.0.0.1:18382$2"; n=$((n + 1))
    done
    echo "  $n reads of $2, $(wc -c <"$work/read.out") bytes each" >"$work/reads"
  ) &
  local reader=$!
  run "$1"
  wait "$reader"
  cat "$work/reads"
}
# the same loop on the probe: what curl's own processes cost the box
beside "beside a /healthz loop" /healthz
beside "beside a read loop" "/v1/hitters?n=100"
echo "resident after: $(rss)"

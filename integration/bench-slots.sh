#!/usr/bin/env bash
# CPU per concurrency start on the memory store as the slots held grow
# (#51): one descriptor of a `concurrency: 1000000` rule, every call a
# start with a fresh attempt id (rls-bench --attempt-key), none released,
# so call i finds i slots held. Service utime+stime per call over CALLS
# calls, for each count; BIN picks the binary (default the release build),
# to compare builds in one sitting. Loopback only, bounded.
#   integration/bench-slots.sh [COUNTS...]   (default 1000 50000 200000)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${BIN:-target/release/tokenbucket-rls}
[ -n "${BIN:-}" ] || cargo build --release --bins --locked 2>&1 | tail -n 1
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
cat > "$work/rules.yaml" <<'RULES'
domain: streams
descriptors:
  - key: user
    concurrency: 1000000
    attempts: {key: request_id, ttl: 10m}
RULES
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }
for calls in "${@:-1000 50000 200000}"; do
  for n in $calls; do
    "$bin" --config "$work" --grpc-addr 127.0.0.1:18591 --admin-addr 127.0.0.1:18592 --max-attempts 2000000 >"$work/server.log" 2>&1 &
    pid=$!
    wait_port 18591
    b=$(ticks "$pid")
    out=$(target/release/rls-bench --target http://127.0.0.1:18591 --domain streams --key user \
      --attempt-key request_id --requests "$n" --duration 600s --warmup 0s --json 2>/dev/null)
    a=$(ticks "$pid")
    kill "$pid"; wait "$pid" 2>/dev/null || true
    python3 - "$n" "$out" "$b" "$a" <<'PY'
import json, os, sys
n, out, b, a = sys.argv[1:5]
r = json.loads(out); hz = os.sysconf("SC_CLK_TCK")
us = (int(a) - int(b)) / hz * 1e6 / r["requests"]
print(f"{int(n):>7} starts (slots held 0..{int(n)-1}): {us:8.1f} us per start  {r['throughput_rps']:8.0f}/s  ok {r.get('ok', '?')}")
PY
  done
done

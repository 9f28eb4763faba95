#!/usr/bin/env bash
# The memory path against the tonic floor (#55 aim 2), CPU per decision
# (the server's utime+stime from /proc over CALLS calls), in the bar shape:
# one descriptor per call, one hot key, 8 connections x 16 in flight. Two
# load generators, so that neither client's way of writing frames decides
# the ratio: rls-bench (tonic's client) and h2load (nghttp2, an independent
# HTTP/2 client sending a fixed gRPC body). Rows, interleaved in each round:
#   - the floor: `examples/rls-floor.rs` (a constant-OK ShouldRateLimit
#     server from the same dependencies) on tokio's default runtime and on
#     one worker (TOKIO_WORKER_THREADS=1);
#   - with BEFORE set to another tokenbucket-rls binary: it, memory store;
#   - this build, memory store: default (a serving thread per core), one
#     serving thread, and the shared runtime (--serving-threads 0).
# h2load's rows check that every call was answered 2xx.
#   integration/bench-floor.sh [CALLS] [ROUNDS]     (default 200000, 3)
# Needs h2load (Debian: nghttp2-client). Loopback only, bounded.
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-200000}; rounds=${2:-3}
command -v h2load >/dev/null || { echo "bench-floor: h2load missing (apt-get install nghttp2-client)" >&2; exit 1; }
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
cargo build --release --bins --example rls-floor --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key                 # every request admitted: measures the decision
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
RULES
# the gRPC body h2load sends: domain bench, one descriptor (key, k0)
python3 integration/h2load_body.py "$work" hot=key
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }
# row CLIENT LABEL COMMAND...: CPU per decision of COMMAND's process
row() {
  local client=$1 label=$2; shift 2
  "$@" >"$work/server.log" 2>&1 &
  local pid=$! before after
  wait_port 18581
  before=$(ticks "$pid")
  if [ "$client" = h2load ]; then
    h2load -n "$calls" -c 8 -m 16 -t 1 -d "$work/hot.bin" -H content-type:application/grpc -H te:trailers \
      http://127.0.0.1:18581/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit >"$work/out" 2>&1
    grep -q "$calls 2xx" "$work/out" || { echo "bench-floor: h2load's calls were not all answered 2xx" >&2; cat "$work/out" >&2; exit 1; }
  else
    target/release/rls-bench --target http://127.0.0.1:18581 --domain bench --key key --distribution hot \
      --requests "$calls" --duration 120s --warmup 0s --json >"$work/out" 2>/dev/null
  fi
  after=$(ticks "$pid")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  python3 -c "import os, sys; print(f'{sys.argv[1]:<10} {sys.argv[2]:<32} {(int(sys.argv[4]) - int(sys.argv[3])) / os.sysconf(\"SC_CLK_TCK\") * 1e6 / int(sys.argv[5]):6.2f} us/decision')" \
    "$client" "$label" "$before" "$after" "$calls"
  sleep 0.3
}
rls=(--config "$work/rules.yaml" --grpc-addr 127.0.0.1:18581 --admin-addr 127.0.0.1:18582)
for round in $(seq "$rounds"); do
  echo "round $round"
  for client in rls-bench h2load; do
    row "$client" "floor, default runtime" target/release/examples/rls-floor
    row "$client" "floor, one worker" env TOKIO_WORKER_THREADS=1 target/release/examples/rls-floor
    [ -n "${BEFORE:-}" ] && row "$client" "before, memory, default" "$BEFORE" "${rls[@]}"
    row "$client" "memory, default" target/release/tokenbucket-rls "${rls[@]}"
    row "$client" "memory, one serving thread" target/release/tokenbucket-rls "${rls[@]}" --serving-threads 1
    row "$client" "memory, shared runtime" target/release/tokenbucket-rls "${rls[@]}" --serving-threads 0
  done
done

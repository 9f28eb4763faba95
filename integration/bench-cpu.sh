#!/usr/bin/env bash
# CPU per decision, side by side in one run: the process's utime+stime from
# /proc over a fixed number of calls (what a deployment pays for; unlike
# throughput, it does not depend on how a shared machine splits its cores
# between the load generator and the server). rls-bench closed loop, 8
# connections x 16 in flight, one descriptor, one hot key, 200,000 calls:
#   - the floor: `examples/rls-floor.rs`, a constant-OK ShouldRateLimit
#     server from the same dependencies, default runtime and one worker;
#   - tokenbucket-rls, memory store: default (a serving thread per core),
#     on the shared multi-thread runtime (--serving-threads 0), and on one
#     serving thread;
#   - tokenbucket-rls, Redis store on one local redis-server (service and
#     redis-server CPU per decision);
#   - with LIMITADOR_BIN set: Limitador, memory storage, same load.
# Loopback only, bounded. Needs redis-server.
#   integration/bench-cpu.sh [CALLS] [ROUNDS]     (default 200000, 3)
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-200000}; rounds=${2:-3}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; redis-cli -p 18699 shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
cargo build --release --bins --example rls-floor --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key                 # every request admitted: measures the decision
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
RULES
redis-server --port 18699 --save "" --appendonly no --daemonize yes --dir "$work" >/dev/null
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }
# measure LABEL PID [REDIS_PID]: one run of $calls against 127.0.0.1:18581
measure() {
  local label=$1 pid=$2 rpid=${3:-}
  local b r0 out a r1
  b=$(ticks "$pid"); r0=${rpid:+$(ticks "$rpid")}
  out=$(target/release/rls-bench --target http://127.0.0.1:18581 --domain bench --key key \
    --distribution hot --requests "$calls" --duration 120s --warmup 0s --json 2>/dev/null)
  a=$(ticks "$pid"); r1=${rpid:+$(ticks "$rpid")}
  python3 - "$label" "$out" "$b" "$a" "${r0:-0}" "${r1:-0}" <<'PY'
import json, os, sys
label, out, b, a, r0, r1 = sys.argv[1:7]
r = json.loads(out); hz = os.sysconf("SC_CLK_TCK"); n = r["requests"]
svc = (int(a) - int(b)) / hz * 1e6 / n
red = (int(r1) - int(r0)) / hz * 1e6 / n
extra = f"  redis-server {red:.1f} us" if red else ""
print(f"{label:<44} {svc:6.1f} us/decision{extra}  {r['throughput_rps']:8.0f}/s")
PY
}
serve() { # LABEL ENV... -- CMD...
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" "$@" >"$work/server.log" 2>&1 &
  local pid=$!
  wait_port 18581
  measure "$label" "$pid" "${REDIS_PID:-}"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  sleep 0.3
}
rls=(target/release/tokenbucket-rls --config "$work/rules.yaml" --grpc-addr 127.0.0.1:18581 --admin-addr 127.0.0.1:18582)
redis_pid=$(redis-cli -p 18699 info server | awk -F: '/^process_id/ {print $2}' | tr -d '\r')
for round in $(seq "$rounds"); do
  echo "round $round"
  serve "floor (constant OK), default runtime" X=1 -- target/release/examples/rls-floor
  serve "floor (constant OK), TOKIO_WORKER_THREADS=1" TOKIO_WORKER_THREADS=1 -- target/release/examples/rls-floor
  serve "tokenbucket-rls memory, default" X=1 -- "${rls[@]}"
  serve "tokenbucket-rls memory, --serving-threads 0" X=1 -- "${rls[@]}" --serving-threads 0
  serve "tokenbucket-rls memory, --serving-threads 1" X=1 -- "${rls[@]}" --serving-threads 1
  redis-cli -p 18699 flushall >/dev/null
  REDIS_PID=$redis_pid serve "tokenbucket-rls redis (service; redis-server)" X=1 -- "${rls[@]}" --store redis --redis-url redis://127.0.0.1:18699
  if [ -n "${LIMITADOR_BIN:-}" ]; then
    cat > "$work/limits.yaml" <<'LIMITS'
- namespace: bench
  max_value: 1000000000
  seconds: 1
  conditions: []
  variables: [key]
LIMITS
    serve "Limitador memory" X=1 -- "$LIMITADOR_BIN" --rls-ip 127.0.0.1 --rls-port 18581 --http-port 18582 "$work/limits.yaml" memory
  fi
done

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
#   - the fleet shape (issue #29), a row per round: a Redis Cluster of
#     PRIMARIES primaries with a replica each (default 3), keys drawn
#     uniformly from FLEET_KEYS (default 100,000), the service on
#     SERVICE_CPUS, the primaries on REDIS_CPUS (a primary on each CPU of
#     the list in turn when it names at least as many CPUs as there are
#     primaries, else all on the whole list) and rls-bench on LOAD_CPUS
#     (taskset lists; defaults for a 2-core box: 0, 1, 1; RLS_BENCH_THREADS
#     sets its --threads); service, primaries (summed) and
#     rls-bench CPU per decision; then the memory store under the same load
#     and pinning, the baseline of the Redis path's ratio. FLEET=0 skips it;
#     FLEET_ONLY=1 runs only it.
# RLS_BIN runs another tokenbucket-rls binary (e.g. the previous version's,
# for a before/after in one run); RLS_ARGS adds flags to every run of it
# (e.g. RLS_ARGS="--redis-pool-size 1").
# Loopback only, bounded. Needs redis-server.
#   integration/bench-cpu.sh [CALLS] [ROUNDS]     (default 200000, 3)
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-200000}; rounds=${2:-3}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; redis-cli -p 18699 shutdown nosave >/dev/null 2>&1 || true; [ -d "$work/cluster" ] && PRIMARIES=${PRIMARIES:-3} integration/redis-cluster.sh stop "$work/cluster" 18701 >/dev/null 2>&1; rm -rf "$work"' EXIT
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
# reads redis-server made from its clients, summed over REDIS_PORTS (how
# many commands each read brings: the batching, whatever the machine's noise)
reads_all() { local t=0 p; for p in ${REDIS_PORTS:-}; do t=$((t + $(redis-cli -p "$p" info stats | awk -F: '/^total_reads_processed/ {print $2}' | tr -d '\r'))); done; echo "$t"; }
# ticks of several processes, summed
ticks_all() { local t=0 p; for p in "$@"; do t=$((t + $(ticks "$p"))); done; echo "$t"; }
# measure LABEL PID [REDIS_PIDS]: one run of $calls against 127.0.0.1:18581
# (keys: DIST, default hot; rls-bench pinned to LOAD_CPUS when set)
measure() {
  local label=$1 pid=$2 rpids=${3:-}
  local b r0 out a r1 bt
  b=$(ticks "$pid"); r0=$(ticks_all $rpids); q0=$(reads_all)
  local pin=(); [ -n "${LOAD_CPUS:-}" ] && pin=(taskset -c "$LOAD_CPUS")
  local threads=(); [ -n "${RLS_BENCH_THREADS:-}" ] && threads=(--threads "$RLS_BENCH_THREADS")
  out=$(/usr/bin/time -f "%U %S" -o "$work/bench.time" "${pin[@]}" target/release/rls-bench \
    --target http://127.0.0.1:18581 --domain bench --key key --distribution "${DIST:-hot}" \
    --keys "${FLEET_KEYS:-100000}" --requests "$calls" --duration 120s --warmup 0s "${threads[@]}" --json 2>/dev/null)
  a=$(ticks "$pid"); r1=$(ticks_all $rpids); q1=$(reads_all)
  bt=$(cat "$work/bench.time")
  python3 - "$label" "$out" "$b" "$a" "$r0" "$r1" "$bt" "$q0" "$q1" <<'PY'
import json, os, sys
label, out, b, a, r0, r1, bt, q0, q1 = sys.argv[1:10]
r = json.loads(out); hz = os.sysconf("SC_CLK_TCK"); n = r["requests"]
svc = (int(a) - int(b)) / hz * 1e6 / n
red = (int(r1) - int(r0)) / hz * 1e6 / n
gen = sum(map(float, bt.split())) * 1e6 / n
extra = f"  redis-server {red:.1f} us" if red else ""
if int(q1) > int(q0):
    extra += f" ({(int(q1) - int(q0)) / n:.3f} reads)"
print(f"{label:<44} {svc:6.1f} us/decision{extra}  rls-bench {gen:.1f} us  {r['throughput_rps']:8.0f}/s")
PY
}
serve() { # LABEL ENV... -- CMD...
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local pin=(); [ -n "${SERVICE_PIN:-}" ] && pin=(taskset -c "$SERVICE_PIN")
  env "${envs[@]}" "${pin[@]}" "$@" >"$work/server.log" 2>&1 &
  local pid=$!
  wait_port 18581
  [ -n "${WARM:-}" ] && sleep "$WARM"
  measure "$label" "$pid" "${REDIS_PID:-}"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  sleep 0.3
}
# shellcheck disable=SC2206 # RLS_ARGS is split into words on purpose
rls=("${RLS_BIN:-target/release/tokenbucket-rls}" --config "$work/rules.yaml" --grpc-addr 127.0.0.1:18581 --admin-addr 127.0.0.1:18582 ${RLS_ARGS:-})
redis_pid=$(redis-cli -p 18699 info server | awk -F: '/^process_id/ {print $2}' | tr -d '\r')
fleet_rounds() {
  local dir="$work/cluster" url pids p n=${PRIMARIES:-3} i=0 cpus
  url=$(integration/redis-cluster.sh start "$dir" 18701 | tail -n 1)
  IFS=, read -r -a cpus <<<"${REDIS_CPUS:-1}"
  pids=""; ports=""
  for p in $(seq 18701 $((18700 + 2 * n))); do
    if redis-cli -p "$p" role | head -n 1 | grep -q master; then
      pids="$pids $(cat "$dir/$p/redis.pid")"; ports="$ports $p"
      if [ "${#cpus[@]}" -ge "$n" ]; then
        taskset -cp "${cpus[$i]}" "$(cat "$dir/$p/redis.pid")" >/dev/null
      else
        taskset -cp "${REDIS_CPUS:-1}" "$(cat "$dir/$p/redis.pid")" >/dev/null
      fi
      i=$((i + 1))
    fi
  done
  for round in $(seq "$rounds"); do
    for p in $(seq 18701 $((18700 + 2 * n))); do redis-cli -p "$p" flushall >/dev/null 2>&1 || true; done
    SERVICE_PIN=${SERVICE_CPUS:-0} LOAD_CPUS=${LOAD_CPUS:-1} DIST=uniform WARM=1 REDIS_PID="$pids" REDIS_PORTS="$ports" \
      serve "fleet: $n primaries, ${FLEET_KEYS:-100000} keys (round $round)" X=1 -- "${rls[@]}" --store redis --redis-url "$url"
    # the same load and pinning on the memory store: what the Redis path
    # costs beyond it (#29's goal: at most 1.6x)
    SERVICE_PIN=${SERVICE_CPUS:-0} LOAD_CPUS=${LOAD_CPUS:-1} DIST=uniform WARM=1 \
      serve "fleet: memory store, same pinning (round $round)" X=1 -- "${rls[@]}"
  done
  PRIMARIES=$n integration/redis-cluster.sh stop "$dir" 18701 >/dev/null
}
if [ "${FLEET_ONLY:-0}" = 1 ]; then
  fleet_rounds
  exit 0
fi
for round in $(seq "$rounds"); do
  echo "round $round"
  serve "floor (constant OK), default runtime" X=1 -- target/release/examples/rls-floor
  serve "floor (constant OK), TOKIO_WORKER_THREADS=1" TOKIO_WORKER_THREADS=1 -- target/release/examples/rls-floor
  serve "tokenbucket-rls memory, default" X=1 -- "${rls[@]}"
  serve "tokenbucket-rls memory, --serving-threads 0" X=1 -- "${rls[@]}" --serving-threads 0
  serve "tokenbucket-rls memory, --serving-threads 1" X=1 -- "${rls[@]}" --serving-threads 1
  redis-cli -p 18699 flushall >/dev/null
  REDIS_PID=$redis_pid REDIS_PORTS=18699 serve "tokenbucket-rls redis (service; redis-server)" X=1 -- "${rls[@]}" --store redis --redis-url redis://127.0.0.1:18699
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
[ "${FLEET:-1}" = 1 ] && fleet_rounds
exit 0

# Sourced by the bench-*.sh scripts that compare CPU per decision row by
# row (bench-attempts.sh, bench-algorithms.sh): a redis-server on 18699 for
# the Redis rows, and `run`, which starts the release build on the rules in
# "$work" (memory or Redis store), sends "$calls" ShouldRateLimit calls
# with rls-bench (closed loop, 8 connections x 16 in flight, one hot key)
# and prints the service's utime+stime per call, and redis-server's beside
# it on the Redis store. The caller sets `work` and `calls`, and stops the
# redis-server on exit (`redis-cli -p 18699 shutdown nosave`).

redis-server --port 18699 --save "" --appendonly no --daemonize yes --dir "$work" >/dev/null
until redis-cli -p 18699 ping 2>/dev/null | grep -q PONG; do sleep 0.05; done
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }
redis_pid=$(redis-cli -p 18699 info server | awk -F: '/^process_id/ {print $2}' | tr -d '\r')

# run LABEL STORE DOMAIN KEY [more rls-bench arguments]
run() {
  local label=$1 store=$2 domain=$3 key=$4; shift 4
  local args=(); [ "$store" = redis ] && args=(--store redis --redis-url redis://127.0.0.1:18699)
  redis-cli -p 18699 flushall >/dev/null
  target/release/tokenbucket-rls --config "$work" --grpc-addr 127.0.0.1:18581 --admin-addr 127.0.0.1:18582 "${args[@]}" >"$work/server.log" 2>&1 &
  local pid=$!
  wait_port 18581
  local b r0 a r1 out
  b=$(ticks "$pid"); r0=$(ticks "$redis_pid")
  out=$(target/release/rls-bench --target http://127.0.0.1:18581 --domain "$domain" --key "$key" \
    --requests "$calls" --duration 120s --warmup 0s --json "$@" 2>/dev/null)
  a=$(ticks "$pid"); r1=$(ticks "$redis_pid")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  python3 - "$label" "$out" "$b" "$a" "$r0" "$r1" "$store" <<'PY'
import json, os, sys
label, out, b, a, r0, r1, store = sys.argv[1:8]
r = json.loads(out); hz = os.sysconf("SC_CLK_TCK"); n = r["requests"]
svc = (int(a) - int(b)) / hz * 1e6 / n
red = (int(r1) - int(r0)) / hz * 1e6 / n
extra = f"  redis-server {red:.1f} us" if store == "redis" else ""
lat = r.get("latency_us", {})
print(f"{label:<34} {svc:6.1f} us/decision{extra}  {r['throughput_rps']:8.0f}/s  ok {r.get('ok', '?')}  p50 {lat.get('p50', '?')} p99 {lat.get('p99', '?')} us")
PY
  sleep 0.3
}

#!/usr/bin/env bash
# Several regions sharing global budgets (docs/regions.md), in one
# run on one machine (release build, loopback, memory stores, bounded):
#   1. the global tier's cost per (region, bucket) report: N regions, each
#      loaded by rls-bench at RATE requests/s in open loop over KEYS values
#      of a per-key global rule (so each region reports about KEYS buckets
#      a second); the global tier's utime+stime from /proc over its own
#      rls_quota_reports_total; beside it, each region's CPU per decision,
#      and the same load on a regional rule (what `scope: global` adds);
#   2. the excess over B + r·t through a partition, for each N in NS and
#      each length in LENGTHS: every region loaded in closed loop on one
#      global bucket (B = 60, r = 30/s, local failure mode); the global tier
#      frozen (SIGSTOP) for the length, then thawed; admitted counted by
#      rls-bench in each region over the whole run (length + 6 s).
#   integration/bench-regions.sh        env: REGIONS (3), KEYS (1000),
#       RATE (2000), SECS (15), NS ("2 3 5"), LENGTHS ("2 5 10")
set -euo pipefail
cd "$(dirname "$0")/.."
regions=${REGIONS:-3}; keys=${KEYS:-1000}; rate=${RATE:-2000}; secs=${SECS:-15}
ns=${NS:-"2 3 5"}; lengths=${LENGTHS:-"2 5 10"}
work=$(mktemp -d)
trap 'kill -CONT $(jobs -p) 2>/dev/null || true; kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: api_key              # one global budget per value
    scope: global
    rate_limit: {unit: second, requests_per_unit: 1000000, burst: 1000000}
  - key: key                  # regional, same numbers: the baseline
    rate_limit: {unit: second, requests_per_unit: 1000000, burst: 1000000}
  - key: api                  # one global bucket: B = 60, r = 30/s
    scope: global
    failure_mode: local
    rate_limit: {unit: second, requests_per_unit: 30, burst: 60}
RULES
bin=target/release/tokenbucket-rls
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }
metric() { curl -s "127.0.0.1:$1/metrics" | awk -v m="$2" '$1 == m || index($1, m "{") == 1 {s += $2} END {print s + 0}'; }
global_pid=""
region_pids=()
start_world() { # N
  local n=$1 i
  RUST_LOG=warn $bin --config "$work/rules.yaml" --grpc-addr 127.0.0.1:19000 --admin-addr 127.0.0.1:19001 >"$work/global.log" 2>&1 &
  global_pid=$!
  wait_port 19000
  region_pids=()
  for i in $(seq "$n"); do
    RUST_LOG=warn $bin --config "$work/rules.yaml" --grpc-addr "127.0.0.1:$((19000 + 10 * i))" \
      --admin-addr "127.0.0.1:$((19001 + 10 * i))" --serving-threads 1 \
      --quota-upstream http://127.0.0.1:19000 --region "r$i" --regions "$n" >"$work/region$i.log" 2>&1 &
    region_pids+=($!)
    wait_port $((19000 + 10 * i))
  done
}
stop_world() {
  kill -CONT "$global_pid" 2>/dev/null || true
  kill "$global_pid" "${region_pids[@]}" 2>/dev/null || true
  wait "$global_pid" "${region_pids[@]}" 2>/dev/null || true
  sleep 0.3
}
bench() { # PORT KEY DIST SECONDS [extra rls-bench args]
  local port=$1 key=$2 dist=$3 s=$4; shift 4
  target/release/rls-bench --target "http://127.0.0.1:$port" --domain bench --key "$key" \
    --distribution "$dist" --keys "$keys" --duration "${s}s" --warmup 0s --json "$@" 2>/dev/null
}

echo "1. the global tier's cost per (region, bucket) report: $regions regions, $keys keys each, $rate/s each, ${secs}s"
for key in key api_key; do
  start_world "$regions"
  sleep 1
  g0=$(ticks "$global_pid"); q0=$(metric 19001 rls_quota_reports_total)
  r0=(); for p in "${region_pids[@]}"; do r0+=("$(ticks "$p")"); done
  loads=()
  for i in $(seq "$regions"); do
    bench $((19000 + 10 * i)) "$key" uniform "$secs" --rate "$rate" --connections 2 >"$work/out$i.json" &
    loads+=($!)
  done
  wait "${loads[@]}"
  g1=$(ticks "$global_pid"); q1=$(metric 19001 rls_quota_reports_total)
  r1=(); for p in "${region_pids[@]}"; do r1+=("$(ticks "$p")"); done
  python3 - "$key" "$hz" "$g0" "$g1" "$q0" "$q1" "${#region_pids[@]}" "${r0[@]}" "${r1[@]}" "$work"/out*.json <<'PY'
import json, sys
key, hz, g0, g1, q0, q1, n = sys.argv[1:8]
n = int(n); hz = int(hz)
r0 = list(map(int, sys.argv[8:8 + n])); r1 = list(map(int, sys.argv[8 + n:8 + 2 * n]))
outs = [json.load(open(f)) for f in sys.argv[8 + 2 * n:]]
requests = sum(o["requests"] for o in outs)
reports = float(q1) - float(q0)
gcpu = (int(g1) - int(g0)) / hz
rcpu = sum(b - a for a, b in zip(r0, r1)) / hz
rule = "global (api_key)" if key == "api_key" else "regional (key)"
line = f"  {rule:<18} decisions {requests:>8}  regions {rcpu / max(requests, 1) * 1e6:6.1f} us/decision"
if reports > 0:
    line += f"  global tier: {reports:.0f} bucket reports, {gcpu:.2f} s CPU, {gcpu / reports * 1e6:.2f} us per (region, bucket) report"
else:
    line += f"  global tier: no reports, {gcpu:.2f} s CPU"
print(line)
PY
  rm -f "$work"/out*.json
  stop_world
done

echo "2. excess over B + r*t through a frozen global tier (B = 60, r = 30/s, local failure mode)"
for n in $ns; do
  for len in $lengths; do
    start_world "$n"
    # warm up: every region in the split
    loads=()
    for i in $(seq "$n"); do bench $((19000 + 10 * i)) api hot 3 --connections 1 --concurrency 4 >/dev/null & loads+=($!); done
    wait "${loads[@]}"
    total=$((len + 6))
    loads=()
    for i in $(seq "$n"); do
      bench $((19000 + 10 * i)) api hot "$total" --connections 1 --concurrency 4 >"$work/part$i.json" &
      loads+=($!)
    done
    sleep 2; kill -STOP "$global_pid"; sleep "$len"; kill -CONT "$global_pid"
    wait "${loads[@]}"
    python3 - "$n" "$len" "$total" "$work"/part*.json <<'PY'
import json, sys
n, length, total = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
outs = [json.load(open(f)) for f in sys.argv[4:]]
ok = sum(o["ok"] for o in outs)
bound = 60 + 30 * total
print(f"  N={n} frozen {length:>2}s of {total}s: admitted {ok} (per region {[o['ok'] for o in outs]}), B + r*t = {bound}, excess {ok - bound:+d}")
PY
    rm -f "$work"/part*.json
    stop_world
  done
done

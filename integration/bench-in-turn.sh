#!/usr/bin/env bash
# What deciding a request's descriptors one at a time costs (#51): a
# request that starts an attempt among two or more descriptors is decided
# in turn, slots first, stopping at the first refusal, so that two such
# requests cannot each hold what refuses the other. Rows, side by side in
# one run on both stores: two descriptors per request, each with a fresh
# attempt id on a rule with `attempts:` and a budget that admits all
# (decided in turn, the default), against the same with
# --per-descriptor-spending (decided all at once, as before); a request of
# one descriptor is the baseline. The service's utime+stime per call from
# /proc, redis-server's beside it, throughput and the median and p99
# latency (rls-bench closed loop, 8 connections x 16 in flight).
#   integration/bench-in-turn.sh [CALLS] [ROUNDS]   (default 100000, 2)
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-100000}; rounds=${2:-2}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; redis-cli -p 18699 shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
    attempts: {key: request_id, ttl: 10s}
RULES
# shellcheck source=integration/cpu-per-decision.sh
. integration/cpu-per-decision.sh
for round in $(seq "$rounds"); do
  echo "round $round"
  for store in ${STORES:-memory redis}; do
    run "$store, one descriptor" "$store" bench key --attempt-key request_id --distribution uniform --keys 1000
    run "$store, two, in turn" "$store" bench key --attempt-key request_id --distribution uniform --keys 1000 --descriptors 2
    RLS_PER_DESCRIPTOR_SPENDING=true run "$store, two, at once" "$store" bench key --attempt-key request_id --distribution uniform --keys 1000 --descriptors 2
  done
done
# one request at a time: the round trip a request waits for, not the queue
echo "one request in flight"
for store in ${STORES:-memory redis}; do
  one=(--connections 1 --concurrency 1 --attempt-key request_id --distribution uniform --keys 1000)
  calls=$((calls / 5))
  run "$store, two, in turn, 1 in flight" "$store" bench key "${one[@]}" --descriptors 2
  RLS_PER_DESCRIPTOR_SPENDING=true run "$store, two, at once, 1 in flight" "$store" bench key "${one[@]}" --descriptors 2
  calls=$((calls * 5))
done

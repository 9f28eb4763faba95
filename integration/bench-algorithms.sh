#!/usr/bin/env bash
# CPU per decision by algorithm (#41): a token-bucket rule against the same
# rule with `algorithm: fixed_window` and `sliding_window`, and a calendar
# month in America/New_York, on both stores, side by side in one
# run: the service's utime+stime from /proc over a fixed number of
# ShouldRateLimit calls (rls-bench closed loop, 8 connections x 16 in
# flight, one hot key), and on Redis redis-server's CPU beside it. Rounds
# alternate the rows. Loopback only, bounded.
#   integration/bench-algorithms.sh [CALLS] [ROUNDS]   (default 200000, 2)
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-200000}; rounds=${2:-2}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; redis-cli -p 18699 shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: bucket
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
  - key: fixed
    algorithm: fixed_window
    rate_limit: {unit: hour, requests_per_unit: 1000000000}
  - key: sliding
    algorithm: sliding_window
    rate_limit: {unit: hour, requests_per_unit: 67108863}
  - key: calendar
    rate_limit: {unit: month, requests_per_unit: 1000000000, calendar: {time_zone: America/New_York}}
RULES
# shellcheck source=integration/cpu-per-decision.sh
. integration/cpu-per-decision.sh
for round in $(seq "$rounds"); do
  echo "round $round"
  for store in ${STORES:-memory redis}; do
    run "$store, token bucket" "$store" bench bucket
    run "$store, fixed window" "$store" bench fixed
    run "$store, sliding window" "$store" bench sliding
    run "$store, calendar month" "$store" bench calendar
  done
done

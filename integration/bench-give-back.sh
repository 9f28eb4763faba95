#!/usr/bin/env bash
# CPU per decision for refused two-descriptor requests (#51), with the
# give-back (the default) against without (--per-descriptor-spending), on
# both stores, side by side in one run: the service's utime+stime from
# /proc over a fixed number of ShouldRateLimit calls (rls-bench closed
# loop, 8 connections x 16 in flight). Each request carries a descriptor a
# huge budget admits (one hot key) and one a limit of 0 refuses: with the
# give-back, the admitted one's tokens are refunded in a second store call.
# An admitted single-descriptor request is the baseline row. On Redis,
# redis-server's CPU per call beside it. Rounds alternate the rows.
#   integration/bench-give-back.sh [CALLS] [ROUNDS]   (default 200000, 2)
#   STORES="redis" limits the run to one store (default: memory redis)
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-200000}; rounds=${2:-2}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; redis-cli -p 18699 shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
cargo build --release --bins --locked 2>&1 | tail -n 1
cat > "$work/rules.yaml" <<'RULES'
domain: bench
descriptors:
  - key: key
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}
  - key: blocked
    rate_limit: {unit: second, requests_per_unit: 0}
RULES
# shellcheck source=integration/cpu-per-decision.sh
. integration/cpu-per-decision.sh
for round in $(seq "$rounds"); do
  echo "round $round"
  for store in ${STORES:-memory redis}; do
    run "$store, admitted, one descriptor" "$store" bench key
    run "$store, refused pair, given back" "$store" bench key --extra-descriptor blocked=x
    RLS_PER_DESCRIPTOR_SPENDING=true run "$store, refused pair, kept" "$store" bench key --extra-descriptor blocked=x
  done
done

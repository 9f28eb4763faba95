#!/usr/bin/env bash
# What redis-server runs per decision (#55 aim 1: at most Limitador's),
# counted in instructions by callgrind (deterministic where CPU time on a
# shared box is not), one redis-server 7 for every row, one hot key, every
# decision admitted:
#   - tokenbucket-rls (release build), Redis store, through gRPC: rls-bench
#     with one connection and one request in flight (each decision alone:
#     one.lua; a fixed window of one limit: INCRBY + EXPIRE in
#     envoyproxy/ratelimit's keys), then 8 connections x 16 in flight
#     (decisions queued together go as one batch of bucket.lua; under
#     callgrind few do);
#   - Limitador through its own library and Redis storage (the
#     `AsyncRateLimiter` on `AsyncRedisStorage`, what limitador-server runs
#     with `redis <URL>`): integration/limitador-probe, one decision after
#     another, one limit on one variable (a fixed window: Limitador's only
#     kind). limitador-server itself is not on crates.io; its library is,
#     and builds RocksDB (its keys' code needs the `disk_storage` feature):
#     the first build takes a while.
# Instructions per decision are the process's, all threads, over the
# decisions only (instrumentation switched on around them; read from
# valgrind's summary when the row's fresh redis-server stops), and the
# commands it ran are printed (every decision must reach it: the service
# gets --redis-timeout 10s, as callgrind slows redis-server fifty-fold).
#   integration/bench-redis-peers.sh [CALLS]   (default 2000)
# Needs valgrind, redis-server, cargo (crates.io for the probe).
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-2000}; port=18791
work=$(mktemp -d)
cargo build --release --bins --locked 2>&1 | tail -n 1
CARGO_TARGET_DIR=${PROBE_TARGET:-target/limitador-probe} \
  cargo build --release --manifest-path integration/limitador-probe/Cargo.toml 2>&1 | tail -n 1
probe=${PROBE_TARGET:-target/limitador-probe}/release/limitador-probe
trap 'kill $(jobs -p) 2>/dev/null || true; redis-cli -p $port shutdown nosave >/dev/null 2>&1 || true; sleep 1; rm -rf "$work"' EXIT
vpid=
# a fresh redis-server under callgrind (instrumentation off) for each row
on_fresh_redis() {
  (cd "$work" && valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$work/cg.%p" \
    redis-server --port "$port" --save "" --appendonly no >"$work/redis.log" 2>&1 &)
  for _ in $(seq 300); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  vpid=$(pgrep -f "callgrind.*--port $port" | head -1)
}
on() { callgrind_control -z "$vpid" >/dev/null 2>&1; callgrind_control -i on "$vpid" >/dev/null 2>&1; }
off() { # LABEL: instructions per decision since `on`, from valgrind's
  # summary when the server stops (callgrind_control -e, asked of a
  # server asleep between calls, can answer a part)
  callgrind_control -i off "$vpid" >/dev/null 2>&1
  # what the server ran: every decision must have reached it (callgrind
  # slows it fifty-fold; a decision answered by a failure mode would not)
  redis-cli -p "$port" info commandstats | grep -E "^cmdstat_(evalsha|eval|incrby):" | cut -d, -f1 >&2
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  while kill -0 "$vpid" 2>/dev/null; do sleep 0.2; done
  local ir
  ir=$(awk '/Collected :/ {gsub(",", "", $4); print $4}' "$work/redis.log" | tail -1)
  echo "$1 $((ir / calls))"
}
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }
rls_row() { # LABEL RULE CONNECTIONS CONCURRENCY
  on_fresh_redis
  printf 'domain: bench\ndescriptors:\n  - key: key\n    %s\n' "$2" >"$work/rules.yaml"
  target/release/tokenbucket-rls check-config "$work/rules.yaml" >/dev/null
  redis-cli -p "$port" flushall >/dev/null
  target/release/tokenbucket-rls --config "$work/rules.yaml" --grpc-addr 127.0.0.1:18583 \
    --admin-addr 127.0.0.1:18584 --store redis --redis-url "redis://127.0.0.1:$port" \
    --redis-timeout 10s --instances 1 >"$work/rls.log" 2>&1 &
  local pid=$!
  wait_port 18583
  # warm: connections up, scripts loaded
  target/release/rls-bench --target http://127.0.0.1:18583 --domain bench --key key \
    --connections "$3" --concurrency "$4" --requests 200 --warmup 0s >/dev/null 2>&1
  on
  target/release/rls-bench --target http://127.0.0.1:18583 --domain bench --key key \
    --connections "$3" --concurrency "$4" --requests "$calls" --warmup 0s >/dev/null 2>&1
  kill "$pid"; wait "$pid" 2>/dev/null || true
  off "$1"
}
{
  rls_row tokenbucket-rls,token-bucket,alone \
    "rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}" 1 1
  rls_row tokenbucket-rls,fixed-window,alone \
    "algorithm: fixed_window
    rate_limit: {unit: hour, requests_per_unit: 1000000000}" 1 1
  rls_row tokenbucket-rls,token-bucket,8x16 \
    "rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}" 8 16
  on_fresh_redis
  "$probe" "redis://127.0.0.1:$port" 200 >/dev/null
  on
  "$probe" "redis://127.0.0.1:$port" "$calls" >/dev/null
  off limitador
} | awk '{v[$1] = $2; print} END {
  printf "redis-server per decision against Limitador'"'"'s: token bucket alone %.2f, fixed window alone %.2f, token bucket 8x16 in flight %.2f\n", v["tokenbucket-rls,token-bucket,alone"] / v["limitador"], v["tokenbucket-rls,fixed-window,alone"] / v["limitador"], v["tokenbucket-rls,token-bucket,8x16"] / v["limitador"]
}'

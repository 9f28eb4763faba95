#!/usr/bin/env bash
# What redis-server runs per decision (#55 aim 1: at most Limitador's),
# counted in instructions by callgrind (deterministic where CPU time on a
# shared box is not), one redis-server 7 for every row, one hot key, every
# decision admitted:
#   - tokenbucket-rls (release build), Redis store, through gRPC: rls-bench
#     with one connection and one request in flight (each decision alone:
#     one.lua), then 8 connections x 16 in flight (batches: bucket.lua);
#     a token bucket and a fixed window of one limit each;
#   - Limitador through its own library and Redis storage (the
#     `AsyncRateLimiter` on `AsyncRedisStorage`, what limitador-server runs
#     with `redis <URL>`): integration/limitador-probe, one decision after
#     another, one limit on one variable (a fixed window: Limitador's only
#     kind). limitador-server itself is not on crates.io; its library is,
#     and builds RocksDB (its keys' code needs the `disk_storage` feature):
#     the first build takes a while.
# Instructions per decision are the process's, all threads, over the
# decisions only (instrumentation switched on around them).
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
(cd "$work" && valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$work/cg.out" \
  redis-server --port "$port" --save "" --appendonly no >"$work/redis.log" 2>&1 &)
for _ in $(seq 300); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
vpid=$(pgrep -f "callgrind.*--port $port" | head -1)
trap 'kill $(jobs -p) 2>/dev/null || true; redis-cli -p $port shutdown nosave >/dev/null 2>&1 || true; sleep 1; rm -rf "$work"' EXIT
on() { callgrind_control -z "$vpid" >/dev/null 2>&1; callgrind_control -i on "$vpid" >/dev/null 2>&1; }
off() { # LABEL: instructions per decision since `on`
  local ir
  ir=$(callgrind_control -e Ir "$vpid" 2>/dev/null | awk '$1 == "Th" {gsub(",", "", $3); s += $3} END {print s + 0}')
  callgrind_control -i off "$vpid" >/dev/null 2>&1
  echo "$1 $((ir / calls))"
}
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }
rls_row() { # LABEL RULE CONNECTIONS CONCURRENCY
  printf 'domain: bench\ndescriptors:\n  - key: key\n    %s\n' "$2" >"$work/rules.yaml"
  redis-cli -p "$port" flushall >/dev/null
  target/release/tokenbucket-rls --config "$work/rules.yaml" --grpc-addr 127.0.0.1:18583 \
    --admin-addr 127.0.0.1:18584 --store redis --redis-url "redis://127.0.0.1:$port" >"$work/rls.log" 2>&1 &
  local pid=$!
  wait_port 18583
  # warm: connections up, scripts loaded
  target/release/rls-bench --target http://127.0.0.1:18583 --domain bench --key key \
    --connections "$3" --concurrency "$4" --requests 200 --warmup 0s >/dev/null 2>&1
  on
  target/release/rls-bench --target http://127.0.0.1:18583 --domain bench --key key \
    --connections "$3" --concurrency "$4" --requests "$calls" --warmup 0s >/dev/null 2>&1
  off "$1"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
{
  rls_row tokenbucket-rls,token-bucket,alone \
    "rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}" 1 1
  rls_row tokenbucket-rls,fixed-window,alone \
    "rate_limit: {unit: hour, requests_per_unit: 1000000000, algorithm: fixed_window}" 1 1
  rls_row tokenbucket-rls,token-bucket,batched \
    "rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 1000000000}" 8 16
  redis-cli -p "$port" flushall >/dev/null
  "$probe" "redis://127.0.0.1:$port" 200 >/dev/null
  on
  "$probe" "redis://127.0.0.1:$port" "$calls" >/dev/null
  off limitador
} | awk '{v[$1] = $2; print} END {
  printf "redis-server per decision against Limitador'"'"'s: token bucket alone %.2f, fixed window alone %.2f, token bucket batched %.2f\n", v["tokenbucket-rls,token-bucket,alone"] / v["limitador"], v["tokenbucket-rls,fixed-window,alone"] / v["limitador"], v["tokenbucket-rls,token-bucket,batched"] / v["limitador"]
}'

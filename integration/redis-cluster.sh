#!/usr/bin/env bash
# Starts or stops a local Redis Cluster of 3 primaries + 3 replicas on
# loopback ports BASE..BASE+5 (cluster bus on +10000), data in DIR;
# PRIMARIES=N (at least 3) makes N primaries + N replicas on BASE..BASE+2N-1
# (give stop the same N).
#   integration/redis-cluster.sh start DIR [BASE]   (default BASE 7101)
#   integration/redis-cluster.sh stop  DIR [BASE]
# Prints the redis-cluster:// URL for --redis-url on start.
set -euo pipefail
cmd=${1:?start|stop}; dir=${2:?data directory}; base=${3:-7101}
primaries=${PRIMARIES:-3}
if [ "$primaries" -lt 3 ]; then echo "PRIMARIES must be at least 3 (Redis Cluster's minimum)" >&2; exit 2; fi
ports=$(seq "$base" $((base + 2 * primaries - 1)))

case "$cmd" in
start)
  mkdir -p "$dir"
  for p in $ports; do
    mkdir -p "$dir/$p"
    (cd "$dir/$p" && redis-server --port "$p" --bind 127.0.0.1 --save "" --appendonly no \
      --protected-mode no --maxmemory-policy noeviction --cluster-enabled yes \
      --cluster-config-file nodes.conf --cluster-node-timeout 1000 \
      --repl-diskless-sync-delay 0 --logfile "$dir/$p/redis.log" --daemonize yes \
      --pidfile "$dir/$p/redis.pid")
  done
  for p in $ports; do
    tries=0
    until redis-cli -p "$p" ping >/dev/null 2>&1; do
      tries=$((tries + 1))
      if [ "$tries" -gt 200 ]; then
        echo "redis-server on $p never answered (port taken?):" >&2
        tail -n 3 "$dir/$p/redis.log" >&2 || true
        exit 1
      fi
      sleep 0.05
    done
  done
  # shellcheck disable=SC2046
  redis-cli --cluster create $(for p in $ports; do echo "127.0.0.1:$p"; done) \
    --cluster-replicas 1 --cluster-yes >/dev/null
  for _ in $(seq 300); do
    ok=0
    for p in $ports; do
      redis-cli -p "$p" cluster info | grep -q cluster_state:ok && ok=$((ok + 1))
    done
    synced=$(for p in $ports; do redis-cli -p "$p" info replication; done | grep -c master_link_status:up || true)
    [ "$ok" -eq $((2 * primaries)) ] && [ "$synced" -eq "$primaries" ] && break
    sleep 0.1
  done
  echo "redis-cluster://$(for p in $ports; do printf '127.0.0.1:%s,' "$p"; done | sed 's/,$//')"
  ;;
stop)
  for p in $ports; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done
  ;;
*) echo "usage: $0 start|stop DIR [BASE]" >&2; exit 2 ;;
esac

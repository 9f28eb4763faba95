#!/usr/bin/env bash
# redis-server CPU per call (#39): a bucket's GET+SET alone, plus an attempt
# record as its own key (as shipped), or as a field of a per-descriptor hash
# of generations (the design measured and not built). redis-benchmark EVAL,
# utime+stime of redis-server from /proc. Loopback only, bounded.
#   integration/bench-attempt-record.sh [CALLS]   (default 300000)
set -euo pipefail
trap 'redis-cli -p 18799 shutdown nosave >/dev/null 2>&1 || true' EXIT
port=18799
redis-server --port $port --save '' --appendonly no --daemonize yes --logfile /dev/null
sleep 0.5
pid=$(redis-cli -p $port info server | awk -F: '/process_id/{print $2}' | tr -d '\r')
cpu() { awk '{print $14+$15}' /proc/$pid/stat; }
tck=$(getconf CLK_TCK)
n=${1:-300000}
V24=xxxxxxxxxxxxxxxxxxxxxxxx
V32=xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx
A="local v = redis.call('GET', KEYS[1]) redis.call('SET', KEYS[1], ARGV[1], 'PX', 60000) return 1"
B="local v = redis.call('GET', KEYS[1]) redis.call('SET', KEYS[1], ARGV[1], 'PX', 60000) local r = redis.call('GET', KEYS[2]) redis.call('SET', KEYS[2], ARGV[2], 'PX', 120000) return 1"
C="local v = redis.call('GET', KEYS[1]) redis.call('SET', KEYS[1], ARGV[1], 'PX', 60000) local r = redis.call('HGET', KEYS[2], ARGV[3]) if not r then r = redis.call('HGET', KEYS[3], ARGV[3]) end if redis.call('HSET', KEYS[2], ARGV[3], ARGV[2]) == 1 and redis.call('HLEN', KEYS[2]) == 1 then redis.call('PEXPIRE', KEYS[2], 240000) end return 1"
run() {
  label=$1; shift
  redis-cli -p $port flushall >/dev/null
  before=$(cpu)
  redis-benchmark -p $port -n $n -c 8 -r 100000000 -q "$@" >/dev/null
  after=$(cpu)
  awk -v l="$label" -v b=$before -v a=$after -v n=$n -v t=$tck 'BEGIN{printf "%-28s %.2f us/call\n", l, (a-b)/t*1e6/n}'
}
for round in 1 2; do
  run "bucket only" EVAL "$A" 1 '{t}b' $V24
  run "bucket + record key" EVAL "$B" 2 '{t}b' '{t}r:__rand_int__' $V24 $V32
  run "bucket + record in hash" EVAL "$C" 3 '{t}b' '{t}g1' '{t}g0' $V24 $V32 __rand_int__
done
redis-cli -p $port shutdown nosave >/dev/null 2>&1 || true

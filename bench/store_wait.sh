#!/usr/bin/env bash
# bench/store_wait.sh - the PostgreSQL modes' decision wait, several tollgate builds in turn.
#
# In pg-hot every request waits for the one statement its bucket's batch is in, so the rate is
# the batch size over that statement's round trip. bench/run.sh gives the rate; this gives both
# factors, per build and round, so a change in the rate can be told apart as a change in
# batching or in the round trip. Each build serves the MODE of bench/run.sh (one worker, pinned
# to CPU_PROXY; the upstream nginx, wrk and the database backends on CPU_LOAD), each on a fresh
# database of its own. After WARMUP s of load, it measures DURATION s of `wrk --latency` and
# reads the store metrics from the admin listener before and after:
#   req/s          wrk's rate
#   wait µs        mean time a decision waited for the store (tollgate_store_seconds sum/count)
#   stmt/100       statements sent per 100 decisions (tollgate_store_round_trips_total)
#   p99            wrk's 99th percentile
# The builds take turns within each round, so a drifting host moves them alike.
#
# Usage: TOLLGATE_BINS="/path/a /path/b" [KNOB=value ...] bench/store_wait.sh
# Knobs: MODE [pg-hot] (pg-hot or pg-10k) ROUNDS [5] CONNS [32] DURATION [5] s WARMUP [1] s
#        CPU_PROXY [1] CPU_LOAD [0] BASE_PORT [19600]
#        PG_URL [postgres://postgres@127.0.0.1:5432] (loopback; creates and drops databases
#        tollgate_wait_<n>)   PG_SSLMODE [disable] (bench/lib/pg.sh)
# Needs: nginx, wrk, psql, taskset, curl (apt-get install -y nginx wrk postgresql-client).
set -euo pipefail
{
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${TOLLGATE_BINS:?TOLLGATE_BINS: the tollgate binaries to compare, separated by spaces}"
MODE=${MODE:-pg-hot}
ROUNDS=${ROUNDS:-5}
CONNS=${CONNS:-32}
DURATION=${DURATION:-5}
WARMUP=${WARMUP:-1}
CPU_PROXY=${CPU_PROXY:-1}
CPU_LOAD=${CPU_LOAD:-0}
BASE_PORT=${BASE_PORT:-19600}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
export RUST_LOG=warn
unset TOLLGATE_DATABASE_URL TOLLGATE_CONFIG
UP=$BASE_PORT; PX=$((BASE_PORT + 1)); PX_H2=$((BASE_PORT + 2)); ADMIN=$((BASE_PORT + 3))

case $MODE in
  pg-hot) key=ip; script=() ;;
  pg-10k) key=header:authorization; script=(-s "$HERE/lua/tokens.lua") ;;
  *) echo "MODE must be pg-hot or pg-10k" >&2; exit 2 ;;
esac
for tool in nginx wrk psql taskset curl; do
  command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install -y nginx wrk postgresql-client)" >&2; exit 1; }
done
source "$HERE/lib/pg.sh"
require_loopback_pg_url

RUN=$(mktemp -d /tmp/tollgate-store-wait.XXXXXX); chmod 755 "$RUN"
mkdir -p "$RUN/nginx_tmp"
source "$HERE/lib/procs.sh"
cleanup_on_exit

render "$HERE/conf/upstream.nginx.conf" "$UP" >"$RUN/upstream.conf"
taskset -c "$CPU_LOAD" nginx -p "$RUN/" -c "$RUN/upstream.conf" >"$RUN/upstream.out" 2>&1 &
PIDS+=("$!")
wait_200 "http://127.0.0.1:$UP/" 10

read -r -a bins <<<"$TOLLGATE_BINS"
for i in "${!bins[@]}"; do
  db=tollgate_wait_$i
  psql_admin -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" >/dev/null
  {
    tollgate_config_head "$PX" "$ADMIN"
    store_section "$db"
    printf '[[routes]]\nname = "bench"\nupstream = "app"\n'
    printf '  [[routes.limits]]\n  key = "%s"\n  requests = 2000000000\n  window = "1h"\n' "$key"
  } >"$RUN/$i.toml"
done

# metric NAME: its value on the admin listener now (0 when absent)
metric() {
  curl -fsS "http://127.0.0.1:$ADMIN/metrics" 2>/dev/null | awk -v m="$1" '$1 == m {n = $2} END {print n + 0}'
}

echo "$MODE, wrk -t1 -c$CONNS -d${DURATION}s; tollgate on CPU $CPU_PROXY, the rest on CPU $CPU_LOAD"
printf '%-5s %-40s %9s %9s %9s %9s\n' round build "req/s" "wait µs" "stmt/100" p99
for round in $(seq "$ROUNDS"); do
  for i in "${!bins[@]}"; do
    taskset -c "$CPU_PROXY" "${bins[$i]}" --config "$RUN/$i.toml" run >"$RUN/$i.log" 2>&1 &
    started=$!
    PIDS+=("$started")
    wait_200 "http://127.0.0.1:$PX/" 30
    taskset -c "$CPU_LOAD" wrk -t1 -c"$CONNS" -d"${WARMUP}s" "${script[@]}" "http://127.0.0.1:$PX/" >/dev/null
    pin_backends "tollgate_wait_$i"
    s0=$(metric tollgate_store_seconds_sum); c0=$(metric tollgate_store_seconds_count)
    t0=$(metric tollgate_store_round_trips_total)
    # Pool connections opened during the run are pinned too, as bench/run.sh does.
    pin_backends_during "tollgate_wait_$i" &
    pinner=$!
    PIDS+=("$pinner")
    out=$(taskset -c "$CPU_LOAD" wrk -t1 -c"$CONNS" -d"${DURATION}s" --latency "${script[@]}" "http://127.0.0.1:$PX/")
    kill "$pinner"; wait "$pinner" 2>/dev/null || true
    s1=$(metric tollgate_store_seconds_sum); c1=$(metric tollgate_store_seconds_count)
    t1=$(metric tollgate_store_round_trips_total)
    rate=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
    p99=$(awk '$1 == "99%" {print $2}' <<<"$out")
    awk -v r="$round" -v b="${bins[$i]}" -v rate="$rate" -v p99="$p99" \
        -v s="$s0 $s1" -v c="$c0 $c1" -v t="$t0 $t1" 'BEGIN {
      split(s, S, " "); split(c, C, " "); split(t, T, " "); n = C[2] - C[1]
      if (n <= 0) { printf "%-5s %-40s %9.0f %9s %9s %9s\n", r, b, rate, "-", "-", p99; exit }
      printf "%-5s %-40s %9.0f %9.0f %9.2f %9s\n", r, b, rate, (S[2] - S[1]) / n * 1e6, (T[2] - T[1]) / n * 100, p99
    }'
    kill -TERM "$started" 2>/dev/null || true; wait "$started" 2>/dev/null || true
  done
done
for i in "${!bins[@]}"; do psql_admin -c "DROP DATABASE IF EXISTS tollgate_wait_$i" >/dev/null; done
exit 0
}

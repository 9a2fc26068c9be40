#!/usr/bin/env bash
# bench/db_load.sh - what tollgate asks of PostgreSQL at a given request rate, with and without
# reserved shares (contract §3c; docs/performance.md, "Reserved shares: the database's load").
#
# For each MODE and each RATE, a fresh database and one tollgate (one worker, pinned to
# CPU_PROXY; the upstream nginx, wrk and the database on CPU_LOAD) serve wrk paced to RATE
# requests per second over CONNS connections (bench/lua/paced.lua) for DURATION s after
# WARMUP s. Before that, PRIME s of unpaced load touch the buckets: on 10,000 keys a paced run
# of a few seconds would otherwise see most keys for the first time, and measure the start of
# their windows (one grant each with `reserve`), not the steady state. Printed per run:
#   req/s       what wrk reached (a rate the machine cannot carry shows as less)
#   stmts/s     statements tollgate sent for decisions, shares and give-backs
#               (tollgate_store_round_trips_total over the measured seconds)
#   xacts/s     transactions the database committed for that database, per measured second
#               (pg_stat_database; read PG_STATS_WAIT s after the run, so the registry's refreshes
#               of those seconds, one every 3 s, are in it too)
#   rows/s      rows inserted, updated or deleted in rate_limits and tollgate_shares
#   per 1k      stmts/s per 1,000 requests
# Modes: pg-hot (one `ip` bucket), pg-10k (`header:authorization`, 10,000 tokens), and each with
# "-reserve" (the same limit with `reserve = true`); limits are 2,000,000,000 per hour, so
# nothing is denied. The statement rate of a reserve mode should stay flat as RATE grows on the
# hot bucket, and be about one per bucket per window plus give-backs on 10,000 buckets.
#
# Usage: [KNOB=value ...] bench/db_load.sh
# Knobs: MODES ["pg-hot pg-hot-reserve pg-10k pg-10k-reserve"] RATES ["1000 4000 16000"]
#        CONNS [32] DURATION [20] s WARMUP [3] s PRIME [5] s CPU_PROXY [1] CPU_LOAD [0]
#        BASE_PORT [19700]
#        TOLLGATE_BIN [target/release/tollgate] PG_STATS_WAIT [11] s (PostgreSQL flushes an idle
#        backend's counters on a 10 s timer)
#        PG_URL [postgres://postgres@127.0.0.1:5432] (loopback; creates and drops databases
#        tollgate_dbload_<n>)   PG_SSLMODE [disable] (bench/lib/pg.sh)
# Needs: nginx, wrk, psql, taskset, curl (apt-get install -y nginx wrk postgresql-client).
set -euo pipefail
{
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODES=${MODES:-"pg-hot pg-hot-reserve pg-10k pg-10k-reserve"}
RATES=${RATES:-"1000 4000 16000"}
CONNS=${CONNS:-32}
DURATION=${DURATION:-20}
WARMUP=${WARMUP:-3}
PRIME=${PRIME:-5}
CPU_PROXY=${CPU_PROXY:-1}
CPU_LOAD=${CPU_LOAD:-0}
BASE_PORT=${BASE_PORT:-19700}
TOLLGATE_BIN=${TOLLGATE_BIN:-$HERE/../target/release/tollgate}
PG_STATS_WAIT=${PG_STATS_WAIT:-11}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
export RUST_LOG=warn
unset TOLLGATE_DATABASE_URL TOLLGATE_CONFIG
UP=$BASE_PORT; PX=$((BASE_PORT + 1)); PX_H2=$((BASE_PORT + 2)); ADMIN=$((BASE_PORT + 3))

for tool in nginx wrk psql taskset curl; do
  command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install -y nginx wrk postgresql-client)" >&2; exit 1; }
done
[[ -x $TOLLGATE_BIN ]] || { echo "no tollgate binary at $TOLLGATE_BIN (cargo build --release)" >&2; exit 1; }
source "$HERE/lib/pg.sh"
require_loopback_pg_url

RUN=$(mktemp -d /tmp/tollgate-db-load.XXXXXX); chmod 755 "$RUN"
mkdir -p "$RUN/nginx_tmp"
source "$HERE/lib/procs.sh"
cleanup_on_exit

render "$HERE/conf/upstream.nginx.conf" "$UP" >"$RUN/upstream.conf"
taskset -c "$CPU_LOAD" nginx -p "$RUN/" -c "$RUN/upstream.conf" >"$RUN/upstream.out" 2>&1 &
PIDS+=("$!")
wait_200 "http://127.0.0.1:$UP/" 10

metric() {   # metric NAME: its value on the admin listener now (0 when absent)
  curl -fsS "http://127.0.0.1:$ADMIN/metrics" 2>/dev/null | awk -v m="$1" '$1 == m {n = $2} END {print n + 0}'
}
db_counts() {   # db_counts DB -> "transactions rows_written"
  local x r
  x=$(psql_admin -tAc "SELECT xact_commit FROM pg_stat_database WHERE datname = '$1'")
  r=$(psql_db "$1" -tAc "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables WHERE relname IN ('rate_limits', 'tollgate_shares')")
  echo "$x $r"
}

echo "wrk -t1 -c$CONNS paced; ${DURATION}s measured after ${PRIME}s unpaced and ${WARMUP}s paced; tollgate on CPU $CPU_PROXY, the rest on CPU $CPU_LOAD"
echo
echo "| mode | rate asked | req/s | stmts/s | per 1k req | xacts/s | rows/s |"
echo "|---|---:|---:|---:|---:|---:|---:|"
n=0
for mode in $MODES; do
  case ${mode%-reserve} in
    pg-hot) key=ip keys=0 ;;
    pg-10k) key=header:authorization keys=10000 ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
  esac
  reserve=false
  [[ $mode == *-reserve ]] && reserve=true
  for rate in $RATES; do
    db=tollgate_dbload_$n; n=$((n + 1))
    psql_admin -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" >/dev/null
    {
      tollgate_config_head "$PX" "$ADMIN"
      store_section "$db"
      printf '[[routes]]\nname = "bench"\nupstream = "app"\n'
      printf '  [[routes.limits]]\n  key = "%s"\n  requests = 2000000000\n  window = "1h"\n  reserve = %s\n' "$key" "$reserve"
    } >"$RUN/$db.toml"
    taskset -c "$CPU_PROXY" "$TOLLGATE_BIN" --config "$RUN/$db.toml" run >"$RUN/$db.log" 2>&1 &
    started=$!
    PIDS+=("$started")
    wait_200 "http://127.0.0.1:$ADMIN/readyz" 30
    export BENCH_RATE=$rate BENCH_CONNS=$CONNS BENCH_KEYS=$keys
    if ((PRIME > 0)); then
      taskset -c "$CPU_LOAD" wrk -t1 -c"$CONNS" -d"${PRIME}s" -s "$HERE/lua/tokens.lua" "http://127.0.0.1:$PX/" >/dev/null
    fi
    taskset -c "$CPU_LOAD" wrk -t1 -c"$CONNS" -d"${WARMUP}s" -s "$HERE/lua/paced.lua" "http://127.0.0.1:$PX/" >/dev/null
    pin_backends "$db"
    sleep "$PG_STATS_WAIT"
    read -r x0 r0 <<<"$(db_counts "$db")"
    t0=$(metric tollgate_store_round_trips_total)
    out=$(taskset -c "$CPU_LOAD" wrk -t1 -c"$CONNS" -d"${DURATION}s" -s "$HERE/lua/paced.lua" "http://127.0.0.1:$PX/")
    t1=$(metric tollgate_store_round_trips_total)
    # The statistics of the run's last seconds reach the view up to 10 s late.
    sleep "$PG_STATS_WAIT"
    read -r x1 r1 <<<"$(db_counts "$db")"
    rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
    awk -v m="$mode" -v rate="$rate" -v rps="$rps" -v d="$DURATION" \
        -v t="$t0 $t1" -v x="$x0 $x1" -v r="$r0 $r1" 'BEGIN {
      split(t, T, " "); split(x, X, " "); split(r, R, " ")
      s = (T[2] - T[1]) / d
      printf "| %s | %d | %.0f | %.2f | %.3f | %.2f | %.1f |\n", m, rate, rps, s, (rps > 0 ? 1000 * s / rps : 0), \
        (X[2] - X[1]) / d, (R[2] - R[1]) / d
    }'
    kill -TERM "$started" 2>/dev/null || true; wait "$started" 2>/dev/null || true
    psql_admin -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null
  done
done
exit 0
}

#!/usr/bin/env bash
# bench/run.sh - tollgate against nginx, on loopback, in one interleaved run.
#
# Starts an upstream (nginx `return 200`, 1 worker), nginx as a reverse proxy (1 worker,
# upstream keep-alive, h2c listener) and one tollgate per mode, all on 127.0.0.1, then measures
# every target with wrk (HTTP/1.1) and h2load (h2c, prior knowledge) for RUNS interleaved
# rounds and prints the medians as a markdown table, with the targets of the performance issue
# checked against them. Then a keep-alive soak: 1,000 open connections against a fresh
# tollgate (memory store), its RSS sampled over SOAK_SECONDS.
#
# Modes (tollgate targets; MODES selects a subset, nginx is always measured):
#   nolimit     a route without limits (memory store, never consulted)
#   memory      memory store, one `ip` limit: one hot key (every client is 127.0.0.1)
#   memory-10k  memory store, `header:authorization` limit, wrk varies the token over 10,000
#               values (bench/lua/tokens.lua): the fair reference for pg-10k (same wrk script)
#   pg-hot      PostgreSQL store, `ip` limit: one hot key
#   pg-10k      PostgreSQL store, `header:authorization` limit, 10,000 tokens (h1 only: h2load
#               cannot vary a header per request)
#   pg-flood    PostgreSQL store, `ip` limit of 10 per hour: all but the first 10 are denied
#   pg-hot-sliding, pg-10k-sliding
#               as pg-hot and pg-10k with `algorithm = "sliding"` (contract §3a); not in the default
#               MODES: MODES="pg-hot pg-hot-sliding pg-10k pg-10k-sliding" gives same-run ratios
#               (the summary's "sliding / fixed" lines, checked against issue 18's 0.9)
#   pg-hot-reserve, pg-10k-reserve, pg-hot-reserve-sliding, pg-10k-reserve-sliding
#               as pg-hot, pg-10k and their sliding modes with `reserve = true` (contract §3c):
#               decided from shares taken from the database; not in the default MODES:
#               MODES="memory memory-10k pg-hot pg-10k pg-hot-reserve pg-10k-reserve" gives the
#               same-run ratios the summary checks against issue 49's targets
#   pg-hot-overrides
#               as pg-hot, with OVERRIDES [10000] overrides of its limit in the database for
#               other subjects (contract §3e): the decision path's look-up in a full map;
#               BASE_BIN=<main> MODES="pg-hot pg-hot-overrides" gives the same-run pair
#   pg-hot-two  as pg-hot with a second limit (`global`) on the route: a request with two
#               enforced limits, decided together (contract §3d: one that denies takes
#               nothing from the other)
#   pg-hot-cost-header
#               as pg-hot, the limit charged after the response from the upstream's
#               `x-ratelimit-cost` field (contract §3d; wrk asks /cost, where the upstream sets it):
#               a check before forwarding and a charge after the head; not in the default MODES
#   nolimit-hyper, memory-hyper
#               nolimit and memory served by hyper's HTTP/1.1 server and client alone
#               (`tollgate run --http1 hyper`): what tollgate's own HTTP/1.1 code is worth,
#               as same-round ratios (docs/performance.md, "One HTTP/1.1 stack or two"); not
#               in the default MODES
# Reference (CEILING=1, the default): bench/ceiling, the plainest HTTP/1.1 proxy hyper makes (the
#   upstream connection polled inside the client connection's task, one thread, no limits, no
#   header rewriting), measured in the same rounds (h1 only): how far tollgate is from what hyper
#   can do on this machine (issue 16). Its row is "hyper ceiling" in the summary.
# Non-flood limits are 2,000,000,000 per hour, so nothing is rejected (non-2xx must stay 0).
#
# Usage: [KNOB=value ...] bench/run.sh
#        bench/run.sh --summarize bench/results/<ts>     (rebuild summary.md)
#
# Knobs (defaults in brackets):
#   RUNS [3] rounds   DURATION [10] s per measured run   WARMUP [2] s before every run
#   CONNS ["32 128"]  PROTOS ["h1 h2"]  H2_STREAMS [10] (h2load -m)  PAUSE [1] s between runs
#   MODES ["nolimit memory memory-10k pg-hot pg-10k pg-flood"]
#   OVERRIDES [10000]       overrides loaded for pg-hot-overrides
#   SOAK [1]  SOAK_SECONDS [300]  SOAK_CONNS [1000]  SOAK_INTERVAL [5] s between two requests
#             on one connection (1000 connections / 5 s = ~200 req/s of light load)
#   PIN [1]: proxy under test on CPU_PROXY [1]; wrk/h2load and the upstream on CPU_LOAD [0]
#   PIN_PG [1] (with PIN=1): the PostgreSQL backends serving the mode under load on CPU_LOAD
#             too, re-pinned every 0.5 s during the run (new pool connections included).
#             Unpinned, Linux's wake-up placement runs a backend on the proxy's CPU most of
#             the time (it is woken by the proxy's write), where it takes the proxy's CPU;
#             in production the database is another machine. PIN_PG=0 measures that case.
#   WORKERS [1]: tollgate's connection workers (`server.workers`, like nginx's one worker)
#   ACCESS_LOG [0]: 1 runs tollgate at RUST_LOG=info, its default, so every request formats
#             and writes its access-log line (into its worker's 64 KiB block, handed to the
#             log writer's thread) to /dev/null:
#             the formatting and the writer are paid, a disk is not, and results/ does not
#             fill with log files. 0 runs it at RUST_LOG=warn, like nginx with access_log off.
#   NGINX_ACCESS_LOG [ACCESS_LOG]: 1 gives the reference nginx its default access log
#             (`combined`) to /dev/null, buffered 64 KiB (`buffer=64k flush=1s`, as tollgate's
#             workers buffer theirs), so ACCESS_LOG=1 compares both proxies as they
#             ship; NGINX_ACCESS_LOG=0 with ACCESS_LOG=1 logs in tollgate only.
#   PG_URL [postgres://postgres@127.0.0.1:5432]  (loopback only; trust auth; the script creates
#             and drops databases tollgate_bench_<target>)   PG_STATS_WAIT [11] s (see below)
#   PG_SSLMODE [disable]: the `sslmode` of tollgate's `store.url` (bench/lib/pg.sh says why)
#   BUILD [1]: cargo build --release first (tollgate and bench/ceiling); TOLLGATE_BIN
#             [target/release/tollgate]; BASE_BIN [none]: another tollgate build (the "before"
#             of a change) measured in every mode as target base-<mode>, in the same rounds
#             with the same configuration, so the summary can give this build / BASE_BIN as a
#             median of same-round ratios (the "this build" lines of its targets table)
#             rather than two runs' ratios to nginx; CEILING [1]; CEILING_BIN
#             [bench/ceiling/target/release/tollgate-bench-ceiling]
#   BASE_PORT [19200]: upstream +0, nginx +1 (h2c +2), ceiling +3, tollgate modes +10.., admin +30..,
#             soak +50/+51
#   OUT [bench/results/<UTC timestamp>]
#
# DB statements: from pg_stat_statements when the server has it loaded, else from
# pg_stat_database.xact_commit (tollgate's increments run in autocommit, one transaction per
# statement); rows written from pg_stat_user_tables (n_tup_ins + n_tup_upd + n_tup_del of
# rate_limits and tollgate_shares, the reserve modes' ledger), per database.
# Those statistics reach the view up to 10 s late (PostgreSQL flushes an idle backend's
# counters on a 10 s timer), hence PG_STATS_WAIT after each Postgres run. The count covers the
# warm-up and the run, divided by the requests of both.
#
# Every server is started by this script, listens on 127.0.0.1 and is stopped by its PID on
# exit (also on error and Ctrl-C); every load run is bounded (wrk -d, h2load -D, timeout).
set -euo pipefail
{ # read the whole script before running it: editing it during a run cannot break the run

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
LIB="python3 $HERE/lib/benchlib.py"

write_summary() {   # write_summary DIR
  {
    echo "# tollgate bench results"
    echo
    echo '```'
    cat "$1/env.txt"
    echo '```'
    echo
    echo "Medians over the rounds. × nginx / × tollgate-memory: median over rounds of the"
    echo "ratio to that target's req/s in the same round, protocol and connection count."
    echo "Per-1k columns count the warm-up and the run, over the requests of both."
    echo
    $LIB summarize "$1/runs.tsv" "$1/soak.json"
    if [[ -s $1/warnings.txt ]]; then echo; echo "Warnings:"; echo; sed 's/^/- /' "$1/warnings.txt"; fi
    if [[ -s $1/soak.txt ]]; then echo; echo "Keep-alive soak:"; echo; echo '```'; cat "$1/soak.txt"; echo '```'; fi
  } >"$1/summary.md"
}
if [[ ${1:-} == --summarize ]]; then
  write_summary "${2:?usage: run.sh --summarize DIR}"
  cat "$2/summary.md"
  exit 0
fi

RUNS=${RUNS:-3}
DURATION=${DURATION:-10}
WARMUP=${WARMUP:-2}
CONNS=${CONNS:-"32 128"}
PROTOS=${PROTOS:-"h1 h2"}
H2_STREAMS=${H2_STREAMS:-10}
PAUSE=${PAUSE:-1}
MODES=${MODES:-"nolimit memory memory-10k pg-hot pg-10k pg-flood"}
OVERRIDES=${OVERRIDES:-10000}
SOAK=${SOAK:-1}
SOAK_SECONDS=${SOAK_SECONDS:-300}
SOAK_CONNS=${SOAK_CONNS:-1000}
SOAK_INTERVAL=${SOAK_INTERVAL:-5}
PIN=${PIN:-1}
PIN_PG=${PIN_PG:-1}
CPU_PROXY=${CPU_PROXY:-1}
CPU_LOAD=${CPU_LOAD:-0}
WORKERS=${WORKERS:-1}
ACCESS_LOG=${ACCESS_LOG:-0}
NGINX_ACCESS_LOG=${NGINX_ACCESS_LOG:-$ACCESS_LOG}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
PG_STATS_WAIT=${PG_STATS_WAIT:-11}
BUILD=${BUILD:-1}
TOLLGATE_BIN=${TOLLGATE_BIN:-$ROOT/target/release/tollgate}
BASE_BIN=${BASE_BIN:-}
CEILING=${CEILING:-1}
CEILING_BIN=${CEILING_BIN:-$HERE/ceiling/target/release/tollgate-bench-ceiling}
BASE_PORT=${BASE_PORT:-19200}
OUT=${OUT:-$HERE/results/$(date -u +%Y%m%dT%H%M%SZ)}

UPSTREAM_PORT=$BASE_PORT
NGINX_PORT=$((BASE_PORT + 1))
NGINX_H2_PORT=$((BASE_PORT + 2))
CEILING_PORT=$((BASE_PORT + 3))
SOAK_PORT=$((BASE_PORT + 50))
SOAK_ADMIN_PORT=$((BASE_PORT + 51))

for tool in wrk nginx curl python3 taskset; do
  command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install -y nginx wrk nghttp2-client curl python3)" >&2; exit 1; }
done
[[ $PROTOS != *h2* ]] || command -v h2load >/dev/null || { echo "missing h2load (apt-get install -y nghttp2-client)" >&2; exit 1; }
source "$HERE/lib/pg.sh"
require_loopback_pg_url

# ---------------------------------------------------------------- process bookkeeping
RUN=""
PIDS=()
NAMES=()
PG_DBS=()
start_bg() {   # start_bg NAME CMD... : a server that stays in the foreground; we keep its PID
  # Its output goes to $RUN/NAME.out, or to BG_OUT when that is set.
  local name=$1; shift
  "$@" >"${BG_OUT:-$RUN/$name.out}" 2>&1 &
  PIDS+=("$!"); NAMES+=("$name")
  echo "started $name (pid $!)"
}
stop_pid() {   # stop_pid PID NAME : TERM, up to 5 s, then KILL
  local pid=$1 i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  echo "stopped $2 (pid $pid)"
}
stop_all() {
  local i
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do stop_pid "${PIDS[$i]}" "${NAMES[$i]}"; done
  PIDS=(); NAMES=()
}
LOADPID=""
finish() {
  local rc=$?
  [[ -n $LOADPID ]] && kill -0 "$LOADPID" 2>/dev/null && kill -TERM "$LOADPID" 2>/dev/null || true
  stop_all
  local db
  for db in "${PG_DBS[@]}"; do psql_admin -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true; done
  if [[ -n $RUN ]]; then
    mkdir -p "$OUT/raw"
    cp "$RUN"/*.out "$RUN"/*.log "$RUN"/*.toml "$RUN"/*.conf "$OUT/raw/" 2>/dev/null || true
    rm -rf "$RUN"
  fi
  exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

check_alive() {
  local i
  for i in "${!PIDS[@]}"; do
    kill -0 "${PIDS[$i]}" 2>/dev/null && continue
    echo "${NAMES[$i]} (pid ${PIDS[$i]}) has exited; its output:" >&2
    tail -n 30 "$RUN/${NAMES[$i]}.out" >&2 || true
    exit 1
  done
}
wait_200() {   # wait_200 URL TIMEOUT_S
  local deadline=$((SECONDS + $2)) code=none
  while ((SECONDS < deadline)); do
    check_alive
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "$1" || true)
    [[ $code == 200 ]] && return 0
    sleep 0.2
  done
  echo "no 200 from $1 after $2 s (last answer: $code)" >&2
  exit 1
}
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
need_port() { port_free "$1" || { echo "port $1 is in use (set BASE_PORT)" >&2; exit 1; }; }
pin() {   # pin proxy|load -> taskset prefix (word-split on purpose)
  [[ $PIN == 1 ]] || return 0
  if [[ $1 == proxy ]]; then echo "taskset -c $CPU_PROXY"; else echo "taskset -c $CPU_LOAD"; fi
}

# ---------------------------------------------------------------- PostgreSQL helpers
# psql_admin, psql_db, pin_backends and pin_backends_during: bench/lib/pg.sh (sourced above)
STATS_METHOD=""
db_snap() {   # db_snap DB -> "statements rows_written"
  local db=$1 stm rows
  if [[ $STATS_METHOD == pg_stat_statements ]]; then
    stm=$(psql_admin -tAc "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = '$db'")
  else
    stm=$(psql_admin -tAc "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = '$db'")
  fi
  rows=$(psql_db "$db" -tAc "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables WHERE relname IN ('rate_limits', 'tollgate_shares')")
  echo "$stm ${rows:-0}"
}

# ---------------------------------------------------------------- set-up
mkdir -p "$OUT/raw"
: >"$OUT/warnings.txt"
RUN=$(mktemp -d /tmp/tollgate-bench.XXXXXX)
chmod 755 "$RUN"
mkdir -p "$RUN/upstream_tmp" "$RUN/nginx_tmp"
echo "results: $OUT   (server state: $RUN)"

if [[ $BUILD == 1 ]]; then
  echo "building tollgate (cargo build --release) ..."
  (cd "$ROOT" && cargo build --release --quiet) || { echo "cargo build --release failed" >&2; exit 1; }
  if [[ $CEILING == 1 ]]; then
    echo "building the ceiling proxy (bench/ceiling) ..."
    cargo build --release --quiet --manifest-path "$HERE/ceiling/Cargo.toml" \
      || { echo "cargo build of bench/ceiling failed" >&2; exit 1; }
  fi
fi
[[ -x $TOLLGATE_BIN ]] || { echo "no tollgate binary at $TOLLGATE_BIN" >&2; exit 1; }
[[ -z $BASE_BIN || -x $BASE_BIN ]] || { echo "no tollgate binary at BASE_BIN=$BASE_BIN" >&2; exit 1; }
[[ $CEILING != 1 || -x $CEILING_BIN ]] || { echo "no ceiling binary at $CEILING_BIN (BUILD=1 builds it, CEILING=0 skips it)" >&2; exit 1; }

ORDER=(nginx)
[[ $CEILING == 1 ]] && ORDER+=(ceiling)
for m in $MODES; do
  case $m in
    nolimit | memory | memory-10k | pg-hot | pg-10k | pg-flood | pg-hot-sliding | pg-10k-sliding | \
      pg-hot-reserve | pg-10k-reserve | pg-hot-reserve-sliding | pg-10k-reserve-sliding | \
      pg-hot-cost-header | pg-hot-overrides | pg-hot-two | nolimit-hyper | memory-hyper)
      ORDER+=("tollgate-$m")
      [[ -n $BASE_BIN ]] && ORDER+=("base-$m") ;;
    *) echo "unknown mode $m" >&2; exit 1 ;;
  esac
done
NEEDS_PG=0
[[ " $MODES " == *" pg-"* ]] && NEEDS_PG=1

if ((NEEDS_PG)); then
  psql_admin -tAc "SELECT 1" >/dev/null || { echo "PostgreSQL does not answer at $PG_URL" >&2; exit 1; }
  if [[ $(psql_admin -tAc "SHOW shared_preload_libraries") == *pg_stat_statements* ]]; then
    STATS_METHOD=pg_stat_statements
    psql_admin -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" >/dev/null
  else
    STATS_METHOD="pg_stat_database.xact_commit+xact_rollback (pg_stat_statements is not in shared_preload_libraries)"
  fi
fi

declare -A URL H2URL ADMIN CONF LUA PIDOF DB EXPECT_DENY DBSNAP BIN
URL[nginx]=http://127.0.0.1:$NGINX_PORT/
H2URL[nginx]=http://127.0.0.1:$NGINX_H2_PORT/
URL[ceiling]=http://127.0.0.1:$CEILING_PORT/   # h1 only: no H2URL

tollgate_conf() {   # tollgate_conf FILE PORT ADMIN_PORT MODE [DB]
  local file=$1 port=$2 aport=$3 mode=$4 db=${5:-}
  {
    cat <<EOF
# generated by bench/run.sh for mode $mode
[server]
listen = ["127.0.0.1:$port"]
header_read_timeout = "10s"
idle_timeout = "60s"
max_connections = 10000
shutdown_timeout = "2s"
workers = $WORKERS

[admin]
listen = "127.0.0.1:$aport"

[keys]
secret = "bench-only-secret-not-used-anywhere-else"

[upstreams.app]
url = "http://127.0.0.1:$UPSTREAM_PORT"

EOF
    if [[ -n $db ]]; then
      cat <<EOF
[store]
url = "$(store_url "$db")"
pool_size = 16
timeout = "100ms"
on_error = "allow"
migrate = true
sweep_interval = "60s"
synchronous_commit = "off"

EOF
    fi
    echo '[[routes]]'
    echo "name = \"bench\""
    echo 'upstream = "app"'
    # A *-reserve mode is the mode without "-reserve", its limit taken in shares.
    local limits=${mode%-hyper}
    case ${limits/-reserve/} in
      nolimit) ;;
      memory | pg-hot | pg-hot-overrides) printf '  [[routes.limits]]\n  key = "ip"\n  requests = 2000000000\n  window = "1h"\n' ;;
      memory-10k | pg-10k) printf '  [[routes.limits]]\n  key = "header:authorization"\n  requests = 2000000000\n  window = "1h"\n' ;;
      pg-flood) printf '  [[routes.limits]]\n  key = "ip"\n  requests = 10\n  window = "1h"\n' ;;
      pg-hot-two) printf '  [[routes.limits]]\n  key = "%s"\n  requests = 2000000000\n  window = "1h"\n' ip global ;;
      pg-hot-cost-header) printf '  [[routes.limits]]\n  key = "ip"\n  requests = 2000000000\n  window = "1h"\n  cost_header = "x-ratelimit-cost"\n' ;;
      pg-hot-sliding) printf '  [[routes.limits]]\n  key = "ip"\n  requests = 2000000000\n  window = "1h"\n  algorithm = "sliding"\n' ;;
      pg-10k-sliding) printf '  [[routes.limits]]\n  key = "header:authorization"\n  requests = 2000000000\n  window = "1h"\n  algorithm = "sliding"\n' ;;
    esac
    if [[ $limits == *-reserve* ]]; then printf '  reserve = true\n'; fi
  } >"$file"
}

# load_overrides TARGET: its database migrated, then OVERRIDES overrides of the bench limit
# (`bench:ip`) for subjects that are not the client, so the decision path looks the client's
# bucket up in a full map and finds nothing (contract §3e). A build without overrides (a
# BASE_BIN before them) has no table: it runs as pg-hot.
load_overrides() {
  local t=$1
  "${BIN[$t]}" migrate --config "${CONF[$t]}" >"$RUN/$t.migrate.log" 2>&1 \
    || { echo "$t: tollgate migrate failed (see $RUN/$t.migrate.log)" >&2; exit 1; }
  psql_db "${DB[$t]}" -c "INSERT INTO tollgate_overrides (scope, label, digest, requests, note)
    SELECT 'bench', 'ip', encode(sha256(convert_to('bench-' || i, 'UTF8')), 'hex'), 2000000000, 'bench'
    FROM generate_series(1, $OVERRIDES) AS i" >/dev/null 2>&1 || echo "$t: no overrides table: runs as pg-hot"
}

i=0
for t in "${ORDER[@]}"; do
  [[ $t == nginx || $t == ceiling ]] && continue
  m=${t#*-}
  if [[ $t == base-* ]]; then BIN[$t]=$BASE_BIN; else BIN[$t]=$TOLLGATE_BIN; fi
  port=$((BASE_PORT + 10 + i)); aport=$((BASE_PORT + 30 + i)); i=$((i + 1))
  # The cost-header mode asks where the upstream reports a cost.
  path=/; [[ $m == *cost-header* ]] && path=/cost
  URL[$t]=http://127.0.0.1:$port$path
  [[ $m == *10k* ]] || H2URL[$t]=http://127.0.0.1:$port$path
  ADMIN[$t]=http://127.0.0.1:$aport
  [[ $m == *10k* ]] && LUA[$t]=$HERE/lua/tokens.lua
  [[ $m == pg-flood ]] && EXPECT_DENY[$t]=1
  if [[ $m == pg-* ]]; then DB[$t]=tollgate_bench_${t//-/_}; fi
  CONF[$t]=$RUN/$t.toml
  tollgate_conf "${CONF[$t]}" "$port" "$aport" "$m" "${DB[$t]:-}"
  "${BIN[$t]}" check --config "${CONF[$t]}" >"$RUN/$t.check.log" 2>&1 \
    || { echo "tollgate check refused ${CONF[$t]}:" >&2; cat "$RUN/$t.check.log" >&2; exit 1; }
done

# ---------------------------------------------------------------- environment record
{
  echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "nproc: $(nproc)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
  echo "kernel: $(uname -r)"
  echo "mem: $(free -m | awk '/Mem:/{print $2" MiB"}')"
  echo "nginx: $(nginx -v 2>&1 | sed 's/.*: //')"
  echo "wrk: $(wrk -v 2>&1 | head -1 | cut -d' ' -f1-2)"
  command -v h2load >/dev/null && echo "h2load: $(h2load --version)"
  echo "tollgate: $("$TOLLGATE_BIN" --version 2>&1 | head -1); commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$( [[ -n $(git -C "$ROOT" status --porcelain -- src Cargo.toml Cargo.lock migrations 2>/dev/null) ]] && echo ' + uncommitted changes in src/')"
  [[ -n $BASE_BIN ]] && echo "base (BASE_BIN, targets base-<mode>): $("$BASE_BIN" --version 2>&1 | head -1) at $BASE_BIN"
  echo "tollgate runtime: server.workers=$WORKERS (worker 0 is the main thread)"
  ((NEEDS_PG)) && echo "postgres: $(psql_admin -tAc 'SHOW server_version') at $PG_URL, sslmode=$PG_SSLMODE; DB statements from $STATS_METHOD"
  echo "loadavg_before: $(cat /proc/loadavg)"
  echo "params: RUNS=$RUNS DURATION=${DURATION}s WARMUP=${WARMUP}s CONNS='$CONNS' PROTOS='$PROTOS' H2_STREAMS=$H2_STREAMS wrk -t1 h2load -t1 ACCESS_LOG=$ACCESS_LOG NGINX_ACCESS_LOG=$NGINX_ACCESS_LOG"
  if [[ $PIN == 1 ]]; then echo "pinning: proxy under test on cpu$CPU_PROXY; wrk/h2load and upstream on cpu$CPU_LOAD"; else echo "pinning: none"; fi
  if [[ $PIN == 1 && $PIN_PG == 1 ]]; then echo "pinning: PostgreSQL backends of the mode under load on cpu$CPU_LOAD (PIN_PG=1)"; elif ((NEEDS_PG)); then echo "pinning: PostgreSQL not pinned (PIN_PG=0)"; fi
  echo "targets: ${ORDER[*]}"
} | tee "$OUT/env.txt"

# ---------------------------------------------------------------- start servers
render() {   # render TEMPLATE NAME PORT [H2PORT] -> rendered path
  local dst=$RUN/$2.conf
  local access_log="access_log off;"
  [[ $NGINX_ACCESS_LOG == 1 ]] && access_log="access_log /dev/null combined buffer=64k flush=1s;"
  sed -e "s#{{RUN}}#$RUN#g" -e "s#{{PORT}}#$3#g" -e "s#{{H2PORT}}#${4:-0}#g" \
      -e "s#{{UPSTREAM_PORT}}#$UPSTREAM_PORT#g" -e "s#{{ACCESS_LOG}}#$access_log#g" "$1" >"$dst"
  echo "$dst"
}
need_port "$UPSTREAM_PORT"; need_port "$NGINX_PORT"; need_port "$NGINX_H2_PORT"
conf=$(render "$HERE/conf/upstream.nginx.conf" upstream "$UPSTREAM_PORT")
nginx -t -q -p "$RUN/" -c "$conf"
start_bg upstream $(pin load) nginx -p "$RUN/" -c "$conf"
PIDOF[upstream]=${PIDS[-1]}
wait_200 "http://127.0.0.1:$UPSTREAM_PORT/" 10

conf=$(render "$HERE/conf/proxy.nginx.conf" nginx "$NGINX_PORT" "$NGINX_H2_PORT")
nginx -t -q -p "$RUN/" -c "$conf"
start_bg nginx $(pin proxy) nginx -p "$RUN/" -c "$conf"
PIDOF[nginx]=${PIDS[-1]}
wait_200 "${URL[nginx]}" 10

if [[ $CEILING == 1 ]]; then
  need_port "$CEILING_PORT"
  start_bg ceiling $(pin proxy) "$CEILING_BIN" "127.0.0.1:$CEILING_PORT" "127.0.0.1:$UPSTREAM_PORT"
  PIDOF[ceiling]=${PIDS[-1]}
  wait_200 "${URL[ceiling]}" 10
fi

for t in "${ORDER[@]}"; do
  [[ $t == nginx || $t == ceiling ]] && continue
  port=${URL[$t]%/}; need_port "${port##*:}"; need_port "${ADMIN[$t]##*:}"
  if [[ -n ${DB[$t]:-} ]]; then
    psql_admin -c "DROP DATABASE IF EXISTS ${DB[$t]} WITH (FORCE)" >/dev/null
    psql_admin -c "CREATE DATABASE ${DB[$t]}" >/dev/null
    PG_DBS+=("${DB[$t]}")
    [[ $t == *-pg-hot-overrides ]] && load_overrides "$t"
  fi
  # With ACCESS_LOG=1 everything it logs goes to /dev/null (see ACCESS_LOG above): a start-up
  # failure shows as the readiness wait below giving up, and the same command without
  # ACCESS_LOG says why.
  log_level=warn out=""
  [[ $ACCESS_LOG == 1 ]] && log_level=info out=/dev/null
  # A *-hyper mode: the same configuration served by hyper's HTTP/1.1 code alone. Only those
  # name the stack, so that a BASE_BIN from before `run --http1` measures the other modes.
  http1=()
  [[ $m == *-hyper ]] && http1=(--http1 hyper)
  BG_OUT=$out start_bg "$t" env -u TOLLGATE_DATABASE_URL -u TOLLGATE_CONFIG RUST_LOG=$log_level \
    $(pin proxy) "${BIN[$t]}" --config "${CONF[$t]}" run "${http1[@]}"
  PIDOF[$t]=${PIDS[-1]}
done
for t in "${ORDER[@]}"; do
  [[ $t == nginx || $t == ceiling ]] && continue
  wait_200 "${ADMIN[$t]}/readyz" 30
  if [[ -n ${EXPECT_DENY[$t]:-} ]]; then
    curl -s -o /dev/null --max-time 2 "${URL[$t]}" || true
  else
    wait_200 "${URL[$t]}" 10
  fi
  echo "ready: $t ${URL[$t]} (pid ${PIDOF[$t]}, $(ls /proc/"${PIDOF[$t]}"/task | wc -l) threads; affinity $(taskset -cp "${PIDOF[$t]}" | sed 's/.*: //'))" | tee -a "$OUT/env.txt"
done
metric_names=(tollgate_store_round_trips_total tollgate_store_errors_total)
for t in "${ORDER[@]}"; do
  if [[ -n ${DB[$t]:-} ]]; then
    sleep "$PG_STATS_WAIT"   # let start-up statements reach the statistics first
    break
  fi
done
for t in "${ORDER[@]}"; do [[ -n ${DB[$t]:-} ]] && DBSNAP[$t]=$(db_snap "${DB[$t]}"); done

# ---------------------------------------------------------------- load
TSV=$OUT/runs.tsv
printf 'rep\tproto\tconns\ttarget\trps\tp50_us\tp99_us\trequests\tnon2xx\terrors\twarm_requests\tdb_stmts\tdb_rows\tstore_calls\tstore_errors\trss_kib\tcpu_busy\n' >"$TSV"
BOUND=$((DURATION + 30))

load_cmd() {   # load_cmd PROTO CONNS TARGET SECONDS LOGFILE -> runs the load tool
  local proto=$1 c=$2 t=$3 d=$4 log=$5
  if [[ $proto == h1 ]]; then
    local lua=()
    [[ -n ${LUA[$t]:-} ]] && lua=(-s "${LUA[$t]}")
    timeout "$BOUND" $(pin load) wrk -t1 -c"$c" -d"${d}s" --latency --timeout 5s "${lua[@]}" "${URL[$t]}"
  else
    timeout "$BOUND" $(pin load) h2load -t1 -c"$c" -m"$H2_STREAMS" -D "$d" --log-file="$log" "${H2URL[$t]}"
  fi
}

run_one() {   # run_one PROTO CONNS TARGET REP
  local proto=$1 c=$2 t=$3 rep=$4 base f warm vals m0 m1 cpu0 cpu1 busy rss
  local wreq=0 stm=NA rows=NA calls=NA serr=NA
  base=$OUT/raw/$proto-c$c-$t-rep$rep
  f=$base.txt
  [[ -n ${ADMIN[$t]:-} ]] && m0=$($LIB metric "${ADMIN[$t]}/metrics" "${metric_names[@]}")
  check_alive
  if ((WARMUP > 0)); then
    load_cmd "$proto" "$c" "$t" "$WARMUP" "$RUN/warm.h2log" >"$base.warmup.txt" 2>&1 \
      || { echo "warm-up failed for $t (see $base.warmup.txt)" >&2; tail "$base.warmup.txt" >&2; exit 1; }
    wreq=$($LIB count "$base.warmup.txt")
  fi
  local pinner=""
  if [[ -n ${DB[$t]:-} && $PIN == 1 && $PIN_PG == 1 ]]; then
    pin_backends_during "${DB[$t]}" & pinner=$!
  fi
  cpu0=$($LIB cpu-snap)
  load_cmd "$proto" "$c" "$t" "$DURATION" "$RUN/run.h2log" >"$f" 2>&1 \
    || { [[ -n $pinner ]] && kill "$pinner"; echo "$proto load failed for $t (see $f)" >&2; tail "$f" >&2; exit 1; }
  cpu1=$($LIB cpu-snap)
  if [[ -n $pinner ]]; then kill "$pinner" 2>/dev/null; wait "$pinner" 2>/dev/null || true; fi
  busy=$($LIB cpu-busy "$cpu0" "$cpu1")
  if [[ $proto == h1 ]]; then vals=$($LIB parse-wrk "$f"); else vals=$($LIB parse-h2load "$f" "$RUN/run.h2log"); fi
  rss=$($LIB rss "${PIDOF[$t]}")
  if [[ -n ${ADMIN[$t]:-} ]]; then
    m1=$($LIB metric "${ADMIN[$t]}/metrics" "${metric_names[@]}")
    calls=$(awk -v a="$(cut -f1 <<<"$m0")" -v b="$(cut -f1 <<<"$m1")" 'BEGIN{print (a=="NA"||b=="NA")?"NA":b-a}')
    serr=$(awk -v a="$(cut -f2 <<<"$m0")" -v b="$(cut -f2 <<<"$m1")" 'BEGIN{print (a=="NA"||b=="NA")?"NA":b-a}')
  fi
  if [[ -n ${DB[$t]:-} ]]; then
    sleep "$PG_STATS_WAIT"
    local now; now=$(db_snap "${DB[$t]}")
    read -r s0 r0 <<<"${DBSNAP[$t]}"; read -r s1 r1 <<<"$now"
    stm=$((s1 - s0)); rows=$((r1 - r0)); DBSNAP[$t]=$now
  fi
  rm -f "$RUN/warm.h2log" "$RUN/run.h2log"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$rep" "$proto" "$c" "$t" "$vals" "$wreq" \
    "$stm" "$rows" "$calls" "$serr" "$rss" "$busy" >>"$TSV"
  local rps non2xx errs
  rps=$(cut -f1 <<<"$vals"); non2xx=$(cut -f5 <<<"$vals"); errs=$(cut -f6 <<<"$vals")
  printf 'round %d %s c=%-4s %-22s req/s=%-7s p50=%sus p99=%sus non2xx=%s err=%s db_stmts=%s store_calls=%s rss=%sKiB cpu0/1=%s%%\n' \
    "$rep" "$proto" "$c" "$t" "$rps" "$(cut -f2 <<<"$vals")" "$(cut -f3 <<<"$vals")" "$non2xx" "$errs" "$stm" "$calls" "$rss" "$busy"
  if [[ -z ${EXPECT_DENY[$t]:-} ]] && ((non2xx + errs > 0)); then
    echo "round $rep $proto c=$c $t: $non2xx non-2xx and $errs errors where none were expected" | tee -a "$OUT/warnings.txt"
  fi
  if [[ $serr != NA && $serr != 0 ]]; then
    echo "round $rep $proto c=$c $t: $serr store errors (requests let through uncounted: on_error = allow)" | tee -a "$OUT/warnings.txt"
  fi
  sleep "$PAUSE"
}

n=${#ORDER[@]}
for ((rep = 1; rep <= RUNS; rep++)); do
  rot=(); for ((k = 0; k < n; k++)); do rot+=("${ORDER[$(((k + rep - 1) % n))]}"); done
  for c in $CONNS; do
    for proto in $PROTOS; do
      for t in "${rot[@]}"; do
        [[ $proto == h2 && -z ${H2URL[$t]:-} ]] && continue
        run_one "$proto" "$c" "$t" "$rep"
      done
    done
  done
done
echo "loadavg_after_load: $(cat /proc/loadavg)" >>"$OUT/env.txt"
stop_all

# ---------------------------------------------------------------- keep-alive soak (RSS)
if [[ $SOAK == 1 ]]; then
  echo "keep-alive soak: $SOAK_CONNS connections, ${SOAK_SECONDS}s, one request per connection every ${SOAK_INTERVAL}s"
  need_port "$UPSTREAM_PORT"; need_port "$SOAK_PORT"; need_port "$SOAK_ADMIN_PORT"
  conf=$(render "$HERE/conf/upstream.nginx.conf" upstream "$UPSTREAM_PORT")
  start_bg upstream $(pin load) nginx -p "$RUN/" -c "$conf"
  wait_200 "http://127.0.0.1:$UPSTREAM_PORT/" 10
  tollgate_conf "$RUN/tollgate-soak.toml" "$SOAK_PORT" "$SOAK_ADMIN_PORT" memory
  start_bg tollgate-soak env -u TOLLGATE_DATABASE_URL -u TOLLGATE_CONFIG RUST_LOG=warn \
    $(pin proxy) "$TOLLGATE_BIN" --config "$RUN/tollgate-soak.toml" run
  soak_pid=${PIDS[-1]}
  wait_200 "http://127.0.0.1:$SOAK_ADMIN_PORT/readyz" 30
  sleep 1
  timeout $((${SOAK_SECONDS%.*} + 120)) $(pin load) python3 "$HERE/lib/keepalive_soak.py" --port "$SOAK_PORT" \
    --pid "$soak_pid" --connections "$SOAK_CONNS" --seconds "$SOAK_SECONDS" --interval "$SOAK_INTERVAL" \
    --out "$OUT/soak.json" --metrics-url "http://127.0.0.1:$SOAK_ADMIN_PORT/metrics" | tee "$OUT/soak.txt"
  stop_all
fi

write_summary "$OUT"
cat "$OUT/summary.md"
exit 0
}

#!/usr/bin/env bash
# bench/cpu_split.sh - where the CPU time of one request goes, per process: nginx and
# tollgate as proxies, and tollgate's memory and Postgres modes (HTTP/1.1).
#
# bench/run.sh shows how busy each CPU is; this says who keeps it busy. For each MODE it starts
# the proxy (one worker, pinned to CPU_PROXY), loads it with wrk (pinned to CPU_LOAD, with the
# upstream and, for the Postgres modes, the database backends, as in bench/run.sh), and reads
# the CPU time (from /proc) that each took during the run: the proxy (user and system apart),
# every PostgreSQL server process, the upstream's worker and wrk. Printed per request, in µs,
# with how busy that made CPU_LOAD. The modes and their limits are those of bench/run.sh:
#   nginx       nginx as the reverse proxy (bench/conf/proxy.nginx.conf)
#   nolimit     tollgate, a route without limits
#   memory      memory store, one `ip` limit (one hot key)
#   pg-hot      PostgreSQL store, the same limit
#   memory-10k  memory store, `header:authorization` limit, 10,000 tokens (bench/lua/tokens.lua)
#   pg-10k      PostgreSQL store, the same limit and tokens
#   pg-hot-sliding, pg-10k-sliding
#               as pg-hot and pg-10k with `algorithm = "sliding"` (contract §3a); not in the default
#               MODES (issue 18: what a sliding row costs the database per request)
#   nolimit-hyper, memory-hyper
#               nolimit and memory served by hyper's HTTP/1.1 server and client alone
#               (`tollgate run --http1 hyper`); not in the default MODES
#
# Usage: [KNOB=value ...] bench/cpu_split.sh
# Knobs: MODES ["nginx nolimit memory pg-hot memory-10k pg-10k"] ROUNDS [2] (the modes in turn,
#        each round; one line per mode and round) CONNS [32] DURATION [6] s WARMUP [2] s
#        CPU_PROXY [1] CPU_LOAD [0] BASE_PORT [19500]
#        PG_URL [postgres://postgres@127.0.0.1:5432] (loopback; creates and drops databases
#        tollgate_cpu_<mode>)   BUILD [1]   TOLLGATE_BIN [target/release/tollgate]
#        PG_SSLMODE [disable] (the store URL's sslmode; bench/lib/pg.sh)
# Needs: nginx, wrk, psql, taskset (apt-get install -y nginx wrk).
set -euo pipefail
{
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
MODES=${MODES:-nginx nolimit memory pg-hot memory-10k pg-10k}
ROUNDS=${ROUNDS:-2}
CONNS=${CONNS:-32}
DURATION=${DURATION:-6}
WARMUP=${WARMUP:-2}
CPU_PROXY=${CPU_PROXY:-1}
CPU_LOAD=${CPU_LOAD:-0}
BASE_PORT=${BASE_PORT:-19500}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
BUILD=${BUILD:-1}
TOLLGATE_BIN=${TOLLGATE_BIN:-$ROOT/target/release/tollgate}
export RUST_LOG=warn
unset TOLLGATE_DATABASE_URL TOLLGATE_CONFIG
UP=$BASE_PORT; PX=$((BASE_PORT + 1)); PX_H2=$((BASE_PORT + 2)); ADMIN=$((BASE_PORT + 3))

for tool in nginx wrk psql taskset curl python3; do
  command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install -y nginx wrk postgresql-client)" >&2; exit 1; }
done
source "$HERE/lib/pg.sh"
require_loopback_pg_url

RUN=$(mktemp -d /tmp/tollgate-cpu-split.XXXXXX); chmod 755 "$RUN"
mkdir -p "$RUN/nginx_tmp"
source "$HERE/lib/procs.sh"
cleanup_on_exit

if [[ $BUILD == 1 ]]; then (cd "$ROOT" && cargo build --release --quiet); fi
render "$HERE/conf/upstream.nginx.conf" "$UP" >"$RUN/upstream.conf"
render "$HERE/conf/proxy.nginx.conf" "$PX" >"$RUN/nginx.conf"
taskset -c "$CPU_LOAD" nginx -p "$RUN/" -c "$RUN/upstream.conf" >"$RUN/upstream.out" 2>&1 &
PIDS+=("$!")
wait_200 "http://127.0.0.1:$UP/" 10
upstream_worker=$(pgrep -P "$(cat "$RUN/upstream.pid")" | head -1)

# user_system PID: "user system" clock ticks of one process
user_system() { awk '{print $14, $15}' "/proc/$1/stat"; }
# ticks PID...: user+system clock ticks of the processes (those gone since count 0)
ticks() {
  local sum=0 pid
  for pid in "$@"; do
    [[ -r /proc/$pid/stat ]] && sum=$((sum + $(awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null || echo 0)))
  done
  echo "$sum"
}
postgres_pids() { pgrep -u postgres postgres || true; }
# statements: tollgate's store statements so far (tollgate_store_round_trips_total), 0 for nginx
statements() {
  curl -fsS "http://127.0.0.1:$ADMIN/metrics" 2>/dev/null |
    awk '/^tollgate_store_round_trips_total/ {n = $2} END {print n + 0}'
}

hz=$(getconf CLK_TCK)
echo "CPU per request (user + system, µs), wrk -t1 -c$CONNS -d${DURATION}s; tollgate on CPU $CPU_PROXY, the rest on CPU $CPU_LOAD"
echo "(stmt/req: statements sent to the store per request; a hot bucket's statements follow its round trip)"
printf '%-5s %-11s %9s %11s %11s %9s %9s %9s %12s %9s %9s\n' round mode "req/s" "proxy user" "proxy sys" postgres upstream wrk "cpu$CPU_LOAD total" "cpu$CPU_LOAD busy" "stmt/req"
for round in $(seq "$ROUNDS"); do
for mode in $MODES; do
  case ${mode%-hyper} in
    nginx | nolimit) key=""; script=() ;;
    memory | pg-hot | pg-hot-sliding) key=ip; script=() ;;
    memory-10k | pg-10k | pg-10k-sliding) key=header:authorization; script=(-s "$HERE/lua/tokens.lua") ;;
    *) echo "unknown mode $mode" >&2; exit 1 ;;
  esac
  db=""
  {
    tollgate_config_head "$PX" "$ADMIN"
    if [[ $mode == pg-* ]]; then
      db=tollgate_cpu_${mode//-/_}
      psql_admin -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" >/dev/null
      store_section "$db"
    fi
    printf '[[routes]]\nname = "bench"\nupstream = "app"\n'
    if [[ -n $key ]]; then
      printf '  [[routes.limits]]\n  key = "%s"\n  requests = 2000000000\n  window = "1h"\n' "$key"
      if [[ $mode == *-sliding ]]; then printf '  algorithm = "sliding"\n'; fi
    fi
  } >"$RUN/$mode.toml"
  if [[ $mode == nginx ]]; then
    taskset -c "$CPU_PROXY" nginx -p "$RUN/" -c "$RUN/nginx.conf" >"$RUN/$mode.log" 2>&1 &
  else
    # A *-hyper mode is served by hyper's HTTP/1.1 code alone (`run --http1 hyper`).
    http1=()
    [[ $mode == *-hyper ]] && http1=(--http1 hyper)
    taskset -c "$CPU_PROXY" "$TOLLGATE_BIN" --config "$RUN/$mode.toml" run "${http1[@]}" >"$RUN/$mode.log" 2>&1 &
  fi
  started=$!
  PIDS+=("$started")
  wait_200 "http://127.0.0.1:$PX/" 30
  # nginx does its work in its worker process; tollgate in its one process.
  proxy_pid=$started
  if [[ $mode == nginx ]]; then proxy_pid=$(pgrep -P "$started" | head -1); fi
  taskset -c "$CPU_LOAD" wrk -t1 -c"$CONNS" -d"${WARMUP}s" "${script[@]}" "http://127.0.0.1:$PX/" >/dev/null
  if [[ -n $db ]]; then pin_backends "$db"; fi
  mapfile -t pg < <(postgres_pids)
  read -r tu0 ts0 < <(user_system "$proxy_pid"); pg0=$(ticks "${pg[@]}"); up0=$(ticks "$upstream_worker"); st0=$(statements)
  # Pool connections opened during the run are pinned too, as bench/run.sh does.
  pinner=""
  if [[ -n $db ]]; then pin_backends_during "$db" & pinner=$!; fi
  out=$( { /usr/bin/time -f "wrk_cpu %U %S" taskset -c "$CPU_LOAD" wrk -t1 -c"$CONNS" -d"${DURATION}s" "${script[@]}" "http://127.0.0.1:$PX/"; } 2>&1 )
  if [[ -n $pinner ]]; then kill "$pinner"; wait "$pinner" 2>/dev/null || true; fi
  mapfile -t pg_after < <(postgres_pids)
  read -r tu1 ts1 < <(user_system "$proxy_pid"); pg1=$(ticks "${pg_after[@]}"); up1=$(ticks "$upstream_worker"); st1=$(statements)
  requests=$(awk '/requests in/ {print $1}' <<<"$out")
  rate=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
  read -r _ wrk_user wrk_sys < <(grep wrk_cpu <<<"$out")
  awk -v r="$round" -v m="$mode" -v rate="$rate" -v n="$requests" -v hz="$hz" -v d="$DURATION" \
      -v tu=$((tu1 - tu0)) -v ts=$((ts1 - ts0)) -v pg=$((pg1 - pg0)) -v up=$((up1 - up0)) -v st=$((st1 - st0)) -v wu="$wrk_user" -v ws="$wrk_sys" 'BEGIN {
    per = 1e6 / hz / n; w = (wu + ws) * 1e6 / n; load = pg * per + up * per + w
    printf "%-5s %-11s %9.0f %11.1f %11.1f %9.1f %9.1f %9.1f %12.1f %8.0f%% %9.3f\n", r, m, rate, tu * per, ts * per, pg * per, up * per, w, load, load * n / 1e6 / d * 100, st / n
  }'
  kill -TERM "$started" 2>/dev/null || true; wait "$started" 2>/dev/null || true
  unset 'PIDS[-1]'
  if [[ -n $db ]]; then
    psql_admin -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
  fi
done
done
}

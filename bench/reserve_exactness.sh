#!/usr/bin/env bash
# bench/reserve_exactness.sh - the exactness bound of reserved shares (contract §3c), measured:
# INSTANCES tollgate processes on one database and one `global` bucket of REQUESTS per hour with
# `reserve = true`, driven to the end of the budget by bench/lib/exactness.py (round robin over
# the instances, about RATE requests per second in all).
#
#   phase "all live"  how many were admitted (must be exactly REQUESTS), how many requests were
#                     denied while units were still left on another instance ("denied early":
#                     before the last admission), and for how long (first denial to last
#                     admission: the time the give-backs took)
#   phase "one dies"  the same after the first instance took a share and was killed (SIGKILL):
#                     what its unused units cost the others (REQUESTS minus what was admitted),
#                     next to its tollgate_reserved_units just before the kill
#
# Usage: [KNOB=value ...] bench/reserve_exactness.sh
# Knobs: INSTANCES [3] REQUESTS [3000] RATE [3000] req/s, ALGORITHM [fixed] BASE_PORT [19800]
#        TOLLGATE_BIN [target/release/tollgate] CPU_PROXY [1] CPU_LOAD [0]
#        PG_URL [postgres://postgres@127.0.0.1:5432] (loopback; creates and drops databases
#        tollgate_exact_<phase>)   PG_SSLMODE [disable] (bench/lib/pg.sh)
# Needs: nginx, psql, taskset, curl, python3.
set -euo pipefail
{
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
INSTANCES=${INSTANCES:-3}
REQUESTS=${REQUESTS:-3000}
RATE=${RATE:-3000}
ALGORITHM=${ALGORITHM:-fixed}
BASE_PORT=${BASE_PORT:-19800}
TOLLGATE_BIN=${TOLLGATE_BIN:-$HERE/../target/release/tollgate}
CPU_PROXY=${CPU_PROXY:-1}
CPU_LOAD=${CPU_LOAD:-0}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
export RUST_LOG=warn
unset TOLLGATE_DATABASE_URL TOLLGATE_CONFIG
UP=$BASE_PORT; PX_H2=0

for tool in nginx psql taskset curl python3; do
  command -v "$tool" >/dev/null || { echo "missing $tool" >&2; exit 1; }
done
[[ -x $TOLLGATE_BIN ]] || { echo "no tollgate binary at $TOLLGATE_BIN (cargo build --release)" >&2; exit 1; }
source "$HERE/lib/pg.sh"
require_loopback_pg_url
RUN=$(mktemp -d /tmp/tollgate-exactness.XXXXXX); chmod 755 "$RUN"
mkdir -p "$RUN/nginx_tmp"
source "$HERE/lib/procs.sh"
cleanup_on_exit

render "$HERE/conf/upstream.nginx.conf" "$UP" >"$RUN/upstream.conf"
taskset -c "$CPU_LOAD" nginx -p "$RUN/" -c "$RUN/upstream.conf" >"$RUN/upstream.out" 2>&1 &
PIDS+=("$!")
wait_200 "http://127.0.0.1:$UP/" 10

start_instances() {   # start_instances DB -> INSTANCE_PIDS, PORTS (comma-separated)
  local db=$1 i port admin
  psql_admin -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db" >/dev/null
  INSTANCE_PIDS=(); PORTS=""
  for ((i = 0; i < INSTANCES; i++)); do
    port=$((BASE_PORT + 10 + i)); admin=$((BASE_PORT + 30 + i))
    {
      tollgate_config_head "$port" "$admin"
      store_section "$db" | sed 's/timeout = "100ms"/timeout = "2s"/'
      printf '[[routes]]\nname = "bench"\nupstream = "app"\n'
      printf '  [[routes.limits]]\n  key = "global"\n  requests = %s\n  window = "1h"\n  algorithm = "%s"\n  reserve = true\n' \
        "$REQUESTS" "$ALGORITHM"
    } >"$RUN/$db-$i.toml"
    taskset -c "$CPU_PROXY" "$TOLLGATE_BIN" --config "$RUN/$db-$i.toml" run >"$RUN/$db-$i.log" 2>&1 &
    PIDS+=("$!"); INSTANCE_PIDS+=("$!")
    PORTS+="${PORTS:+,}$port"
  done
  for ((i = 0; i < INSTANCES; i++)); do
    wait_200 "http://127.0.0.1:$((BASE_PORT + 30 + i))/readyz" 30
    # Each instance hears the others' reclaims before the load (its LISTEN check came back),
    # and counts every instance live (the registry's refresh, every 3 s): share sizes divide by
    # that count.
    until curl -fsS "http://127.0.0.1:$((BASE_PORT + 30 + i))/metrics" \
        | grep -x -e 'tollgate_reset_listener_up 1' -e "tollgate_instances $INSTANCES" | wc -l | grep -qx 2; do
      sleep 0.2
    done
  done
}
stop_instances() {
  local pid
  for pid in "${INSTANCE_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
}

echo "$INSTANCES instances, one global bucket of $REQUESTS per hour ($ALGORITHM, reserve = true), about $RATE req/s"
echo
echo "phase: all live"
start_instances tollgate_exact_live
taskset -c "$CPU_LOAD" python3 "$HERE/lib/exactness.py" --ports "$PORTS" --rate "$RATE" | tee "$RUN/live.json"
stop_instances
echo "row count after every instance stopped: $(psql_db tollgate_exact_live -tAc "SELECT coalesce(sum(count), 0) FROM rate_limits")"

echo
echo "phase: one dies holding a share"
start_instances tollgate_exact_dies
first=${PORTS%%,*}; rest=${PORTS#*,}
for ((k = 0; k < REQUESTS / 20; k++)); do curl -s -o /dev/null "http://127.0.0.1:$first/"; done
sleep 0.5   # tollgate_reserved_units is brought up to date every 250 ms
held=$(curl -fsS "http://127.0.0.1:$((BASE_PORT + 30))/metrics" | awk '$1 == "tollgate_reserved_units" {print $2}')
kill -KILL "${INSTANCE_PIDS[0]}"; wait "${INSTANCE_PIDS[0]}" 2>/dev/null || true
echo "killed the first instance after it admitted $((REQUESTS / 20)), holding $held unused units"
taskset -c "$CPU_LOAD" python3 "$HERE/lib/exactness.py" --ports "$rest" --rate "$RATE" | tee "$RUN/dies.json"
python3 - "$RUN/dies.json" "$REQUESTS" "$((REQUESTS / 20))" "$held" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); total = int(sys.argv[2]); before = int(sys.argv[3]); held = float(sys.argv[4])
lost = total - before - d["admitted"]
print(f"admitted in all: {before + d['admitted']} of {total}; lost with the dead instance: {lost} (it held {held:.0f})")
PY
stop_instances
for db in tollgate_exact_live tollgate_exact_dies; do psql_admin -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null; done
exit 0
}

#!/usr/bin/env bash
# bench/pg_instructions.sh - instructions PostgreSQL executes per decision, tollgate builds
# side by side.
#
# cpu_split.sh reads the database's CPU time per request, which moves by 10-20% on this
# shared VM from one minute to the next. An instruction count does not. This starts a
# throwaway cluster (initdb in $RUN, port PG_PORT, fsync and autovacuum off) with the
# postmaster under valgrind's callgrind, which follows the backends it forks; each backend
# writes its counts when it exits. For every binary of TOLLGATE_BINS and every MODE, tollgate
# (natively, pool_size = 1, a fresh database) serves N requests one at a time with h2load, so
# every request is its own statement, and is stopped; the Ir of the backends that served it
# are summed. Done for N = N1 and N = N2, (Ir(N2) - Ir(N1)) / (N2 - N1) is the database's cost
# of one decision with start-up, migrations and the first statements taken out. Modes:
#   pg-hot          one `ip` limit (fixed window), one hot bucket
#   pg-hot-sliding  the same with `algorithm = "sliding"` (contract §3a)
#   pg-hot-two      the `ip` limit and a `global` one on the same route: a request with two
#                   enforced limits, decided together (contract §3d: one that denies takes
#                   nothing from the other)
# The backends' callgrind files stay in OUT (callgrind_annotate them, or diff two builds:
# the largest file of a run is the decision connection's).
#
# Usage: [KNOB=value ...] bench/pg_instructions.sh
# Knobs: TOLLGATE_BINS [target/release/tollgate] (several, space-separated: the first is the
#        baseline of the ratios)   MODES ["pg-hot"]   N1 [300]   N2 [1500]
#        PG_PORT [55433]   BASE_PORT [19600]   BUILD [1]
#        OUT [bench/results/pg-instructions-<UTC timestamp>]
# Needs: valgrind, nginx, h2load, PostgreSQL's server binaries (initdb, postgres), psql; run
# as root (the cluster runs as `postgres`) or as the user that owns the cluster.
set -euo pipefail
{
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
TOLLGATE_BINS=${TOLLGATE_BINS:-$ROOT/target/release/tollgate}
MODES=${MODES:-pg-hot}
N1=${N1:-300}
N2=${N2:-1500}
PG_PORT=${PG_PORT:-55433}
BASE_PORT=${BASE_PORT:-19600}
BUILD=${BUILD:-1}
OUT=${OUT:-$HERE/results/pg-instructions-$(date -u +%Y%m%dT%H%M%SZ)}
export RUST_LOG=warn
unset TOLLGATE_DATABASE_URL TOLLGATE_CONFIG
UP=$BASE_PORT; PX=$((BASE_PORT + 1)); PX_H2=$((BASE_PORT + 2))
((N2 > N1)) || { echo "N2 must be larger than N1" >&2; exit 1; }

for tool in valgrind callgrind_annotate nginx h2load psql curl; do
  command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install -y valgrind nginx nghttp2-client postgresql-client)" >&2; exit 1; }
done
PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[[ -x $PG_BIN/postgres && -x $PG_BIN/initdb ]] || { echo "no PostgreSQL server binaries under /usr/lib/postgresql" >&2; exit 1; }
as_owner() { if [[ $(id -u) == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi; }

RUN=$(mktemp -d /tmp/tollgate-pg-instructions.XXXXXX); chmod 755 "$RUN"
mkdir -p "$RUN/nginx_tmp" "$RUN/cg" "$OUT"
source "$HERE/lib/procs.sh"
cleanup_on_exit
# The cluster first: its data folder is in $RUN.
# Its processes write their callgrind files as they exit, a moment after pg_ctl returns.
trap 'rc=$?; as_owner "$PG_BIN/pg_ctl" -D "$RUN/cg/data" stop -m fast >/dev/null 2>&1 || true; stop_started
  for _ in 1 2 3 4 5 6 7 8 9 10; do rm -rf "$RUN" 2>/dev/null && break; sleep 0.5; done; exit "$rc"' EXIT
if [[ $(id -u) == 0 ]]; then chown postgres "$RUN/cg"; fi

if [[ $BUILD == 1 ]]; then (cd "$ROOT" && cargo build --release --quiet); fi
render "$HERE/conf/upstream.nginx.conf" "$UP" >"$RUN/upstream.conf"
nginx -p "$RUN/" -c "$RUN/upstream.conf" >"$RUN/upstream.out" 2>&1 &
PIDS+=("$!")
wait_200 "http://127.0.0.1:$UP/" 10

as_owner mkdir "$RUN/cg/data"
as_owner "$PG_BIN/initdb" -D "$RUN/cg/data" -A trust -U postgres >"$RUN/initdb.log"
cat >>"$RUN/cg/data/postgresql.conf" <<EOF
port = $PG_PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$RUN/cg'
fsync = off
autovacuum = off
EOF
# --vgdb=no: valgrind's gdbserver FIFOs do not survive the postmaster's forks.
as_owner valgrind --tool=callgrind --vgdb=no --trace-children=yes \
  --callgrind-out-file="$RUN/cg/backend.%p" "$PG_BIN/postgres" -D "$RUN/cg/data" >"$RUN/postgres.log" 2>&1 &
PIDS+=("$!")
PG=postgres://postgres@127.0.0.1:$PG_PORT
deadline=$((SECONDS + 60))
until psql "$PG/postgres" -XtAc 'SELECT 1' >/dev/null 2>&1; do
  ((SECONDS < deadline)) || { echo "the cluster under valgrind did not start" >&2; tail "$RUN/postgres.log" >&2; exit 1; }
  sleep 0.5
done

# backend_ir FILE: its instruction total
backend_ir() { callgrind_annotate "$1" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); t = $1} END {print t + 0}'; }

# served BIN MODE N: sets SERVED to the Ir of the backends that served N requests of one
# tollgate run (a global, not output: in a subshell the EXIT trap would not stop tollgate)
served() {
  local bin=$1 mode=$2 n=$3 label db mark tg total=0 f
  label=$(basename "$bin")
  db=cg_${mode//-/_}
  psql "$PG/postgres" -Xq -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db" >/dev/null 2>&1
  sleep 2 # the backend of those statements exits and writes its file before the mark
  mark=$RUN/mark; touch "$mark"
  {
    tollgate_config_head "$PX"
    printf '[store]\nurl = "%s/%s?sslmode=disable"\npool_size = 1\ntimeout = "10s"\non_error = "deny"\nmigrate = true\nsynchronous_commit = "off"\n\n' "$PG" "$db"
    printf '[[routes]]\nname = "bench"\nupstream = "app"\n'
    printf '  [[routes.limits]]\n  key = "ip"\n  requests = 2000000000\n  window = "1h"\n'
    if [[ $mode == *-sliding ]]; then printf '  algorithm = "sliding"\n'; fi
    if [[ $mode == *-two ]]; then printf '  [[routes.limits]]\n  key = "global"\n  requests = 2000000000\n  window = "1h"\n'; fi
  } >"$RUN/tollgate.toml"
  # An older build may not know the mode's settings (sliding came with SPEC revision 2).
  if ! "$bin" --config "$RUN/tollgate.toml" check >"$RUN/check.log" 2>&1; then
    SERVED=""
    return
  fi
  "$bin" --config "$RUN/tollgate.toml" run >"$RUN/tollgate.log" 2>&1 &
  tg=$!
  PIDS+=("$tg")
  wait_200 "http://127.0.0.1:$PX/" 120
  h2load --h1 -n "$n" -c 1 -m 1 "http://127.0.0.1:$PX/" >"$RUN/h2load.txt"
  grep -q "$n succeeded" "$RUN/h2load.txt" || { echo "$label $mode: not every request succeeded" >&2; cat "$RUN/h2load.txt" "$RUN/tollgate.log" >&2; exit 1; }
  kill -TERM "$tg"; wait "$tg" 2>/dev/null || true
  unset 'PIDS[-1]'
  sleep 3 # the pool's backends exit and write their files
  mkdir -p "$OUT/$label.$mode.$n"
  while IFS= read -r f; do
    total=$((total + $(backend_ir "$f")))
    mv "$f" "$OUT/$label.$mode.$n/"
  done < <(find "$RUN/cg" -maxdepth 1 -name 'backend.*' -newer "$mark")
  SERVED=$total
}

say() { printf "$@" | tee -a "$OUT/summary.txt"; }
say '%s\n' "PostgreSQL instructions per decision (callgrind, user space), one request at a time:"
say '%s\n' "(Ir($N2 requests) - Ir($N1 requests)) / $((N2 - N1)); $("$PG_BIN/postgres" --version)"
say '%-28s %-15s %12s %10s\n' binary mode "Ir/decision" "x first"
for mode in $MODES; do
  base=""
  for bin in $TOLLGATE_BINS; do
    served "$bin" "$mode" "$N1"; a=$SERVED
    if [[ -z $a ]]; then
      say '%-28s %-15s %12s %10s\n' "$(basename "$bin")" "$mode" "-" "(its check refuses the mode's config)"
      continue
    fi
    served "$bin" "$mode" "$N2"; b=$SERVED
    per=$(((b - a) / (N2 - N1)))
    base=${base:-$per}
    say '%-28s %-15s %12s %10s\n' "$(basename "$bin")" "$mode" "$per" "$(python3 -c "print(f'{$per / $base:.3f}')")"
  done
done
}

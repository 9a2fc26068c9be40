#!/usr/bin/env bash
# bench/statement_instructions.sh - PostgreSQL instructions per execution of the increment
# statements, one backend at a time, without tollgate.
#
# bench/pg_instructions.sh sums every backend of a tollgate run, the listen and registry
# sessions included, whose work per second (not per request) moves its figures. This counts
# one psql session's backend only: a throwaway cluster (initdb in a temporary folder, port
# PG_PORT, fsync and autovacuum off, migrations/ applied) runs under callgrind; for each
# STATEMENT a session PREPAREs it and EXECUTEs it N1 times, another N2 times, on one hot
# bucket far from its limit, and (Ir(N2) - Ir(N1)) / (N2 - N1) is printed. Each EXECUTE is
# sent as simple-protocol text, so every figure includes its parse; compare the rows.
# Statements:
#   upsert     the seed's plain upsert, uncapped (what a direct connection sent before
#              contract §3d's rule for fixed windows)
#   fixed      FIXED_UPSERT_SQL, read from src/store/postgres/statements.rs (capped)
#   function   the call of tollgate_increment, the 0008 overload (a pooler's statement)
#   function5  the call of the 0005 overload (uncapped, kept for the previous release)
#   upsert2    the plain upsert of two fixed rows (a request with two limits, uncapped)
#   decide2    the call of tollgate_decide for one request with two fixed limits that fit
#
# Usage: [KNOB=value ...] bench/statement_instructions.sh
# Knobs: STATEMENTS ["upsert fixed function function5 upsert2 decide2"] N1 [100] N2 [600]
#        PG_PORT [55499]
# Needs: valgrind, PostgreSQL's server binaries (initdb, postgres), psql, python3; run as
# root (the cluster runs as `postgres`) or as the user that owns the cluster.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
STATEMENTS=${STATEMENTS:-"upsert fixed function function5 upsert2 decide2"}
N1=${N1:-100}
N2=${N2:-600}
PG_PORT=${PG_PORT:-55499}
PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[[ -x $PG_BIN/postgres && -x $PG_BIN/initdb ]] || { echo "no PostgreSQL server binaries under /usr/lib/postgresql" >&2; exit 1; }
as_owner() { if [[ $(id -u) == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi; }

RUN=$(mktemp -d /tmp/tollgate-statement-instructions.XXXXXX); chmod 755 "$RUN"
[[ $(id -u) == 0 ]] && chown postgres "$RUN"
trap 'as_owner "$PG_BIN/pg_ctl" -D "$RUN/data" stop -m fast >/dev/null 2>&1 || true; rm -rf "$RUN"' EXIT
as_owner "$PG_BIN/initdb" -D "$RUN/data" -A trust -U postgres >/dev/null
printf "port = %s\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '%s'\nfsync = off\nautovacuum = off\n" \
  "$PG_PORT" "$RUN" | as_owner tee -a "$RUN/data/postgresql.conf" >/dev/null
as_owner valgrind --tool=callgrind --vgdb=no --trace-children=yes \
  --callgrind-out-file="$RUN/backend.%p" "$PG_BIN/postgres" -D "$RUN/data" >"$RUN/postgres.log" 2>&1 &
PSQL=(psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -X -q -v ON_ERROR_STOP=1 postgres)
deadline=$((SECONDS + 60))
until "${PSQL[@]}" -c 'SELECT 1' >/dev/null 2>&1; do
  ((SECONDS < deadline)) || { echo "the cluster under valgrind did not start" >&2; exit 1; }
  sleep 0.5
done
for m in "$ROOT"/migrations/*.sql; do PGOPTIONS="-c client_min_messages=error" "${PSQL[@]}" -f "$m" >/dev/null; done

# FIXED_UPSERT_SQL as the source has it, on one line.
fixed_sql=$(python3 - "$ROOT/src/store/postgres/statements.rs" <<'PY'
import re, sys
m = re.search(r'const FIXED_UPSERT_SQL: &str = "\\\n(.*?)";', open(sys.argv[1]).read(), re.S)
print(" ".join(m.group(1).split()))
PY
)
upsert_sql='WITH input AS (SELECT b.bucket, b.amount, b.win, (floor(extract(epoch FROM now()))::int8 / b.win) * b.win AS start_secs FROM unnest($1, $2, $3) AS b(bucket, win, amount)) INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at) SELECT i.bucket, to_timestamp(i.start_secs), LEAST(i.amount, 2147483647)::int4, to_timestamp(i.start_secs + i.win) FROM input i ORDER BY i.bucket ON CONFLICT (bucket, window_start) DO UPDATE SET count = LEAST(r.count::int8 + EXCLUDED.count, 2147483647)::int4 RETURNING r.bucket, r.count, floor(extract(epoch FROM r.expires_at) * 1000)::int8, floor(extract(epoch FROM now()) * 1000)::int8'
decide_call='SELECT bucket, count, previous, window_end_ms, now_ms, added, fits FROM public.tollgate_decide($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)'

prepare() {   # prepare STATEMENT -> "PREPARE ...;" and "EXECUTE ...;" lines, tab-separated
  case $1 in
    upsert) printf 'PREPARE p(text[], int8[], int8[]) AS %s;\tEXECUTE p(%s);' "$upsert_sql" "'{hot}', '{3600}', '{1}'" ;;
    fixed) printf 'PREPARE p(text[], int8[], int8[], int8[]) AS %s;\tEXECUTE p(%s);' "$fixed_sql" "'{hot}', '{3600}', '{1}', '{2000000000}'" ;;
    function) printf 'PREPARE p(text[], int8[], int8[], int8[], int8[], boolean) AS SELECT * FROM public.tollgate_increment($1, $2, $3, $4, $5, $6);\tEXECUTE p(%s);' "'{hot}', '{3600}', '{1}', NULL, '{2000000000}', true" ;;
    function5) printf 'PREPARE p(text[], int8[], int8[], int8[], boolean) AS SELECT * FROM public.tollgate_increment($1, $2, $3, $4, $5);\tEXECUTE p(%s);' "'{hot}', '{3600}', '{1}', NULL, true" ;;
    upsert2) printf 'PREPARE p(text[], int8[], int8[]) AS %s;\tEXECUTE p(%s);' "$upsert_sql" "'{hot,glob}', '{3600,3600}', '{1,1}'" ;;
    decide2) printf 'PREPARE p(text[], int8[], int8[], int8[], int4[], int4[], int8[], int8[], boolean[], boolean) AS %s;\tEXECUTE p(%s);' "$decide_call" "'{hot,glob}', '{3600,3600}', '{1,1}', '{NULL,NULL}', '{1,2}', '{1,1}', '{1,1}', '{2000000000,2000000000}', '{f,f}', true" ;;
    *) echo "unknown statement $1" >&2; exit 1 ;;
  esac
}

# session_ir STATEMENT N: the instructions of one session that prepares it and executes it N times
session_ir() {
  local lines prep exec f
  lines=$(prepare "$1"); prep=${lines%%$'\t'*}; exec=${lines#*$'\t'}
  { echo "SET synchronous_commit = off;"; echo "$prep"; for ((i = 0; i < $2; i++)); do echo "$exec"; done; } >"$RUN/script.sql"
  touch "$RUN/mark"; sleep 0.2
  "${PSQL[@]}" -f "$RUN/script.sql" >/dev/null
  sleep 1.5 # the backend exits and writes its file
  f=$(find "$RUN" -maxdepth 1 -name 'backend.*' -newer "$RUN/mark" | head -1)
  callgrind_annotate "$f" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}'
  rm -f "$f"
}

echo "PostgreSQL instructions per EXECUTE, (Ir($N2) - Ir($N1)) / $((N2 - N1)); $("$PG_BIN/postgres" --version)"
printf '%-10s %12s\n' statement Ir/execute
for s in $STATEMENTS; do
  a=$(session_ir "$s" "$N1"); b=$(session_ir "$s" "$N2")
  printf '%-10s %12d\n' "$s" $(((b - a) / (N2 - N1)))
done

#!/usr/bin/env bash
# bench/statement_cost.sh - what one increment statement costs the database, by how it is sent.
#
# Issue 15 replaced the per-connection named prepared statement (which a transaction-mode
# pooler breaks) with the unnamed one. This measures the server's side of that choice without
# tollgate: pgbench (4 clients, one thread, on CPU_LOAD) sends the shipped increment function
# `public.tollgate_increment`, the seed's plain upsert (what `f1d8ece` prepared, with
# `synchronous_commit = off` for the session) and `direct`, that upsert as a direct connection
# prepares it now (`FIXED_UPSERT_SQL`: guarded and setting `synchronous_commit` per
# transaction; the guard's parameters are literals here), each as
#   prepared  - Parse once per connection, then Bind/Execute (-M prepared), and
#   extended  - Parse, Bind, Execute every time (-M extended: the unnamed statement tollgate
#               sends with `query_typed`),
# on one hot bucket (`hot`, as pg-hot) and on 8 distinct random buckets out of 10,000 per call
# (`10k`, as a pg-10k batch). It prints transactions per second and the PostgreSQL processes' CPU per
# transaction (user + system, with the CPU of backends that have exited, from /proc).
# Arguments are bound as pgbench variables (text), so the absolute figures include an ARRAY[]
# constructor that tollgate does not send; compare the rows with each other.
#
# pgbench connects with libpq's default sslmode (`prefer`: TLS on Debian's server, which has
# `ssl = on`), the same for every row; the figures in docs/performance.md were taken so.
#
# `fixed` and `sliding` are the texts a direct connection prepares today (FIXED_UPSERT_SQL
# and SLIDING_UPSERT_SQL, read from src/store/postgres/statements.rs), `slideone`
# SLIDING_ONE_SQL (hot only), `slidefn` the function's call with sliding limits:
# `STATEMENTS="fixed sliding slideone slidefn"` prices a sliding batch against a fixed one,
# every way (docs/performance.md, "Database side"). `reserve` is the share grant of contract §3c
# (`public.tollgate_reserve`, one unit per call, the grant's dearest use; a share far from the
# limit is one call per window): `STATEMENTS="function reserve"` prices a grant against an
# increment.
#
# Usage: [KNOB=value ...] bench/statement_cost.sh
# Knobs: SECONDS_RUN [6] ROUNDS [2] CPU_LOAD [0] STATEMENTS ["function upsert direct"]
#        PG_URL [postgres://postgres@127.0.0.1:5432] (database tollgate_bench_statements,
#        created from migrations/ and dropped here)
set -euo pipefail
{
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
SECONDS_RUN=${SECONDS_RUN:-6}
ROUNDS=${ROUNDS:-2}
CPU_LOAD=${CPU_LOAD:-0}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
DB=tollgate_bench_statements
command -v pgbench >/dev/null || { echo "missing pgbench (postgresql-client)" >&2; exit 1; }
source "$HERE/lib/pg.sh"
source "$HERE/lib/procs.sh"
require_loopback_pg_url

RUN=$(mktemp -d /tmp/tollgate-statements.XXXXXX)
finish() {
  local rc=$?
  psql_admin -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$RUN"
  exit "$rc"
}
trap finish EXIT; trap 'exit 130' INT; trap 'exit 143' TERM

psql_admin -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB" >/dev/null
for m in "$ROOT"/migrations/*.sql; do
  PGOPTIONS="-c client_min_messages=error" psql_db "$DB" -f "$m" >/dev/null
done

# The scripts. `hot`: bucket 7 every time; `10k`: 8 buckets out of 10,000.
hot_vars='\set b1 7
\set w 3600
\set a 1'
# One bucket from each eighth of the 10,000: distinct within a call, as tollgate folds a
# batch's duplicates into one row (an upsert may not touch a row twice).
k_vars=$(for i in 1 2 3 4 5 6 7 8; do printf '\\set b%d random(1, 1250) + %d\n' "$i" "$(((i - 1) * 1250 + 1000000))"; done
  printf '\\set w 3600\n\\set a 1')
hot_args=('ARRAY[:b1]::text[]' 'ARRAY[:w]::int8[]' 'ARRAY[:a]::int8[]')
k_args=('ARRAY[:b1,:b2,:b3,:b4,:b5,:b6,:b7,:b8]::text[]' 'ARRAY[:w,:w,:w,:w,:w,:w,:w,:w]::int8[]'
  'ARRAY[:a,:a,:a,:a,:a,:a,:a,:a]::int8[]')
# The function's call on fixed rows, each capped at a limit it never reaches (contract §3d: a
# fixed row is counted only while its units fit; the 0008 overload).
function_sql() { echo "SELECT * FROM public.tollgate_increment($1, $2, $3, NULL, $4, true);"; }
# The seed's upsert as f1d8ece sent it (with the function's answer columns).
# A fourth argument, if given, is the input's WHERE clause.
upsert_sql() {
  echo "WITH input AS (SELECT b.bucket, b.amount, b.win,
    (floor(extract(epoch FROM now()))::int8 / b.win) * b.win AS start_secs
  FROM unnest($1, $2, $3) AS b(bucket, win, amount)${4:+
  WHERE $4})
INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
SELECT bucket, to_timestamp(start_secs), LEAST(amount, 2147483647)::int4, to_timestamp(start_secs + win)
FROM input ORDER BY bucket
ON CONFLICT (bucket, window_start) DO UPDATE
  SET count = LEAST(r.count::int8 + EXCLUDED.count, 2147483647)::int4
RETURNING r.bucket, r.count, NULL::int8, 0, floor(extract(epoch FROM r.expires_at) * 1000)::int8,
  floor(extract(epoch FROM now()) * 1000)::int8;"
}
# The plain upsert as a direct connection prepares it now (FIXED_UPSERT_SQL in
# src/store/postgres/statements.rs): the same upsert, guarded by the sliding limits being
# NULL, and setting synchronous_commit for its own transaction instead of the session.
direct_sql() {
  upsert_sql "$@" "NULL::int8[] IS NULL
    AND (SELECT NOT true OR set_config('synchronous_commit', 'off', true) = 'off')"
}
# The statements a direct connection prepares today, read from
# src/store/postgres/statements.rs so that they cannot drift from it: `fixed`
# (FIXED_UPSERT_SQL) and `sliding` (SLIDING_UPSERT_SQL, every row with a sliding limit of
# 2,000,000,000, so nothing is denied and no row goes on to the function). Both rely on the
# session's synchronous_commit, set here as tollgate's direct sessions set it.
source_sql() {   # source_sql CONST ARG... -> the constant's text with $1.. replaced by ARGs
  python3 - "$ROOT/src/store/postgres/statements.rs" "$@" <<'PY'
import re, sys
src = open(sys.argv[1]).read()
m = re.search(r'const %s: &str = "\\\n(.*?)";' % sys.argv[2], src, re.S)
if not m:
    sys.exit("no const %s in %s" % (sys.argv[2], sys.argv[1]))
sql = m.group(1)
for i, arg in reversed(list(enumerate(sys.argv[3:], 1))):
    sql = sql.replace("$%d::" % i, arg + "::").replace("$%d" % i, arg)
print(" ".join(sql.split()) + ";")
PY
}
hot_lim='ARRAY[2000000000]::int8[]'
k_lim='ARRAY[2000000000,2000000000,2000000000,2000000000,2000000000,2000000000,2000000000,2000000000]::int8[]'
# A sliding row has no fixed cap.
hot_nocap='ARRAY[NULL]::int8[]'
k_nocap='ARRAY[NULL,NULL,NULL,NULL,NULL,NULL,NULL,NULL]::int8[]'
# `fixed` caps every row at a limit it never reaches, as an enforced limit far from full does.
{ echo "$hot_vars"; source_sql FIXED_UPSERT_SQL "${hot_args[@]}" "$hot_lim"; } >"$RUN/hot-fixed.sql"
{ echo "$k_vars"; source_sql FIXED_UPSERT_SQL "${k_args[@]}" "$k_lim"; } >"$RUN/10k-fixed.sql"
{ echo "$hot_vars"; source_sql SLIDING_UPSERT_SQL "${hot_args[@]}" "$hot_lim" "$hot_nocap"; } >"$RUN/hot-sliding.sql"
{ echo "$k_vars"; source_sql SLIDING_UPSERT_SQL "${k_args[@]}" "$k_lim" "$k_nocap"; } >"$RUN/10k-sliding.sql"
# `slideone`: SLIDING_ONE_SQL, what a direct connection sends for a batch of one sliding row
# (the hot workload only: a 10k batch is never one row).
{ echo "$hot_vars"; source_sql SLIDING_ONE_SQL ':b1' ':w' ':a' '2000000000'; } >"$RUN/hot-slideone.sql"
# `slidefn`: the function's call with every row sliding, what a pooled connection sends for a
# sliding batch (and a direct one for the rows at their limit).
{ echo "$hot_vars"; echo "SELECT * FROM public.tollgate_increment(${hot_args[0]}, ${hot_args[1]}, ${hot_args[2]}, $hot_lim, $hot_nocap, true);"; } >"$RUN/hot-slidefn.sql"
{ echo "$k_vars"; echo "SELECT * FROM public.tollgate_increment(${k_args[0]}, ${k_args[1]}, ${k_args[2]}, $k_lim, $k_nocap, true);"; } >"$RUN/10k-slidefn.sql"
# `reserve`: the share grant, one unit per call, on limits that never run out.
reserve_sql() {   # reserve_sql BUCKETS WINDOWS LIMITS SLIDING WANTS
  echo "SELECT * FROM public.tollgate_reserve($1, $2, $3, $4, $5, 1, 'bench', true);"
}
{ echo "$hot_vars"; reserve_sql "${hot_args[0]}" "${hot_args[1]}" "$hot_lim" 'ARRAY[false]' "${hot_args[2]}"; } >"$RUN/hot-reserve.sql"
{ echo "$k_vars"; reserve_sql "${k_args[0]}" "${k_args[1]}" "$k_lim" 'ARRAY[false,false,false,false,false,false,false,false]' "${k_args[2]}"; } >"$RUN/10k-reserve.sql"
{ echo "$hot_vars"; function_sql "${hot_args[@]}" "$hot_lim"; } >"$RUN/hot-function.sql"
{ echo "$hot_vars"; direct_sql "${hot_args[@]}"; } >"$RUN/hot-direct.sql"
{ echo "$k_vars"; direct_sql "${k_args[@]}"; } >"$RUN/10k-direct.sql"
{ echo "$hot_vars"; upsert_sql "${hot_args[@]}"; } >"$RUN/hot-upsert.sql"
{ echo "$k_vars"; function_sql "${k_args[@]}" "$k_lim"; } >"$RUN/10k-function.sql"
{ echo "$k_vars"; upsert_sql "${k_args[@]}"; } >"$RUN/10k-upsert.sql"

postgres_cpu_seconds() {   # all postgres processes, with the backends that have exited
  cpu_by_comm reaped | awk -F'\t' '$1 == "postgres" {t += $2} END {printf "%.2f\n", t}'
}

# The function sets synchronous_commit off itself (its last argument); the upsert gets it
# for its session, as f1d8ece's connections had it.
one() {   # one <workload> <statement> <protocol>
  local opt="" c0 c1 out tx tps
  [[ $2 == upsert || $2 == fixed || $2 == sliding || $2 == slideone ]] && opt="-c synchronous_commit=off"
  [[ -f $RUN/$1-$2.sql ]] || return 0   # slideone has no 10k workload
  c0=$(postgres_cpu_seconds)
  out=$(PGOPTIONS="$opt" taskset -c "$CPU_LOAD" pgbench "$PG_URL/$DB" -n -c 4 -j 1 -T "$SECONDS_RUN" \
    -M "$3" -f "$RUN/$1-$2.sql" 2>&1) || { echo "$out" >&2; exit 1; }
  c1=$(postgres_cpu_seconds)
  tx=$(awk '/number of transactions actually processed/ {split($6, a, "/"); print a[1]}' <<<"$out")
  tps=$(awk '/^tps/ {printf "%d", $3}' <<<"$out")
  printf '%-5s %-6s %-9s %9s %10.0f %10.1f\n' "$1" "$2" "$3" "$tps" "$tx" \
    "$(echo "($c1 - $c0) * 1000000 / $tx" | bc -l)"
}

printf 'pgbench -c 4 -j 1 -T %s on CPU %s; postgres CPU per transaction in µs\n' "$SECONDS_RUN" "$CPU_LOAD"
printf '%-5s %-6s %-9s %9s %10s %10s\n' load stmt protocol tps tx pg_us/tx
for ((r = 1; r <= ROUNDS; r++)); do
  for w in hot 10k; do
    for s in ${STATEMENTS:-function upsert direct}; do
      for p in prepared extended; do one "$w" "$s" "$p"; done
    done
  done
done
exit 0
}

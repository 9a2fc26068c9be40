# bench/lib/pg.sh - PostgreSQL helpers sourced by bench/run.sh, bench/cpu_split.sh,
# bench/instructions.sh, bench/profile.sh, bench/statement_cost.sh and bench/store_wait.sh.
#
# Needs PG_URL (the server, without a database) and CPU_LOAD (the CPU the backends go to).
# require_loopback_pg_url exits the script unless PG_URL names a loopback address: the
# benchmarks create and drop databases. psql_admin runs psql against the `postgres`
# database, psql_db DB against DB. pin_backends DB moves the server processes serving DB to
# CPU_LOAD, now; pin_backends_during DB does so every 0.5 s until killed, so that pool
# connections opened during a run follow (from one psql session of its own, on CPU_LOAD). store_url DB is the `store.url` a tollgate under
# test gets: DB on PG_URL with `sslmode=$PG_SSLMODE`. store_section DB prints the `[store]`
# table of bench/run.sh's PostgreSQL modes for DB (pool of 16, 100 ms budget, allow).
#
# PG_SSLMODE [disable]: Debian's PostgreSQL has `ssl = on` (a snakeoil certificate), so the
# URL's default `prefer` would encrypt the loopback connection of every tollgate since issue 15
# and of none before it, and an A/B across issue 15 would compare TLS with plaintext
# (docs/performance.md, "Database side"). `prefer` or `require` measures what TLS to
# the database costs.
PG_SSLMODE=${PG_SSLMODE:-disable}

store_url() { echo "$PG_URL/$1?sslmode=$PG_SSLMODE"; }

store_section() {
  printf '[store]\nurl = "%s"\npool_size = 16\ntimeout = "100ms"\non_error = "allow"\nmigrate = true\nsynchronous_commit = "off"\n\n' "$(store_url "$1")"
}

require_loopback_pg_url() {
  python3 - "$PG_URL" <<'PY' || { echo "PG_URL must point at a loopback address" >&2; exit 1; }
import ipaddress, sys, urllib.parse
h = urllib.parse.urlsplit(sys.argv[1]).hostname or ""
sys.exit(0 if h == "localhost" or ipaddress.ip_address(h).is_loopback else 1)
PY
}

psql_admin() { PGOPTIONS="-c client_min_messages=warning" psql "$PG_URL/postgres" -X -q -v ON_ERROR_STOP=1 "$@"; }
psql_db() { local db=$1; shift; psql "$PG_URL/$db" -X -q -v ON_ERROR_STOP=1 "$@"; }

pin_backends() {
  local pid
  for pid in $(psql_admin -tAc "SELECT pid FROM pg_stat_activity WHERE datname = '$1'" 2>/dev/null); do
    taskset -pc "$CPU_LOAD" "$pid" >/dev/null 2>&1 || echo "cannot pin backend $pid (not root?)" >&2
  done
}

# One psql session for the whole run, itself on CPU_LOAD, and a taskset only for a backend not
# seen before: a psql started every 0.5 s (and the backend the server forks for each) ran on
# whichever CPU was free, the proxy's too, and took a few milliseconds of it each time: the
# PostgreSQL modes' p99 paid for the measurement (docs/performance.md, "Reserved shares").
pin_backends_during() {
  taskset -pc "$CPU_LOAD" "$BASHPID" >/dev/null 2>&1 || true
  local db=$1 pid
  local -A pinned=()
  # A coprocess: when this subshell is killed its end of psql's input closes, and psql exits.
  coproc PINNER { PGOPTIONS="-c client_min_messages=warning" psql "$PG_URL/postgres" -X -q -tA 2>/dev/null; }
  while :; do
    printf "SELECT pid FROM pg_stat_activity WHERE datname = '%s' OR pid = pg_backend_pid();\nSELECT 'done';\n" \
      "$db" >&"${PINNER[1]}" 2>/dev/null || return 0
    while read -r -u "${PINNER[0]}" pid; do
      [[ $pid == done ]] && break
      [[ -n $pid && -z ${pinned[$pid]:-} ]] || continue
      pinned[$pid]=1
      taskset -pc "$CPU_LOAD" "$pid" >/dev/null 2>&1 || echo "cannot pin backend $pid (not root?)" >&2
    done
    sleep 0.5
  done
}

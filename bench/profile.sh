#!/usr/bin/env bash
# bench/profile.sh - where tollgate spends its CPU under load (perf, software clock).
#
# Starts an upstream (nginx `return 200`, 1 worker) and one tollgate (1 tokio worker, pinned
# to CPU_PROXY) on 127.0.0.1, loads it with wrk for WARMUP + SECONDS_PROF seconds, and records
# a perf profile of the tollgate process during the loaded part (cpu-clock sampling: this VM
# exposes no hardware counters; DWARF call graphs, since the release build has no frame
# pointers). Writes the flat (self) and inclusive (children) reports next to perf.data.
# WHO=postgres (pg modes) records the whole machine instead and reports only the PostgreSQL
# processes (no call graphs: the Debian server is built without frame pointers and its
# debug symbols are not installed), to compare what the database does per request between
# two tollgate builds.
#
# Usage: [KNOB=value ...] bench/profile.sh [memory|nolimit|pg-hot|pg-10k|pg-hot-reserve]   (default memory)
# Knobs: SECONDS_PROF [8] CONNS [32] WARMUP [2] FREQ [499] BASE_PORT [19300] PIN [1]
#        WHO [tollgate|postgres]
#        ACCESS_LOG [0] (1: tollgate at RUST_LOG=info, its access-log lines written to /dev/null,
#        as bench/run.sh's ACCESS_LOG=1; 0: RUST_LOG=warn, no line per request)
#        TOLLGATE_BIN [target/release/tollgate] (built with BUILD=1 [1])
#        PG_URL [postgres://postgres@127.0.0.1:5432] PG_SSLMODE [disable] (bench/lib/pg.sh)
#        (pg modes: database tollgate_bench_profile, created and dropped here)
#        OUT [bench/results/profile-<mode>-<UTC timestamp>]
set -euo pipefail
{
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
MODE=${1:-memory}
SECONDS_PROF=${SECONDS_PROF:-8}
CONNS=${CONNS:-32}
WARMUP=${WARMUP:-2}
FREQ=${FREQ:-499}
BASE_PORT=${BASE_PORT:-19300}
PIN=${PIN:-1}
BUILD=${BUILD:-1}
WHO=${WHO:-tollgate}
ACCESS_LOG=${ACCESS_LOG:-0}
TOLLGATE_BIN=${TOLLGATE_BIN:-$ROOT/target/release/tollgate}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
OUT=${OUT:-$HERE/results/profile-$MODE-$(date -u +%Y%m%dT%H%M%SZ)}
UP=$BASE_PORT; TG=$((BASE_PORT + 1)); ADM=$((BASE_PORT + 2))
DB=tollgate_bench_profile

case $MODE in memory | nolimit | pg-hot | pg-10k | pg-hot-reserve) ;; *) echo "unknown mode $MODE" >&2; exit 1 ;; esac
case $WHO in tollgate) ;; postgres) [[ $MODE == pg-* ]] || { echo "WHO=postgres needs a pg mode" >&2; exit 1; } ;;
  *) echo "unknown WHO $WHO" >&2; exit 1 ;; esac
command -v perf >/dev/null || { echo "missing perf (apt-get install -y linux-perf)" >&2; exit 1; }
[[ $PIN == 1 ]] && P_PROXY=(taskset -c 1) P_LOAD=(taskset -c 0) || { P_PROXY=(); P_LOAD=(); }

RUN=$(mktemp -d /tmp/tollgate-profile.XXXXXX); chmod 755 "$RUN"; mkdir -p "$RUN/upstream_tmp" "$OUT"
source "$HERE/lib/procs.sh"
# store_url (and its PG_SSLMODE knob, disable by default), as run.sh and cpu_split.sh use it.
source "$HERE/lib/pg.sh"
USED_DB=0
finish() {
  local rc=$?
  stop_started
  ((USED_DB)) && psql "$PG_URL/postgres" -X -q -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
  cp "$RUN"/*.out "$RUN"/*.toml "$OUT/" 2>/dev/null || true
  rm -rf "$RUN"
  exit "$rc"
}
trap finish EXIT; trap 'exit 130' INT; trap 'exit 143' TERM

if [[ $BUILD == 1 ]]; then (cd "$ROOT" && cargo build --release --quiet); fi
sed -e "s#{{RUN}}#$RUN#g" -e "s#{{PORT}}#$UP#g" "$HERE/conf/upstream.nginx.conf" >"$RUN/upstream.conf"
"${P_LOAD[@]}" nginx -p "$RUN/" -c "$RUN/upstream.conf" >"$RUN/upstream.out" 2>&1 &
PIDS+=("$!")
wait_200 "http://127.0.0.1:$UP/" 10

{
  tollgate_config_head "$TG" "$ADM"
  if [[ $MODE == pg-* ]]; then printf '[store]\nurl = "%s"\n\n' "$(store_url "$DB")"; fi
  printf '[[routes]]\nname = "bench"\nupstream = "app"\n'
  case $MODE in
    memory | pg-hot) printf '  [[routes.limits]]\n  key = "ip"\n  requests = 2000000000\n  window = "1h"\n' ;;
    pg-hot-reserve) printf '  [[routes.limits]]\n  key = "ip"\n  requests = 2000000000\n  window = "1h"\n  reserve = true\n' ;;
    pg-10k) printf '  [[routes.limits]]\n  key = "header:authorization"\n  requests = 2000000000\n  window = "1h"\n' ;;
  esac
} >"$RUN/tollgate.toml"
if [[ $MODE == pg-* ]]; then
  PGOPTIONS="-c client_min_messages=warning" psql "$PG_URL/postgres" -X -q -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB" >/dev/null
  USED_DB=1
fi
if [[ $ACCESS_LOG == 1 ]]; then LOG_LEVEL=info TG_OUT=/dev/null; else LOG_LEVEL=warn TG_OUT=$RUN/tollgate.out; fi
env -u TOLLGATE_DATABASE_URL RUST_LOG=$LOG_LEVEL "${P_PROXY[@]}" "$TOLLGATE_BIN" \
  --config "$RUN/tollgate.toml" run >"$TG_OUT" 2>&1 &
TGPID=$!; PIDS+=("$TGPID")
wait_200 "http://127.0.0.1:$ADM/readyz" 30

LUA=(); [[ $MODE == pg-10k ]] && LUA=(-s "$HERE/lua/tokens.lua")
timeout $((WARMUP + SECONDS_PROF + 30)) "${P_LOAD[@]}" wrk -t1 -c"$CONNS" -d"$((WARMUP + SECONDS_PROF))s" --latency \
  "${LUA[@]}" "http://127.0.0.1:$TG/" >"$OUT/wrk.txt" 2>&1 &
WRK=$!; PIDS+=("$WRK")
sleep "$WARMUP"
cpu_by_comm >"$RUN/cpu0.tsv"
t0=$(date +%s.%N)
if [[ $WHO == postgres ]]; then
  RECORD=(-a); REPORT=(--comms postgres); GRAPH=()
else
  RECORD=(-p "$TGPID"); REPORT=(); GRAPH=(--call-graph dwarf,16384)
fi
timeout $((SECONDS_PROF + 30)) perf record -q -e cpu-clock -F "$FREQ" "${GRAPH[@]}" \
  -o "$OUT/perf.data" "${RECORD[@]}" -- sleep "$SECONDS_PROF" 2>"$OUT/perf-record.err" || true
cpu_by_comm >"$RUN/cpu1.tsv"
t1=$(date +%s.%N)
wait "$WRK" || true
# CPU (cores) per command name during the profiled seconds: who is busy besides tollgate
# (perf itself shows up too)
awk -F'\t' -v dt="$(echo "$t1 - $t0" | bc -l)" 'NR==FNR{a[$1]=$2; next} {d=$2-a[$1]; if (d/dt >= 0.02) printf "%-20s %.2f cores\n", $1, d/dt}' \
  "$RUN/cpu0.tsv" "$RUN/cpu1.tsv" | sort -k2 -nr >"$OUT/cpu-by-process.txt"
perf report -i "$OUT/perf.data" "${REPORT[@]}" --stdio -n --no-children --sort dso,symbol --percent-limit 0.7 -g none \
  >"$OUT/perf-self.txt" 2>/dev/null || true
perf report -i "$OUT/perf.data" "${REPORT[@]}" --stdio --children --sort symbol --percent-limit 3 -g none \
  >"$OUT/perf-children.txt" 2>/dev/null || true
echo "mode $MODE, ACCESS_LOG=$ACCESS_LOG: $(grep -E '^Requests/sec' "$OUT/wrk.txt")  (while perf samples: lower than without it)"
echo "CPU by process while profiling:"; cat "$OUT/cpu-by-process.txt"
perf report -i "$OUT/perf.data" "${REPORT[@]}" --stdio --no-children --sort dso -g none 2>/dev/null | grep -E '^ +[0-9]' | sed -n '1,6p' \
  | tee "$OUT/perf-dso.txt"
echo "self time, top entries ($OUT/perf-self.txt):"
grep -E '^ +[0-9]' "$OUT/perf-self.txt" | sed -n '1,25p'
echo "inclusive (children) top entries ($OUT/perf-children.txt):"
grep -E '^ +[0-9]' "$OUT/perf-children.txt" | sed -n '1,30p'
exit 0
}

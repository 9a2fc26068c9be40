#!/usr/bin/env bash
# bench/instructions.sh - user-space instructions per proxied request, tollgate against nginx.
#
# Timings on a shared VM move by 10-20% from one minute to the next; instruction counts do
# not. This runs each proxy under valgrind's callgrind (which counts the instructions a
# process executes in user space, its own code and its libraries; the kernel's share is not
# counted), sends WARM_REQUESTS HTTP/1.1 requests on CONNS keep-alive connections with
# h2load, zeroes the counters, sends REQUESTS more, dumps, and divides. The proxies are:
#   nginx     bench/conf/proxy.nginx.conf, one process (master_process off)
#   tollgate  one worker, in each MODE given (nolimit: a route without limits; memory: one
#             `ip` limit on the memory store; pg-hot: the same limit on the PostgreSQL store,
#             a fresh database, decision budget 5 s so that valgrind's pace fails nothing;
#             only tollgate's side is counted, bench/pg_instructions.sh counts the database's;
#             pg-hot-reserve: pg-hot with `reserve = true` (contract §3c), decided from shares;
#             memory-tls: the memory mode's route with the requests sent over TLS (HTTP/1.1,
#             a self-signed certificate made with openssl, one TLS connection per CONNS); its
#             "x nginx" is against nginx over plain HTTP; memory-h2c and nolimit-h2c: those
#             routes with the requests sent as h2c (prior knowledge, H2_STREAMS streams per
#             connection), against nginx's h2c listener, measured as nginx-h2c when such a
#             mode is asked for); a mode with "-hyper" appended (nolimit-hyper, memory-hyper)
#             is that mode served by hyper's HTTP/1.1 server and client alone
#             (`run --http1 hyper`), the figure that says what tollgate's own HTTP/1.1 code saves)
#   ceiling   bench/ceiling, the plainest HTTP/1.1 proxy hyper makes (one thread, the upstream
#             connection polled by the client connection's task; see bench/run.sh): what hyper
#             itself costs per request, so that tollgate's figure can be read against it
#             (issue 16). CEILING=0 leaves it out.
# all in front of the same upstream (nginx `return 200`). tollgate's heaviest functions
# (inclusive) go to OUT/tollgate-<mode>.top.txt, the full callgrind files next to them.
#
# Usage: [KNOB=value ...] bench/instructions.sh
# Knobs: MODES ["nolimit memory"] REQUESTS [20000] WARM_REQUESTS [3000] CONNS [8]
#        H2_STREAMS [10] (h2load -m, the *-h2c modes)
#        BASE_PORT [19400] BUILD [1] (cargo build --release of tollgate, and of bench/ceiling
#        when CEILING=1) TOLLGATE_BIN [target/release/tollgate] CEILING [1]
#        CEILING_BIN [bench/ceiling/target/release/tollgate-bench-ceiling]
#        PG_URL [postgres://postgres@127.0.0.1:5432] (pg-hot; creates and drops the database
#        tollgate_instructions) PG_SSLMODE [disable] (bench/lib/pg.sh)
#        OUT [bench/results/instructions-<UTC timestamp>]
#        ACCESS_LOG [0] (1: tollgate at RUST_LOG=info, its default, so every request writes its
#        access-log line, to OUT/tollgate-<mode>.log; 0: RUST_LOG=warn, no line per request)
#        CACHE_SIM [0] (1: callgrind simulates the caches too, and each target also gets its
#        first-level instruction and data cache misses per request: I1 misses, D1 read and
#        write misses. Slower; the instruction counts are the same)
# Needs: valgrind, nginx, h2load (apt-get install -y valgrind nginx nghttp2-client).
set -euo pipefail
{
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
MODES=${MODES:-nolimit memory}
REQUESTS=${REQUESTS:-20000}
WARM_REQUESTS=${WARM_REQUESTS:-3000}
CONNS=${CONNS:-8}
H2_STREAMS=${H2_STREAMS:-10}
BASE_PORT=${BASE_PORT:-19400}
BUILD=${BUILD:-1}
TOLLGATE_BIN=${TOLLGATE_BIN:-$ROOT/target/release/tollgate}
CEILING=${CEILING:-1}
CEILING_BIN=${CEILING_BIN:-$HERE/ceiling/target/release/tollgate-bench-ceiling}
OUT=${OUT:-$HERE/results/instructions-$(date -u +%Y%m%dT%H%M%SZ)}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
ACCESS_LOG=${ACCESS_LOG:-0}
CACHE_SIM=${CACHE_SIM:-0}
# valgrind follows no exec, so the environment is set here rather than through `env`.
if [[ $ACCESS_LOG == 1 ]]; then export RUST_LOG=info; else export RUST_LOG=warn; fi
unset TOLLGATE_DATABASE_URL TOLLGATE_CONFIG
UP=$BASE_PORT; PX=$((BASE_PORT + 1)); PX_H2=$((BASE_PORT + 2)); ADM=$((BASE_PORT + 3))
PX_TLS=$((BASE_PORT + 4))

for tool in valgrind callgrind_control callgrind_annotate nginx h2load curl openssl; do
  command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install -y valgrind nginx nghttp2-client curl openssl)" >&2; exit 1; }
done

RUN=$(mktemp -d /tmp/tollgate-instructions.XXXXXX); chmod 755 "$RUN"
mkdir -p "$RUN/nginx_tmp" "$OUT"
source "$HERE/lib/procs.sh"
source "$HERE/lib/pg.sh"
cleanup_on_exit

if [[ $BUILD == 1 ]]; then
  (cd "$ROOT" && cargo build --release --quiet)
  if [[ $CEILING == 1 ]]; then cargo build --release --quiet --manifest-path "$HERE/ceiling/Cargo.toml"; fi
fi
[[ $CEILING != 1 || -x $CEILING_BIN ]] || { echo "no ceiling binary at $CEILING_BIN (BUILD=1 builds it, CEILING=0 skips it)" >&2; exit 1; }
render "$HERE/conf/upstream.nginx.conf" "$UP" >"$RUN/upstream.conf"
nginx -p "$RUN/" -c "$RUN/upstream.conf" >"$RUN/upstream.out" 2>&1 &
PIDS+=("$!")
wait_200 "http://127.0.0.1:$UP/" 10

# measure NAME URL COMMAND...: runs COMMAND under callgrind, loads URL, prints
# instructions/request. Targets named *-h2c are loaded with h2c, the others with HTTP/1.1.
measure() {
  local name=$1 url=$2; shift 2
  local proto=(--h1) curl_proto=(); [[ $name == *-h2c ]] && proto=(-m "$H2_STREAMS") curl_proto=(--http2-prior-knowledge)
  local cg=$OUT/$name.callgrind
  local sim=(); [[ $CACHE_SIM == 1 ]] && sim=(--cache-sim=yes)
  valgrind --tool=callgrind "${sim[@]}" --callgrind-out-file="$cg" "$@" >"$OUT/$name.log" 2>&1 &
  local vpid=$!
  PIDS+=("$vpid")
  # measure runs in a command substitution, a subshell that does not share the script's exit
  # trap or PIDS: stop the target here too when a step fails, or it keeps its port.
  trap "kill -TERM $vpid 2>/dev/null || true" EXIT
  wait_200 "$url" 60 "${curl_proto[@]}"
  h2load "${proto[@]}" -n "$WARM_REQUESTS" -c "$CONNS" "$url" >/dev/null
  callgrind_control -z "$vpid" >/dev/null 2>&1
  h2load "${proto[@]}" -n "$REQUESTS" -c "$CONNS" "$url" >"$OUT/$name.h2load.txt"
  grep -q "$REQUESTS succeeded" "$OUT/$name.h2load.txt" && grep -q "status codes: $REQUESTS 2xx" "$OUT/$name.h2load.txt" || { echo "$name: not every request succeeded" >&2; cat "$OUT/$name.h2load.txt" >&2; exit 1; }
  callgrind_control -d "$vpid" >/dev/null 2>&1
  sleep 1
  kill -TERM "$vpid" 2>/dev/null || true
  wait "$vpid" 2>/dev/null || true
  trap - EXIT
  unset 'PIDS[-1]'
  # The dump taken after the measured requests: the newest file of this target.
  local dump total
  dump=$(ls -t "$cg".* 2>/dev/null | head -1)
  total=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1; exit}')
  callgrind_annotate --inclusive=yes "$dump" 2>/dev/null | grep -E '^ *[0-9,]+ \(' | sed -n '1,60p' >"$OUT/$name.top.txt"
  local misses=""
  if [[ $CACHE_SIM == 1 ]]; then
    # The totals line lists Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw, each with its share.
    misses=$(callgrind_annotate "$dump" 2>/dev/null | awk -v n="$REQUESTS" '/PROGRAM TOTALS/ {
      gsub(/\([^)]*\)/, ""); gsub(",", ""); printf " %d %d %d", $4 / n, $5 / n, $6 / n; exit }')
  fi
  echo "$name $((total / REQUESTS))$misses"
}

render "$HERE/conf/proxy.nginx.conf" "$PX" | sed -e 's/^worker_processes 1;/worker_processes 1;\nmaster_process off;/' >"$RUN/nginx.conf"
results=()
results+=("$(measure nginx "http://127.0.0.1:$PX/" nginx -p "$RUN/" -c "$RUN/nginx.conf")")
if [[ " $MODES " == *-h2c\ * ]]; then
  results+=("$(measure nginx-h2c "http://127.0.0.1:$PX_H2/" nginx -p "$RUN/" -c "$RUN/nginx.conf")")
fi
if [[ $CEILING == 1 ]]; then
  results+=("$(measure ceiling "http://127.0.0.1:$PX/" "$CEILING_BIN" "127.0.0.1:$PX" "127.0.0.1:$UP")")
fi
for mode in $MODES; do
  if [[ $mode == pg-* ]]; then
    require_loopback_pg_url
    psql_admin -c "DROP DATABASE IF EXISTS tollgate_instructions WITH (FORCE)" -c "CREATE DATABASE tollgate_instructions" >/dev/null
  fi
  url=http://127.0.0.1:$PX/
  {
    if [[ $mode == *-tls ]]; then
      [[ -f $RUN/cert.pem ]] || openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=localhost \
        -addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout "$RUN/key.pem" -out "$RUN/cert.pem" 2>/dev/null
      url=https://127.0.0.1:$PX_TLS/
      tollgate_config_head "$PX" | sed "s|^listen = .*|&\ntls_listen = [\"127.0.0.1:$PX_TLS\"]|"
      printf '[[server.certs]]\ncert = "%s"\nkey = "%s"\n\n' "$RUN/cert.pem" "$RUN/key.pem"
    else
      tollgate_config_head "$PX"
    fi
    if [[ $mode == pg-* ]]; then
      printf '[store]\nurl = "%s"\npool_size = 16\ntimeout = "5s"\non_error = "deny"\nmigrate = true\nsynchronous_commit = "off"\n\n' "$(store_url tollgate_instructions)"
    fi
    printf '[[routes]]\nname = "bench"\nupstream = "app"\n'
    case ${mode%-hyper} in
      nolimit) ;;
      nolimit-h2c) ;;
      memory | memory-tls | memory-h2c | pg-hot) printf '  [[routes.limits]]\n  key = "ip"\n  requests = 2000000000\n  window = "1h"\n' ;;
      pg-hot-reserve) printf '  [[routes.limits]]\n  key = "ip"\n  requests = 2000000000\n  window = "1h"\n  reserve = true\n' ;;
      *) echo "unknown mode $mode" >&2; exit 1 ;;
    esac
  } >"$RUN/tollgate-$mode.toml"
  # Only *-hyper modes name the stack, so that builds from before `run --http1` measure too.
  http1=()
  [[ $mode == *-hyper ]] && http1=(--http1 hyper)
  results+=("$(measure "tollgate-$mode" "$url" "$TOLLGATE_BIN" --config "$RUN/tollgate-$mode.toml" run "${http1[@]}")")
  if [[ $mode == pg-* ]]; then
    psql_admin -c "DROP DATABASE IF EXISTS tollgate_instructions WITH (FORCE)" >/dev/null
  fi
done

{
  echo "instructions per request (user space, callgrind), $REQUESTS HTTP/1.1 requests (h2c for *-h2c, $H2_STREAMS streams each) on $CONNS connections after $WARM_REQUESTS warm-up; tollgate at RUST_LOG=$RUST_LOG; x nginx: against nginx-h2c for *-h2c"
  echo "tollgate: $("$TOLLGATE_BIN" --version); nginx: $(nginx -v 2>&1 | sed 's/.*: //')"
  nginx_ir=$(echo "${results[0]}" | cut -d' ' -f2)
  nginx_h2c_ir=$(printf '%s\n' "${results[@]}" | awk '$1 == "nginx-h2c" {print $2}')
  if [[ $CACHE_SIM == 1 ]]; then
    printf '%-20s %12s %10s %10s %10s %10s\n' target "Ir/request" "x nginx" "I1 miss" "D1r miss" "D1w miss"
  else
    printf '%-20s %12s %10s\n' target "Ir/request" "x nginx"
  fi
  for r in "${results[@]}"; do
    set -- $r
    base=$nginx_ir; [[ $1 == *-h2c ]] && base=$nginx_h2c_ir
    printf '%-20s %12s %10s' "$1" "$2" "$(python3 -c "print(f'{$2 / $base:.2f}')")"
    [[ $CACHE_SIM == 1 ]] && printf ' %10s %10s %10s' "$3" "$4" "$5"
    printf '\n'
  done
} | tee "$OUT/summary.txt"
}

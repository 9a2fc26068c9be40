# bench/lib/procs.sh - sourced by bench/instructions.sh, bench/pg_instructions.sh,
# bench/profile.sh, bench/cpu_split.sh, bench/statement_cost.sh and bench/store_wait.sh.
#
# PIDS holds the servers a script started in the background, in start order; stop_started
# ends them in reverse order (TERM, then wait), from the script's EXIT trap. wait_200 URL
# TIMEOUT_S waits until URL answers 200, or exits the script (an https URL's certificate is
# not checked: the bench makes its own). cleanup_on_exit sets the traps
# that stop the servers and remove the script's $RUN folder however it ends. render TEMPLATE
# PORT fills a bench/conf template (with $RUN, $PX_H2 and $UP, the upstream's port).
# (bench/run.sh has richer versions of stop_started and wait_200: it checks targets stay alive and escalates to KILL.)
# tollgate_config_head PORT [ADMIN_PORT] prints the start of a bench tollgate config: one worker
# listening on PORT, an admin listener when ADMIN_PORT is given, the bench key secret and the
# upstream `app` on $UP; the caller appends [store] and [[routes]].
# cpu_by_comm [reaped] prints the CPU seconds (user + system) used so far, summed per command
# name, one `name<TAB>seconds` line each; with `reaped`, each process' reaped children count
# too (the CPU of PostgreSQL backends that have exited is in the postmaster's).

PIDS=()

stop_started() {
  local i
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    kill -TERM "${PIDS[$i]}" 2>/dev/null || true
    wait "${PIDS[$i]}" 2>/dev/null || true
  done
}

wait_200() {   # wait_200 URL SECONDS [CURL_OPTION...]
  local url=$1 deadline=$((SECONDS + $2)); shift 2
  until [[ $(curl -sk "$@" -o /dev/null -w '%{http_code}' --max-time 1 "$url" || true) == 200 ]]; do
    ((SECONDS < deadline)) || { echo "no 200 from $url" >&2; exit 1; }
    sleep 0.2
  done
}

cleanup_on_exit() {
  trap 'rc=$?; stop_started; rm -rf "$RUN"; exit "$rc"' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

render() {
  sed -e "s#{{RUN}}#$RUN#g" -e "s#{{PORT}}#$2#g" -e "s#{{H2PORT}}#$PX_H2#g" \
    -e "s#{{UPSTREAM_PORT}}#$UP#g" -e "s#{{ACCESS_LOG}}#access_log off;#g" "$1"
}

tollgate_config_head() {
  printf '[server]\nlisten = ["127.0.0.1:%s"]\nshutdown_timeout = "2s"\nworkers = 1\n\n' "$1"
  if [[ -n ${2:-} ]]; then printf '[admin]\nlisten = "127.0.0.1:%s"\n\n' "$2"; fi
  printf '[keys]\nsecret = "bench-only-secret-not-used-anywhere-else"\n\n[upstreams.app]\nurl = "http://127.0.0.1:%s"\n\n' "$UP"
}

cpu_by_comm() {
  python3 - "${1:-}" <<'PY'
import os, sys
hz = os.sysconf("SC_CLK_TCK"); tot = {}
last = 15 if sys.argv[1] == "reaped" else 13   # fields utime, stime [, cutime, cstime]
for d in os.listdir("/proc"):
    if d.isdigit():
        try:
            raw = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        f = raw.rsplit(")", 1)[1].split()
        tot[comm] = tot.get(comm, 0) + sum(int(x) for x in f[11:last]) / hz
for k, v in tot.items():
    print(f"{k}\t{v:.2f}")
PY
}

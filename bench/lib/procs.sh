# bench/lib/procs.sh - sourced by bench/instructions.sh, bench/profile.sh and bench/cpu_split.sh.
#
# PIDS holds the servers a script started in the background, in start order; stop_started
# ends them in reverse order (TERM, then wait), from the script's EXIT trap. wait_200 URL
# TIMEOUT_S waits until URL answers 200, or exits the script. cleanup_on_exit sets the traps
# that stop the servers and remove the script's $RUN folder however it ends. render TEMPLATE
# PORT fills a bench/conf template (with $RUN, $PX_H2 and $UP, the upstream's port).
# (bench/run.sh has richer versions of both: it checks targets stay alive and escalates to KILL.)

PIDS=()

stop_started() {
  local i
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    kill -TERM "${PIDS[$i]}" 2>/dev/null || true
    wait "${PIDS[$i]}" 2>/dev/null || true
  done
}

wait_200() {
  local deadline=$((SECONDS + $2))
  until [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "$1" || true) == 200 ]]; do
    ((SECONDS < deadline)) || { echo "no 200 from $1" >&2; exit 1; }
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
    -e "s#{{UPSTREAM_PORT}}#$UP#g" "$1"
}

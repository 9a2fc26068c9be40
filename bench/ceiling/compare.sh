#!/usr/bin/env bash
# bench/ceiling/compare.sh - the ceiling proxy's two ways of driving upstream connections
# against each other: `inline` (polled by the client connection's task) and `spawned` (a task
# per upstream connection), same machine, same rounds (docs/performance.md).
#
# Upstream: nginx `return 200` (bench/conf/upstream.nginx.conf) and wrk -t1 on CPU_LOAD [0];
# both proxies on CPU_PROXY [1], idle while the other is measured. ROUNDS [5] rounds, each
# measuring both at every CONNS ["32 128"] for DURATION [6] s after a 2 s warm-up. Prints each
# run and, per connection count, the inline / spawned ratio per round and its median.
# Knobs: ROUNDS CONNS DURATION CPU_PROXY CPU_LOAD BASE_PORT [19600] (upstream +0, inline +1,
# spawned +2). Needs nginx, wrk, taskset, python3, cargo (it builds the ceiling first).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROUNDS=${ROUNDS:-5}
CONNS=${CONNS:-"32 128"}
DURATION=${DURATION:-6}
CPU_PROXY=${CPU_PROXY:-1}
CPU_LOAD=${CPU_LOAD:-0}
BASE_PORT=${BASE_PORT:-19600}
UP=$BASE_PORT INLINE=$((BASE_PORT + 1)) SPAWNED=$((BASE_PORT + 2))

cargo build --release --quiet --manifest-path "$HERE/Cargo.toml"
BIN=$HERE/target/release/tollgate-bench-ceiling
RUN=$(mktemp -d /tmp/tollgate-ceiling.XXXXXX)
mkdir -p "$RUN/upstream_tmp"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$RUN"; }
trap cleanup EXIT
sed -e "s#{{RUN}}#$RUN#g" -e "s#{{PORT}}#$UP#g" "$HERE/../conf/upstream.nginx.conf" >"$RUN/upstream.conf"
taskset -c "$CPU_LOAD" nginx -p "$RUN/" -c "$RUN/upstream.conf" & PIDS+=("$!")
taskset -c "$CPU_PROXY" "$BIN" "127.0.0.1:$INLINE" "127.0.0.1:$UP" inline & PIDS+=("$!")
taskset -c "$CPU_PROXY" "$BIN" "127.0.0.1:$SPAWNED" "127.0.0.1:$UP" spawned & PIDS+=("$!")
for port in "$UP" "$INLINE" "$SPAWNED"; do
  for _ in $(seq 50); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
done

: >"$RUN/runs.txt"
for ((round = 1; round <= ROUNDS; round++)); do
  for c in $CONNS; do
    for mode in inline spawned; do
      port=$INLINE; [[ $mode == spawned ]] && port=$SPAWNED
      timeout 30 taskset -c "$CPU_LOAD" wrk -t1 -c"$c" -d2s "http://127.0.0.1:$port/" >/dev/null
      rps=$(timeout $((DURATION + 30)) taskset -c "$CPU_LOAD" wrk -t1 -c"$c" -d"${DURATION}s" "http://127.0.0.1:$port/" | awk '/Requests\/sec/ {print $2}')
      echo "$round $c $mode $rps" | tee -a "$RUN/runs.txt"
    done
  done
done
python3 - "$RUN/runs.txt" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1]) if len(line.split()) == 4]
for c in sorted({r[1] for r in rows}, key=int):
    by = {}
    for rnd, conns, mode, rps in rows:
        if conns == c:
            by.setdefault(rnd, {})[mode] = float(rps)
    ratios = [v["inline"] / v["spawned"] for v in by.values() if "inline" in v and "spawned" in v]
    print(f"c{c}: inline / spawned per round {[round(x, 2) for x in ratios]}, median {statistics.median(ratios):.2f}")
PY

#!/usr/bin/env bash
# Soak: floods and slow clients together against two tollgate instances sharing one
# PostgreSQL database, for a bounded time, on loopback only. Checks that no window let more
# requests through than the limit, and prints RSS over time.
#
#   bench/soak.sh                      # 180 s
#   SOAK_SECONDS=60 bench/soak.sh      # shorter
#
# Knobs: SOAK_SECONDS [180], LIMIT [100], WINDOW [10] (seconds), FLOODERS [32], SLOW [100],
# PGURL [postgres://postgres@127.0.0.1:5432/postgres] (the server; a fresh database is made),
# OUT [bench/results/soak-<ts>].
set -euo pipefail
cd "$(dirname "$0")/.."

SOAK_SECONDS=${SOAK_SECONDS:-180}
LIMIT=${LIMIT:-100}
WINDOW=${WINDOW:-10}
FLOODERS=${FLOODERS:-32}
SLOW=${SLOW:-100}
PGURL=${PGURL:-postgres://postgres@127.0.0.1:5432/postgres}
TS=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT:-bench/results/soak-$TS}
mkdir -p "$OUT"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
UP_PORT=$(free_port); P1=$(free_port); P2=$(free_port)
DB="tollgate_soak_$$"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  psql "$PGURL" -qc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT INT TERM

cargo build --release --quiet
psql "$PGURL" -qc "CREATE DATABASE $DB" >/dev/null
DBURL="${PGURL%/*}/$DB"

python3 bench/lib/soak.py --upstream-port "$UP_PORT" --ports "$P1,$P2" \
  --seconds "$SOAK_SECONDS" --limit "$LIMIT" --window "$WINDOW" \
  --flooders "$FLOODERS" --slow "$SLOW" --ready-file "$OUT/ready" > "$OUT/soak.json" &
DRIVER=$!
PIDS+=("$DRIVER")
for _ in $(seq 100); do [ -f "$OUT/ready" ] && break; sleep 0.1; done

for port in "$P1" "$P2"; do
  cat > "$OUT/tollgate-$port.toml" <<TOML
[server]
listen = ["127.0.0.1:$port"]
header_read_timeout = "5s"
idle_timeout = "30s"

[store]
url = "$DBURL"
timeout = "200ms"

[keys]
secret = "soak"

[upstreams.app]
url = "http://127.0.0.1:$UP_PORT"

[[routes]]
name = "limited"
path_prefix = "/limited"
upstream = "app"

  [[routes.limits]]
  key = "global"
  requests = $LIMIT
  window = "${WINDOW}s"

[[routes]]
name = "open"
upstream = "app"
TOML
  RUST_LOG=warn target/release/tollgate --config "$OUT/tollgate-$port.toml" 2>"$OUT/tollgate-$port.log" &
  PIDS+=("$!")
done
sleep 1
echo "${PIDS[1]} ${PIDS[2]}" > "$OUT/ready.go"

echo "soak: ${SOAK_SECONDS}s, 2 instances on one database, $FLOODERS flooders, $SLOW slow clients, limit $LIMIT per ${WINDOW}s" >&2
status=0
wait "$DRIVER" || status=$?
PIDS=("${PIDS[@]:1}")
python3 - "$OUT/soak.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"duration            {r['seconds']} s, {r['instances']} instances")
print(f"flood responses     {r['flood_responses']}")
print(f"slow clients        {r['slow_clients']}")
print(f"upstream requests   {r['upstream_requests']} over {r['windows']} windows")
print(f"worst window        {r['worst_window']} (limit {r['limit']}): {'held' if r['limit_held'] else 'EXCEEDED'}")
print(f"RSS KiB first/last/peak per instance: {r['rss_kib_first']} / {r['rss_kib_last']} / {r['rss_kib_peak']}")
PY
exit "$status"

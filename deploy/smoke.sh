#!/usr/bin/env bash
# End-to-end check of docker-compose.yml against the images this host has (pulled, or built by
# deploy/standin-images.sh where no registry is reachable):
#
#   1. build the image and start the stack; both replicas become healthy (GET /readyz);
#   2. a limit is shared across the replicas: 5 requests per minute on /login, alternating
#      between replica a (127.0.0.1:18080) and b (:18081), then both answer 429;
#   3. SIGHUP reloads an edited configuration (the /login limit raised to 50): /login answers
#      200 again on both, and tollgate_config_reloads_total{result="success"} counts it;
#   4. a stop drains and exits 0 ("tollgate stopped" in each replica's log);
#   5. the stack is removed (KEEP=1 leaves it running for a look).
#
# Uses `docker compose` (v2). With only the old Python docker-compose (v1), which rejects the
# top-level `name:`, it runs a copy of the file without that line under the same project name.
# Exits non-zero, saying which step failed, on any failure. Only 127.0.0.1 is contacted.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
project=tollgate

fail() {
  echo "smoke: FAIL: $*" >&2
  exit 1
}
step() { echo "== $*"; }

if docker compose version >/dev/null 2>&1; then
  compose=(docker compose -p "$project" -f "$repo/docker-compose.yml")
  echo "smoke: $(docker compose version)"
elif command -v docker-compose >/dev/null; then
  echo "smoke: $(docker-compose version --short 2>/dev/null || true): Compose v1; the file's top-level"
  echo "       'name:' needs v2, so a copy without it runs under project name $project"
  v1file="$(mktemp "${TMPDIR:-/tmp}/tollgate-compose-v1.XXXXXX.yml")"
  sed '/^name:/d' "$repo/docker-compose.yml" > "$v1file"
  compose=(docker-compose -p "$project" --project-directory "$repo" -f "$v1file")
else
  fail "neither 'docker compose' (v2) nor docker-compose is installed"
fi

# A copy of the configuration the replicas mount, so step 3 can edit it. It is rewritten in
# place (same inode), because a bind-mounted file keeps pointing at the inode it was given.
work="$(mktemp -d "${TMPDIR:-/tmp}/tollgate-smoke.XXXXXX")"
chmod 755 "$work"
cp "$repo/docker/proxy.toml" "$work/proxy.toml"
chmod 644 "$work/proxy.toml"
export TOLLGATE_COMPOSE_CONFIG="$work/proxy.toml"

cleanup() {
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "smoke: logs of the failed run:" >&2
    "${compose[@]}" logs --no-color --tail 40 >&2 || true
  fi
  if [ "${KEEP:-0}" = 1 ]; then
    echo "smoke: KEEP=1: the stack is still running (config copy: $work/proxy.toml)"
  else
    "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
    rm -rf "$work"
  fi
  [ -n "${v1file:-}" ] && rm -f "$v1file"
  exit "$rc"
}
trap cleanup EXIT

container() { "${compose[@]}" ps -q "$1"; }

# Polls a condition (a command) once a second for up to $1 seconds.
wait_for() {
  local seconds="$1"
  shift
  for _ in $(seq 1 "$seconds"); do
    if "$@"; then return 0; fi
    sleep 1
  done
  return 1
}

healthy() {
  local id
  id="$(container "$1")"
  [ -n "$id" ] && [ "$(docker inspect -f '{{.State.Health.Status}}' "$id")" = healthy ]
}

status() { curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$@"; }
login_allowed() { [ "$(status -X POST "http://127.0.0.1:$1/login")" = 200 ]; }

step "1. build and start"
"${compose[@]}" build
"${compose[@]}" up -d
for replica in tollgate-a tollgate-b; do
  wait_for 120 healthy "$replica" || fail "$replica did not become healthy"
  echo "smoke: $replica healthy"
done
for port in 19901 19902; do
  [ "$(status "http://127.0.0.1:$port/readyz")" = 200 ] || fail "/readyz on :$port is not 200"
  [ "$(status "http://127.0.0.1:$port/healthz")" = 200 ] || fail "/healthz on :$port is not 200"
done

step "2. one limit across both replicas"
# Fixed one-minute windows aligned to the epoch: start early in a minute, so all seven
# requests fall into the same window.
while [ "$(date +%S | sed 's/^0//')" -ge 45 ]; do sleep 1; done
codes=()
for i in 1 2 3 4 5 6 7; do
  if [ $((i % 2)) = 1 ]; then port=18080; else port=18081; fi
  codes+=("$(status -X POST -d "attempt $i" "http://127.0.0.1:$port/login")")
done
echo "smoke: /login a,b,a,b,a,b,a -> ${codes[*]}"
[ "${codes[*]}" = "200 200 200 200 200 429 429" ] ||
  fail "expected 200 five times then 429 from both replicas, got ${codes[*]}"
body="$(curl -s --max-time 5 -X PUT -d 'echo me' http://127.0.0.1:18081/api/thing)"
echo "smoke: PUT through replica b -> $body"
case "$body" in *'"method": "PUT"'*'"body": "echo me"'*) ;; *) fail "the demo backend's echo is wrong" ;; esac

step "3. SIGHUP reload"
sed 's/^  requests = 5$/  requests = 50/' "$repo/docker/proxy.toml" > "$work/edited.toml"
grep -q '^  requests = 50$' "$work/edited.toml" || fail "could not edit the /login limit"
cat "$work/edited.toml" > "$work/proxy.toml"
"${compose[@]}" kill -s HUP tollgate-a tollgate-b
for port in 18080 18081; do
  wait_for 30 login_allowed "$port" ||
    fail "/login through :$port still refused after the reload"
done
for port in 19901 19902; do
  curl -s --max-time 5 "http://127.0.0.1:$port/metrics" |
    grep -q '^tollgate_config_reloads_total{result="success"} 1$' ||
    fail "no successful reload counted on :$port"
done
echo "smoke: both replicas reloaded (/login allowed again; tollgate_config_reloads_total{result=\"success\"} 1)"

step "4. clean stop"
ids=("$(container tollgate-a)" "$(container tollgate-b)")
"${compose[@]}" stop -t 20 tollgate-a tollgate-b
for id in "${ids[@]}"; do
  code="$(docker inspect -f '{{.State.ExitCode}}' "$id")"
  [ "$code" = 0 ] || fail "container $id exited $code"
  docker logs "$id" 2>&1 | grep -q 'tollgate stopped' || fail "container $id did not log 'tollgate stopped'"
done
echo "smoke: both replicas stopped with exit 0 after draining"

echo "smoke: PASS"

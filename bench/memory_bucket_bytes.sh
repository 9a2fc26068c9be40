#!/usr/bin/env bash
# bench/memory_bucket_bytes.sh - resident memory per live bucket of the memory store.
#
# Runs the example examples/memory_bucket_bytes.rs: KEYS distinct buckets, named as the proxy
# names them (`<scope>:<label>:<hex SHA-256>`), one increment each, through the real memory
# store at the default bound (`store.memory_buckets` = 1,000,000); it prints the growth of its
# RSS divided by the buckets it holds, then the growth for as many new keys once those
# windows have ended (memory reused: near zero). Every WINDOW mode in MODES is one run, in a
# fresh process. No servers, no network; a few seconds per run.
#
# Usage: [KNOB=value ...] bench/memory_bucket_bytes.sh
# Knobs: KEYS [500000] WINDOW_SECS [3600] MODES ["fixed sliding"]
#        BUILD [1] (cargo build --release --example memory_bucket_bytes)
#        BIN [target/release/examples/memory_bucket_bytes] (another build's, to compare)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
KEYS=${KEYS:-500000}
WINDOW_SECS=${WINDOW_SECS:-3600}
MODES=${MODES:-fixed sliding}
BUILD=${BUILD:-1}
BIN=${BIN:-$ROOT/target/release/examples/memory_bucket_bytes}

if [[ $BUILD == 1 ]]; then
  (cd "$ROOT" && cargo build --release --quiet --example memory_bucket_bytes)
fi
[[ -x $BIN ]] || { echo "no example binary at $BIN (BUILD=1 builds it)" >&2; exit 1; }
for mode in $MODES; do
  "$BIN" "$KEYS" "$WINDOW_SECS" "$mode"
done

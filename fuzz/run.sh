#!/usr/bin/env bash
# Bounded fuzzing runs of the framing guard, the normaliser (issue 14), the configuration
# loader, and the simple HTTP/1.1 path's differentials against the guard and hyper's client
# (issue 16), not part of CI.
#
#   fuzz/run.sh                 # each target for 60 s
#   SECONDS_EACH=600 fuzz/run.sh
#   TARGETS=framing fuzz/run.sh
#
# Needs the nightly toolchain; installs cargo-fuzz from crates.io when it is missing. Each
# target starts from its seeds under fuzz/seeds/ plus what earlier runs kept in
# fuzz/corpus/ (ignored by git). A crash leaves its input under fuzz/artifacts/<target>/
# and makes this script exit non-zero. The last lines of each run (executions, coverage)
# are printed.
set -euo pipefail
cd "$(dirname "$0")"
SECONDS_EACH=${SECONDS_EACH:-60}
TARGETS=${TARGETS:-"framing normalise config simple_head upstream_response"}
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz
fi
cargo +nightly fuzz build
status=0
for target in $TARGETS; do
  mkdir -p "corpus/$target"
  log="$(mktemp)"
  echo "== $target for ${SECONDS_EACH}s"
  if ! cargo +nightly fuzz run "$target" "corpus/$target" "seeds/$target" -- \
      -max_total_time="$SECONDS_EACH" -max_len=16384 -timeout=10 -print_final_stats=1 \
      >"$log" 2>&1; then
    status=1
    echo "!! $target failed; see fuzz/artifacts/$target/"
  fi
  grep -E "^(Done|stat::number_of_executed_units|stat::peak_rss_mb|#[0-9]+ *DONE)|SUMMARY|panicked" "$log" || tail -5 "$log"
  rm -f "$log"
done
exit $status

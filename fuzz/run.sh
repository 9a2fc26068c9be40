#!/usr/bin/env bash
# Bounded fuzzing runs of the framing guard, the normaliser, the configuration loader, and
# the two differentials of tollgate's own HTTP/1.1 path against the framing guard and hyper
# (`simple_head`, `upstream_response`; .ci/run runs these two for 60 s each).
#
#   fuzz/run.sh                 # each target for 60 s
#   SECONDS_EACH=600 fuzz/run.sh
#   TARGETS=framing fuzz/run.sh
#   SANITIZER=none fuzz/run.sh  # no AddressSanitizer: builds and runs faster; the crate has no
#                               # unsafe code to check, and a differential fails by panicking
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
SANITIZER=${SANITIZER:-address}
if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "fuzz/run.sh: the nightly toolchain is missing (rustup toolchain install nightly)" >&2
  exit 1
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  cargo install --locked cargo-fuzz
fi
for target in $TARGETS; do
  cargo +nightly fuzz build -s "$SANITIZER" "$target"
done
status=0
for target in $TARGETS; do
  mkdir -p "corpus/$target"
  log="$(mktemp)"
  echo "== $target for ${SECONDS_EACH}s"
  if ! cargo +nightly fuzz run -s "$SANITIZER" "$target" "corpus/$target" "seeds/$target" -- \
      -max_total_time="$SECONDS_EACH" -max_len=16384 -timeout=10 -print_final_stats=1 \
      >"$log" 2>&1; then
    status=1
    echo "!! $target failed; see fuzz/artifacts/$target/"
    tail -40 "$log"
  fi
  grep -E "^(Done|stat::number_of_executed_units|stat::peak_rss_mb|#[0-9]+ *DONE)|SUMMARY|panicked" "$log" || tail -5 "$log"
  rm -f "$log"
done
exit $status

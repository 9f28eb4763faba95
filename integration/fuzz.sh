#!/usr/bin/env bash
# Runs each cargo-fuzz target (fuzz/) for a bounded time, then minimises its
# corpus. Optional, not part of CI.
#   integration/fuzz.sh [SECONDS]      (default 60 per target)
# cargo-fuzz asks rustc for -Z flags; RUSTC_BOOTSTRAP=1 lets the one stable
# toolchain on these machines accept them. No sanitizer (-s none): it would
# need the nightly standard library.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
for target in rules request stored; do
  mkdir -p "corpus/$target"
  cargo fuzz run -s none "$target" "corpus/$target" "seeds/$target" -- \
    -max_total_time="$secs" -max_len=8192 -timeout=10 -rss_limit_mb=2048
  cargo fuzz cmin -s none "$target" "corpus/$target"
done

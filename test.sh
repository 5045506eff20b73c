#!/usr/bin/env bash
# The one command that runs every test (CI runs exactly this, via .ci/run):
#   1. the read-only gate: rustfmt and clippy, warnings are errors
#   2. cargo test --workspace (units, store crash tests, whole-broker tests)
#   3. conformance/: third-party clients against a broker started on free ports
#   4. fuzz/run.sh: each decoder's libFuzzer target for FUZZ_SECS seconds (default 60)
# It installs what it needs (a Python venv with pinned client libraries, cargo-fuzz).
set -euo pipefail
cd "$(dirname "$0")"

echo "== gate: cargo fmt --check, cargo clippy -D warnings"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

echo "== cargo test --workspace"
cargo test --workspace

echo "== conformance"
conformance/run.sh

echo "== fuzz (${FUZZ_SECS:-60} s per target)"
fuzz/run.sh

#!/usr/bin/env bash
# The one command that runs every test (CI runs exactly this, via .ci/run):
#   1. the read-only gate: rustfmt and clippy, warnings are errors
#   2. cargo test --workspace (units, store crash tests, whole-broker tests, including
#      the crash loop, abuse and soak tests: TRIAD_CRASH_ROUNDS, TRIAD_SOAK_SECS)
#   3. conformance/: third-party clients against a broker started on free ports
#   4. fuzz/run.sh: each decoder's libFuzzer target for FUZZ_SECS seconds (default 60)
# It installs what it needs (a Python venv with pinned client libraries, cargo-fuzz).
#
# It ends with one line, `N passed, M failed`: cargo's tests, conformance's pytest tests
# and the fuzz targets, summed (each runner's own counts follow in parentheses). It
# stops at the first failing stage and exits non-zero; the line then says where.
set -euo pipefail
cd "$(dirname "$0")"

logs=$(mktemp -d -t triad-test.XXXXXX)
stage="start"

# Sums the `test result: ... N passed; M failed` lines of cargo's output.
cargo_counts() {
    awk '/^test result: /{
        for (i = 1; i <= NF; i++) {
            if ($(i+1) ~ /^passed;/) p += $i
            if ($(i+1) ~ /^failed;/) f += $i
        }
    } END { printf "%d %d\n", p, f }' "$logs/cargo.log" 2>/dev/null || echo "0 0"
}

# pytest's closing summary ("140 passed, 1 failed, 11 xfailed in 80.1s"): passed,
# failed (errors included), and the rest as text.
pytest_counts() {
    local line
    line=$(grep -E '[0-9]+ (passed|failed|error|errors)\b.* in [0-9.]+s' "$logs/conformance.log" 2>/dev/null | tail -1 || true)
    awk -v s="$line" 'BEGIN {
        n = split(s, w, /[ ,=]+/)
        for (i = 2; i <= n; i++) {
            if (w[i] == "passed") p += w[i-1]
            else if (w[i] == "failed" || w[i] ~ /^errors?$/) f += w[i-1]
            else if (w[i] ~ /^(xfailed|skipped|xpassed|deselected)$/) rest = rest " " w[i-1] " " w[i]
        }
        printf "%d %d%s\n", p, f, rest
    }'
}

fuzz_counts() {
    local ok bad
    ok=$(grep -c '^fuzz .*: ok,' "$logs/fuzz.log" 2>/dev/null || true)
    bad=$(grep -c '^fuzz .*: FAILED' "$logs/fuzz.log" 2>/dev/null || true)
    echo "${ok:-0} ${bad:-0}"
}

closing_line() {
    local rc=$?
    set +e
    local cp cf pp pf prest fp ff
    read -r cp cf < <(cargo_counts)
    read -r pp pf prest < <(pytest_counts)
    read -r fp ff < <(fuzz_counts)
    echo
    echo "== summary: cargo test ${cp} passed, ${cf} failed; conformance ${pp} passed, ${pf} failed${prest:+ ($prest)}; fuzz ${fp} targets ok, ${ff} failed"
    if [ "$rc" -ne 0 ]; then
        echo "== FAILED in stage: $stage (exit $rc)"
    fi
    echo "$((cp + pp + fp)) passed, $((cf + pf + ff)) failed"
    rm -rf "$logs"
    exit "$rc"
}
trap closing_line EXIT

stage="gate"
echo "== gate: cargo fmt --check, cargo clippy -D warnings"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

stage="cargo test --workspace"
echo "== cargo test --workspace"
cargo test --workspace 2>&1 | tee "$logs/cargo.log"

stage="conformance"
echo "== conformance"
conformance/run.sh 2>&1 | tee "$logs/conformance.log"

stage="fuzz"
echo "== fuzz (${FUZZ_SECS:-60} s per target)"
fuzz/run.sh 2>&1 | tee "$logs/fuzz.log"

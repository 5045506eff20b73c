#!/usr/bin/env bash
# Runs every fuzz target (cargo-fuzz, libFuzzer) for a bounded time from the committed
# seed corpus in fuzz/corpus/<target>/, and fails on the first crash, panic or hang.
#
#   FUZZ_SECS       seconds per target (default 60)
#   FUZZ_TARGETS    which targets (default: all six)
#   FUZZ_JOBS       targets run at once (default 2: the CI machine's cores)
#   FUZZ_SANITIZER  cargo-fuzz --sanitizer (default none: the decoders are safe Rust,
#                   so panics, overflows and hangs are what is looked for; "address"
#                   roughly halves the speed)
#
# cargo-fuzz passes nightly -Z flags to rustc; RUSTC_BOOTSTRAP=1 lets the stable
# toolchain take them, so no nightly toolchain is needed. New inputs go to a temporary
# directory, not into the committed corpus. A crash leaves its input in
# fuzz/artifacts/<target>/; turn it into a regression test in the codec's crate.
set -euo pipefail
cd "$(dirname "$0")"

secs=${FUZZ_SECS:-60}
targets=${FUZZ_TARGETS:-"amqp_decode stomp_decode mqtt_decode store_record selector_parse replication_decode"}
jobs=${FUZZ_JOBS:-2}
sanitizer=${FUZZ_SANITIZER:-none}
export RUSTC_BOOTSTRAP=1

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

echo "== fuzz: building targets (sanitizer: $sanitizer)"
cargo fuzz build --sanitizer "$sanitizer"

work=$(mktemp -d -t triad-fuzz.XXXXXX)
trap 'rm -rf "$work"' EXIT

run_one() {
    local t=$1
    mkdir -p "$work/$t"
    # -timeout: one input taking 10 s is a hang, reported like a crash
    cargo fuzz run --sanitizer "$sanitizer" "$t" "$work/$t" "corpus/$t" -- \
        -max_total_time="$secs" -timeout=10 -print_final_stats=1 \
        >"$work/$t.log" 2>&1
}

summary() {
    local t=$1 rc=$2 runs execs
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$t.log" | tail -1)
    execs=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$work/$t.log" | tail -1)
    if [ "$rc" -eq 0 ]; then
        echo "fuzz $t: ok, ${runs:-?} runs in ${secs}s (${execs:-?} exec/s)"
    else
        echo "fuzz $t: FAILED (exit $rc); the end of its log:"
        tail -60 "$work/$t.log"
        ls -1 "artifacts/$t/" 2>/dev/null | sed "s|^|  input: fuzz/artifacts/$t/|"
    fi
}

failed=0
set -- $targets
while [ $# -gt 0 ]; do
    batch=()
    pids=()
    for _ in $(seq 1 "$jobs"); do
        [ $# -gt 0 ] || break
        batch+=("$1")
        run_one "$1" &
        pids+=($!)
        shift
    done
    for i in "${!batch[@]}"; do
        rc=0
        wait "${pids[$i]}" || rc=$?
        summary "${batch[$i]}" "$rc"
        [ "$rc" -eq 0 ] || failed=1
    done
done
exit "$failed"

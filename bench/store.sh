#!/usr/bin/env bash
# The store benchmark matrix behind BENCHMARKS.md:
#   disk baselines (dd bandwidth; write+fdatasync loops) for 16 B, 1 KiB, 64 KiB, then
#   triad-bench store for the same sizes: sync with 1, 8, 64 writers, async with 1 and 8,
#   each run bounded to $DURATION seconds and read back (--read, verified).
# Prints a Markdown table; the raw result lines (one JSON object each) go to $OUT.
#
#   bench/store.sh                      # DURATION=5, data under ./ (must be a real disk)
#   DURATION=2 DIR=/mnt/ssd bench/store.sh
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-5}
DIR=${DIR:-.}
OUT=${OUT:-bench-results.jsonl}
SIZES=${SIZES:-"16 1024 65536"}

cargo build --release --quiet --bin triad-bench
B=target/release/triad-bench
: >"$OUT"

run() {
    echo "+ triad-bench $*" >&2
    "$B" "$@" --dir "$DIR" --json --quiet | tee -a "$OUT" >/dev/null
}

run disk --test dd --dd-mib 1024
for size in $SIZES; do
    run disk --test overwrite,fallocated --size "$size" --duration "$DURATION"
done
for size in $SIZES; do
    for w in 1 8 64; do
        run store --flush sync --size "$size" --writers "$w" --duration "$DURATION" --read
    done
    for w in 1 8; do
        run store --flush async --size "$size" --writers "$w" --duration "$DURATION" --read
    done
done

"$B" table "$OUT"

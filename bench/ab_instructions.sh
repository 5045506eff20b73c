#!/usr/bin/env bash
# Instructions per delivered message of two broker builds, alternated: a stable A/B on a
# shared, noisy machine (wall-clock CPU time varies by +/-10 % here; instruction counts
# by far less). This VM exposes no hardware counters to `perf stat`, so the count is
# valgrind's (callgrind's `Ir`: user-space instructions of the whole broker process,
# startup included, which both builds pay alike).
#
#   bench/ab_instructions.sh BEFORE_BIN AFTER_BIN ROUNDS TRIAD_BENCH -- mqtt --qos 1 --size 64 \
#       --publishers 4 --subscribers 4 --topics 4 --count 20000
#
# Each round runs BEFORE then AFTER, each on a fresh data directory, driven by the same
# TRIAD_BENCH with the given arguments (`--port` added), and prints one line per run:
# `label round instructions received instructions_per_message`. With KEEP_DIR set, each
# run's inclusive per-function profile is kept there as `<label>-<round>.txt`.
set -euo pipefail
[ $# -ge 5 ] && [ "$5" = -- ] || { sed -n 2,14p "$0"; exit 2; }
before=$1 after=$2 rounds=$3 bench=$4
shift 5
proto=$1
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 1; }
WORK=$(mktemp -d)
PID=
cleanup() {
    [ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

run() {
    local label=$1 bin=$2 round=$3
    shift 3
    rm -rf "$WORK/data" && mkdir -p "$WORK/data"
    valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.out" \
        "$bin" --data-dir "$WORK/data" --amqp-listen 127.0.0.1:0 \
        --stomp-listen 127.0.0.1:0 --mqtt-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
        2>"$WORK/triad.log" &
    PID=$!
    for _ in $(seq 1 1200); do
        grep -q "broker ready" "$WORK/triad.log" 2>/dev/null && break
        kill -0 "$PID" 2>/dev/null || { cat "$WORK/triad.log" >&2; exit 1; }
        sleep 0.1
    done
    local port
    port=$(grep -o "listening proto=$proto addr=[^ ]*" "$WORK/triad.log" | head -1 | sed 's/.*:\([0-9]*\)$/\1/')
    [ -n "$port" ] || { echo "no $proto listener in the log" >&2; exit 1; }
    "$bench" "$@" --port "$port" --drain-timeout 60 --json --quiet >"$WORK/result.json"
    kill -TERM "$PID"
    wait "$PID" 2>/dev/null || true
    PID=
    local received total
    received=$(grep -o '"received":[0-9]*' "$WORK/result.json" | head -1 | cut -d: -f2)
    callgrind_annotate "$WORK/cg.out" >"$WORK/annotate.txt" 2>/dev/null
    total=$(awk '/PROGRAM TOTALS/ {gsub(",","",$1); print $1}' "$WORK/annotate.txt" | head -1)
    if [ -n "${KEEP_DIR:-}" ]; then
        mkdir -p "$KEEP_DIR"
        callgrind_annotate --inclusive=yes "$WORK/cg.out" >"$KEEP_DIR/$label-$round.txt" 2>/dev/null || true
    fi
    echo "$label $round $total $received $((total / received))"
}

for r in $(seq 1 "$rounds"); do
    run before "$before" "$r" "$@"
    run after "$after" "$r" "$@"
done

#!/usr/bin/env bash
# Instruction profile of the broker's hot path under one load scenario.
#
#   bench/profile.sh amqp --size 1k --count 50000
#   bench/profile.sh stomp --size 1k --count 50000
#   bench/profile.sh mqtt --qos 1 --size 64 --publishers 4 --subscribers 4 --topics 4 --count 50000
#   bench/profile.sh connect --count 5000 --parallel 4      # connection setup (MQTT by
#                                  default; --proto stomp|amqp for theirs), per connect
#
# Runs the release broker under `valgrind --tool=callgrind` (instruction counts: repeatable
# on a shared, noisy machine, unlike wall-clock profiles; this machine's perf has no
# hardware counters), drives it with `triad-bench <args>` (the port is added), stops it
# with SIGTERM, and prints the functions with the most instructions, exclusive and
# inclusive, plus instructions per delivered message. Output file:
# $WORK/callgrind.out (WORK defaults to a temp dir, printed).
#
# Environment: SKIP_BUILD=1 (use the existing release binaries), TOP (rows, default 25),
# KEEP=1 (keep WORK).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n 2,16p "$0"; exit 2; }
proto=$1
case $proto in amqp|stomp|mqtt|connect) ;; *) echo "first argument: amqp, stomp, mqtt or connect" >&2; exit 2 ;; esac
# connect: the listener is that of its --proto (default mqtt); no drain phase
mode=$proto
extra=(--drain-timeout 30)
if [ "$mode" = connect ]; then
    proto=mqtt
    extra=()
    prev=
    for a in "${@:2}"; do
        [ "$prev" = --proto ] && proto=$a
        prev=$a
    done
    case $proto in amqp|stomp|mqtt) ;; *) echo "connect: --proto amqp, stomp or mqtt (plain listeners)" >&2; exit 2 ;; esac
fi
TOP=${TOP:-25}
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 1; }
if [ -z "${SKIP_BUILD:-}" ]; then
    cargo build --release --quiet --bins
fi
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK/data"
PID=
cleanup() {
    [ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null || true
    [ -n "${KEEP:-}" ] || rm -rf "$WORK/data"
}
trap cleanup EXIT INT TERM

valgrind --tool=callgrind --callgrind-out-file="$WORK/callgrind.out" \
    target/release/triad --data-dir "$WORK/data" --amqp-listen 127.0.0.1:0 \
    --stomp-listen 127.0.0.1:0 --mqtt-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
    2>"$WORK/triad.log" &
PID=$!
for _ in $(seq 1 600); do
    grep -q "broker ready" "$WORK/triad.log" 2>/dev/null && break
    kill -0 "$PID" 2>/dev/null || { cat "$WORK/triad.log" >&2; exit 1; }
    sleep 0.1
done
port=$(grep -o "listening proto=$proto addr=[^ ]*" "$WORK/triad.log" | head -1 | sed 's/.*:\([0-9]*\)$/\1/')
[ -n "$port" ] || { echo "no $proto listener in the log" >&2; cat "$WORK/triad.log" >&2; exit 1; }
echo "broker under callgrind: pid $PID, $proto port $port (work dir $WORK)" >&2

target/release/triad-bench "$@" --port "$port" "${extra[@]}" --json --quiet \
    | tee "$WORK/result.json"
kill -TERM "$PID"
wait "$PID" 2>/dev/null || true
PID=

if [ "$mode" = connect ]; then
    # warm-up connects (persistent sessions) and the final clean ones count as well
    received=$(grep -o '"connects":[0-9]*' "$WORK/result.json" | head -1 | cut -d: -f2)
else
    received=$(grep -o '"received":[0-9]*' "$WORK/result.json" | head -1 | cut -d: -f2)
fi
callgrind_annotate "$WORK/callgrind.out" >"$WORK/exclusive.txt" 2>/dev/null
callgrind_annotate --inclusive=yes "$WORK/callgrind.out" >"$WORK/inclusive.txt" 2>/dev/null
total=$(awk '/PROGRAM TOTALS/ {gsub(",","",$1); print $1; exit}' "$WORK/exclusive.txt")
unit=$([ "$mode" = connect ] && echo connect || echo "delivered message")
echo "total instructions: $total; ${unit}s: ${received:-?}"
if [ -n "${received:-}" ] && [ "${received:-0}" -gt 0 ]; then
    echo "instructions per $unit (whole process, incl. startup): $((total / received))"
fi
echo "== top $TOP exclusive"
awk '/file:function/ {on=1; getline; next} on' "$WORK/exclusive.txt" | head -n "$TOP" | cut -c1-200
echo "== top $TOP inclusive"
awk '/file:function/ {on=1; getline; next} on' "$WORK/inclusive.txt" | head -n "$TOP" | cut -c1-200

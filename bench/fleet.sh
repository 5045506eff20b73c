#!/usr/bin/env bash
# The fleet benchmark side by side: `triad-bench fleet` against Triad, Mosquitto
# (persistence on) and RabbitMQ's MQTT plugin, for each N given. Prints one Markdown row
# per run; result lines (JSON) are appended to $OUT, client logs go to $LOGDIR.
#
#   bench/fleet.sh 1000 10000                     # every broker, N = 1,000 then 10,000
#   BROKERS="triad mosquitto" bench/fleet.sh 1000
#
# Triad and Mosquitto are started by triad-bench itself, each on a fresh data directory
# under $DIR, so it can also stop and restart them (restart time, session-present after
# the restart). Mosquitto gets its own config (persistence true; the peers tool runs it
# with persistence false) and, as always, writes its store only at shutdown or every
# autosave_interval (1800 s), so its on-disk size is read after the stop. RabbitMQ is the
# peers tool's (bench/../shared tools `peers`, given as $PEERS): restarted with fresh state
# before each run (`peers restart-rabbit`), measured from its pid (found from its MQTT
# port) and its data directory $RABBIT_DATA; the bench does not restart it.
#
# Environment: BROKERS (triad mosquitto rabbitmq) DIR (.) OUT (fleet-results.jsonl)
#   LOGDIR (a temp dir) TIME_LIMIT (600 s per phase) IDLE (19000 idle connections at most)
#   PARALLEL (50) TRIAD_BIN (target/release/triad) MOSQUITTO_BIN (mosquitto on PATH or
#   /usr/sbin/mosquitto) PEERS (the peers tool; needed for rabbitmq) RABBIT_MQTT_PORT (1890)
#   RABBIT_DATA (the peers tool's state dir + /rabbit/mnesia) SKIP_BUILD=1
#   TRIAD_PUBLISH (1000): Triad gets a message queued for at most this many sessions,
#   because on current main each queue that holds a message preallocates a 5.7 MB
#   consume-queue file (10,000 would take 60 GB); disk per session with a message is then
#   computed over those sessions. Blocks are 1,000 sessions (N/10 below N = 10,000).
set -uo pipefail
cd "$(dirname "$0")/.."

BROKERS=${BROKERS:-triad mosquitto rabbitmq}
DIR=${DIR:-.}
OUT=${OUT:-fleet-results.jsonl}
TIME_LIMIT=${TIME_LIMIT:-600}
IDLE=${IDLE:-19000}
PARALLEL=${PARALLEL:-50}
TRIAD_BIN=${TRIAD_BIN:-target/release/triad}
MOSQUITTO_BIN=${MOSQUITTO_BIN:-$(command -v mosquitto || echo /usr/sbin/mosquitto)}
RABBIT_MQTT_PORT=${RABBIT_MQTT_PORT:-1890}
RABBIT_DATA=${RABBIT_DATA:-${ACC_STATE:-/tmp/triad-peers}/rabbit/mnesia}
B=target/release/triad-bench

[ $# -gt 0 ] || { sed -n 2,28p "$0"; exit 2; }
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    cargo build --release --quiet || exit 1
fi
LOGDIR=${LOGDIR:-$(mktemp -d /tmp/triad-fleet.XXXXXX)}

pid_on_port() { # the pid of the process listening on 127.0.0.1:PORT
    ss -ltnpH "sport = :$1" 2>/dev/null | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2
}
field() { # a numeric JSON field (first occurrence of "name":number), or "–"
    local v
    v=$(grep -o "\"$2\":[-0-9.e+]*" <<<"$1" | head -1 | cut -d: -f2)
    echo "${v:-–}"
}
kib() { awk -v x="$1" 'BEGIN { if (x == "–" || x == "") print "–"; else printf "%.1f", x / 1024 }'; }

rows=()
for n in "$@"; do
    block=$((n / 10 < 1000 ? (n / 10 > 0 ? n / 10 : 1) : 1000))
    for broker in $BROKERS; do
        common=(fleet --sessions "$n" --block "$block" --time-limit "$TIME_LIMIT"
            --idle-connections "$IDLE" --parallel "$PARALLEL" --json)
        case $broker in
        triad) args=(--triad "$TRIAD_BIN" --dir "$DIR" --publish "${TRIAD_PUBLISH:-1000}") ;;
        mosquitto) args=(--mosquitto "$MOSQUITTO_BIN" --dir "$DIR") ;;
        rabbitmq)
            if [ -z "${PEERS:-}" ]; then
                echo "rabbitmq: set PEERS to the peers tool" >&2
                continue
            fi
            # RabbitMQ's crash dumps go to the peers tool's state dir; run from a temp dir anyway
            (cd "$LOGDIR" && "$PEERS" restart-rabbit >&2)
            pid=$(pid_on_port "$RABBIT_MQTT_PORT")
            if [ -z "$pid" ]; then
                echo "rabbitmq: nothing listening on $RABBIT_MQTT_PORT" >&2
                continue
            fi
            args=(--port "$RABBIT_MQTT_PORT" --broker-pid "$pid" --data-dir "$RABBIT_DATA" --name rabbitmq)
            ;;
        *) echo "unknown broker $broker" >&2; exit 2 ;;
        esac
        log="$LOGDIR/fleet-$broker-$n.log"
        echo "+ triad-bench ${common[*]} ${args[*]}" >&2
        line=$("$B" "${common[@]}" "${args[@]}" 2>"$log" | tail -1)
        if [ -z "$line" ]; then
            echo "  $broker N=$n failed: $(tail -1 "$log")" >&2
            continue
        fi
        echo "$line" >>"$OUT"
        row="| $broker | $n | $(field "$line" sessions) | $(field "$line" sessions_per_s) | $(field "$line" first_block_per_s) | $(field "$line" last_block_per_s) | $(field "$line" broker_cpu_us_per_session) | $(kib "$(field "$line" bytes_per_session_idle)") | $(kib "$(field "$line" bytes_per_session_with_message)") | $(kib "$(field "$line" bytes_per_session_after_stop)") | $(field "$line" rss_anon_kib_per_session) | $(field "$line" rss_anon_kib_per_conn) | $(field "$line" connected) | $(field "$line" listen_s) | $(field "$line" ready_s) | $(field "$line" rss_kib_after) |"
        echo "$row" >&2
        rows+=("$row")
    done
done
echo
echo "| broker | N | created | sessions/s | first block/s | last block/s | broker CPU µs/session | disk KiB/session idle | with 1 msg | after stop | RssAnon KiB/session | RssAnon KiB/idle conn | idle conns | restart: listening s | CONNACK sp=1 s | RSS KiB after restart |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
printf '%s\n' "${rows[@]}"

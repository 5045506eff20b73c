#!/usr/bin/env bash
# Side-by-side runs: the same triad-bench scenario against Triad and against a peer broker,
# alternately (A B A B ...), ROUNDS rounds each. Prints one Markdown table row per pair:
# each run's msgs/s, p99 latency and broker CPU µs/msg, and the Triad/peer ratios (for
# mqtt-idle: connects/s and broker RSS KiB per connection).
#
#   bench/compare.sh SCENARIO...          # e.g. bench/compare.sh amqp-transient-1k mqtt-qos1-64
#   bench/compare.sh all                  # every scenario below
#   ROUNDS=3 DURATION=10 bench/compare.sh stomp-1k
#
# Scenarios:
#   amqp-transient-16           1 producer, 1 consumer, 16 B, transient, no-ack, unlimited rate
#   amqp-transient-1k           the same with 1 KiB bodies
#   amqp-persistent-confirm-1k  durable queue, persistent 1 KiB, publisher confirms (window
#                               1000), manual ack, prefetch 1000
#   amqp-fanout-10              1 producer, 1 KiB, fanout exchange with 10 queues, 10 consumers
#   stomp-1k                    1 producer, 1 consumer, /queue/, 1 KiB, ack auto
#   mqtt-qos0-64                4 publishers -> 4 subscribers on 4 topics, 64 B, QoS 0
#   mqtt-qos1-64                the same at QoS 1 (100 in flight per publisher)
#   mqtt-fanout-50              1 publisher at 2,000 msgs/s -> 50 subscribers of one topic,
#                               64 B, QoS 0 (rate-limited: compare p99 and CPU/msg)
#   mqtt-fanout-50-max          the same without a rate limit (throughput; p99 is queueing)
#   mqtt-idle-10k               10,000 idle MQTT connections held 5 s
#
# Triad: built here (cargo build --release) and started once, on ephemeral loopback ports
# (read from its `listening proto=... addr=...` log lines), with a fresh data directory;
# stopped at the end. Peers (bench/../shared tools `peers start`): RabbitMQ for AMQP and
# STOMP, Mosquitto for MQTT (MQTT_PEER=rabbitmq for RabbitMQ's MQTT plugin), on their fixed
# ports; their pids are found from the listening sockets (ss). Unlimited-rate runs measure
# throughput: their p99 includes queueing; broker CPU µs/msg is the steadier figure on a
# shared machine. Result lines (JSON) are appended to $OUT; client logs go to $LOGDIR.
#
# msgs/s counts deliveries (amqp-fanout-10 and mqtt-fanout-50: every copy) from the first
# publish to the last delivery; CPU µs/msg is the broker's CPU time over that span per
# delivery.
#
# Environment: ROUNDS (2) DURATION (5 s of publishing per run) OUT (compare-results.jsonl)
#   PEER_AMQP_PORT (5680) PEER_STOMP_PORT (61620) PEER_MQTT_PORT (1891 Mosquitto; 1890 with
#   MQTT_PEER=rabbitmq) TRIAD_BIN (target/release/triad) SKIP_BUILD=1
#   PEERS (path of the peers tool: restarts the peer before each mqtt-idle run)
set -uo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-2}
DURATION=${DURATION:-5}
OUT=${OUT:-compare-results.jsonl}
MQTT_PEER=${MQTT_PEER:-mosquitto}
PEER_AMQP_PORT=${PEER_AMQP_PORT:-5680}
PEER_STOMP_PORT=${PEER_STOMP_PORT:-61620}
if [ "$MQTT_PEER" = rabbitmq ]; then
    PEER_MQTT_PORT=${PEER_MQTT_PORT:-1890}
else
    PEER_MQTT_PORT=${PEER_MQTT_PORT:-1891}
fi
TRIAD_BIN=${TRIAD_BIN:-target/release/triad}
B=target/release/triad-bench
ALL="amqp-transient-16 amqp-transient-1k amqp-persistent-confirm-1k amqp-fanout-10 stomp-1k mqtt-qos0-64 mqtt-qos1-64 mqtt-fanout-50 mqtt-fanout-50-max mqtt-idle-10k"

[ $# -gt 0 ] || { sed -n 2,40p "$0"; exit 2; }
SCENARIOS=("$@")
[ "${1:-}" = all ] && read -r -a SCENARIOS <<<"$ALL"
for s in "${SCENARIOS[@]}"; do
    case " $ALL " in *" $s "*) ;; *) echo "unknown scenario $s (one of: $ALL)" >&2; exit 2 ;; esac
done

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    cargo build --release --quiet || exit 1
fi

WORK=$(mktemp -d /tmp/triad-compare.XXXXXX)
LOGDIR=${LOGDIR:-$WORK}
TRIAD_PID=
cleanup() {
    stop_triad
    rm -rf "$WORK/data"
}
trap cleanup EXIT INT TERM

# --- Triad ---
start_triad() {
    rm -rf "$WORK/data"
    mkdir -p "$WORK/data"
    "$TRIAD_BIN" --data-dir "$WORK/data" --amqp-listen 127.0.0.1:0 --stomp-listen 127.0.0.1:0 \
        --mqtt-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 2>"$WORK/triad.log" &
    TRIAD_PID=$!
    for _ in $(seq 1 300); do
        grep -q "broker ready" "$WORK/triad.log" 2>/dev/null && break
        kill -0 "$TRIAD_PID" 2>/dev/null || break
        sleep 0.1
    done
    T_AMQP=$(triad_port amqp); T_STOMP=$(triad_port stomp); T_MQTT=$(triad_port mqtt)
    if [ -z "$T_AMQP" ] || ! kill -0 "$TRIAD_PID" 2>/dev/null; then
        echo "triad did not start; its log:" >&2
        cat "$WORK/triad.log" >&2
        exit 1
    fi
    echo "triad pid $TRIAD_PID: amqp=$T_AMQP stomp=$T_STOMP mqtt=$T_MQTT (log $WORK/triad.log)" >&2
}
stop_triad() {
    if [ -n "$TRIAD_PID" ] && kill -0 "$TRIAD_PID" 2>/dev/null; then
        kill -TERM "$TRIAD_PID" 2>/dev/null
        for _ in $(seq 1 100); do kill -0 "$TRIAD_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$TRIAD_PID" 2>/dev/null || true
        wait "$TRIAD_PID" 2>/dev/null
    fi
    TRIAD_PID=
}
triad_port() { # proto -> port, from "listening proto=<p> addr=<ip:port>"
    grep -o "listening proto=$1 addr=[^ ]*" "$WORK/triad.log" | head -1 | sed 's/.*:\([0-9]*\)$/\1/'
}
start_triad

# A broker's RSS rarely shrinks, so mqtt-idle's RSS per connection is only meaningful on a
# freshly started broker: Triad is restarted before each such run, and the peer too when
# PEERS names the peers tool (its stop-/start-mosquitto, restart-rabbit commands).
restart_peer() {
    if [ -z "${PEERS:-}" ]; then
        echo "  note: PEERS not set, the peer is not restarted: its RSS/conn may read low" >&2
        return
    fi
    local port=$PEER_MQTT_PORT
    if [ "$MQTT_PEER" = rabbitmq ]; then
        "$PEERS" restart-rabbit >&2
    else
        "$PEERS" stop-mosquitto >&2
        for _ in $(seq 1 50); do [ -z "$(pid_on_port "$port")" ] && break; sleep 0.2; done
        "$PEERS" start-mosquitto >&2
    fi
}

pid_on_port() { # the pid of the process listening on 127.0.0.1:PORT
    ss -ltnpH "sport = :$1" 2>/dev/null | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2
}

# scenario -> "proto|args" (the port and --broker-pid are added per broker)
scenario() {
    local d="--duration $DURATION"
    case $1 in
    amqp-transient-16) echo "amqp|amqp --size 16 $d" ;;
    amqp-transient-1k) echo "amqp|amqp --size 1k $d" ;;
    amqp-persistent-confirm-1k)
        echo "amqp|amqp --size 1k --persistent --confirm --confirm-window 1000 --manual-ack --prefetch 1000 $d" ;;
    amqp-fanout-10) echo "amqp|amqp --size 1k --fanout 10 $d" ;;
    stomp-1k) echo "stomp|stomp --size 1k $d" ;;
    mqtt-qos0-64) echo "mqtt|mqtt --qos 0 --size 64 --publishers 4 --subscribers 4 --topics 4 $d" ;;
    mqtt-qos1-64) echo "mqtt|mqtt --qos 1 --size 64 --publishers 4 --subscribers 4 --topics 4 $d" ;;
    mqtt-fanout-50) echo "mqtt|mqtt --qos 0 --size 64 --publishers 1 --subscribers 50 --rate 2000 $d" ;;
    mqtt-fanout-50-max) echo "mqtt|mqtt --qos 0 --size 64 --publishers 1 --subscribers 50 $d" ;;
    mqtt-idle-10k) echo "mqtt|mqtt-idle --connections 10000 --hold 5" ;;
    esac
}

field() { # top-level numeric JSON field from a result line, or "–"
    local v
    v=$(grep -o "\"$2\":[-0-9.e+]*" <<<"$1" | head -1 | cut -d: -f2)
    echo "${v:-–}"
}
ratio() {
    awk -v a="$1" -v b="$2" 'BEGIN { if (a+0 > 0 && b+0 > 0) printf "%.2f×", a/b; else print "–" }'
}
num() {
    awk -v x="$1" 'BEGIN { if (x == "–" || x == "") print "–"; else if (x+0 >= 100) printf "%.0f", x; else printf "%.2f", x }'
}

# run BROKER SCENARIO ROUND -> prints the result line (or nothing)
run() {
    local broker=$1 name=$2 round=$3 spec proto args port pid line
    spec=$(scenario "$name"); proto=${spec%%|*}; args=${spec#*|}
    if [ "$broker" = triad ]; then
        pid=$TRIAD_PID
        case $proto in amqp) port=$T_AMQP ;; stomp) port=$T_STOMP ;; mqtt) port=$T_MQTT ;; esac
    else
        case $proto in amqp) port=$PEER_AMQP_PORT ;; stomp) port=$PEER_STOMP_PORT ;; mqtt) port=$PEER_MQTT_PORT ;; esac
        pid=$(pid_on_port "$port")
        if [ -z "$pid" ]; then
            echo "no peer listening on 127.0.0.1:$port (start it: shared/tools/peers start)" >&2
            return
        fi
    fi
    local log="$LOGDIR/$name-$broker-$round.log"
    echo "+ [$broker] triad-bench $args --port $port --broker-pid $pid" >&2
    # shellcheck disable=SC2086
    line=$(timeout $((DURATION + 120)) "$B" $args --port "$port" --broker-pid "$pid" --json 2>"$log" | tail -1)
    if [ -n "$line" ]; then
        echo "$line" | sed "s/^{/{\"scenario\":\"$name\",\"broker_name\":\"$broker\",\"round\":$round,/" >>"$OUT"
        echo "$line"
    else
        echo "  [$broker] $name round $round failed: $(tail -1 "$log")" >&2
    fi
}

peer_name() { case $1 in amqp|stomp) echo rabbitmq ;; mqtt) echo "$MQTT_PEER" ;; esac; }

rows=()
idle_rows=()
for name in "${SCENARIOS[@]}"; do
    spec=$(scenario "$name"); proto=${spec%%|*}; peer=$(peer_name "$proto")
    for round in $(seq 1 "$ROUNDS"); do
        if [ "$name" = mqtt-idle-10k ]; then
            stop_triad
            start_triad
        fi
        a=$(run triad "$name" "$round")
        [ "$name" = mqtt-idle-10k ] && restart_peer
        b=$(run peer "$name" "$round")
        if [ "$name" = mqtt-idle-10k ]; then
            ac=$(field "$a" connects_per_s); bc=$(field "$b" connects_per_s)
            ar=$(field "$a" rss_kib_per_conn); br=$(field "$b" rss_kib_per_conn)
            an=$(field "$a" connected); bn=$(field "$b" connected)
            row="| $name | $peer | $round | $an / $bn | $(num "$ac") | $(num "$bc") | $(ratio "$ac" "$bc") | $(num "$ar") | $(num "$br") | $(ratio "$ar" "$br") |"
            idle_rows+=("$row")
        else
            am=$(field "$a" msgs_per_s); bm=$(field "$b" msgs_per_s)
            ap=$(field "$a" p99_us); bp=$(field "$b" p99_us)
            ac=$(field "$a" broker_cpu_us_per_msg); bc=$(field "$b" broker_cpu_us_per_msg)
            al="$(field "$a" lost)/$(field "$a" duplicated)/$(field "$a" out_of_order)"
            bl="$(field "$b" lost)/$(field "$b" duplicated)/$(field "$b" out_of_order)"
            row="| $name | $peer | $round | $(num "$am") | $(num "$bm") | $(ratio "$am" "$bm") | $(num "$ap") | $(num "$bp") | $(ratio "$ap" "$bp") | $(num "$ac") | $(num "$bc") | $(ratio "$ac" "$bc") | $al | $bl |"
            rows+=("$row")
        fi
        echo "$row" >&2
    done
done

echo
if [ ${#rows[@]} -gt 0 ]; then
    echo "| scenario | peer | round | Triad msgs/s | peer msgs/s | Triad/peer | Triad p99 µs | peer p99 µs | Triad/peer | Triad CPU µs/msg | peer CPU µs/msg | Triad/peer | Triad lost/dup/reord | peer lost/dup/reord |"
    echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    printf '%s\n' "${rows[@]}"
    echo
fi
if [ ${#idle_rows[@]} -gt 0 ]; then
    echo "| scenario | peer | round | connected Triad / peer | Triad connects/s | peer connects/s | Triad/peer | Triad RSS KiB/conn | peer RSS KiB/conn | Triad/peer |"
    echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    printf '%s\n' "${idle_rows[@]}"
fi

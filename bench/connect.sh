#!/usr/bin/env bash
# Connection setup side by side (issue 20): `triad-bench connect` against Triad, Mosquitto
# and RabbitMQ's MQTT plugin, plain and TLS, clean and persistent sessions, full and
# resumed TLS handshakes, for an RSA 2048 and an ECDSA P-256 certificate.
#
#   bench/connect.sh                 # every scenario, ROUNDS rounds, brokers alternated
#   ROUNDS=1 COUNT=3000 PARALLEL="1 8" bench/connect.sh
#
# - Certificates: self-signed, made here with openssl (CN and SAN localhost), one run of
#   the TLS rows per certificate (CERTS="rsa p256").
# - Triad: TRIAD_BIN started here on a fresh data directory per certificate, ephemeral
#   loopback ports (read from its `listening proto=... addr=...` lines), default
#   configuration (INFO log to a file), TLS with that certificate.
# - Mosquitto: MOSQUITTO_BIN started here, its own instance per certificate with a plain
#   and a TLS listener (MOSQ_PORT, MOSQ_PORT+1) on the same certificate (`persistence
#   false`, anonymous, `set_tcp_nodelay true`: with Nagle on, its CONNACK after the TLS 1.3
#   tickets waits for the client's delayed ACK, ~22 connects/s for one client; Triad sets
#   TCP_NODELAY).
# - RabbitMQ: its MQTT plugin on RABBIT_MQTT_PORT (1890) from the shared peers tool, plain
#   only (no TLS listener is set up there); skipped when nothing listens on that port.
#
# Each run: `triad-bench connect` with --count COUNT (or TIME_LIMIT s first) and --broker-pid;
# result lines (JSON) are appended to $OUT, and a Markdown table of them is printed at the
# end (broker CPU ms per connect, connects/s).
#
# Environment: ROUNDS (2) COUNT (3000) TIME_LIMIT (20) PARALLEL ("1 8") CERTS ("rsa p256")
#   OUT (connect-results.jsonl) TRIAD_BIN (target/release/triad) MOSQUITTO_BIN (mosquitto)
#   RABBIT_MQTT_PORT (1890) MOSQ_PORT (18891; TLS on MOSQ_PORT+1) SKIP_BUILD=1
#   RUST_LOG (passed to Triad; unset: info)
set -uo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-2}
COUNT=${COUNT:-3000}
TIME_LIMIT=${TIME_LIMIT:-20}
PARALLEL=${PARALLEL:-"1 8"}
CERTS=${CERTS:-"rsa p256"}
OUT=${OUT:-connect-results.jsonl}
TRIAD_BIN=${TRIAD_BIN:-target/release/triad}
MOSQUITTO_BIN=${MOSQUITTO_BIN:-$(command -v mosquitto || echo /usr/sbin/mosquitto)}
RABBIT_MQTT_PORT=${RABBIT_MQTT_PORT:-1890}
# Mosquitto's plain and TLS ports (below the ephemeral range, where client sockets and
# their TIME_WAITs could hold them)
MOSQ_PORT=${MOSQ_PORT:-18891}
B=target/release/triad-bench

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    cargo build --release --quiet || exit 1
fi
[ -x "$MOSQUITTO_BIN" ] || { echo "no mosquitto binary ($MOSQUITTO_BIN)" >&2; exit 1; }

WORK=$(mktemp -d /tmp/triad-connect.XXXXXX)
TRIAD_PID=
MOSQ_PID=
cleanup() {
    stop_pid "$TRIAD_PID"
    stop_pid "$MOSQ_PID"
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

stop_pid() {
    local pid=$1
    [ -n "$pid" ] || return 0
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null
}

make_cert() { # kind -> $WORK/<kind>-cert.pem, $WORK/<kind>-key.pem
    local kind=$1 newkey
    case $kind in
        rsa) newkey=(-newkey rsa:2048) ;;
        p256) newkey=(-newkey ec -pkeyopt ec_paramgen_curve:P-256) ;;
        *) echo "unknown certificate kind $kind" >&2; exit 2 ;;
    esac
    openssl req -x509 "${newkey[@]}" -nodes -keyout "$WORK/$kind-key.pem" \
        -out "$WORK/$kind-cert.pem" -subj /CN=localhost -addext subjectAltName=DNS:localhost \
        -days 3 2>/dev/null || { echo "openssl req failed" >&2; exit 1; }
}

start_triad() { # kind
    local kind=$1
    rm -rf "$WORK/data"
    mkdir -p "$WORK/data"
    "$TRIAD_BIN" --data-dir "$WORK/data" --amqp-listen 127.0.0.1:0 --stomp-listen 127.0.0.1:0 \
        --mqtt-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --amqps-listen 127.0.0.1:0 \
        --stomps-listen 127.0.0.1:0 --mqtts-listen 127.0.0.1:0 --https-listen 127.0.0.1:0 \
        --tls-cert "$WORK/$kind-cert.pem" --tls-key "$WORK/$kind-key.pem" \
        2>"$WORK/triad.log" &
    TRIAD_PID=$!
    for _ in $(seq 1 300); do
        grep -q "broker ready" "$WORK/triad.log" 2>/dev/null && break
        kill -0 "$TRIAD_PID" 2>/dev/null || break
        sleep 0.1
    done
    T_MQTT=$(triad_port mqtt); T_MQTTS=$(triad_port mqtts)
    if [ -z "$T_MQTTS" ] || ! kill -0 "$TRIAD_PID" 2>/dev/null; then
        echo "triad did not start; its log:" >&2
        cat "$WORK/triad.log" >&2
        exit 1
    fi
    echo "triad pid $TRIAD_PID: mqtt=$T_MQTT mqtts=$T_MQTTS ($kind)" >&2
}
triad_port() {
    grep -o "listening proto=$1 addr=[^ ]*" "$WORK/triad.log" | head -1 | sed 's/.*:\([0-9]*\)$/\1/'
}

start_mosquitto() { # kind
    local kind=$1
    M_MQTT=$MOSQ_PORT; M_MQTTS=$((MOSQ_PORT + 1))
    if ss -ltn | grep -qE "127.0.0.1:($M_MQTT|$M_MQTTS) "; then
        echo "port $M_MQTT or $M_MQTTS is in use: set MOSQ_PORT" >&2
        exit 1
    fi
    cat >"$WORK/mosquitto.conf" <<CONF
per_listener_settings false
user $(id -un)
set_tcp_nodelay true
allow_anonymous true
persistence false
log_dest file $WORK/mosquitto.log
listener $M_MQTT 127.0.0.1
listener $M_MQTTS 127.0.0.1
certfile $WORK/$kind-cert.pem
keyfile $WORK/$kind-key.pem
CONF
    "$MOSQUITTO_BIN" -c "$WORK/mosquitto.conf" 2>>"$WORK/mosquitto.log" &
    MOSQ_PID=$!
    for _ in $(seq 1 100); do
        ss -ltn | grep -q "127.0.0.1:$M_MQTTS " && break
        sleep 0.1
    done
    ss -ltn | grep -q "127.0.0.1:$M_MQTTS " || { echo "mosquitto did not start" >&2; cat "$WORK/mosquitto.log" >&2; exit 1; }
    echo "mosquitto pid $MOSQ_PID: mqtt=$M_MQTT mqtts=$M_MQTTS ($kind)" >&2
}

rabbit_pid() {
    ss -ltnp 2>/dev/null | grep "127.0.0.1:$RABBIT_MQTT_PORT " | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2
}

run() { # name port pid label args...
    local name=$1 port=$2 pid=$3 label=$4
    shift 4
    echo "+ [$name] triad-bench connect $* --port $port --broker-pid $pid" >&2
    "$B" connect "$@" --port "$port" --broker-pid "$pid" --name "$name" \
        --count "$COUNT" --time-limit "$TIME_LIMIT" --json --quiet \
        | sed "s/^{/{\"label\":\"$label\",\"cert\":\"${CERT:-}\",/" >>"$OUT"
}

: >>"$OUT"
first_line=$(($(wc -l <"$OUT") + 1))
echo "loadavg at start: $(cut -d' ' -f1-3 /proc/loadavg)" >&2

# Plain rows: once (no certificate involved), Triad and Mosquitto from the first
# certificate's instances, RabbitMQ from the peers tool.
first=1
for kind in $CERTS; do
    make_cert "$kind"
    CERT=$kind
    start_triad "$kind"
    start_mosquitto "$kind"
    R_PID=$(rabbit_pid)
    for round in $(seq 1 "$ROUNDS"); do
        for p in $PARALLEL; do
            if [ $first = 1 ]; then
                CERT=
                for sess in clean persistent; do
                    run triad "$T_MQTT" "$TRIAD_PID" "plain $sess p$p" --parallel "$p" --session "$sess"
                    run mosquitto "$M_MQTT" "$MOSQ_PID" "plain $sess p$p" --parallel "$p" --session "$sess"
                    if [ -n "$R_PID" ]; then
                        run rabbitmq "$RABBIT_MQTT_PORT" "$R_PID" "plain $sess p$p" --parallel "$p" --session "$sess"
                    fi
                done
                CERT=$kind
            fi
            for v in 1.3 1.2; do
                for res in "" --resume; do
                    lab="tls$v${res:+ resumed} p$p"
                    run triad "$T_MQTTS" "$TRIAD_PID" "handshake $lab" --proto tls --tls --tls-version "$v" $res --parallel "$p"
                    run mosquitto "$M_MQTTS" "$MOSQ_PID" "handshake $lab" --proto tls --tls --tls-version "$v" $res --parallel "$p"
                done
            done
            for sess in clean persistent; do
                run triad "$T_MQTTS" "$TRIAD_PID" "mqtt tls1.3 $sess p$p" --tls --tls-version 1.3 --session "$sess" --parallel "$p"
                run mosquitto "$M_MQTTS" "$MOSQ_PID" "mqtt tls1.3 $sess p$p" --tls --tls-version 1.3 --session "$sess" --parallel "$p"
            done
        done
    done
    first=0
    stop_pid "$TRIAD_PID"; TRIAD_PID=
    stop_pid "$MOSQ_PID"; MOSQ_PID=
done
echo "loadavg at end: $(cut -d' ' -f1-3 /proc/loadavg)" >&2

# The table: one row per (cert, label), each broker's runs as "CPU ms (connects/s)".
tail -n +"$first_line" "$OUT" | python3 -c '
import json, sys
rows, names = {}, []
for line in sys.stdin:
    try:
        v = json.loads(line)
    except ValueError:
        continue
    key = (v.get("cert") or "-", v["label"])
    name = v.get("name") or "?"
    if name not in names:
        names.append(name)
    cell = "%s (%s/s)" % (v.get("cpu_ms_per_connect"), int(v.get("connects_per_s") or 0))
    if v.get("failed"):
        cell += " %d failed" % v["failed"]
    if v.get("resume"):
        cell += " %d/%d resumed" % (v.get("resumed", 0), v.get("connects", 0))
    rows.setdefault(key, {}).setdefault(name, []).append(cell)
print("| certificate | scenario | " + " | ".join(n + " ms CPU/connect (connects/s)" for n in names) + " |")
print("|---|---|" + "---|" * len(names))
for (cert, label), by in rows.items():
    print("| %s | %s | %s |" % (cert, label, " | ".join(" / ".join(by.get(n, ["–"])) for n in names)))
'

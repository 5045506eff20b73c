#!/usr/bin/env bash
# Replicated publishing (issue 18): persistent AMQP messages with publisher confirms against
# a single Triad node, a Triad replica group of 3 nodes on this machine (a leader and two
# followers) in sync mode (min_insync 2 and 3) and async mode, and RabbitMQ with a classic
# durable queue and a quorum queue. The same triad-bench run for each; scenarios alternate
# (A B C ... A B C ...) for ROUNDS rounds. Every Triad run gets fresh nodes and data dirs.
# Prints one Markdown row per run; the result lines (JSON) are appended to $OUT.
#
#   bench/replicated.sh                   # every scenario
#   bench/replicated.sh single sync2      # some of them
#   ROUNDS=3 DURATION=30 bench/replicated.sh
#
# Scenarios:
#   single          Triad, one node (store.flush = "sync", the default)
#   sync2           Triad leader + 2 followers, replication.mode = "sync", min_insync = 2
#   sync3           the same with min_insync = 3 (every node)
#   async           Triad leader + 2 followers, replication.mode = "async"
#   rabbit-classic  RabbitMQ (the peer, port $PEER_AMQP_PORT), classic durable queue
#   rabbit-quorum   RabbitMQ, quorum queue (x-queue-type=quorum)
#
# The run: 1 producer, 1 consumer, SIZE-byte persistent bodies, confirm window WINDOW,
# manual ack with prefetch 1000, DURATION seconds of publishing. Broker CPU per message is
# that of every node of the group (--broker-pid once per process); for RabbitMQ its
# listening process (ss). The peer is used as it is: start it first (the peers tool's
# start-rabbit; a single RabbitMQ node, so its quorum queue has one member).
#
# Node logs are kept as $LOGDIR/SCENARIO-ROUND-NODE.log; a result line's in_sync_left counts
# the leader's "left the in-sync set" lines during that run.
#
# After each Triad run, before the nodes stop, the commitlog bytes on disk of each node
# (du of its data dir's commitlog) are added to the result line as "commitlog_bytes" and
# printed. SEGMENT (e.g. "64 MiB") sets every node's store.segment_size (default: the
# broker's 1 GiB), so that a short run fills and deletes segments, and limits messages
# to 1 MiB (a segment must be larger than the largest message).
#
# Environment: ROUNDS (2) DURATION (20) SIZE (1024) WINDOW (1000) SEGMENT OUT
#   (replicated-results.jsonl) TRIAD_BIN (target/release/triad) PEER_AMQP_PORT (5680)
#   FIRST_ROUND (1: the first round's number, to add rounds to a file) SKIP_BUILD=1 LOGDIR (a temp dir) TMPDIR (where the nodes' data dirs go: a disk, not tmpfs)
set -uo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-2}
FIRST_ROUND=${FIRST_ROUND:-1}
DURATION=${DURATION:-20}
SIZE=${SIZE:-1024}
WINDOW=${WINDOW:-1000}
OUT=${OUT:-replicated-results.jsonl}
PEER_AMQP_PORT=${PEER_AMQP_PORT:-5680}
TRIAD_BIN=${TRIAD_BIN:-target/release/triad}
B=target/release/triad-bench
ALL="single sync2 sync3 async rabbit-classic rabbit-quorum"

SCENARIOS=("$@")
[ $# -gt 0 ] || read -r -a SCENARIOS <<<"$ALL"
for s in "${SCENARIOS[@]}"; do
    case " $ALL " in *" $s "*) ;; *) echo "unknown scenario $s (one of: $ALL)" >&2; exit 2 ;; esac
done

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    cargo build --release --quiet --bins || exit 1
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/triad-replicated.XXXXXX")
# the nodes' data dirs go under WORK: fsync on tmpfs costs nothing, so refuse it
if [ "$(findmnt -no FSTYPE -T "$WORK" 2>/dev/null)" = tmpfs ]; then
    echo "$WORK is on tmpfs: set TMPDIR to a directory on a disk" >&2
    rmdir "$WORK"
    exit 2
fi
LOGDIR=${LOGDIR:-$WORK}
PIDS=()
cleanup() {
    stop_nodes
    rm -rf "$WORK"/data-*
}
trap cleanup EXIT INT TERM

stop_nodes() {
    local p
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
    for p in "${PIDS[@]}"; do
        for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$p" 2>/dev/null
        wait "$p" 2>/dev/null
    done
    PIDS=()
}

# wait_log FILE NEEDLE COUNT PID: until FILE holds COUNT lines with NEEDLE (30 s at most)
wait_log() {
    for _ in $(seq 1 300); do
        [ "$(grep -c -- "$2" "$1" 2>/dev/null)" -ge "$3" ] && return 0
        kill -0 "$4" 2>/dev/null || break
        sleep 0.1
    done
    echo "waiting for \"$2\" in $1 failed; its log:" >&2
    cat "$1" >&2
    return 1
}

listen_addr() { # log proto -> ip:port, from "listening proto=<p> addr=<ip:port>"
    grep -o "listening proto=$2 addr=[^ ]*" "$1" | head -1 | sed 's/.*addr=//'
}

# start_node NAME CONFIG_TEXT [ARGS...]: a triad process with a fresh data dir; its pid is
# appended to PIDS, its log is $WORK/NAME.log
start_node() {
    local name=$1 config=$2
    shift 2
    rm -rf "$WORK/data-$name"
    if [ -n "${SEGMENT:-}" ]; then
        # a segment must be larger than the largest message (128 MiB by default)
        config=$(printf '[store]\nsegment_size = "%s"\n\n[limits]\nmax_message_size = "1 MiB"\n\n%s' \
            "$SEGMENT" "$config")
    fi
    printf '%s\n' "$config" >"$WORK/$name.toml"
    "$TRIAD_BIN" --data-dir "$WORK/data-$name" --config "$WORK/$name.toml" "$@" \
        2>"$WORK/$name.log" >&2 &
    PIDS+=($!)
}

# start_triad SCENARIO: the node(s); sets AMQP_PORT
start_triad() {
    local listen=(--amqp-listen 127.0.0.1:0 --stomp-listen 127.0.0.1:0
        --mqtt-listen 127.0.0.1:0 --http-listen 127.0.0.1:0)
    local repl
    case $1 in
    single) repl="" ;;
    sync2) repl=$'[replication]\nmode = "sync"\nmin_insync = 2' ;;
    sync3) repl=$'[replication]\nmode = "sync"\nmin_insync = 3' ;;
    async) repl=$'[replication]\nmode = "async"' ;;
    esac
    if [ -z "$repl" ]; then
        start_node single "" "${listen[@]}"
        wait_log "$WORK/single.log" "broker ready" 1 "${PIDS[0]}" || return 1
        AMQP_PORT=$(listen_addr "$WORK/single.log" amqp | sed 's/.*://')
        return 0
    fi
    start_node leader "$(printf '[cluster]\nrole = "leader"\nnode_id = "l"\nlisten = "127.0.0.1:0"\n%s' "$repl")" \
        "${listen[@]}"
    wait_log "$WORK/leader.log" "broker ready" 1 "${PIDS[0]}" || return 1
    local raddr
    raddr=$(listen_addr "$WORK/leader.log" replication)
    for f in f1 f2; do
        start_node "$f" "$(printf '[cluster]\nrole = "follower"\nnode_id = "%s"\nleader = "%s"' "$f" "$raddr")"
    done
    # both followers connected and in the in-sync set before the run
    wait_log "$WORK/leader.log" "replica joined the in-sync set" 2 "${PIDS[0]}" || return 1
    AMQP_PORT=$(listen_addr "$WORK/leader.log" amqp | sed 's/.*://')
}

pid_on_port() { # the pid of the process listening on 127.0.0.1:PORT
    ss -ltnpH "sport = :$1" 2>/dev/null | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2
}

# run SCENARIO ROUND -> appends the result line to $OUT and prints a table row
run() {
    local name=$1 round=$2 port pids=() extra=() line disk=
    case $name in
    rabbit-*)
        port=$PEER_AMQP_PORT
        local pid
        pid=$(pid_on_port "$port")
        if [ -z "$pid" ]; then
            echo "no RabbitMQ listening on 127.0.0.1:$port (start it: peers start-rabbit)" >&2
            return
        fi
        pids=("$pid")
        [ "$name" = rabbit-quorum ] && extra=(--queue-type quorum)
        ;;
    *)
        if ! start_triad "$name"; then
            echo "  $name round $round: triad did not start" >&2
            stop_nodes
            return
        fi
        port=$AMQP_PORT
        pids=("${PIDS[@]}")
        ;;
    esac
    local args=(amqp --port "$port" --size "$SIZE" --persistent --confirm
        --confirm-window "$WINDOW" --manual-ack --prefetch 1000 --duration "$DURATION" "${extra[@]}")
    local p
    for p in "${pids[@]}"; do args+=(--broker-pid "$p"); done
    local log="$LOGDIR/$name-$round.log"
    echo "+ [$name] triad-bench ${args[*]}" >&2
    line=$(timeout $((DURATION + 120)) "$B" "${args[@]}" --json 2>"$log" | tail -1)
    local left=0 node
    case $name in
    rabbit-*) ;;
    *)
        # times a follower left the in-sync set during the run (a stall, a lag past the
        # bound), counted before the nodes are stopped (then every follower leaves)
        [ -f "$WORK/leader.log" ] && left=$(grep -c "left the in-sync set" "$WORK/leader.log")
        disk=""
        for node in single leader f1 f2; do
            [ -d "$WORK/data-$node/commitlog" ] || continue
            disk="$disk${disk:+,}\"$node\":$(du -sb "$WORK/data-$node/commitlog" | cut -f1)"
        done
        echo "  $name round $round: commitlog bytes on disk {$disk}" >&2
        stop_nodes
        for node in single leader f1 f2; do
            [ -f "$WORK/$node.log" ] && mv "$WORK/$node.log" "$LOGDIR/$name-$round-$node.log"
        done
        ;;
    esac
    if [ -z "$line" ]; then
        echo "  $name round $round failed: $(tail -1 "$log")" >&2
        return
    fi
    local load
    load=$(cut -d' ' -f1 /proc/loadavg)
    echo "$line" | sed "s/^{/{\"scenario\":\"$name\",\"round\":$round,\"loadavg_1m\":$load,\"in_sync_left\":$left,\"commitlog_bytes\":{$disk},/" >>"$OUT"
    row "$name" "$round" "$load" "$line" "$left"
}

field() { # JSON path (a.b) from a result line, or "–"
    local v
    v=$(python3 -c 'import json,sys
v=json.loads(sys.argv[1])
for k in sys.argv[2].split("."):
    v=v.get(k) if isinstance(v,dict) else None
print("–" if v is None else v)' "$1" "$2" 2>/dev/null)
    echo "${v:-–}"
}

row() {
    local name=$1 round=$2 load=$3 line=$4 left=$5
    printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$name" "$round" \
        "$(field "$line" msgs_per_s)" "$(field "$line" confirm_lat_us.p50)" \
        "$(field "$line" confirm_lat_us.p99)" "$(field "$line" lat_us.p99)" \
        "$(field "$line" broker.cpu_us_per_msg)" "$(field "$line" nacked)" \
        "$(field "$line" lost)" "$left" "$load"
}

echo "| scenario | round | msgs/s | confirm p50 µs | confirm p99 µs | delivery p99 µs | broker CPU µs/msg | nacked | lost | left ISR | load (1 min) |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for round in $(seq "$FIRST_ROUND" $((FIRST_ROUND + ROUNDS - 1))); do
    for name in "${SCENARIOS[@]}"; do
        run "$name" "$round"
    done
done
echo "result lines: $OUT; logs: $LOGDIR" >&2

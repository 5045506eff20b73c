#!/usr/bin/env bash
# Restart time after kill -9, and what a promoted follower's full replay costs (issues 13
# and 18).
#
#   bench/restart.sh                       # 1,000,000 messages, TRIAD_BIN
#   COUNT=2000000 FOLLOWER=1 bench/restart.sh
#
# - A fresh data directory; TRIAD_BIN on fixed loopback ports (BASE_PORT: AMQP, +1 STOMP,
#   +2 MQTT, +3 HTTP); COUNT confirmed persistent 1 KiB messages into the durable queue
#   `big` (amqplib from conformance/node, 1,000 in flight); `kill -9`.
# - Then timed: seconds from start to `broker ready`, with the checkpoint, and again.
# - FOLLOWER=1: the directory is then made into a follower's (what `drop_broker_state`
#   leaves: consume queues, index, timers and checkpoint removed, `abort` present) and
#   started: a full replay, as a promotion does; once with the page cache warm and once
#   after dropping it (needs root).
# - COLD=1: the page cache is dropped before the first timed restart too (needs root).
#
# Environment: TRIAD_BIN (target/release/triad) COUNT (1000000) BASE_PORT (25672)
#   FOLLOWER COLD SKIP_BUILD=1
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${TRIAD_BIN:-target/release/triad}
COUNT=${COUNT:-1000000}
PORT=${BASE_PORT:-25672}
[ -n "${SKIP_BUILD:-}" ] || cargo build --release --bin triad
[ -d conformance/node/node_modules/amqplib ] || (cd conformance/node && npm install --no-audit --no-fund)
D=$(mktemp -d)
trap 'kill -9 $P 2>/dev/null; rm -rf "$D"' EXIT
ARGS=(--data-dir "$D/data" --amqp-listen "127.0.0.1:$PORT" --stomp-listen "127.0.0.1:$((PORT + 1))"
  --mqtt-listen "127.0.0.1:$((PORT + 2))" --http-listen "127.0.0.1:$((PORT + 3))")
P=
start() {
  local t0
  t0=$(date +%s.%N)
  "$BIN" "${ARGS[@]}" >"$D/log" 2>&1 &
  P=$!
  until grep -q "broker ready" "$D/log"; do
    kill -0 $P 2>/dev/null || { echo "triad died:"; cat "$D/log"; exit 1; }
    sleep 0.01
  done
  READY=$(echo "$(date +%s.%N) - $t0" | bc)
}
kill9() { kill -9 $P; wait $P 2>/dev/null; }
drop_cache() { sync; echo 3 >/proc/sys/vm/drop_caches; }

start
NODE_PATH=conformance/node/node_modules node -e '
const amqp = require("amqplib");
(async () => {
  const [port, count] = [process.argv[1], +process.argv[2]];
  const c = await amqp.connect(`amqp://guest:guest@127.0.0.1:${port}`);
  const ch = await c.createConfirmChannel();
  await ch.assertQueue("big", { durable: true });
  const body = Buffer.alloc(1024, 7);
  for (let i = 0; i < count; i += 1000) {
    for (let j = 0; j < 1000 && i + j < count; j++) ch.sendToQueue("big", body, { persistent: true });
    await ch.waitForConfirms();
  }
  await c.close();
})().catch(e => { console.error(e); process.exit(1); });' "$PORT" "$COUNT" || exit 1
kill9
echo "commitlog on disk: $(du -sh "$D/data/commitlog" | cut -f1)"
[ -n "${COLD:-}" ] && drop_cache
start; echo "restart after kill -9: $READY s"; kill9
start; echo "again: $READY s"; kill9
if [ -n "${FOLLOWER:-}" ]; then
  as_follower() {
    touch "$D/data/abort"
    rm -rf "$D"/data/{consumequeue,sharedcq,index,timer} "$D/data/checkpoint"
  }
  as_follower; start; echo "full replay (a promotion), page cache warm: $READY s"; kill9
  as_follower; drop_cache; start; echo "full replay, page cache dropped: $READY s"
  curl -s -u guest:guest "http://127.0.0.1:$((PORT + 3))/api/queues/%2F/big" |
    python3 -c 'import json,sys; print("messages in big:", json.load(sys.stdin)["messages"])'
  kill9
fi

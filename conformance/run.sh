#!/usr/bin/env bash
# Runs the third-party-client conformance suite against a broker it starts itself on
# free loopback ports with a temporary data directory. Installs its own Python venv
# (conformance/.venv) from the pinned requirements.txt, and mosquitto-clients
# (mosquitto_pub / mosquitto_sub), rabbitmq-server (for rabbitmqadmin), prometheus (for promtool),
# haproxy (PROXY protocol test) and chromium (dashboard test) through apt when
# they are missing and we are root; otherwise the tests that need them are skipped with
# the reason.
#
# Extra arguments go to pytest, e.g. `conformance/run.sh -k stomp -x`.
# CONFORMANCE_EXTERNAL="amqp=H:P,stomp=H:P,mqtt=H:P" runs the suite against a broker
# that is already running (e.g. RabbitMQ) instead of building and starting Triad.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"

venv="$here/.venv"
stamp="$venv/.requirements"
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$here/requirements.txt" "$stamp"; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt"
  cp "$here/requirements.txt" "$stamp"
fi

if ! command -v mosquitto_pub >/dev/null 2>&1 || ! command -v mosquitto_sub >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "conformance: installing mosquitto-clients" >&2
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto-clients >/dev/null; }; then
      echo "conformance: could not install mosquitto-clients; its tests will be skipped" >&2
    fi
  else
    echo "conformance: mosquitto_pub/mosquitto_sub missing and not root; their tests will be skipped" >&2
  fi
fi

# rabbitmqadmin, the management API's command-line client, comes with RabbitMQ's Debian
# package (the broker itself is not started).
if ! command -v rabbitmqadmin >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "conformance: installing rabbitmq-server (for rabbitmqadmin)" >&2
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
             rabbitmq-server >/dev/null; }; then
      echo "conformance: could not install rabbitmq-server; the rabbitmqadmin tests will be skipped" >&2
    fi
  else
    echo "conformance: rabbitmqadmin missing and not root; its tests will be skipped" >&2
  fi
fi

# promtool (Prometheus's Debian package) checks the /metrics exposition.
if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "conformance: installing prometheus (for promtool)" >&2
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
             prometheus >/dev/null; }; then
      echo "conformance: could not install prometheus; the promtool tests will be skipped" >&2
    fi
  else
    echo "conformance: promtool missing and not root; its tests will be skipped" >&2
  fi
fi

# haproxy sends the PROXY protocol headers of test_proxy_protocol.py.
if ! command -v haproxy >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "conformance: installing haproxy (PROXY protocol test)" >&2
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
             haproxy >/dev/null; }; then
      echo "conformance: could not install haproxy; its test will be skipped" >&2
    fi
  else
    echo "conformance: haproxy missing and not root; its test will be skipped" >&2
  fi
fi

# chromium drives the web dashboard's browser test (headless, over CDP).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "conformance: installing chromium (for the dashboard test)" >&2
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
             chromium >/dev/null; }; then
      echo "conformance: could not install chromium; the dashboard test will be skipped" >&2
    fi
  else
    echo "conformance: chromium missing and not root; the dashboard test will be skipped" >&2
  fi
fi

# Node clients (amqplib, mqtt.js), pinned by conformance/node/package-lock.json.
if command -v npm >/dev/null 2>&1; then
  nstamp="$here/node/node_modules/.package-lock.json"
  if [ ! -f "$nstamp" ] || [ "$here/node/package-lock.json" -nt "$nstamp" ]; then
    (cd "$here/node" && npm ci --silent --no-audit --no-fund) ||
      echo "conformance: npm ci failed; the Node client tests will be skipped" >&2
  fi
else
  echo "conformance: npm missing; the Node client tests will be skipped" >&2
fi

if [ -z "${CONFORMANCE_EXTERNAL:-}" ]; then
  cargo build --quiet --bin triad --manifest-path "$root/Cargo.toml"
  export TRIAD_BIN="$root/target/debug/triad"
fi
cd "$here"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests "$@"

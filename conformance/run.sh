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

# Installs Debian package PKG (for WHAT) unless every command CMD... is there; without
# root or apt-get, or when the install fails, says so: the tests that need it are skipped.
need() {
  local pkg=$1 what=$2 cmd
  shift 2
  for cmd in "$@"; do
    command -v "$cmd" >/dev/null 2>&1 && continue
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "conformance: installing $pkg ($what)" >&2
      if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
             DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
               "$pkg" >/dev/null; }; then
        echo "conformance: could not install $pkg; the $what tests will be skipped" >&2
      fi
    else
      echo "conformance: $cmd missing and not root; the $what tests will be skipped" >&2
    fi
    return
  done
}

need mosquitto-clients "mosquitto_pub and mosquitto_sub" mosquitto_pub mosquitto_sub
# rabbitmqadmin, the management API's command-line client, comes with RabbitMQ's Debian
# package (the broker itself is not started).
need rabbitmq-server rabbitmqadmin rabbitmqadmin
# promtool (Prometheus's Debian package) checks the /metrics exposition.
need prometheus promtool promtool
# haproxy sends the PROXY protocol headers of test_proxy_protocol.py.
need haproxy "PROXY protocol" haproxy
# chromium drives the web dashboard's browser test (headless, over CDP).
need chromium dashboard chromium

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

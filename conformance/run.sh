#!/usr/bin/env bash
# Runs the third-party-client conformance suite against a broker it starts itself on
# free loopback ports with a temporary data directory. Installs its own Python venv
# (conformance/.venv) from the pinned requirements.txt.
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

cargo build --quiet --bin triad --manifest-path "$root/Cargo.toml"
export TRIAD_BIN="$root/target/debug/triad"
cd "$here"
exec "$venv/bin/python" -m pytest -q tests

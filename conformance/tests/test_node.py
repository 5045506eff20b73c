"""Node clients (amqplib, mqtt.js, @stomp/stompjs over WebSocket; conformance/node, pinned in its package-lock.json) run
with node's own test runner against the same broker; each file is one pytest test."""

import os
import shutil
import subprocess

import pytest

NODE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "node")
FILES = sorted(f for f in os.listdir(os.path.join(NODE_DIR, "test")) if f.endswith(".test.js"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", FILES)
def test_node_client(broker, name):
    if not shutil.which("node"):
        pytest.skip("node is not installed")
    if not os.path.isdir(os.path.join(NODE_DIR, "node_modules")):
        pytest.skip("conformance/node/node_modules missing (run.sh runs `npm ci` when npm exists)")
    amqp_host, amqp_port = broker.host_port("amqp")
    mqtt_host, mqtt_port = broker.host_port("mqtt")
    http_host, http_port = broker.host_port("http")
    env = dict(
        os.environ,
        TRIAD_AMQP_URL=f"amqp://guest:guest@{amqp_host}:{amqp_port}",
        TRIAD_MQTT_URL=f"mqtt://{mqtt_host}:{mqtt_port}",
        TRIAD_HTTP_URL=f"http://{http_host}:{http_port}",
    )
    r = subprocess.run(
        ["node", "--test", "--test-reporter=spec", f"test/{name}"],
        cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=110,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]

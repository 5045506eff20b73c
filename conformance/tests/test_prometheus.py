"""Triad's Prometheus endpoints checked by Prometheus's own `promtool check metrics`
(Debian package prometheus), after AMQP traffic so the counters are not all zero."""

import shutil
import subprocess
import urllib.request

import pika
import pytest

pytestmark = pytest.mark.skipif(
    not shutil.which("promtool"),
    reason="promtool not installed (Debian package prometheus; run.sh installs it when run "
    "as root)",
)


def scrape(broker, path):
    host, port = broker.host_port("http")
    with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()


def promtool(text):
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=30)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.parametrize("path", ["/metrics", "/metrics/per-object"])
def test_promtool_accepts_the_exposition(broker, uid, path):
    host, port = broker.host_port("amqp")
    conn = pika.BlockingConnection(pika.ConnectionParameters(host=host, port=port))
    ch = conn.channel()
    q = f"prom-{uid}"
    ch.queue_declare(q)
    for i in range(3):
        ch.basic_publish("", q, f"m{i}".encode())
    method, _, _ = ch.basic_get(q)
    ch.basic_ack(method.delivery_tag)
    text = scrape(broker, path)
    code, report = promtool(text)
    assert code == 0, report
    if path == "/metrics":
        assert "rabbitmq_global_messages_acknowledged_total" in text
        assert "rabbitmq_queue_messages_ready " in text
    else:
        assert f'rabbitmq_queue_messages_ready{{vhost="/",queue="{q}"}} 2' in text
    ch.queue_delete(q)
    conn.close()

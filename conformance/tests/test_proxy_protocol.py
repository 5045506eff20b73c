"""HAProxy in front of Triad with `send-proxy-v2` (`[listeners] proxy_protocol = true`),
with paho-mqtt and pika connecting through it: the broker sees the clients' addresses,
not HAProxy's. The HAProxy configuration is the README's "Behind a load balancer" one.
Skipped when the `haproxy` binary is missing (Debian package `haproxy`)."""

import shutil
import socket
import subprocess
import tempfile
import time
import os

import paho.mqtt.client as mqtt
import pika
import pytest

from helpers import wait_for

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed")

CONFIG = """
[store]
segment_size = "4 MiB"

[limits]
max_message_size = "1 MiB"

[listeners]
proxy_protocol = true
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_non_loopback_ip():
    """An address of this host that is not loopback, or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


@pytest.fixture
def haproxy(configured_broker):
    if os.environ.get("CONFORMANCE_EXTERNAL"):
        pytest.skip("needs a broker started with its own configuration")
    broker = configured_broker(CONFIG)
    _, mqtt_port = broker.host_port("mqtt")
    _, amqp_port = broker.host_port("amqp")
    front = {"mqtt": free_port(), "amqp": free_port()}
    cfg = f"""
global
    maxconn 256

defaults
    mode tcp
    timeout connect 5s
    timeout client 1h
    timeout server 1h

frontend mqtt
    bind 0.0.0.0:{front["mqtt"]}
    default_backend triad_mqtt

backend triad_mqtt
    server triad 127.0.0.1:{mqtt_port} send-proxy-v2

frontend amqp
    bind 0.0.0.0:{front["amqp"]}
    default_backend triad_amqp

backend triad_amqp
    server triad 127.0.0.1:{amqp_port} send-proxy-v2
"""
    d = tempfile.mkdtemp(prefix="triad-haproxy-")
    path = os.path.join(d, "haproxy.cfg")
    with open(path, "w") as f:
        f.write(cfg)
    check = subprocess.run(["haproxy", "-c", "-f", path], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    proc = subprocess.Popen(["haproxy", "-db", "-f", path],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def listening():
        try:
            socket.create_connection(("127.0.0.1", front["mqtt"]), timeout=1).close()
            return True
        except OSError:
            return False

    assert wait_for(listening, timeout=10), "haproxy did not start"
    yield broker, front
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(d, ignore_errors=True)


def paho_connect(host, port, source=None, username="guest", password="guest"):
    """Connects paho as guest; returns (client, CONNACK reason code)."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"haproxy-{time.time_ns()}")
    client.username_pw_set(username, password)
    got = []
    client.on_connect = lambda c, u, flags, rc, props: got.append(rc)
    kw = {"bind_address": source} if source else {}
    client.connect(host, port, keepalive=30, **kw)
    client.loop_start()
    assert wait_for(lambda: got, timeout=10), "no CONNACK"
    return client, got[0]


def test_paho_and_pika_through_haproxy_send_proxy_v2(haproxy, uid):
    broker, front = haproxy

    # paho from loopback through HAProxy: guest is a loopback user and gets in; a
    # message goes round.
    sub, rc = paho_connect("127.0.0.1", front["mqtt"])
    assert not rc.is_failure, rc
    received = []
    sub.on_message = lambda c, u, m: received.append(m.payload)
    topic = f"haproxy/{uid}"
    subscribed = []
    sub.on_subscribe = lambda c, u, mid, rcs, props: subscribed.append(mid)
    sub.subscribe(topic, qos=1)
    assert wait_for(lambda: subscribed, timeout=10)
    pub, rc = paho_connect("127.0.0.1", front["mqtt"])
    pub.publish(topic, b"through haproxy", qos=1).wait_for_publish(timeout=10)
    assert wait_for(lambda: received, timeout=10)
    assert received == [b"through haproxy"]
    client_port = sub.socket().getsockname()[1]
    for c in (sub, pub):
        c.disconnect()
        c.loop_stop()
    # The broker logs the client's own port (from the header) and HAProxy as `via`.
    assert wait_for(lambda: any(f"peer=127.0.0.1:{client_port}" in line and "via=127.0.0.1:" in line
                                for line in broker.log), timeout=10), "".join(broker.log[-30:])

    # pika through HAProxy.
    params = pika.ConnectionParameters("127.0.0.1", front["amqp"],
                                       credentials=pika.PlainCredentials("guest", "guest"))
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    q = f"haproxy-{uid}"
    ch.queue_declare(q, auto_delete=True)
    ch.basic_publish("", q, b"pika via haproxy")
    deadline = time.time() + 10
    body = None
    while body is None and time.time() < deadline:
        _, _, body = ch.basic_get(q, auto_ack=True)
    assert body == b"pika via haproxy"
    conn.close()

    # From a non-loopback address of this host, HAProxy's header says so: guest is
    # refused although HAProxy itself connects from 127.0.0.1.
    ip = local_non_loopback_ip()
    if ip is None:
        pytest.skip("no non-loopback address on this host for the remote-client half")
    remote, rc = paho_connect(ip, front["mqtt"], source=ip)
    remote.loop_stop()
    assert rc.is_failure, rc
    assert wait_for(lambda: any(f"peer={ip}:" in line for line in broker.log), timeout=10)
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(pika.ConnectionParameters(
            ip, front["amqp"], credentials=pika.PlainCredentials("guest", "guest")))

"""An elected replica group (issue 18) with unchanged third-party clients: three Triad
nodes and a real etcd on loopback, each node on fixed client ports. paho clients connect
to followers (which forward them to the leader) and keep their own network loop, with
paho's own reconnect logic; after the leader is killed (SIGKILL), they reconnect to the
same addresses on their own and resume: the persistent session is on the new leader and
a message published after the failover reaches it.

Skipped only when the `etcd` binary is absent (`.ci/run` installs Debian's etcd-server).
"""

import os
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request

import paho.mqtt.client as mqtt
import pytest

from helpers import wait_for

PROTOS = ("amqp", "stomp", "mqtt", "http")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    def __init__(self, root):
        self.client = f"http://127.0.0.1:{free_port()}"
        peer = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            ["etcd", "--name=t", f"--data-dir={os.path.join(root, 'etcd')}",
             f"--listen-client-urls={self.client}", f"--advertise-client-urls={self.client}",
             f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
             f"--initial-cluster=t={peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def healthy():
            try:
                with urllib.request.urlopen(self.client + "/health", timeout=1) as r:
                    return b"true" in r.read()
            except OSError:
                return False
        assert wait_for(healthy, timeout=30), "etcd did not become healthy"

    def stop(self):
        self.proc.kill()
        self.proc.wait()


class Node:
    """One node of the group, on fixed ports (a follower forwards clients on them; the
    leader serves them itself)."""

    def __init__(self, root, name, etcd_url):
        self.name = name
        self.ports = {p: free_port() for p in PROTOS}
        self.data_dir = os.path.join(root, name)
        os.makedirs(self.data_dir)
        self.config = os.path.join(root, f"{name}.toml")
        with open(self.config, "w") as f:
            f.write(
                f'[cluster]\nnode_id = "{name}"\netcd = ["{etcd_url}"]\n'
                f'listen = "127.0.0.1:{free_port()}"\nlease_ttl = "2s"\n'
                '[replication]\nmode = "sync"\nmin_insync = 2\n')
        self.log = []
        self.proc = None
        self.start()

    def start(self):
        args = [os.environ["TRIAD_BIN"], "--data-dir", self.data_dir, "--config", self.config]
        for p in PROTOS:
            args += [f"--{p}-listen", f"127.0.0.1:{self.ports[p]}"]
        env = dict(os.environ, RUST_LOG="info")
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True).start()

    def _pump(self, proc):
        for line in proc.stderr:
            self.log.append(line)

    def count(self, needle):
        return sum(needle in line for line in list(self.log))

    def leads(self):
        return self.proc.poll() is None and self.count("broker ready") > self.count(
            "leadership lost")

    def host_port(self, proto):
        return "127.0.0.1", self.ports[proto]

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def group():
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (Debian: etcd-server)")
    root = tempfile.mkdtemp(prefix="triad-cluster-")
    etcd = Etcd(root)
    nodes = [Node(root, n, etcd.client) for n in ("a", "b", "c")]
    try:
        yield nodes
    finally:
        for n in nodes:
            n.stop()
        etcd.stop()
        for n in nodes:
            if os.environ.get("CONFORMANCE_VERBOSE"):
                print(f"----- {n.name} -----\n" + "".join(n.log))
        shutil.rmtree(root, ignore_errors=True)


def one_leader(nodes):
    leaders = [n for n in nodes if n.leads()]
    return leaders[0] if len(leaders) == 1 else None


def paho(node, client_id, clean_session):
    """A paho client on its own network thread, reconnecting by itself (paho's
    reconnect_delay_set) to the node it was given."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                    protocol=mqtt.MQTTv311, clean_session=clean_session)
    c.username_pw_set("guest", "guest")
    c.reconnect_delay_set(min_delay=1, max_delay=2)
    c.connacks = queue.Queue()
    c.received = queue.Queue()
    c.on_connect = lambda cl, u, flags, rc, props: c.connacks.put((flags.session_present, rc))
    c.on_message = lambda cl, u, msg: c.received.put(msg.payload)
    c.subacks = queue.Queue()
    c.on_subscribe = lambda cl, u, mid, rcs, props: c.subacks.put(rcs)
    host, port = node.host_port("mqtt")

    def connect():
        try:
            c.connect(host, port, keepalive=5)
            return True
        except OSError:
            return False
    # the follower forwards once it has read the leader's addresses from etcd
    assert wait_for(connect, timeout=30), f"cannot connect to {node.name}"
    c.loop_start()
    return c


def next_connack(c, timeout=60):
    """The client's next successful CONNACK (session present, code)."""
    deadline = time.monotonic() + timeout
    while True:
        present, rc = c.connacks.get(timeout=max(0.1, deadline - time.monotonic()))
        if not rc.is_failure:
            return present, rc


def test_paho_clients_of_followers_reconnect_by_themselves_after_the_leader_is_killed(group):
    assert wait_for(lambda: one_leader(group) is not None, timeout=60), "no leader"
    leader = one_leader(group)
    f1, f2 = [n for n in group if n is not leader]
    assert wait_for(lambda: f1.count("follower: connected") and f2.count("follower: connected"),
                    timeout=60)
    assert wait_for(lambda: leader.count("joined the in-sync set") >= 1, timeout=60)

    # a device with a persistent session through one follower, a publisher through the other
    dev = paho(f1, "cluster-dev", clean_session=False)
    next_connack(dev)
    dev.subscribe("cl/cmd", qos=1)
    assert [int(r.value) for r in dev.subacks.get(timeout=30)] == [1]
    pub = paho(f2, "cluster-pub", clean_session=True)
    next_connack(pub)
    pub.publish("cl/cmd", b"before", qos=1).wait_for_publish(timeout=30)
    assert dev.received.get(timeout=30) == b"before"

    leader.kill()
    assert wait_for(lambda: any(n.leads() for n in (f1, f2)), timeout=60), "no new leader"
    # both clients reconnect on their own, to the same addresses (forwarded to the new
    # leader, or served by it); the device's session (its subscription) is there
    present, rc = next_connack(dev)
    assert present, "the persistent session is on the new leader"
    next_connack(pub)
    info = pub.publish("cl/cmd", b"after", qos=1)
    info.wait_for_publish(timeout=60)
    assert info.is_published()
    got = dev.received.get(timeout=30)
    while got == b"before":  # a redelivery of the unacked first one is allowed
        got = dev.received.get(timeout=30)
    assert got == b"after"
    for c in (dev, pub):
        c.loop_stop()
        c.disconnect()

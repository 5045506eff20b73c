"""Starts one Triad broker for the session on free loopback ports with a temporary data
directory, and hands its addresses to the tests.

Fixtures:
  broker        the session broker (shared by most tests; tests use unique names)
  own_broker    a broker of the test's own, for tests that restart it (SIGTERM, then a
                new process on the same data directory)
  configured_broker
                a factory: configured_broker(toml_text) starts a broker of the test's
                own with that configuration file (users, permissions, limits)
  uid           a unique name fragment for queues, exchanges, topics, client ids

Setting CONFORMANCE_EXTERNAL="amqp=H:P,stomp=H:P,mqtt=H:P" runs the suite against an
already running broker instead (e.g. RabbitMQ, to check what a test expects); tests that
need to restart their broker are skipped then.
"""

import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid

import pytest

LISTENING = re.compile(r"listening proto=(\w+) addr=(\S+)")
PROTOS = ("amqp", "stomp", "mqtt", "http")


class Broker:
    """One Triad process; `restart()` stops it and starts a new one on the same data dir."""

    def __init__(self, data_dir=None, config=None):
        self.own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="triad-conformance-")
        self.config_file = None
        if config is not None:
            self.config_file = os.path.join(self.data_dir, "triad.toml")
            with open(self.config_file, "w") as f:
                f.write(config)
        self.external = False
        self.proc = None
        self.log = []
        self.addrs = {}
        self._start()

    def _start(self):
        binary = os.environ["TRIAD_BIN"]
        args = [binary, "--data-dir", self.data_dir]
        if self.config_file:
            args += ["--config", self.config_file]
        for proto in PROTOS:
            args += [f"--{proto}-listen", "127.0.0.1:0"]
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info"))
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
        self.addrs = {}
        deadline = time.time() + 30
        ready = False
        while not ready:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("broker exited during startup:\n" + "".join(self.log))
            self.log.append(line)
            m = LISTENING.search(line)
            if m:
                self.addrs[m.group(1)] = m.group(2)
            if "broker ready" in line and all(p in self.addrs for p in PROTOS):
                ready = True
            if time.time() > deadline:
                raise RuntimeError("broker did not start:\n" + "".join(self.log))
        proc = self.proc
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc):
        for line in proc.stderr:
            self.log.append(line)

    def host_port(self, proto):
        host, port = self.addrs[proto].rsplit(":", 1)
        return host, int(port)

    def stop(self, sig=signal.SIGTERM):
        if self.proc is None:
            return None
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(timeout=5)
        self.proc = None
        return rc

    def restart(self, sig=signal.SIGTERM):
        rc = self.stop(sig)
        self._start()
        return rc

    def cleanup(self):
        self.stop()
        if self.own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


class ExternalBroker:
    external = True

    def __init__(self, spec):
        self.addrs = dict(part.split("=", 1) for part in spec.split(","))
        self.log = []

    def host_port(self, proto):
        if proto not in self.addrs:
            pytest.skip(f"external broker has no {proto} listener")
        host, port = self.addrs[proto].rsplit(":", 1)
        return host, int(port)

    def cleanup(self):
        pass


@pytest.fixture(scope="session")
def broker():
    spec = os.environ.get("CONFORMANCE_EXTERNAL")
    b = ExternalBroker(spec) if spec else Broker()
    yield b
    b.cleanup()


@pytest.fixture
def own_broker():
    if os.environ.get("CONFORMANCE_EXTERNAL"):
        pytest.skip("needs a broker it can restart")
    b = Broker()
    yield b
    b.cleanup()


@pytest.fixture
def configured_broker():
    if os.environ.get("CONFORMANCE_EXTERNAL"):
        pytest.skip("needs a broker started with its own configuration")
    made = []

    def make(config):
        b = Broker(config=config)
        made.append(b)
        return b

    yield make
    for b in made:
        b.cleanup()


@pytest.fixture
def uid(request):
    name = re.sub(r"[^A-Za-z0-9]", "", request.node.name)[-30:]
    return f"{name}-{uuid.uuid4().hex[:8]}"


def pytest_collection_modifyitems(config, items):
    # Every test gets a hard ceiling so no client can hang the run (SIGALRM based, main
    # thread only; the individual receives have much shorter timeouts of their own).
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(60))


@pytest.fixture(autouse=True)
def _hard_timeout(request):
    marker = request.node.get_closest_marker("timeout")
    seconds = marker.args[0] if marker else 60

    def on_alarm(signum, frame):
        raise TimeoutError(f"test exceeded its {seconds}s ceiling")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def pytest_configure(config):
    config.addinivalue_line("markers", "timeout(seconds): per-test hard ceiling")

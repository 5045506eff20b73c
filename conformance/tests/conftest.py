"""Starts one Triad broker for the session on free loopback ports with a temporary data
directory, and hands its addresses to the tests."""

import os
import re
import subprocess
import tempfile
import threading
import time

import pytest

LISTENING = re.compile(r"listening proto=(\w+) addr=(\S+)")


class Broker:
    def __init__(self):
        self.data_dir = tempfile.mkdtemp(prefix="triad-conformance-")
        binary = os.environ["TRIAD_BIN"]
        args = [binary, "--data-dir", self.data_dir]
        for proto in ("amqp", "stomp", "mqtt", "http"):
            args += [f"--{proto}-listen", "127.0.0.1:0"]
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info"))
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
        self.addrs = {}
        self.log = []
        deadline = time.time() + 30
        while len(self.addrs) < 4:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("broker exited during startup:\n" + "".join(self.log))
            self.log.append(line)
            m = LISTENING.search(line)
            if m:
                self.addrs[m.group(1)] = m.group(2)
            if time.time() > deadline:
                raise RuntimeError("broker did not start:\n" + "".join(self.log))
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stderr:
            self.log.append(line)

    def host_port(self, proto):
        host, port = self.addrs[proto].rsplit(":", 1)
        return host, int(port)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="session")
def broker():
    b = Broker()
    yield b
    b.stop()

"""kombu 5.4 (py-amqp transport) and a real Celery 5.4 worker against Triad."""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

HERE = os.path.dirname(os.path.abspath(__file__))


def url(broker):
    host, port = broker.host_port("amqp")
    return f"pyamqp://guest:guest@{host}:{port}//"


@pytest.fixture
def kconn(broker):
    with Connection(url(broker), connect_timeout=5, transport_options={"confirm_publish": True}) as c:
        c.ensure_connection(max_retries=3)
        yield c


def test_producer_consumer_round_trip(kconn, uid):
    ex = Exchange(f"kex-{uid}", type="direct", durable=True)
    q = Queue(f"kq-{uid}", exchange=ex, routing_key="jobs", durable=True)
    received = []

    def on_message(body, message):
        received.append((body, message.headers, message.properties, message.delivery_info))
        message.ack()

    with kconn.channel() as ch:
        producer = Producer(ch, exchange=ex, routing_key="jobs", serializer="json")
        producer.publish({"n": 1, "s": "héllo"}, declare=[q], headers={"trace": "t1"},
                         delivery_mode=2, correlation_id="cid-1", retry=True)
        producer.publish({"n": 2}, declare=[q], retry=True)
        with Consumer(ch, queues=[q], callbacks=[on_message], accept=["json"]):
            deadline = time.monotonic() + 5
            while len(received) < 2 and time.monotonic() < deadline:
                try:
                    kconn.drain_events(timeout=0.5)
                except socket.timeout:
                    pass
    assert [r[0] for r in received] == [{"n": 1, "s": "héllo"}, {"n": 2}]
    body, headers, props, info = received[0]
    assert headers == {"trace": "t1"}
    assert props["correlation_id"] == "cid-1"
    assert props["content_type"] == "application/json"
    assert props["delivery_mode"] == 2
    assert info["routing_key"] == "jobs" and info["exchange"] == f"kex-{uid}"


def test_reject_and_requeue(kconn, uid):
    q = Queue(f"kq-{uid}", exchange=Exchange(f"kex-{uid}", type="fanout"), auto_delete=False)
    seen = []

    def on_message(body, message):
        seen.append((body, message.delivery_info["redelivered"]))
        if len(seen) == 1:
            message.requeue()
        else:
            message.ack()

    with kconn.channel() as ch:
        Producer(ch).publish("retry me", exchange=q.exchange, declare=[q], serializer="json")
        with Consumer(ch, queues=[q], callbacks=[on_message], accept=["json"]):
            deadline = time.monotonic() + 5
            while len(seen) < 2 and time.monotonic() < deadline:
                try:
                    kconn.drain_events(timeout=0.5)
                except socket.timeout:
                    pass
    assert seen == [("retry me", False), ("retry me", True)]


def test_simple_queue_put_get(kconn, uid):
    sq = kconn.SimpleQueue(f"simple-{uid}")
    try:
        for i in range(3):
            sq.put({"i": i})
        assert sq.qsize() == 3
        got = []
        for _ in range(3):
            m = sq.get(block=True, timeout=5)
            got.append(m.payload)
            m.ack()
        assert got == [{"i": 0}, {"i": 1}, {"i": 2}]
        with pytest.raises(sq.Empty):
            sq.get(block=True, timeout=0.5)
        sq.put("x")
        assert sq.get(block=True, timeout=5).payload == "x"
    finally:
        sq.clear()
        sq.close()


def test_simple_buffer_is_transient(kconn, uid):
    sb = kconn.SimpleBuffer(f"buf-{uid}")
    try:
        sb.put("buffered")
        m = sb.get(timeout=5)
        assert m.payload == "buffered"
    finally:
        sb.close()


# --- a real Celery worker ----------------------------------------------------------------


class Worker:
    def __init__(self, broker, queue):
        env = dict(
            os.environ,
            CELERY_BROKER_URL=url(broker),
            CONFORMANCE_CELERY_QUEUE=queue,
            PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "apps.celery_app", "worker", "--pool=solo",
             "-c", "1", "-l", "info", "-n", f"conf-{queue}@%h"],
            cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if " ready." in line:
                self.ready.set()

    def wait_ready(self, timeout=30):
        if not self.ready.wait(timeout):
            raise AssertionError("celery worker not ready:\n" + "".join(self.lines[-40:]))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


@pytest.fixture
def celery_app(broker, uid):
    os.environ["CELERY_BROKER_URL"] = url(broker)
    queue = f"celery-{uid}"
    os.environ["CONFORMANCE_CELERY_QUEUE"] = queue
    sys.path.insert(0, HERE)
    import importlib

    import apps.celery_app as mod

    mod = importlib.reload(mod)
    worker = Worker(broker, queue)
    try:
        worker.wait_ready()
        yield mod, worker
    finally:
        worker.stop()
        mod.app.close()


@pytest.mark.timeout(120)
def test_celery_worker_runs_tasks(celery_app, tmp_path):
    mod, worker = celery_app
    assert mod.add.delay(2, 3).get(timeout=20) == 5
    results = [mod.add.delay(i, i) for i in range(10)]
    assert [r.get(timeout=20) for r in results] == [2 * i for i in range(10)]
    target = tmp_path / "side-effect.txt"
    assert mod.write_file.delay(str(target), "written by the worker").get(timeout=20) == 21
    assert target.read_text() == "written by the worker"
    with pytest.raises(ValueError, match="expected failure"):
        mod.boom.delay().get(timeout=20)


@pytest.mark.timeout(120)
def test_celery_retry_with_countdown(celery_app, tmp_path):
    mod, worker = celery_app
    counter = tmp_path / "attempts"
    assert mod.flaky.delay(str(counter)).get(timeout=30) == 3
    assert counter.read_text() == "3"


@pytest.mark.timeout(120)
def test_celery_eta_and_control_ping(celery_app):
    mod, worker = celery_app
    start = time.monotonic()
    r = mod.add.apply_async((20, 22), countdown=1)
    assert r.get(timeout=20) == 42
    assert time.monotonic() - start >= 0.9
    # broadcast over the pidbox fanout exchange, replies over the reply exchange
    replies = mod.app.control.ping(timeout=3)
    assert any(name.startswith("conf-") for reply in replies for name in reply), replies

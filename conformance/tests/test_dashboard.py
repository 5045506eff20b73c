"""The web dashboard in a real headless Chromium (Debian package chromium), driven over
the Chrome DevTools Protocol with websocket-client: log in with the API's basic auth, see
a queue an AMQP client filled with its depth, purge it from the UI, see it reach 0; find
paho-mqtt's publishes with the message query's by-topic form (topic and time range)."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

import pika
import pytest
import websocket

from helpers import Mqtt

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.skipif(
    not CHROMIUM,
    reason="chromium not installed (Debian package chromium; run.sh installs it when run as root)",
)


class Browser:
    """One headless Chromium and its first page, over CDP."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="triad-chromium-")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
             "--no-first-run", "--remote-debugging-port=0", "--window-size=1200,900",
             f"--user-data-dir={self.dir}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = os.path.join(self.dir, "DevToolsActivePort")
        deadline = time.time() + 30
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            assert time.time() < deadline, "chromium did not start"
            time.sleep(0.1)
        port = int(open(port_file).read().split()[0])
        deadline = time.time() + 10
        while True:
            pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
            pages = [p for p in pages if p.get("type") == "page"]
            if pages:
                break
            assert time.time() < deadline, "no page target"
            time.sleep(0.1)
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=30)
        self.next_id = 0

    def cmd(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                assert "error" not in msg, msg
                return msg.get("result", {})

    def js(self, expr):
        r = self.cmd("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in r, r
        return r["result"].get("value")

    def wait(self, expr, what, timeout=20):
        deadline = time.time() + timeout
        while True:
            v = self.js(expr)
            if v:
                return v
            assert time.time() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    def close(self):
        """Stop chromium and every helper process it started (its own process group: the
        crashpad handler and utility processes outlive the browser process and keep
        writing into the profile), then remove the profile. Removal is retried until a
        deadline, as a helper's last write can still land after the group is gone."""
        try:
            self.ws.close()
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL: whatever is left
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            self.proc.wait(timeout=10)
            deadline = time.time() + 10
            while True:
                try:
                    shutil.rmtree(self.dir)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    assert time.time() < deadline, f"could not remove {self.dir}"
                    time.sleep(0.2)


@pytest.fixture
def browser():
    b = Browser()
    yield b
    b.close()


def cell(queue, col):
    """JS: the text of column `col` (0-based) in the queues table row of `queue`."""
    return (f"(() => {{ const r = [...document.querySelectorAll('#queues tbody tr')]"
            f".find(r => r.dataset.name === {json.dumps(queue)});"
            f" return r ? r.children[{col}].textContent : null; }})()")


def test_login_see_a_queue_purge_it_in_the_browser(broker, browser, uid):
    host, amqp = broker.host_port("amqp")
    conn = pika.BlockingConnection(pika.ConnectionParameters(host=host, port=amqp))
    ch = conn.channel()
    q = f"ui-{uid}"
    ch.queue_declare(q, durable=True)
    for i in range(7):
        ch.basic_publish("", q, f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))

    h, port = broker.host_port("http")
    browser.cmd("Page.enable")
    browser.cmd("Page.navigate", url=f"http://{h}:{port}/")
    browser.wait("!!document.querySelector('#login') && !document.querySelector('#login').hidden",
                 "the login form")
    # a wrong password is refused on the page
    browser.js("document.querySelector('#user').value = 'guest';"
               "document.querySelector('#password').value = 'nope';"
               "document.querySelector('#login button').click(); true")
    browser.wait("document.querySelector('#login-error').textContent.length > 0", "the refusal")
    browser.js("document.querySelector('#password').value = 'guest';"
               "document.querySelector('#login button').click(); true")
    browser.wait("document.querySelector('#who').textContent === 'guest'", "the login")
    browser.wait("!!document.querySelector('#totals')", "the overview")
    assert browser.js("!!document.querySelector('#rate-chart')")

    browser.js("location.hash = '#queues'; true")
    # the queue the AMQP client filled, with its depth (column 2: messages)
    browser.wait(f"{cell(q, 2)} === '7'", "the queue's depth in the table")
    if os.environ.get("TRIAD_SCREENSHOT"):
        shot = browser.cmd("Page.captureScreenshot", format="png")["data"]
        import base64
        with open(os.environ["TRIAD_SCREENSHOT"], "wb") as f:
            f.write(base64.b64decode(shot))
    browser.js(f"[...document.querySelectorAll('#queues tbody tr')]"
               f".find(r => r.dataset.name === {json.dumps(q)})"
               f".querySelector('button.purge').click(); true")
    browser.wait(f"{cell(q, 2)} === '0'", "the purged queue at 0")
    assert ch.queue_declare(q, passive=True).method.message_count == 0
    ch.queue_delete(q)
    conn.close()


def log_in(browser, broker):
    """Opens `broker`'s dashboard and logs in as guest."""
    h, port = broker.host_port("http")
    browser.cmd("Page.enable")
    browser.cmd("Page.navigate", url=f"http://{h}:{port}/")
    browser.wait("!!document.querySelector('#login') && !document.querySelector('#login').hidden",
                 "the login form")
    browser.js("document.querySelector('#user').value = 'guest';"
               "document.querySelector('#password').value = 'guest';"
               "document.querySelector('#login button').click(); true")
    browser.wait("document.querySelector('#who').textContent === 'guest'", "the login")


def local_datetime(seconds):
    """JS: `seconds` since the epoch as the value of a datetime-local input (the browser's
    local time, whole seconds, as the form's `step="1"` inputs take it)."""
    return (f"(() => {{ const d = new Date({seconds} * 1000);"
            f" const p = (n) => String(n).padStart(2, '0');"
            f" return d.getFullYear() + '-' + p(d.getMonth() + 1) + '-' + p(d.getDate())"
            f" + 'T' + p(d.getHours()) + ':' + p(d.getMinutes()) + ':' + p(d.getSeconds()); }})()")


def find_by_topic(browser, topic, start=None, end=None):
    """Fills the by-topic form (vhost /), submits it through its button and returns the
    result table's rows as lists of cell texts: stored, bytes, routing key, payload,
    queues."""
    browser.js("document.querySelector('#found').replaceChildren(); true")
    browser.js(f"document.querySelector('#msg-topic').value = {json.dumps(topic)};"
               f"document.querySelector('#msg-from').value = "
               f"{local_datetime(start) if start is not None else json.dumps('')};"
               f"document.querySelector('#msg-to').value = "
               f"{local_datetime(end) if end is not None else json.dumps('')}; true")
    # the browser takes the values as given (an input refusing one would empty it)
    if start is not None:
        assert browser.js("document.querySelector('#msg-from').value") != ""
    if end is not None:
        assert browser.js("document.querySelector('#msg-to').value") != ""
    browser.js("document.querySelector('#by-topic button').click(); true")
    browser.wait("!!document.querySelector('#found-table')", f"the results for {topic}")
    return browser.js("[...document.querySelectorAll('#found-table tbody tr')]"
                      ".map(r => [...r.children].map(c => c.textContent))")


def test_find_mqtt_publishes_by_topic_and_time_in_the_browser(configured_broker, browser, uid):
    # the by-topic query needs MQTT publishes indexed by topic (off by default)
    broker = configured_broker("[mqtt]\nindex_topics = true\n")
    sub = Mqtt(broker, client_id=f"us-{uid}")
    pub = Mqtt(broker, client_id=f"up-{uid}")
    try:
        # a subscriber, so the publishes are routed and stored
        sub.subscribe(f"meter/{uid}/#", qos=1)
        pub.publish(f"meter/{uid}/a", b"a-1", qos=1)
        pub.publish(f"meter/{uid}/b", b"b-1", qos=1)
        assert len(sub.take(2)) == 2
        # a whole second after the first two were stored, before the third is: the form's
        # time inputs take whole seconds
        mark = int(time.time()) + 1
        while time.time() <= mark + 0.05:
            time.sleep(0.01)
        pub.publish(f"meter/{uid}/a", b"a-2", qos=1)
        assert len(sub.take(1)) == 1

        log_in(browser, broker)
        browser.js("location.hash = '#messages'; true")
        browser.wait("!!document.querySelector('#by-topic')", "the message query page")

        rows = find_by_topic(browser, f"meter/{uid}/a")
        # newest first, the MQTT topic as its routing key, the payload as text
        assert [r[3] for r in rows] == ["a-2", "a-1"], rows
        assert [r[2] for r in rows] == [f"meter.{uid}.a"] * 2, rows
        assert [r[1] for r in rows] == ["3", "3"], rows
        # stored times (ISO, UTC) on either side of the mark
        at_mark = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(mark))
        assert rows[1][0] < at_mark < rows[0][0], (rows, at_mark)
        # each went to the subscriber's session queue
        assert all(f'"name":"mqtt-subscription-us-{uid}"' in r[4] for r in rows), rows

        # the time range, from the form's datetime inputs
        assert [r[3] for r in find_by_topic(browser, f"meter/{uid}/a", end=mark)] == ["a-1"]
        assert [r[3] for r in find_by_topic(browser, f"meter/{uid}/a", start=mark)] == ["a-2"]
        assert [r[3] for r in find_by_topic(browser, f"meter/{uid}/b")] == ["b-1"]
        assert find_by_topic(browser, f"meter/{uid}/c") == []

        # a topic filter is refused, and the page says why
        browser.js("document.querySelector('#status').textContent = ''; true")
        browser.js(f"document.querySelector('#msg-topic').value = {json.dumps(f'meter/{uid}/+')};"
                   "document.querySelector('#msg-from').value = '';"
                   "document.querySelector('#msg-to').value = '';"
                   "document.querySelector('#by-topic button').click(); true")
        refusal = browser.wait("document.querySelector('#status').textContent", "the refusal")
        assert refusal == "query: topic must be a topic name, not a filter (no + or #)", refusal
    finally:
        pub.close()
        sub.close()

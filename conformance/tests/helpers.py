"""Small shared helpers: client factories with bounded timeouts, and receive loops that
always give up after a deadline."""

import time

import pika


def pika_params(broker, **kw):
    host, port = broker.host_port("amqp")
    kw.setdefault("credentials", pika.PlainCredentials("guest", "guest"))
    kw.setdefault("socket_timeout", 5)
    kw.setdefault("blocked_connection_timeout", 10)
    kw.setdefault("connection_attempts", 3)
    kw.setdefault("retry_delay", 0.5)
    return pika.ConnectionParameters(host=host, port=port, **kw)


def pika_connect(broker, **kw):
    return pika.BlockingConnection(pika_params(broker, **kw))


def consume(conn, ch, queue, n, timeout=5.0, auto_ack=False, ack=True, **consume_kw):
    """basic.consume on `queue` until `n` deliveries arrived or `timeout` passed; returns
    a list of (method, properties, body). Acks each delivery unless ack=False."""
    got = []

    def on_message(channel, method, props, body):
        got.append((method, props, body))
        if ack and not auto_ack:
            channel.basic_ack(method.delivery_tag)

    tag = ch.basic_consume(queue, on_message, auto_ack=auto_ack, **consume_kw)
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    if len(got) >= n:
        # give a surplus delivery the chance to show up, so callers can assert on "no more"
        conn.process_data_events(time_limit=0.2)
    if ch.is_open:
        ch.basic_cancel(tag)
    return got


def wait_for(predicate, timeout=5.0, interval=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# --- STOMP (stomp.py) -----------------------------------------------------------------

import queue as _queue  # noqa: E402

import stomp  # noqa: E402


class StompListener(stomp.ConnectionListener):
    """Collects frames into queues so tests can wait for them with a timeout."""

    def __init__(self):
        self.messages = _queue.Queue()
        self.errors = _queue.Queue()
        self.receipts = _queue.Queue()
        self.connected = _queue.Queue()
        self.disconnected = _queue.Queue()

    def on_connected(self, frame):
        self.connected.put(frame)

    def on_message(self, frame):
        self.messages.put(frame)

    def on_error(self, frame):
        self.errors.put(frame)

    def on_receipt(self, frame):
        self.receipts.put(frame)

    def on_disconnected(self):
        self.disconnected.put(True)


class Stomp:
    """A stomp.py 1.2 connection with bounded waits."""

    def __init__(self, broker, login="guest", passcode="guest", headers=None, connect=True,
                 auto_decode=True):
        host, port = broker.host_port("stomp")
        # Against Triad, stomp.py's default `host` header (the server's address) is what
        # users send; an external RabbitMQ would read it as a vhost name, so name "/" there.
        vhost = "/" if getattr(broker, "external", False) else None
        self.conn = stomp.Connection12([(host, port)], timeout=5, auto_decode=auto_decode,
                                       reconnect_attempts_max=1, vhost=vhost)
        self.listener = StompListener()
        self.conn.set_listener("l", self.listener)
        self._receipt = 0
        if connect:
            self.connect(login, passcode, headers)

    def connect(self, login="guest", passcode="guest", headers=None, timeout=5):
        self.conn.connect(login, passcode, wait=False, headers=headers or {})
        return self.wait_connected(timeout)

    def wait_connected(self, timeout=5):
        try:
            return self.listener.connected.get(timeout=timeout)
        except _queue.Empty:
            err = self.error(0)
            raise AssertionError(f"no CONNECTED within {timeout}s; error={err and err.headers}")

    def receipt(self):
        self._receipt += 1
        return f"r-{id(self)}-{self._receipt}"

    def wait_receipt(self, rid, timeout=5):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no RECEIPT {rid} within {timeout}s")
            try:
                f = self.listener.receipts.get(timeout=left)
            except _queue.Empty:
                continue
            if f.headers.get("receipt-id") == rid:
                return f

    def subscribe(self, destination, sid, ack="auto", **headers):
        rid = self.receipt()
        self.conn.subscribe(destination, sid, ack=ack, headers=dict(headers, receipt=rid))
        self.wait_receipt(rid)

    def send(self, destination, body, wait=True, **headers):
        if wait:
            rid = self.receipt()
            headers["receipt"] = rid
        self.conn.send(destination, body, headers=headers)
        if wait:
            self.wait_receipt(rid)

    def message(self, timeout=5):
        try:
            return self.listener.messages.get(timeout=timeout)
        except _queue.Empty:
            return None

    def messages(self, n, timeout=5):
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            m = self.message(left)
            if m is None:
                break
            out.append(m)
        return out

    def error(self, timeout=5):
        try:
            return self.listener.errors.get(timeout=timeout)
        except _queue.Empty:
            return None

    def close(self):
        try:
            if self.conn.is_connected():
                rid = self.receipt()
                self.conn.disconnect(receipt=rid)
        except Exception:
            pass
        try:
            self.conn.transport.stop()
        except Exception:
            pass

    def drop(self):
        """Close the socket without DISCONNECT."""
        try:
            self.conn.transport.disconnect_socket()
        except Exception:
            pass


# --- MQTT (paho-mqtt 2.x, MQTT 3.1.1) ---------------------------------------------------

import paho.mqtt.client as _mqtt  # noqa: E402


class Mqtt:
    """A paho client with its network loop on a thread (or driven by hand when
    threaded=False, so a test can kill the socket without paho reconnecting)."""

    def __init__(self, broker, client_id="", clean_session=True, username="guest",
                 password="guest", will=None, connect=True, keepalive=30, threaded=True,
                 manual_ack=False, port=None):
        host, bport = broker.host_port("mqtt")
        self.host, self.port = host, port or bport
        self.client_id = client_id
        self.threaded = threaded
        self.c = _mqtt.Client(_mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                              protocol=_mqtt.MQTTv311, clean_session=clean_session,
                              manual_ack=manual_ack)
        if username is not None:
            self.c.username_pw_set(username, password)
        if will:
            self.c.will_set(*will)
        self.messages = _queue.Queue()
        self.connacks = _queue.Queue()
        self.subacks = {}
        self.disconnects = _queue.Queue()
        self.c.on_connect = lambda c, u, flags, rc, props: self.connacks.put((flags, rc))
        self.c.on_message = lambda c, u, msg: self.messages.put(msg)
        self.c.on_subscribe = lambda c, u, mid, rcs, props: self.subacks.__setitem__(mid, rcs)
        self.c.on_disconnect = lambda c, u, flags, rc, props: self.disconnects.put(rc)
        self.keepalive = keepalive
        self.started = False
        if connect:
            flags, rc = self.connect()
            assert not rc.is_failure, f"CONNACK refused: {rc}"

    def connect(self, timeout=5):
        self.c.connect(self.host, self.port, self.keepalive)
        if self.threaded:
            self.c.loop_start()
            self.started = True
            try:
                return self.connacks.get(timeout=timeout)
            except _queue.Empty:
                raise AssertionError("no CONNACK")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.c.loop(timeout=0.05)
            try:
                return self.connacks.get_nowait()
            except _queue.Empty:
                pass
        raise AssertionError("no CONNACK")

    def pump(self, seconds):
        """Drive the loop by hand (threaded=False)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.c.loop(timeout=0.02)

    def subscribe(self, topic, qos=0, timeout=5):
        rc, mid = self.c.subscribe(topic, qos)
        assert rc == _mqtt.MQTT_ERR_SUCCESS
        deadline = time.monotonic() + timeout
        while mid not in self.subacks:
            if time.monotonic() > deadline:
                raise AssertionError(f"no SUBACK for {topic}")
            if self.threaded:
                time.sleep(0.01)
            else:
                self.c.loop(timeout=0.02)
        return [r.value for r in self.subacks[mid]]

    def unsubscribe(self, topic):
        got = _queue.Queue()
        self.c.on_unsubscribe = lambda c, u, mid, rcs, props: got.put(mid)
        self.c.unsubscribe(topic)
        got.get(timeout=5)

    def publish(self, topic, payload, qos=0, retain=False, timeout=5):
        info = self.c.publish(topic, payload, qos=qos, retain=retain)
        if self.threaded:
            info.wait_for_publish(timeout=timeout)
        else:
            deadline = time.monotonic() + timeout
            while not info.is_published() and time.monotonic() < deadline:
                self.c.loop(timeout=0.02)
        assert info.is_published(), f"publish to {topic} (qos {qos}) not completed"
        return info

    def message(self, timeout=5):
        try:
            return self.messages.get(timeout=timeout)
        except _queue.Empty:
            return None

    def take(self, n, timeout=5):
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            m = self.message(left)
            if m is None:
                break
            out.append(m)
        return out

    def drain(self, quiet=0.3):
        """All messages until none arrives for `quiet` seconds."""
        out = []
        while True:
            m = self.message(quiet)
            if m is None:
                return out
            out.append(m)

    def close(self):
        try:
            self.c.disconnect()
        except Exception:
            pass
        if self.started:
            self.c.loop_stop()
            self.started = False

    def kill(self):
        """Drop the TCP connection without DISCONNECT (and without paho reconnecting)."""
        if self.started:
            self.c._thread_terminate = True
        sock = self.c.socket()
        if sock is not None:
            import socket as _s
            try:
                sock.shutdown(_s.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self.started:
            self.c.loop_stop()
            self.started = False

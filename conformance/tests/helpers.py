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

"""Delayed delivery with pika, stomp.py and paho-mqtt: `x-delay` (ms) or
`x-delay-level` (RocketMQ's levels 1-18) on a publish to any exchange (AMQP header,
STOMP header), the delayed-message plugin's exchange type `x-delayed-message`, and
EMQX's MQTT topic prefix `$delayed/<seconds>/<topic>`. A delayed message is routed
through its exchange when it is due, and not before."""

import signal
import time

import pika
import pytest

from helpers import Mqtt, Stomp, pika_connect


@pytest.fixture(autouse=True)
def _triad_only(broker):
    if getattr(broker, "external", False):
        pytest.skip("delayed delivery is a plugin on RabbitMQ and not installed there")


def get(ch, q, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m, p, b = ch.basic_get(q, auto_ack=True)
        if m is not None:
            return p, b
        time.sleep(0.01)
    return None


def test_pika_x_delay_on_the_default_exchange_and_a_delayed_message_exchange(broker, uid):
    conn = pika_connect(broker)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        q, x = f"q-{uid}", f"dx-{uid}"
        ch.queue_declare(q, durable=True)
        # the plugin's exchange type, routing as its x-delayed-type
        ch.exchange_declare(x, "x-delayed-message", arguments={"x-delayed-type": "direct"})
        ch.queue_bind(q, x, routing_key="k")
        t0 = time.monotonic()
        ch.basic_publish("", q, b"plain-delay", pika.BasicProperties(
            delivery_mode=2, headers={"x-delay": 300}))
        ch.basic_publish(x, "k", b"via-exchange", pika.BasicProperties(
            delivery_mode=2, headers={"x-delay": 600}))
        # early: nothing yet (on a slow machine it may be due already; then it is the
        # first one)
        m, p, b = ch.basic_get(q, auto_ack=True)
        got = (p, b) if m is not None else get(ch, q)
        assert got is not None and got[1] == b"plain-delay"
        assert time.monotonic() - t0 >= 0.3
        got = get(ch, q)
        assert got is not None and got[1] == b"via-exchange"
        assert time.monotonic() - t0 >= 0.6
        # no x-delay: at once, through the same exchange
        ch.basic_publish(x, "k", b"now")
        got = get(ch, q, 2)
        assert got is not None and got[1] == b"now"
        # redeclaring it the same way is fine; without x-delayed-type it is refused
        ch.exchange_declare(x, "x-delayed-message", arguments={"x-delayed-type": "direct"})
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            conn.channel().exchange_declare(f"bad-{uid}", "x-delayed-message")
        assert "x-delayed-type" in e.value.reply_text
    finally:
        conn.close()


def test_pika_x_delay_level_and_bad_values_are_refused_naming_the_header(broker, uid):
    conn = pika_connect(broker)
    try:
        ch = conn.channel()
        q = f"q-{uid}"
        ch.queue_declare(q)
        t0 = time.monotonic()
        ch.basic_publish("", q, b"level-1", pika.BasicProperties(headers={"x-delay-level": 1}))
        got = get(ch, q, 5)
        assert got is not None and got[1] == b"level-1"
        assert time.monotonic() - t0 >= 1.0
        for header, value in [("x-delay", "soon"), ("x-delay-level", 19)]:
            c = conn.channel()
            c.basic_publish("", q, b"x", pika.BasicProperties(headers={header: value}))
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
                c.queue_declare(q, passive=True)  # a round trip to see the close
            assert e.value.reply_code == 406 and header in e.value.reply_text
    finally:
        conn.close()


def test_stomp_x_delay_header(broker, uid):
    dest = f"/queue/q-{uid}"
    c = Stomp(broker)
    try:
        c.subscribe(dest, "s")
        t0 = time.monotonic()
        c.send(dest, "later", **{"x-delay": "400", "persistent": "true"})
        m = c.message()
        assert m is not None and m.body == "later"
        assert time.monotonic() - t0 >= 0.4
    finally:
        c.close()


def test_stomp_bad_x_delay_is_an_error_naming_it(broker, uid):
    c = Stomp(broker)
    try:
        c.conn.send(f"/queue/q-{uid}", "x", headers={"x-delay": "abc"})
        err = c.error(5)
        assert err is not None
        assert "x-delay" in (err.headers.get("message", "") + err.body)
    finally:
        c.close()


def test_mqtt_delayed_topic_prefix(broker, uid):
    sub, pub = Mqtt(broker), Mqtt(broker)
    try:
        topic = f"dl/{uid}"
        assert sub.subscribe(topic, qos=1) == [1]
        t0 = time.monotonic()
        pub.publish(f"$delayed/1/{topic}", b"in a second", qos=1)
        m = sub.message(5)
        assert m is not None and m.topic == topic and m.payload == b"in a second"
        assert time.monotonic() - t0 >= 1.0
        assert sub.message(0.3) is None
    finally:
        sub.close()
        pub.close()


def test_delayed_messages_survive_kill_9(own_broker, uid):
    q = f"q-{uid}"
    conn = pika_connect(own_broker)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(q, durable=True)
    for i in range(20):
        ch.basic_publish("", q, str(i).encode(), pika.BasicProperties(
            delivery_mode=2, headers={"x-delay": 1500}))
    own_broker.restart(signal.SIGKILL)
    conn = pika_connect(own_broker)
    try:
        ch = conn.channel()
        got = set()
        deadline = time.monotonic() + 20
        while len(got) < 20 and time.monotonic() < deadline:
            r = get(ch, q, 0.5)
            if r is not None:
                got.add(int(r[1]))
        assert got == set(range(20))
    finally:
        conn.close()

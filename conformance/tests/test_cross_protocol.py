"""One message, two protocols: RabbitMQ's cross-protocol mapping (MQTT topic a/b ⇄
amq.topic key a.b; STOMP /queue/, /topic/, /exchange/ ⇄ AMQP exchanges and queues)."""

import time

import pika
import pytest

from helpers import Mqtt, Stomp, consume, pika_connect


@pytest.fixture
def amqp(broker):
    c = pika_connect(broker)
    yield c
    if c.is_open:
        c.close()


@pytest.fixture
def clients(broker):
    made = []

    def make(kind, **kw):
        c = {"mqtt": Mqtt, "stomp": Stomp}[kind](broker, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def bound_queue(ch, uid, key):
    q = f"xq-{uid}"
    ch.queue_declare(q, exclusive=True)
    ch.queue_bind(q, "amq.topic", routing_key=key)
    return q


def test_mqtt_publish_reaches_amqp_topic_binding(amqp, clients, uid):
    ch = amqp.channel()
    q = bound_queue(ch, uid, f"x{uid}.a.b")
    m = clients("mqtt")
    m.publish(f"x{uid}/a/b", b"from mqtt", qos=1)
    m.publish(f"x{uid}/a/c", b"other topic", qos=1)
    got = consume(amqp, ch, q, 2, timeout=3)
    assert [b for _, _, b in got] == [b"from mqtt"]
    method, props, _ = got[0]
    assert method.exchange == "amq.topic" and method.routing_key == f"x{uid}.a.b"
    assert props.delivery_mode == 2, "MQTT QoS 1 maps to a persistent message"


def test_mqtt_qos0_is_transient_for_amqp(amqp, clients, uid):
    ch = amqp.channel()
    q = bound_queue(ch, uid, f"x{uid}.#")
    clients("mqtt").publish(f"x{uid}/q0", b"qos0", qos=0)
    got = consume(amqp, ch, q, 1)
    assert [b for _, _, b in got] == [b"qos0"]
    assert got[0][1].delivery_mode in (None, 1)


def test_mqtt_dot_in_level_maps_to_slash(amqp, clients, uid):
    ch = amqp.channel()
    q = bound_queue(ch, uid, f"x{uid}.room/1.temp")
    clients("mqtt").publish(f"x{uid}/room.1/temp", b"21.5", qos=1)
    got = consume(amqp, ch, q, 1)
    assert [b for _, _, b in got] == [b"21.5"]
    assert got[0][0].routing_key == f"x{uid}.room/1.temp"


def test_amqp_publish_reaches_mqtt_subscriber(amqp, clients, uid):
    m = clients("mqtt")
    assert m.subscribe(f"y{uid}/+/temp", qos=1) == [1]
    ch = amqp.channel()
    ch.basic_publish("amq.topic", f"y{uid}.kitchen.temp", b"persistent",
                     pika.BasicProperties(delivery_mode=2, headers={"h": "dropped"}))
    ch.basic_publish("amq.topic", f"y{uid}.kitchen.temp", b"transient")
    ch.basic_publish("amq.topic", f"y{uid}.kitchen.hum", b"not matching")
    got = m.take(2)
    assert [(x.topic, x.payload, x.qos) for x in got] == [
        (f"y{uid}/kitchen/temp", b"persistent", 1),
        (f"y{uid}/kitchen/temp", b"transient", 0),
    ]
    assert m.message(0.3) is None


def test_stomp_send_queue_consumed_by_amqp(amqp, clients, uid):
    q = f"sq-{uid}"
    s = clients("stomp")
    s.send(f"/queue/{q}", "from stomp", **{"content-type": "text/plain", "x-k": "v", "persistent": "true"})
    ch = amqp.channel()
    ok = ch.queue_declare(q, passive=True).method
    assert ok.message_count == 1
    got = consume(amqp, ch, q, 1)
    assert [b for _, _, b in got] == [b"from stomp"]
    method, props, _ = got[0]
    assert method.exchange == "" and method.routing_key == q
    assert props.content_type == "text/plain"
    assert props.headers["x-k"] == "v"
    assert props.delivery_mode == 2


def test_amqp_topic_publish_reaches_stomp_topic_subscriber(amqp, clients, uid):
    s = clients("stomp")
    s.subscribe(f"/topic/s{uid}.t", "sub")
    ch = amqp.channel()
    ch.basic_publish("amq.topic", f"s{uid}.t", b"from amqp", pika.BasicProperties(
        content_type="application/json", correlation_id="c-7", reply_to="r",
        headers={"x-app": "yes", "n": 5}, priority=4, delivery_mode=2))
    msg = s.message()
    assert msg is not None and msg.body == "from amqp"
    h = msg.headers
    assert h["destination"] == f"/topic/s{uid}.t"
    assert h["content-type"] == "application/json"
    assert h["correlation-id"] == "c-7"
    assert h["x-app"] == "yes" and h["n"] == "5"
    assert h["priority"] == "4"
    assert h["persistent"] == "true"


def test_amqp_default_exchange_reaches_stomp_queue_subscriber(amqp, clients, uid):
    q = f"sq-{uid}"
    s = clients("stomp")
    s.subscribe(f"/queue/{q}", "sub")  # declares the queue
    amqp.channel().basic_publish("", q, b"hi")
    msg = s.message()
    assert msg is not None and msg.body == "hi"
    assert msg.headers["destination"] == f"/queue/{q}"


def test_stomp_exchange_destination_reaches_amqp_queue(amqp, clients, uid):
    ex, q = f"ex-{uid}", f"q-{uid}"
    ch = amqp.channel()
    ch.exchange_declare(ex, "direct")
    ch.queue_declare(q, exclusive=True)
    ch.queue_bind(q, ex, routing_key="rk")
    clients("stomp").send(f"/exchange/{ex}/rk", "via exchange")
    got = consume(amqp, ch, q, 1)
    assert [b for _, _, b in got] == [b"via exchange"]
    assert got[0][0].exchange == ex and got[0][0].routing_key == "rk"


def test_mqtt_publish_reaches_stomp_topic_subscriber(clients, uid):
    s = clients("stomp")
    s.subscribe(f"/topic/m{uid}.*.c", "sub")
    clients("mqtt").publish(f"m{uid}/b/c", b"mqtt to stomp", qos=1)
    msg = s.message()
    assert msg is not None and msg.body == "mqtt to stomp"
    assert msg.headers["destination"] == f"/topic/m{uid}.b.c"


def test_stomp_topic_send_reaches_mqtt_subscriber(clients, uid):
    m = clients("mqtt")
    m.subscribe(f"n{uid}/#", qos=1)
    clients("stomp").send(f"/topic/n{uid}.x.y", "stomp to mqtt", persistent="true")
    got = m.message()
    assert got is not None and got.payload == b"stomp to mqtt"
    assert got.topic == f"n{uid}/x/y"


def test_mqtt_retained_not_leaking_into_amqp_redelivery(amqp, clients, uid):
    """A retained MQTT publish is routed once to AMQP queues like any other publish."""
    ch = amqp.channel()
    q = bound_queue(ch, uid, f"r{uid}.state")
    clients("mqtt").publish(f"r{uid}/state", b"retained", qos=1, retain=True)
    time.sleep(0.2)
    got = consume(amqp, ch, q, 2, timeout=1.5)
    assert [b for _, _, b in got] == [b"retained"]
    clients("mqtt").publish(f"r{uid}/state", b"", qos=1, retain=True)

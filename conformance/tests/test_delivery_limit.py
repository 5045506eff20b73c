"""Delivery counts and x-delivery-limit on every queue, with pika and stomp.py:
redeliveries carry `x-delivery-count` (absent on the first delivery, as on RabbitMQ's
quorum queues), the count survives a kill -9, and a message returned more often than
`x-delivery-limit` is dead-lettered with x-death reason `delivery_limit` (or dropped).

RabbitMQ has the argument on quorum queues only; these tests declare classic queues, so
against an external RabbitMQ they are skipped."""

import signal
import time

import pika
import pytest

from helpers import Stomp, pika_connect


@pytest.fixture(autouse=True)
def _triad_only(broker):
    if getattr(broker, "external", False):
        pytest.skip("x-delivery-limit on a classic queue is Triad's (RabbitMQ: quorum queues)")


def get(ch, q, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m, p, b = ch.basic_get(q)
        if m is not None:
            return m, p, b
        time.sleep(0.02)
    raise AssertionError(f"nothing in {q} within {timeout}s")


def count_of(props):
    return (props.headers or {}).get("x-delivery-count")


def test_pika_redeliveries_carry_the_count_and_the_limit_dead_letters(broker, uid):
    conn = pika_connect(broker)
    try:
        ch = conn.channel()
        dlx, dead, q = f"dlx-{uid}", f"dead-{uid}", f"q-{uid}"
        ch.exchange_declare(dlx, "fanout")
        ch.queue_declare(dead)
        ch.queue_bind(dead, dlx)
        ch.queue_declare(q, durable=True, arguments={
            "x-delivery-limit": 2, "x-dead-letter-exchange": dlx})
        ch.basic_publish("", q, b"poison", pika.BasicProperties(delivery_mode=2))
        seen = []
        for _ in range(3):
            m, p, b = get(ch, q)
            assert b == b"poison"
            seen.append((m.redelivered, count_of(p)))
            ch.basic_nack(m.delivery_tag, requeue=True)
        assert seen == [(False, None), (True, 1), (True, 2)]
        m, p, b = get(ch, dead)
        assert b == b"poison"
        assert p.headers["x-first-death-reason"] == "delivery_limit"
        assert p.headers["x-death"][0]["reason"] == "delivery_limit"
        assert p.headers["x-death"][0]["queue"] == q
        ch.basic_ack(m.delivery_tag)
        assert ch.queue_declare(q, passive=True).method.message_count == 0
        # declare equivalence includes it
        ch.queue_declare(q, durable=True, arguments={
            "x-delivery-limit": 2, "x-dead-letter-exchange": dlx})
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.queue_declare(q, durable=True, arguments={
                "x-delivery-limit": 3, "x-dead-letter-exchange": dlx})
        assert e.value.reply_code == 406 and "x-delivery-limit" in e.value.reply_text
    finally:
        conn.close()


def test_pika_a_bad_delivery_limit_is_refused_naming_it(broker, uid):
    conn = pika_connect(broker)
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            conn.channel().queue_declare(f"q-{uid}", arguments={"x-delivery-limit": "three"})
        assert e.value.reply_code == 406 and "x-delivery-limit" in e.value.reply_text
    finally:
        conn.close()


def test_pika_without_a_dlx_past_the_limit_it_is_dropped(broker, uid):
    conn = pika_connect(broker)
    try:
        ch = conn.channel()
        q = f"q-{uid}"
        ch.queue_declare(q, arguments={"x-delivery-limit": 0})
        ch.basic_publish("", q, b"once")
        ch.basic_publish("", q, b"next")
        m, _, b = get(ch, q)
        assert b == b"once"
        ch.basic_reject(m.delivery_tag, requeue=True)
        m, p, b = get(ch, q)
        assert b == b"next" and count_of(p) is None
        ch.basic_ack(m.delivery_tag)
        assert ch.queue_declare(q, passive=True).method.message_count == 0
    finally:
        conn.close()


def test_the_count_survives_kill_9(own_broker, uid):
    q = f"q-{uid}"
    conn = pika_connect(own_broker)
    ch = conn.channel()
    # counts are stored for queues with a limit (or a back-off) only
    ch.queue_declare(q, durable=True, arguments={"x-delivery-limit": 100})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"m", pika.BasicProperties(delivery_mode=2))
    for _ in range(2):
        m, _, _ = get(ch, q)
        ch.basic_nack(m.delivery_tag, requeue=True)
    # the consumer's channel closes with it unacked: a return too
    m, p, _ = get(ch, q)
    assert count_of(p) == 2
    ch.close()
    ch = conn.channel()
    m, p, _ = get(ch, q)
    assert count_of(p) == 3
    # in flight (unacked) when the broker is killed
    own_broker.restart(signal.SIGKILL)
    conn = pika_connect(own_broker)
    try:
        ch = conn.channel()
        m, p, b = get(ch, q)
        assert b == b"m" and m.redelivered
        assert count_of(p) == 3, p.headers
        ch.basic_ack(m.delivery_tag)
    finally:
        conn.close()


def test_stomp_nack_redelivers_with_the_x_delivery_count_header(broker, uid):
    dest = f"/queue/q-{uid}"
    c = Stomp(broker)
    try:
        # the queue argument as a header, as RabbitMQ's STOMP plugin takes them
        c.send(dest, "m", **{"x-delivery-limit": "1", "persistent": "true"})
        c.subscribe(dest, "s", ack="client-individual", **{"x-delivery-limit": "1"})
        m = c.message()
        assert m is not None and m.body == "m"
        assert "x-delivery-count" not in m.headers
        c.conn.nack(m.headers["ack"])
        m = c.message()
        assert m is not None and m.body == "m"
        assert m.headers.get("x-delivery-count") == "1"
        assert m.headers.get("redelivered") == "true"
        # second return: past the limit of 1, no dead-letter exchange: dropped
        c.conn.nack(m.headers["ack"])
        assert c.message(0.5) is None
    finally:
        c.close()
    conn = pika_connect(broker)
    try:
        assert conn.channel().queue_declare(
            f"q-{uid}", passive=True).method.message_count == 0
    finally:
        conn.close()


def test_pika_retry_backoff_delays_a_requeued_message(broker, uid):
    conn = pika_connect(broker)
    try:
        ch = conn.channel()
        q = f"q-{uid}"
        ch.queue_declare(q, durable=True, arguments={"x-retry-backoff": "400ms,800ms"})
        ch.basic_publish("", q, b"retry", pika.BasicProperties(delivery_mode=2))
        m, _, _ = get(ch, q)
        t0 = time.monotonic()
        ch.basic_nack(m.delivery_tag, requeue=True)
        m, p, b = get(ch, q)
        assert b == b"retry" and count_of(p) == 1
        assert time.monotonic() - t0 >= 0.4
        ch.basic_nack(m.delivery_tag, requeue=True)
        t1 = time.monotonic()
        m, p, b = get(ch, q)
        assert count_of(p) == 2 and time.monotonic() - t1 >= 0.8
        ch.basic_ack(m.delivery_tag)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            conn.channel().queue_declare(f"bad-{uid}", arguments={"x-retry-backoff": "1 fortnight"})
        assert e.value.reply_code == 406 and "x-retry-backoff" in e.value.reply_text
    finally:
        conn.close()

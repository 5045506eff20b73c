"""pika 1.3.2 (BlockingConnection) against Triad's AMQP 0-9-1 listener: the features
pika's users build on, with RabbitMQ's semantics."""

import time

import pika
import pika.exceptions as pex
import pytest

from helpers import consume, pika_connect, pika_params


@pytest.fixture
def conn(broker):
    c = pika_connect(broker)
    yield c
    if c.is_open:
        try:
            c.close()
        except Exception:
            pass


@pytest.fixture
def ch(conn):
    return conn.channel()


def declare(ch, name, **kw):
    return ch.queue_declare(name, **kw).method


def count(conn, name):
    c = conn.channel()
    try:
        return c.queue_declare(name, passive=True).method.message_count
    finally:
        c.close()


# --- basics ------------------------------------------------------------------------


def test_declare_bind_publish_consume_manual_ack(conn, ch, uid):
    ex, q = f"ex-{uid}", f"q-{uid}"
    ch.exchange_declare(ex, "direct")
    ok = declare(ch, q)
    assert ok.queue == q and ok.message_count == 0 and ok.consumer_count == 0
    ch.queue_bind(q, ex, routing_key="rk")
    props = pika.BasicProperties(
        content_type="application/json",
        content_encoding="utf-8",
        headers={"x-trace": "abc", "n": 7, "nested": {"k": "v"}, "flag": True},
        delivery_mode=2,
        priority=3,
        correlation_id="corr-1",
        reply_to="replies",
        expiration="60000",
        message_id="mid-1",
        timestamp=1700000000,
        type="order.created",
        user_id="guest",
        app_id="conformance",
    )
    for i in range(3):
        ch.basic_publish(ex, "rk", f"m{i}".encode(), props)
    ch.basic_publish(ex, "other-key", b"not routed here")
    got = consume(conn, ch, q, 3)
    assert [b for _, _, b in got] == [b"m0", b"m1", b"m2"]
    method, p, _ = got[0]
    assert method.exchange == ex and method.routing_key == "rk"
    assert method.redelivered is False
    assert p.content_type == "application/json"
    assert p.content_encoding == "utf-8"
    assert p.headers == {"x-trace": "abc", "n": 7, "nested": {"k": "v"}, "flag": True}
    assert p.delivery_mode == 2 and p.priority == 3
    assert p.correlation_id == "corr-1" and p.reply_to == "replies"
    assert p.message_id == "mid-1" and p.timestamp == 1700000000
    assert p.type == "order.created" and p.user_id == "guest" and p.app_id == "conformance"
    assert [m.delivery_tag for m, _, _ in got] == [1, 2, 3]
    assert count(conn, q) == 0


def test_default_exchange_routes_by_queue_name(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    ch.basic_publish("", q, b"direct to queue")
    got = consume(conn, ch, q, 1)
    assert [b for _, _, b in got] == [b"direct to queue"]
    assert got[0][0].exchange == "" and got[0][0].routing_key == q


def test_server_named_queue(conn, ch):
    ok = ch.queue_declare("", exclusive=True).method
    assert ok.queue.startswith("amq.gen-")
    ch.basic_publish("", ok.queue, b"x")
    assert [b for _, _, b in consume(conn, ch, ok.queue, 1)] == [b"x"]


def test_unacked_messages_return_on_channel_close(conn, uid):
    q = f"q-{uid}"
    c1 = conn.channel()
    declare(c1, q)
    c1.basic_publish("", q, b"one")
    got = consume(conn, c1, q, 1, ack=False)
    assert len(got) == 1 and got[0][0].redelivered is False
    c1.close()
    c2 = conn.channel()
    got = consume(conn, c2, q, 1)
    assert [b for _, _, b in got] == [b"one"]
    assert got[0][0].redelivered is True


def test_publisher_confirms_persistent_to_durable_queue(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q, durable=True)
    ch.confirm_delivery()
    for i in range(50):
        # raises NackError / UnroutableError if the broker does not ack
        ch.basic_publish("", q, f"p{i}".encode(), pika.BasicProperties(delivery_mode=2))
    assert count(conn, q) == 50
    got = consume(conn, ch, q, 50)
    assert [b for _, _, b in got] == [f"p{i}".encode() for i in range(50)]
    assert all(p.delivery_mode == 2 for _, p, _ in got)


def test_prefetch_limits_unacked_deliveries(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    for i in range(6):
        ch.basic_publish("", q, f"m{i}".encode())
    ch.basic_qos(prefetch_count=2)
    got = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(m))
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert len(got) == 2, "prefetch_count=2 must cap unacked deliveries at 2"
    ch.basic_ack(got[0].delivery_tag)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert len(got) == 3
    # multiple ack releases the rest of the window
    ch.basic_ack(got[2].delivery_tag, multiple=True)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert len(got) == 5


def test_nack_requeue_sets_redelivered(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    ch.basic_publish("", q, b"again")
    method, _, body = ch.basic_get(q)
    assert body == b"again" and method.redelivered is False
    ch.basic_nack(method.delivery_tag, requeue=True)
    got = consume(conn, ch, q, 1)
    assert [b for _, _, b in got] == [b"again"]
    assert got[0][0].redelivered is True


def test_nack_multiple_requeues_all(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    for i in range(3):
        ch.basic_publish("", q, f"m{i}".encode())
    got = consume(conn, ch, q, 3, ack=False)
    assert len(got) == 3
    ch.basic_nack(got[-1][0].delivery_tag, multiple=True, requeue=True)
    again = consume(conn, ch, q, 3)
    assert sorted(b for _, _, b in again) == [b"m0", b"m1", b"m2"]
    assert all(m.redelivered for m, _, _ in again)


def test_reject_without_requeue_dead_letters_with_x_death(conn, ch, uid):
    dlx, dlq, q = f"dlx-{uid}", f"dlq-{uid}", f"q-{uid}"
    ch.exchange_declare(dlx, "fanout")
    declare(ch, dlq)
    ch.queue_bind(dlq, dlx)
    declare(ch, q, arguments={"x-dead-letter-exchange": dlx})
    ch.basic_publish("", q, b"poison", pika.BasicProperties(headers={"keep": "me"}))
    method, _, body = ch.basic_get(q)
    assert body == b"poison"
    ch.basic_reject(method.delivery_tag, requeue=False)
    got = consume(conn, ch, dlq, 1)
    assert [b for _, _, b in got] == [b"poison"]
    m, p, _ = got[0]
    assert m.exchange == dlx and m.routing_key == q
    assert p.headers["keep"] == "me"
    deaths = p.headers["x-death"]
    assert len(deaths) == 1
    d = deaths[0]
    assert d["queue"] == q and d["reason"] == "rejected"
    assert d["exchange"] == "" and d["routing-keys"] == [q]
    assert d["count"] == 1
    assert p.headers.get("x-first-death-reason") == "rejected"
    assert p.headers.get("x-first-death-queue") == q
    assert count(conn, q) == 0


def test_dead_letter_routing_key_override(conn, ch, uid):
    dlx, dlq, q = f"dlx-{uid}", f"dlq-{uid}", f"q-{uid}"
    ch.exchange_declare(dlx, "direct")
    declare(ch, dlq)
    ch.queue_bind(dlq, dlx, routing_key="dead")
    declare(ch, q, arguments={"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": "dead"})
    ch.basic_publish("", q, b"x")
    method, _, _ = ch.basic_get(q)
    ch.basic_nack(method.delivery_tag, requeue=False)
    got = consume(conn, ch, dlq, 1)
    assert [b for _, _, b in got] == [b"x"]
    assert got[0][0].routing_key == "dead"


def test_message_ttl_expires_into_dlx(conn, ch, uid):
    dlx, dlq, q = f"dlx-{uid}", f"dlq-{uid}", f"q-{uid}"
    ch.exchange_declare(dlx, "fanout")
    declare(ch, dlq)
    ch.queue_bind(dlq, dlx)
    declare(ch, q, arguments={"x-message-ttl": 200, "x-dead-letter-exchange": dlx})
    ch.basic_publish("", q, b"short-lived")
    got = consume(conn, ch, dlq, 1, timeout=5)
    assert [b for _, _, b in got] == [b"short-lived"]
    d = got[0][1].headers["x-death"][0]
    assert d["reason"] == "expired" and d["queue"] == q
    assert count(conn, q) == 0


def test_per_message_expiration(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    ch.basic_publish("", q, b"gone", pika.BasicProperties(expiration="100"))
    ch.basic_publish("", q, b"stays")
    time.sleep(0.4)
    m, _, body = ch.basic_get(q, auto_ack=True)
    assert body == b"stays"
    assert ch.basic_get(q)[0] is None


def test_max_length_drops_head(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q, arguments={"x-max-length": 3})
    for i in range(5):
        ch.basic_publish("", q, f"m{i}".encode())
    assert count(conn, q) == 3
    got = consume(conn, ch, q, 3)
    assert [b for _, _, b in got] == [b"m2", b"m3", b"m4"]


def test_max_length_drop_head_dead_letters_maxlen(conn, ch, uid):
    dlx, dlq, q = f"dlx-{uid}", f"dlq-{uid}", f"q-{uid}"
    ch.exchange_declare(dlx, "fanout")
    declare(ch, dlq)
    ch.queue_bind(dlq, dlx)
    declare(ch, q, arguments={"x-max-length": 1, "x-dead-letter-exchange": dlx})
    ch.basic_publish("", q, b"old")
    ch.basic_publish("", q, b"new")
    got = consume(conn, ch, dlq, 1)
    assert [b for _, _, b in got] == [b"old"]
    assert got[0][1].headers["x-death"][0]["reason"] == "maxlen"


def test_reject_publish_overflow_nacks_under_confirms(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"fits")
    with pytest.raises(pex.NackError):
        ch.basic_publish("", q, b"overflows")
    assert count(conn, q) == 1


def test_priority_queue_delivers_highest_first(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q, arguments={"x-max-priority": 10})
    for prio in (1, 5, 9, 0, 5):
        ch.basic_publish("", q, f"p{prio}".encode(), pika.BasicProperties(priority=prio))
    ch.basic_publish("", q, b"none")  # no priority = 0
    bodies = []
    for _ in range(6):
        m, _, body = ch.basic_get(q, auto_ack=True)
        assert m is not None
        bodies.append(body)
    assert bodies[:4] == [b"p9", b"p5", b"p5", b"p1"]
    assert sorted(bodies[4:]) == [b"none", b"p0"]


def test_mandatory_unroutable_is_returned(conn, ch, uid):
    returned = []
    ch.add_on_return_callback(lambda c, method, props, body: returned.append((method, body)))
    ch.basic_publish("amq.direct", f"nobody-{uid}", b"lost?", mandatory=True)
    deadline = time.monotonic() + 5
    while not returned and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert len(returned) == 1
    method, body = returned[0]
    assert body == b"lost?"
    assert method.reply_code == 312 and method.reply_text == "NO_ROUTE"
    assert method.exchange == "amq.direct" and method.routing_key == f"nobody-{uid}"


def test_mandatory_unroutable_under_confirms_raises(conn, ch, uid):
    ch.confirm_delivery()
    with pytest.raises(pex.UnroutableError) as e:
        ch.basic_publish("amq.direct", f"nobody-{uid}", b"lost?", mandatory=True)
    assert e.value.messages[0].body == b"lost?"
    # a non-mandatory unroutable publish is simply confirmed
    ch.basic_publish("amq.direct", f"nobody-{uid}", b"dropped")


def test_basic_get_and_get_empty(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    assert ch.basic_get(q) == (None, None, None)
    ch.basic_publish("", q, b"a")
    ch.basic_publish("", q, b"b")
    m, _, body = ch.basic_get(q)
    assert body == b"a" and m.message_count == 1 and m.redelivered is False
    ch.basic_ack(m.delivery_tag)
    m, _, body = ch.basic_get(q, auto_ack=True)
    assert body == b"b" and m.message_count == 0
    assert ch.basic_get(q) == (None, None, None)


def test_tx_commit_and_rollback(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    ch.tx_select()
    ch.basic_publish("", q, b"rolled back")
    assert count(conn, q) == 0, "uncommitted publish must not be visible"
    ch.tx_rollback()
    assert count(conn, q) == 0
    ch.basic_publish("", q, b"committed")
    ch.tx_commit()
    assert count(conn, q) == 1
    m, _, body = ch.basic_get(q)
    assert body == b"committed"
    # acks are transactional too
    ch.basic_ack(m.delivery_tag)
    ch.tx_rollback()
    ch.close()
    ch2 = conn.channel()
    m, _, body = ch2.basic_get(q)
    assert body == b"committed" and m.redelivered is True
    ch2.tx_select()
    ch2.basic_ack(m.delivery_tag)
    ch2.tx_commit()
    assert count(conn, q) == 0


def test_large_body_spans_many_frames(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    body = bytes(range(256)) * (5 * 1024 * 1024 // 256)  # 5 MiB
    ch.confirm_delivery()
    ch.basic_publish("", q, body)
    got = consume(conn, ch, q, 1, timeout=20)
    assert len(got) == 1 and len(got[0][2]) == len(body) and got[0][2] == body


def test_exclusive_queue_locked_from_other_connection(broker, conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q, exclusive=True)
    other = pika_connect(broker)
    try:
        och = other.channel()
        with pytest.raises(pex.ChannelClosedByBroker) as e:
            och.basic_consume(q, lambda *a: None)
        assert e.value.reply_code == 405
        assert "RESOURCE_LOCKED" in e.value.reply_text
        och = other.channel()
        with pytest.raises(pex.ChannelClosedByBroker) as e:
            och.queue_declare(q, exclusive=True)
        assert e.value.reply_code == 405
    finally:
        other.close()


def test_exclusive_queue_deleted_when_owner_closes(broker, uid):
    q = f"q-{uid}"
    owner = pika_connect(broker)
    owner.channel().queue_declare(q, exclusive=True)
    owner.close()
    c = pika_connect(broker)
    try:
        with pytest.raises(pex.ChannelClosedByBroker) as e:
            c.channel().queue_declare(q, passive=True)
        assert e.value.reply_code == 404
    finally:
        c.close()


def test_passive_declare_missing_queue_404_connection_survives(conn, uid):
    c = conn.channel()
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        c.queue_declare(f"missing-{uid}", passive=True)
    assert e.value.reply_code == 404 and "NOT_FOUND" in e.value.reply_text
    assert not c.is_open and conn.is_open
    c2 = conn.channel()
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        c2.exchange_declare(f"missing-{uid}", passive=True)
    assert e.value.reply_code == 404
    c3 = conn.channel()
    q = f"q-{uid}"
    c3.queue_declare(q)
    c3.basic_publish("", q, b"still fine")
    assert c3.basic_get(q, auto_ack=True)[2] == b"still fine"


def test_redeclare_with_different_arguments_is_precondition_failed(conn, uid):
    q = f"q-{uid}"
    c = conn.channel()
    c.queue_declare(q, arguments={"x-max-length": 10})
    c.queue_declare(q, arguments={"x-max-length": 10})  # equivalent: fine
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        c.queue_declare(q, durable=True, arguments={"x-max-length": 10})
    assert e.value.reply_code == 406
    c = conn.channel()
    c.exchange_declare(f"ex-{uid}", "direct")
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        c.exchange_declare(f"ex-{uid}", "fanout")
    assert e.value.reply_code == 406


def test_ack_unknown_delivery_tag_closes_channel_406(conn, uid):
    c = conn.channel()
    c.basic_ack(999)
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        # the next synchronous call observes the channel close
        c.queue_declare(f"q-{uid}")
    assert e.value.reply_code == 406
    assert conn.is_open


def test_exchange_to_exchange_binding(conn, ch, uid):
    src, dst, q = f"src-{uid}", f"dst-{uid}", f"q-{uid}"
    ch.exchange_declare(src, "topic")
    ch.exchange_declare(dst, "direct")
    ch.exchange_bind(destination=dst, source=src, routing_key="orders.*")
    declare(ch, q)
    ch.queue_bind(q, dst, routing_key="orders.eu")
    ch.basic_publish(src, "orders.eu", b"eu")
    ch.basic_publish(src, "orders.us", b"us")  # reaches dst, but no queue bound for it
    ch.basic_publish(src, "invoices.eu", b"nope")
    got = consume(conn, ch, q, 2, timeout=1.5)
    assert [b for _, _, b in got] == [b"eu"]
    ch.exchange_unbind(destination=dst, source=src, routing_key="orders.*")
    ch.basic_publish(src, "orders.eu", b"after unbind")
    assert consume(conn, ch, q, 1, timeout=0.5) == []


def test_headers_exchange_all_and_any(conn, ch, uid):
    ex, qall, qany = f"hx-{uid}", f"all-{uid}", f"any-{uid}"
    ch.exchange_declare(ex, "headers")
    declare(ch, qall)
    declare(ch, qany)
    ch.queue_bind(qall, ex, arguments={"x-match": "all", "format": "pdf", "type": "report"})
    ch.queue_bind(qany, ex, arguments={"x-match": "any", "format": "pdf", "type": "report"})

    def pub(body, headers):
        ch.basic_publish(ex, "ignored", body, pika.BasicProperties(headers=headers))

    pub(b"both", {"format": "pdf", "type": "report", "extra": 1})
    pub(b"format-only", {"format": "pdf"})
    pub(b"wrong-value", {"format": "zip", "type": "log"})
    pub(b"no-headers", None)
    got_all = consume(conn, ch, qall, 2, timeout=1)
    got_any = consume(conn, ch, qany, 3, timeout=1)
    assert [b for _, _, b in got_all] == [b"both"]
    assert [b for _, _, b in got_any] == [b"both", b"format-only"]


def test_amq_match_and_amq_headers_predeclared(ch):
    for name in ("amq.direct", "amq.fanout", "amq.topic", "amq.headers", "amq.match"):
        ch.exchange_declare(name, passive=True)


def test_topic_wildcards(conn, ch, uid):
    ex = f"tx-{uid}"
    ch.exchange_declare(ex, "topic")
    patterns = {
        "star": "a.*.c",
        "hash": "a.#",
        "mid": "a.#.c",
        "all": "#",
        "exact": "a.b.c",
    }
    for tag, pat in patterns.items():
        declare(ch, f"{tag}-{uid}")
        ch.queue_bind(f"{tag}-{uid}", ex, routing_key=pat)
    keys = ["a.b.c", "a.c", "a", "a.b.b.c", "x.b.c", "a.b", ""]
    for k in keys:
        ch.basic_publish(ex, k, k.encode())

    def received(tag):
        return [b.decode() for _, _, b in consume(conn, ch, f"{tag}-{uid}", len(keys), timeout=1)]

    assert received("star") == ["a.b.c"]
    assert received("hash") == ["a.b.c", "a.c", "a", "a.b.b.c", "a.b"]
    assert received("mid") == ["a.b.c", "a.c", "a.b.b.c"]
    assert received("all") == keys
    assert received("exact") == ["a.b.c"]


def test_fanout_reaches_every_bound_queue(conn, ch, uid):
    ex = f"fx-{uid}"
    ch.exchange_declare(ex, "fanout")
    for i in range(3):
        declare(ch, f"q{i}-{uid}")
        ch.queue_bind(f"q{i}-{uid}", ex)
    ch.basic_publish(ex, "whatever", b"all")
    for i in range(3):
        assert [b for _, _, b in consume(conn, ch, f"q{i}-{uid}", 1)] == [b"all"]


def test_queue_purge_returns_count(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    for i in range(4):
        ch.basic_publish("", q, b"x")
    assert count(conn, q) == 4
    assert ch.queue_purge(q).method.message_count == 4
    assert count(conn, q) == 0
    assert ch.queue_purge(q).method.message_count == 0


def test_queue_delete_returns_count_and_if_empty(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    ch.basic_publish("", q, b"x")
    ch.basic_publish("", q, b"y")
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        ch.queue_delete(q, if_empty=True)
    assert e.value.reply_code == 406
    ch = conn.channel()
    assert ch.queue_delete(q).method.message_count == 2
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        ch.queue_declare(q, passive=True)
    assert e.value.reply_code == 404


def test_consumer_cancel_stops_deliveries(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    got = []
    tag = ch.basic_consume(q, lambda c, m, p, b: (got.append(b), c.basic_ack(m.delivery_tag)))
    assert ch.queue_declare(q, passive=True).method.consumer_count == 1
    ch.basic_publish("", q, b"before")
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert got == [b"before"]
    ch.basic_cancel(tag)
    assert ch.queue_declare(q, passive=True).method.consumer_count == 0
    ch.basic_publish("", q, b"after")
    conn.process_data_events(time_limit=0.5)
    assert got == [b"before"]
    assert count(conn, q) == 1


def test_server_cancels_consumer_when_queue_deleted(conn, ch, broker, uid):
    q = f"q-{uid}"
    declare(ch, q)
    cancelled = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame))
    ch.basic_consume(q, lambda *a: None, consumer_tag=f"ctag-{uid}")
    other = pika_connect(broker)
    try:
        other.channel().queue_delete(q)
    finally:
        other.close()
    deadline = time.monotonic() + 5
    while not cancelled and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert len(cancelled) == 1
    assert cancelled[0].method.consumer_tag == f"ctag-{uid}"
    assert ch.is_open


def test_round_robin_between_consumers(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    a, b = [], []
    ch.basic_consume(q, lambda c, m, p, body: a.append(body), auto_ack=True)
    ch.basic_consume(q, lambda c, m, p, body: b.append(body), auto_ack=True)
    for i in range(10):
        ch.basic_publish("", q, f"m{i}".encode())
    deadline = time.monotonic() + 5
    while len(a) + len(b) < 10 and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert len(a) == 5 and len(b) == 5


def test_auto_delete_queue_goes_with_last_consumer(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q, auto_delete=True)
    tag = ch.basic_consume(q, lambda *a: None)
    ch.basic_cancel(tag)
    c = conn.channel()
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        c.queue_declare(q, passive=True)
    assert e.value.reply_code == 404


def test_queue_expires_when_unused(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q, arguments={"x-expires": 300})
    time.sleep(1.0)
    c = conn.channel()
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        c.queue_declare(q, passive=True)
    assert e.value.reply_code == 404


def test_alternate_exchange_catches_unroutable(conn, ch, uid):
    ex, ae, q = f"ex-{uid}", f"ae-{uid}", f"q-{uid}"
    ch.exchange_declare(ae, "fanout")
    declare(ch, q)
    ch.queue_bind(q, ae)
    ch.exchange_declare(ex, "direct", arguments={"alternate-exchange": ae})
    ch.basic_publish(ex, "nowhere", b"caught")
    got = consume(conn, ch, q, 1)
    assert [b for _, _, b in got] == [b"caught"]


def test_many_channels_on_one_connection(conn, uid):
    chans = [conn.channel() for _ in range(20)]
    q = f"q-{uid}"
    chans[0].queue_declare(q)
    for i, c in enumerate(chans):
        c.basic_publish("", q, f"c{i}".encode())
    assert count(conn, q) == 20
    for c in chans:
        c.close()


# --- durability across a restart ------------------------------------------------------


def test_persistent_messages_survive_restart(own_broker, uid):
    q, tq, ex = f"q-{uid}", f"tq-{uid}", f"ex-{uid}"
    c = pika_connect(own_broker)
    ch = c.channel()
    ch.exchange_declare(ex, "direct", durable=True)
    ch.queue_declare(q, durable=True)
    ch.queue_bind(q, ex, routing_key="k")
    ch.queue_declare(tq, durable=False)
    ch.confirm_delivery()
    for i in range(20):
        ch.basic_publish(ex, "k", f"p{i}".encode(), pika.BasicProperties(delivery_mode=2, message_id=f"id{i}"))
    # consume and ack the first five before the restart: they must not come back
    for _ in range(5):
        m, _, _ = ch.basic_get(q)
        ch.basic_ack(m.delivery_tag)
    # take the sixth without acking: it must come back redelivered
    m6, _, b6 = ch.basic_get(q)
    assert b6 == b"p5"
    ch.queue_declare(q, passive=True)  # round trip so the acks are processed
    c.close()

    assert own_broker.restart() == 0

    c = pika_connect(own_broker)
    ch = c.channel()
    assert ch.queue_declare(q, passive=True).method.message_count == 15
    got = consume(c, ch, q, 15, timeout=10)
    assert [b for _, _, b in got] == [f"p{i}".encode() for i in range(5, 20)]
    assert got[0][0].redelivered is True
    assert got[0][1].message_id == "id5" and got[0][1].delivery_mode == 2
    # durable exchange and binding survived too
    ch.basic_publish(ex, "k", b"after restart")
    assert [b for _, _, b in consume(c, ch, q, 1)] == [b"after restart"]
    # the non-durable queue did not
    c2 = c.channel()
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        c2.queue_declare(tq, passive=True)
    assert e.value.reply_code == 404
    c.close()


def test_transient_messages_do_not_survive_restart(own_broker, uid):
    q = f"q-{uid}"
    c = pika_connect(own_broker)
    ch = c.channel()
    ch.queue_declare(q, durable=True)
    ch.confirm_delivery()
    ch.basic_publish("", q, b"transient", pika.BasicProperties(delivery_mode=1))
    ch.basic_publish("", q, b"persistent", pika.BasicProperties(delivery_mode=2))
    c.close()
    own_broker.restart()
    c = pika_connect(own_broker)
    ch = c.channel()
    got = consume(c, ch, q, 2, timeout=2)
    assert [b for _, _, b in got] == [b"persistent"]
    c.close()


# --- more of what applications lean on ----------------------------------------------------


def test_direct_reply_to_rpc(broker, conn, ch, uid):
    """RPC over RabbitMQ's pseudo-queue amq.rabbitmq.reply-to (pika's RPC tutorial)."""
    service = f"rpc-{uid}"
    server = pika_connect(broker)
    try:
        sch = server.channel()
        sch.queue_declare(service)
        replies = []
        ch.basic_consume("amq.rabbitmq.reply-to", lambda c, m, p, b: replies.append((p, b)),
                         auto_ack=True)
        ch.basic_publish("", service, b"21", pika.BasicProperties(
            reply_to="amq.rabbitmq.reply-to", correlation_id="rpc-1"))
        m, props, body = None, None, None
        deadline = time.monotonic() + 5
        while m is None and time.monotonic() < deadline:
            m, props, body = sch.basic_get(service, auto_ack=True)
        assert body == b"21"
        assert props.reply_to.startswith("amq.rabbitmq.reply-to."), props.reply_to
        sch.basic_publish("", props.reply_to, b"42",
                          pika.BasicProperties(correlation_id=props.correlation_id))
        deadline = time.monotonic() + 5
        while not replies and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.05)
        assert [(p.correlation_id, b) for p, b in replies] == [("rpc-1", b"42")]
    finally:
        server.close()


def test_direct_reply_to_refusals_as_rabbitmq(conn, uid):
    """RabbitMQ's 406s: an acking reply consumer, a second one on a channel, and a
    publish with reply_to=amq.rabbitmq.reply-to on a channel that does not consume
    replies."""
    ch = conn.channel()
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        ch.basic_consume("amq.rabbitmq.reply-to", lambda *a: None, auto_ack=False)
    assert (e.value.reply_code, e.value.reply_text) == (
        406, "PRECONDITION_FAILED - reply consumer cannot acknowledge")
    ch = conn.channel()
    ch.basic_consume("amq.rabbitmq.reply-to", lambda *a: None, auto_ack=True)
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        ch.basic_consume("amq.rabbitmq.reply-to", lambda *a: None, auto_ack=True)
    assert (e.value.reply_code, e.value.reply_text) == (
        406, "PRECONDITION_FAILED - reply consumer already set")
    ch = conn.channel()
    ch.queue_declare(f"q-{uid}", exclusive=True)
    ch.basic_publish("", f"q-{uid}", b"x", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to"))
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        ch.queue_declare(f"q-{uid}", passive=True)
    assert (e.value.reply_code, e.value.reply_text) == (
        406, "PRECONDITION_FAILED - fast reply consumer does not exist")
    # nothing of the refused publish reached the queue
    assert count(conn, f"q-{uid}") == 0


def test_direct_reply_to_names_die_with_their_consumer(broker, conn, uid):
    """The pseudo-queue declares ok with one consumer; replies arrive with the reply name as
    routing key; after basic.cancel, replies to that name are unroutable (returned when
    mandatory), as are replies to a made-up name."""
    ch = conn.channel()
    got = []
    tag = ch.basic_consume("amq.rabbitmq.reply-to", lambda c, m, p, b: got.append((m, b)),
                           auto_ack=True)
    ok = ch.queue_declare("amq.rabbitmq.reply-to", passive=True).method
    assert (ok.queue, ok.message_count, ok.consumer_count) == ("amq.rabbitmq.reply-to", 0, 1)
    q = f"svc-{uid}"
    ch.queue_declare(q, exclusive=True)
    ch.basic_publish("", q, b"req", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to"))
    m, props, _ = None, None, None
    deadline = time.monotonic() + 5
    while m is None and time.monotonic() < deadline:
        m, props, _ = ch.basic_get(q, auto_ack=True)
    name = props.reply_to
    assert name.startswith("amq.rabbitmq.reply-to.") and len(name) > 40, name
    server = pika_connect(broker)
    try:
        sch = server.channel()
        sch.basic_publish("", name, b"one")
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.05)
        assert [(m.exchange, m.routing_key, m.redelivered, b) for m, b in got] == [
            ("", name, False, b"one")]
        ch.basic_cancel(tag)
        with pytest.raises(pex.UnroutableError):
            sch.confirm_delivery()
            sch.basic_publish("", name, b"two", mandatory=True)
        with pytest.raises(pex.UnroutableError):
            # the same connection part, another key
            head, key = name.rsplit(".", 1)
            sch.basic_publish("", f"{head}.{'A' * len(key)}", b"x", mandatory=True)
        conn.process_data_events(time_limit=0.2)
        assert len(got) == 1
    finally:
        server.close()


def test_publish_immediate_is_540_not_implemented(conn, ch, uid):
    """RabbitMQ refuses immediate=true with connection.close 540 and this exact text.
    pika's basic_publish has no `immediate`, so the frames go out through its channel."""
    import pika.spec as spec

    ch._impl.connection._send_message(  # pylint: disable=protected-access
        ch.channel_number,
        spec.Basic.Publish(exchange="", routing_key=f"q-{uid}", immediate=True),
        (spec.BasicProperties(), b"x"),
    )
    with pytest.raises(pex.ConnectionClosedByBroker) as e:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.1)
    assert (e.value.reply_code, e.value.reply_text) == (540, "NOT_IMPLEMENTED - immediate=true")


def test_requeued_message_keeps_its_position(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    for i in range(3):
        ch.basic_publish("", q, f"m{i}".encode())
    m0, _, _ = ch.basic_get(q)
    ch.basic_nack(m0.delivery_tag, requeue=True)
    got = consume(conn, ch, q, 3)
    assert [b for _, _, b in got] == [b"m0", b"m1", b"m2"]
    assert [m.redelivered for m, _, _ in got] == [True, False, False]


def test_retry_loop_via_ttl_queue_counts_x_death(conn, ch, uid):
    """The common delayed-retry pattern: work queue dead-letters to a wait queue whose TTL
    dead-letters back to the work queue; x-death counts the rounds."""
    work, wait = f"work-{uid}", f"wait-{uid}"
    declare(ch, work, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": wait})
    declare(ch, wait, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": work,
                                 "x-message-ttl": 50})
    ch.basic_publish("", work, b"job")
    for round_ in range(1, 3):
        m = None
        deadline = time.monotonic() + 5
        while m is None and time.monotonic() < deadline:
            m, props, body = ch.basic_get(work)
            if m is None:
                time.sleep(0.02)
        assert body == b"job"
        ch.basic_reject(m.delivery_tag, requeue=False)
    m = None
    deadline = time.monotonic() + 5
    while m is None and time.monotonic() < deadline:
        m, props, body = ch.basic_get(work, auto_ack=True)
        if m is None:
            time.sleep(0.02)
    deaths = {(d["queue"], d["reason"]): d["count"] for d in props.headers["x-death"]}
    assert deaths == {(work, "rejected"): 2, (wait, "expired"): 2}
    # the most recent death comes first
    assert props.headers["x-death"][0]["queue"] == wait


def test_publish_to_missing_exchange_closes_channel_404(conn, uid):
    c = conn.channel()
    c.basic_publish(f"missing-{uid}", "k", b"x")
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        c.queue_declare(f"q-{uid}")
    assert e.value.reply_code == 404
    assert conn.is_open


def test_amq_prefixed_names_are_reserved(conn, uid):
    c = conn.channel()
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        c.queue_declare(f"amq.q-{uid}")
    assert e.value.reply_code == 403
    c = conn.channel()
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        c.exchange_declare(f"amq.x-{uid}", "direct")
    assert e.value.reply_code == 403


def test_exclusive_consumer_refuses_second(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    ch.basic_consume(q, lambda *a: None, exclusive=True)
    c2 = conn.channel()
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        c2.basic_consume(q, lambda *a: None)
    assert e.value.reply_code == 403


def test_consumer_priority(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    low, high = [], []
    ch.basic_consume(q, lambda c, m, p, b: low.append(b), auto_ack=True, arguments={"x-priority": 1})
    ch.basic_consume(q, lambda c, m, p, b: high.append(b), auto_ack=True, arguments={"x-priority": 10})
    for i in range(5):
        ch.basic_publish("", q, b"x")
    deadline = time.monotonic() + 5
    while len(low) + len(high) < 5 and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert len(high) == 5 and low == []


def test_max_length_bytes(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q, arguments={"x-max-length-bytes": 10})
    ch.confirm_delivery()
    for i in range(4):
        ch.basic_publish("", q, f"msg{i}".encode())  # 4 bytes each
    ok = ch.queue_declare(q, passive=True).method
    assert ok.message_count == 2
    got = consume(conn, ch, q, 2)
    assert [b for _, _, b in got] == [b"msg2", b"msg3"]


def test_basic_recover_requeues_unacked(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    ch.basic_publish("", q, b"r")
    got = consume(conn, ch, q, 1, ack=False)
    assert len(got) == 1
    ch.basic_recover(requeue=True)
    again = consume(conn, ch, q, 1)
    assert [b for _, _, b in again] == [b"r"] and again[0][0].redelivered is True


def test_exchange_delete_if_unused(conn, ch, uid):
    ex, q = f"ex-{uid}", f"q-{uid}"
    ch.exchange_declare(ex, "fanout")
    declare(ch, q)
    ch.queue_bind(q, ex)
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        ch.exchange_delete(ex, if_unused=True)
    assert e.value.reply_code == 406
    c = conn.channel()
    c.queue_unbind(q, ex)
    c.exchange_delete(ex, if_unused=True)
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        c.exchange_declare(ex, passive=True)
    assert e.value.reply_code == 404


def test_heartbeats_keep_idle_connection_alive(broker, uid):
    c = pika_connect(broker, heartbeat=1)
    try:
        ch = c.channel()
        q = f"q-{uid}"
        ch.queue_declare(q)
        c.sleep(4.0)  # services heartbeats only; idle on the application side
        assert c.is_open
        ch.basic_publish("", q, b"alive")
        assert ch.basic_get(q, auto_ack=True)[2] == b"alive"
    finally:
        if c.is_open:
            c.close()


def test_expired_messages_leave_the_message_count_on_time(conn, ch, uid):
    q0, q50 = f"q0-{uid}", f"q50-{uid}"
    declare(ch, q0, arguments={"x-message-ttl": 0})
    declare(ch, q50, arguments={"x-message-ttl": 50})
    ch.confirm_delivery()
    ch.basic_publish("", q0, b"nobody listening")
    ch.basic_publish("", q50, b"short")
    time.sleep(0.15)
    assert count(conn, q0) == 0, "x-message-ttl 0 without a waiting consumer drops at once"
    assert count(conn, q50) == 0, "a message 100 ms past its TTL must not be counted"


def test_stream_queue_replays_from_first(conn, ch, uid):
    q = f"s-{uid}"
    declare(ch, q, durable=True, arguments={"x-queue-type": "stream"})
    for i in range(5):
        ch.basic_publish("", q, f"e{i}".encode())
    for _ in range(2):  # two independent readers see the whole stream
        c = conn.channel()
        c.basic_qos(prefetch_count=10)
        got = consume(conn, c, q, 5, arguments={"x-stream-offset": "first"})
        assert [b for _, _, b in got] == [f"e{i}".encode() for i in range(5)]
        c.close()
    c = conn.channel()
    c.basic_qos(prefetch_count=10)
    got = consume(conn, c, q, 5, timeout=1, arguments={"x-stream-offset": 3})
    assert [b for _, _, b in got] == [b"e3", b"e4"]


def test_confirmed_messages_survive_kill_9(own_broker, uid):
    import signal as _signal

    q = f"q-{uid}"
    c = pika_connect(own_broker)
    ch = c.channel()
    ch.queue_declare(q, durable=True)
    ch.confirm_delivery()
    for i in range(200):
        ch.basic_publish("", q, f"c{i}".encode(), pika.BasicProperties(delivery_mode=2))
    own_broker.restart(sig=_signal.SIGKILL)
    c = pika_connect(own_broker)
    ch = c.channel()
    assert ch.queue_declare(q, passive=True).method.message_count == 200
    got = consume(c, ch, q, 200, timeout=10)
    assert [b for _, _, b in got] == [f"c{i}".encode() for i in range(200)]
    c.close()


def test_empty_body(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    ch.basic_publish("", q, b"", pika.BasicProperties(content_type="text/plain"))
    got = consume(conn, ch, q, 1)
    assert [b for _, _, b in got] == [b""]
    assert got[0][1].content_type == "text/plain"


def test_thousands_of_messages_none_lost(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q)
    n = 5000
    for i in range(n):
        ch.basic_publish("", q, str(i).encode())
    ch.basic_qos(prefetch_count=500)
    got = consume(conn, ch, q, n, timeout=30)
    assert [int(b) for _, _, b in got] == list(range(n))


def test_single_active_consumer(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q, arguments={"x-single-active-consumer": True})
    a, b = [], []
    tag_a = ch.basic_consume(q, lambda c, m, p, body: a.append(body), auto_ack=True)
    ch.basic_consume(q, lambda c, m, p, body: b.append(body), auto_ack=True)
    for i in range(4):
        ch.basic_publish("", q, f"m{i}".encode())
    deadline = time.monotonic() + 3
    while len(a) + len(b) < 4 and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert len(a) == 4 and b == []
    ch.basic_cancel(tag_a)
    ch.basic_publish("", q, b"after failover")
    deadline = time.monotonic() + 3
    while not b and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert b == [b"after failover"]


def test_single_active_consumer_channel_close_requeues_unacked_to_the_next(broker, conn, uid):
    """The active consumer's channel closes with two messages unacked: the next consumer
    in registration order gets them first (redelivered), then the rest, and a consumer
    registered later gets nothing."""
    q = f"q-{uid}"
    ch = conn.channel()
    declare(ch, q, durable=True, arguments={"x-single-active-consumer": True})
    first = conn.channel()
    first.basic_qos(prefetch_count=2)
    held = []
    first.basic_consume(q, lambda c, m, p, body: held.append(body))
    other = pika_connect(broker)
    try:
        b, c = [], []
        och = other.channel()
        och.basic_consume(q, lambda ch_, m, p, body: b.append((m.redelivered, body)),
                          auto_ack=True)
        och.basic_consume(q, lambda ch_, m, p, body: c.append(body), auto_ack=True)
        for i in range(4):
            ch.basic_publish("", q, f"m{i}".encode())
        deadline = time.monotonic() + 3
        while len(held) < 2 and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.05)
        other.process_data_events(time_limit=0.3)
        assert held == [b"m0", b"m1"] and b == [] and c == []
        first.close()
        deadline = time.monotonic() + 5
        while len(b) < 4 and time.monotonic() < deadline:
            other.process_data_events(time_limit=0.05)
        assert b == [(True, b"m0"), (True, b"m1"), (False, b"m2"), (False, b"m3")]
        assert c == []
        with pytest.raises(pex.ChannelClosedByBroker) as e:
            conn.channel().queue_declare(q, durable=True)
        assert e.value.reply_code == 406 and "x-single-active-consumer" in e.value.reply_text
    finally:
        other.close()
        conn.channel().queue_delete(q)


def test_global_qos_is_shared_by_the_channels_consumers(conn, ch, uid):
    q1, q2 = f"q1-{uid}", f"q2-{uid}"
    declare(ch, q1)
    declare(ch, q2)
    for i in range(3):
        ch.basic_publish("", q1, b"x")
        ch.basic_publish("", q2, b"y")
    ch.basic_qos(prefetch_count=2, global_qos=True)
    got = []
    ch.basic_consume(q1, lambda c, m, p, body: got.append(body))
    ch.basic_consume(q2, lambda c, m, p, body: got.append(body))
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert len(got) == 2, "global prefetch 2 caps the whole channel at 2 unacked"


def test_topic_binding_with_empty_words(conn, ch, uid):
    ex = f"tx-{uid}"
    ch.exchange_declare(ex, "topic")
    q = f"q-{uid}"
    declare(ch, q)
    ch.queue_bind(q, ex, routing_key="a..b")
    ch.basic_publish(ex, "a..b", b"empty middle word")
    ch.basic_publish(ex, "a.x.b", b"not this")
    got = consume(conn, ch, q, 2, timeout=1)
    assert [b for _, _, b in got] == [b"empty middle word"]


def test_dead_letter_to_missing_exchange_drops(conn, ch, uid):
    q = f"q-{uid}"
    declare(ch, q, arguments={"x-dead-letter-exchange": f"missing-{uid}"})
    ch.basic_publish("", q, b"x")
    m, _, _ = ch.basic_get(q)
    ch.basic_reject(m.delivery_tag, requeue=False)
    assert count(conn, q) == 0
    assert ch.is_open


def test_acks_survive_kill_9(own_broker, uid):
    import signal as _signal

    q = f"q-{uid}"
    c = pika_connect(own_broker)
    ch = c.channel()
    ch.queue_declare(q, durable=True)
    ch.confirm_delivery()
    for i in range(10):
        ch.basic_publish("", q, f"k{i}".encode(), pika.BasicProperties(delivery_mode=2))
    ch.basic_qos(prefetch_count=5)
    got = consume(c, ch, q, 5, ack=False)
    assert len(got) == 5
    ch.basic_ack(got[-1][0].delivery_tag, multiple=True)
    ch.queue_declare(q, passive=True)  # a round trip after the ack
    time.sleep(1.5)  # past the 1 s checkpoint interval
    own_broker.restart(sig=_signal.SIGKILL)
    c = pika_connect(own_broker)
    ch = c.channel()
    got = consume(c, ch, q, 5, timeout=5)  # waits a little past the 5th for any surplus
    assert [b for _, _, b in got][:1] != [b"k0"], "acked messages came back after a crash"
    assert [b for _, _, b in got] == [f"k{i}".encode() for i in range(5, 10)]
    c.close()


def test_user_limits_max_channels_and_max_connections(configured_broker):
    """RabbitMQ's user limits (`rabbitmqctl set_user_limits`), here under [[users]]:
    the same 530 and texts as RabbitMQ 3.10 gives pika."""
    import base64
    import hashlib
    salt = b"\x01\x02\x03\x04"
    pw = base64.b64encode(salt + hashlib.sha256(salt + b"lim-pw").digest()).decode()
    b = configured_broker(
        f'[[users]]\nname = "lim"\npassword_hash = "{pw}"\nmax_connections = 2\nmax_channels = 2\n\n'
        '[[permissions]]\nuser = "lim"\nvhost = "/"\nconfigure = ".*"\nwrite = ".*"\nread = ".*"\n')
    creds = pika.PlainCredentials("lim", "lim-pw")
    c = pika.BlockingConnection(pika_params(b, credentials=creds))
    c.channel()
    c.channel()
    with pytest.raises(pex.ConnectionClosedByBroker) as e:
        c.channel()
    assert e.value.reply_code == 530
    assert e.value.reply_text == ("NOT_ALLOWED - number of channels opened for user 'lim' "
                                  "has reached the maximum allowed user limit of (2)")
    c1 = pika.BlockingConnection(pika_params(b, credentials=creds))
    c2 = pika.BlockingConnection(pika_params(b, credentials=creds))
    with pytest.raises(pex.AMQPConnectionError) as e:
        pika.BlockingConnection(pika_params(b, credentials=creds))
    assert "user connection limit (2) is reached" in str(e.value)
    c1.close()
    c2.close()

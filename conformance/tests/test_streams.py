"""Stream queues (x-queue-type=stream) through pika, stomp.py and paho-mqtt: start
positions (first / last / next / offset / time), acks that remove nothing, RabbitMQ's
refusals, stored consumer offsets, and MQTT's $stream/<start>/<filter> replay.

Against RabbitMQ 3.10 (CONFORMANCE_EXTERNAL), the start-position, timestamp and refusal
tests pass too; the two in which pika nacks the deliveries it still buffers when it
cancels fail there, as RabbitMQ closes the connection (540) on a basic.nack or
basic.reject of a stream delivery, where Triad takes one as credit returned."""

import datetime
import time

import pika
import pika.exceptions as pex
import pytest

from helpers import Mqtt, Stomp, pika_connect

STREAM = {"x-queue-type": "stream"}


@pytest.fixture
def conn(broker):
    c = pika_connect(broker)
    yield c
    if c.is_open:
        try:
            c.close()
        except Exception:
            pass


def fill(conn, q, n, prefix="m", args=None):
    ch = conn.channel()
    ch.queue_declare(q, durable=True, arguments=dict(STREAM, **(args or {})))
    ch.confirm_delivery()
    for i in range(n):
        ch.basic_publish("", q, f"{prefix}{i}".encode(), pika.BasicProperties(delivery_mode=2))
    ch.close()


def read(conn, q, n, offset=None, name=None, prefetch=100, timeout=5.0, ack=True):
    """Consumes up to `n` deliveries (waiting at most `timeout`), acks exactly those when
    `ack` (a surplus delivery is left unacked), cancels; returns (offset, body) pairs."""
    ch = conn.channel()
    ch.basic_qos(prefetch_count=prefetch)
    args = {}
    if offset is not None:
        args["x-stream-offset"] = offset
    if name is not None:
        args["x-stream-consumer-name"] = name
    got = []

    def on_message(channel, method, props, body):
        if len(got) < n:
            got.append((props.headers["x-stream-offset"], body.decode()))
            if ack:
                channel.basic_ack(method.delivery_tag)

    tag = ch.basic_consume(q, on_message, arguments=args)
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    ch.basic_cancel(tag)
    ch.close()
    return got


def test_pika_start_positions_and_non_destructive_reads(conn, uid):
    q = f"st-{uid}"
    fill(conn, q, 5)
    first = read(conn, q, 10, "first")
    assert first == [(i, f"m{i}") for i in range(5)]
    # acks removed nothing: read again from the start
    assert read(conn, q, 10, "first") == first
    assert read(conn, q, 10, 3) == [(3, "m3"), (4, "m4")]
    assert read(conn, q, 10, -1) == first  # a negative offset is the start, as RabbitMQ
    assert read(conn, q, 10, "next", timeout=0.5) == []
    assert read(conn, q, 10, "1h") == first  # an interval: that long ago
    hour_ago = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=1)
    assert read(conn, q, 10, hour_ago.replace(tzinfo=None)) == first  # AMQP timestamp
    ok = conn.channel().queue_declare(q, passive=True).method
    assert ok.consumer_count == 0


def test_pika_timestamp_start_skips_older_messages(conn, uid):
    q = f"st-{uid}"
    fill(conn, q, 3, prefix="old")
    # AMQP timestamps have whole seconds: wait for the next second to begin
    t = int(time.time()) + 1
    while time.time() < t:
        time.sleep(0.02)
    fill(conn, q, 2, prefix="new")
    got = read(conn, q, 10, datetime.datetime.utcfromtimestamp(t))
    assert [b for _, b in got] == ["new0", "new1"]


def test_pika_refusals_match_rabbitmq(broker, uid):
    def closed_with(fn):
        c = pika_connect(broker)
        ch = c.channel()
        try:
            fn(ch)
            c.process_data_events(time_limit=0.5)
        except (pex.ChannelClosedByBroker, pex.ConnectionClosedByBroker) as e:
            return e.reply_code, e.reply_text
        finally:
            if c.is_open:
                c.close()
        return None

    q = f"st-{uid}"
    code, text = closed_with(lambda ch: ch.queue_declare(q, durable=False, arguments=STREAM))
    assert code == 406 and "non-durable" in text
    code, text = closed_with(lambda ch: ch.queue_declare(q, durable=True, exclusive=True, arguments=STREAM))
    assert code == 406 and "exclusive" in text
    code, text = closed_with(lambda ch: ch.queue_declare(q, durable=True, auto_delete=True, arguments=STREAM))
    assert code == 406 and "auto-delete" in text
    code, text = closed_with(lambda ch: ch.queue_declare(q, durable=True, arguments=dict(STREAM, **{"x-message-ttl": 5})))
    assert code == 406 and "x-message-ttl" in text
    code, text = closed_with(lambda ch: ch.queue_declare(q, durable=True, arguments=dict(STREAM, **{"x-max-age": "10x"})))
    assert code == 406 and "x-max-age" in text
    c = pika_connect(broker)
    fill(c, q, 1)
    c.close()
    code, text = closed_with(lambda ch: ch.basic_get(q))
    assert code == 540 and "basic.get" in text
    code, text = closed_with(lambda ch: ch.queue_purge(q))
    assert code == 540 and "queue.purge" in text
    code, text = closed_with(lambda ch: ch.basic_consume(q, lambda *a: None))
    assert code == 406 and "prefetch" in text
    code, text = closed_with(
        lambda ch: (ch.basic_qos(prefetch_count=10), ch.basic_consume(q, lambda *a: None, auto_ack=True))
    )
    assert code == 540 and "automatic acknowledgement" in text
    code, text = closed_with(
        lambda ch: (ch.basic_qos(prefetch_count=10),
                    ch.basic_consume(q, lambda *a: None, arguments={"x-stream-offset": "1x"}))
    )
    assert code == 406 and "x-stream-offset" in text


def test_pika_named_consumer_resumes_after_its_last_ack(conn, uid):
    q = f"st-{uid}"
    fill(conn, q, 10)
    got = read(conn, q, 4, "first", name="app", prefetch=4)
    assert [o for o, _ in got] == [0, 1, 2, 3]
    got = read(conn, q, 3, name="app")
    assert [o for o, _ in got] == [4, 5, 6]
    # unacked deliveries do not move the stored offset
    got = read(conn, q, 2, name="app", ack=False)
    assert [o for o, _ in got] == [7, 8]
    got = read(conn, q, 1, name="app")
    assert [o for o, _ in got] == [7]


def test_pika_retention_by_bytes_moves_the_first_offset(conn, uid):
    q = f"st-{uid}"
    fill(conn, q, 200, args={"x-max-length-bytes": 500})
    got = read(conn, q, 1, "first", prefetch=1)
    # bodies are 2-4 bytes: about 150 of them fit in 500 bytes
    assert got and got[0][0] > 0


def test_stomp_subscribe_with_stream_offset(broker, uid):
    q = f"st-{uid}"
    c = pika_connect(broker)
    fill(c, q, 5)
    c.close()
    s = Stomp(broker)
    try:
        s.subscribe(f"/amq/queue/{q}", "s1", ack="client-individual",
                    **{"prefetch-count": "10", "x-stream-offset": "2"})
        got = s.messages(3, timeout=5)
        assert [m.body for m in got] == ["m2", "m3", "m4"]
        assert [m.headers["x-stream-offset"] for m in got] == ["2", "3", "4"]
        for m in got:
            s.conn.ack(m.headers["ack"])
        # a /queue/ destination declares the stream itself (x-queue-type header)
        dest = f"/queue/st2-{uid}"
        s.subscribe(dest, "s2", ack="client", **{"prefetch-count": "5", "x-queue-type": "stream",
                                                  "x-stream-offset": "first"})
        s.send(dest, "hello")
        m = s.message()
        assert m is not None and m.body == "hello" and m.headers["x-stream-offset"] == "0"
    finally:
        s.close()


def test_stomp_auto_ack_on_a_stream_is_an_error(broker, uid):
    q = f"st-{uid}"
    c = pika_connect(broker)
    fill(c, q, 1)
    c.close()
    s = Stomp(broker)
    try:
        s.conn.subscribe(f"/amq/queue/{q}", "s1", ack="auto", headers={"x-stream-offset": "first"})
        err = s.error(5)
        assert err is not None and "automatic acknowledgement" in err.body
    finally:
        s.close()


def test_stomp_named_consumer_resumes(broker, uid):
    q = f"st-{uid}"
    c = pika_connect(broker)
    fill(c, q, 6)
    c.close()
    s = Stomp(broker)
    try:
        s.subscribe(f"/amq/queue/{q}", "a", ack="client-individual",
                    **{"prefetch-count": "3", "x-stream-offset": "first", "x-stream-consumer-name": "sx"})
        got = s.messages(3, timeout=5)
        assert [m.body for m in got] == ["m0", "m1", "m2"]
        for m in got:
            s.conn.ack(m.headers["ack"])
        s.conn.unsubscribe("a")
        s.subscribe(f"/amq/queue/{q}", "b", ack="client-individual",
                    **{"prefetch-count": "3", "x-stream-consumer-name": "sx"})
        # the credit of a's acks may have brought it m3 before it went: skip those
        got = [m for m in s.messages(6, timeout=2) if m.headers["subscription"] == "b"]
        assert [m.body for m in got] == ["m3", "m4", "m5"]
    finally:
        s.close()


def test_mqtt_stream_subscription_replays_from_first_and_follows(broker, uid):
    topic = f"replay/{uid}/temp"
    a = Mqtt(broker)
    pub = Mqtt(broker)
    try:
        # the first $stream subscription declares the filter's stream
        assert a.subscribe(f"$stream/next/replay/{uid}/+", qos=1) == [1]
        for i in range(3):
            pub.publish(topic, f"t{i}".encode(), qos=1)
        got = a.take(3, timeout=5)
        assert [m.payload for m in got] == [b"t0", b"t1", b"t2"]
        assert all(m.topic == topic for m in got)
        # a later client replays the history from the start, then follows
        b = Mqtt(broker)
        try:
            assert b.subscribe(f"$stream/first/replay/{uid}/+", qos=1) == [1]
            got = b.take(3, timeout=5)
            assert [m.payload for m in got] == [b"t0", b"t1", b"t2"]
            pub.publish(topic, b"t3", qos=1)
            m = b.message()
            assert m is not None and m.payload == b"t3"
            # from an offset, and by time
            c = Mqtt(broker)
            try:
                assert c.subscribe(f"$stream/2/replay/{uid}/+", qos=0) == [0]
                assert [m.payload for m in c.take(2, timeout=5)] == [b"t2", b"t3"]
                since = (datetime.datetime.now(datetime.timezone.utc)
                         - datetime.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
                assert c.subscribe(f"$stream/time:{since}/replay/{uid}/+", qos=1) == [1]
                assert len(c.take(4, timeout=5)) == 4
            finally:
                c.close()
        finally:
            b.close()
        # invalid starts are refused in the SUBACK
        assert a.subscribe(f"$stream/soon/replay/{uid}/+", qos=1) == [128]
    finally:
        a.close()
        pub.close()


def test_mqtt_stream_subscription_of_a_persistent_session_resumes_where_acked(own_broker, uid):
    """clean session 0: the $stream subscription is kept with the session and resumes
    after its last acknowledged message, after a reconnect and after a broker restart,
    not from the start it was made with; UNSUBSCRIBE forgets the position."""
    cid = f"ps-{uid}"
    flt = f"$stream/first/ps/{uid}/+"
    topic = f"ps/{uid}/x"

    def publish(*bodies):
        p = Mqtt(own_broker)
        try:
            for b in bodies:
                p.publish(topic, b.encode(), qos=1)
        finally:
            p.close()

    def acked(a, msgs):
        # paho acks a message after its callback returns, on its own thread: with
        # automatic acks a DISCONNECT from this thread could go out first. Acked here,
        # the PUBACKs are queued before the DISCONNECT that follows.
        for m in msgs:
            a.c.ack(m.mid, m.qos)
        return msgs

    a = Mqtt(own_broker, client_id=cid, clean_session=False, manual_ack=True)
    try:
        assert a.subscribe(flt, qos=1) == [1]
        publish("t0", "t1", "t2")
        got = acked(a, a.take(3, timeout=5))
        assert [m.payload for m in got] == [b"t0", b"t1", b"t2"]
    finally:
        a.close()
    publish("t3", "t4")
    # a reconnect without SUBSCRIBE: the session has the stream subscription, from t3
    a = Mqtt(own_broker, client_id=cid, clean_session=False, connect=False, manual_ack=True)
    try:
        flags, rc = a.connect()
        assert not rc.is_failure and flags.session_present
        got = acked(a, a.take(2, timeout=5))
        assert [m.payload for m in got] == [b"t3", b"t4"]
        assert all(m.topic == topic for m in got)
        assert a.message(timeout=0.5) is None, "t0-t2 were acknowledged: not sent again"
    finally:
        a.close()
    publish("t5")
    own_broker.restart()
    a = Mqtt(own_broker, client_id=cid, clean_session=False, connect=False, manual_ack=True)
    try:
        flags, rc = a.connect()
        assert not rc.is_failure and flags.session_present
        assert [m.payload for m in acked(a, a.take(1, timeout=5))] == [b"t5"]
        assert a.message(timeout=0.5) is None, "resumed after the restart, not from first"
        # still a subscription: new messages follow
        publish("t6")
        m = a.message()
        assert m is not None and m.payload == b"t6"
        acked(a, [m])
        # UNSUBSCRIBE ends it and forgets the position: subscribing again starts over
        a.unsubscribe(flt)
        assert a.subscribe(flt, qos=1) == [1]
        got = acked(a, a.take(7, timeout=5))
        assert [m.payload for m in got] == [f"t{i}".encode() for i in range(7)]
    finally:
        a.close()
    # a clean session over it discards it, and its stream subscription with it
    c = Mqtt(own_broker, client_id=cid, clean_session=True)
    c.close()
    publish("t7")
    a = Mqtt(own_broker, client_id=cid, clean_session=False, connect=False)
    try:
        flags, rc = a.connect()
        assert not rc.is_failure and not flags.session_present
        assert a.message(timeout=0.5) is None
    finally:
        a.close()

"""Message filters and ordered partitions (issue 17, items 4 and 5) with pika and
stomp.py: SQL92 selectors (AMQP `x-selector`, STOMP `selector`), tag filters
(`x-tag` / `x-tag-filter`), and the consistent-hash exchange with single active
consumer keeping per-key order across a consumer failover."""

import collections
import time

import pika
import pika.exceptions as pex
import pytest

from helpers import Stomp, consume, pika_connect


def triad_only(broker):
    if getattr(broker, "external", False):
        pytest.skip("Triad's extension (RabbitMQ has no selectors or tag filters)")


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
def stomp_clients(broker):
    made = []

    def make(**kw):
        c = Stomp(broker, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def publish_colours(ch, q):
    for colour, size in [("blue", 5), ("red", 20), ("red", 3), ("red", 11)]:
        ch.basic_publish(
            "", q, f"{colour}-{size}".encode(),
            pika.BasicProperties(headers={"colour": colour, "size": size}, priority=size % 10),
        )


# --- selectors ---------------------------------------------------------------------


def test_pika_selector_takes_matches_and_leaves_the_rest(broker, conn, uid):
    triad_only(broker)
    q = f"sel-{uid}"
    ch = conn.channel()
    ch.queue_declare(q)
    publish_colours(ch, q)
    got = consume(conn, ch, q, 2,
                  arguments={"x-selector": "colour = 'red' AND size > 10 AND JMSPriority <> 5"})
    assert [b for _, _, b in got] == [b"red-20", b"red-11"]
    # the others stayed, in order, for a consumer without a selector
    rest = consume(conn, ch, q, 2)
    assert [b for _, _, b in rest] == [b"blue-5", b"red-3"]


def test_pika_selector_in_like_between_is_null(broker, conn, uid):
    triad_only(broker)
    q = f"sel2-{uid}"
    ch = conn.channel()
    ch.queue_declare(q)
    for i, h in enumerate([{"region": "eu-west", "n": 1}, {"region": "us-east", "n": 5},
                           {"n": 7}, {"region": "eu-north", "n": 9}]):
        ch.basic_publish("", q, f"m{i}".encode(), pika.BasicProperties(headers=h))
    sel = "(region LIKE 'eu-%' AND n BETWEEN 2 AND 9) OR (region IS NULL AND n IN (7, 8))"
    got = consume(conn, ch, q, 2, arguments={"x-selector": sel})
    assert [b for _, _, b in got] == [b"m2", b"m3"]


def test_pika_malformed_selector_is_406_naming_the_problem(broker, conn, uid):
    triad_only(broker)
    q = f"bad-{uid}"
    conn.channel().queue_declare(q)
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        conn.channel().basic_consume(q, lambda *a: None,
                                     arguments={"x-selector": "colour = 'red' AND"})
    assert e.value.reply_code == 406
    assert "invalid selector" in e.value.reply_text
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        conn.channel().basic_consume(q, lambda *a: None, arguments={"x-tag-filter": "a||"})
    assert e.value.reply_code == 406 and "x-tag-filter" in e.value.reply_text


def test_stomp_selector_takes_matches_and_leaves_the_rest(broker, stomp_clients, uid):
    triad_only(broker)
    dest = f"/queue/ssel-{uid}"
    p = stomp_clients()
    for colour, size in [("blue", 5), ("red", 20), ("red", 3), ("red", 11)]:
        p.send(dest, f"{colour}-{size}", colour=colour, size=str(size))
    a = stomp_clients()
    # STOMP header values are strings; `size > 10` reads them as numbers (ActiveMQ's rule)
    a.subscribe(dest, "a", selector="colour = 'red' AND size > 10")
    assert [m.body for m in a.messages(2)] == ["red-20", "red-11"]
    assert a.message(0.3) is None
    b = stomp_clients()
    b.subscribe(dest, "b")
    assert [m.body for m in b.messages(2)] == ["blue-5", "red-3"]


# --- tags --------------------------------------------------------------------------


def test_pika_tag_filter(broker, conn, uid):
    triad_only(broker)
    q = f"tag-{uid}"
    ch = conn.channel()
    ch.queue_declare(q, durable=True)
    for i, tag in enumerate(["TagA", "TagC", "TagB", None, "TagA"]):
        h = {"x-tag": tag} if tag else {}
        ch.basic_publish("", q, f"m{i}".encode(),
                         pika.BasicProperties(headers=h, delivery_mode=2))
    got = consume(conn, ch, q, 3, arguments={"x-tag-filter": "TagA || TagB"})
    assert [b for _, _, b in got] == [b"m0", b"m2", b"m4"]
    assert got[0][1].headers == {"x-tag": "TagA"}
    assert ch.queue_declare(q, passive=True).method.message_count == 2


def test_pika_tag_filter_after_restart(own_broker, uid):
    """The tag's hash lives in the consume-queue entry: it is still there after a
    restart (and the real tag still decides)."""
    triad_only(own_broker)
    q = f"tagr-{uid}"
    c = pika_connect(own_broker)
    ch = c.channel()
    ch.queue_declare(q, durable=True)
    for i, tag in enumerate(["a", "b", "a", "c"]):
        ch.basic_publish("", q, f"m{i}".encode(),
                         pika.BasicProperties(headers={"x-tag": tag}, delivery_mode=2))
    c.close()
    own_broker.restart()
    c = pika_connect(own_broker)
    try:
        ch = c.channel()
        got = consume(c, ch, q, 2, arguments={"x-tag-filter": "a"})
        assert [b for _, _, b in got] == [b"m0", b"m2"]
    finally:
        c.close()


def test_stomp_tag_filter(broker, stomp_clients, uid):
    triad_only(broker)
    dest = f"/queue/stag-{uid}"
    c = stomp_clients()
    c.subscribe(dest, "t", **{"x-tag-filter": "a || b"})
    p = stomp_clients()
    for tag in ["a", "c", "b"]:
        p.send(dest, f"m-{tag}", **{"x-tag": tag})
    p.send(dest, "m-none")
    got = c.messages(2)
    assert [m.body for m in got] == ["m-a", "m-b"]
    assert got[0].headers["x-tag"] == "a"
    assert c.message(0.3) is None


# --- consistent hash + single active consumer ----------------------------------------


def test_consistent_hash_routes_by_key_and_weight(conn, uid):
    ch = conn.channel()
    x = f"chx-{uid}"
    ch.exchange_declare(x, "x-consistent-hash")
    qs = [f"chq{i}-{uid}" for i in range(3)]
    for i, q in enumerate(qs):
        ch.queue_declare(q)
        ch.queue_bind(q, x, routing_key=str(1 if i < 2 else 2))
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        conn.channel().queue_bind(qs[0], x, routing_key="heavy")
    assert e.value.reply_code == 406
    n = 3000
    for i in range(n):
        ch.basic_publish(x, f"key-{i}", b"x")
    counts = [ch.queue_declare(q, passive=True).method.message_count for q in qs]
    assert sum(counts) == n
    # weight 2 gets about twice what weight 1 gets
    assert 0.6 * n / 4 < counts[0] < 1.4 * n / 4, counts
    assert 0.6 * n / 2 < counts[2] < 1.4 * n / 2, counts
    # the same key goes to the same queue every time
    for _ in range(5):
        ch.basic_publish(x, "key-7", b"again")
    after = [ch.queue_declare(q, passive=True).method.message_count for q in qs]
    assert sorted(a - c for a, c in zip(after, counts)) == [0, 0, 5]


def test_consistent_hash_on_a_header(conn, uid):
    ch = conn.channel()
    x = f"chh-{uid}"
    ch.exchange_declare(x, "x-consistent-hash", arguments={"hash-header": "account"})
    qs = [f"chh{i}-{uid}" for i in range(4)]
    for q in qs:
        ch.queue_declare(q)
        ch.queue_bind(q, x, routing_key="1")
    for i in range(200):
        ch.basic_publish(x, f"rk-{i}", f"{i % 10}".encode(),
                         pika.BasicProperties(headers={"account": f"acct-{i % 10}"}))
    seen = collections.defaultdict(set)
    for q in qs:
        for _, _, body in consume(conn, conn.channel(), q, 200, timeout=1.0):
            seen[body].add(q)
    assert len(seen) == 10 and all(len(v) == 1 for v in seen.values()), seen
    with pytest.raises(pex.ChannelClosedByBroker) as e:
        conn.channel().exchange_declare(f"chbad-{uid}", "x-consistent-hash",
                                        arguments={"hash-header": "a", "hash-property": "message_id"})
    assert e.value.reply_code == 406 and "mutually exclusive" in e.value.reply_text


def test_consistent_hash_with_sac_keeps_per_key_order_across_failover(broker, uid):
    """Three single-active-consumer queues behind a consistent-hash exchange, 20 keys
    with 30 messages each. The first consumer of every queue acks what it gets until
    it has processed 100, holds what else it has unacked and dies (connection closed);
    the standby consumers take over. Per key, the messages processed (first consumer's
    acks, then the standby's) are 0..29 in order, and each key used one queue."""
    x, keys, per_key = f"cho-{uid}", [f"k{i}" for i in range(20)], 30
    qs = [f"cho{i}-{uid}" for i in range(3)]
    admin = pika_connect(broker)
    ch = admin.channel()
    ch.exchange_declare(x, "x-consistent-hash", durable=True)
    for q in qs:
        ch.queue_declare(q, durable=True, arguments={"x-single-active-consumer": True})
        ch.queue_bind(q, x, routing_key="1")
    first, standby = pika_connect(broker), pika_connect(broker)
    processed = collections.defaultdict(list)
    key_queues = collections.defaultdict(set)
    state = {"acked": 0}
    tag_queue = {}

    def on_first(c, m, p, body):
        key, seq = body.decode().split(":")
        if state["acked"] < 100:
            processed[key].append(int(seq))
            key_queues[key].add(tag_queue[m.consumer_tag])
            c.basic_ack(m.delivery_tag)
            state["acked"] += 1

    fch = first.channel()
    fch.basic_qos(prefetch_count=5)
    for q in qs:
        tag_queue[fch.basic_consume(q, on_first)] = q
    taken_over = []

    def on_standby(c, m, p, body):
        key, seq = body.decode().split(":")
        processed[key].append(int(seq))
        key_queues[key].add(tag_queue[m.consumer_tag])
        taken_over.append(m.redelivered)
        c.basic_ack(m.delivery_tag)

    sch = standby.channel()
    sch.basic_qos(prefetch_count=5)
    for q in qs:
        tag_queue[sch.basic_consume(q, on_standby)] = q
    try:
        for seq in range(per_key):
            for k in keys:
                ch.basic_publish(x, k, f"{k}:{seq}".encode(),
                                 pika.BasicProperties(delivery_mode=2))
        deadline = time.monotonic() + 10
        while state["acked"] < 100 and time.monotonic() < deadline:
            first.process_data_events(time_limit=0.05)
        assert state["acked"] == 100
        standby.process_data_events(time_limit=0.2)
        assert taken_over == [], "the standby got nothing while the first was active"
        first.close()  # the active consumers go; their unacked messages are requeued
        total = len(keys) * per_key
        deadline = time.monotonic() + 15
        while sum(len(v) for v in processed.values()) < total and time.monotonic() < deadline:
            standby.process_data_events(time_limit=0.05)
        for k in keys:
            assert processed[k] == list(range(per_key)), (k, processed[k])
            assert len(key_queues[k]) == 1, (k, key_queues[k])
        assert any(taken_over), "some held messages came back redelivered"
    finally:
        for c in (standby, first):
            if c.is_open:
                c.close()
        for q in qs:
            ch.queue_delete(q)
        ch.exchange_delete(x)
        admin.close()

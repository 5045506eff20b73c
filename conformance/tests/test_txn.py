"""Half messages (issue 17 item 6, RocketMQ's transactional messages) with pika and
stomp.py: `x-txn: half` stores a message without routing it; a commit or rollback by
message-id (AMQP exchange `amq.triad.txn`, STOMP `SEND /txn/<id>`) resolves it; an
unresolved one gets `x-txn: check` messages at its `reply-to`.

Triad's own extension: skipped against an external broker."""

import pika
import pytest

from helpers import Stomp, consume, pika_connect, wait_for

TXN_CONFIG = """
[store]
segment_size = "4 MiB"
[limits]
max_message_size = "1 MiB"
[txn]
check_timeout = "300ms"
check_max = 2
"""


@pytest.fixture(autouse=True)
def _triad_only(broker):
    if getattr(broker, "external", False):
        pytest.skip("half messages are Triad's extension")


def props(op, msg_id, **kw):
    return pika.BasicProperties(message_id=msg_id, delivery_mode=2, headers={"x-txn": op}, **kw)


def test_pika_half_message_is_invisible_until_commit_and_rollback_discards(broker, uid):
    conn = pika_connect(broker)
    ch = conn.channel()
    q = f"txn-{uid}"
    ch.queue_declare(q, durable=True)
    ch.confirm_delivery()
    ch.basic_publish("", q, b"first", props("half", f"{uid}-1"))
    ch.basic_publish("", q, b"second", props("half", f"{uid}-2"))
    method, _, _ = ch.basic_get(q, auto_ack=True)
    assert method is None, "half messages are not routed"
    ch.basic_publish("amq.triad.txn", "", b"", props("commit", f"{uid}-1"))
    ch.basic_publish("amq.triad.txn", "", b"", props("rollback", f"{uid}-2"))
    got = consume(conn, ch, q, 1, auto_ack=True)
    assert [b for _, _, b in got] == [b"first"]
    _, p, _ = got[0]
    assert p.message_id == f"{uid}-1"
    assert "x-txn" not in (p.headers or {})
    # resolved: the id is unknown now (404 closes the channel)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch.basic_publish("amq.triad.txn", "", b"", props("commit", f"{uid}-2"))
    assert e.value.reply_code == 404
    assert "half message" in e.value.reply_text
    conn.close()


def test_pika_half_message_without_message_id_is_refused(broker, uid):
    conn = pika_connect(broker)
    ch = conn.channel()
    q = f"txn-noid-{uid}"
    ch.queue_declare(q)
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch.basic_publish("", q, b"x", pika.BasicProperties(headers={"x-txn": "half"}))
    assert e.value.reply_code == 406
    assert "message-id" in e.value.reply_text
    conn.close()


def test_pika_producer_answers_a_check_with_commit(configured_broker, uid):
    b = configured_broker(TXN_CONFIG)
    conn = pika_connect(b)
    ch = conn.channel()
    q, replies = f"orders-{uid}", f"checks-{uid}"
    ch.queue_declare(q, durable=True)
    ch.queue_declare(replies, durable=True)
    ch.confirm_delivery()
    ch.basic_publish("", q, b"order", props("half", "o-1", reply_to=replies))
    checks = consume(conn, ch, replies, 1, timeout=10, auto_ack=True)
    assert len(checks) == 1, "a check after check_timeout"
    _, p, body = checks[0]
    assert p.headers["x-txn"] == "check"
    assert p.headers["x-txn-check-count"] == 1
    assert p.headers["x-txn-routing-key"] == q
    assert p.message_id == "o-1" and body == b""
    # the producer's local transaction succeeded: commit
    ch.basic_publish("amq.triad.txn", "", b"", props("commit", p.message_id))
    got = consume(conn, ch, q, 1, auto_ack=True)
    assert [body for _, _, body in got] == [b"order"]
    conn.close()


def test_pika_unanswered_half_message_is_rolled_back_after_check_max(configured_broker, uid):
    b = configured_broker(TXN_CONFIG)
    conn = pika_connect(b)
    ch = conn.channel()
    q, replies = f"lost-{uid}", f"lost-checks-{uid}"
    ch.queue_declare(q)
    ch.queue_declare(replies)
    ch.confirm_delivery()
    ch.basic_publish("", q, b"x", props("half", "l-1", reply_to=replies))
    checks = consume(conn, ch, replies, 2, timeout=10, auto_ack=True)
    assert [p.headers["x-txn-check-count"] for _, p, _ in checks] == [1, 2]

    def rolled_back():
        c = conn.channel()
        c.confirm_delivery()
        try:
            c.basic_publish("amq.triad.txn", "", b"", props("rollback", "l-1"))
            c.close()
            return False
        except pika.exceptions.ChannelClosedByBroker as e:
            return e.reply_code == 404

    assert wait_for(rolled_back, timeout=10, interval=0.2)
    method, _, _ = ch.basic_get(q, auto_ack=True)
    assert method is None
    conn.close()


def test_stomp_half_commit_rollback_and_unknown_id(broker, uid):
    c = Stomp(broker)
    try:
        dest = f"/queue/stxn-{uid}"
        c.subscribe(dest, "s1")
        c.send(dest, "kept", **{"x-txn": "half", "message-id": f"{uid}-a", "persistent": "true"})
        c.send(dest, "dropped", **{"x-txn": "half", "message-id": f"{uid}-b"})
        assert c.message(0.5) is None, "half messages are not delivered"
        c.send(f"/txn/{uid}-a", "", **{"x-txn": "commit"})
        c.send(f"/txn/{uid}-b", "", **{"x-txn": "rollback"})
        m = c.message()
        assert m is not None and m.body == "kept"
        assert "x-txn" not in m.headers
        assert c.message(0.5) is None
        c.send(f"/txn/{uid}-b", "", wait=False, **{"x-txn": "commit"})
        err = c.error()
        assert err is not None and err.headers.get("message") == "not_found"
        assert f"no half message '{uid}-b'" in err.body
    finally:
        c.close()


def test_stomp_check_goes_to_the_reply_to_destination(configured_broker, uid):
    b = configured_broker(TXN_CONFIG)
    c = Stomp(b)
    try:
        dest, replies = f"/queue/sorders-{uid}", f"/queue/schecks-{uid}"
        c.subscribe(replies, "checks")
        c.send(dest, "pay", **{"x-txn": "half", "message-id": "p-1", "reply-to": replies})
        m = c.message(10)
        assert m is not None, "a check at the reply-to destination"
        assert m.headers["x-txn"] == "check"
        assert m.headers["x-txn-check-count"] == "1"
        c.send("/txn/p-1", "", **{"x-txn": "commit"})
        c.subscribe(dest, "orders")
        got = c.messages(3, timeout=3)
        bodies = [f.body for f in got if f.headers["subscription"] == "orders"]
        assert bodies == ["pay"]
    finally:
        c.close()

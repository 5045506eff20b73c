"""stomp.py 8.2.0 (STOMP 1.2) against Triad's STOMP listener, with RabbitMQ's STOMP
plugin destination conventions."""

import time

import pytest

from helpers import Stomp, pika_connect


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


def test_connected_frame(broker, stomp_clients):
    c = stomp_clients(connect=False)
    frame = c.connect()
    assert frame.headers["version"] == "1.2"
    assert "server" in frame.headers


def test_bad_login_gets_error(broker, stomp_clients):
    c = stomp_clients(connect=False)
    c.conn.connect("guest", "wrong-password", wait=False)
    err = c.error(5)
    assert err is not None, "a wrong passcode must be answered with ERROR"
    assert err.headers.get("message")


def test_queue_send_subscribe_receipts_and_headers(stomp_clients, uid):
    c = stomp_clients()
    dest = f"/queue/q-{uid}"
    c.subscribe(dest, "sub-1")
    c.send(dest, "hello", **{"content-type": "text/plain", "x-custom": "v1", "correlation-id": "c-1"})
    m = c.message()
    assert m is not None and m.body == "hello"
    h = m.headers
    assert h["destination"] == dest
    assert h["subscription"] == "sub-1"
    assert h["message-id"]
    assert h["content-type"] == "text/plain"
    assert h["x-custom"] == "v1"
    assert h["correlation-id"] == "c-1"
    assert "ack" not in h or h["ack"]  # ack header only required for client modes


def test_queue_is_point_to_point(stomp_clients, uid):
    a, b, p = stomp_clients(), stomp_clients(), stomp_clients()
    dest = f"/queue/q-{uid}"
    a.subscribe(dest, "a")
    b.subscribe(dest, "b")
    for i in range(10):
        p.send(dest, f"m{i}", wait=(i == 9))
    got = a.messages(10, timeout=1.5) + b.messages(10, timeout=0.5)
    assert sorted(m.body for m in got) == sorted(f"m{i}" for i in range(10))


def test_queue_keeps_messages_until_subscribed(stomp_clients, uid):
    p = stomp_clients()
    dest = f"/queue/q-{uid}"
    # SEND to /queue/ declares the queue, so messages wait for a later subscriber
    p.send(dest, "early")
    c = stomp_clients()
    c.subscribe(dest, "s")
    m = c.message()
    assert m is not None and m.body == "early"


def test_topic_fans_out_to_current_subscribers(stomp_clients, uid):
    a, b, p = stomp_clients(), stomp_clients(), stomp_clients()
    dest = f"/topic/t.{uid}"
    p.send(dest, "before anyone listens")
    a.subscribe(dest, "a")
    b.subscribe(dest, "b")
    p.send(dest, "news")
    ma, mb = a.message(), b.message()
    assert ma is not None and ma.body == "news"
    assert mb is not None and mb.body == "news"
    assert ma.headers["destination"] == dest
    assert a.message(0.3) is None and b.message(0.1) is None


def test_topic_wildcard_subscription(stomp_clients, uid):
    c, p = stomp_clients(), stomp_clients()
    c.subscribe(f"/topic/w{uid}.*.x", "s1")
    c.subscribe(f"/topic/w{uid}.#", "s2")
    p.send(f"/topic/w{uid}.a.x", "ax")
    got = c.messages(2, timeout=3)
    assert sorted((m.headers["subscription"], m.body) for m in got) == [("s1", "ax"), ("s2", "ax")]
    p.send(f"/topic/w{uid}.a.b.c", "deep")
    got = c.messages(2, timeout=1)
    assert [(m.headers["subscription"], m.body) for m in got] == [("s2", "deep")]


def test_exchange_destination(stomp_clients, uid):
    c, p = stomp_clients(), stomp_clients()
    c.subscribe(f"/exchange/amq.topic/e{uid}.*", "s")
    p.send(f"/exchange/amq.topic/e{uid}.one", "via exchange")
    p.send(f"/topic/e{uid}.two", "via topic")
    got = c.messages(2, timeout=3)
    assert [m.body for m in got] == ["via exchange", "via topic"]


def test_amq_queue_destination_uses_existing_queue(broker, stomp_clients, uid):
    q = f"q-{uid}"
    conn = pika_connect(broker)
    try:
        conn.channel().queue_declare(q)
        conn.channel().basic_publish("", q, b"from amqp")
    finally:
        conn.close()
    c = stomp_clients()
    c.subscribe(f"/amq/queue/{q}", "s")
    m = c.message()
    assert m is not None and m.body == "from amqp"
    c.send(f"/amq/queue/{q}", "from stomp")
    m = c.message()
    assert m is not None and m.body == "from stomp"


def test_amq_queue_missing_queue_is_error(stomp_clients, uid):
    c = stomp_clients()
    c.conn.subscribe(f"/amq/queue/missing-{uid}", "s")
    err = c.error(5)
    assert err is not None


def test_unknown_destination_is_error(stomp_clients, uid):
    c = stomp_clients()
    c.conn.send(f"/bogus/{uid}", "x")
    err = c.error(5)
    assert err is not None


def test_unsubscribe_stops_delivery(stomp_clients, uid):
    c, p = stomp_clients(), stomp_clients()
    dest = f"/topic/u.{uid}"
    c.subscribe(dest, "s")
    p.send(dest, "one")
    assert c.message().body == "one"
    rid = c.receipt()
    c.conn.unsubscribe("s", headers={"receipt": rid})
    c.wait_receipt(rid)
    p.send(dest, "two")
    assert c.message(0.5) is None


def test_ack_client_is_cumulative(broker, stomp_clients, uid):
    dest = f"/queue/q-{uid}"
    p = stomp_clients()
    for i in range(3):
        p.send(dest, f"m{i}")
    c = stomp_clients()
    c.subscribe(dest, "s", ack="client")
    got = c.messages(3)
    assert [m.body for m in got] == ["m0", "m1", "m2"]
    # ACK of the second acknowledges the first as well (client mode is cumulative)
    rid = c.receipt()
    c.conn.ack(got[1].headers["ack"], receipt=rid)
    c.wait_receipt(rid)
    c.close()
    d = stomp_clients()
    d.subscribe(dest, "s", ack="auto")
    again = d.messages(3, timeout=1.5)
    assert [m.body for m in again] == ["m2"]
    assert again[0].headers.get("redelivered") == "true"


def test_ack_client_individual_and_nack_redelivers(stomp_clients, uid):
    dest = f"/queue/q-{uid}"
    p = stomp_clients()
    for i in range(3):
        p.send(dest, f"m{i}")
    c = stomp_clients()
    c.subscribe(dest, "s", ack="client-individual")
    got = c.messages(3)
    assert [m.body for m in got] == ["m0", "m1", "m2"]
    assert all(m.headers.get("ack") for m in got)
    # individual ACK of the last one does not ack the others
    c.conn.ack(got[2].headers["ack"])
    c.conn.ack(got[0].headers["ack"])
    c.conn.nack(got[1].headers["ack"])
    m = c.message()
    assert m is not None and m.body == "m1"
    assert m.headers.get("redelivered") == "true"
    rid = c.receipt()
    c.conn.ack(m.headers["ack"], receipt=rid)
    c.wait_receipt(rid)
    assert c.message(0.5) is None


def test_unacked_client_messages_return_after_disconnect(stomp_clients, uid):
    dest = f"/queue/q-{uid}"
    p = stomp_clients()
    p.send(dest, "unacked")
    c = stomp_clients()
    c.subscribe(dest, "s", ack="client-individual")
    assert c.message().body == "unacked"
    c.close()
    d = stomp_clients()
    d.subscribe(dest, "s")
    m = d.message()
    assert m is not None and m.body == "unacked"
    assert m.headers.get("redelivered") == "true"


def test_prefetch_count_header_limits_unacked(stomp_clients, uid):
    dest = f"/queue/q-{uid}"
    p = stomp_clients()
    for i in range(5):
        p.send(dest, f"m{i}")
    c = stomp_clients()
    c.subscribe(dest, "s", ack="client-individual", **{"prefetch-count": "2"})
    got = c.messages(5, timeout=1)
    assert len(got) == 2
    c.conn.ack(got[0].headers["ack"])
    more = c.messages(5, timeout=1)
    assert len(more) == 1


def test_transaction_commit_and_abort(stomp_clients, uid):
    dest = f"/queue/q-{uid}"
    c = stomp_clients()
    c.subscribe(dest, "s")
    tx = c.conn.begin()
    c.conn.send(dest, "aborted-1", transaction=tx)
    c.conn.send(dest, "aborted-2", transaction=tx)
    rid = c.receipt()
    c.conn.abort(tx, headers={"receipt": rid})
    c.wait_receipt(rid)
    tx = c.conn.begin()
    c.conn.send(dest, "committed", transaction=tx)
    assert c.message(0.5) is None, "transactional SEND must wait for COMMIT"
    rid = c.receipt()
    c.conn.commit(tx, headers={"receipt": rid})
    c.wait_receipt(rid)
    got = c.messages(3, timeout=1.5)
    assert [m.body for m in got] == ["committed"]


def test_transactional_ack_abort_keeps_message(stomp_clients, uid):
    dest = f"/queue/q-{uid}"
    p = stomp_clients()
    p.send(dest, "m")
    c = stomp_clients()
    c.subscribe(dest, "s", ack="client-individual")
    m = c.message()
    tx = c.conn.begin()
    c.conn.ack(m.headers["ack"], transaction=tx)
    rid = c.receipt()
    c.conn.abort(tx, headers={"receipt": rid})
    c.wait_receipt(rid)
    c.close()
    d = stomp_clients()
    d.subscribe(dest, "s")
    m = d.message()
    assert m is not None and m.body == "m", "an aborted ACK must leave the message unacked"


def test_durable_topic_subscription_gets_messages_sent_while_away(broker, stomp_clients, uid):
    dest = f"/topic/d.{uid}"
    hdrs = {"durable": "true", "auto-delete": "false"}
    c = stomp_clients(headers={"client-id": f"cid-{uid}"})
    c.subscribe(dest, f"dur-{uid}", ack="client-individual", **hdrs)
    p = stomp_clients()
    p.send(dest, "while online")
    m = c.message()
    assert m is not None and m.body == "while online"
    c.conn.ack(m.headers["ack"])
    c.close()
    time.sleep(0.2)
    p.send(dest, "while away 1")
    p.send(dest, "while away 2")
    d = stomp_clients(headers={"client-id": f"cid-{uid}"})
    d.subscribe(dest, f"dur-{uid}", ack="auto", **hdrs)
    got = d.messages(2)
    assert [m.body for m in got] == ["while away 1", "while away 2"]


def test_non_durable_topic_subscription_loses_messages_while_away(stomp_clients, uid):
    dest = f"/topic/nd.{uid}"
    c = stomp_clients()
    c.subscribe(dest, "s")
    c.close()
    p = stomp_clients()
    p.send(dest, "missed")
    d = stomp_clients()
    d.subscribe(dest, "s")
    assert d.message(0.5) is None


def test_temp_queue_reply_pattern(stomp_clients, uid):
    service = f"/queue/svc-{uid}"
    server = stomp_clients()
    server.subscribe(service, "svc")
    client = stomp_clients()
    client.send(service, "ping", **{"reply-to": "/temp-queue/answers", "correlation-id": "42"})
    req = server.message()
    assert req is not None and req.body == "ping"
    reply_to = req.headers["reply-to"]
    assert reply_to.startswith("/reply-queue/"), reply_to
    server.send(reply_to, "pong", **{"correlation-id": req.headers["correlation-id"]})
    rep = client.message()
    assert rep is not None and rep.body == "pong"
    assert rep.headers["correlation-id"] == "42"
    assert rep.headers["destination"] == "/temp-queue/answers" or rep.headers.get(
        "subscription"
    ) == "/temp-queue/answers"


def test_malformed_selector_is_refused(stomp_clients, uid):
    c = stomp_clients()
    c.conn.subscribe(f"/queue/q-{uid}", "s", headers={"selector": "color = 'red"})
    err = c.error(5)
    assert err is not None, "SUBSCRIBE with a malformed selector must get an ERROR"
    assert "selector" in (err.headers.get("message", "") + err.body).lower()


def test_binary_body_with_nul_bytes(broker, uid):
    dest = f"/queue/q-{uid}"
    c = Stomp(broker, auto_decode=False)
    try:
        c.subscribe(dest, "s")
        body = bytes(range(256)) * 64
        c.send(dest, body, **{"content-type": "application/octet-stream"})
        m = c.message()
        assert m is not None and m.body == body
        assert int(m.headers["content-length"]) == len(body)
    finally:
        c.close()


def test_header_escaping_round_trip(stomp_clients, uid):
    c = stomp_clients()
    dest = f"/queue/q-{uid}"
    c.subscribe(dest, "s")
    value = "a:b\\c\nd"
    c.send(dest, "x", **{"x-escaped": value})
    m = c.message()
    assert m is not None and m.headers["x-escaped"] == value


def test_persistent_and_priority_headers_map_to_amqp(broker, stomp_clients, uid):
    q = f"q-{uid}"
    c = stomp_clients()
    c.send(f"/queue/{q}", "to amqp", **{
        "persistent": "true", "priority": "7", "x-app": "yes",
        "content-type": "text/plain", "correlation-id": "corr-9",
    })
    conn = pika_connect(broker)
    try:
        m, props, body = conn.channel().basic_get(q, auto_ack=True)
        assert body == b"to amqp"
        assert props.delivery_mode == 2 and props.priority == 7
        assert props.headers["x-app"] == "yes"
        assert props.content_type == "text/plain"
        assert props.correlation_id == "corr-9"
    finally:
        conn.close()


def test_large_message(stomp_clients, uid):
    c = stomp_clients()
    dest = f"/queue/q-{uid}"
    c.subscribe(dest, "s")
    body = "x" * (2 * 1024 * 1024)
    c.send(dest, body)
    m = c.message(15)
    assert m is not None and len(m.body) == len(body)


def test_heartbeats_negotiated_and_sent(broker):
    import stomp

    host, port = broker.host_port("stomp")
    conn = stomp.Connection12([(host, port)], heartbeats=(500, 500), timeout=5,
                              reconnect_attempts_max=1)
    from helpers import StompListener

    lst = StompListener()
    timeouts = []
    lst.on_heartbeat_timeout = lambda: timeouts.append(True)
    conn.set_listener("l", lst)
    try:
        conn.connect("guest", "guest", wait=False)
        frame = lst.connected.get(timeout=5)
        sx, sy = (int(x) for x in frame.headers["heart-beat"].split(","))
        assert sx > 0 and sy > 0, "the server must agree to heart-beat when the client asks"
        time.sleep(3)
        assert not timeouts, "the server stopped sending heart-beats"
        assert conn.is_connected()
    finally:
        conn.disconnect()


def test_duplicate_subscription_id_is_error(stomp_clients, uid):
    c = stomp_clients()
    c.subscribe(f"/queue/q-{uid}", "same")
    c.conn.subscribe(f"/queue/q2-{uid}", "same")
    assert c.error(5) is not None


def test_ack_of_unknown_id_is_error(stomp_clients, uid):
    c = stomp_clients()
    c.subscribe(f"/queue/q-{uid}", "s", ack="client-individual")
    c.conn.ack("no-such-ack-id")
    assert c.error(5) is not None


def test_send_without_destination_is_error(stomp_clients):
    c = stomp_clients()
    c.conn.send_frame("SEND", {}, "x")
    err = c.error(5)
    assert err is not None


def test_receipt_on_disconnect(stomp_clients):
    c = stomp_clients()
    rid = c.receipt()
    c.conn.disconnect(receipt=rid)
    c.wait_receipt(rid)


def test_durable_stomp_queue_survives_restart(own_broker, uid):
    dest = f"/queue/q-{uid}"
    p = Stomp(own_broker)
    p.send(dest, "persisted", persistent="true")
    p.close()
    assert own_broker.restart() == 0
    c = Stomp(own_broker)
    try:
        c.subscribe(dest, "s")
        m = c.message()
        assert m is not None and m.body == "persisted"
    finally:
        c.close()


def test_durable_topic_subscription_survives_restart(own_broker, uid):
    dest = f"/topic/dr.{uid}"
    hdrs = {"durable": "true", "auto-delete": "false"}
    c = Stomp(own_broker, headers={"client-id": f"cid-{uid}"})
    c.subscribe(dest, f"dur-{uid}", **hdrs)
    c.close()
    p = Stomp(own_broker)
    p.send(dest, "kept across restart", persistent="true")
    p.close()
    assert own_broker.restart() == 0
    d = Stomp(own_broker, headers={"client-id": f"cid-{uid}"})
    try:
        d.subscribe(dest, f"dur-{uid}", **hdrs)
        m = d.message()
        assert m is not None and m.body == "kept across restart"
    finally:
        d.close()


def test_content_length_absent_body_until_nul(broker, uid):
    """A frame without content-length: the body runs to the first NUL."""
    import socket

    host, port = broker.host_port("stomp")
    s = socket.create_connection((host, port), timeout=5)
    try:
        s.sendall(b"CONNECT\naccept-version:1.2\nhost:/\nlogin:guest\npasscode:guest\n\n\x00")
        buf = b""
        while b"\x00" not in buf:
            buf += s.recv(4096)
        assert buf.startswith(b"CONNECTED")
        dest = f"/queue/q-{uid}".encode()
        s.sendall(b"SUBSCRIBE\nid:0\ndestination:" + dest + b"\nreceipt:sub\n\n\x00")
        s.sendall(b"SEND\ndestination:" + dest + b"\n\nno length header\x00\n\n")
        buf = b""
        deadline = time.monotonic() + 5
        while b"MESSAGE" not in buf or not buf.rstrip(b"\n").endswith(b"\x00"):
            if time.monotonic() > deadline:
                break
            buf += s.recv(4096)
        assert b"RECEIPT\nreceipt-id:sub" in buf
        msg = buf[buf.index(b"MESSAGE"):]
        assert msg.split(b"\n\n", 1)[1].rstrip(b"\n").rstrip(b"\x00") == b"no length header"
    finally:
        s.close()


def test_nack_without_requeue_dead_letters(broker, stomp_clients, uid):
    dlx, dlq, q = f"dlx-{uid}", f"dlq-{uid}", f"q-{uid}"
    conn = pika_connect(broker)
    try:
        ch = conn.channel()
        ch.exchange_declare(dlx, "fanout")
        ch.queue_declare(dlq)
        ch.queue_bind(dlq, dlx)
        ch.queue_declare(q, arguments={"x-dead-letter-exchange": dlx})
        ch.basic_publish("", q, b"bad message")
        c = stomp_clients()
        c.subscribe(f"/amq/queue/{q}", "s", ack="client-individual")
        m = c.message()
        assert m is not None and m.body == "bad message"
        rid = c.receipt()
        c.conn.nack(m.headers["ack"], receipt=rid, requeue="false")
        c.wait_receipt(rid)
        assert c.message(0.5) is None, "requeue:false must not redeliver"
        deadline = time.monotonic() + 5
        got = (None, None, None)
        while got[0] is None and time.monotonic() < deadline:
            got = ch.basic_get(dlq, auto_ack=True)
        assert got[2] == b"bad message"
        assert got[1].headers["x-death"][0]["reason"] == "rejected"
    finally:
        conn.close()


def test_expiration_header_sets_per_message_ttl(stomp_clients, uid):
    dest = f"/queue/q-{uid}"
    p = stomp_clients()
    p.send(dest, "short", expiration="100")
    p.send(dest, "long")
    time.sleep(0.4)
    c = stomp_clients()
    c.subscribe(dest, "s")
    got = c.messages(2, timeout=1)
    assert [m.body for m in got] == ["long"]


# --- boolean headers as stomp.py writes them (Python's True / False) ---------------------


def _rabbit_subscription_queue(name, sid):
    """RabbitMQ's STOMP plugin's durable subscription queue name for routing key `name`
    and id `sid`: md5 of term_to_binary({Name, Id}) (two Erlang strings), base64url."""
    import base64
    import hashlib
    import struct

    def erl_string(s):
        b = s.encode()
        return b"\x6a" if not b else b"\x6b" + struct.pack(">H", len(b)) + b

    term = b"\x83\x68\x02" + erl_string(name) + erl_string(sid)
    digest = hashlib.md5(term).digest()
    return "stomp-subscription-" + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def _queue_exists(broker, name):
    import pika.exceptions

    conn = pika_connect(broker)
    try:
        ch = conn.channel()
        try:
            ch.queue_declare(name, passive=True)
            return True
        except pika.exceptions.ChannelClosedByBroker as e:
            assert e.reply_code == 404, e
            return False
    finally:
        if conn.is_open:
            conn.close()


def test_nack_requeue_python_false_dead_letters(broker, stomp_clients, uid):
    """stomp.py sends requeue=False as `requeue:False`: dropped (dead-lettered), not
    redelivered."""
    dlx, dlq, q = f"dlx-{uid}", f"dlq-{uid}", f"q-{uid}"
    conn = pika_connect(broker)
    try:
        ch = conn.channel()
        ch.exchange_declare(dlx, "fanout")
        ch.queue_declare(dlq)
        ch.queue_bind(dlq, dlx)
        ch.queue_declare(q, arguments={"x-dead-letter-exchange": dlx})
        ch.basic_publish("", q, b"bad message")
        c = stomp_clients()
        c.subscribe(f"/amq/queue/{q}", "s", ack="client-individual")
        m = c.message()
        assert m is not None and m.body == "bad message"
        rid = c.receipt()
        c.conn.nack(m.headers["ack"], receipt=rid, requeue=False)
        c.wait_receipt(rid)
        assert c.message(0.5) is None, "requeue:False must not redeliver"
        deadline = time.monotonic() + 5
        got = (None, None, None)
        while got[0] is None and time.monotonic() < deadline:
            got = ch.basic_get(dlq, auto_ack=True)
        assert got[2] == b"bad message"
        assert got[1].headers["x-death"][0]["reason"] == "rejected"
    finally:
        conn.close()


def test_durable_python_true_keeps_messages_between_unsubscribe_and_resubscribe(
        broker, stomp_clients, uid):
    dest, sid = f"/topic/pyb.{uid}", f"dur-{uid}"
    hdrs = {"durable": True, "auto-delete": False}
    c = stomp_clients()
    c.subscribe(dest, sid, **hdrs)
    # RabbitMQ's name for the queue, durable and not auto-delete
    assert _queue_exists(broker, _rabbit_subscription_queue(f"pyb.{uid}", sid))
    rid = c.receipt()
    c.conn.unsubscribe(sid, headers={"receipt": rid})
    c.wait_receipt(rid)
    p = stomp_clients()
    p.send(dest, "between", persistent=True)
    c.subscribe(dest, sid, **hdrs)
    m = c.message()
    assert m is not None and m.body == "between"
    # UNSUBSCRIBE with durable:True deletes the queue
    rid = c.receipt()
    c.conn.unsubscribe(sid, headers={"receipt": rid, "durable": True})
    c.wait_receipt(rid)
    assert not _queue_exists(broker, _rabbit_subscription_queue(f"pyb.{uid}", sid))


def test_durable_same_id_on_two_topics_does_not_mix(broker, stomp_clients, uid):
    sid = f"same-{uid}"
    hdrs = {"durable": "true", "auto-delete": "false"}
    a, b, p = stomp_clients(), stomp_clients(), stomp_clients()
    a.subscribe(f"/topic/mixa.{uid}", sid, **hdrs)
    b.subscribe(f"/topic/mixb.{uid}", sid, **hdrs)
    p.send(f"/topic/mixa.{uid}", "for a")
    p.send(f"/topic/mixb.{uid}", "for b")
    assert [m.body for m in a.messages(2, timeout=1)] == ["for a"]
    assert [m.body for m in b.messages(2, timeout=1)] == ["for b"]
    # a second connection with the same id and topic shares a's queue
    a2 = stomp_clients()
    a2.subscribe(f"/topic/mixa.{uid}", sid, **hdrs)
    for i in range(4):
        p.send(f"/topic/mixa.{uid}", f"s{i}")
    got = a.messages(4, timeout=1) + a2.messages(4, timeout=1)
    assert sorted(m.body for m in got) == ["s0", "s1", "s2", "s3"]
    assert b.message(0.3) is None


def test_durable_subscribe_without_id_is_refused(stomp_clients, uid):
    c = stomp_clients()
    c.conn.send_frame("SUBSCRIBE", {"destination": f"/topic/noid.{uid}", "durable": "true",
                                    "auto-delete": "false", "receipt": "r"})
    err = c.error()
    assert err is not None, "a durable SUBSCRIBE without id must get an ERROR"
    assert err.headers["message"] == "Missing Header"
    assert "Header 'id' is required for durable subscriptions" in err.body
    assert c.listener.receipts.empty()


def test_non_boolean_durable_header_is_refused(broker, stomp_clients, uid):
    if getattr(broker, "external", False):
        pytest.skip("RabbitMQ answers durable:yes with 'Processing error'")
    c = stomp_clients()
    c.conn.send_frame("SUBSCRIBE", {"destination": f"/topic/yes.{uid}", "id": "s",
                                    "durable": "yes", "auto-delete": "false", "receipt": "r"})
    err = c.error()
    assert err is not None
    assert err.headers["message"] == "invalid durable header"
    assert "'yes'" in err.body


# --- issue 16, items 3-7 ----------------------------------------------------------------


def _raw_stomp(broker, timeout=5):
    """A plain socket to the STOMP port, for frames stomp.py cannot send (STOMP 1.0)."""
    import socket

    host, port = broker.host_port("stomp")
    s = socket.create_connection((host, int(port)), timeout=timeout)
    return s


def _read_frame(sock, timeout=5):
    """Reads one frame (up to its NUL) from a raw socket; skips heart-beat EOLs."""
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\0" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no frame within {timeout}s; got {buf!r}")
        sock.settimeout(left)
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed; got {buf!r}")
        buf += chunk
    head = buf.split(b"\0", 1)[0].lstrip(b"\r\n").split(b"\n\n", 1)[0].decode()
    lines = head.split("\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers.setdefault(k, v)
    return lines[0], headers


def test_connected_carries_heart_beat_also_for_stomp_1_0(broker):
    # STOMP 1.0 CONNECT (no accept-version): RabbitMQ answers heart-beat:0,0
    s = _raw_stomp(broker)
    try:
        vhost = "/" if getattr(broker, "external", False) else "localhost"
        s.sendall(f"CONNECT\nlogin:guest\npasscode:guest\nhost:{vhost}\n\n\0".encode())
        cmd, h = _read_frame(s)
        assert cmd == "CONNECTED"
        assert h.get("version") == "1.0"
        assert h.get("heart-beat") == "0,0"
    finally:
        s.close()


def test_connected_carries_heart_beat_when_none_is_agreed(broker):
    c = Stomp(broker, connect=False)
    try:
        # stomp.py sends heart-beat:0,0 by default
        frame = c.connect()
        assert frame.headers.get("heart-beat") == "0,0"
    finally:
        c.close()


@pytest.mark.parametrize("command", ["ACK", "NACK"])
def test_stomp_1_2_ack_with_message_id_but_no_id_is_error(stomp_clients, uid, command):
    c = stomp_clients()
    dest = f"/queue/q-{uid}"
    c.subscribe(dest, "s", ack="client-individual")
    c.send(dest, "m")
    m = c.message()
    assert m is not None
    c.conn.send_frame(command, {"message-id": m.headers["message-id"], "subscription": "s"})
    err = c.error()
    assert err is not None, f"a 1.2 {command} without 'id' must get an ERROR, not silence"
    assert err.headers["message"] == "Missing header"
    assert f'"{command}" must include the "id" header' in err.body


def test_receipts_for_sends_in_a_transaction_come_at_commit(stomp_clients, uid):
    dest = f"/queue/q-{uid}"
    c = stomp_clients()
    tx = c.conn.begin()
    sent = []
    for i in range(3):
        rid = c.receipt()
        sent.append(rid)
        c.conn.send(dest, f"m{i}", transaction=tx, headers={"receipt": rid},
                    persistent="true")
    # a receipt now would claim a message is stored that is only buffered
    with pytest.raises(AssertionError):
        c.wait_receipt(sent[0], timeout=0.5)
    assert c.listener.receipts.empty()
    crid = c.receipt()
    c.conn.commit(tx, headers={"receipt": crid})
    got = []
    deadline = time.monotonic() + 5
    while len(got) < 4 and time.monotonic() < deadline:
        try:
            got.append(c.listener.receipts.get(timeout=0.2).headers["receipt-id"])
        except Exception:
            pass
    assert sorted(got) == sorted(sent + [crid])
    # the three SENDs are stored once their receipts are out
    d = stomp_clients()
    d.subscribe(dest, "s")
    assert [m.body for m in d.messages(3, timeout=2)] == ["m0", "m1", "m2"]


def test_receipts_for_sends_in_an_aborted_transaction_never_come(stomp_clients, uid):
    dest = f"/queue/q-{uid}"
    c = stomp_clients()
    tx = c.conn.begin()
    srid = c.receipt()
    c.conn.send(dest, "gone", transaction=tx, headers={"receipt": srid})
    arid = c.receipt()
    c.conn.abort(tx, headers={"receipt": arid})
    c.wait_receipt(arid)
    c.send(dest, "sync")  # a later receipt: anything owed would have come before it
    seen = []
    while not c.listener.receipts.empty():
        seen.append(c.listener.receipts.get().headers["receipt-id"])
    assert srid not in seen


def test_queue_arguments_on_send_declare_the_queue_like_amqp(broker, stomp_clients, uid):
    q = f"qa-{uid}"
    c = stomp_clients()
    c.send(f"/queue/{q}", "m", **{"x-max-length": "5", "x-message-ttl": "60000",
                                  "x-dead-letter-exchange": "dlx-" + uid,
                                  "x-queue-type": "classic"})
    conn = pika_connect(broker)
    try:
        ch = conn.channel()
        # the same arguments: declare-ok (pika sends ints as signed 32-bit)
        ok = ch.queue_declare(q, durable=True, arguments={
            "x-max-length": 5, "x-message-ttl": 60000,
            "x-dead-letter-exchange": "dlx-" + uid, "x-queue-type": "classic"})
        assert ok.method.message_count == 1
        # a different one: 406 PRECONDITION_FAILED, as RabbitMQ
        import pika.exceptions

        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            conn.channel().queue_declare(q, durable=True, arguments={
                "x-max-length": 6, "x-message-ttl": 60000,
                "x-dead-letter-exchange": "dlx-" + uid, "x-queue-type": "classic"})
        assert e.value.reply_code == 406
        assert "x-max-length" in e.value.reply_text
    finally:
        conn.close()


def test_queue_arguments_on_subscribe_declare_the_queue(broker, stomp_clients, uid):
    q = f"qs-{uid}"
    c = stomp_clients()
    c.subscribe(f"/queue/{q}", "s", ack="client-individual",
                **{"x-max-length": " 2 ", "x-max-priority": "5", "prefetch-count": "1"})
    conn = pika_connect(broker)
    try:
        ch = conn.channel()
        ok = ch.queue_declare(q, durable=True, arguments={
            "x-max-length": 2, "x-max-priority": 5})
        assert ok.method.consumer_count == 1
    finally:
        conn.close()


def test_x_overflow_header_declares_the_queue(broker, stomp_clients, uid):
    if getattr(broker, "external", False):
        pytest.skip("the RabbitMQ 3.10 peer's STOMP plugin does not read x-overflow")
    q = f"qo-{uid}"
    c = stomp_clients()
    c.subscribe(f"/queue/{q}", "s", **{"x-max-length": "1", "x-overflow": "reject-publish"})
    conn = pika_connect(broker)
    try:
        ok = conn.channel().queue_declare(q, durable=True, arguments={
            "x-max-length": 1, "x-overflow": "reject-publish"})
        assert ok.method.consumer_count == 1
    finally:
        conn.close()


def test_queue_arguments_that_differ_from_the_queue_are_refused(stomp_clients, uid):
    q = f"qd-{uid}"
    a = stomp_clients()
    a.send(f"/queue/{q}", "m", **{"x-max-length": "5"})
    b = stomp_clients()
    b.conn.send(f"/queue/{q}", "m", headers={"x-max-length": "6", "receipt": "r"})
    err = b.error()
    assert err is not None
    assert err.headers["message"] == "precondition_failed"
    assert "x-max-length" in err.body


def test_queue_argument_that_does_not_parse_names_the_header(broker, stomp_clients, uid):
    if getattr(broker, "external", False):
        pytest.skip("RabbitMQ answers a bad x-message-ttl with 'Processing error'")
    c = stomp_clients()
    c.conn.send(f"/queue/qb-{uid}", "m", headers={"x-message-ttl": "soon", "receipt": "r"})
    err = c.error()
    assert err is not None
    assert err.headers["message"] == "invalid x-message-ttl header"
    assert "'soon'" in err.body


def test_queue_type_core_does_not_implement_is_refused(broker, stomp_clients, uid):
    if getattr(broker, "external", False):
        pytest.skip("RabbitMQ has quorum queues")
    c = stomp_clients()
    c.conn.subscribe(f"/queue/qq-{uid}", "s", headers={"x-queue-type": "quorum",
                                                       "receipt": "r"})
    err = c.error()
    assert err is not None
    assert err.headers["message"] == "precondition_failed"
    assert "x-queue-type" in err.body


def test_16_mib_send_to_a_topic_with_two_subscribers(stomp_clients, uid):
    dest = f"/topic/big.{uid}"
    a, b, p = stomp_clients(auto_decode=False), stomp_clients(auto_decode=False), stomp_clients()
    a.subscribe(dest, "a")
    b.subscribe(dest, "b")
    body = b"\x01" * (16 << 20)
    p.send(dest, body, wait=True)
    for c in (a, b):
        m = c.message(30)
        assert m is not None and len(m.body) == len(body) and m.body == body


def test_message_over_max_message_size_is_error(configured_broker, uid):
    broker = configured_broker('[limits]\nmax_message_size = "1 MiB"\n')
    c = Stomp(broker)
    try:
        c.conn.send(f"/queue/q-{uid}", "x" * ((1 << 20) + 1), headers={"receipt": "r"})
        err = c.error(10)
        assert err is not None, "a SEND over limits.max_message_size must get an ERROR"
        assert err.headers["message"] == "precondition_failed"
        assert "larger than configured max size 1048576" in err.body
        assert c.listener.receipts.empty()
        # exactly the limit is fine
        d = Stomp(broker)
        try:
            d.send(f"/queue/q-{uid}", "y" * (1 << 20))
        finally:
            d.close()
    finally:
        c.close()


def test_max_message_size_applies_to_every_protocol(configured_broker, uid):
    """One key, limits.max_message_size, for AMQP bodies, STOMP frames and MQTT packets,
    each refused with its protocol's own error (RabbitMQ's for AMQP: channel 406)."""
    import pika.exceptions

    from helpers import Mqtt

    limit = 1 << 20
    broker = configured_broker('[store]\nsegment_size = "4 MiB"\n'
                               '[limits]\nmax_message_size = "1 MiB"\n')
    q = f"mms-{uid}"
    conn = pika_connect(broker)
    try:
        ch = conn.channel()
        ch.queue_declare(q)
        ch.basic_publish("", q, b"a" * limit)  # exactly the limit
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.basic_publish("", q, b"a" * (limit + 1))
            ch.queue_declare(q, passive=True)  # a round trip: the close comes first
        assert e.value.reply_code == 406
        assert f"larger than configured max size {limit}" in e.value.reply_text
        assert conn.channel().queue_declare(q, passive=True).method.message_count == 1
    finally:
        conn.close()
    # MQTT: a payload within the limit arrives; a packet past it closes the connection
    sub = Mqtt(broker)
    pub = Mqtt(broker)
    try:
        sub.subscribe(f"mms/{uid}", qos=1)
        pub.publish(f"mms/{uid}", b"m" * limit, qos=1)
        m = sub.message(10)
        assert m is not None and len(m.payload) == limit
        pub.c.publish(f"mms/{uid}", b"m" * (limit + (64 << 10) + 1), qos=1)
        rc = pub.disconnects.get(timeout=10)
        assert rc is not None, "an MQTT packet over the limit must close the connection"
    finally:
        sub.close()
        pub.close()

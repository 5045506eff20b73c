"""Replies from STOMP to an AMQP requester's direct reply-to (issue 16 leftover), as
RabbitMQ's STOMP plugin does them: the request's MESSAGE carries
`reply-to:/reply-queue/amq.rabbitmq.reply-to.<name>`, and a SEND to that destination or
to `/amq/queue/<name>` reaches the requester's channel (checked against RabbitMQ 3.x with
`CONFORMANCE_EXTERNAL`); Triad also takes `/queue/<name>` without declaring anything."""

import pika
import pytest

from helpers import Stomp, pika_connect


@pytest.mark.parametrize("form", ["header", "/queue/", "/amq/queue/"])
def test_stomp_replies_to_an_amqp_direct_reply_to_requester(broker, uid, form):
    if form == "/queue/" and getattr(broker, "external", False):
        pytest.skip("RabbitMQ 3.x: a SEND to /queue/amq.rabbitmq.reply-to.… reached the "
                    "requester once by hand, but in this test got neither RECEIPT nor reply")
    conn = pika_connect(broker)
    ch = conn.channel()
    service = f"rpc-{uid}"
    ch.queue_declare(service, durable=True)
    replies = []
    ch.basic_consume("amq.rabbitmq.reply-to", lambda c, m, p, b: replies.append((p, b)),
                     auto_ack=True)
    ch.basic_publish("", service, b"ping", pika.BasicProperties(
        reply_to="amq.rabbitmq.reply-to", correlation_id="c-1"))
    s = Stomp(broker)
    try:
        s.subscribe(f"/amq/queue/{service}", "svc")
        req = s.message()
        assert req is not None and req.body == "ping"
        reply_to = req.headers["reply-to"]
        assert reply_to.startswith("/reply-queue/amq.rabbitmq.reply-to."), reply_to
        name = reply_to[len("/reply-queue/"):]
        dest = reply_to if form == "header" else form + name
        s.send(dest, "pong", **{"correlation-id": req.headers["correlation-id"]})
        deadline = 50
        while not replies and deadline:
            conn.process_data_events(time_limit=0.1)
            deadline -= 1
        assert [b for _, b in replies] == [b"pong"]
        assert replies[0][0].correlation_id == "c-1"
    finally:
        s.close()
        conn.close()


def test_amqp_reply_to_queue_name_is_a_reply_queue_destination_in_stomp(broker, uid):
    conn = pika_connect(broker)
    ch = conn.channel()
    service, answers = f"svc2-{uid}", f"answers-{uid}"
    ch.queue_declare(service, durable=True)
    ch.queue_declare(answers, durable=True)
    ch.basic_publish("", service, b"q", pika.BasicProperties(reply_to=answers))
    s = Stomp(broker)
    try:
        s.subscribe(f"/amq/queue/{service}", "svc")
        req = s.message()
        assert req is not None
        assert req.headers["reply-to"] == f"/reply-queue/{answers}"
        s.send(req.headers["reply-to"], "a")
        method, _, body = ch.basic_get(answers, auto_ack=True)
        assert method is not None and body == b"a"
    finally:
        s.close()
        conn.close()

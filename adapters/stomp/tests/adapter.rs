#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
//! The whole adapter over real loopback sockets: `serve` on a TcpListener, a broker on
//! a temp-dir store, and a raw STOMP client.

mod common;

use std::time::Duration;

use common::{body, start, start_with, Client};
use triad_core::testing::eventually;
use triad_stomp::{Command, Frame};

#[tokio::test]
async fn connect_negotiates_the_highest_common_version() {
    let s = start().await;
    for (offer, want) in [
        (Some("1.0,1.1,1.2"), "1.2"),
        (Some("1.1,1.0"), "1.1"),
        (Some("1.0"), "1.0"),
        (None, "1.0"),
    ] {
        let mut c = Client::open(s.addr).await;
        let mut f = Frame::new(Command::Connect).with("host", "localhost");
        if let Some(o) = offer {
            f.push("accept-version", o);
        }
        c.send(f).await;
        let r = c.expect(Command::Connected).await;
        assert_eq!(r.header("version"), Some(want));
        assert!(r.header("server").unwrap().starts_with("Triad/"));
        assert!(r.header("session").is_some());
        c.disconnect().await;
    }
    // STOMP command works as CONNECT
    let mut c = Client::open(s.addr).await;
    c.send(
        Frame::new(Command::Stomp)
            .with("accept-version", "1.2")
            .with("host", "/"),
    )
    .await;
    c.expect(Command::Connected).await;
    // no common version
    let mut c = Client::open(s.addr).await;
    c.send(Frame::new(Command::Connect).with("accept-version", "2.0"))
        .await;
    let e = c.expect_error().await;
    assert!(e.header("message").unwrap().contains("1.0,1.1,1.2"));
}

#[tokio::test]
async fn bad_login_gets_an_error_then_close() {
    let s = start().await;
    let mut c = Client::open(s.addr).await;
    c.send(
        Frame::new(Command::Connect)
            .with("accept-version", "1.2")
            .with("login", "guest")
            .with("passcode", "wrong"),
    )
    .await;
    let e = c.expect_error().await;
    assert!(body(&e).contains("Access refused"), "{e:?}");
    // explicit good login works
    let c = Client::connect_with(
        s.addr,
        &[
            ("accept-version", "1.2"),
            ("login", "guest"),
            ("passcode", "guest"),
        ],
    )
    .await;
    c.disconnect().await;
    // frames before CONNECT are refused
    let mut c = Client::open(s.addr).await;
    c.send(Frame::new(Command::Send).with("destination", "/queue/x"))
        .await;
    c.expect_error().await;
}

#[tokio::test]
async fn send_and_subscribe_on_a_queue_carry_headers() {
    let s = start().await;
    let mut sub = Client::connect(s.addr).await;
    sub.subscribe("s1", "/queue/orders", &[]).await;
    let mut publ = Client::connect(s.addr).await;
    publ.publish(
        "/queue/orders",
        "hello",
        &[
            ("content-type", "text/plain"),
            ("x-colour", "blue:green"),
            ("correlation-id", "c-1"),
            ("persistent", "true"),
            ("message-id", "app-1"),
        ],
    )
    .await;
    let m = sub.expect(Command::Message).await;
    assert_eq!(body(&m), "hello");
    assert_eq!(m.header("subscription"), Some("s1"));
    assert_eq!(m.header("destination"), Some("/queue/orders"));
    assert_eq!(m.header("content-type"), Some("text/plain"));
    assert_eq!(m.header("x-colour"), Some("blue:green"));
    assert_eq!(m.header("correlation-id"), Some("c-1"));
    assert_eq!(m.header("persistent"), Some("true"));
    assert_eq!(m.header("amqp-message-id"), Some("app-1"));
    assert_eq!(m.header("redelivered"), Some("false"));
    assert_eq!(m.header("content-length"), Some("5"));
    assert!(m.header("message-id").is_some());
    // auto ack: no ack header
    assert_eq!(m.header("ack"), None);
    // the queue was declared durable
    let q = s.broker.vhost("/").unwrap().queue("orders").unwrap();
    assert!(q.durable());
    // a body with NULs survives
    publ.send(
        Frame::new(Command::Send)
            .with("destination", "/queue/orders")
            .with_body(&b"a\0b"[..]),
    )
    .await;
    let m = sub.expect(Command::Message).await;
    assert_eq!(&m.body[..], b"a\0b");
}

#[tokio::test]
async fn topics_fan_out_by_pattern() {
    let s = start().await;
    let mut a = Client::connect(s.addr).await;
    a.subscribe("a", "/topic/stocks.*", &[]).await;
    let mut b = Client::connect(s.addr).await;
    b.subscribe("b", "/topic/stocks.#", &[]).await;
    let mut p = Client::connect(s.addr).await;
    p.publish("/topic/stocks.nyse", "one", &[]).await;
    p.publish("/topic/stocks.nyse.ibm", "two", &[]).await;
    p.publish("/topic/bonds", "three", &[]).await;
    let m = a.expect(Command::Message).await;
    assert_eq!(body(&m), "one");
    assert_eq!(m.header("destination"), Some("/topic/stocks.nyse"));
    a.expect_nothing(200).await;
    assert_eq!(body(&b.expect(Command::Message).await), "one");
    assert_eq!(body(&b.expect(Command::Message).await), "two");
    b.expect_nothing(100).await;
    // exchange destinations
    let mut f = Client::connect(s.addr).await;
    f.subscribe("f", "/exchange/amq.fanout", &[]).await;
    p.publish("/exchange/amq.fanout/any", "fan", &[]).await;
    let m = f.expect(Command::Message).await;
    assert_eq!(body(&m), "fan");
    assert_eq!(m.header("destination"), Some("/exchange/amq.fanout/any"));
    // the private topic queue goes with its connection
    let before = s.broker.vhost("/").unwrap().queue_names().len();
    a.disconnect().await;
    eventually(
        "the private topic queue to go",
        Duration::from_secs(10),
        || s.broker.vhost("/").unwrap().queue_names().len() == before - 1,
    )
    .await;
}

#[tokio::test]
async fn durable_topic_subscription_survives_reconnect() {
    let s = start().await;
    let durable = [("durable", "true"), ("auto-delete", "false")];
    let mut c = Client::connect(s.addr).await;
    c.subscribe("news", "/topic/news.#", &durable).await;
    c.disconnect().await;
    let mut p = Client::connect(s.addr).await;
    p.publish("/topic/news.world", "while away", &[("persistent", "true")])
        .await;
    let mut c = Client::connect(s.addr).await;
    c.subscribe("news", "/topic/news.#", &durable).await;
    let m = c.expect(Command::Message).await;
    assert_eq!(body(&m), "while away");
    // UNSUBSCRIBE with durable:true deletes it
    c.send(
        Frame::new(Command::Unsubscribe)
            .with("id", "news")
            .with("durable", "true")
            .with("receipt", "u"),
    )
    .await;
    c.expect(Command::Receipt).await;
    assert!(s
        .broker
        .vhost("/")
        .unwrap()
        .queue(&triad_stomp::queue_name::durable_subscription(
            "news.#", "news"
        ))
        .is_none());
}

/// stomp.py writes Python's `True` / `False`: they count, in any case.
#[tokio::test]
async fn boolean_headers_are_read_in_any_case() {
    let s = start().await;
    let vh = s.broker.vhost("/").unwrap();
    let durable = [("durable", "True"), ("auto-delete", "False")];
    let mut c = Client::connect(s.addr).await;
    c.subscribe("d", "/topic/cased", &durable).await;
    let name = triad_stomp::queue_name::durable_subscription("cased", "d");
    let q = vh.queue(&name).expect("a durable subscription queue");
    assert!(q.durable() && !q.auto_delete());
    c.disconnect().await;
    // messages sent while away wait in it
    let mut p = Client::connect(s.addr).await;
    p.publish("/topic/cased", "kept", &[("persistent", "TRUE")])
        .await;
    let mut c = Client::connect(s.addr).await;
    c.subscribe("d", "/topic/cased", &durable).await;
    assert_eq!(body(&c.expect(Command::Message).await), "kept");
    // UNSUBSCRIBE with durable:True deletes it
    c.send(
        Frame::new(Command::Unsubscribe)
            .with("id", "d")
            .with("durable", "True")
            .with("receipt", "u"),
    )
    .await;
    c.expect(Command::Receipt).await;
    assert!(vh.queue(&name).is_none());

    // NACK with requeue:False drops the message
    c.subscribe("n", "/queue/cased-nack", &[("ack", "client-individual")])
        .await;
    c.publish("/queue/cased-nack", "drop me", &[]).await;
    let m = c.expect(Command::Message).await;
    c.send(
        Frame::new(Command::Nack)
            .with("id", m.header("ack").unwrap())
            .with("requeue", "False")
            .with("receipt", "n"),
    )
    .await;
    c.expect(Command::Receipt).await;
    let q = vh.queue("cased-nack").unwrap();
    eventually(
        "the nacked message to be dropped",
        Duration::from_secs(5),
        || q.message_count() == 0 && q.unacked_count() == 0,
    )
    .await;

    // exclusive:True makes an exclusive consumer: a second one is refused
    c.subscribe("x", "/queue/cased-x", &[("exclusive", "True")])
        .await;
    let mut other = Client::connect(s.addr).await;
    other
        .send(
            Frame::new(Command::Subscribe)
                .with("id", "x")
                .with("destination", "/queue/cased-x"),
        )
        .await;
    other.expect_error().await;
}

/// A boolean header that is neither true nor false, in any case, is refused with an
/// ERROR naming it, not read as its default.
#[tokio::test]
async fn non_boolean_values_are_refused_naming_the_header() {
    let s = start().await;
    let sub = |extra: &[(&'static str, &'static str)]| {
        let mut f = Frame::new(Command::Subscribe)
            .with("id", "b")
            .with("destination", "/topic/bools")
            .with("receipt", "r");
        for (k, v) in extra {
            f.push(*k, *v);
        }
        f
    };
    let send = |h: &'static str, v: &'static str| {
        Frame::new(Command::Send)
            .with("destination", "/queue/bools")
            .with(h, v)
            .with("receipt", "r")
    };
    for (frame, header) in [
        (sub(&[("durable", "yes")]), "durable"),
        (sub(&[("persistent", "1")]), "persistent"),
        (
            sub(&[("durable", "true"), ("auto-delete", "no")]),
            "auto-delete",
        ),
        (sub(&[("exclusive", "y")]), "exclusive"),
        (send("persistent", "yes"), "persistent"),
    ] {
        let mut c = Client::connect(s.addr).await;
        c.send(frame).await;
        let e = c.expect_error().await;
        assert_eq!(
            e.header("message"),
            Some(format!("invalid {header} header").as_str()),
            "{e:?}"
        );
        assert_eq!(e.header("receipt-id"), Some("r"));
        c.expect_closed().await;
    }
    // NACK requeue:maybe, also inside a transaction, is refused before anything moves
    for tx in [false, true] {
        let mut c = Client::connect(s.addr).await;
        c.subscribe("n", "/queue/bools-nack", &[("ack", "client-individual")])
            .await;
        c.publish("/queue/bools-nack", "m", &[]).await;
        let m = c.expect(Command::Message).await;
        if tx {
            c.send(Frame::new(Command::Begin).with("transaction", "t"))
                .await;
        }
        let mut nack = Frame::new(Command::Nack)
            .with("id", m.header("ack").unwrap())
            .with("requeue", "maybe");
        if tx {
            nack.push("transaction", "t");
        }
        c.send(nack).await;
        let e = c.expect_error().await;
        assert_eq!(e.header("message"), Some("invalid requeue header"));
        c.expect_closed().await;
        // the connection is gone: the message is back for the next subscriber
        let q = s.broker.vhost("/").unwrap().queue("bools-nack").unwrap();
        eventually("the message to be back", Duration::from_secs(5), || {
            q.unacked_count() == 0 && q.message_count() == 1
        })
        .await;
        let mut d = Client::connect(s.addr).await;
        d.subscribe("n", "/queue/bools-nack", &[]).await;
        d.expect(Command::Message).await;
        d.disconnect().await;
    }
}

/// RabbitMQ's queue per (destination, id): the same id on two topics does not mix, the
/// same id on the same topic shares one queue between connections.
#[tokio::test]
async fn durable_subscriptions_are_per_destination_and_id() {
    let s = start().await;
    let vh = s.broker.vhost("/").unwrap();
    let durable = [("durable", "true"), ("auto-delete", "false")];
    let mut a = Client::connect(s.addr).await;
    a.subscribe("same", "/topic/mix.a", &durable).await;
    let mut b = Client::connect(s.addr).await;
    b.subscribe("same", "/topic/mix.b", &durable).await;
    let qa = triad_stomp::queue_name::durable_subscription("mix.a", "same");
    let qb = triad_stomp::queue_name::durable_subscription("mix.b", "same");
    assert_ne!(qa, qb);
    assert!(vh.queue(&qa).is_some() && vh.queue(&qb).is_some());
    let mut p = Client::connect(s.addr).await;
    p.publish("/topic/mix.a", "for a", &[]).await;
    p.publish("/topic/mix.b", "for b", &[]).await;
    let m = a.expect(Command::Message).await;
    assert_eq!(
        (body(&m), m.header("destination")),
        ("for a".into(), Some("/topic/mix.a"))
    );
    let m = b.expect(Command::Message).await;
    assert_eq!(
        (body(&m), m.header("destination")),
        ("for b".into(), Some("/topic/mix.b"))
    );
    // a third connection on the same id and topic as `a` shares a's queue: each
    // message goes to one of them
    let mut a2 = Client::connect(s.addr).await;
    a2.subscribe("same", "/topic/mix.a", &durable).await;
    assert_eq!(vh.queue(&qa).unwrap().consumer_count(), 2);
    for i in 0..4 {
        p.publish("/topic/mix.a", &format!("s{i}"), &[]).await;
    }
    // however the core spreads them, the two get the four between them, each once
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while got.len() < 4 && tokio::time::Instant::now() < deadline {
        for c in [&mut a, &mut a2] {
            if let Ok(Some(m)) = c.recv_within(Duration::from_millis(20)).await {
                assert_eq!(m.command, Command::Message);
                got.push(body(&m));
            }
        }
    }
    got.sort();
    assert_eq!(got, ["s0", "s1", "s2", "s3"]);
    // and b saw none of them
    b.send(Frame::new(Command::Disconnect).with("receipt", "bye"))
        .await;
    assert_eq!(
        b.expect(Command::Receipt).await.header("receipt-id"),
        Some("bye")
    );
    assert_eq!(vh.queue(&qb).unwrap().message_count(), 0);
}

/// RabbitMQ refuses a durable SUBSCRIBE (or UNSUBSCRIBE) without `id`: the id names
/// the queue. STOMP 1.0, where the id may otherwise default to the destination,
/// included.
#[tokio::test]
async fn durable_subscribe_without_id_is_missing_header() {
    let s = start().await;
    for (version, durable) in [
        ("1.2", ("durable", "true")),
        ("1.2", ("persistent", "True")),
        ("1.0", ("durable", "TRUE")),
    ] {
        let mut c = Client::connect_with(s.addr, &[("accept-version", version)]).await;
        c.send(
            Frame::new(Command::Subscribe)
                .with("destination", "/topic/noid")
                .with(durable.0, durable.1)
                .with("auto-delete", "false")
                .with("receipt", "r"),
        )
        .await;
        let e = c.expect_error().await;
        assert_eq!(e.header("message"), Some("Missing Header"), "{e:?}");
        assert_eq!(
            body(&e).trim_end(),
            "Header 'id' is required for durable subscriptions"
        );
        c.expect_closed().await;
    }
    let mut c = Client::connect(s.addr).await;
    c.send(
        Frame::new(Command::Unsubscribe)
            .with("destination", "/topic/noid")
            .with("durable", "true"),
    )
    .await;
    assert_eq!(
        c.expect_error().await.header("message"),
        Some("Missing Header")
    );
    // nothing was declared
    assert!(s
        .broker
        .vhost("/")
        .unwrap()
        .queue_names()
        .iter()
        .all(|q| !q.starts_with(triad_stomp::queue_name::PREFIX)));
}

/// A durable subscription made before the RabbitMQ naming (queue
/// `stomp-subscription-<id>`) is still found for the same id and topic, with the
/// messages it kept; another topic under the same id gets its own queue.
#[tokio::test]
async fn legacy_durable_subscription_queue_is_still_used() {
    let s = start().await;
    let vh = s.broker.vhost("/").unwrap();
    let legacy = "stomp-subscription-old";
    let mut c = Client::connect(s.addr).await;
    // what an older Triad made: x-queue-name gives the same queue and binding
    c.subscribe(
        "old",
        "/topic/legacy.t",
        &[
            ("durable", "true"),
            ("auto-delete", "false"),
            ("x-queue-name", legacy),
        ],
    )
    .await;
    c.disconnect().await;
    let mut p = Client::connect(s.addr).await;
    p.publish("/topic/legacy.t", "kept", &[("persistent", "true")])
        .await;
    let durable = [("durable", "true"), ("auto-delete", "false")];
    let mut c = Client::connect(s.addr).await;
    c.subscribe("old", "/topic/legacy.t", &durable).await;
    assert_eq!(body(&c.expect(Command::Message).await), "kept");
    assert!(vh
        .queue(&triad_stomp::queue_name::durable_subscription(
            "legacy.t", "old"
        ))
        .is_none());
    assert_eq!(vh.queue(legacy).unwrap().consumer_count(), 1);
    // the same id on another topic does not join the legacy queue
    let mut d = Client::connect(s.addr).await;
    d.subscribe("old", "/topic/legacy.other", &durable).await;
    assert!(vh
        .queue(&triad_stomp::queue_name::durable_subscription(
            "legacy.other",
            "old"
        ))
        .is_some());
    assert_eq!(vh.queue(legacy).unwrap().consumer_count(), 1);
    // UNSUBSCRIBE durable deletes the queue the subscription used
    c.send(
        Frame::new(Command::Unsubscribe)
            .with("id", "old")
            .with("durable", "true")
            .with("receipt", "u"),
    )
    .await;
    c.expect(Command::Receipt).await;
    assert!(vh.queue(legacy).is_none());
}

async fn three_messages(s: &common::Server, q: &str) {
    let mut p = Client::connect(s.addr).await;
    for b in ["m1", "m2", "m3"] {
        p.publish(q, b, &[]).await;
    }
}

#[tokio::test]
async fn client_ack_is_cumulative() {
    let s = start().await;
    three_messages(&s, "/queue/cum").await;
    let mut c = Client::connect(s.addr).await;
    c.subscribe("0", "/queue/cum", &[("ack", "client")]).await;
    let ms: Vec<Frame> = [
        c.expect(Command::Message).await,
        c.expect(Command::Message).await,
        c.expect(Command::Message).await,
    ]
    .into();
    assert!(ms.iter().all(|m| m.header("ack").is_some()));
    // acking m2 acks m1 too
    c.send(
        Frame::new(Command::Ack)
            .with("id", ms[1].header("ack").unwrap())
            .with("receipt", "a"),
    )
    .await;
    c.expect(Command::Receipt).await;
    c.disconnect().await;
    let mut c = Client::connect(s.addr).await;
    c.subscribe("0", "/queue/cum", &[("ack", "client")]).await;
    let m = c.expect(Command::Message).await;
    assert_eq!(body(&m), "m3");
    assert_eq!(m.header("redelivered"), Some("true"));
    c.expect_nothing(200).await;
}

#[tokio::test]
async fn client_individual_ack_acks_one() {
    let s = start().await;
    three_messages(&s, "/queue/ind").await;
    let mut c = Client::connect(s.addr).await;
    c.subscribe("0", "/queue/ind", &[("ack", "client-individual")])
        .await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(
            c.expect(Command::Message)
                .await
                .header("ack")
                .unwrap()
                .to_string(),
        );
    }
    c.send(
        Frame::new(Command::Ack)
            .with("id", ids[1].as_str())
            .with("receipt", "a"),
    )
    .await;
    c.expect(Command::Receipt).await;
    // an unknown id is an error
    drop(c);
    eventually(
        "the unacked message to go back",
        Duration::from_secs(10),
        || {
            s.broker
                .vhost("/")
                .unwrap()
                .queue("ind")
                .unwrap()
                .unacked_count()
                == 0
        },
    )
    .await;
    let mut c = Client::connect(s.addr).await;
    c.subscribe("0", "/queue/ind", &[("ack", "client-individual")])
        .await;
    let got: Vec<String> = vec![
        body(&c.expect(Command::Message).await),
        body(&c.expect(Command::Message).await),
    ];
    assert_eq!(got, vec!["m1", "m3"]);
    c.send(Frame::new(Command::Ack).with("id", "nope")).await;
    c.expect_error().await;
}

#[tokio::test]
async fn stomp_1_1_acks_by_message_id() {
    let s = start().await;
    three_messages(&s, "/queue/v11").await;
    let mut c = Client::connect_with(s.addr, &[("accept-version", "1.1")]).await;
    c.subscribe("0", "/queue/v11", &[("ack", "client-individual")])
        .await;
    for _ in 0..3 {
        let m = c.expect(Command::Message).await;
        assert_eq!(m.header("ack"), None);
        c.send(
            Frame::new(Command::Ack)
                .with("message-id", m.header("message-id").unwrap())
                .with("subscription", "0"),
        )
        .await;
    }
    c.disconnect().await;
    assert_eq!(
        s.broker
            .vhost("/")
            .unwrap()
            .queue("v11")
            .unwrap()
            .message_count(),
        0
    );
}

#[tokio::test]
async fn nack_requeues_and_redelivers() {
    let s = start().await;
    let mut c = Client::connect(s.addr).await;
    c.subscribe("0", "/queue/nk", &[("ack", "client-individual")])
        .await;
    c.publish("/queue/nk", "again", &[]).await;
    let m = c.expect(Command::Message).await;
    assert_eq!(m.header("redelivered"), Some("false"));
    c.send(Frame::new(Command::Nack).with("id", m.header("ack").unwrap()))
        .await;
    let m2 = c.expect(Command::Message).await;
    assert_eq!(body(&m2), "again");
    assert_eq!(m2.header("redelivered"), Some("true"));
    // requeue:false drops it
    c.send(
        Frame::new(Command::Nack)
            .with("id", m2.header("ack").unwrap())
            .with("requeue", "false"),
    )
    .await;
    c.expect_nothing(200).await;
}

#[tokio::test]
async fn transactions_apply_at_commit_only() {
    let s = start().await;
    let mut sub = Client::connect(s.addr).await;
    sub.subscribe("0", "/queue/tx", &[("ack", "client-individual")])
        .await;
    let mut p = Client::connect(s.addr).await;
    p.send(Frame::new(Command::Begin).with("transaction", "t1"))
        .await;
    for b in ["a", "b"] {
        p.send(
            Frame::new(Command::Send)
                .with("destination", "/queue/tx")
                .with("transaction", "t1")
                .with_body(b),
        )
        .await;
    }
    sub.expect_nothing(200).await;
    p.send(
        Frame::new(Command::Commit)
            .with("transaction", "t1")
            .with("receipt", "c"),
    )
    .await;
    p.expect(Command::Receipt).await;
    let a = sub.expect(Command::Message).await;
    let b = sub.expect(Command::Message).await;
    assert_eq!((body(&a), body(&b)), ("a".into(), "b".into()));
    // aborted sends never arrive
    p.send(Frame::new(Command::Begin).with("transaction", "t2"))
        .await;
    p.send(
        Frame::new(Command::Send)
            .with("destination", "/queue/tx")
            .with("transaction", "t2")
            .with_body("never"),
    )
    .await;
    p.send(
        Frame::new(Command::Abort)
            .with("transaction", "t2")
            .with("receipt", "ab"),
    )
    .await;
    p.expect(Command::Receipt).await;
    sub.expect_nothing(200).await;
    // a transactional ACK takes effect at COMMIT; uncommitted at disconnect: none
    sub.send(Frame::new(Command::Begin).with("transaction", "ta"))
        .await;
    sub.send(
        Frame::new(Command::Ack)
            .with("id", a.header("ack").unwrap())
            .with("transaction", "ta"),
    )
    .await;
    sub.send(Frame::new(Command::Begin).with("transaction", "tb"))
        .await;
    sub.send(
        Frame::new(Command::Ack)
            .with("id", b.header("ack").unwrap())
            .with("transaction", "tb"),
    )
    .await;
    sub.send(
        Frame::new(Command::Commit)
            .with("transaction", "ta")
            .with("receipt", "x"),
    )
    .await;
    sub.expect(Command::Receipt).await;
    sub.disconnect().await;
    let mut sub = Client::connect(s.addr).await;
    sub.subscribe("0", "/queue/tx", &[]).await;
    assert_eq!(body(&sub.expect(Command::Message).await), "b");
    sub.expect_nothing(200).await;
    // unknown transaction
    p.send(Frame::new(Command::Commit).with("transaction", "zzz"))
        .await;
    p.expect_error().await;
}

#[tokio::test]
async fn persistent_send_receipt_means_durable() {
    let dir = tempfile::tempdir().unwrap();
    let broker = common::open_broker(dir.path());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let ctx = triad_stomp::StompContext::new(broker.clone(), shutdown.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (sock, peer) = listener.accept().await.unwrap();
        triad_stomp::serve(sock, peer, ctx).await
    });
    let mut c = Client::connect(addr).await;
    c.publish("/queue/dur", "kept", &[("persistent", "true")])
        .await;
    c.disconnect().await;
    server.await.unwrap().unwrap();
    drop(broker);
    // reopen from the same directory: the message that got its RECEIPT is there
    let broker = common::open_broker(dir.path());
    let q = broker.vhost("/").unwrap().queue("dur").unwrap();
    assert_eq!(q.message_count(), 1);
}

#[tokio::test]
async fn heartbeats_are_sent_and_silent_peers_closed() {
    let s = start_with(|c| {
        c.heartbeat_send = Duration::from_millis(100);
        c.heartbeat_recv = Duration::from_millis(100);
    })
    .await;
    let mut c = Client::open(s.addr).await;
    c.send(
        Frame::new(Command::Connect)
            .with("accept-version", "1.2")
            .with("heart-beat", "100,100"),
    )
    .await;
    let r = c.expect(Command::Connected).await;
    assert_eq!(r.header("heart-beat"), Some("100,100"));
    // a client that sends heart-beats stays connected: nothing but heart-beats comes
    // (no ERROR, no close) in the 80 ms between the client's own
    for _ in 0..5 {
        c.expect_nothing(80).await;
        c.send_raw(b"\n").await;
    }
    c.expect_nothing(50).await;
    assert!(c.heartbeats >= 2, "got {} heart-beats", c.heartbeats);
    // then falls silent: closed within a few intervals
    let t = std::time::Instant::now();
    c.expect_closed().await;
    assert!(t.elapsed() < Duration::from_secs(2));
    // no heart-beat asked for: none sent, never closed for silence
    let mut c =
        Client::connect_with(s.addr, &[("accept-version", "1.2"), ("heart-beat", "0,0")]).await;
    c.expect_nothing(400).await;
    assert_eq!(c.heartbeats, 0);
}

#[tokio::test]
async fn malformed_frame_errors_and_closes_only_that_connection() {
    let s = start().await;
    let mut good = Client::connect(s.addr).await;
    good.subscribe("0", "/queue/ok", &[]).await;
    let mut bad = Client::connect(s.addr).await;
    bad.send_raw(b"SEND\ndestination:/queue/ok\nbad\\qescape:1\n\nx\0")
        .await;
    let e = bad.expect_error().await;
    assert_eq!(e.header("message"), Some("malformed frame received"));
    let mut bad = Client::connect(s.addr).await;
    bad.send_raw(b"FROB\n\n\0").await;
    bad.expect_error().await;
    let mut p = Client::connect(s.addr).await;
    p.publish("/queue/ok", "still fine", &[]).await;
    assert_eq!(body(&good.expect(Command::Message).await), "still fine");
}

#[tokio::test]
async fn oversized_frames_are_refused() {
    let s = start().await;
    let mut c = Client::connect(s.addr).await;
    // the default: 128 MiB of body (RabbitMQ's max_message_size) and 1 MiB of head
    c.send_raw(b"SEND\ndestination:/queue/big\ncontent-length:135266305\n\n")
        .await;
    let e = c.expect_error().await;
    assert!(body(&e).contains("too large"), "{e:?}");
    // before login the limit is 64 KiB
    let mut c = Client::open(s.addr).await;
    let mut f = b"CONNECT\nx:".to_vec();
    f.extend(vec![b'a'; 70 << 10]);
    c.send_raw(&f).await;
    c.expect_error().await;
}

#[tokio::test]
async fn a_bad_stream_offset_declares_nothing() {
    let s = start().await;
    let mut c = Client::connect(s.addr).await;
    c.send(
        Frame::new(Command::Subscribe)
            .with("id", "0")
            .with("destination", "/queue/so")
            .with("prefetch-count", "10")
            .with("ack", "client")
            .with("x-stream-offset", "soon"),
    )
    .await;
    let e = c.expect_error().await;
    assert_eq!(e.header("message"), Some("invalid x-stream-offset"));
    // refused before the queue was declared
    assert!(s.broker.vhost("/").unwrap().queue("so").is_none());
}

#[tokio::test]
async fn a_malformed_selector_is_an_error_naming_the_problem() {
    let s = start().await;
    let mut c = Client::connect(s.addr).await;
    c.send(
        Frame::new(Command::Subscribe)
            .with("id", "0")
            .with("destination", "/queue/s")
            .with("selector", "colour = 'red"),
    )
    .await;
    let e = c.expect_error().await;
    assert_eq!(e.header("message"), Some("invalid selector"));
    assert!(body(&e).contains("unterminated string"), "{e:?}");
    // nothing was declared for it
    assert!(s.broker.vhost("/").unwrap().queue("s").is_none());
    let mut c = Client::connect(s.addr).await;
    c.send(
        Frame::new(Command::Subscribe)
            .with("id", "0")
            .with("destination", "/queue/s")
            .with("x-tag-filter", "a || "),
    )
    .await;
    let e = c.expect_error().await;
    assert_eq!(e.header("message"), Some("invalid x-tag-filter header"));
}

#[tokio::test]
async fn a_selecting_subscriber_takes_only_matches_and_leaves_the_rest() {
    let s = start().await;
    let mut p = Client::connect(s.addr).await;
    for (colour, size) in [("blue", "5"), ("red", "20"), ("red", "3"), ("red", "11")] {
        p.publish(
            "/queue/sel",
            &format!("{colour}-{size}"),
            &[("colour", colour), ("size", size)],
        )
        .await;
    }
    let mut a = Client::connect(s.addr).await;
    // a STOMP header is a string; against a number it reads as one (ActiveMQ's rule)
    a.subscribe(
        "a",
        "/queue/sel",
        &[("selector", "colour = 'red' AND size > 10")],
    )
    .await;
    assert_eq!(body(&a.expect(Command::Message).await), "red-20");
    assert_eq!(body(&a.expect(Command::Message).await), "red-11");
    a.expect_nothing(100).await;
    let mut b = Client::connect(s.addr).await;
    b.subscribe("b", "/queue/sel", &[]).await;
    assert_eq!(body(&b.expect(Command::Message).await), "blue-5");
    assert_eq!(body(&b.expect(Command::Message).await), "red-3");
    // a new message goes to the one whose selector takes it
    p.publish("/queue/sel", "red-50", &[("colour", "red"), ("size", "50")])
        .await;
    assert_eq!(body(&a.expect(Command::Message).await), "red-50");
}

#[tokio::test]
async fn a_tag_filter_takes_only_its_tags() {
    let s = start().await;
    let mut c = Client::connect(s.addr).await;
    c.subscribe("t", "/queue/tags", &[("x-tag-filter", "a || b")])
        .await;
    let mut p = Client::connect(s.addr).await;
    for tag in ["a", "c", "b", ""] {
        let h: &[(&str, &str)] = if tag.is_empty() {
            &[]
        } else {
            &[("x-tag", tag)]
        };
        p.publish("/queue/tags", &format!("m-{tag}"), h).await;
    }
    let m = c.expect(Command::Message).await;
    assert_eq!((body(&m).as_str(), m.header("x-tag")), ("m-a", Some("a")));
    assert_eq!(body(&c.expect(Command::Message).await), "m-b");
    c.expect_nothing(100).await;
    let q = s.broker.vhost("/").unwrap().queue("tags").unwrap();
    assert_eq!(q.message_count(), 2);
}

#[tokio::test]
async fn prefetch_count_limits_unacked_deliveries() {
    let s = start().await;
    let mut p = Client::connect(s.addr).await;
    for i in 0..5 {
        p.publish("/queue/pf", &format!("m{i}"), &[]).await;
    }
    let mut c = Client::connect(s.addr).await;
    c.subscribe(
        "0",
        "/queue/pf",
        &[("ack", "client-individual"), ("prefetch-count", "2")],
    )
    .await;
    let m0 = c.expect(Command::Message).await;
    c.expect(Command::Message).await;
    c.expect_nothing(300).await;
    c.send(Frame::new(Command::Ack).with("id", m0.header("ack").unwrap()))
        .await;
    assert_eq!(body(&c.expect(Command::Message).await), "m2");
    c.expect_nothing(200).await;
}

#[tokio::test]
async fn amq_queue_needs_an_existing_queue() {
    let s = start().await;
    let mut c = Client::connect(s.addr).await;
    c.send(
        Frame::new(Command::Subscribe)
            .with("id", "0")
            .with("destination", "/amq/queue/missing")
            .with("receipt", "r"),
    )
    .await;
    let e = c.expect_error().await;
    assert_eq!(e.header("message"), Some("not_found"));
    assert_eq!(e.header("receipt-id"), Some("r"));
    let mut c = Client::connect(s.addr).await;
    c.publish("/queue/exists", "x", &[]).await;
    c.subscribe("0", "/amq/queue/exists", &[]).await;
    assert_eq!(body(&c.expect(Command::Message).await), "x");
}

#[tokio::test]
async fn temp_queue_replies_route_back() {
    let s = start().await;
    let mut server = Client::connect(s.addr).await;
    server.subscribe("rpc", "/queue/rpc", &[]).await;
    let mut client = Client::connect(s.addr).await;
    client
        .publish("/queue/rpc", "ping", &[("reply-to", "/temp-queue/r1")])
        .await;
    let req = server.expect(Command::Message).await;
    let reply_to = req.header("reply-to").unwrap().to_string();
    assert!(reply_to.starts_with("/reply-queue/"), "{reply_to}");
    server.publish(&reply_to, "pong", &[]).await;
    let rep = client.expect(Command::Message).await;
    assert_eq!(body(&rep), "pong");
    assert_eq!(rep.header("subscription"), Some("/temp-queue/r1"));
}

#[tokio::test]
async fn receipts_answer_every_client_frame_and_disconnect_closes() {
    let s = start().await;
    let mut c = Client::connect(s.addr).await;
    c.send(
        Frame::new(Command::Begin)
            .with("transaction", "t")
            .with("receipt", "1"),
    )
    .await;
    c.send(
        Frame::new(Command::Abort)
            .with("transaction", "t")
            .with("receipt", "2"),
    )
    .await;
    c.send(
        Frame::new(Command::Subscribe)
            .with("id", "s")
            .with("destination", "/queue/r")
            .with("receipt", "3"),
    )
    .await;
    c.send(
        Frame::new(Command::Unsubscribe)
            .with("id", "s")
            .with("receipt", "4"),
    )
    .await;
    for want in ["1", "2", "3", "4"] {
        let r = c.expect(Command::Receipt).await;
        assert_eq!(r.header("receipt-id"), Some(want));
    }
    c.disconnect().await;
}

#[tokio::test]
async fn unacked_messages_return_when_the_connection_drops() {
    let s = start().await;
    three_messages(&s, "/queue/drop").await;
    let mut c = Client::connect(s.addr).await;
    c.subscribe("0", "/queue/drop", &[("ack", "client")]).await;
    for _ in 0..3 {
        c.expect(Command::Message).await;
    }
    drop(c);
    let q = s.broker.vhost("/").unwrap().queue("drop").unwrap();
    eventually(
        "the unacked messages to go back",
        Duration::from_secs(10),
        || q.unacked_count() == 0,
    )
    .await;
    assert_eq!(q.message_count(), 3);
}

#[tokio::test]
async fn shutdown_closes_connections_with_an_error() {
    let s = start().await;
    let mut c = Client::connect(s.addr).await;
    s.shutdown.cancel();
    let e = c.expect_error().await;
    assert_eq!(e.header("message"), Some("Server shutdown"));
}

#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
//! What RabbitMQ's STOMP plugin does and clients rely on (issue 16, STOMP items 3-7):
//! queue arguments on headers, `heart-beat` in every CONNECTED, a 1.2 ACK without `id`,
//! receipts of transactional SENDs at COMMIT, large messages.

mod common;

use common::{body, start, start_sized, Client};
use triad_core::{CoreError, FieldTable, FieldValue, QueueDeclare};
use triad_stomp::{Command, Frame};

#[tokio::test]
async fn connected_always_carries_heart_beat() {
    let s = start().await;
    // STOMP 1.0 (no accept-version), and 1.2 without a heart-beat header: 0,0
    for headers in [
        vec![("host", "/")],
        vec![("accept-version", "1.2"), ("host", "/")],
        vec![
            ("accept-version", "1.1"),
            ("host", "/"),
            ("heart-beat", "0,0"),
        ],
    ] {
        let mut c = Client::open(s.addr).await;
        let mut f = Frame::new(Command::Connect);
        for (k, v) in &headers {
            f.push(*k, *v);
        }
        c.send(f).await;
        let r = c.expect(Command::Connected).await;
        assert_eq!(r.header("heart-beat"), Some("0,0"), "{headers:?}");
    }
    // a 1.0 client's heart-beat header is not 1.0: still none agreed
    let mut c = Client::open(s.addr).await;
    c.send(
        Frame::new(Command::Connect)
            .with("host", "/")
            .with("heart-beat", "1000,1000"),
    )
    .await;
    let r = c.expect(Command::Connected).await;
    assert_eq!(r.header("version"), Some("1.0"));
    assert_eq!(r.header("heart-beat"), Some("0,0"));
}

async fn one_unacked(addr: std::net::SocketAddr, version: &str, q: &str) -> (Client, Frame) {
    let mut c = Client::connect_with(addr, &[("accept-version", version), ("host", "/")]).await;
    c.subscribe("s", q, &[("ack", "client-individual")]).await;
    c.publish(q, "m", &[]).await;
    let m = c.expect(Command::Message).await;
    (c, m)
}

#[tokio::test]
async fn a_stomp_1_2_ack_or_nack_without_id_is_an_error() {
    let s = start().await;
    for cmd in [Command::Ack, Command::Nack] {
        let (mut c, m) = one_unacked(s.addr, "1.2", &format!("/queue/noid-{cmd}")).await;
        c.send(
            Frame::new(cmd)
                .with("message-id", m.header("message-id").unwrap())
                .with("subscription", "s"),
        )
        .await;
        let e = c.expect_error().await;
        assert_eq!(e.header("message"), Some("Missing header"));
        assert!(
            body(&e).contains(&format!("\"{cmd}\" must include the \"id\" header")),
            "{e:?}"
        );
    }
    // 1.1 acks by message-id
    let (mut c, m) = one_unacked(s.addr, "1.1", "/queue/noid-11").await;
    c.send(
        Frame::new(Command::Ack)
            .with("message-id", m.header("message-id").unwrap())
            .with("subscription", "s")
            .with("receipt", "a"),
    )
    .await;
    assert_eq!(
        c.expect(Command::Receipt).await.header("receipt-id"),
        Some("a")
    );
    // a 1.1 ACK without message-id is refused, naming it
    c.send(Frame::new(Command::Ack).with("id", "x")).await;
    let e = c.expect_error().await;
    assert!(body(&e).contains("\"message-id\""), "{e:?}");
}

#[tokio::test]
async fn receipts_of_transactional_sends_come_at_commit_in_order() {
    let s = start().await;
    let mut c = Client::connect(s.addr).await;
    c.send(Frame::new(Command::Begin).with("transaction", "t"))
        .await;
    for i in 0..3 {
        c.send(
            Frame::new(Command::Send)
                .with("destination", "/queue/txr")
                .with("transaction", "t")
                .with("persistent", "true")
                .with("receipt", format!("s{i}"))
                .with_body(format!("m{i}")),
        )
        .await;
    }
    // an untransacted SEND in between gets its receipt at once
    c.publish("/queue/txr-other", "x", &[]).await;
    c.expect_nothing(200).await;
    c.send(
        Frame::new(Command::Commit)
            .with("transaction", "t")
            .with("receipt", "c"),
    )
    .await;
    for want in ["s0", "s1", "s2", "c"] {
        let r = c.expect(Command::Receipt).await;
        assert_eq!(r.header("receipt-id"), Some(want));
    }
    // stored by then
    let q = s.broker.vhost("/").unwrap().queue("txr").unwrap();
    assert_eq!(q.message_count(), 3);

    // ABORT: the SEND's receipt never comes, ABORT's does
    c.send(Frame::new(Command::Begin).with("transaction", "u"))
        .await;
    c.send(
        Frame::new(Command::Send)
            .with("destination", "/queue/txr")
            .with("transaction", "u")
            .with("receipt", "gone")
            .with_body("g"),
    )
    .await;
    c.send(
        Frame::new(Command::Abort)
            .with("transaction", "u")
            .with("receipt", "ab"),
    )
    .await;
    assert_eq!(
        c.expect(Command::Receipt).await.header("receipt-id"),
        Some("ab")
    );
    c.expect_nothing(200).await;
    assert_eq!(q.message_count(), 3);
}

fn args(pairs: &[(&str, FieldValue)]) -> FieldTable {
    let mut t = FieldTable::new();
    for (k, v) in pairs {
        t.insert(*k, v.clone());
    }
    t
}

#[tokio::test]
async fn queue_argument_headers_declare_as_amqp_does() {
    let s = start().await;
    let mut c = Client::connect(s.addr).await;
    c.publish(
        "/queue/qa",
        "m",
        &[
            ("x-max-length", "5"),
            ("x-message-ttl", " 60000 "),
            ("x-dead-letter-exchange", "dlx"),
            ("x-queue-type", "classic"),
        ],
    )
    .await;
    let vhost = s.broker.vhost("/").unwrap();
    let q = vhost.queue("qa").unwrap();
    assert!(q.durable());
    let a = q.arguments();
    assert_eq!(a.get("x-max-length").and_then(|v| v.as_i64()), Some(5));
    assert_eq!(a.get("x-message-ttl").and_then(|v| v.as_i64()), Some(60000));
    assert_eq!(a.get_str("x-dead-letter-exchange"), Some("dlx"));
    // an AMQP client declaring the same queue with the same arguments (an I32 is the
    // same number): declare-ok; with a different one: 406
    let same = args(&[
        ("x-max-length", FieldValue::I32(5)),
        ("x-message-ttl", FieldValue::I32(60000)),
        ("x-dead-letter-exchange", FieldValue::from("dlx")),
        ("x-queue-type", FieldValue::from("classic")),
    ]);
    let decl = |arguments| QueueDeclare {
        name: "qa".into(),
        durable: true,
        arguments,
        ..Default::default()
    };
    let ok = vhost.declare_queue(decl(same.clone())).unwrap();
    assert_eq!(ok.message_count, 1);
    let mut other = same.clone();
    other.insert("x-max-length", FieldValue::I32(6));
    assert!(matches!(
        vhost.declare_queue(decl(other)),
        Err(CoreError::PreconditionFailed(t)) if t.contains("x-max-length")
    ));
    // SUBSCRIBE and SEND with the same arguments use it; without any, too
    c.send(
        Frame::new(Command::Subscribe)
            .with("id", "s")
            .with("destination", "/queue/qa")
            .with("x-max-length", "5")
            .with("x-message-ttl", "60000")
            .with("x-dead-letter-exchange", "dlx")
            .with("receipt", "sub"),
    )
    .await;
    // the receipt and the waiting message, in either order
    let (a, b) = (c.recv().await.unwrap(), c.recv().await.unwrap());
    let mut got = [a.command, b.command];
    got.sort_by_key(|c| c.as_str());
    assert_eq!(got, [Command::Message, Command::Receipt]);
    c.publish("/queue/qa", "n", &[]).await;
    // different ones: precondition_failed, naming the argument
    c.send(
        Frame::new(Command::Send)
            .with("destination", "/queue/qa")
            .with("x-max-length", "6")
            .with("x-message-ttl", "60000")
            .with("x-dead-letter-exchange", "dlx")
            .with_body("x"),
    )
    .await;
    let e = loop {
        let f = c.recv().await.unwrap();
        if f.command == Command::Error {
            break f;
        }
    };
    assert_eq!(e.header("message"), Some("precondition_failed"));
    assert!(body(&e).contains("x-max-length"), "{e:?}");
}

#[tokio::test]
async fn queue_argument_headers_are_checked_never_ignored() {
    let s = start().await;
    for (dest, header, value, message, detail) in [
        // does not parse: named
        (
            "/queue/b1",
            "x-message-ttl",
            "soon",
            "invalid x-message-ttl header",
            "'soon'",
        ),
        (
            "/queue/b2",
            "x-max-priority",
            "1.5",
            "invalid x-max-priority header",
            "'1.5'",
        ),
        // what the core does not implement is refused, not ignored
        (
            "/queue/b3",
            "x-queue-type",
            "quorum",
            "precondition_failed",
            "x-queue-type",
        ),
        (
            "/queue/b4",
            "x-overflow",
            "bogus",
            "precondition_failed",
            "x-overflow",
        ),
        (
            "/queue/b5",
            "x-max-length",
            "-1",
            "precondition_failed",
            "x-max-length",
        ),
        // a destination whose queue the SUBSCRIBE does not declare cannot take them
        (
            "/amq/queue/qa",
            "x-max-length",
            "5",
            "invalid queue arguments",
            "/amq/queue/qa",
        ),
        (
            "/temp-queue/t",
            "x-max-length",
            "5",
            "invalid queue arguments",
            "/temp-queue/t",
        ),
    ] {
        let mut c = Client::connect(s.addr).await;
        c.send(
            Frame::new(Command::Subscribe)
                .with("id", "s")
                .with("destination", dest)
                .with(header, value),
        )
        .await;
        let e = c.expect_error().await;
        assert_eq!(e.header("message"), Some(message), "{dest} {header}: {e:?}");
        assert!(body(&e).contains(detail), "{dest} {header}: {e:?}");
        if dest.starts_with("/queue/") {
            let name = dest.trim_start_matches("/queue/");
            assert!(s.broker.vhost("/").unwrap().queue(name).is_none());
        }
    }
    // a transactional SEND is checked when it is sent, not at COMMIT
    let mut c = Client::connect(s.addr).await;
    c.send(Frame::new(Command::Begin).with("transaction", "t"))
        .await;
    c.send(
        Frame::new(Command::Send)
            .with("destination", "/queue/b6")
            .with("transaction", "t")
            .with("x-expires", "never"),
    )
    .await;
    let e = c.expect_error().await;
    assert_eq!(e.header("message"), Some("invalid x-expires header"));
}

/// A 16 MiB SEND to a topic with two subscribers reaches both, whole (it works on
/// RabbitMQ; the 4 MiB frame limit refused it before).
#[tokio::test]
async fn a_16_mib_send_to_a_topic_with_two_subscribers() {
    let s = start_sized(64 << 20, |_| {}).await;
    let (mut a, mut b) = (Client::connect(s.addr).await, Client::connect(s.addr).await);
    a.subscribe("a", "/topic/big", &[]).await;
    b.subscribe("b", "/topic/big", &[]).await;
    let data: Vec<u8> = (0..16u32 << 20).map(|i| (i % 251) as u8).collect();
    let mut p = Client::connect(s.addr).await;
    p.send(
        Frame::new(Command::Send)
            .with("destination", "/topic/big")
            .with("receipt", "r")
            .with_body(data.clone()),
    )
    .await;
    assert_eq!(
        p.expect(Command::Receipt).await.header("receipt-id"),
        Some("r")
    );
    for c in [&mut a, &mut b] {
        let m = c.expect(Command::Message).await;
        assert_eq!(m.body.len(), data.len());
        assert!(m.body == data[..], "the body arrives intact");
    }
}

/// Over the frame limit (the broker's `limits.max_message_size` plus head room): an
/// ERROR naming the limit and close, decided from `content-length` before the body
/// is read.
#[tokio::test]
async fn a_frame_over_the_limit_is_refused_before_its_body() {
    let s = start_sized(64 << 20, |ctx| ctx.limits.max_frame = 1 << 20).await;
    let mut c = Client::connect(s.addr).await;
    c.send_raw(b"SEND\ndestination:/queue/big\ncontent-length:1048577\n\n")
        .await;
    let e = c.expect_error().await;
    assert!(body(&e).contains("more than 1048576 bytes"), "{e:?}");
    // just under it passes
    let mut c = Client::connect(s.addr).await;
    let data = vec![b'x'; (1 << 20) - 100];
    c.send(
        Frame::new(Command::Send)
            .with("destination", "/queue/big")
            .with("receipt", "r")
            .with_body(data),
    )
    .await;
    c.expect(Command::Receipt).await;
}

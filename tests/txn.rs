//! Half messages through the real broker over AMQP (lapin) and STOMP, across `kill -9`:
//! a half message committed before the crash is delivered exactly once after the
//! restart, an unresolved one stays half (and can still be committed), a rolled-back
//! one never appears, and an unknown id is AMQP's 404 channel error and a STOMP ERROR.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::raw::StompClient;
use common::TestBroker;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation};

const T: Duration = Duration::from_secs(10);

fn txn_props(op: &str, id: &str) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert("x-txn".into(), AMQPValue::LongString(LongString::from(op)));
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(ShortString::from(id))
        .with_headers(h)
}

async fn publish(ch: &Channel, exchange: &str, key: &str, body: &[u8], props: BasicProperties) {
    let c = ch
        .basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            body,
            props,
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    assert!(matches!(c, Confirmation::Ack(_)), "{c:?}");
}

async fn confirm_channel(conn: &lapin::Connection) -> Channel {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch
}

fn stomp_ok(c: &mut StompClient, command: &str, headers: &[(&str, &str)], body: &[u8]) {
    let mut h = headers.to_vec();
    h.push(("receipt", "r"));
    c.send(command, &h, body).unwrap();
    let f = c.read_frame().unwrap();
    assert_eq!(f.command, "RECEIPT", "{f:?}");
}

#[test]
fn half_message_resolutions_survive_kill_9() {
    let mut broker = TestBroker::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let conn = common::amqp::connect(broker.amqp_addr()).await.unwrap();
        let ch = confirm_channel(&conn).await;
        common::amqp::declare_durable(&ch, "orders").await.unwrap();
        for id in ["a-commit", "a-keep", "a-rollback"] {
            publish(&ch, "", "orders", id.as_bytes(), txn_props("half", id)).await;
        }
        publish(
            &ch,
            "amq.triad.txn",
            "",
            b"",
            txn_props("commit", "a-commit"),
        )
        .await;
        publish(
            &ch,
            "amq.triad.txn",
            "",
            b"",
            txn_props("rollback", "a-rollback"),
        )
        .await;
    });
    let mut stomp = StompClient::connect(broker.stomp_addr(), T).unwrap();
    for id in ["s-commit", "s-keep", "s-rollback"] {
        stomp_ok(
            &mut stomp,
            "SEND",
            &[
                ("destination", "/queue/orders"),
                ("persistent", "true"),
                ("x-txn", "half"),
                ("message-id", id),
            ],
            id.as_bytes(),
        );
    }
    for (id, op) in [("s-commit", "commit"), ("s-rollback", "rollback")] {
        let dest = format!("/txn/{id}");
        stomp_ok(
            &mut stomp,
            "SEND",
            &[("destination", &dest), ("x-txn", op)],
            b"",
        );
    }
    drop(stomp);
    broker.kill9();
    broker.restart();

    let got = rt.block_on(common::amqp::drain(broker.amqp_addr(), "orders", T));
    let mut got: Vec<String> = got
        .into_iter()
        .map(|b| String::from_utf8(b).unwrap())
        .collect();
    got.sort();
    assert_eq!(got, ["a-commit", "s-commit"], "committed ones, once each");

    // the unresolved ones are still half: commit them now, over the other protocol
    rt.block_on(async {
        let conn = common::amqp::connect(broker.amqp_addr()).await.unwrap();
        let ch = confirm_channel(&conn).await;
        publish(&ch, "amq.triad.txn", "", b"", txn_props("commit", "s-keep")).await;
        // a rolled-back id is unknown: 404 closes the channel
        let err = ch
            .basic_publish(
                "amq.triad.txn".into(),
                "".into(),
                BasicPublishOptions::default(),
                b"",
                txn_props("commit", "a-rollback"),
            )
            .await
            .expect("sent")
            .await
            .expect_err("unknown half message");
        let text = err.to_string();
        assert!(text.contains("404") || text.contains("NOT_FOUND"), "{text}");
    });
    let mut stomp = StompClient::connect(broker.stomp_addr(), T).unwrap();
    stomp_ok(
        &mut stomp,
        "SEND",
        &[("destination", "/txn/a-keep"), ("x-txn", "commit")],
        b"",
    );
    stomp
        .send(
            "SEND",
            &[("destination", "/txn/s-rollback"), ("x-txn", "commit")],
            b"",
        )
        .unwrap();
    let f = stomp.read_frame().unwrap();
    assert_eq!(f.command, "ERROR", "{f:?}");
    assert_eq!(f.header("message"), Some("not_found"), "{f:?}");
    assert!(
        String::from_utf8_lossy(&f.body).contains("no half message 's-rollback'"),
        "{f:?}"
    );
    let got = rt.block_on(common::amqp::drain(broker.amqp_addr(), "orders", T));
    let mut got: Vec<String> = got
        .into_iter()
        .map(|b| String::from_utf8(b).unwrap())
        .collect();
    got.sort();
    assert_eq!(got, ["a-keep", "s-keep"]);
}

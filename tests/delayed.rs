//! Delayed delivery and delivery counts in the real broker process: a delayed message is
//! routed when it is due, not before; confirmed delayed messages and returned messages'
//! delivery counts survive `kill -9`.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::amqp::connect;
use common::TestBroker;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel};

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

async fn declare(ch: &Channel, name: &str, args: FieldTable) {
    common::amqp::declare_durable_with(ch, name, args)
        .await
        .unwrap();
}

fn delayed_props(ms: i64, sent_at: u64) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert(ShortString::from("x-delay"), AMQPValue::LongLongInt(ms));
    h.insert(
        ShortString::from("sent-at"),
        AMQPValue::LongLongInt(sent_at as i64),
    );
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(h)
}

/// `basic.get` until a message comes or `timeout` passes.
async fn get(ch: &Channel, q: &str, timeout: Duration) -> Option<lapin::message::BasicGetMessage> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(m) = ch
            .basic_get(q.into(), BasicGetOptions::default())
            .await
            .unwrap()
        {
            return Some(m);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn header_i64(p: &BasicProperties, k: &str) -> Option<i64> {
    match p.headers().as_ref()?.inner().get(k)? {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_message_is_routed_when_due_not_before() {
    let broker = TestBroker::start();
    let conn = connect(broker.amqp_addr()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    declare(&ch, "later", FieldTable::default()).await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let sent = now_ms();
    ch.basic_publish(
        "".into(),
        "later".into(),
        BasicPublishOptions::default(),
        b"tick",
        delayed_props(400, sent),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    // not before its time (checked right after the confirm, well before 400 ms)
    let early = ch
        .basic_get("later".into(), BasicGetOptions::default())
        .await
        .unwrap();
    if now_ms() < sent + 400 {
        assert!(early.is_none(), "delivered before its delay");
    }
    let m = get(&ch, "later", Duration::from_secs(10))
        .await
        .expect("the delayed message arrives");
    let at = now_ms();
    assert_eq!(m.delivery.data, b"tick");
    assert!(at >= sent + 400, "arrived {} ms after publish", at - sent);
    // a bad x-delay is refused naming it (channel closed with 406)
    let mut h = FieldTable::default();
    h.insert(
        ShortString::from("x-delay"),
        AMQPValue::LongString(LongString::from("soon")),
    );
    let r = ch
        .basic_publish(
            "".into(),
            "later".into(),
            BasicPublishOptions::default(),
            b"bad",
            BasicProperties::default().with_headers(h),
        )
        .await;
    let r = match r {
        Ok(c) => c.await.map(|_| ()),
        Err(e) => Err(e),
    };
    let err = format!("{:?}", r.expect_err("refused"));
    assert!(err.contains("x-delay"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_delayed_messages_and_delivery_counts_survive_kill_9() {
    let mut broker = TestBroker::start();
    const N: u64 = 200;
    let counts_q = "returned";
    {
        let conn = connect(broker.amqp_addr()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        declare(&ch, "delayed", FieldTable::default()).await;
        // counts are stored for queues with a limit (or a back-off) only
        let mut limit = FieldTable::default();
        limit.insert(
            ShortString::from("x-delivery-limit"),
            AMQPValue::LongInt(100),
        );
        declare(&ch, counts_q, limit).await;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        // a message returned twice, unacked when the broker dies
        ch.basic_publish(
            "".into(),
            counts_q.into(),
            BasicPublishOptions::default(),
            b"r",
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
        for _ in 0..2 {
            let m = get(&ch, counts_q, Duration::from_secs(5)).await.unwrap();
            m.delivery
                .nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await
                .unwrap();
        }
        let m = get(&ch, counts_q, Duration::from_secs(5)).await.unwrap();
        assert_eq!(
            header_i64(&m.delivery.properties, "x-delivery-count"),
            Some(2)
        );
        // delayed ones: due 1.5-2.5 s from now, all confirmed before the kill
        let sent = now_ms();
        let mut confirms = Vec::new();
        for i in 0..N {
            let c = ch
                .basic_publish(
                    "".into(),
                    "delayed".into(),
                    BasicPublishOptions::default(),
                    &i.to_be_bytes(),
                    delayed_props(1_500 + (i as i64 * 5), sent),
                )
                .await
                .unwrap();
            confirms.push(c);
        }
        for c in confirms {
            assert!(c.await.unwrap().is_ack());
        }
        // nothing is due yet
        assert!(
            now_ms() >= sent + 1_500
                || ch
                    .basic_get("delayed".into(), BasicGetOptions::default())
                    .await
                    .unwrap()
                    .is_none()
        );
        broker.kill9();
    }
    broker.restart();
    let conn = connect(broker.amqp_addr()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let m = get(&ch, counts_q, Duration::from_secs(5)).await.unwrap();
    assert_eq!(m.delivery.data, b"r");
    assert_eq!(
        header_i64(&m.delivery.properties, "x-delivery-count"),
        Some(2),
        "the count survives kill -9 (the broker's death is not a return)"
    );
    m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    let mut got = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while (got.len() as u64) < N && Instant::now() < deadline {
        if let Some(m) = get(&ch, "delayed", Duration::from_millis(200)).await {
            let n = u64::from_be_bytes(m.delivery.data.as_slice().try_into().unwrap());
            let sent = header_i64(&m.delivery.properties, "sent-at").unwrap() as u64;
            assert!(now_ms() >= sent + 1_500 + n * 5, "message {n} early");
            got.insert(n);
            m.delivery.ack(BasicAckOptions::default()).await.unwrap();
        }
    }
    assert_eq!(
        got.len() as u64,
        N,
        "every confirmed delayed message arrives"
    );
    // and each once: nothing more
    assert!(get(&ch, "delayed", Duration::from_millis(300))
        .await
        .is_none());
}

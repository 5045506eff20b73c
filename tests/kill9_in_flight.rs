//! `kill -9` with everything in flight at once (issue 17): delayed messages not yet due
//! (and more being published when the broker dies), returned messages waiting out their
//! `x-retry-backoff` step, half messages committed, rolled back and unresolved, and a
//! stream with a named consumer's stored offset and publishes still arriving. After the
//! restart nothing confirmed is lost, nothing comes early, and no half message becomes
//! visible without a commit. Real clients (lapin) over sockets against the real binary.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::amqp::connect;
use common::TestBroker;
use futures_util::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel};
use triad_core::testing::{eventually, eventually_async};

const T: Duration = Duration::from_secs(20);
/// Delayed messages are due this long (plus up to a second) after they are sent.
const DELAY_MS: u64 = 2_500;
/// The retrying queue's one back-off step.
const BACKOFF_MS: u64 = 6_000;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn s(v: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(v))
}

async fn declare(ch: &Channel, name: &str, args: &[(&str, AMQPValue)]) {
    let mut t = FieldTable::default();
    for (k, v) in args {
        t.insert((*k).into(), v.clone());
    }
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        t,
    )
    .await
    .unwrap();
}

fn props(headers: &[(&str, AMQPValue)], id: Option<&str>) -> BasicProperties {
    let mut h = FieldTable::default();
    for (k, v) in headers {
        h.insert((*k).into(), v.clone());
    }
    let p = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(h);
    match id {
        Some(id) => p.with_message_id(ShortString::from(id)),
        None => p,
    }
}

async fn publish(ch: &Channel, exchange: &str, key: &str, body: &[u8], p: BasicProperties) {
    let c = ch
        .basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            body,
            p,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(c.is_ack(), "{c:?}");
}

fn header_i64(p: &BasicProperties, k: &str) -> Option<i64> {
    match p.headers().as_ref()?.inner().get(k)? {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        _ => None,
    }
}

/// Publishes delayed messages (`d<i>`, with their due time in `due`) and stream
/// messages (`s<i>`) with confirms until the connection dies; records what was
/// confirmed.
async fn publish_until_killed(
    addr: std::net::SocketAddr,
    delayed: Arc<Mutex<BTreeMap<u64, u64>>>,
    stream: Arc<Mutex<BTreeSet<u64>>>,
) {
    let conn = connect(addr).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for i in 0u64.. {
        let due = now_ms() + DELAY_MS + (i % 100) * 10;
        let d = ch
            .basic_publish(
                "".into(),
                "delayed".into(),
                BasicPublishOptions::default(),
                format!("d{i}").as_bytes(),
                props(
                    &[
                        ("x-delay", AMQPValue::LongLongInt((due - now_ms()) as i64)),
                        ("due", AMQPValue::LongLongInt(due as i64)),
                    ],
                    None,
                ),
            )
            .await;
        let st = ch
            .basic_publish(
                "".into(),
                "log".into(),
                BasicPublishOptions::default(),
                format!("s{i}").as_bytes(),
                props(&[], None),
            )
            .await;
        let (Ok(d), Ok(st)) = (d, st) else { return };
        match d.await {
            // `due` as sent: the broker's due time is at or after it
            Ok(c) if c.is_ack() => {
                delayed.lock().unwrap().insert(i, due);
            }
            _ => return,
        }
        match st.await {
            Ok(c) if c.is_ack() => {
                stream.lock().unwrap().insert(i);
            }
            _ => return,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_delayed_retrying_half_and_stream_messages_in_flight() {
    let mut broker = TestBroker::start();
    const RETRYING: usize = 50;
    const STREAM_FIRST: u64 = 200;
    let nacked_at;
    let delayed = Arc::new(Mutex::new(BTreeMap::new()));
    let streamed = Arc::new(Mutex::new(BTreeSet::new()));
    {
        let conn = connect(broker.amqp_addr()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        declare(&ch, "delayed", &[]).await;
        declare(&ch, "orders", &[]).await;
        let backoff = format!("{BACKOFF_MS}ms");
        declare(&ch, "retrying", &[("x-retry-backoff", s(&backoff))]).await;
        declare(&ch, "log", &[("x-queue-type", s("stream"))]).await;

        // the stream: 200 messages, a named consumer acks the first 100 and cancels
        for i in 0..STREAM_FIRST {
            publish(
                &ch,
                "",
                "log",
                format!("first{i}").as_bytes(),
                props(&[], None),
            )
            .await;
        }
        let rd = conn.create_channel().await.unwrap();
        rd.basic_qos(100, BasicQosOptions::default()).await.unwrap();
        let mut args = FieldTable::default();
        args.insert("x-stream-offset".into(), s("first"));
        args.insert("x-stream-consumer-name".into(), s("app"));
        let mut c = rd
            .basic_consume(
                "log".into(),
                "app".into(),
                BasicConsumeOptions::default(),
                args,
            )
            .await
            .unwrap();
        for _ in 0..100 {
            let d = tokio::time::timeout(T, c.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
        rd.basic_cancel("app".into(), BasicCancelOptions::default())
            .await
            .unwrap();

        // half messages: 10 committed, 5 rolled back, 5 unresolved
        for i in 0..20 {
            let id = format!("h{i}");
            publish(
                &ch,
                "",
                "orders",
                id.as_bytes(),
                props(&[("x-txn", s("half"))], Some(&id)),
            )
            .await;
        }
        for i in 0..15 {
            let id = format!("h{i}");
            let op = if i < 10 { "commit" } else { "rollback" };
            publish(
                &ch,
                "amq.triad.txn",
                "",
                b"",
                props(&[("x-txn", s(op))], Some(&id)),
            )
            .await;
        }

        // retrying: 50 messages, each returned once: all wait out their 6 s step
        for i in 0..RETRYING {
            publish(
                &ch,
                "",
                "retrying",
                format!("r{i}").as_bytes(),
                props(&[], None),
            )
            .await;
        }
        let mut got = Vec::new();
        while got.len() < RETRYING {
            let m = ch
                .basic_get("retrying".into(), BasicGetOptions::default())
                .await
                .unwrap()
                .expect("a retrying message");
            got.push(m);
        }
        nacked_at = now_ms();
        for m in got {
            m.delivery
                .nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await
                .unwrap();
        }
        // a round trip on the same channel: the nacks before it are handled
        let q = ch
            .queue_declare(
                "retrying".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        assert_eq!(q.message_count(), 0, "all backing off, none ready");

        // delayed and stream publishes keep going while the broker is killed
        let task = tokio::spawn(publish_until_killed(
            broker.amqp_addr(),
            delayed.clone(),
            streamed.clone(),
        ));
        eventually("50 delayed publishes confirmed", T, || {
            delayed.lock().unwrap().len() >= 50
        })
        .await;
        broker.kill9();
        tokio::time::timeout(T, task).await.unwrap().unwrap();
    }
    let delayed = delayed.lock().unwrap().clone();
    let streamed = streamed.lock().unwrap().clone();
    broker.restart();
    let conn = connect(broker.amqp_addr()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    assert!(
        now_ms() < nacked_at + BACKOFF_MS,
        "the back-off ended before the restart: the test would prove nothing (machine too slow)"
    );
    // none of the retrying messages is ready yet: they wait out their step
    let q = ch
        .queue_declare(
            "retrying".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    if now_ms() < nacked_at + BACKOFF_MS {
        assert_eq!(q.message_count(), 0, "still backing off after the restart");
    }

    // retrying: none before the end of its step (counted from the nack, not the
    // restart), each once with its count
    let mut retried = BTreeSet::new();
    let deadline = Instant::now() + T;
    while retried.len() < RETRYING {
        let m = eventually_async(
            &format!("the next retrying message (have {retried:?})"),
            deadline.saturating_duration_since(Instant::now()),
            async || {
                ch.basic_get("retrying".into(), BasicGetOptions { no_ack: true })
                    .await
                    .unwrap()
            },
        )
        .await;
        let at = now_ms();
        assert!(
            at >= nacked_at + BACKOFF_MS,
            "a retrying message came {} ms after its return, before its {BACKOFF_MS} ms step",
            at - nacked_at
        );
        assert_eq!(
            header_i64(&m.delivery.properties, "x-delivery-count"),
            Some(1)
        );
        let body = String::from_utf8(m.delivery.data).unwrap();
        assert!(retried.insert(body.clone()), "{body} twice");
    }

    // the stream: every confirmed message, in order; the named consumer resumes at 100
    let rd = conn.create_channel().await.unwrap();
    rd.basic_qos(1000, BasicQosOptions::default())
        .await
        .unwrap();
    let mut args = FieldTable::default();
    args.insert("x-stream-offset".into(), s("first"));
    let mut c = rd
        .basic_consume(
            "log".into(),
            "all".into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await
        .unwrap();
    let mut first = Vec::new();
    let mut later = BTreeSet::new();
    while first.len() < STREAM_FIRST as usize || !streamed.is_subset(&later) {
        let d = tokio::time::timeout(T, c.next())
            .await
            .expect("every confirmed stream message")
            .unwrap()
            .unwrap();
        let body = String::from_utf8(d.data.clone()).unwrap();
        if let Some(n) = body.strip_prefix("first") {
            first.push(n.parse::<u64>().unwrap());
        } else {
            let n: u64 = body.strip_prefix('s').unwrap().parse().unwrap();
            assert!(later.insert(n), "s{n} twice");
        }
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(first, (0..STREAM_FIRST).collect::<Vec<_>>());
    rd.basic_cancel("all".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    let mut args = FieldTable::default();
    args.insert("x-stream-consumer-name".into(), s("app"));
    let mut c = rd
        .basic_consume(
            "log".into(),
            "app".into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await
        .unwrap();
    let d = tokio::time::timeout(T, c.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(header_i64(&d.properties, "x-stream-offset"), Some(100));
    rd.basic_cancel("app".into(), BasicCancelOptions::default())
        .await
        .unwrap();

    // delayed: every confirmed one, none before it was due
    let mut got = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !delayed.keys().all(|i| got.contains(i)) {
        let m = eventually_async(
            &format!(
                "the next delayed message ({} of {} confirmed arrived)",
                got.len(),
                delayed.len()
            ),
            deadline.saturating_duration_since(Instant::now()),
            async || {
                ch.basic_get("delayed".into(), BasicGetOptions { no_ack: true })
                    .await
                    .unwrap()
            },
        )
        .await;
        let at = now_ms();
        let due = header_i64(&m.delivery.properties, "due").unwrap() as u64;
        assert!(at >= due, "a delayed message came {} ms early", due - at);
        let body = String::from_utf8(m.delivery.data).unwrap();
        got.insert(body.strip_prefix('d').unwrap().parse::<u64>().unwrap());
    }

    // half messages: the committed ones, once each; no unresolved or rolled-back one
    let mut orders = Vec::new();
    while let Some(m) = ch
        .basic_get("orders".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        orders.push(String::from_utf8(m.delivery.data).unwrap());
    }
    orders.sort();
    let mut want: Vec<String> = (0..10).map(|i| format!("h{i}")).collect();
    want.sort();
    assert_eq!(orders, want, "committed ones once; nothing uncommitted");
    // the unresolved ones are still half: a commit now makes exactly that one visible
    let cc = conn.create_channel().await.unwrap();
    cc.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    publish(
        &cc,
        "amq.triad.txn",
        "",
        b"",
        props(&[("x-txn", s("commit"))], Some("h15")),
    )
    .await;
    let m = ch
        .basic_get("orders".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("h15 once committed");
    assert_eq!(m.delivery.data, b"h15");
    assert!(ch
        .basic_get("orders".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .is_none());
}

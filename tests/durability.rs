//! Durability of the real broker process: persistent messages confirmed to an AMQP
//! publisher survive `kill -9` at a random moment and a clean restart, with nothing
//! confirmed lost; acked messages are not redelivered after a clean restart. The same
//! for AMQP transactions: every message of a transaction whose `tx.commit-ok` arrived
//! survives `kill -9`, and a commit that fails applies none of its publishes and acks.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::amqp::{connect, declare_durable, publish_numbered};
use common::TestBroker;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;

/// Publishes `count` persistent messages numbered from `start` with confirms, keeping
/// up to 64 unconfirmed; records each number once the broker confirmed it. Stops at the
/// first error (the broker was killed).
async fn publish_confirmed(
    addr: std::net::SocketAddr,
    queue: &str,
    start: u64,
    count: u64,
    confirmed: Arc<Mutex<BTreeSet<u64>>>,
) {
    let conn = connect(addr).await.expect("connect");
    let ch = conn.create_channel().await.unwrap();
    declare_durable(&ch, queue).await.unwrap();
    publish_numbered(&ch, queue, start, count, &confirmed, None).await;
}

/// Publishes persistent messages numbered from `start` in transactions of `batch`;
/// records a transaction's numbers once its `tx.commit-ok` arrived. Stops at the first
/// error (the broker was killed).
async fn publish_committed(
    addr: std::net::SocketAddr,
    queue: &str,
    start: u64,
    batch: u64,
    committed: Arc<Mutex<BTreeSet<u64>>>,
) {
    let conn = connect(addr).await.expect("connect");
    let ch = conn.create_channel().await.unwrap();
    declare_durable(&ch, queue).await.unwrap();
    ch.tx_select().await.unwrap();
    for first in (start..start + 1_000_000).step_by(batch as usize) {
        for i in first..first + batch {
            let published = ch
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    &i.to_le_bytes(),
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await;
            if published.is_err() {
                return;
            }
        }
        if ch.tx_commit().await.is_err() {
            return;
        }
        committed.lock().unwrap().extend(first..first + batch);
    }
}

/// Drains a queue, acking; returns the message numbers seen.
async fn drain(addr: std::net::SocketAddr, queue: &str) -> Vec<u64> {
    let conn = connect(addr).await.expect("connect");
    let ch = conn.create_channel().await.unwrap();
    declare_durable(&ch, queue).await.unwrap();
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
    {
        out.push(u64::from_le_bytes(m.delivery.data[..8].try_into().unwrap()));
        m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    conn.close(200, "done".into()).await.unwrap();
    out
}

#[test]
fn kill_9_loses_no_confirmed_persistent_message() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut broker = TestBroker::start();
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    let mut seed = u64::from(std::process::id()) | 1;
    for round in 0..4u64 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let kill_after = Duration::from_millis(150 + seed % 600);
        let addr = broker.amqp_addr();
        let c = confirmed.clone();
        let publisher = rt.spawn(async move {
            publish_confirmed(addr, "durable-q", round * 1_000_000, 1_000_000, c).await
        });
        std::thread::sleep(kill_after);
        broker.kill9();
        rt.block_on(async {
            let _ = tokio::time::timeout(Duration::from_secs(10), publisher).await;
        });
        broker.restart();
    }
    let seen = rt.block_on(drain(broker.amqp_addr(), "durable-q"));
    let seen_set: BTreeSet<u64> = seen.iter().copied().collect();
    let confirmed = confirmed.lock().unwrap().clone();
    assert!(
        !confirmed.is_empty(),
        "nothing was confirmed: the test proved nothing"
    );
    let lost: Vec<_> = confirmed.difference(&seen_set).take(10).collect();
    assert!(
        lost.is_empty(),
        "{} confirmed messages lost, e.g. {lost:?}",
        confirmed.difference(&seen_set).count()
    );
    // nothing was consumed before, so a message can only appear once
    assert_eq!(seen.len(), seen_set.len(), "duplicates after restarts");
}

/// Issue 14 item 12: transactions in the kill -9 test. (A `kill -9` keeps what reached
/// the page cache, so this guards recovery of committed transactions; that commit-ok
/// waits for the fsync is `confirms::tests::commit_waits_for_every_durable_of_its_transaction`.)
#[test]
fn kill_9_loses_no_committed_transaction() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut broker = TestBroker::start();
    let committed = Arc::new(Mutex::new(BTreeSet::new()));
    let mut seed = u64::from(std::process::id()) | 1;
    for round in 0..3u64 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let kill_after = Duration::from_millis(150 + seed % 600);
        let addr = broker.amqp_addr();
        let c = committed.clone();
        let publisher =
            rt.spawn(async move { publish_committed(addr, "tx-q", round * 1_000_000, 7, c).await });
        std::thread::sleep(kill_after);
        broker.kill9();
        rt.block_on(async {
            let _ = tokio::time::timeout(Duration::from_secs(10), publisher).await;
        });
        broker.restart();
    }
    let seen = rt.block_on(drain(broker.amqp_addr(), "tx-q"));
    let seen_set: BTreeSet<u64> = seen.iter().copied().collect();
    let committed = committed.lock().unwrap().clone();
    assert!(
        !committed.is_empty(),
        "nothing was committed: the test proved nothing"
    );
    let lost: Vec<_> = committed.difference(&seen_set).take(10).collect();
    assert!(
        lost.is_empty(),
        "{} committed messages lost, e.g. {lost:?}",
        committed.difference(&seen_set).count()
    );
    assert_eq!(seen.len(), seen_set.len(), "duplicates after restarts");
}

/// Issue 14 item 12: a `tx.commit` that fails (an exchange it publishes to was deleted
/// after the publish) stores none of the transaction's messages and applies none of its
/// acks: the acked delivery comes back, and nothing published before it in the
/// transaction arrives.
#[test]
fn failed_tx_commit_applies_nothing() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let broker = TestBroker::start();
    rt.block_on(async {
        let conn = connect(broker.amqp_addr()).await.expect("connect");
        let setup = conn.create_channel().await.unwrap();
        declare_durable(&setup, "tx-all").await.unwrap();
        declare_durable(&setup, "tx-src").await.unwrap();
        setup
            .exchange_declare(
                "tx-gone".into(),
                lapin::ExchangeKind::Fanout,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        setup
            .basic_publish(
                "".into(),
                "tx-src".into(),
                BasicPublishOptions::default(),
                b"to-ack",
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.tx_select().await.unwrap();
        let got = loop {
            if let Some(m) = ch
                .basic_get("tx-src".into(), BasicGetOptions { no_ack: false })
                .await
                .unwrap()
            {
                break m;
            }
        };
        got.delivery.ack(BasicAckOptions::default()).await.unwrap();
        for ex in ["", "tx-gone"] {
            ch.basic_publish(
                ex.into(),
                "tx-all".into(),
                BasicPublishOptions::default(),
                b"in-tx",
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap();
        }
        setup
            .exchange_delete("tx-gone".into(), ExchangeDeleteOptions::default())
            .await
            .unwrap();
        let err = ch.tx_commit().await.expect_err("commit must fail");
        assert!(err.to_string().contains("NOT_FOUND"), "{err}");
        let check = conn.create_channel().await.unwrap();
        let back = check
            .basic_get("tx-src".into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .expect("the ack of the failed commit was not applied");
        assert_eq!(back.delivery.data, b"to-ack");
        assert!(back.delivery.redelivered);
        let published = check
            .basic_get("tx-all".into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap();
        assert!(
            published.is_none(),
            "a publish of the failed commit was stored"
        );
    });
}

#[test]
fn acked_messages_stay_acked_and_unacked_come_back_after_restart() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut broker = TestBroker::start();
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    rt.block_on(publish_confirmed(
        broker.amqp_addr(),
        "acks",
        0,
        100,
        confirmed.clone(),
    ));
    assert_eq!(confirmed.lock().unwrap().len(), 100);
    // take 40 and ack them, take 10 more without acking, then stop the broker cleanly
    rt.block_on(async {
        let conn = connect(broker.amqp_addr()).await.expect("connect");
        let ch = conn.create_channel().await.unwrap();
        for i in 0..50 {
            let m = ch
                .basic_get("acks".into(), BasicGetOptions { no_ack: false })
                .await
                .unwrap()
                .unwrap();
            if i < 40 {
                m.delivery.ack(BasicAckOptions::default()).await.unwrap();
            }
        }
        // give the acks time to reach the broker before it stops
        ch.basic_qos(1, BasicQosOptions::default()).await.unwrap();
    });
    assert!(broker.terminate().success());
    broker.restart();
    let seen = rt.block_on(drain(broker.amqp_addr(), "acks"));
    assert_eq!(seen, (40..100).collect::<Vec<u64>>());
}

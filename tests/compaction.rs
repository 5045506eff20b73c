//! Commitlog compaction over real sockets: one slow queue holding a few old messages no
//! longer keeps every later segment on disk, and a `kill -9` at any moment of a
//! compaction loses no confirmed message and duplicates none.
//!
//! The broker runs with 64 KiB segments and a retention pass every 200 ms, so that a few
//! megabytes of traffic make dozens of segments and compaction runs all the time.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::amqp;
use common::raw::{env_u64, Rng};
use common::TestBroker;
use futures_util::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation};
use triad_core::testing::eventually_blocking;

const CONFIG: &str = r#"
[store]
segment_size = "64 KiB"
checkpoint_interval = "100ms"
retention_interval = "200ms"

[limits]
max_message_size = "16 KiB"
"#;
const SEGMENT: u64 = 64 << 10;
const SLOW: &str = "slow";
const FAST: &str = "fast";
const BODY: usize = 1024;
const IO_TIMEOUT: Duration = Duration::from_secs(20);

fn body(tag: &str) -> Vec<u8> {
    let mut b = format!("{tag} ").into_bytes();
    b.resize(BODY, b'x');
    b
}

fn tag_of(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .split(' ')
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// Bytes of the commitlog's segment files.
fn log_bytes(data: &Path) -> u64 {
    std::fs::read_dir(data.join("commitlog"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

async fn setup(ch: &Channel) {
    for q in [SLOW, FAST] {
        amqp::declare_durable(ch, q).await.unwrap();
    }
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
}

/// Consumes `fast` and acks everything, counting, until the connection goes.
async fn fast_consumer(broker_addr: std::net::SocketAddr, acked: Arc<AtomicU64>) {
    let Ok(conn) = amqp::connect(broker_addr).await else {
        return;
    };
    let Ok(ch) = conn.create_channel().await else {
        return;
    };
    if amqp::declare_durable(&ch, FAST).await.is_err()
        || ch.basic_qos(200, BasicQosOptions::default()).await.is_err()
    {
        return;
    }
    let Ok(mut consumer) = ch
        .basic_consume(
            FAST.into(),
            "fast".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
    else {
        return;
    };
    while let Some(Ok(d)) = consumer.next().await {
        if d.ack(BasicAckOptions::default()).await.is_err() {
            return;
        }
        acked.fetch_add(1, Ordering::Relaxed);
    }
}

/// Publishes `n` messages to `fast`, every `every`-th one also to `slow` (tagged
/// `<prefix>-<seq>`), with confirms, keeping 64 in flight; returns the tags of the slow
/// ones confirmed and the number attempted. Stops early when `stop` is set or the
/// connection fails (the broker was killed).
async fn publish(
    ch: &Channel,
    prefix: &str,
    n: u64,
    every: u64,
    stop: &AtomicBool,
) -> (Vec<String>, Vec<String>) {
    let mut pending = std::collections::VecDeque::new();
    let (mut confirmed, mut sent) = (Vec::new(), Vec::new());
    for i in 0..n {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let (queue, tag) = if i % every == 0 {
            (SLOW, format!("{prefix}-{i}"))
        } else {
            (FAST, format!("{prefix}-fast-{i}"))
        };
        let Ok(c) = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &body(&tag),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
        else {
            return (confirmed, sent);
        };
        if queue == SLOW {
            sent.push(tag.clone());
        }
        pending.push_back((queue, tag, c));
        while pending.len() > 64 || (i + 1 == n && !pending.is_empty()) {
            let (queue, tag, c) = pending.pop_front().unwrap();
            match tokio::time::timeout(IO_TIMEOUT, c).await {
                Ok(Ok(Confirmation::Ack(_))) if queue == SLOW => confirmed.push(tag),
                Ok(Ok(Confirmation::Ack(_))) => {}
                _ => return (confirmed, sent),
            }
        }
    }
    (confirmed, sent)
}

#[test]
fn one_slow_queue_does_not_pin_the_log() {
    const MESSAGES: u64 = 4000;
    const EVERY: u64 = 100;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut broker = TestBroker::start_with_config(CONFIG);
    let addr = broker.amqp_addr();
    let acked = Arc::new(AtomicU64::new(0));
    let consumer = rt.spawn(fast_consumer(addr, acked.clone()));
    let confirmed = rt.block_on(async {
        let conn = amqp::connect(addr).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        setup(&ch).await;
        let (confirmed, sent) =
            publish(&ch, "slow", MESSAGES, EVERY, &AtomicBool::new(false)).await;
        assert_eq!(confirmed, sent, "every publish confirmed");
        conn.close(200, "done".into()).await.unwrap();
        confirmed
    });
    let written = (MESSAGES * (BODY as u64 + 100)) / SEGMENT;
    assert!(written > 40, "{written} segments' worth written");
    // Live: the slow queue's messages (body plus record and envelope overhead, generously).
    let live = confirmed.len() as u64 * (BODY as u64 + 512);
    let bound = 2 * live + 2 * SEGMENT;
    eventually_blocking(
        "the fast consumer done and the log within its bound",
        Duration::from_secs(60),
        || {
            let fast_done = acked.load(Ordering::Relaxed) >= MESSAGES - confirmed.len() as u64;
            let bytes = log_bytes(broker.data_dir());
            if fast_done && bytes <= bound {
                return Ok(());
            }
            Err(format!(
                "the log holds {bytes} bytes ({} segments) for {live} live bytes (bound {bound}); \
                 fast consumer acked {}",
                bytes / SEGMENT,
                acked.load(Ordering::Relaxed)
            ))
        },
    );
    assert!(
        !broker
            .data_dir()
            .join("commitlog")
            .join(format!("{:020}", 0))
            .exists(),
        "the first segment (holding the slow queue's first message) is gone"
    );
    consumer.abort();
    // Every slow message, exactly once, after a kill -9 in the middle of all this.
    broker.kill9();
    broker.restart();
    let drained = rt.block_on(amqp::drain(broker.amqp_addr(), SLOW, IO_TIMEOUT));
    let tags: Vec<String> = drained.iter().map(|b| tag_of(b)).collect();
    assert_eq!(tags, confirmed);
    for b in &drained {
        assert_eq!(b, &body(&tag_of(b)));
    }
}

#[test]
fn kill9_during_compaction_loses_and_duplicates_nothing() {
    let rounds = env_u64("TRIAD_COMPACTION_ROUNDS", 6);
    let seed = Rng::seed_from_env("TRIAD_COMPACTION_SEED");
    println!("compaction crash loop: {rounds} rounds, seed {seed}");
    let mut rng = Rng::new(seed);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut broker = TestBroker::start_with_config(CONFIG);
    let mut confirmed_all: Vec<String> = Vec::new();
    let mut sent_all: Vec<String> = Vec::new();
    for round in 0..rounds {
        let addr = broker.amqp_addr();
        let acked = Arc::new(AtomicU64::new(0));
        let consumer = rt.spawn(fast_consumer(addr, acked.clone()));
        let stop = Arc::new(AtomicBool::new(false));
        let publisher = {
            let stop = stop.clone();
            rt.spawn(async move {
                let conn = amqp::connect(addr).await.unwrap();
                let ch = conn.create_channel().await.unwrap();
                setup(&ch).await;
                publish(&ch, &format!("r{round}"), 1_000_000, 10, &stop).await
            })
        };
        // the kill comes while publishing, consuming and compacting are all under way
        let kill_after = Duration::from_millis(rng.range(400, 2500));
        std::thread::sleep(kill_after);
        broker.kill9();
        stop.store(true, Ordering::Relaxed);
        let (confirmed, sent) = rt.block_on(publisher).unwrap();
        consumer.abort();
        println!(
            "round {round}: killed after {kill_after:?}, {} slow confirmed of {} sent, {} fast acked",
            confirmed.len(),
            sent.len(),
            acked.load(Ordering::Relaxed)
        );
        confirmed_all.extend(confirmed);
        sent_all.extend(sent);
        broker.restart();
    }
    assert!(
        !broker
            .data_dir()
            .join("commitlog")
            .join(format!("{:020}", 0))
            .exists(),
        "compaction ran: the first segment is gone though the slow queue still holds its messages"
    );
    let drained = rt.block_on(amqp::drain(broker.amqp_addr(), SLOW, IO_TIMEOUT));
    let mut counts: HashMap<String, u64> = HashMap::new();
    for b in &drained {
        assert_eq!(b, &body(&tag_of(b)), "body intact");
        *counts.entry(tag_of(b)).or_default() += 1;
    }
    let lost: Vec<&String> = confirmed_all
        .iter()
        .filter(|t| !counts.contains_key(*t))
        .collect();
    assert!(
        lost.is_empty(),
        "confirmed and lost (seed {seed}): {lost:?}"
    );
    let dups: BTreeMap<&String, &u64> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        dups.is_empty(),
        "stored more than once (seed {seed}): {dups:?}"
    );
    let bogus: Vec<&String> = counts.keys().filter(|t| !sent_all.contains(t)).collect();
    assert!(bogus.is_empty(), "never sent: {bogus:?}");
    assert!(
        confirmed_all.len() > 100,
        "the test confirmed too little to prove anything"
    );
}

/// A queue removed by `x-expires` frees the disk its messages held.
#[test]
fn an_expired_queue_frees_its_disk() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let broker = TestBroker::start_with_config(CONFIG);
    let addr = broker.amqp_addr();
    rt.block_on(async {
        let conn = amqp::connect(addr).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        let mut args = FieldTable::default();
        args.insert("x-expires".into(), lapin::types::AMQPValue::LongInt(1500));
        amqp::declare_durable_with(&ch, "expiring", args)
            .await
            .unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let mut pending = Vec::new();
        for i in 0..2000 {
            let c = ch
                .basic_publish(
                    "".into(),
                    "expiring".into(),
                    BasicPublishOptions::default(),
                    &body(&format!("e-{i}")),
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap();
            pending.push(c);
        }
        for c in pending {
            assert!(matches!(c.await.unwrap(), Confirmation::Ack(_)));
        }
        conn.close(200, "done".into()).await.unwrap();
    });
    let written = log_bytes(broker.data_dir());
    assert!(written > 20 * SEGMENT, "{written} bytes of log written");
    eventually_blocking(
        "the log back to 2 segments after the queue expired",
        Duration::from_secs(30),
        || match log_bytes(broker.data_dir()) {
            bytes if bytes > 2 * SEGMENT => Err(format!("the log still holds {bytes} bytes")),
            _ => Ok(()),
        },
    );
    // and the queue is gone
    rt.block_on(async {
        let conn = amqp::connect(addr).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        let r = ch
            .queue_declare(
                "expiring".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await;
        assert!(r.is_err(), "expired queue still declared: {r:?}");
    });
}

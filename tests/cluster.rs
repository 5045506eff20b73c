//! Replication, phase 1 (issue 18), with the real binary: a leader and two followers
//! configured statically (`[cluster] role = leader|follower`), confirmed publishing in
//! `replication.mode = sync`, `kill -9` of the leader, and each follower's data directory
//! started as a standalone broker: every confirmed message is there (duplicates counted).
//! And sync mode without enough replicas nacks, never confirms falsely.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::amqp::{connect, declare_durable, declare_durable_with, drain, publish_numbered};
use common::cluster::{api, follower, in_sync_count, leader_config, Proc, T};
use common::{ephemeral_listen_args, TestBroker, TEST_CONFIG};
use lapin::options::*;
use triad_core::testing::eventually_blocking;

/// Publishes persistent messages numbered from `start` with confirms (64 in flight);
/// records each confirmed number, and each nacked one in `nacked`. Stops at the first
/// connection error (the leader was killed) or after `count`.
async fn publish(
    addr: SocketAddr,
    queue: &str,
    start: u64,
    count: u64,
    confirmed: Arc<Mutex<BTreeSet<u64>>>,
    nacked: Arc<Mutex<BTreeSet<u64>>>,
) {
    let Ok(conn) = connect(addr).await.map_err(|_| ()) else {
        return;
    };
    let ch = conn.create_channel().await.unwrap();
    declare_durable(&ch, queue).await.unwrap();
    publish_numbered(&ch, queue, start, count, &confirmed, Some(&nacked)).await;
}

fn numbers(bodies: &[Vec<u8>]) -> Vec<u64> {
    bodies
        .iter()
        .map(|b| u64::from_le_bytes(b.as_slice().try_into().unwrap()))
        .collect()
}

#[test]
fn every_message_confirmed_in_sync_mode_survives_kill_9_of_the_leader_on_each_follower() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let root = tempfile::tempdir().unwrap();
    // min_insync = 3: a confirm means both followers have the message on disk
    let mut leader = TestBroker::start_with_config(&leader_config(3));
    let repl = leader.addr("replication");
    let (mut fa, dir_a) = follower(root.path(), "fa", repl);
    let (mut fb, dir_b) = follower(root.path(), "fb", repl);
    eventually_blocking("both followers in sync", T, || in_sync_count(&leader) == 2);

    // a first batch, all confirmed, then one still in flight when the leader dies
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    let nacked = Arc::new(Mutex::new(BTreeSet::new()));
    let addr = leader.amqp_addr();
    rt.block_on(publish(
        addr,
        "rq",
        0,
        2_000,
        confirmed.clone(),
        nacked.clone(),
    ));
    assert_eq!(confirmed.lock().unwrap().len(), 2_000, "all confirmed");
    let publisher = {
        let (c, n) = (confirmed.clone(), nacked.clone());
        rt.spawn(async move { publish(addr, "rq", 1_000_000, 1_000_000, c, n).await })
    };
    eventually_blocking("more confirms in flight", T, || {
        confirmed.lock().unwrap().len() > 2_500
    });
    leader.kill9();
    rt.block_on(async {
        let _ = tokio::time::timeout(Duration::from_secs(10), publisher).await;
    });
    let confirmed = confirmed.lock().unwrap().clone();
    assert!(
        nacked.lock().unwrap().is_empty(),
        "nothing nacked while both were in sync"
    );
    // each follower, promoted by hand: stopped, its directory opened as a broker
    fa.kill9();
    fb.kill9();
    for (name, dir) in [("fa", &dir_a), ("fb", &dir_b)] {
        let config = root.path().join(format!("{name}-standalone.toml"));
        std::fs::write(&config, TEST_CONFIG).unwrap();
        let mut b = Proc::start(
            &format!("{name} standalone"),
            dir,
            &config,
            &ephemeral_listen_args(),
        );
        b.wait_for_log("broker ready", T);
        let got = numbers(&rt.block_on(drain(b.addr("amqp"), "rq", T)));
        let got_set: BTreeSet<u64> = got.iter().copied().collect();
        let missing: Vec<_> = confirmed.difference(&got_set).take(10).collect();
        assert!(
            missing.is_empty(),
            "{name}: confirmed messages missing (first few): {missing:?}"
        );
        let duplicates = got.len() - got_set.len();
        eprintln!(
            "{name}: {} confirmed, {} consumed, {duplicates} duplicates, {} unconfirmed extra",
            confirmed.len(),
            got.len(),
            got_set.difference(&confirmed).count()
        );
        assert_eq!(duplicates, 0, "{name}: duplicates");
    }
}

#[test]
fn sync_mode_nacks_without_enough_replicas_and_confirms_again_once_one_rejoins() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let root = tempfile::tempdir().unwrap();
    let leader = TestBroker::start_with_config(&leader_config(2));
    let addr = leader.amqp_addr();
    let run = |start: u64, count: u64| {
        let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
        let nacked = Arc::new(Mutex::new(BTreeSet::new()));
        rt.block_on(publish(
            addr,
            "nq",
            start,
            count,
            confirmed.clone(),
            nacked.clone(),
        ));
        let c = confirmed.lock().unwrap().len();
        let n = nacked.lock().unwrap().len();
        (c, n)
    };
    // no follower yet: every publish is nacked
    assert_eq!(run(0, 50), (0, 50));
    let repl = leader.addr("replication");
    let (mut fa, dir_a) = follower(root.path(), "fa", repl);
    let (mut fb, _) = follower(root.path(), "fb", repl);
    eventually_blocking("both in sync", T, || in_sync_count(&leader) == 2);
    assert_eq!(run(100, 200), (200, 0));
    // both followers stopped: nacks, never a false confirm
    fa.kill9();
    fb.kill9();
    eventually_blocking("both gone", T, || {
        leader.log().matches("follower disconnected").count() == 2
    });
    assert_eq!(run(1_000, 100), (0, 100));
    // one comes back (the same directory): confirms again
    let config = root.path().join("fa.toml");
    let mut fa = Proc::start("fa again", &dir_a, &config, &[]);
    fa.wait_for_log("follower: connected to the leader", T);
    eventually_blocking("fa in sync again", T, || in_sync_count(&leader) == 1);
    assert_eq!(run(2_000, 100), (100, 0));
    fa.kill9();
}

/// The other two protocols' refusal when too few replicas are in sync: STOMP answers
/// an ERROR instead of the RECEIPT and closes, MQTT closes the connection without a
/// PUBACK (3.1.1 has no negative PUBACK). Neither confirms.
#[test]
fn sync_mode_without_replicas_refuses_stomp_receipts_and_mqtt_pubacks() {
    use common::raw::{MqttClient, StompClient};
    let leader = TestBroker::start_with_config(&leader_config(2));
    let mut stomp = StompClient::connect(leader.stomp_addr(), T).unwrap();
    stomp
        .send(
            "SEND",
            &[
                ("destination", "/queue/sq"),
                ("persistent", "true"),
                ("receipt", "r1"),
            ],
            b"hello",
        )
        .unwrap();
    let f = stomp.read_frame().unwrap();
    assert_eq!(f.command, "ERROR", "{f:?}");
    assert!(
        f.header("message")
            .is_some_and(|m| m.contains("internal error")),
        "{f:?}"
    );
    assert!(stomp.read_frame().is_err(), "closed after the ERROR");

    // a persistent MQTT session needs a stored record: refused with CONNACK 3
    // (server unavailable), not accepted and lost
    let r = MqttClient::connect(leader.mqtt_addr(), "sub", false, T);
    let err = r.err().expect("refused").to_string();
    assert!(err.contains("body: [0, 3]"), "{err}");
    // a durable queue bound to amq.topic, so the QoS 1 publish is stored
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let conn = connect(leader.amqp_addr()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        declare_durable(&ch, "mq").await.unwrap();
        ch.queue_bind(
            "mq".into(),
            "amq.topic".into(),
            "t.x".into(),
            QueueBindOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    });
    let mut publisher = MqttClient::connect(leader.mqtt_addr(), "pub", true, T).unwrap();
    publisher.stream.set_read_timeout(Some(T)).unwrap();
    publisher.publish("t/x", 1, 7, b"m").unwrap();
    let r = publisher.read_until(0x40);
    assert!(r.is_err(), "no PUBACK, the connection closed: {r:?}");
    leader.wait_for_log("not enough replicas in sync", T);
}

/// Small segments, so that a test fills and deletes a few dozen.
const SMALL_SEGMENTS: &str =
    "[store]\nsegment_size = \"256 KiB\"\n\n[limits]\nmax_message_size = \"64 KiB\"\n";

/// Commitlog segment files in a data directory.
fn segment_files(data: &std::path::Path) -> usize {
    std::fs::read_dir(data.join("commitlog"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Publishes `n` persistent 8 KiB messages to `queue` with confirms, all acked.
async fn publish_8k(ch: &lapin::Channel, queue: &str, n: usize) {
    let body = vec![0x5au8; 8 << 10];
    let mut pending = Vec::with_capacity(n);
    for _ in 0..n {
        let c = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &body,
                lapin::BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap();
        pending.push(c);
    }
    for c in pending {
        assert!(c.await.unwrap().is_ack(), "confirmed");
    }
}

/// A follower deletes the segments its leader's retention and compaction delete (once
/// it holds the copies and the ack states that let them go), so its disk follows the
/// leader's instead of growing with everything ever written; promoted, it finds every
/// message still live and none that was acked.
#[test]
fn a_follower_deletes_what_the_leaders_retention_deletes_and_its_promotion_finds_the_rest() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let root = tempfile::tempdir().unwrap();
    let mut leader = TestBroker::start_with_config(&format!(
        "{SMALL_SEGMENTS}\n[cluster]\nrole = \"leader\"\nnode_id = \"l\"\nlisten = \"127.0.0.1:0\"\n\
         [replication]\nmode = \"sync\"\nmin_insync = 2\nreplica_lag_max = \"16 MiB\"\n"
    ));
    let repl = leader.addr("replication");
    let config = root.path().join("fa.toml");
    std::fs::write(
        &config,
        format!("{SMALL_SEGMENTS}\n[cluster]\nrole = \"follower\"\nnode_id = \"fa\"\nleader = \"{repl}\"\n"),
    )
    .unwrap();
    let dir_a = root.path().join("fa");
    let mut fa = Proc::start("fa", &dir_a, &config, &[]);
    fa.wait_for_log("follower: connected to the leader", T);
    eventually_blocking("the follower in sync", T, || in_sync_count(&leader) == 1);

    // ten messages nobody reads, in the first segment; then 8 MiB through a queue a
    // consumer keeps empty: about 32 segments written
    let addr = leader.amqp_addr();
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    rt.block_on(async {
        let conn = connect(addr).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        declare_durable(&ch, "slow").await.unwrap();
        declare_durable(&ch, "fast").await.unwrap();
        publish_numbered(&ch, "slow", 0, 10, &confirmed, None).await;
        for _ in 0..5 {
            publish_8k(&ch, "fast", 200).await;
            assert_eq!(drain(addr, "fast", T).await.len(), 200);
        }
    });
    assert_eq!(confirmed.lock().unwrap().len(), 10);
    let written: u64 = {
        let s = api(leader.addr("http"), "/api/cluster");
        s["log_end"].as_u64().unwrap()
    };
    assert!(written > 30 * (256 << 10), "wrote {written} bytes");
    // the leader keeps a few segments; so does the follower, once told
    eventually_blocking("the follower deleted what the leader deleted", T, || {
        let (l, f) = (segment_files(leader.data_dir()), segment_files(&dir_a));
        l <= 4 && f <= l + 2
    });
    assert!(fa.count("replica: deleted the segments the leader's retention deleted") > 0);
    eprintln!(
        "{written} bytes written in segments of 256 KiB; on disk: leader {} segments, \
         follower {}",
        segment_files(leader.data_dir()),
        segment_files(&dir_a)
    );

    // promoted by hand: every live message, nothing acked
    leader.kill9();
    fa.kill9();
    let standalone = root.path().join("fa-standalone.toml");
    std::fs::write(&standalone, SMALL_SEGMENTS).unwrap();
    let mut b = Proc::start(
        "fa standalone",
        &dir_a,
        &standalone,
        &ephemeral_listen_args(),
    );
    b.wait_for_log("broker ready", T);
    let slow = numbers(&rt.block_on(drain(b.addr("amqp"), "slow", T)));
    assert_eq!(slow, (0..10).collect::<Vec<u64>>());
    assert!(rt.block_on(drain(b.addr("amqp"), "fast", T)).is_empty());
}

/// In sync mode a consumer gets a message only once `min_insync` replicas hold it, as
/// its confirm waits for (RabbitMQ's quorum queues deliver only what is committed): with
/// the one follower stopped (SIGSTOP), a message published without confirms is not
/// delivered; once the follower runs again and holds it, it is.
#[test]
fn in_sync_mode_a_consumer_gets_a_message_only_once_enough_replicas_hold_it() {
    a_consumer_waits_for_the_replicas(false);
}

#[test]
fn in_sync_mode_a_stream_consumer_reads_an_entry_only_once_enough_replicas_hold_it() {
    a_consumer_waits_for_the_replicas(true);
}

/// With `min_insync = 2` and the one follower stopped (SIGSTOP), a message is published
/// (the leader holds it) but not delivered, from a classic queue or a `stream`; once the
/// follower runs again it is.
fn a_consumer_waits_for_the_replicas(stream: bool) {
    use futures_util::StreamExt;
    use lapin::types::{AMQPValue, FieldTable, LongString};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let root = tempfile::tempdir().unwrap();
    let leader = TestBroker::start_with_config(&leader_config(2));
    let (fa, _dir) = follower(root.path(), "fa", leader.addr("replication"));
    eventually_blocking("the follower in sync", T, || in_sync_count(&leader) == 1);
    let addr = leader.amqp_addr();
    let http = leader.addr("http");
    rt.block_on(async {
        let conn = connect(addr).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        let mut consume_args = FieldTable::default();
        if stream {
            let mut args = FieldTable::default();
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString(LongString::from("stream")),
            );
            declare_durable_with(&ch, "dq", args).await.unwrap();
            ch.basic_qos(10, BasicQosOptions::default()).await.unwrap();
            consume_args.insert(
                "x-stream-offset".into(),
                AMQPValue::LongString(LongString::from("first")),
            );
        } else {
            declare_durable(&ch, "dq").await.unwrap();
        }
        let mut consumer = ch
            .basic_consume(
                "dq".into(),
                "c".into(),
                BasicConsumeOptions::default(),
                consume_args,
            )
            .await
            .unwrap();
        let send = |n: u64| {
            let ch = ch.clone();
            async move {
                ch.basic_publish(
                    "".into(),
                    "dq".into(),
                    BasicPublishOptions::default(),
                    &n.to_le_bytes(),
                    lapin::BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap();
            }
        };
        // with the follower running: delivered
        send(1).await;
        let d = tokio::time::timeout(T, consumer.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(d.data, 1u64.to_le_bytes());
        d.ack(BasicAckOptions::default()).await.unwrap();

        fa.signal("-STOP");
        send(2).await;
        // published (the leader's log grew past what the follower holds), not delivered
        eventually_blocking("the leader holds the message", T, || {
            let s = api(http, "/api/cluster");
            s["log_end"].as_u64() > s["replicated_offset"].as_u64()
        });
        let early = tokio::time::timeout(Duration::from_millis(1500), consumer.next()).await;
        assert!(
            early.is_err(),
            "delivered before a replica held it: {early:?}"
        );
        fa.signal("-CONT");
        let d = tokio::time::timeout(T, consumer.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(d.data, 2u64.to_le_bytes());
    });
    drop(fa);
}

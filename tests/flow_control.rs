//! Issue 19: publisher flow control applies alike to AMQP, STOMP and MQTT. One slow
//! consumer (an AMQP consumer with prefetch 1 that never acks) lets its queue fall
//! behind; then an AMQP publisher with confirms, a STOMP publisher with receipts and an
//! MQTT QoS 1 publisher each have their acknowledgements held back by it.
//!
//! The hold is bounded (`FLOW_MAX_WAIT`, 1 s, in each adapter), and the consumer here
//! never acks: so each acknowledged publish to the throttled queue takes at least that
//! long. Only a lower bound on time is asserted (a slow machine makes it longer, never
//! shorter).

#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::raw::{MqttClient, StompClient};
use common::TestBroker;
use futures_util::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use triad_core::testing::eventually_async;

const T: Duration = Duration::from_secs(30);
/// Each adapter's `FLOW_MAX_WAIT`.
const FLOW_MAX_WAIT: Duration = Duration::from_secs(1);
/// Acknowledged publishes per protocol while the queue is throttled.
const HELD: u32 = 2;
/// What the queue holds before the publishers start: well past `FLOW_HIGH` (64)
/// beyond the consumer's credit (prefetch 1).
const BACKLOG: u32 = 80;

fn assert_held(proto: &str, took: Duration) {
    let least = FLOW_MAX_WAIT * HELD - Duration::from_millis(100);
    assert!(
        took >= least,
        "{proto}: {HELD} acknowledged publishes to the throttled queue took {took:?}, \
         less than {least:?}: the publisher was not held back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slow_consumer_holds_back_amqp_stomp_and_mqtt_publishers() {
    let broker = TestBroker::start();
    let amqp = broker.amqp_addr();

    // the slow consumer: takes one message and never acks it
    let consumer_conn = common::amqp::connect(amqp).await.unwrap();
    let cch = consumer_conn.create_channel().await.unwrap();
    cch.queue_declare(
        "flow-slow".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    cch.queue_bind(
        "flow-slow".into(),
        "amq.topic".into(),
        "flow.slow".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    cch.basic_qos(1, BasicQosOptions::default()).await.unwrap();
    let mut consumer = cch
        .basic_consume(
            "flow-slow".into(),
            "slow".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();

    // the backlog, from a connection that then goes away
    let filler = common::amqp::connect(amqp).await.unwrap();
    let fch = filler.create_channel().await.unwrap();
    for i in 0..BACKLOG {
        fch.basic_publish(
            "amq.topic".into(),
            "flow.slow".into(),
            BasicPublishOptions::default(),
            format!("backlog {i}").as_bytes(),
            BasicProperties::default(),
        )
        .await
        .unwrap();
    }
    let first = tokio::time::timeout(T, consumer.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.data, b"backlog 0");
    eventually_async("the backlog to be queued", T, async || {
        fch.queue_declare(
            "flow-slow".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap()
        .message_count()
            == BACKLOG - 1
    })
    .await;
    filler.close(200, "done".into()).await.unwrap();

    // AMQP: a publisher with confirms
    let conn = common::amqp::connect(amqp).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let start = Instant::now();
    for i in 0..HELD {
        let confirm = ch
            .basic_publish(
                "amq.topic".into(),
                "flow.slow".into(),
                BasicPublishOptions::default(),
                format!("amqp {i}").as_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap();
        let c = tokio::time::timeout(T, confirm).await.unwrap().unwrap();
        assert!(c.is_ack(), "{c:?}");
    }
    assert_held("AMQP", start.elapsed());

    // STOMP: a publisher with receipts; MQTT: QoS 1 (blocking clients)
    let stomp = broker.stomp_addr();
    let mqtt = broker.mqtt_addr();
    let (stomp_took, mqtt_took) = tokio::task::spawn_blocking(move || {
        let mut s = StompClient::connect(stomp, T).unwrap();
        let start = Instant::now();
        for i in 0..HELD {
            let r = format!("r{i}");
            s.send(
                "SEND",
                &[("destination", "/topic/flow.slow"), ("receipt", &r)],
                format!("stomp {i}").as_bytes(),
            )
            .unwrap();
            let f = s.read_frame().unwrap();
            assert_eq!(f.command, "RECEIPT", "{f:?}");
        }
        let stomp_took = start.elapsed();

        let mut m = MqttClient::connect(mqtt, "flow-publisher", true, T).unwrap();
        let _ = m.stream.set_read_timeout(Some(T));
        let start = Instant::now();
        for i in 0..HELD {
            let pkid = u16::try_from(i + 1).unwrap();
            m.publish("flow/slow", 1, pkid, format!("mqtt {i}").as_bytes())
                .unwrap();
            let p = m.read_packet().unwrap();
            assert_eq!(
                (p.kind(), p.pkid()),
                (4, Some(pkid)),
                "PUBACK expected: {p:?}"
            );
        }
        (stomp_took, start.elapsed())
    })
    .await
    .unwrap();
    assert_held("STOMP", stomp_took);
    assert_held("MQTT", mqtt_took);

    // everything reached the queue: the holds delay, they do not drop
    eventually_async("every publish to be queued", T, async || {
        ch.queue_declare(
            "flow-slow".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap()
        .message_count()
            == BACKLOG - 1 + 3 * HELD
    })
    .await;
    drop(consumer);
    consumer_conn.close(200, "done".into()).await.unwrap();
}

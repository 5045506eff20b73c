//! Resource alarms over AMQP: while one is raised, publishers get connection.blocked and
//! are not read from, consumers keep draining; clearing it releases them, nothing lost.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

mod common;

use std::time::Duration;

use common::Server;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use triad_core::testing::eventually;
use triad_core::Alarms;

const T: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alarm_blocks_publishers_and_clearing_releases_them() {
    let s = Server::start().await;
    let publisher = s.connect().await;
    let consumer_conn = s.connect().await;
    let pch = publisher.create_channel().await.unwrap();
    pch.queue_declare(
        "alarmed".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let cch = consumer_conn.create_channel().await.unwrap();
    let mut c = cch
        .basic_consume(
            "alarmed".into(),
            "c".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();

    s.broker.set_alarms(Alarms {
        memory: false,
        disk: true,
    });
    // a connection is told once it publishes (RabbitMQ: publishing connections only)
    pch.basic_publish(
        "".into(),
        "alarmed".into(),
        BasicPublishOptions::default(),
        b"first",
        BasicProperties::default(),
    )
    .await
    .unwrap();
    eventually("the publisher blocked", T, || publisher.status().blocked()).await;
    assert!(!consumer_conn.status().blocked());
    // what the publisher sent before it learnt it was blocked may have been read; after
    // that, clients hold their publishes (lapin does, as RabbitMQ's clients do) and the
    // broker does not read from the publisher until the alarm clears
    let publishing = tokio::spawn(async move {
        for i in 0..5u8 {
            pch.basic_publish(
                "".into(),
                "alarmed".into(),
                BasicPublishOptions::default(),
                &[i],
                BasicProperties::default(),
            )
            .await
            .unwrap();
        }
        pch
    });
    let mut got: Vec<Vec<u8>> = Vec::new();
    // consumers keep draining meanwhile
    while let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_millis(700), c.next()).await {
        got.push(d.data);
    }
    assert!(
        got.len() <= 1,
        "a blocked publisher's messages came in: {got:?}"
    );

    s.broker.set_alarms(Alarms::default());
    eventually("the publisher unblocked", T, || {
        !publisher.status().blocked()
    })
    .await;
    tokio::time::timeout(Duration::from_secs(5), publishing)
        .await
        .unwrap()
        .unwrap();
    while got.len() < 6 {
        let d = tokio::time::timeout(Duration::from_secs(5), c.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        got.push(d.data);
    }
    let expect: Vec<Vec<u8>> = std::iter::once(b"first".to_vec())
        .chain((0..5u8).map(|i| vec![i]))
        .collect();
    assert_eq!(got, expect, "nothing lost, in order");
}

/// Connections opened while an alarm is raised: one that only consumes is not told it is
/// blocked and drains the queue; one that publishes is blocked (regression: the AMQP
/// driver used to learn of alarms only when they changed, so a publisher that connected
/// during an alarm was never blocked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_opened_during_an_alarm() {
    let s = Server::start().await;
    let publisher = s.connect().await;
    let pch = publisher.create_channel().await.unwrap();
    pch.queue_declare(
        "backlog".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    // confirmed, so the broker has read them before the alarm stops reading this publisher
    pch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for i in 0..3u8 {
        pch.basic_publish(
            "".into(),
            "backlog".into(),
            BasicPublishOptions::default(),
            &[i],
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    s.broker.set_alarms(Alarms {
        memory: true,
        disk: false,
    });
    eventually("the publisher blocked", T, || publisher.status().blocked()).await;

    let consumer_conn = s.connect().await;
    let cch = tokio::time::timeout(Duration::from_secs(5), consumer_conn.create_channel())
        .await
        .expect("channel.open answered during the alarm")
        .unwrap();
    let mut c = tokio::time::timeout(
        Duration::from_secs(5),
        cch.basic_consume(
            "backlog".into(),
            "late".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .expect("basic.consume answered during the alarm")
    .unwrap();
    let mut got = Vec::new();
    while got.len() < 3 {
        let d = tokio::time::timeout(Duration::from_secs(5), c.next())
            .await
            .expect("delivery during the alarm")
            .unwrap()
            .unwrap();
        got.push(d.data);
    }
    assert_eq!(got, vec![vec![0u8], vec![1], vec![2]]);
    assert!(!consumer_conn.status().blocked());

    let late = s.connect().await;
    let lch = late.create_channel().await.unwrap();
    lch.basic_publish(
        "".into(),
        "backlog".into(),
        BasicPublishOptions::default(),
        b"late",
        BasicProperties::default(),
    )
    .await
    .unwrap();
    eventually("the late publisher blocked", T, || late.status().blocked()).await;
    s.broker.set_alarms(Alarms::default());
    eventually("the late publisher unblocked", T, || {
        !late.status().blocked()
    })
    .await;
    let d = tokio::time::timeout(Duration::from_secs(5), c.next())
        .await
        .expect("the late publisher's message after the alarm")
        .unwrap()
        .unwrap();
    assert_eq!(d.data, b"late");
}

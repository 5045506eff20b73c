//! Whole-adapter tests: lapin over loopback sockets against `serve()`.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

mod common;

use std::time::Duration;

use common::Server;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Confirmation, ExchangeKind};
use triad_core::testing::{eventually, eventually_async};

const T: Duration = Duration::from_secs(10);

async fn next(c: &mut lapin::Consumer) -> lapin::message::Delivery {
    tokio::time::timeout(T, c.next())
        .await
        .expect("delivery timeout")
        .expect("stream ended")
        .expect("delivery error")
}

fn err_text(e: lapin::Error) -> String {
    format!("{e} {e:?}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_bind_publish_consume_ack() {
    let s = Server::start().await;
    let conn = s.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        "ex".into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let q = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert!(q.name().as_str().starts_with("amq.gen"));
    ch.queue_bind(
        q.name().clone(),
        "ex".into(),
        "a.*".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let mut c = ch
        .basic_consume(
            q.name().clone(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut headers = FieldTable::default();
    headers.insert("h".into(), AMQPValue::LongString(LongString::from("v")));
    let props = BasicProperties::default()
        .with_content_type("text/plain".into())
        .with_headers(headers.clone());
    ch.basic_publish(
        "ex".into(),
        "a.b".into(),
        BasicPublishOptions::default(),
        b"hello",
        props,
    )
    .await
    .unwrap();
    let d = next(&mut c).await;
    assert_eq!(d.data, b"hello");
    assert_eq!(d.routing_key.as_str(), "a.b");
    assert_eq!(d.exchange.as_str(), "ex");
    assert_eq!(
        d.properties.content_type().as_ref().unwrap().as_str(),
        "text/plain"
    );
    assert_eq!(d.properties.headers().as_ref().unwrap(), &headers);
    assert!(!d.redelivered);
    d.ack(BasicAckOptions::default()).await.unwrap();
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_limits_unacked_deliveries() {
    let s = Server::start().await;
    let conn = s.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "pf".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    for i in 0..5u8 {
        ch.basic_publish(
            "".into(),
            "pf".into(),
            BasicPublishOptions::default(),
            &[i],
            BasicProperties::default(),
        )
        .await
        .unwrap();
    }
    ch.basic_qos(2, BasicQosOptions::default()).await.unwrap();
    let mut c = ch
        .basic_consume(
            "pf".into(),
            "c1".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let a = next(&mut c).await;
    let _b = next(&mut c).await;
    assert!(tokio::time::timeout(Duration::from_millis(300), c.next())
        .await
        .is_err());
    a.ack(BasicAckOptions::default()).await.unwrap();
    let third = next(&mut c).await;
    assert_eq!(third.data, [2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_requeue_redelivers() {
    let s = Server::start().await;
    let conn = s.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "nq".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let mut c = ch
        .basic_consume(
            "nq".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    ch.basic_publish(
        "".into(),
        "nq".into(),
        BasicPublishOptions::default(),
        b"x",
        BasicProperties::default(),
    )
    .await
    .unwrap();
    let d = next(&mut c).await;
    assert!(!d.redelivered);
    d.nack(BasicNackOptions {
        requeue: true,
        multiple: false,
    })
    .await
    .unwrap();
    let d = next(&mut c).await;
    assert!(d.redelivered);
    assert_eq!(d.data, b"x");
    d.ack(BasicAckOptions::default()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_dead_letters_and_get_empty() {
    let s = Server::start().await;
    let conn = s.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "dlq".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(LongString::from("")),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(LongString::from("dlq")),
    );
    ch.queue_declare("src".into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    assert!(ch
        .basic_get("src".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .is_none());
    ch.basic_publish(
        "".into(),
        "src".into(),
        BasicPublishOptions::default(),
        b"dead",
        BasicProperties::default(),
    )
    .await
    .unwrap();
    let m = eventually_async("the message in src", T, async || {
        ch.basic_get("src".into(), BasicGetOptions::default())
            .await
            .unwrap()
    })
    .await;
    assert_eq!(m.message_count, 0);
    m.delivery
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    let dl = eventually_async("the dead-lettered message in dlq", T, async || {
        ch.basic_get("dlq".into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
    })
    .await;
    assert_eq!(dl.delivery.data, b"dead");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirms_and_mandatory_return() {
    let s = Server::start().await;
    let conn = s.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch.queue_declare(
        "dur".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let mut pending = Vec::new();
    for i in 0..20u8 {
        let props = BasicProperties::default().with_delivery_mode(if i % 2 == 0 { 2 } else { 1 });
        pending.push(
            ch.basic_publish(
                "".into(),
                "dur".into(),
                BasicPublishOptions::default(),
                &[i],
                props,
            )
            .await
            .unwrap(),
        );
    }
    for p in pending {
        assert_eq!(
            tokio::time::timeout(T, p).await.unwrap().unwrap(),
            Confirmation::Ack(None)
        );
    }
    let ret = ch
        .basic_publish(
            "".into(),
            "nowhere".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"lost",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    match ret {
        Confirmation::Ack(Some(r)) => {
            assert_eq!(r.reply_code, 312);
            assert_eq!(r.delivery.data, b"lost");
        }
        other => panic!("expected ack with return, got {other:?}"),
    }
    // tx.select after confirm.select is a 406 channel error.
    let e = ch.tx_select().await.unwrap_err();
    assert!(err_text(e).contains("PRECONDITION_FAILED"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tx_commit_and_rollback() {
    let s = Server::start().await;
    let conn = s.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "txq".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.tx_select().await.unwrap();
    ch.basic_publish(
        "".into(),
        "txq".into(),
        BasicPublishOptions::default(),
        b"1",
        BasicProperties::default(),
    )
    .await
    .unwrap();
    ch.tx_rollback().await.unwrap();
    assert!(ch
        .basic_get("txq".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .is_none());
    ch.basic_publish(
        "".into(),
        "txq".into(),
        BasicPublishOptions::default(),
        b"2",
        BasicProperties::default(),
    )
    .await
    .unwrap();
    ch.tx_commit().await.unwrap();
    let m = ch
        .basic_get("txq".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m.delivery.data, b"2");
    // The ack is held until commit; rollback returns it to unacked.
    m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    ch.tx_rollback().await.unwrap();
    ch.basic_recover(BasicRecoverOptions { requeue: true })
        .await
        .unwrap();
    let again = eventually_async("the recovered message in txq", T, async || {
        ch.basic_get("txq".into(), BasicGetOptions::default())
            .await
            .unwrap()
    })
    .await;
    assert!(again.delivery.redelivered);
    again
        .delivery
        .ack(BasicAckOptions::default())
        .await
        .unwrap();
    ch.tx_commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusive_queue_is_locked_for_other_connections() {
    let s = Server::start().await;
    let c1 = s.connect().await;
    let ch1 = c1.create_channel().await.unwrap();
    ch1.queue_declare(
        "ex1".into(),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let c2 = s.connect().await;
    let ch2 = c2.create_channel().await.unwrap();
    let e = ch2
        .basic_consume(
            "ex1".into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert!(err_text(e).contains("RESOURCE_LOCKED"));
    // Closing the owner deletes it.
    c1.close(200, "bye".into()).await.unwrap();
    let ch3 = c2.create_channel().await.unwrap();
    let e = ch3
        .queue_declare(
            "ex1".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert!(err_text(e).contains("NOT_FOUND"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passive_declare_of_missing_queue_closes_only_the_channel() {
    let s = Server::start().await;
    let conn = s.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let e = ch
        .queue_declare(
            "missing".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert!(err_text(e).contains("NOT_FOUND"));
    assert!(conn.status().connected());
    let ch2 = conn.create_channel().await.unwrap();
    ch2.queue_declare(
        "present".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    // Publishing to a missing exchange is a 404 channel error too.
    ch2.basic_publish(
        "nope".into(),
        "k".into(),
        BasicPublishOptions::default(),
        b"x",
        BasicProperties::default(),
    )
    .await
    .unwrap();
    let e = ch2.basic_qos(1, BasicQosOptions::default()).await;
    let ch3 = conn.create_channel().await.unwrap();
    ch3.queue_declare(
        "present".into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    assert!(e.is_err() || !ch2.status().connected());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_exchange_kind_is_a_connection_error() {
    let s = Server::start().await;
    let conn = s.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let e = ch
        .exchange_declare(
            "weird".into(),
            ExchangeKind::Custom("x-nonsense".into()),
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    let text = err_text(e);
    assert!(text.contains("COMMAND_INVALID"), "{text}");
    eventually("the connection closed", T, || !conn.status().connected()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_body_spans_many_frames() {
    let s = Server::start().await;
    let conn = s.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "big".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let body: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    ch.basic_publish(
        "".into(),
        "big".into(),
        BasicPublishOptions::default(),
        &body,
        BasicProperties::default(),
    )
    .await
    .unwrap();
    let mut c = ch
        .basic_consume(
            "big".into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let d = next(&mut c).await;
    assert_eq!(d.data.len(), body.len());
    assert!(d.data == body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_flow_stop_and_recover_without_requeue_are_not_implemented_as_in_rabbitmq() {
    let s = Server::start().await;
    for which in ["flow", "recover"] {
        let conn = s.connect().await;
        let ch = conn.create_channel().await.unwrap();
        let err = match which {
            "flow" => ch
                .channel_flow(ChannelFlowOptions { active: false })
                .await
                .map(|_| ())
                .unwrap_err(),
            _ => ch
                .basic_recover(BasicRecoverOptions { requeue: false })
                .await
                .unwrap_err(),
        };
        let text = err_text(err);
        assert!(
            text.contains("540") || text.contains("NOT_IMPLEMENTED"),
            "{which}: {text}"
        );
    }
}

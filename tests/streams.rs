//! Stream queues through the real binary: a restart keeps a stream's contents and its
//! stored consumer offsets, the management API resets an offset, and retention by
//! `x-max-length-bytes` frees commitlog segments on disk.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use base64::Engine;
use common::amqp;
use common::TestBroker;
use futures_util::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel};
use triad_core::testing::eventually;

const IO_TIMEOUT: Duration = Duration::from_secs(20);

fn stream_args(extra: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("stream")),
    );
    for (k, v) in extra {
        t.insert((*k).into(), v.clone());
    }
    t
}

async fn declare_stream(ch: &Channel, name: &str, args: FieldTable) {
    common::amqp::declare_durable_with(ch, name, args)
        .await
        .unwrap();
}

async fn publish_confirmed(ch: &Channel, queue: &str, bodies: impl Iterator<Item = Vec<u8>>) {
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::new();
    for b in bodies {
        let c = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &b,
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap();
        confirms.push(c);
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack());
    }
}

fn offset_of(d: &lapin::message::Delivery) -> i64 {
    let h = d.properties.headers().clone().expect("headers");
    match h.inner().get(&ShortString::from("x-stream-offset")) {
        Some(AMQPValue::LongLongInt(n)) => *n,
        other => panic!("x-stream-offset: {other:?}"),
    }
}

/// Consumes `n` deliveries (prefetch `n`) with the given arguments, acks them if
/// `ack`, cancels; returns their offsets.
async fn read(ch: &Channel, queue: &str, n: usize, args: FieldTable, ack: bool) -> Vec<i64> {
    ch.basic_qos(n as u16, BasicQosOptions::default())
        .await
        .unwrap();
    let mut c = ch
        .basic_consume(
            queue.into(),
            "reader".into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await
        .unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        let d = tokio::time::timeout(IO_TIMEOUT, c.next())
            .await
            .expect("delivery in time")
            .expect("consumer open")
            .expect("delivery");
        out.push(offset_of(&d));
        if ack {
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
    }
    ch.basic_cancel("reader".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    out
}

fn consume_args(offset: Option<AMQPValue>, name: Option<&str>) -> FieldTable {
    let mut t = FieldTable::default();
    if let Some(o) = offset {
        t.insert("x-stream-offset".into(), o);
    }
    if let Some(n) = name {
        t.insert(
            "x-stream-consumer-name".into(),
            AMQPValue::LongString(LongString::from(n)),
        );
    }
    t
}

fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let cred = base64::engine::general_purpose::STANDARD.encode("guest:guest");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nAuthorization: Basic {cred}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap();
    (status, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_stream_contents_and_stored_offsets() {
    let mut broker = TestBroker::start();
    {
        let conn = amqp::connect(broker.amqp_addr()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        declare_stream(&ch, "events", stream_args(&[])).await;
        publish_confirmed(
            &ch,
            "events",
            (0..100).map(|i| format!("m{i}").into_bytes()),
        )
        .await;
        let first = AMQPValue::LongString(LongString::from("first"));
        let got = read(
            &ch,
            "events",
            40,
            consume_args(Some(first), Some("app")),
            true,
        )
        .await;
        assert_eq!(got, (0..40).collect::<Vec<i64>>());
        conn.close(200, "bye".into()).await.unwrap();
    }
    broker.restart();
    let conn = amqp::connect(broker.amqp_addr()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    // the contents are all there
    let got = read(
        &ch,
        "events",
        100,
        consume_args(Some(AMQPValue::LongString(LongString::from("first"))), None),
        true,
    )
    .await;
    assert_eq!(got, (0..100).collect::<Vec<i64>>());
    // the named consumer resumes after its last ack
    let got = read(&ch, "events", 5, consume_args(None, Some("app")), true).await;
    assert_eq!(got, [40, 41, 42, 43, 44]);
    // reset through the management API, by offset, then by time (0: the start)
    let (code, body) = http(
        broker.http_addr(),
        "PUT",
        "/api/stream-offsets/%2F/events/app",
        r#"{"offset": 10}"#,
    );
    assert_eq!(code, 200, "{body}");
    let got = read(&ch, "events", 2, consume_args(None, Some("app")), false).await;
    assert_eq!(got, [10, 11]);
    let (code, body) = http(
        broker.http_addr(),
        "PUT",
        "/api/stream-offsets/%2F/events/app",
        r#"{"timestamp": 0}"#,
    );
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#"{"offset":0}"#), "{body}");
    let (code, body) = http(
        broker.http_addr(),
        "GET",
        "/api/stream-offsets/%2F/events",
        "",
    );
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""name":"app","offset":0"#), "{body}");
    let (code, _) = http(
        broker.http_addr(),
        "PUT",
        "/api/stream-offsets/%2F/events/app",
        r#"{"offset": 1, "timestamp": 2}"#,
    );
    assert_eq!(code, 400);
    let got = read(&ch, "events", 1, consume_args(None, Some("app")), false).await;
    assert_eq!(got, [0]);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_by_bytes_frees_disk() {
    let broker = TestBroker::start_with_config(
        r#"
[store]
segment_size = "64 KiB"
checkpoint_interval = "100ms"
retention_interval = "200ms"

[limits]
max_message_size = "16 KiB"
"#,
    );
    let conn = amqp::connect(broker.amqp_addr()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    declare_stream(
        &ch,
        "capped",
        stream_args(&[("x-max-length-bytes", AMQPValue::LongLongInt(200_000))]),
    )
    .await;
    // 4 MiB through a stream that keeps 200 kB
    publish_confirmed(&ch, "capped", (0..4096).map(|_| vec![b'x'; 1024])).await;
    eventually(
        "the commitlog under 1 MiB",
        IO_TIMEOUT,
        || match log_bytes(broker.data_dir()) {
            bytes if bytes < 1 << 20 => Ok(()),
            bytes => Err(format!("the commitlog still holds {bytes} bytes")),
        },
    )
    .await;
    // a consumer from the start begins at the retention point
    let got = read(
        &ch,
        "capped",
        1,
        consume_args(Some(AMQPValue::LongString(LongString::from("first"))), None),
        false,
    )
    .await;
    assert!(got[0] >= 4096 - 200, "starts at {}", got[0]);
}

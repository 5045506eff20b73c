//! lapin helpers shared by the crash-loop, abuse, soak, durability and cluster tests:
//! connect, declare a durable queue, publish numbered messages with confirms, drain a
//! queue completely.

use std::collections::{BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};

pub async fn connect(addr: SocketAddr) -> lapin::Result<Connection> {
    let uri = format!("amqp://guest:guest@{addr}/%2f");
    match tokio::time::timeout(
        Duration::from_secs(10),
        Connection::connect(&uri, ConnectionProperties::default()),
    )
    .await
    {
        Ok(r) => r,
        Err(_) => panic!("AMQP connect to {addr} timed out"),
    }
}

/// Declares a durable queue; returns its ready message count.
pub async fn declare_durable(ch: &Channel, name: &str) -> lapin::Result<u32> {
    declare_durable_with(ch, name, FieldTable::default()).await
}

/// Declares a durable queue with arguments (`x-queue-type`, `x-expires`, ...); returns
/// its ready message count.
pub async fn declare_durable_with(
    ch: &Channel,
    name: &str,
    args: FieldTable,
) -> lapin::Result<u32> {
    let q = ch
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await?;
    Ok(q.message_count())
}

/// Publishes `count` persistent messages to `queue` (through the default exchange) on
/// `ch`, numbered from `start` (the body is the number, little-endian), with confirms,
/// keeping up to 64 unconfirmed. Records each confirmed number in `confirmed`; with
/// `nacked`, records each nacked one there and goes on, without it a nack stops the run.
/// Stops at the first error (the broker was killed).
pub async fn publish_numbered(
    ch: &Channel,
    queue: &str,
    start: u64,
    count: u64,
    confirmed: &Mutex<BTreeSet<u64>>,
    nacked: Option<&Mutex<BTreeSet<u64>>>,
) {
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let mut pending = VecDeque::new();
    for i in start..start + count {
        let published = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &i.to_le_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await;
        let Ok(confirm) = published else { return };
        pending.push_back((i, confirm));
        while pending.len() > 64 || (i + 1 == start + count && !pending.is_empty()) {
            let Some((n, c)) = pending.pop_front() else {
                break;
            };
            match (c.await, nacked) {
                (Ok(Confirmation::Ack(_)), _) => {
                    confirmed.lock().expect("not poisoned").insert(n);
                }
                (Ok(Confirmation::Nack(_)), Some(nacked)) => {
                    nacked.lock().expect("not poisoned").insert(n);
                }
                _ => return,
            }
        }
    }
}

/// Consumes and acks every message of durable queue `queue` until it is empty; returns
/// the bodies in delivery order. Panics after `timeout`.
///
/// The queue's ready count (from `queue.declare`) says how many to expect, so nothing
/// waits on an idle period; a final `basic.get` proves nothing is left.
pub async fn drain(addr: SocketAddr, queue: &str, timeout: Duration) -> Vec<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let conn = connect(addr).await.expect("connect to drain");
    let ch = conn.create_channel().await.expect("channel");
    let expected = declare_durable(&ch, queue).await.expect("declare");
    ch.basic_qos(500, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut out = Vec::with_capacity(expected as usize);
    if expected > 0 {
        let mut consumer = ch
            .basic_consume(
                queue.into(),
                "drain".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        while out.len() < expected as usize {
            let left = deadline.saturating_duration_since(Instant::now());
            let next = tokio::time::timeout(left, consumer.next())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "drain {queue}: {} of {expected} after {timeout:?}",
                        out.len()
                    )
                });
            let d = next.expect("consumer ended").expect("delivery");
            d.ack(BasicAckOptions::default()).await.expect("ack");
            out.push(d.data);
        }
        ch.basic_cancel("drain".into(), BasicCancelOptions::default())
            .await
            .expect("cancel");
    }
    let left = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .expect("get");
    assert!(
        left.is_none(),
        "{queue}: more messages than its ready count said ({expected})"
    );
    conn.close(200, "drained".into()).await.expect("close");
    out
}

#![allow(clippy::unwrap_used)]
//! Heap an idle consumed queue keeps after it has delivered one message and had it
//! acked: a device fleet has many such queues (one per persistent MQTT session), each
//! with one consumer whose connection sits idle. Measured with a counting allocator; run
//! with `--nocapture` to see the numbers.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use triad_core::testing::{eventually_blocking, open_broker, CountingAlloc};
use triad_core::{
    Broker, ConsumeRequest, ConsumerHandle, CoreConfig, OutEvent, Outbox, Properties, Publish,
    QueueDeclare,
};
use triad_store::store::StoreConfig;

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

fn open(dir: &Path) -> Arc<Broker> {
    let mut c = StoreConfig::new(dir);
    c.segment_size = 64 << 20;
    open_broker(c, CoreConfig::default())
}

const N: usize = 2_000;

/// Publishes one message to each of the `N` queues, takes it from each outbox, acks it,
/// and lets the outboxes go idle.
fn one_message_round(
    v: &triad_core::Vhost,
    outboxes: &[Arc<Outbox>],
    consumers: &[ConsumerHandle],
    round: usize,
) {
    for i in 0..N {
        v.publish(Publish {
            exchange: "".into(),
            routing_key: format!("q{i}"),
            properties: Properties {
                delivery_mode: Some(2),
                ..Default::default()
            },
            body: Bytes::from(format!("m{round}")),
            conn: 1,
            ..Default::default()
        })
        .unwrap();
    }
    for (i, o) in outboxes.iter().enumerate() {
        let mut got = Vec::new();
        eventually_blocking("the delivery", Duration::from_secs(30), || {
            o.drain(&mut got, usize::MAX);
            !got.is_empty()
        });
        for e in got {
            let OutEvent::Deliver(d) = e else {
                panic!("not a delivery in q{i}")
            };
            d.queue.ack(&[d.offset]);
        }
        // what the driver does once the idle sweep asks (`Outbox::note_idle`)
        o.release_idle();
        consumers[i].release_idle();
    }
}

/// Before `release_idle` (the outbox's and the consumer's), each such queue kept 1,212 bytes after
/// its first message: the outbox's event queue (room for four deliveries), the queue's
/// emptied `BTreeMap` leaf of ready entries and its `HashMap` of unacked ones. Now 96
/// bytes remain, and a second message adds nothing.
#[test]
fn an_idle_consumed_queue_keeps_no_heap_from_a_delivered_message() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    let mut outboxes = Vec::with_capacity(N);
    let mut consumers: Vec<ConsumerHandle> = Vec::with_capacity(N);
    for i in 0..N {
        v.declare_queue(QueueDeclare {
            name: format!("q{i}"),
            durable: true,
            conn: 1,
            ..Default::default()
        })
        .unwrap();
        let o = Outbox::new(64);
        consumers.push(
            v.consume(
                &format!("q{i}"),
                ConsumeRequest {
                    tag: "c".into(),
                    no_ack: false,
                    exclusive: false,
                    prefetch: 16,
                    priority: 0,
                    conn: 1,
                    outbox: o.clone(),
                    gate: None,
                    filter: None,
                },
            )
            .unwrap(),
        );
        outboxes.push(o);
    }
    let start = A.live();
    one_message_round(&v, &outboxes, &consumers, 0);
    let first = A.live();
    one_message_round(&v, &outboxes, &consumers, 1);
    let after = A.live();
    let per_queue = (first - start) as f64 / N as f64;
    let second = (after - first) as f64 / N as f64;
    println!("heap kept per idle consumed queue after a message: {per_queue:.1} B, after a second: {second:.1} B");
    assert!(per_queue < 160.0, "{per_queue:.1} B per queue");
    assert!(
        second < 16.0,
        "{second:.1} B per queue for a second message"
    );
    drop(consumers);
}

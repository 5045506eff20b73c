#![allow(clippy::unwrap_used)]
//! Heap per message waiting out an `x-retry-backoff` step (parked), measured with a
//! counting allocator: while running, and after a restart (parked again from the
//! stored ready-at times). Run with `--nocapture` to see the numbers.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use triad_core::testing::{open_broker, CountingAlloc};
use triad_core::{
    Broker, ConsumeRequest, CoreConfig, FieldTable, FieldValue, OutEvent, Outbox, Properties,
    Publish, Queue, QueueDeclare, Vhost,
};
use triad_store::store::StoreConfig;

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

fn open(dir: &Path) -> Arc<Broker> {
    let mut c = StoreConfig::new(dir);
    c.segment_size = 64 << 20;
    open_broker(c, CoreConfig::default())
}

const N: usize = 20_000;

/// Declares durable queue `q` with a one-hour `x-retry-backoff` and publishes [`N`]
/// persistent messages to it.
fn backoff_queue_with_n(v: &Vhost) -> Arc<Queue> {
    let mut args = FieldTable::default();
    args.insert(
        "x-retry-backoff",
        FieldValue::LongString(Bytes::from_static(b"1h")),
    );
    v.declare_queue(QueueDeclare {
        name: "q".into(),
        durable: true,
        arguments: args,
        conn: 1,
        ..Default::default()
    })
    .unwrap();
    for i in 0..N {
        v.publish(Publish {
            exchange: "".into(),
            routing_key: "q".into(),
            properties: Properties {
                delivery_mode: Some(2),
                ..Default::default()
            },
            body: Bytes::from(format!("m{i}")),
            conn: 1,
            ..Default::default()
        })
        .unwrap();
    }
    v.queue("q").unwrap()
}

#[test]
fn a_parked_message_costs_one_map_entry_of_heap_running_and_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let running;
    {
        let b = open(dir.path());
        let v = b.vhost("/").unwrap();
        let q = backoff_queue_with_n(&v);
        let o = Outbox::new(N + 16);
        let c = v
            .consume(
                "q",
                ConsumeRequest {
                    tag: "c".into(),
                    no_ack: false,
                    exclusive: false,
                    prefetch: 0,
                    priority: 0,
                    conn: 1,
                    outbox: o.clone(),
                    gate: None,
                    filter: None,
                },
            )
            .unwrap();
        let mut offsets = Vec::with_capacity(N);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while offsets.len() < N {
            let mut evs = Vec::new();
            o.drain(&mut evs, usize::MAX);
            for e in evs {
                if let OutEvent::Deliver(d) = e {
                    offsets.push(d.offset);
                }
            }
            assert!(std::time::Instant::now() < deadline, "{}", offsets.len());
        }
        c.cancel();
        for chunk in offsets.chunks(1000) {
            q.nack(chunk, true);
        }
        assert_eq!(q.parked_count() as usize, N);
        drop(offsets);
        let with = A.live();
        v.purge_queue("q", 1).unwrap();
        assert_eq!(q.parked_count(), 0);
        let without = A.live();
        running = (with - without) as f64 / N as f64;
    }
    // after a restart: N parked again, from the journal (a second store, same shape)
    let dir2 = tempfile::tempdir().unwrap();
    {
        let b = open(dir2.path());
        let v = b.vhost("/").unwrap();
        let q = backoff_queue_with_n(&v);
        let mut n = 0;
        while let Some(d) = v.get("q", false, 1).unwrap() {
            q.nack(&[d.offset], true);
            n += 1;
            assert!(n <= N);
        }
        assert_eq!(q.parked_count() as usize, N);
        let store = b.store().clone();
        drop(q);
        drop(v);
        drop(b);
        store.journal().durable_end().wait().unwrap();
        drop(store);
    }
    let b = open(dir2.path());
    let v = b.vhost("/").unwrap();
    let q = v.queue("q").unwrap();
    assert_eq!(q.parked_count() as usize, N);
    let with = A.live();
    v.purge_queue("q", 1).unwrap();
    assert_eq!(q.parked_count(), 0);
    let freed = (with - A.live()) as f64 / N as f64;
    println!("heap per parked message: {running:.1} B running, {freed:.1} B after a restart");
    assert!(running > 0.0 && running < 128.0, "{running}");
    assert!(freed > 0.0 && freed < 160.0, "{freed}");
}

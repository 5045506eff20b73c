#![allow(clippy::unwrap_used)]
//! Message counters: a queue counts deliveries, gets, acks and redeliveries; a vhost
//! counts what clients publish into it.

use std::sync::Arc;

use bytes::Bytes;
use triad_core::{
    Broker, ConsumeRequest, CoreConfig, FieldTable, OutEvent, Outbox, Publish, QueueDeclare,
};
use triad_store::store::{Store, StoreConfig};

#[test]
fn queues_count_deliveries_gets_acks_and_redeliveries() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = StoreConfig::new(dir.path());
    c.segment_size = 1 << 20;
    let b = Broker::open(Arc::new(Store::open(c).unwrap()), CoreConfig::default()).unwrap();
    let v = b.vhost("/").unwrap();
    v.declare_queue(QueueDeclare {
        name: "q".into(),
        arguments: FieldTable::new(),
        conn: 1,
        ..Default::default()
    })
    .unwrap();
    for i in 0..4 {
        v.publish(Publish {
            routing_key: "q".into(),
            body: Bytes::from(format!("m{i}")),
            conn: 1,
            ..Default::default()
        })
        .unwrap();
    }
    // one got and acked, one got without ack
    let g = v.get("q", false, 1).unwrap().unwrap();
    g.queue.ack(&[g.offset]);
    v.get("q", true, 1).unwrap().unwrap();
    // two delivered; one requeued and delivered again (redelivered), then acked
    let o = Outbox::new(16);
    let _c = v
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
    let take = || {
        let mut evs = Vec::new();
        o.drain(&mut evs, usize::MAX);
        evs.into_iter()
            .filter_map(|e| match e {
                OutEvent::Deliver(d) => Some(d),
                OutEvent::Cancelled { .. } | OutEvent::Reply(_) => None,
            })
            .collect::<Vec<_>>()
    };
    let ds = take();
    assert_eq!(ds.len(), 2);
    let q = v.queue("q").unwrap();
    q.nack(&[ds[0].offset], true);
    let again = take();
    assert_eq!(again.len(), 1);
    assert!(again[0].redelivered);
    q.ack(&[again[0].offset, ds[1].offset]);
    let s = q.stats();
    assert_eq!(
        (s.counts.deliver, s.counts.redeliver, s.counts.ack),
        (3, 1, 3)
    );
    assert_eq!((s.counts.get, s.counts.get_no_ack), (1, 1));
    // publish, deliver, deliver_no_ack, get, get_no_ack, redeliver, ack, deliver_get
    assert_eq!(s.values(), [4, 3, 0, 1, 1, 1, 3, 5]);
    let t = v.totals();
    assert_eq!(t.values, [4, 3, 0, 1, 1, 1, 3, 5]);
    assert_eq!(t.rates, [0.0; 8]);
}

#![allow(clippy::unwrap_used)]
//! Consumers with filters over a real store: selectors and tag filters on a shared
//! queue (each takes only what it accepts, the rest stays), the bounded lookahead, and
//! tags read back from the consume queue after a restart.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use triad_core::{
    Broker, ConsumeRequest, CoreConfig, Delivery, FieldTable, FieldValue, MessageFilter, OutEvent,
    Outbox, Properties, Publish, QueueDeclare, Vhost,
};
use triad_store::store::{Store, StoreConfig};

const WINDOW: usize = 64;

fn open(dir: &Path) -> Arc<Broker> {
    let mut c = StoreConfig::new(dir);
    c.segment_size = 1 << 20;
    c.cq_entries_per_file = 1024;
    let store = Arc::new(Store::open(c).unwrap());
    Broker::open(
        store,
        CoreConfig {
            queue_window: WINDOW,
            ..CoreConfig::default()
        },
    )
    .unwrap()
}

fn declare(v: &Vhost, name: &str) {
    v.declare_queue(QueueDeclare {
        name: name.into(),
        durable: true,
        conn: 1,
        ..Default::default()
    })
    .unwrap();
}

fn publish(v: &Vhost, q: &str, body: &str, headers: &[(&str, FieldValue)]) {
    let mut h = FieldTable::new();
    for (k, val) in headers {
        h.insert(*k, val.clone());
    }
    v.publish(Publish {
        exchange: String::new(),
        routing_key: q.into(),
        properties: Properties {
            delivery_mode: Some(2),
            headers: Some(h),
            ..Default::default()
        },
        body: Bytes::from(body.to_string()),
        conn: 1,
        ..Default::default()
    })
    .unwrap();
}

fn consume(
    v: &Vhost,
    q: &str,
    tag: &str,
    prefetch: u32,
    selector: Option<&str>,
    tags: Option<&str>,
) -> Arc<Outbox> {
    let outbox = Outbox::new(1024);
    v.consume(
        q,
        ConsumeRequest {
            tag: tag.into(),
            no_ack: false,
            exclusive: false,
            prefetch,
            priority: 0,
            conn: 1,
            outbox: outbox.clone(),
            gate: None,
            filter: MessageFilter::compile(selector, tags).unwrap(),
        },
    )
    .unwrap();
    outbox
}

fn drain(o: &Outbox) -> Vec<Delivery> {
    let mut evs = Vec::new();
    o.drain(&mut evs, usize::MAX);
    evs.into_iter()
        .filter_map(|e| match e {
            OutEvent::Deliver(d) => Some(d),
            _ => None,
        })
        .collect()
}

fn bodies(ds: &[Delivery]) -> Vec<String> {
    ds.iter()
        .map(|d| String::from_utf8(d.body.to_vec()).unwrap())
        .collect()
}

fn colour(c: &str) -> [(&'static str, FieldValue); 1] {
    [("colour", FieldValue::from(c))]
}

#[test]
fn selecting_consumers_share_a_queue_and_leave_what_nobody_takes() {
    let dir = tempfile::tempdir().unwrap();
    let broker = open(dir.path());
    let v = broker.vhost("/").unwrap();
    declare(&v, "q");
    let red = consume(&v, "q", "red", 1, Some("colour = 'red'"), None);
    let blue = consume(&v, "q", "blue", 1, Some("colour = 'blue'"), None);
    for (i, c) in ["red", "green", "blue", "red", "blue", "green", "red"]
        .iter()
        .enumerate()
    {
        publish(&v, "q", &format!("{c}-{i}"), &colour(c));
    }
    // prefetch 1 each: one at a time, in queue order, never the other's colour
    let (mut got_red, mut got_blue) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        for (o, got) in [(&red, &mut got_red), (&blue, &mut got_blue)] {
            let ds = drain(o);
            assert!(ds.len() <= 1);
            for d in ds {
                got.push(String::from_utf8(d.body.to_vec()).unwrap());
                d.queue.ack(&[d.offset]);
            }
        }
    }
    assert_eq!(got_red, ["red-0", "red-3", "red-6"]);
    assert_eq!(got_blue, ["blue-2", "blue-4"]);
    let q = v.queue("q").unwrap();
    assert_eq!(q.message_count(), 2, "the green ones stay");
    // a consumer that takes everything gets them, in order
    let all = consume(&v, "q", "all", 0, None, None);
    assert_eq!(bodies(&drain(&all)), ["green-1", "green-5"]);
}

#[test]
fn lookahead_is_bounded_by_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let broker = open(dir.path());
    let v = broker.vhost("/").unwrap();
    declare(&v, "q");
    for i in 0..(WINDOW * 2) {
        publish(&v, "q", &format!("green-{i}"), &colour("green"));
    }
    publish(&v, "q", "red", &colour("red"));
    let red = consume(&v, "q", "red", 0, Some("colour = 'red'"), None);
    // the red message is behind a full window of entries the consumer does not take
    assert!(drain(&red).is_empty());
    // once the head is consumed by someone else, the walk reaches it
    let all = consume(&v, "q", "all", 0, Some("colour = 'green'"), None);
    let greens = drain(&all);
    assert_eq!(greens.len(), WINDOW * 2);
    for d in &greens {
        d.queue.ack(&[d.offset]);
    }
    assert_eq!(bodies(&drain(&red)), ["red"]);
}

#[test]
fn tag_filters_read_the_stored_tag_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let broker = open(dir.path());
        let v = broker.vhost("/").unwrap();
        declare(&v, "q");
        for (i, t) in ["a", "b", "c", "a"].iter().enumerate() {
            publish(
                &v,
                "q",
                &format!("{t}-{i}"),
                &[("x-tag", FieldValue::from(*t))],
            );
        }
        publish(&v, "q", "untagged", &[]);
    }
    let broker = open(dir.path());
    let v = broker.vhost("/").unwrap();
    let o = consume(&v, "q", "t", 0, None, Some("a || c"));
    assert_eq!(bodies(&drain(&o)), ["a-0", "c-2", "a-3"]);
    // selector and tag filter together
    let o = consume(
        &v,
        "q",
        "t2",
        0,
        Some("JMSPriority = 4 AND JMSDeliveryMode = 'PERSISTENT'"),
        Some("b"),
    );
    assert_eq!(bodies(&drain(&o)), ["b-1"]);
}

#[test]
fn sac_failover_waits_for_every_delivery_of_the_old_consumer() {
    // The active consumer is cancelled with deliveries the client has seen (unacked)
    // and others still in its connection's outbox; the adapter requeues the first
    // ones first. The next consumer must still get them all before the rest, in order.
    let dir = tempfile::tempdir().unwrap();
    let broker = open(dir.path());
    let v = broker.vhost("/").unwrap();
    let mut args = FieldTable::new();
    args.insert("x-single-active-consumer", FieldValue::Bool(true));
    v.declare_queue(QueueDeclare {
        name: "sac".into(),
        durable: true,
        arguments: args,
        conn: 1,
        ..Default::default()
    })
    .unwrap();
    let req = |tag: &str, outbox: &Arc<Outbox>| ConsumeRequest {
        tag: tag.into(),
        no_ack: false,
        exclusive: false,
        prefetch: 3,
        priority: 0,
        conn: 1,
        outbox: outbox.clone(),
        gate: None,
        filter: None,
    };
    let (oa, ob) = (Outbox::new(64), Outbox::new(64));
    let a = v.consume("sac", req("a", &oa)).unwrap();
    let _b = v.consume("sac", req("b", &ob)).unwrap();
    for i in 0..6 {
        publish(&v, "sac", &format!("m{i}"), &[]);
    }
    let held = drain(&oa);
    assert_eq!(bodies(&held), ["m0", "m1", "m2"]);
    a.cancel();
    // the client had seen m1 only: its channel requeues that first
    held[1].queue.nack(&[held[1].offset], true);
    assert!(drain(&ob).is_empty(), "m0 and m2 are still out");
    // then the outbox's leftovers come back
    held[0].queue.nack(&[held[0].offset], true);
    held[2].queue.nack(&[held[2].offset], true);
    let got = drain(&ob);
    assert_eq!(bodies(&got), ["m0", "m1", "m2"]);
    assert!(got.iter().all(|d| d.redelivered));
    for d in &got {
        d.queue.ack(&[d.offset]);
    }
    assert_eq!(bodies(&drain(&ob)), ["m3", "m4", "m5"]);
}

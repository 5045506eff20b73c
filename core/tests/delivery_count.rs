#![allow(clippy::unwrap_used)]
//! Per-message delivery counts (`x-delivery-count`) and `x-delivery-limit`, over a real
//! store: counted on returns only, carried on redeliveries, kept across restarts,
//! dead-lettered (reason `delivery_limit`) or dropped past the limit.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use triad_core::testing;
use triad_core::{
    Broker, Clock, ConsumeRequest, Delivery, ExchangeDef, ExchangeKind, FieldTable, FieldValue,
    OutEvent, Outbox, Properties, Publish, QueueDeclare, Vhost,
};
use triad_store::store::StoreConfig;

fn open(dir: &Path) -> Arc<Broker> {
    open_clocked(dir, Clock::system())
}

/// A broker whose expiry decisions (the retry back-off) read `clock`.
fn open_clocked(dir: &Path, clock: Clock) -> Arc<Broker> {
    let mut c = StoreConfig::new(dir);
    c.segment_size = 1 << 20;
    testing::open_clocked(c, clock)
}

fn declare(v: &Vhost, name: &str, durable: bool, args: FieldTable) {
    v.declare_queue(QueueDeclare {
        name: name.into(),
        durable,
        arguments: args,
        conn: 1,
        ..Default::default()
    })
    .unwrap();
}

fn publish(v: &Vhost, key: &str, body: &str) {
    v.publish(Publish {
        exchange: "".into(),
        routing_key: key.into(),
        properties: Properties {
            delivery_mode: Some(2),
            ..Default::default()
        },
        body: Bytes::from(body.to_string()),
        conn: 1,
        ..Default::default()
    })
    .unwrap();
}

fn consume(v: &Vhost, q: &str, o: &Arc<Outbox>) -> triad_core::ConsumerHandle {
    v.consume(
        q,
        ConsumeRequest {
            tag: "c".into(),
            no_ack: false,
            exclusive: false,
            prefetch: 1,
            priority: 0,
            conn: 1,
            outbox: o.clone(),
            gate: None,
            filter: None,
        },
    )
    .unwrap()
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

fn count(d: &Delivery) -> Option<i64> {
    d.properties
        .headers
        .as_ref()
        .and_then(|h| h.get_i64("x-delivery-count"))
}

fn one(o: &Outbox) -> Delivery {
    let mut ds = drain(o);
    assert_eq!(ds.len(), 1, "one delivery expected");
    ds.pop().unwrap()
}

fn limit_args(limit: i64, dlx: Option<&str>) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert("x-delivery-limit", FieldValue::I64(limit));
    if let Some(x) = dlx {
        t.insert(
            "x-dead-letter-exchange",
            FieldValue::LongString(Bytes::from(x.to_string())),
        );
    }
    t
}

#[test]
fn the_first_delivery_has_no_count_and_each_return_adds_one() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    declare(&v, "q", true, FieldTable::default());
    publish(&v, "q", "m");
    let o = Outbox::new(16);
    let c = consume(&v, "q", &o);
    let d = one(&o);
    assert_eq!(count(&d), None);
    assert!(!d.redelivered);
    for n in 1..=3 {
        d.queue.nack(&[d.offset], true);
        let d = one(&o);
        assert_eq!(count(&d), Some(n));
        assert!(d.redelivered);
        if n == 3 {
            // a delivery that never reached the client is not a return
            d.queue.requeue_unsent(&[d.offset]);
            assert_eq!(count(&one(&o)), Some(3));
        }
    }
    c.cancel();
}

#[test]
fn without_a_limit_counts_stay_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = open(dir.path());
        let v = b.vhost("/").unwrap();
        declare(&v, "q", true, FieldTable::default());
        publish(&v, "q", "m");
        let o = Outbox::new(16);
        let c = consume(&v, "q", &o);
        let d = one(&o);
        d.queue.nack(&[d.offset], true);
        let d = one(&o);
        assert_eq!(count(&d), Some(1));
        c.cancel();
        d.queue.nack(&[d.offset], true);
        let o = Outbox::new(16);
        let _c = consume(&v, "q", &o);
        assert_eq!(count(&one(&o)), Some(2));
        let left = b.store().journal().scan(b"R").unwrap();
        assert!(left.is_empty(), "no journal record: {left:?}");
    }
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    let o = Outbox::new(16);
    let _c = consume(&v, "q", &o);
    let d = one(&o);
    assert_eq!(count(&d), None, "not kept across a restart without a limit");
}

#[test]
fn counts_survive_a_restart_and_an_ack_forgets_them() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = open(dir.path());
        let v = b.vhost("/").unwrap();
        // counts are stored for queues with a limit (or a back-off) only
        declare(&v, "q", true, limit_args(100, None));
        for m in ["a", "b", "c"] {
            publish(&v, "q", m);
        }
        let o = Outbox::new(16);
        let c = consume(&v, "q", &o);
        // a: returned twice; b: returned once then acked; c: never returned
        let d = one(&o);
        d.queue.nack(&[d.offset], true);
        let d = one(&o);
        d.queue.nack(&[d.offset], true);
        let d = one(&o);
        assert_eq!(count(&d), Some(2));
        // returned again as the consumer goes away unacked (its channel closed)
        c.cancel();
        d.queue.nack(&[d.offset], true);
        let o = Outbox::new(16);
        let c = consume(&v, "q", &o);
        let a = one(&o);
        assert_eq!(count(&a), Some(3));
        a.queue.ack(&[a.offset]);
        let bm = one(&o);
        assert_eq!(bm.body.as_ref(), b"b");
        bm.queue.nack(&[bm.offset], true);
        let bm = one(&o);
        assert_eq!(count(&bm), Some(1));
        c.cancel();
        // b stays unacked (count 1); the store goes down with it
    }
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    let o = Outbox::new(16);
    let _c = consume(&v, "q", &o);
    let d = one(&o);
    assert_eq!(d.body.as_ref(), b"b");
    assert_eq!(count(&d), Some(1), "count kept across the restart");
    d.queue.nack(&[d.offset], true);
    let d = one(&o);
    assert_eq!(count(&d), Some(2));
    d.queue.ack(&[d.offset]);
    let d = one(&o);
    assert_eq!(d.body.as_ref(), b"c");
    assert_eq!(count(&d), None, "only a return counts, not a restart");
    // acked a (and b) left no count behind
    let left = b.store().journal().scan(b"R").unwrap();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn past_the_limit_a_message_is_dead_lettered_with_reason_delivery_limit() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    v.declare_exchange(ExchangeDef::new("dlx", ExchangeKind::Fanout), false)
        .unwrap();
    declare(&v, "dead", false, FieldTable::default());
    v.bind_queue("dead", "dlx", "", &FieldTable::default(), 1)
        .unwrap();
    declare(&v, "q", true, limit_args(2, Some("dlx")));
    publish(&v, "q", "poison");
    let o = Outbox::new(16);
    let _c = consume(&v, "q", &o);
    // limit 2: delivered, returned twice (redelivered with counts 1 and 2), and the
    // third return is past the limit
    for n in [None, Some(1), Some(2)] {
        let d = one(&o);
        assert_eq!(count(&d), n);
        d.queue.nack(&[d.offset], true);
    }
    assert!(drain(&o).is_empty());
    assert_eq!(v.queue("q").unwrap().message_count(), 0);
    let got = v.get("dead", true, 1).unwrap().unwrap();
    assert_eq!(got.body.as_ref(), b"poison");
    let h = got.properties.headers.as_ref().unwrap();
    assert_eq!(h.get_str("x-first-death-reason"), Some("delivery_limit"));
    let death = h.get("x-death").unwrap().as_array().unwrap()[0]
        .as_table()
        .unwrap()
        .clone();
    assert_eq!(death.get_str("reason"), Some("delivery_limit"));
    assert_eq!(death.get_str("queue"), Some("q"));
}

#[test]
fn past_the_limit_without_a_dlx_it_is_dropped_and_limit_zero_allows_no_return() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    declare(&v, "q", false, limit_args(0, None));
    publish(&v, "q", "m");
    publish(&v, "q", "n");
    let o = Outbox::new(16);
    let _c = consume(&v, "q", &o);
    let d = one(&o);
    d.queue.nack(&[d.offset], true);
    let d = one(&o);
    assert_eq!(d.body.as_ref(), b"n");
    assert_eq!(count(&d), None);
    d.queue.ack(&[d.offset]);
    assert_eq!(v.queue("q").unwrap().message_count(), 0);
    assert_eq!(v.queue("q").unwrap().unacked_count(), 0);
}

#[test]
fn declare_equivalence_includes_the_delivery_limit() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    declare(&v, "q", true, limit_args(3, None));
    declare(&v, "q", true, limit_args(3, None));
    let other = v.declare_queue(QueueDeclare {
        name: "q".into(),
        durable: true,
        arguments: limit_args(4, None),
        conn: 1,
        ..Default::default()
    });
    assert!(
        matches!(&other, Err(triad_core::CoreError::PreconditionFailed(m)) if m.contains("x-delivery-limit")),
        "{other:?}"
    );
}

#[test]
fn with_a_retry_backoff_a_returned_message_waits_its_step_and_the_limit_defaults_to_16() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Clock::manual();
    let b = open_clocked(dir.path(), clock.clone());
    let v = b.vhost("/").unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-retry-backoff",
        FieldValue::LongString(Bytes::from_static(b"300ms,1s")),
    );
    declare(&v, "q", true, args);
    let q = v.queue("q").unwrap();
    assert_eq!(q.args().delivery_limit, Some(16));
    assert_eq!(q.args().retry_backoff.as_deref(), Some(&[300, 1000][..]));
    publish(&v, "q", "m");
    let o = Outbox::new(16);
    let _c = consume(&v, "q", &o);
    let d = one(&o);
    let returned_at = clock.now_ms();
    d.queue.nack(&[d.offset], true);
    // parked, not ready: nothing delivered at once
    assert!(drain(&o).is_empty());
    assert_eq!(q.parked_count(), 1);
    assert_eq!(q.message_count(), 0);
    // the broker's periodic tick makes it ready once its step is over, not before
    clock.advance(Duration::from_millis(299));
    b.tick();
    assert!(drain(&o).is_empty(), "not before its 300 ms step");
    clock.advance(Duration::from_millis(1));
    b.tick();
    let d = drain(&o).pop().expect("ready again once its step is over");
    assert!(clock.now_ms() - returned_at >= 300);
    assert_eq!(count(&d), Some(1));
    assert_eq!(q.parked_count(), 0);
}

#[test]
fn a_queue_holding_a_backing_off_message_is_not_empty() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-retry-backoff",
        FieldValue::LongString(Bytes::from_static(b"1m")),
    );
    declare(&v, "q", true, args);
    let q = v.queue("q").unwrap();
    publish(&v, "q", "m");
    let o = Outbox::new(16);
    let c = consume(&v, "q", &o);
    let d = one(&o);
    d.queue.nack(&[d.offset], true);
    c.cancel();
    assert_eq!(q.parked_count(), 1);
    match v.delete_queue("q", false, true, 1) {
        Err(triad_core::CoreError::PreconditionFailed(m)) => {
            assert!(m.contains("not empty"), "{m}")
        }
        other => panic!("deleted: {other:?}"),
    }
    v.delete_queue("q", false, false, 1).unwrap();
}

#[test]
fn a_bad_retry_backoff_is_refused_naming_it() {
    for bad in ["", "1s,,2s", "1x", "-1s", "99999h"] {
        let mut t = FieldTable::default();
        t.insert("x-retry-backoff", FieldValue::LongString(Bytes::from(bad)));
        match triad_core::QueueArgs::parse(&t) {
            Err(triad_core::CoreError::PreconditionFailed(m)) => {
                assert!(m.contains("x-retry-backoff"), "{m}")
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
    // an explicit limit wins over the default, -1 = none
    let mut t = FieldTable::default();
    t.insert("x-retry-backoff", FieldValue::LongString(Bytes::from("1s")));
    t.insert("x-delivery-limit", FieldValue::I32(-1));
    assert_eq!(
        triad_core::QueueArgs::parse(&t).unwrap().delivery_limit,
        None
    );
}

#[test]
fn a_backing_off_message_still_waits_its_step_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-retry-backoff",
        FieldValue::LongString(Bytes::from_static(b"3s")),
    );
    let clock = Clock::manual();
    let returned_at;
    {
        let b = open_clocked(dir.path(), clock.clone());
        let v = b.vhost("/").unwrap();
        declare(&v, "q", true, args.clone());
        publish(&v, "q", "m");
        publish(&v, "q", "n");
        let o = Outbox::new(16);
        let c = consume(&v, "q", &o);
        let d = one(&o);
        assert_eq!(d.body.as_ref(), b"m");
        returned_at = clock.now_ms();
        d.queue.nack(&[d.offset], true);
        assert_eq!(v.queue("q").unwrap().parked_count(), 1);
        c.cancel();
        let store = b.store().clone();
        drop(v);
        drop(b);
        drop(store);
    }
    let b = open_clocked(dir.path(), clock.clone());
    let v = b.vhost("/").unwrap();
    let q = v.queue("q").unwrap();
    assert_eq!(q.parked_count(), 1, "still backing off after the restart");
    assert_eq!(q.message_count(), 1, "only n is ready");
    let o = Outbox::new(16);
    let _c = consume(&v, "q", &o);
    let n = one(&o);
    assert_eq!(n.body.as_ref(), b"n");
    n.queue.ack(&[n.offset]);
    clock.advance(Duration::from_millis(2_999));
    b.tick();
    assert!(drain(&o).is_empty(), "not before its 3 s step");
    clock.advance(Duration::from_millis(1));
    b.tick();
    let d = drain(&o).pop().expect("ready again once its step is over");
    assert!(
        clock.now_ms() - returned_at >= 3_000,
        "came back {} ms after its return, before its 3 s step",
        clock.now_ms() - returned_at
    );
    assert_eq!(d.body.as_ref(), b"m");
    assert_eq!(count(&d), Some(1));
    assert_eq!(q.parked_count(), 0);
    d.queue.ack(&[d.offset]);
    let left = b.store().journal().scan(b"R").unwrap();
    assert!(left.is_empty(), "{left:?}");
}

#![allow(clippy::unwrap_used)]
//! The core engine over a real store: publish → route → store → deliver → ack, and the
//! queue features (prefetch, round robin, requeue, DLX, TTL, limits, priority,
//! exclusivity, auto-delete, purge, get, durability across restarts, back-pressure).

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use triad_core::testing::eventually_blocking;
use triad_core::{
    Broker, ConsumeRequest, CoreConfig, CoreError, CreditGate, Delivery, ExchangeDef, ExchangeKind,
    FieldTable, FieldValue, OutEvent, Outbox, Properties, Publish, QueueDeclare, Vhost,
};
use triad_store::store::{Store, StoreConfig};

struct Env {
    _dir: tempfile::TempDir,
    broker: Arc<Broker>,
}

fn store_cfg(dir: &Path) -> StoreConfig {
    let mut c = StoreConfig::new(dir);
    c.segment_size = 1 << 20;
    c.cq_entries_per_file = 1024;
    c
}

fn open(dir: &Path, window: usize) -> Arc<Broker> {
    let store = Arc::new(Store::open(store_cfg(dir)).unwrap());
    let cfg = CoreConfig {
        queue_window: window,
        ..CoreConfig::default()
    };
    Broker::open(store, cfg).unwrap()
}

fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let broker = open(dir.path(), 64);
    Env { _dir: dir, broker }
}

fn vh(e: &Env) -> Arc<Vhost> {
    e.broker.vhost("/").unwrap()
}

fn declare(v: &Vhost, name: &str, durable: bool, args: FieldTable) -> String {
    v.declare_queue(QueueDeclare {
        name: name.into(),
        durable,
        arguments: args,
        conn: 1,
        ..Default::default()
    })
    .unwrap()
    .name
}

fn publish(
    v: &Vhost,
    exchange: &str,
    key: &str,
    body: &str,
    props: Properties,
) -> triad_core::Published {
    v.publish(Publish {
        exchange: exchange.into(),
        routing_key: key.into(),
        properties: props,
        body: Bytes::from(body.to_string()),
        conn: 1,
        ..Default::default()
    })
    .unwrap()
}

fn persistent() -> Properties {
    Properties {
        delivery_mode: Some(2),
        ..Default::default()
    }
}

fn consume(
    v: &Vhost,
    q: &str,
    tag: &str,
    prefetch: u32,
    outbox: &Arc<Outbox>,
) -> triad_core::ConsumerHandle {
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
            OutEvent::Cancelled { .. } | OutEvent::Reply(_) => None,
        })
        .collect()
}

fn bodies(ds: &[Delivery]) -> Vec<String> {
    ds.iter()
        .map(|d| String::from_utf8(d.body.to_vec()).unwrap())
        .collect()
}

fn s(v: &str) -> FieldValue {
    FieldValue::LongString(Bytes::from(v.to_string()))
}

#[test]
fn publish_consume_ack_through_default_and_topic_exchanges() {
    let e = env();
    let v = vh(&e);
    let q = declare(&v, "orders", false, FieldTable::default());
    v.bind_queue(&q, "amq.topic", "orders.*.eu", &FieldTable::default(), 1)
        .unwrap();
    assert!(publish(&v, "", "orders", "direct", Properties::default()).routed);
    assert!(
        publish(
            &v,
            "amq.topic",
            "orders.new.eu",
            "topic",
            Properties::default()
        )
        .routed
    );
    assert!(
        !publish(
            &v,
            "amq.topic",
            "orders.new.us",
            "nowhere",
            Properties::default()
        )
        .routed
    );
    assert_eq!(v.queue(&q).unwrap().message_count(), 2);
    let o = Outbox::new(100);
    let _c = consume(&v, &q, "c1", 0, &o);
    let ds = drain(&o);
    assert_eq!(bodies(&ds), ["direct", "topic"]);
    assert_eq!(&*ds[1].exchange, "amq.topic");
    assert_eq!(&*ds[1].routing_key, "orders.new.eu");
    assert!(!ds[0].redelivered);
    let queue = ds[0].queue.clone();
    assert_eq!(queue.unacked_count(), 2);
    queue.ack(&[ds[0].offset, ds[1].offset]);
    assert_eq!(queue.unacked_count(), 0);
    assert_eq!(queue.message_count(), 0);
}

#[test]
fn prefetch_limits_and_round_robin() {
    let e = env();
    let v = vh(&e);
    let q = declare(&v, "work", false, FieldTable::default());
    let (a, b) = (Outbox::new(100), Outbox::new(100));
    let _ca = consume(&v, &q, "a", 2, &a);
    let _cb = consume(&v, &q, "b", 2, &b);
    for i in 0..10 {
        publish(&v, "", &q, &format!("m{i}"), Properties::default());
    }
    let (da, db) = (drain(&a), drain(&b));
    assert_eq!(bodies(&da), ["m0", "m2"]);
    assert_eq!(bodies(&db), ["m1", "m3"]);
    let queue = v.queue(&q).unwrap();
    assert_eq!(queue.message_count(), 6);
    queue.ack(&[da[0].offset]);
    assert_eq!(bodies(&drain(&a)), ["m4"]);
    assert!(drain(&b).is_empty());
}

#[test]
fn nack_requeue_is_redelivered_first_and_reject_dead_letters() {
    let e = env();
    let v = vh(&e);
    let dlq = declare(&v, "dead", false, FieldTable::default());
    v.declare_exchange(ExchangeDef::new("dlx", ExchangeKind::Fanout), false)
        .unwrap();
    v.bind_queue(&dlq, "dlx", "", &FieldTable::default(), 1)
        .unwrap();
    let mut args = FieldTable::default();
    args.insert("x-dead-letter-exchange", s("dlx"));
    let q = declare(&v, "main", false, args);
    publish(&v, "", &q, "one", Properties::default());
    publish(&v, "", &q, "two", Properties::default());
    let o = Outbox::new(100);
    let c = consume(&v, &q, "c", 1, &o);
    let d1 = drain(&o);
    assert_eq!(bodies(&d1), ["one"]);
    d1[0].queue.nack(&[d1[0].offset], true);
    let d2 = drain(&o);
    assert_eq!(bodies(&d2), ["one"]);
    assert!(d2[0].redelivered);
    d2[0].queue.nack(&[d2[0].offset], false);
    let d3 = drain(&o);
    assert_eq!(bodies(&d3), ["two"]);
    c.cancel();
    let got = v.get(&dlq, true, 1).unwrap().unwrap();
    assert_eq!(got.body.as_ref(), b"one");
    let deaths = got
        .properties
        .headers
        .as_ref()
        .unwrap()
        .get("x-death")
        .unwrap()
        .as_array()
        .unwrap();
    let first = deaths[0].as_table().unwrap();
    assert_eq!(first.get_str("reason"), Some("rejected"));
    assert_eq!(first.get_str("queue"), Some("main"));
    assert_eq!(first.get_i64("count"), Some(1));
    assert_eq!(
        got.properties
            .headers
            .as_ref()
            .unwrap()
            .get_str("x-first-death-reason"),
        Some("rejected")
    );
}

#[test]
fn message_ttl_expires_into_the_dead_letter_queue() {
    let e = env();
    let v = vh(&e);
    let dlq = declare(&v, "expired", false, FieldTable::default());
    let mut args = FieldTable::default();
    args.insert("x-message-ttl", FieldValue::I32(30));
    args.insert("x-dead-letter-exchange", s(""));
    args.insert("x-dead-letter-routing-key", s("expired"));
    let q = declare(&v, "ttl", false, args);
    publish(&v, "", &q, "old", Properties::default());
    // per-message expiration on a queue without TTL
    let q2 = declare(&v, "per-msg", false, FieldTable::default());
    publish(
        &v,
        "",
        &q2,
        "short",
        Properties {
            expiration: Some("20".into()),
            ..Default::default()
        },
    );
    publish(
        &v,
        "",
        &q2,
        "long",
        Properties {
            expiration: Some("600000".into()),
            ..Default::default()
        },
    );
    eventually_blocking("the short TTL to expire", Duration::from_secs(10), || {
        e.broker.tick();
        v.queue(&q).unwrap().message_count() == 0
    });
    let d = v.get(&dlq, true, 1).unwrap().unwrap();
    assert_eq!(d.body.as_ref(), b"old");
    assert_eq!(v.get(&q2, true, 1).unwrap().unwrap().body.as_ref(), b"long");
}

#[test]
fn max_length_drop_head_and_reject_publish() {
    let e = env();
    let v = vh(&e);
    let mut args = FieldTable::default();
    args.insert("x-max-length", FieldValue::I32(2));
    let q = declare(&v, "short", false, args);
    for b in ["a", "b", "c"] {
        publish(&v, "", &q, b, Properties::default());
    }
    assert_eq!(v.get(&q, true, 1).unwrap().unwrap().body.as_ref(), b"b");
    let mut args = FieldTable::default();
    args.insert("x-max-length-bytes", FieldValue::I32(10));
    args.insert("x-overflow", s("reject-publish"));
    let r = declare(&v, "bytes", false, args);
    assert!(!publish(&v, "", &r, "12345", Properties::default()).rejected);
    assert!(!publish(&v, "", &r, "12345", Properties::default()).rejected);
    assert!(publish(&v, "", &r, "x", Properties::default()).rejected);
    assert_eq!(v.queue(&r).unwrap().message_count(), 2);
}

#[test]
fn priority_queue_delivers_highest_first() {
    let e = env();
    let v = vh(&e);
    let mut args = FieldTable::default();
    args.insert("x-max-priority", FieldValue::I32(10));
    let q = declare(&v, "prio", false, args);
    for (b, p) in [("low", 1), ("high", 9), ("mid", 5), ("none", 0)] {
        publish(
            &v,
            "",
            &q,
            b,
            Properties {
                priority: Some(p),
                ..Default::default()
            },
        );
    }
    let got: Vec<_> = (0..4)
        .map(|_| v.get(&q, true, 1).unwrap().unwrap())
        .collect();
    assert_eq!(bodies(&got), ["high", "mid", "low", "none"]);
}

#[test]
fn exclusive_queues_are_locked_and_die_with_their_connection() {
    let e = env();
    let v = vh(&e);
    let name = v
        .declare_queue(QueueDeclare {
            exclusive: true,
            conn: 7,
            ..Default::default()
        })
        .unwrap()
        .name;
    assert!(name.starts_with("amq.gen-"));
    let err = v.purge_queue(&name, 8).unwrap_err();
    assert!(matches!(err, CoreError::ResourceLocked(_)), "{err:?}");
    assert!(v.purge_queue(&name, 7).is_ok());
    e.broker.connection_closed(7);
    assert!(v.queue(&name).is_none());
}

#[test]
fn exclusive_consumer_and_auto_delete() {
    let e = env();
    let v = vh(&e);
    let q = v
        .declare_queue(QueueDeclare {
            name: "ad".into(),
            auto_delete: true,
            conn: 1,
            ..Default::default()
        })
        .unwrap()
        .name;
    let o = Outbox::new(10);
    let c = v
        .consume(
            &q,
            ConsumeRequest {
                tag: "x".into(),
                no_ack: true,
                exclusive: true,
                prefetch: 0,
                priority: 0,
                conn: 1,
                outbox: o.clone(),
                gate: None,
                filter: None,
            },
        )
        .unwrap();
    let err = v
        .consume(
            &q,
            ConsumeRequest {
                tag: "y".into(),
                no_ack: true,
                exclusive: false,
                prefetch: 0,
                priority: 0,
                conn: 2,
                outbox: o.clone(),
                gate: None,
                filter: None,
            },
        )
        .unwrap_err();
    assert!(matches!(err, CoreError::AccessRefused(_)));
    c.cancel();
    assert!(
        v.queue(&q).is_none(),
        "auto-delete queue removed with its last consumer"
    );
}

#[test]
fn deleting_a_queue_cancels_its_consumers_and_bindings() {
    let e = env();
    let v = vh(&e);
    let q = declare(&v, "gone", false, FieldTable::default());
    v.bind_queue(&q, "amq.fanout", "", &FieldTable::default(), 1)
        .unwrap();
    let o = Outbox::new(10);
    let _c = consume(&v, &q, "c", 0, &o);
    assert_eq!(v.delete_queue(&q, false, false, 1).unwrap(), 0);
    let mut evs = Vec::new();
    o.drain(&mut evs, 10);
    assert!(matches!(&evs[..], [OutEvent::Cancelled { tag }] if &**tag == "c"));
    assert!(!publish(&v, "amq.fanout", "", "x", Properties::default()).routed);
}

#[test]
fn inequivalent_redeclare_and_reserved_names() {
    let e = env();
    let v = vh(&e);
    declare(&v, "q", true, FieldTable::default());
    let err = v
        .declare_queue(QueueDeclare {
            name: "q".into(),
            durable: false,
            conn: 1,
            ..Default::default()
        })
        .unwrap_err();
    assert!(matches!(err, CoreError::PreconditionFailed(_)), "{err:?}");
    let err = v
        .declare_queue(QueueDeclare {
            name: "amq.mine".into(),
            conn: 1,
            ..Default::default()
        })
        .unwrap_err();
    assert!(matches!(err, CoreError::AccessRefused(_)));
    let err = v
        .declare_queue(QueueDeclare {
            name: "missing".into(),
            passive: true,
            conn: 1,
            ..Default::default()
        })
        .unwrap_err();
    assert!(matches!(err, CoreError::NotFound { .. }));
}

#[test]
fn purge_counts_and_get_reports_remaining() {
    let e = env();
    let v = vh(&e);
    let q = declare(&v, "p", false, FieldTable::default());
    for i in 0..200 {
        publish(&v, "", &q, &format!("{i}"), Properties::default());
    }
    let d = v.get(&q, false, 1).unwrap().unwrap();
    assert_eq!(d.message_count, 199);
    assert_eq!(v.purge_queue(&q, 1).unwrap(), 199);
    assert!(v.get(&q, true, 1).unwrap().is_none());
    d.queue.nack(&[d.offset], true);
    assert_eq!(v.get(&q, true, 1).unwrap().unwrap().body.as_ref(), b"0");
}

#[test]
fn backlog_beyond_the_window_is_delivered_in_order() {
    let e = env();
    let v = vh(&e);
    let q = declare(&v, "big", true, FieldTable::default());
    for i in 0..1000 {
        publish(&v, "", &q, &format!("{i}"), persistent());
    }
    let o = Outbox::new(10_000);
    let _c = consume(&v, &q, "c", 0, &o);
    let ds = drain(&o);
    let expect: Vec<String> = (0..1000).map(|i| i.to_string()).collect();
    assert_eq!(bodies(&ds), expect);
}

#[test]
fn a_full_outbox_pauses_deliveries_until_drained() {
    let e = env();
    let v = vh(&e);
    let q = declare(&v, "slow", false, FieldTable::default());
    let o = Outbox::new(4);
    let c = v
        .consume(
            &q,
            ConsumeRequest {
                tag: "c".into(),
                no_ack: true,
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
    for i in 0..20 {
        publish(&v, "", &q, &format!("{i}"), Properties::default());
    }
    assert_eq!(o.len(), 4);
    let mut all = Vec::new();
    for _ in 0..10 {
        all.extend(drain(&o));
    }
    assert_eq!(all.len(), 20);
    assert_eq!(bodies(&all)[19], "19");
    c.cancel();
}

#[test]
fn channel_gate_limits_across_consumers() {
    let e = env();
    let v = vh(&e);
    let q1 = declare(&v, "g1", false, FieldTable::default());
    let q2 = declare(&v, "g2", false, FieldTable::default());
    let o = Outbox::new(100);
    let gate = CreditGate::new(3);
    for (q, tag) in [(&q1, "a"), (&q2, "b")] {
        v.consume(
            q,
            ConsumeRequest {
                tag: tag.into(),
                no_ack: false,
                exclusive: false,
                prefetch: 0,
                priority: 0,
                conn: 1,
                outbox: o.clone(),
                gate: Some(gate.clone()),
                filter: None,
            },
        )
        .unwrap();
    }
    for i in 0..5 {
        publish(&v, "", &q1, &format!("a{i}"), Properties::default());
        publish(&v, "", &q2, &format!("b{i}"), Properties::default());
    }
    let ds = drain(&o);
    assert_eq!(ds.len(), 3);
    let d = ds.iter().find(|d| d.queue.name() == "g1").unwrap();
    d.queue.ack(&[d.offset]);
    assert_eq!(drain(&o).len(), 1);
    gate.set_limit(0);
    assert_eq!(drain(&o).len(), 6);
}

#[test]
fn durable_topology_and_persistent_messages_survive_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = open(dir.path(), 64);
        let v = b.vhost("/").unwrap();
        v.declare_exchange(
            ExchangeDef {
                durable: true,
                ..ExchangeDef::new("events", ExchangeKind::Topic)
            },
            false,
        )
        .unwrap();
        let q = declare(&v, "keep", true, FieldTable::default());
        declare(&v, "transient", false, FieldTable::default());
        v.bind_queue(&q, "events", "a.#", &FieldTable::default(), 1)
            .unwrap();
        let p = publish(&v, "events", "a.b", "hello", persistent());
        futures_lite_block_on(p.durable.expect("persistent to durable waits for disk")).unwrap();
        publish(&v, "events", "a.c", "second", persistent());
        let o = Outbox::new(10);
        let _c = consume(&v, &q, "c", 1, &o);
        let d = drain(&o);
        assert_eq!(bodies(&d), ["hello"]);
        // delivered but never acked: comes back redelivered
        let b2 = b.store().clone();
        drop(v);
        drop(b);
        drop(b2);
    }
    let b = open(dir.path(), 64);
    let v = b.vhost("/").unwrap();
    assert!(v.queue("transient").is_none());
    assert!(v.has_exchange("events"));
    let got: Vec<Delivery> = (0..2)
        .map(|_| v.get("keep", true, 1).unwrap().unwrap())
        .collect();
    assert_eq!(bodies(&got), ["hello", "second"]);
    assert!(got[0].redelivered);
    assert!(!got[1].redelivered);
    assert!(
        publish(
            &v,
            "events",
            "a.z",
            "routed after restart",
            Properties::default()
        )
        .routed
    );
}

#[test]
fn a_vhost_added_after_start_up_loads_from_the_journal_files_and_survives_restart() {
    // after Broker::open the journal holds no metadata in memory: a vhost added at run
    // time reads its (here: earlier) records back from the snapshot and journal files
    let dir = tempfile::tempdir().unwrap();
    {
        let b = open(dir.path(), 64);
        let v = b.vhost("/").unwrap();
        let q = declare(&v, "root-q", true, FieldTable::default());
        v.bind_queue(&q, "amq.topic", "dev.1.*", &FieldTable::default(), 1)
            .unwrap();
        let extra = b.add_vhost("extra").unwrap();
        assert!(extra.queue_names().is_empty());
        let q2 = declare(&extra, "extra-q", true, FieldTable::default());
        extra
            .bind_queue(&q2, "amq.topic", "x.#", &FieldTable::default(), 1)
            .unwrap();
        // added again: the same vhost
        assert!(Arc::ptr_eq(&b.add_vhost("extra").unwrap(), &extra));
        drop((v, extra, b));
    }
    let b = open(dir.path(), 64);
    for (vhost, queue, key) in [("/", "root-q", "dev.1.cmd"), ("extra", "extra-q", "x.y.z")] {
        let v = b.vhost(vhost).unwrap();
        assert!(v.queue(queue).is_some(), "{vhost}");
        assert!(
            publish(&v, "amq.topic", key, "m", Properties::default()).routed,
            "{vhost}: binding restored"
        );
        assert_eq!(v.queue(queue).unwrap().message_count(), 1, "{vhost}");
    }
}

#[test]
fn a_long_backlog_is_recovered_in_batches_and_transient_messages_dropped() {
    // more than one batch of Queue::new's walk (65,536 entries)
    const N: usize = 70_000;
    let dir = tempfile::tempdir().unwrap();
    {
        let b = open(dir.path(), 64);
        let v = b.vhost("/").unwrap();
        let q = declare(&v, "long", true, FieldTable::default());
        let mut last = None;
        for i in 0..N {
            // every third message transient, the rest persistent
            let props = if i % 3 == 2 {
                Properties::default()
            } else {
                persistent()
            };
            last = publish(&v, "", &q, &format!("m{i}"), props)
                .durable
                .or(last);
        }
        futures_lite_block_on(last.expect("persistent messages wait for disk")).unwrap();
        assert_eq!(v.queue(&q).unwrap().message_count() as usize, N);
        drop(v);
        drop(b);
    }
    let b = open(dir.path(), 64);
    let v = b.vhost("/").unwrap();
    let kept = N - N / 3;
    assert_eq!(v.queue("long").unwrap().message_count() as usize, kept);
    let mut want = (0..N).filter(|i| i % 3 != 2);
    for _ in 0..kept {
        let d = v.get("long", true, 1).unwrap().expect("a message");
        assert_eq!(bodies(&[d])[0], format!("m{}", want.next().unwrap()));
    }
    assert!(v.get("long", true, 1).unwrap().is_none());
}

#[test]
fn authentication_and_loopback_users() {
    let e = env();
    let local: IpAddr = "127.0.0.1".parse().unwrap();
    let remote: IpAddr = "192.0.2.1".parse().unwrap();
    assert!(e.broker.authenticate("guest", "guest", local).is_ok());
    assert!(matches!(
        e.broker.authenticate("guest", "nope", local),
        Err(CoreError::AccessRefused(_))
    ));
    assert!(matches!(
        e.broker.authenticate("guest", "guest", remote),
        Err(CoreError::NotAllowed(_))
    ));
    assert!(matches!(
        e.broker.authenticate("nobody", "guest", local),
        Err(CoreError::AccessRefused(_))
    ));
    assert!(matches!(
        e.broker.vhost("nope"),
        Err(CoreError::NotFound { .. })
    ));
}

/// A tiny executor for one future (the store's Durable is a plain Future).
fn futures_lite_block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::task::{Context, Poll, Wake, Waker};
    struct T(std::thread::Thread);
    impl Wake for T {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(T(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_millis(10));
    }
}

#[test]
fn message_priority_is_ignored_without_x_max_priority_even_beyond_the_window() {
    let e = env();
    let v = vh(&e);
    let q = declare(&v, "fifo", false, FieldTable::default());
    // more than the window (64), so most entries are loaded back from the consume queue
    for i in 0..300u32 {
        publish(
            &v,
            "",
            &q,
            &i.to_string(),
            Properties {
                priority: Some((i % 10) as u8),
                ..Default::default()
            },
        );
    }
    let got: Vec<String> = (0..300)
        .map(|_| bodies(&[v.get(&q, true, 1).unwrap().unwrap()]).remove(0))
        .collect();
    let expect: Vec<String> = (0..300).map(|i| i.to_string()).collect();
    assert_eq!(got, expect);
}

fn publish_from(v: &Vhost, key: &str, conn: u64) -> triad_core::Published {
    v.publish(Publish {
        exchange: String::new(),
        routing_key: key.into(),
        properties: Properties::default(),
        body: Bytes::from_static(b"x"),
        conn,
        ..Default::default()
    })
    .unwrap()
}

fn poll_once(f: std::pin::Pin<&mut impl std::future::Future<Output = ()>>) -> bool {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    f.poll(&mut cx).is_ready()
}

#[test]
fn a_queue_behind_its_consumers_throttles_other_publishers_until_it_drains() {
    use triad_core::queue::{FLOW_HIGH, FLOW_LOW};
    let e = env();
    let v = vh(&e);
    let q = declare(&v, "flow", false, FieldTable::default());
    // no consumer: never throttled, however deep
    for _ in 0..FLOW_HIGH + 10 {
        assert!(publish_from(&v, &q, 2).backpressure.is_none());
    }
    let o = Outbox::new(100_000);
    let prefetch = 8u32;
    let c = consume(&v, &q, "c", prefetch, &o); // consumer on connection 1
    let bp = publish_from(&v, &q, 2)
        .backpressure
        .expect("a publish beyond the high-water mark is throttled");
    assert!(!bp.is_clear());
    // the consuming connection itself is never held (it must read its acks)
    assert!(publish_from(&v, &q, 1).backpressure.is_none());
    let wait = bp.clone();
    let mut fut = std::pin::pin!(wait.wait());
    assert!(!poll_once(fut.as_mut()));
    // ack until the backlog (ready + unacked beyond the credit) reaches the low mark
    let mut backlog = FLOW_HIGH + 12;
    while backlog > FLOW_LOW + u64::from(prefetch) {
        let ds = drain(&o);
        assert!(!ds.is_empty());
        for d in ds {
            assert!(!bp.is_clear() || backlog <= FLOW_LOW + u64::from(prefetch));
            d.queue.ack(&[d.offset]);
            backlog -= 1;
        }
    }
    assert!(bp.is_clear());
    assert!(poll_once(fut.as_mut()), "the waiting publisher is woken");
    assert!(publish_from(&v, &q, 2).backpressure.is_none());

    // throttled again, then the consumer goes away: publishers are released
    for _ in 0..FLOW_HIGH + 10 {
        publish_from(&v, &q, 2);
    }
    let bp = publish_from(&v, &q, 2).backpressure.expect("throttled");
    c.cancel();
    assert!(
        bp.is_clear(),
        "a queue without consumers does not hold publishers"
    );
}

/// The vhost's bindings as sorted (source, destination, key) triples.
fn binding_set(v: &Vhost) -> Vec<(String, String, String)> {
    let mut out: Vec<_> = v
        .bindings()
        .into_iter()
        .filter(|b| !b.source.starts_with("amq.") || b.source == "amq.topic")
        .map(|b| {
            let d = match b.destination {
                triad_core::Destination::Queue(q) => format!("q:{q}"),
                triad_core::Destination::Exchange(x) => format!("x:{x}"),
            };
            (b.source, d, b.routing_key)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn topology_changes_are_journal_records_that_replay_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let durable_x = |name: &str, kind, auto_delete| ExchangeDef {
        durable: true,
        auto_delete,
        ..ExchangeDef::new(name, kind)
    };
    let none = FieldTable::default;
    let (bindings, journal_growth) = {
        let b = open(dir.path(), 64);
        let v = b.vhost("/").unwrap();
        v.declare_exchange(durable_x("ev", ExchangeKind::Topic, false), false)
            .unwrap();
        v.declare_exchange(durable_x("auto", ExchangeKind::Fanout, true), false)
            .unwrap();
        v.declare_exchange(durable_x("gone", ExchangeKind::Direct, false), false)
            .unwrap();
        declare(&v, "keep", true, none());
        declare(&v, "drop", true, none());
        declare(&v, "transient", false, none());
        v.bind_queue("keep", "ev", "a.#", &none(), 1).unwrap();
        v.bind_queue("drop", "ev", "b.#", &none(), 1).unwrap();
        v.bind_queue("keep", "amq.topic", "t.*", &none(), 1)
            .unwrap();
        v.bind_queue("transient", "ev", "c.#", &none(), 1).unwrap();
        // auto-delete exchange bound only to "drop": deleting the queue cascades to it
        v.bind_exchange("auto", "ev", "x.#", &none()).unwrap();
        v.bind_queue("drop", "auto", "", &none(), 1).unwrap();
        v.bind_queue("keep", "gone", "k", &none(), 1).unwrap();
        v.bind_exchange("ev", "gone", "k2", &none()).unwrap();
        v.delete_exchange("gone", false).unwrap();
        v.unbind_queue("keep", "amq.topic", "t.*", &none(), 1)
            .unwrap();
        v.delete_queue("drop", false, false, 1).unwrap();
        assert!(!v.has_exchange("auto"), "auto-delete cascade");
        // a queue deleted and declared again with the same name starts without bindings
        declare(&v, "drop", true, none());
        v.bind_queue("drop", "ev", "d.#", &none(), 1).unwrap();

        // one more binding costs one small record, however many exist
        let before = b.store().journal().position().0;
        v.bind_queue("keep", "ev", "z.#", &none(), 1).unwrap();
        let growth = b.store().journal().position().0 - before;
        (binding_set(&v), growth)
    };
    assert!(
        journal_growth < 128,
        "a binding took {journal_growth} bytes"
    );
    assert_eq!(
        bindings,
        vec![
            ("ev".into(), "q:drop".into(), "d.#".into()),
            ("ev".into(), "q:keep".into(), "a.#".into()),
            ("ev".into(), "q:keep".into(), "z.#".into()),
            ("ev".into(), "q:transient".into(), "c.#".into()),
        ]
    );
    for round in 0..2 {
        let b = open(dir.path(), 64);
        let v = b.vhost("/").unwrap();
        assert!(v.has_exchange("ev"));
        assert!(!v.has_exchange("gone") && !v.has_exchange("auto"));
        assert!(v.queue("keep").is_some() && v.queue("drop").is_some());
        assert!(v.queue("transient").is_none());
        let want: Vec<_> = bindings
            .iter()
            .filter(|b| b.1 != "q:transient")
            .cloned()
            .collect();
        assert_eq!(binding_set(&v), want, "round {round}");
        if round == 0 {
            // compacted into a snapshot: the same state again
            b.store().journal().compact().unwrap();
        }
    }
}

#[test]
fn an_earlier_versions_metadata_documents_are_moved_into_the_journal() {
    let dir = tempfile::tempdir().unwrap();
    {
        // what an earlier version wrote: the store's registry, the vhost list and the
        // vhost's topology as whole JSON documents
        let meta = triad_store::meta::MetaStore::open(&dir.path().join("meta")).unwrap();
        meta.put(
            "store-queues",
            &serde_json::json!({"next_id": 3, "queues": [
                {"id": 1, "vhost": "/", "name": "old", "durable": true, "dir": "old"}]}),
        )
        .unwrap();
        meta.put("vhosts", &serde_json::json!({"vhosts": ["/", "legacy"]}))
            .unwrap();
        meta.put(
            "vhost-2f",
            &serde_json::json!({
                "exchanges": [{"name": "ev", "kind": "topic", "auto_delete": false,
                               "internal": false, "arguments": ""}],
                "queues": [{"name": "old", "auto_delete": false, "arguments": ""}],
                "bindings": [{"source": "ev", "destination": "old", "to_exchange": false,
                              "key": "a.#", "arguments": ""}]}),
        )
        .unwrap();
    }
    let b = open(dir.path(), 64);
    assert!(b.has_vhost("legacy"));
    let v = b.vhost("/").unwrap();
    assert!(v.queue("old").is_some());
    assert_eq!(
        binding_set(&v),
        vec![("ev".into(), "q:old".into(), "a.#".into())]
    );
    // new ids continue above the old ceiling
    let q = declare(&v, "new", true, FieldTable::default());
    assert!(b.store().find_queue("/", &q).unwrap() >= 3);
    assert!(b.store().meta().list().unwrap().is_empty());
}

#[test]
fn single_active_consumer_fails_over_in_registration_order_with_unacked_first() {
    let e = env();
    let v = vh(&e);
    let mut args = FieldTable::default();
    args.insert("x-single-active-consumer", FieldValue::Bool(true));
    let q = declare(&v, "sac", true, args.clone());
    let (a, b, c) = (Outbox::new(100), Outbox::new(100), Outbox::new(100));
    let ca = consume(&v, &q, "a", 2, &a);
    let cb = consume(&v, &q, "b", 0, &b);
    let _cc = consume(&v, &q, "c", 0, &c);
    for i in 0..5 {
        publish(&v, "", &q, &format!("m{i}"), Properties::default());
    }
    // only the first registered consumer gets messages (up to its prefetch)
    let da = drain(&a);
    assert_eq!(bodies(&da), ["m0", "m1"]);
    assert!(drain(&b).is_empty() && drain(&c).is_empty());
    // its channel closes: the adapter cancels it, then requeues what it had unacked;
    // the next registered consumer (b, not c) takes over, the requeued messages first
    ca.cancel();
    let queue = v.queue(&q).unwrap();
    queue.nack(&da.iter().map(|d| d.offset).collect::<Vec<_>>(), true);
    let db = drain(&b);
    assert_eq!(bodies(&db), ["m0", "m1", "m2", "m3", "m4"]);
    assert!(db[0].redelivered && db[1].redelivered && !db[2].redelivered);
    assert!(drain(&c).is_empty());
    queue.ack(&db.iter().map(|d| d.offset).collect::<Vec<_>>());
    publish(&v, "", &q, "m5", Properties::default());
    let d5 = drain(&b);
    assert_eq!(bodies(&d5), ["m5"]);
    // cancelled while it holds m5: the next one waits until m5 is back, so that m5
    // still comes before m6 (per-key order across the failover)
    cb.cancel();
    publish(&v, "", &q, "m6", Properties::default());
    assert!(drain(&c).is_empty());
    queue.nack(&[d5[0].offset], true);
    assert_eq!(bodies(&drain(&c)), ["m5", "m6"]);
    // the argument is part of the queue's identity: a redeclare without it, or with
    // another value, is refused
    for other in [FieldTable::default(), {
        let mut t = FieldTable::default();
        t.insert("x-single-active-consumer", FieldValue::Bool(false));
        t
    }] {
        let r = v.declare_queue(QueueDeclare {
            name: "sac".into(),
            durable: true,
            arguments: other,
            conn: 1,
            ..Default::default()
        });
        assert!(
            matches!(r, Err(CoreError::PreconditionFailed(ref m)) if m.contains("x-single-active-consumer")),
            "{r:?}"
        );
    }
    // a value that is not a boolean is refused
    let mut bad = FieldTable::default();
    bad.insert("x-single-active-consumer", s("yes"));
    let r = v.declare_queue(QueueDeclare {
        name: "sac-bad".into(),
        arguments: bad,
        conn: 1,
        ..Default::default()
    });
    assert!(matches!(r, Err(CoreError::PreconditionFailed(_))), "{r:?}");
}

#[test]
fn single_active_consumer_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = open(dir.path(), 64);
        let mut args = FieldTable::default();
        args.insert("x-single-active-consumer", FieldValue::Bool(true));
        declare(&b.vhost("/").unwrap(), "sac", true, args);
    }
    let b = open(dir.path(), 64);
    let v = b.vhost("/").unwrap();
    assert!(v.queue("sac").unwrap().args().single_active_consumer);
    let (a, o) = (Outbox::new(100), Outbox::new(100));
    let _ca = consume(&v, "sac", "a", 0, &a);
    let _co = consume(&v, "sac", "o", 0, &o);
    for i in 0..3 {
        publish(&v, "", "sac", &format!("m{i}"), Properties::default());
    }
    assert_eq!(bodies(&drain(&a)), ["m0", "m1", "m2"]);
    assert!(drain(&o).is_empty());
}

#[test]
fn direct_reply_names_route_only_in_their_vhost_and_only_while_consumed() {
    let e = env();
    let link = e
        .broker
        .login(
            triad_core::Credentials::Password {
                user: "guest",
                password: "guest",
            },
            triad_core::Peer {
                addr: "127.0.0.1".parse().unwrap(),
                conn: e.broker.next_connection_id(),
                failed_login_delay: Duration::ZERO,
            },
            "/",
            triad_core::Protocol::Amqp,
        )
        .unwrap();
    let out = Outbox::new(8);
    let reply = link.consume_direct_reply(Arc::from("r"), &out).unwrap();
    let name = reply.name().to_string();
    let reply_to = |v: &Vhost, mandatory| {
        v.publish(Publish {
            exchange: String::new(),
            routing_key: name.clone(),
            mandatory,
            body: Bytes::from_static(b"answer"),
            ..Default::default()
        })
        .unwrap()
    };
    // the same name in another vhost reaches nothing
    let other = e.broker.add_vhost("other").unwrap();
    assert!(!reply_to(&other, true).routed);
    // in its own vhost it reaches the consumer's outbox, stored nowhere
    let home = vh(&e);
    let p = reply_to(&home, false);
    assert!(p.routed && p.durable.is_none());
    let mut evs = Vec::new();
    out.drain(&mut evs, 10);
    assert!(
        matches!(&evs[..], [OutEvent::Reply(r)] if &*r.tag == "r" && *r.routing_key == *name && &r.body[..] == b"answer")
    );
    // a transaction's publish to it too
    let res = home
        .publish_all(vec![Publish {
            routing_key: name.clone(),
            body: Bytes::from_static(b"tx"),
            ..Default::default()
        }])
        .unwrap();
    assert!(res[0].routed);
    // retired with its consumer: unroutable, nothing left registered
    drop(reply);
    assert!(!reply_to(&home, true).routed);
    assert!(home.direct_replies().is_empty());
}

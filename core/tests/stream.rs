#![allow(clippy::unwrap_used, clippy::indexing_slicing)]
//! Stream queues over a real store: start positions, independent cursors, credit,
//! refusals, stored consumer offsets across a restart, retention.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use triad_core::stream::{OffsetReset, StreamConsume, StreamOffset};
use triad_core::testing;
use triad_core::{
    Broker, Clock, ConsumeRequest, CoreError, Delivery, FieldTable, FieldValue, OutEvent, Outbox,
    Properties, Publish, QueueDeclare, Vhost,
};
use triad_store::store::StoreConfig;

fn open(dir: &Path) -> Arc<Broker> {
    open_clocked(dir, Clock::system())
}

/// A broker whose expiry decisions (retention by age) read `clock`.
fn open_clocked(dir: &Path, clock: Clock) -> Arc<Broker> {
    let mut c = StoreConfig::new(dir);
    c.segment_size = 64 << 10;
    c.cq_entries_per_file = 256;
    testing::open_clocked(c, clock)
}

fn s(v: &str) -> FieldValue {
    FieldValue::LongString(Bytes::from(v.to_string()))
}

fn stream_args(extra: &[(&str, FieldValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert("x-queue-type", s("stream"));
    for (k, v) in extra {
        t.insert(*k, v.clone());
    }
    t
}

fn declare(v: &Vhost, name: &str, args: FieldTable) -> Result<(), CoreError> {
    v.declare_queue(QueueDeclare {
        name: name.into(),
        durable: true,
        arguments: args,
        conn: 1,
        ..Default::default()
    })
    .map(|_| ())
}

fn publish(v: &Vhost, q: &str, body: &str) {
    let p = v
        .publish(Publish {
            exchange: String::new(),
            routing_key: q.into(),
            properties: Properties {
                delivery_mode: Some(2),
                ..Default::default()
            },
            body: Bytes::from(body.to_string()),
            conn: 1,
            ..Default::default()
        })
        .unwrap();
    assert!(p.routed);
}

fn req(tag: &str, prefetch: u32, outbox: &Arc<Outbox>) -> ConsumeRequest {
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
    }
}

fn consume(
    v: &Vhost,
    q: &str,
    prefetch: u32,
    offset: Option<StreamOffset>,
    name: Option<&str>,
) -> (triad_core::ConsumerHandle, Arc<Outbox>) {
    let o = Outbox::new(1000);
    let h = v
        .consume_stream(
            q,
            req("c", prefetch, &o),
            StreamConsume {
                offset,
                name: name.map(str::to_string),
            },
        )
        .unwrap();
    (h, o)
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

fn offsets(ds: &[Delivery]) -> Vec<i64> {
    ds.iter()
        .map(|d| {
            d.properties
                .headers
                .as_ref()
                .and_then(|h| h.get("x-stream-offset"))
                .and_then(FieldValue::as_i64)
                .unwrap()
        })
        .collect()
}

fn ack_all(ds: &[Delivery]) {
    triad_core::link::settle(ds.iter().map(|d| (&d.queue, d.offset)), true, false);
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[test]
fn declare_and_operations_are_refused_as_rabbitmq_does() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    let refused = |d: QueueDeclare, word: &str| match v.declare_queue(d) {
        Err(CoreError::PreconditionFailed(m)) => assert!(m.contains(word), "{m}"),
        other => panic!("{other:?}"),
    };
    let base = || QueueDeclare {
        name: "s".into(),
        durable: true,
        arguments: stream_args(&[]),
        conn: 1,
        ..Default::default()
    };
    refused(
        QueueDeclare {
            durable: false,
            ..base()
        },
        "non-durable",
    );
    refused(
        QueueDeclare {
            exclusive: true,
            ..base()
        },
        "exclusive-owner",
    );
    refused(
        QueueDeclare {
            auto_delete: true,
            ..base()
        },
        "auto-delete",
    );
    refused(
        QueueDeclare {
            arguments: stream_args(&[("x-message-ttl", FieldValue::I32(5))]),
            ..base()
        },
        "x-message-ttl",
    );
    refused(
        QueueDeclare {
            arguments: stream_args(&[("x-max-age", s("10x"))]),
            ..base()
        },
        "x-max-age",
    );
    declare(&v, "s", stream_args(&[])).unwrap();
    publish(&v, "s", "a");
    assert!(
        matches!(v.get("s", false, 1), Err(CoreError::NotImplemented(m)) if m.contains("basic.get"))
    );
    assert!(matches!(
        v.purge_queue("s", 1),
        Err(CoreError::NotImplemented(_))
    ));
    let o = Outbox::new(10);
    assert!(matches!(
        v.consume_stream("s", req("c", 0, &o), StreamConsume::default()),
        Err(CoreError::PreconditionFailed(m)) if m.contains("prefetch")
    ));
    let mut r = req("c", 10, &o);
    r.no_ack = true;
    assert!(matches!(
        v.consume_stream("s", r, StreamConsume::default()),
        Err(CoreError::NotImplemented(m)) if m.contains("automatic acknowledgement")
    ));
    // stream options on a classic queue are refused, not ignored
    declare(&v, "classic", FieldTable::default()).unwrap();
    assert!(matches!(
        v.consume_stream(
            "classic",
            req("c", 10, &o),
            StreamConsume {
                offset: Some(StreamOffset::First),
                name: None
            }
        ),
        Err(CoreError::PreconditionFailed(m)) if m.contains("x-stream-offset") && m.contains("classic")
    ));
    // an exclusive consumer (RabbitMQ accepts them on streams) keeps others out
    let mut r = req("x", 10, &o);
    r.exclusive = true;
    let _x = v.consume_stream("s", r, StreamConsume::default()).unwrap();
    assert!(matches!(
        v.consume_stream("s", req("y", 10, &o), StreamConsume::default()),
        Err(CoreError::AccessRefused(m)) if m.contains("exclusive")
    ));
    // redeclaring a stream without x-queue-type is inequivalent, as RabbitMQ
    match declare(&v, "s", FieldTable::default()) {
        Err(CoreError::PreconditionFailed(m)) => assert!(m.contains("x-queue-type"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn consumers_read_from_their_own_positions_and_acks_remove_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    declare(&v, "s", stream_args(&[])).unwrap();
    for i in 0..5 {
        publish(&v, "s", &format!("m{i}"));
    }
    let (_first, o1) = consume(&v, "s", 100, Some(StreamOffset::First), None);
    let d1 = drain(&o1);
    assert_eq!(offsets(&d1), [0, 1, 2, 3, 4]);
    assert_eq!(&d1[2].body[..], b"m2");
    ack_all(&d1);
    // acks removed nothing: another consumer reads them all again
    let (_again, o2) = consume(&v, "s", 100, Some(StreamOffset::First), None);
    assert_eq!(offsets(&drain(&o2)), [0, 1, 2, 3, 4]);
    assert_eq!(v.queue("s").unwrap().message_count(), 5);
    let (_last, o3) = consume(&v, "s", 100, Some(StreamOffset::Last), None);
    assert_eq!(offsets(&drain(&o3)), [4]);
    let (_at, o4) = consume(&v, "s", 100, Some(StreamOffset::Offset(3)), None);
    assert_eq!(offsets(&drain(&o4)), [3, 4]);
    let (_next, o5) = consume(&v, "s", 100, None, None);
    assert!(drain(&o5).is_empty());
    publish(&v, "s", "m5");
    // the new entry reaches every consumer, "next" included
    for o in [&o1, &o2, &o3, &o4, &o5] {
        assert_eq!(offsets(&drain(o)), [5]);
    }
    // past the end: waits at the end
    let (_far, o6) = consume(&v, "s", 100, Some(StreamOffset::Offset(1000)), None);
    assert!(drain(&o6).is_empty());
}

#[test]
fn prefetch_bounds_each_consumer_and_acks_return_credit() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    declare(&v, "s", stream_args(&[])).unwrap();
    for i in 0..10 {
        publish(&v, "s", &format!("m{i}"));
    }
    let (_c, o) = consume(&v, "s", 3, Some(StreamOffset::First), None);
    let d = drain(&o);
    assert_eq!(offsets(&d), [0, 1, 2]);
    assert_eq!(v.queue("s").unwrap().unacked_count(), 3);
    ack_all(&d[..1]);
    assert_eq!(offsets(&drain(&o)), [3]);
    // a nack (even with requeue) redelivers nothing: it returns credit
    triad_core::link::settle(d[1..].iter().map(|d| (&d.queue, d.offset)), false, true);
    assert_eq!(offsets(&drain(&o)), [4, 5]);
}

#[test]
fn a_timestamp_start_finds_the_first_entry_at_or_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    declare(&v, "s", stream_args(&[])).unwrap();
    for i in 0..300 {
        publish(&v, "s", &format!("old{i}"));
    }
    // the next entries are stored at or after `t`, every earlier one before it
    let t = now_ms() + 1;
    let deadline = Instant::now() + Duration::from_secs(5);
    while now_ms() < t {
        assert!(Instant::now() < deadline);
        std::thread::yield_now();
    }
    for i in 0..7 {
        publish(&v, "s", &format!("new{i}"));
    }
    let (_c, o) = consume(&v, "s", 100, Some(StreamOffset::Timestamp(t)), None);
    let d = drain(&o);
    assert_eq!(offsets(&d), [300, 301, 302, 303, 304, 305, 306]);
    assert_eq!(&d[0].body[..], b"new0");
    // a time before everything is the first entry; one after everything is the end
    let (_c, o) = consume(&v, "s", 1, Some(StreamOffset::Timestamp(0)), None);
    assert_eq!(offsets(&drain(&o)), [0]);
    let (_c, o) = consume(
        &v,
        "s",
        1,
        Some(StreamOffset::Timestamp(t + 3_600_000)),
        None,
    );
    assert!(drain(&o).is_empty());
}

#[test]
fn a_named_consumer_resumes_after_its_last_ack_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = open(dir.path());
        let v = b.vhost("/").unwrap();
        declare(&v, "s", stream_args(&[])).unwrap();
        for i in 0..10 {
            publish(&v, "s", &format!("m{i}"));
        }
        let (c, o) = consume(&v, "s", 4, Some(StreamOffset::First), Some("app"));
        let d = drain(&o);
        assert_eq!(offsets(&d), [0, 1, 2, 3]);
        ack_all(&d);
        let d = drain(&o);
        assert_eq!(offsets(&d), [4, 5, 6, 7]);
        ack_all(&d[..2]); // 4 and 5; 6 and 7 stay unacked
        c.cancel();
        // same name, no offset: resumes after the last ack
        let (c2, o2) = consume(&v, "s", 2, None, Some("app"));
        assert_eq!(offsets(&drain(&o2)), [6, 7]);
        c2.cancel();
        // an explicit offset wins over the stored one
        let (c3, o3) = consume(&v, "s", 1, Some(StreamOffset::Offset(1)), Some("app"));
        assert_eq!(offsets(&drain(&o3)), [1]);
        c3.cancel();
        b.store().journal().durable_end().wait().unwrap();
        let st = b.store().clone();
        drop(v);
        drop(b);
        drop(st);
    }
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    let q = v.queue("s").unwrap();
    assert!(q.is_stream());
    assert_eq!(q.message_count(), 10, "the stream's contents survive");
    assert_eq!(q.stream().unwrap().stored_offset("app"), Some(6));
    let (c, o) = consume(&v, "s", 100, None, Some("app"));
    assert_eq!(offsets(&drain(&o)), [6, 7, 8, 9]);
    c.cancel();
    // reset by time (management API): to the start
    let (off, done) = q
        .stream()
        .unwrap()
        .reset_offset("app", OffsetReset::Timestamp(0))
        .unwrap();
    done.wait().unwrap();
    assert_eq!(off, 0);
    let (_c, o) = consume(&v, "s", 2, None, Some("app"));
    assert_eq!(offsets(&drain(&o)), [0, 1]);
    // deleting the stream deletes its stored offsets
    v.delete_queue("s", false, false, 1).unwrap();
    declare(&v, "s", stream_args(&[])).unwrap();
    assert_eq!(
        v.queue("s").unwrap().stream().unwrap().stored_offset("app"),
        None
    );
}

#[test]
fn retention_by_bytes_drops_the_oldest_and_frees_segments() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    declare(
        &v,
        "s",
        stream_args(&[("x-max-length-bytes", FieldValue::I64(100_000))]),
    )
    .unwrap();
    let body = "x".repeat(1000);
    for _ in 0..1000 {
        publish(&v, "s", &body);
    }
    let q = v.queue("s").unwrap();
    let (first, next) = q.stream().unwrap().range();
    assert_eq!(next, 1000);
    assert_eq!(first, 900, "100 bodies of 1000 bytes are kept");
    assert_eq!(q.message_count(), 100);
    // a consumer from the start begins at the retention point
    let (_c, o) = consume(&v, "s", 1, Some(StreamOffset::First), None);
    assert_eq!(offsets(&drain(&o)), [900]);
    let (_c, o) = consume(&v, "s", 1, Some(StreamOffset::Offset(3)), None);
    assert_eq!(offsets(&drain(&o)), [900]);
    // the store frees the segments no queue needs: ~1 MB written, 64 KiB segments
    b.store().checkpoint().unwrap();
    b.store().run_retention().unwrap();
    let segs = b.store().segment_paths().len();
    assert!(segs <= 4, "{segs} segments left");
}

#[test]
fn retention_by_age_drops_old_entries_on_the_tick() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Clock::manual();
    let b = open_clocked(dir.path(), clock.clone());
    let v = b.vhost("/").unwrap();
    declare(&v, "s", stream_args(&[("x-max-age", s("1s"))])).unwrap();
    for i in 0..5 {
        publish(&v, "s", &format!("m{i}"));
    }
    let q = v.queue("s").unwrap();
    b.tick();
    assert_eq!(q.message_count(), 5);
    let (_c, o) = consume(&v, "s", 1, None, None);
    // past the 1 s age (with a margin: the store stamps entries by the system clock, a
    // moment after the manual clock was made)
    clock.advance(Duration::from_secs(60));
    b.tick();
    assert_eq!(q.message_count(), 0, "dropped by age");
    assert_eq!(q.stream().unwrap().range(), (5, 5));
    publish(&v, "s", "fresh");
    assert_eq!(offsets(&drain(&o)), [5]);
}

#[test]
fn deleting_a_stream_returns_its_consumers_credit_to_the_channel() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    declare(&v, "s", stream_args(&[])).unwrap();
    for i in 0..5 {
        publish(&v, "s", &format!("m{i}"));
    }
    // a channel-wide prefetch (basic.qos global) of 10
    let gate = triad_core::CreditGate::new(10);
    let o = Outbox::new(1000);
    let mut r = req("c", 3, &o);
    r.gate = Some(gate.clone());
    let _c = v
        .consume_stream(
            "s",
            r,
            StreamConsume {
                offset: Some(StreamOffset::First),
                name: Some("app".into()),
            },
        )
        .unwrap();
    assert_eq!(offsets(&drain(&o)), [0, 1, 2]);
    assert_eq!(gate.used(), 3);
    v.delete_queue("s", false, false, 1).unwrap();
    assert_eq!(
        gate.used(),
        0,
        "the deleted stream's unacked deliveries hold no credit"
    );
}

#[test]
fn a_streams_stats_count_its_deliveries_acks_and_consumers() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    declare(&v, "s", stream_args(&[])).unwrap();
    for i in 0..5 {
        publish(&v, "s", &format!("m{i}"));
    }
    let (_c, o) = consume(&v, "s", 3, Some(StreamOffset::First), None);
    let d = drain(&o);
    ack_all(&d[..2]);
    let q = v.queue("s").unwrap();
    let st = q.stats();
    assert_eq!(st.counts.deliver, 5, "3, then 2 more on the acks' credit");
    assert_eq!(st.counts.ack, 2);
    assert_eq!(st.consumers, 1);
    let cs = q.consumers();
    assert_eq!(cs.len(), 1);
    assert_eq!(&*cs[0].tag, "c");
    assert_eq!(cs[0].prefetch, 3);
    assert_eq!(cs[0].unacked, 3);
}

#[test]
fn age_retention_keeps_the_young_entries_after_old_ones() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Clock::manual();
    let b = open_clocked(dir.path(), clock.clone());
    let v = b.vhost("/").unwrap();
    declare(&v, "s", stream_args(&[("x-max-age", s("1s"))])).unwrap();
    for i in 0..7 {
        publish(&v, "s", &format!("old{i}"));
    }
    // the store stamps entries by the system clock: the young ones go in once it has
    // moved past the old ones' stamp (a millisecond or so), and the manual clock then
    // stands exactly 1 s after the first young stamp, so "old" and "young" are told apart
    // to the millisecond instead of by a sleep
    let old_ts = store_ts(&b, "s", 6);
    testing::eventually_blocking(
        "the system clock to pass the old entries' stamp",
        Duration::from_secs(5),
        || system_ms() > old_ts,
    );
    for i in 0..2 {
        publish(&v, "s", &format!("young{i}"));
    }
    let (young_ts, last_ts) = (store_ts(&b, "s", 7), store_ts(&b, "s", 8));
    assert!(old_ts < young_ts);
    clock.advance(Duration::from_millis(young_ts + 1_000 - clock.now_ms()));
    let q = v.queue("s").unwrap();
    b.tick();
    assert_eq!(q.stream().unwrap().range(), (7, 9));
    b.tick();
    assert_eq!(q.stream().unwrap().range(), (7, 9));
    // and the young ones go once they are older than 1 s too
    clock.advance(Duration::from_millis(last_ts + 1 - young_ts));
    b.tick();
    assert_eq!(q.stream().unwrap().range(), (9, 9));
}

/// The store time of entry `off` of queue `queue` in vhost "/", ms.
fn store_ts(b: &Broker, queue: &str, off: u64) -> u64 {
    let id = b.store().find_queue("/", queue).unwrap();
    b.store()
        .read_queue(id, off)
        .unwrap()
        .unwrap()
        .1
        .store_ts_ms
}

/// The system time, ms since the epoch (what the store stamps entries with).
fn system_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[test]
fn a_start_offset_replaces_the_stored_one_and_forgetting_it_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = open(dir.path());
        let v = b.vhost("/").unwrap();
        declare(&v, "s", stream_args(&[])).unwrap();
        for i in 0..5 {
            publish(&v, "s", &format!("m{i}"));
        }
        let st = v.queue("s").unwrap();
        let st = st.stream().unwrap();
        // next: where a consumer starting now would start, replacing a higher one
        st.reset_offset("keep", OffsetReset::Offset(4)).unwrap();
        assert_eq!(st.start_offset("keep", StreamOffset::Next).unwrap().0, 5);
        assert_eq!(st.start_offset("keep", StreamOffset::First).unwrap().0, 0);
        assert_eq!(st.start_offset("keep", StreamOffset::Last).unwrap().0, 4);
        assert_eq!(
            st.start_offset("gone", StreamOffset::Offset(2)).unwrap().0,
            2
        );
        // a consumer under a started name, without an explicit start, begins there
        let (c, o) = consume(&v, "s", 10, None, Some("gone"));
        assert_eq!(offsets(&drain(&o)), [2, 3, 4]);
        c.cancel();
        assert!(st.forget_offset("gone").unwrap().is_some());
        assert!(st.forget_offset("gone").unwrap().is_none(), "once");
        assert_eq!(st.stored_offset("gone"), None);
        b.store().journal().durable_end().wait().unwrap();
        let store = b.store().clone();
        drop(v);
        drop(b);
        drop(store);
    }
    let b = open(dir.path());
    let q = b.vhost("/").unwrap().queue("s").unwrap();
    let st = q.stream().unwrap();
    assert_eq!(st.stored_offset("keep"), Some(4));
    assert_eq!(
        st.stored_offset("gone"),
        None,
        "the forgetting was journaled"
    );
}

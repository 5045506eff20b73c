#![allow(clippy::unwrap_used)]
//! Delayed delivery over a real store: what a fired message carries, and a transaction
//! whose delayed publish is refused stores none of its messages.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use triad_core::testing;
use triad_core::{
    Broker, Clock, CoreError, Delivery, FieldTable, FieldValue, Properties, Publish, QueueDeclare,
    Vhost,
};
use triad_store::store::StoreConfig;

fn open(dir: &Path) -> Arc<Broker> {
    open_clocked(dir, Clock::system())
}

/// A broker whose expiry decisions read `clock`.
fn open_clocked(dir: &Path, clock: Clock) -> Arc<Broker> {
    let mut c = StoreConfig::new(dir);
    c.segment_size = 1 << 20;
    testing::open_clocked(c, clock)
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

fn msg(key: &str, body: &str, headers: Option<FieldTable>) -> Publish {
    Publish {
        exchange: "".into(),
        routing_key: key.into(),
        properties: Properties {
            delivery_mode: Some(2),
            headers,
            ..Default::default()
        },
        body: Bytes::from(body.to_string()),
        conn: 1,
        ..Default::default()
    }
}

fn delay(v: FieldValue) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert("x-delay", v);
    t
}

fn get_within(v: &Vhost, q: &str, timeout: Duration) -> Option<Delivery> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(d) = v.get(q, true, 1).unwrap() {
            return Some(d);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_fired_message_carries_the_negative_delay_and_republishing_it_does_not_delay_it() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Clock::manual();
    let b = open_clocked(dir.path(), clock.clone());
    let v = b.vhost("/").unwrap();
    declare(&v, "q");
    for (i, x) in [FieldValue::I32(300), FieldValue::from("300")]
        .into_iter()
        .enumerate()
    {
        let string = i == 1;
        v.publish(msg("q", "m", Some(delay(x)))).unwrap();
        assert!(
            v.get("q", true, 1).unwrap().is_none(),
            "not before its delay"
        );
        // the scheduler fires it once the clock reaches its due time, woken by the move
        clock.advance(Duration::from_millis(300));
        let d = get_within(&v, "q", Duration::from_secs(10)).expect("fired");
        let h = d.properties.headers.clone().unwrap();
        assert_eq!(
            h.get_i64("x-delay")
                .or_else(|| h.get_str("x-delay").and_then(|s| s.parse().ok())),
            Some(-300)
        );
        assert_eq!(string, h.get_str("x-delay").is_some(), "{h:?}");
        // republished with the same headers: delivered at once
        v.publish(msg("q", "again", Some(h))).unwrap();
        let d = v.get("q", true, 1).unwrap().expect("not delayed again");
        assert_eq!(d.body.as_ref(), b"again");
    }
}

#[test]
fn a_transaction_with_a_bad_delay_stores_none_of_its_messages() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    declare(&v, "q");
    let r = v.publish_all(vec![
        msg("q", "first", None),
        msg("q", "later", Some(delay(FieldValue::I32(60_000)))),
        msg("q", "bad", Some(delay(FieldValue::from("soon")))),
    ]);
    match r {
        Err(CoreError::PreconditionFailed(m)) => assert!(m.contains("x-delay"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(
        v.get("q", true, 1).unwrap().is_none(),
        "the first was stored"
    );
    assert_eq!(v.delayed_pending(), 0, "the delayed one was stored");
}

#![allow(clippy::unwrap_used)]
//! Policies over a real store: applied to existing and new queues without redeclaring,
//! combined with queue arguments by RabbitMQ's precedence, persisted in the metadata
//! journal, and removed with their vhost.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use serde_json::json;
use triad_core::policy::{Policy, PolicyDoc};
use triad_core::testing;
use triad_core::{Broker, Clock, FieldTable, FieldValue, Properties, Publish, QueueDeclare};
use triad_store::store::StoreConfig;

fn open(dir: &Path) -> Arc<Broker> {
    open_clocked(dir, Clock::system())
}

/// A broker whose expiry decisions read `clock`.
fn open_clocked(dir: &Path, clock: Clock) -> Arc<Broker> {
    let mut c = StoreConfig::new(dir);
    c.segment_size = 1 << 20;
    c.cq_entries_per_file = 1024;
    testing::open_clocked(c, clock)
}

fn declare(b: &Broker, name: &str, args: FieldTable) {
    b.vhost("/")
        .unwrap()
        .declare_queue(QueueDeclare {
            name: name.into(),
            durable: true,
            arguments: args,
            conn: 1,
            ..Default::default()
        })
        .unwrap();
}

fn publish(b: &Broker, key: &str, n: usize) {
    let v = b.vhost("/").unwrap();
    for i in 0..n {
        v.publish(Publish {
            exchange: String::new(),
            routing_key: key.into(),
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
}

fn policy(name: &str, pattern: &str, priority: i64, def: serde_json::Value) -> Policy {
    let doc = PolicyDoc {
        pattern: pattern.into(),
        apply_to: "queues".into(),
        priority,
        definition: def.as_object().cloned().unwrap(),
    };
    Policy::new("/", name, &doc).unwrap()
}

#[test]
fn a_policy_governs_existing_and_new_queues_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = open(dir.path());
        let v = b.vhost("/").unwrap();
        declare(&b, "pol.a", FieldTable::new());
        let mut one = FieldTable::new();
        one.insert("x-max-length", FieldValue::I32(1));
        declare(&b, "pol.short", one);
        declare(&b, "other", FieldTable::new());
        publish(&b, "pol.a", 5);
        publish(&b, "pol.short", 1);
        publish(&b, "other", 5);
        assert_eq!(v.queue("pol.a").unwrap().message_count(), 5);

        // applied to the existing queue without a redeclare: the head is dropped now
        let created = v
            .set_policy(policy("lim", r"^pol\.", 0, json!({"max-length": 2})))
            .unwrap();
        assert!(created);
        let a = v.queue("pol.a").unwrap();
        assert_eq!(a.message_count(), 2);
        assert_eq!(a.args().max_length, Some(2));
        assert_eq!(a.policy().unwrap().name, "lim");
        // the argument's smaller limit wins
        assert_eq!(v.queue("pol.short").unwrap().args().max_length, Some(1));
        // not matched
        let other = v.queue("other").unwrap();
        assert!(other.policy().is_none());
        assert_eq!(other.message_count(), 5);
        // a queue declared afterwards gets it
        declare(&b, "pol.new", FieldTable::new());
        assert_eq!(v.queue("pol.new").unwrap().args().max_length, Some(2));

        // a higher-priority match replaces it; the lower one no longer applies
        assert!(v
            .set_policy(policy(
                "dlx",
                r"^pol\.a$",
                5,
                json!({"dead-letter-exchange": "dlx"})
            ))
            .unwrap());
        let a = v.queue("pol.a").unwrap();
        assert_eq!(a.policy().unwrap().name, "dlx");
        assert_eq!(a.args().dead_letter_exchange.as_deref(), Some("dlx"));
        assert_eq!(a.args().max_length, None);
        // replacing a policy keeps one record
        assert!(!v
            .set_policy(policy("lim", r"^pol\.", 0, json!({"max-length": 3})))
            .unwrap());
        assert_eq!(v.policies().len(), 2);
    }

    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    assert_eq!(
        v.policies()
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>(),
        ["dlx", "lim"]
    );
    assert_eq!(v.queue("pol.new").unwrap().args().max_length, Some(3));
    assert_eq!(
        v.queue("pol.a")
            .unwrap()
            .args()
            .dead_letter_exchange
            .as_deref(),
        Some("dlx")
    );
    assert_eq!(v.queue("pol.a").unwrap().message_count(), 2);
    // deleting reverts the queues to their arguments
    assert!(v.delete_policy("lim").unwrap());
    assert!(!v.delete_policy("lim").unwrap());
    assert!(v.queue("pol.new").unwrap().policy().is_none());
    assert_eq!(v.queue("pol.new").unwrap().args().max_length, None);
    assert_eq!(v.queue("pol.short").unwrap().args().max_length, Some(1));
}

#[test]
fn a_deleted_vhost_takes_its_policies_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.add_vhost("tmp").unwrap();
    let doc = PolicyDoc {
        pattern: ".*".into(),
        apply_to: "all".into(),
        priority: 0,
        definition: json!({"message-ttl": 10}).as_object().cloned().unwrap(),
    };
    v.set_policy(Policy::new("tmp", "p", &doc).unwrap())
        .unwrap();
    drop(v);
    assert!(b.delete_vhost("tmp").unwrap());
    let v = b.add_vhost("tmp").unwrap();
    assert!(v.policies().is_empty());
}

#[test]
fn a_policy_ttl_and_expiry_are_enforced_by_the_tick() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Clock::manual();
    let b = open_clocked(dir.path(), clock.clone());
    let v = b.vhost("/").unwrap();
    declare(&b, "ttl.q", FieldTable::new());
    declare(&b, "gone.q", FieldTable::new());
    publish(&b, "ttl.q", 3);
    v.set_policy(policy("ttl", r"^ttl\.", 0, json!({"message-ttl": 1})))
        .unwrap();
    v.set_policy(policy("gone", r"^gone\.", 0, json!({"expires": 1})))
        .unwrap();
    // past the 1 ms TTL and expiry (with a margin: the store stamps messages by the
    // system clock, a moment after the manual clock was made)
    clock.advance(std::time::Duration::from_secs(60));
    triad_core::testing::eventually_blocking(
        "messages expired and the unused queue deleted",
        std::time::Duration::from_secs(10),
        || {
            b.tick();
            v.queue("ttl.q").unwrap().message_count() == 0 && v.queue("gone.q").is_none()
        },
    );
}

#[test]
fn a_queues_policy_does_not_attach_to_a_stream() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let v = b.vhost("/").unwrap();
    let mut st = FieldTable::new();
    st.insert(
        "x-queue-type",
        FieldValue::LongString(Bytes::from_static(b"stream")),
    );
    declare(&b, "pol.stream", st);
    v.set_policy(policy("lim", r"^pol\.", 0, json!({"max-length": 1})))
        .unwrap();
    declare(&b, "pol.classic", FieldTable::new());
    assert!(v.queue("pol.classic").unwrap().policy().is_some());
    let q = v.queue("pol.stream").unwrap();
    assert!(q.policy().is_none(), "no effective policy on a stream");
    publish(&b, "pol.stream", 3);
    assert_eq!(q.message_count(), 3);
}

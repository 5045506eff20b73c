#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
//! Data dirs of versions before issue 14 kept retained messages and persistent sessions
//! in the ordinary queues `mqtt-retained` and `mqtt-sessions`, which clients could write
//! to. They are taken over into the broker's reserved queues at start, once.

use std::path::Path;
use std::sync::{Arc, Weak};

use bytes::Bytes;
use triad_core::{
    Broker, CoreConfig, FieldTable, FieldValue, Properties, Publish, QueueDeclare, Vhost,
};
use triad_mqtt::MqttState;
use triad_store::store::{Store, StoreConfig};

fn open_broker(dir: &Path) -> Arc<Broker> {
    let mut c = StoreConfig::new(dir);
    c.segment_size = 1 << 20;
    c.cq_entries_per_file = 1024;
    let store = Arc::new(Store::open(c).unwrap());
    Broker::open(store, CoreConfig::default()).unwrap()
}

/// Drops the broker and waits until nothing holds its store (so it can be reopened).
fn close(broker: Arc<Broker>) {
    let store: Weak<Store> = Arc::downgrade(broker.store());
    drop(broker);
    assert_eq!(store.strong_count(), 0, "store still referenced");
}

/// What a version before issue 14 wrote for one `put`: a persistent message through
/// the default exchange, the key and a small integer in headers.
fn legacy_put(vhost: &Vhost, queue: &str, key: &str, value: &str, meta: i64) {
    vhost
        .declare_queue(QueueDeclare {
            name: queue.into(),
            durable: true,
            ..Default::default()
        })
        .unwrap();
    let mut headers = FieldTable::default();
    headers.insert(
        "x-triad-key",
        FieldValue::LongString(Bytes::from(key.to_string())),
    );
    headers.insert("x-triad-meta", FieldValue::I64(meta));
    let p = vhost
        .publish(Publish {
            exchange: String::new(),
            routing_key: queue.into(),
            mandatory: false,
            properties: Properties {
                delivery_mode: Some(2),
                headers: Some(headers),
                ..Default::default()
            },
            body: Bytes::from(value.to_string()),
            conn: 0,
        })
        .unwrap();
    assert!(p.routed);
    if let Some(d) = p.durable {
        d.wait().unwrap();
    }
}

fn retained(state: &MqttState, filter: &str) -> Vec<(String, String, u8)> {
    let vs = state.vhost_state("/").unwrap();
    let mut v: Vec<_> = vs
        .retained
        .matching(filter)
        .into_iter()
        .map(|r| {
            (
                r.topic.to_string(),
                String::from_utf8(r.payload.to_vec()).unwrap(),
                r.qos,
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn state_of_an_older_version_is_taken_over_once() {
    let dir = tempfile::tempdir().unwrap();
    // an older version's data dir
    {
        let broker = open_broker(dir.path());
        let vh = broker.vhost("/").unwrap();
        legacy_put(&vh, "mqtt-retained", "a/b", "old", 1);
        legacy_put(&vh, "mqtt-retained", "a/c", "first", 0);
        legacy_put(&vh, "mqtt-retained", "a/c", "second", 2);
        legacy_put(&vh, "mqtt-sessions", "dev1", r#"{"x/#":1}"#, 0);
        drop(vh);
        close(broker);
    }
    // this version: taken over, the old queues gone
    {
        let broker = open_broker(dir.path());
        let state = MqttState::new(broker.clone()).unwrap();
        assert_eq!(
            retained(&state, "a/#"),
            [
                ("a/b".into(), "old".into(), 1),
                ("a/c".into(), "second".into(), 2)
            ]
        );
        let vs = state.vhost_state("/").unwrap();
        let subs = vs.sessions.get("dev1").expect("session taken over");
        assert_eq!(subs.get("x/#"), Some(&1));
        let vh = broker.vhost("/").unwrap();
        assert!(vh.queue("mqtt-retained").is_none());
        assert!(vh.queue("mqtt-sessions").is_none());
        // a queue made later under the old name (by a client) is just a queue
        legacy_put(&vh, "mqtt-retained", "a/forged", "forged", 1);
        drop((vs, vh, state));
        close(broker);
    }
    // and is never read as state
    {
        let broker = open_broker(dir.path());
        let state = MqttState::new(broker.clone()).unwrap();
        assert_eq!(
            retained(&state, "a/#"),
            [
                ("a/b".into(), "old".into(), 1),
                ("a/c".into(), "second".into(), 2)
            ]
        );
        assert!(broker.vhost("/").unwrap().queue("mqtt-retained").is_some());
        drop(state);
        close(broker);
    }
}

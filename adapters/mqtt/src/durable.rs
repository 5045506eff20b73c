//! A small durable key → value map kept in a core queue, for the MQTT state the core has
//! no home for: retained messages and persistent-session subscriptions.
//!
//! Each `put` publishes one persistent message (key and a small integer in headers,
//! value as body) to a durable queue of the vhost through the default exchange; the map
//! holds that queue's only consumer (exclusive, unlimited prefetch) and never acks the
//! live value of a key, so the store keeps it. Replacing or deleting a key acks the old
//! message. At start every unacked message comes back (redelivered) in queue order;
//! the last one per key wins and older ones are acked. So the state is as durable as
//! any persistent message (fsync'd under `flush = "sync"`, with the [`Durable`] to wait
//! for), survives `kill -9`, and needs no new storage code.
//!
//! The queue is visible to AMQP and STOMP clients like any other (its name starts with
//! `mqtt-`); its exclusive consumer keeps others from consuming from it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use triad_core::queue::Queue;
use triad_core::{
    ConnectionId, ConsumeRequest, ConsumerHandle, CoreError, FieldTable, FieldValue, OutEvent,
    Outbox, Properties, Publish, QueueDeclare, Vhost,
};
use triad_store::flush::Durable;

const KEY: &str = "x-triad-key";
const META: &str = "x-triad-meta";

/// One recovered entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its key.
    pub key: String,
    /// Its value.
    pub value: Bytes,
    /// The small integer stored with it.
    pub meta: i64,
}

struct Inner {
    outbox: Arc<Outbox>,
    queue: Option<Arc<Queue>>,
    offsets: HashMap<String, u64>,
}

/// A durable map over one core queue.
pub struct DurableLog {
    vhost: Arc<Vhost>,
    queue: String,
    conn: ConnectionId,
    inner: Mutex<Inner>,
    _consumer: ConsumerHandle,
}

impl std::fmt::Debug for DurableLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableLog")
            .field("queue", &self.queue)
            .finish()
    }
}

impl Drop for DurableLog {
    fn drop(&mut self) {
        self._consumer.cancel();
    }
}

impl DurableLog {
    /// Opens (declaring) queue `name` in `vhost` and returns the live entries.
    pub fn open(
        vhost: Arc<Vhost>,
        name: &str,
        conn: ConnectionId,
    ) -> Result<(DurableLog, Vec<Entry>), CoreError> {
        vhost.declare_queue(QueueDeclare {
            name: name.to_string(),
            durable: true,
            conn,
            ..Default::default()
        })?;
        let outbox = Outbox::new(4096);
        let consumer = vhost.consume(
            name,
            ConsumeRequest {
                tag: "triad-mqtt-state".into(),
                no_ack: false,
                exclusive: true,
                prefetch: 0,
                priority: 0,
                conn,
                outbox: outbox.clone(),
                gate: None,
            },
        )?;
        let log = DurableLog {
            vhost,
            queue: name.to_string(),
            conn,
            inner: Mutex::new(Inner {
                outbox,
                queue: None,
                offsets: HashMap::new(),
            }),
            _consumer: consumer,
        };
        let mut live: HashMap<String, Entry> = HashMap::new();
        {
            let mut g = log.lock();
            loop {
                let got = Self::absorb(&mut g);
                if got.is_empty() {
                    break;
                }
                for e in got {
                    live.insert(e.key.clone(), e);
                }
            }
        }
        Ok((log, live.into_values().collect()))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the deliveries waiting in the outbox into the index; returns them.
    fn absorb(g: &mut Inner) -> Vec<Entry> {
        let mut evs = Vec::new();
        g.outbox.drain(&mut evs, usize::MAX);
        let mut out = Vec::new();
        for ev in evs {
            let OutEvent::Deliver(d) = ev else { continue };
            g.queue.get_or_insert_with(|| d.queue.clone());
            let headers = d.properties.headers.as_ref();
            let Some(key) = headers.and_then(|h| h.get_str(KEY)).map(str::to_string) else {
                // not ours: drop it
                d.queue.ack(&[d.offset]);
                continue;
            };
            let meta = headers.and_then(|h| h.get_i64(META)).unwrap_or(0);
            if let Some(old) = g.offsets.insert(key.clone(), d.offset) {
                d.queue.ack(&[old]);
            }
            out.push(Entry {
                key,
                value: d.body.clone(),
                meta,
            });
        }
        out
    }

    /// Sets `key`; the result completes when it is on disk.
    pub fn put(&self, key: &str, value: Bytes, meta: i64) -> Result<Option<Durable>, CoreError> {
        let mut headers = FieldTable::default();
        headers.insert(KEY, FieldValue::LongString(Bytes::from(key.to_string())));
        headers.insert(META, FieldValue::I64(meta));
        let mut g = self.lock();
        let published = self.vhost.publish(Publish {
            exchange: String::new(),
            routing_key: self.queue.clone(),
            mandatory: false,
            properties: Properties {
                delivery_mode: Some(2),
                headers: Some(headers),
                ..Default::default()
            },
            body: value,
            conn: self.conn,
        })?;
        Self::absorb(&mut g);
        Ok(published.durable)
    }

    /// Removes `key`.
    pub fn delete(&self, key: &str) {
        let mut g = self.lock();
        Self::absorb(&mut g);
        if let Some(off) = g.offsets.remove(key) {
            if let Some(q) = &g.queue {
                q.ack(&[off]);
            }
        }
    }

    /// Live keys.
    pub fn len(&self) -> usize {
        self.lock().offsets.len()
    }

    /// Whether no key is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

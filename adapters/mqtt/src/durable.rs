//! A small durable key → value map kept in a core queue, for the MQTT state the core has
//! no home for: retained messages and persistent-session subscriptions.
//!
//! Each `put` publishes one persistent message (key and a small integer in headers,
//! value as body) to a durable queue of the vhost that only the broker can address (a
//! reserved name, see `triad_core::reserved`: no client can declare, publish to, bind,
//! read, purge or delete it, and no exchange routes to it); the map
//! holds that queue's only consumer (exclusive, unlimited prefetch) and never acks the
//! live value of a key, so the store keeps it. Replacing or deleting a key acks the old
//! message. At start every unacked message comes back (redelivered) in queue order;
//! the last one per key wins and older ones are acked. So the state is as durable as
//! any persistent message (fsync'd under `flush = "sync"`, with the [`Durability`] to wait
//! for), survives `kill -9`, and needs no new storage code.
//!
//! Migration: versions before issue 14 kept the map in an ordinary queue (`mqtt-retained`,
//! `mqtt-sessions`) that clients could write to. On the first start with a map that has
//! no migration record, the entries of that older queue (if there is one) are copied
//! in, the record is written, and the older queue is deleted. The record makes this
//! happen once: a queue a client creates under the old name later is never read.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use triad_core::queue::Queue;
use triad_core::Durability;
use triad_core::{
    ConnectionId, ConsumeRequest, ConsumerHandle, CoreError, FieldTable, FieldValue, OutEvent,
    Outbox, Properties, Publish, QueueDeclare, Vhost,
};

const KEY: &str = "x-triad-key";
const META: &str = "x-triad-meta";
/// The key of the migration record. U+0000 is in no MQTT topic or client id
/// [MQTT-1.5.3-2], so no entry of a map can have it.
const MIGRATED: &str = "\u{0}migrated";

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
    /// Opens (declaring) the reserved queue `name` in `vhost` and returns the live
    /// entries, first taking over those of `legacy`, the older version's queue, once
    /// (see the module's doc).
    pub fn open(
        vhost: Arc<Vhost>,
        name: &str,
        legacy: &str,
        conn: ConnectionId,
    ) -> Result<(DurableLog, Vec<Entry>), CoreError> {
        // the broker's own declare: no `access`, a reserved name
        vhost.declare_queue(QueueDeclare {
            name: name.to_string(),
            durable: true,
            conn,
            ..Default::default()
        })?;
        let outbox = Outbox::new(4096);
        let consumer = vhost.consume(name, Self::consume_request(conn, outbox.clone()))?;
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
        if live.remove(MIGRATED).is_none() {
            log.migrate(legacy, &mut live)?;
        }
        Ok((log, live.into_values().collect()))
    }

    fn consume_request(conn: ConnectionId, outbox: Arc<Outbox>) -> ConsumeRequest {
        ConsumeRequest {
            tag: "triad-mqtt-state".into(),
            no_ack: false,
            exclusive: true,
            prefetch: 0,
            priority: 0,
            conn,
            outbox,
            gate: None,
            filter: None,
        }
    }

    /// Copies the entries of the older version's queue `legacy` that `live` lacks (all
    /// of them, unless an earlier start was cut short), waits until they are on disk,
    /// writes the migration record and deletes `legacy`.
    fn migrate(&self, legacy: &str, live: &mut HashMap<String, Entry>) -> Result<(), CoreError> {
        let had_legacy = self.vhost.queue(legacy).is_some();
        let mut durables = Vec::new();
        if had_legacy {
            let old = Self::read_legacy(&self.vhost, legacy, self.conn)?;
            let found = old.len();
            let mut copied = 0usize;
            for e in old {
                if live.contains_key(&e.key) {
                    continue;
                }
                durables.extend(self.put(&e.key, e.value.clone(), e.meta)?);
                live.insert(e.key.clone(), e);
                copied += 1;
            }
            tracing::info!(
                from = legacy,
                to = %self.queue,
                found,
                copied,
                "MQTT state moved out of a client-addressable queue"
            );
        }
        for d in durables {
            d.wait().map_err(|e| CoreError::Internal(e.to_string()))?;
        }
        if let Some(d) = self.put(MIGRATED, Bytes::new(), 0)? {
            d.wait().map_err(|e| CoreError::Internal(e.to_string()))?;
        }
        if had_legacy {
            self.vhost.delete_queue(legacy, false, false, self.conn)?;
        }
        Ok(())
    }

    /// The live entries of an older version's map (the last per key), read without
    /// acking anything: the queue is deleted afterwards.
    fn read_legacy(
        vhost: &Vhost,
        legacy: &str,
        conn: ConnectionId,
    ) -> Result<Vec<Entry>, CoreError> {
        let outbox = Outbox::new(4096);
        let consumer = vhost.consume(legacy, Self::consume_request(conn, outbox.clone()))?;
        let mut live: HashMap<String, Entry> = HashMap::new();
        let mut evs = Vec::new();
        loop {
            outbox.drain(&mut evs, usize::MAX);
            if evs.is_empty() {
                break;
            }
            for ev in evs.drain(..) {
                let OutEvent::Deliver(d) = ev else { continue };
                let headers = d.properties.headers.as_ref();
                let Some(key) = headers.and_then(|h| h.get_str(KEY)) else {
                    continue;
                };
                let meta = headers.and_then(|h| h.get_i64(META)).unwrap_or(0);
                live.insert(
                    key.to_string(),
                    Entry {
                        key: key.to_string(),
                        value: d.body.clone(),
                        meta,
                    },
                );
            }
        }
        consumer.cancel();
        outbox.close();
        Ok(live.into_values().collect())
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
    pub fn put(&self, key: &str, value: Bytes, meta: i64) -> Result<Option<Durability>, CoreError> {
        let mut headers = FieldTable::default();
        headers.insert(KEY, FieldValue::LongString(Bytes::from(key.to_string())));
        headers.insert(META, FieldValue::I64(meta));
        let mut g = self.lock();
        let published = self.vhost.publish_reserved(Publish {
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
        let g = self.lock();
        g.offsets.len() - usize::from(g.offsets.contains_key(MIGRATED))
    }

    /// Whether no key is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

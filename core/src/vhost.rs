//! A virtual host: its topology (exchanges and bindings), its queues, and the publish,
//! consume and get operations. Durable topology is saved as one metadata document per
//! vhost, rewritten atomically on every durable change.
//!
//! Lock order: `topology` before `queues`; a queue's own lock is never held while either
//! is taken.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use triad_store::commitlog::StoredRecord;
use triad_store::flush::Durable;
use triad_store::record::{NewMessage, FLAG_PERSISTENT};
use triad_store::store::Store;

use crate::access::VhostAccess;
use crate::encoding::{put_table, Reader};
use crate::error::CoreError;
use crate::message::Properties;
use crate::outbox::{Backpressure, Delivery};
use crate::queue::{
    make_tag, now_ms, ConsumeRequest, ConsumerHandle, Hot, Queue, QueueArgs, QueueSpec,
};
use crate::routing::{Destination, ExchangeDef, ExchangeKind, Topology};
use crate::value::FieldTable;
use crate::{envelope, ConnectionId};

/// `queue.declare`.
#[derive(Debug, Clone, Default)]
pub struct QueueDeclare {
    /// Empty: the server picks an `amq.gen-...` name.
    pub name: String,
    /// Only check that it exists.
    pub passive: bool,
    /// Survives a restart.
    pub durable: bool,
    /// Owned by the declaring connection, deleted with it.
    pub exclusive: bool,
    /// Deleted when its last consumer goes.
    pub auto_delete: bool,
    /// `x-` arguments.
    pub arguments: FieldTable,
    /// The declaring connection.
    pub conn: ConnectionId,
    /// The declaring user's rights, checked once the name is known (a server-named
    /// queue's generated one included); `None` = the broker's own declare.
    pub access: Option<Arc<VhostAccess>>,
}

/// `queue.declare-ok`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueDeclareOk {
    /// The queue's name (the generated one for server-named queues).
    pub name: String,
    /// Ready messages.
    pub message_count: u32,
    /// Active consumers.
    pub consumer_count: u32,
}

/// A message to publish.
#[derive(Debug, Clone, Default)]
pub struct Publish {
    /// Target exchange ("" = the default exchange).
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Report when it routes nowhere.
    pub mandatory: bool,
    /// Properties.
    pub properties: Properties,
    /// Body.
    pub body: Bytes,
    /// The publishing connection.
    pub conn: ConnectionId,
}

/// What a publish did.
#[derive(Debug)]
pub struct Published {
    /// It reached at least one queue (false + mandatory: return it to the publisher).
    pub routed: bool,
    /// A queue refused it (`x-overflow` reject-publish): nack it under confirms.
    pub rejected: bool,
    /// `Some`: confirm once this completes (persistent message in a durable queue);
    /// `None`: confirm at once.
    pub durable: Option<Durable>,
    /// `Some`: a queue it went to is throttled (its consumers fall behind); hold the
    /// publisher (delay its ack or stop reading from it) until this clears.
    pub backpressure: Option<Backpressure>,
}

#[derive(Serialize, Deserialize, Default)]
struct VhostDoc {
    exchanges: Vec<ExchangeDoc>,
    queues: Vec<QueueDoc>,
    bindings: Vec<BindingDoc>,
}

#[derive(Serialize, Deserialize)]
struct ExchangeDoc {
    name: String,
    kind: String,
    auto_delete: bool,
    internal: bool,
    arguments: String,
}

#[derive(Serialize, Deserialize)]
struct QueueDoc {
    name: String,
    auto_delete: bool,
    arguments: String,
}

#[derive(Serialize, Deserialize)]
struct BindingDoc {
    source: String,
    destination: String,
    to_exchange: bool,
    key: String,
    arguments: String,
}

fn table_to_hex(t: &FieldTable) -> String {
    let mut b = Vec::new();
    if put_table(&mut b, t, 0).is_err() {
        return String::new();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn table_from_hex(s: &str) -> Result<FieldTable, CoreError> {
    if s.is_empty() {
        return Ok(FieldTable::default());
    }
    let bytes: Option<Vec<u8>> = (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect();
    let bytes = bytes.ok_or(CoreError::InvalidEncoding("bad hex in a stored table"))?;
    Reader::new(&bytes).table(0)
}

/// The metadata document name of a vhost.
pub(crate) fn doc_name(vhost: &str) -> String {
    let hex: String = vhost.bytes().map(|b| format!("{b:02x}")).collect();
    format!("vhost-{hex}")
}

/// Queues by name, looked up on every publish: seeded foldhash rather than SipHash.
type QueueMap = HashMap<String, Arc<Queue>, foldhash::fast::RandomState>;

/// A virtual host.
pub struct Vhost {
    name: String,
    store: Arc<Store>,
    topology: RwLock<Topology>,
    queues: RwLock<QueueMap>,
    window: usize,
    max_message_size: usize,
    /// `max_queues_per_vhost`; 0 = unlimited.
    max_queues: usize,
    me: Weak<Vhost>,
    persist: Mutex<()>,
}

impl std::fmt::Debug for Vhost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vhost").field("name", &self.name).finish()
    }
}

fn random_suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut out = String::new();
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    for _ in 0..2 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        h.write_u64(now_ms());
        let mut v = h.finish();
        for _ in 0..11 {
            out.push(ALPHABET.get((v % 64) as usize).copied().unwrap_or(b'A') as char);
            v /= 64;
        }
    }
    out
}

impl Vhost {
    pub(crate) fn open(
        name: &str,
        store: Arc<Store>,
        window: usize,
        max_message_size: usize,
        max_queues: usize,
    ) -> Result<Arc<Vhost>, CoreError> {
        let doc: VhostDoc = store.meta().get(&doc_name(name))?.unwrap_or_default();
        let vh = Arc::new_cyclic(|me| Vhost {
            name: name.to_string(),
            store: store.clone(),
            topology: RwLock::new(Topology::new()),
            queues: RwLock::new(QueueMap::default()),
            window,
            max_message_size,
            max_queues,
            me: me.clone(),
            persist: Mutex::new(()),
        });
        {
            let mut topo = vh.topology_mut();
            for x in &doc.exchanges {
                let mut def = ExchangeDef::new(x.name.clone(), x.kind.parse::<ExchangeKind>()?);
                def.durable = true;
                def.auto_delete = x.auto_delete;
                def.internal = x.internal;
                def.arguments = table_from_hex(&x.arguments)?;
                topo.declare_exchange(def)?;
            }
        }
        let mut wanted = std::collections::HashSet::new();
        for q in &doc.queues {
            let arguments = table_from_hex(&q.arguments)?;
            let args = QueueArgs::parse(&arguments)?;
            let id = store.create_queue(name, &q.name, true)?;
            wanted.insert(id);
            let queue = Queue::new(
                QueueSpec {
                    name: q.name.clone(),
                    vhost_name: name.to_string(),
                    id,
                    durable: true,
                    exclusive_owner: None,
                    auto_delete: q.auto_delete,
                    arguments,
                    args,
                    window,
                },
                store.clone(),
                Arc::downgrade(&vh),
            )?;
            vh.queues_mut().insert(q.name.clone(), queue);
        }
        // store queues of this vhost that the topology does not know: a crash between
        // creating one and saving the document
        for info in store.queues() {
            if info.vhost == name && !wanted.contains(&info.id) {
                store.delete_queue(info.id)?;
            }
        }
        {
            let queues = vh.queues_read();
            let lookup = |n: &str| queues.contains_key(n);
            let mut topo = vh.topology_mut();
            for b in &doc.bindings {
                let dest = if b.to_exchange {
                    Destination::exchange(b.destination.clone())
                } else {
                    Destination::queue(b.destination.clone())
                };
                if let Err(e) = topo.bind(
                    &b.source,
                    dest,
                    &b.key,
                    table_from_hex(&b.arguments)?,
                    &lookup,
                ) {
                    tracing::warn!(vhost = name, error = %e, "dropping a stored binding");
                }
            }
        }
        Ok(vh)
    }

    /// The vhost's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn topology_read(&self) -> RwLockReadGuard<'_, Topology> {
        self.topology.read().unwrap_or_else(|e| e.into_inner())
    }
    fn topology_mut(&self) -> RwLockWriteGuard<'_, Topology> {
        self.topology.write().unwrap_or_else(|e| e.into_inner())
    }
    fn queues_read(&self) -> RwLockReadGuard<'_, QueueMap> {
        self.queues.read().unwrap_or_else(|e| e.into_inner())
    }
    fn queues_mut(&self) -> RwLockWriteGuard<'_, QueueMap> {
        self.queues.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Saves the durable topology (exchanges, queues, bindings between durable ends).
    fn save(&self) -> Result<(), CoreError> {
        let _g = self.persist.lock().unwrap_or_else(|e| e.into_inner());
        let doc = {
            let topo = self.topology_read();
            let queues = self.queues_read();
            let durable_queue = |n: &str| queues.get(n).is_some_and(|q| q.durable());
            let durable_exchange = |n: &str| topo.exchange(n).is_some_and(|x| x.durable);
            VhostDoc {
                exchanges: topo
                    .exchanges()
                    .filter(|x| x.durable && !x.name.is_empty() && !x.name.starts_with("amq."))
                    .map(|x| ExchangeDoc {
                        name: x.name.clone(),
                        kind: x.kind.as_str().to_string(),
                        auto_delete: x.auto_delete,
                        internal: x.internal,
                        arguments: table_to_hex(&x.arguments),
                    })
                    .collect(),
                queues: queues
                    .values()
                    .filter(|q| q.durable())
                    .map(|q| QueueDoc {
                        name: q.name().to_string(),
                        auto_delete: q.auto_delete(),
                        arguments: table_to_hex(q.arguments()),
                    })
                    .collect(),
                bindings: topo
                    .bindings()
                    .into_iter()
                    .filter(|b| durable_exchange(&b.source))
                    .filter(|b| match &b.destination {
                        Destination::Queue(q) => durable_queue(q),
                        Destination::Exchange(x) => durable_exchange(x),
                    })
                    .map(|b| {
                        let (destination, to_exchange) = match b.destination {
                            Destination::Queue(q) => (q, false),
                            Destination::Exchange(x) => (x, true),
                        };
                        BindingDoc {
                            source: b.source,
                            destination,
                            to_exchange,
                            key: b.routing_key,
                            arguments: table_to_hex(&b.arguments),
                        }
                    })
                    .collect(),
            }
        };
        self.store.meta().put(&doc_name(&self.name), &doc)?;
        Ok(())
    }

    /// `exchange.declare`.
    pub fn declare_exchange(&self, def: ExchangeDef, passive: bool) -> Result<(), CoreError> {
        if passive {
            self.topology_read().check_exchange(&def.name)?;
            return Ok(());
        }
        let durable = def.durable;
        let created = {
            let mut topo = self.topology_mut();
            topo.declare_exchange(def)?
        };
        if durable && created == crate::routing::Declared::Created {
            self.save()?;
        }
        Ok(())
    }

    /// `exchange.delete`; deleting a missing exchange succeeds, as in RabbitMQ.
    pub fn delete_exchange(&self, name: &str, if_unused: bool) -> Result<(), CoreError> {
        let res = self.topology_mut().delete_exchange(name, if_unused);
        match res {
            Ok(_) => self.save(),
            Err(CoreError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// `exchange.bind`: route from `source` to the `destination` exchange.
    pub fn bind_exchange(
        &self,
        destination: &str,
        source: &str,
        key: &str,
        args: &FieldTable,
    ) -> Result<(), CoreError> {
        let new = {
            let mut topo = self.topology_mut();
            let queues = self.queues_read();
            let lookup = |n: &str| queues.contains_key(n);
            topo.bind(
                source,
                Destination::exchange(destination),
                key,
                args.clone(),
                &lookup,
            )?
        };
        if new {
            self.save()?;
        }
        Ok(())
    }

    /// `exchange.unbind`.
    pub fn unbind_exchange(
        &self,
        destination: &str,
        source: &str,
        key: &str,
        args: &FieldTable,
    ) -> Result<(), CoreError> {
        let (removed, _) = {
            let mut topo = self.topology_mut();
            let queues = self.queues_read();
            let lookup = |n: &str| queues.contains_key(n);
            topo.unbind(
                source,
                &Destination::exchange(destination),
                key,
                args,
                &lookup,
            )?
        };
        if removed {
            self.save()?;
        }
        Ok(())
    }

    fn queue_for(&self, name: &str, conn: ConnectionId) -> Result<Arc<Queue>, CoreError> {
        let q = self
            .queues_read()
            .get(name)
            .cloned()
            .ok_or_else(|| CoreError::queue_not_found(name))?;
        self.check_exclusive(&q, conn)?;
        Ok(q)
    }

    fn check_exclusive(&self, q: &Queue, conn: ConnectionId) -> Result<(), CoreError> {
        match q.exclusive_owner() {
            Some(owner) if owner != conn => Err(CoreError::ResourceLocked(format!(
                "cannot obtain exclusive access to locked queue '{}' in vhost '{}'. It could be \
                 originally declared on another connection or the exclusive property value does \
                 not match that of the original declaration.",
                q.name(),
                self.name
            ))),
            _ => Ok(()),
        }
    }

    /// A queue by name.
    pub fn queue(&self, name: &str) -> Option<Arc<Queue>> {
        self.queues_read().get(name).cloned()
    }

    /// Names of all queues.
    pub fn queue_names(&self) -> Vec<String> {
        self.queues_read().keys().cloned().collect()
    }

    /// `queue.declare`.
    pub fn declare_queue(&self, d: QueueDeclare) -> Result<QueueDeclareOk, CoreError> {
        if d.passive {
            let name = d.name;
            let q = self.queue_for(&name, d.conn)?;
            q.touch();
            return Ok(QueueDeclareOk {
                name,
                message_count: q.message_count(),
                consumer_count: q.consumer_count(),
            });
        }
        let name = if d.name.is_empty() {
            format!("amq.gen-{}", random_suffix())
        } else {
            if d.name.starts_with("amq.") {
                return Err(CoreError::AccessRefused(format!(
                    "queue name '{}' contains reserved prefix 'amq.*'",
                    d.name
                )));
            }
            d.name.clone()
        };
        if name.len() > 255 {
            return Err(CoreError::PreconditionFailed(
                "queue name longer than 255 bytes".into(),
            ));
        }
        if let Some(access) = &d.access {
            access.queue_declare(&name, &d.arguments)?;
        }
        if let Some(q) = self.queue(&name) {
            self.check_exclusive(&q, d.conn)?;
            self.check_equivalent(&q, &d)?;
            q.touch();
            return Ok(QueueDeclareOk {
                name,
                message_count: q.message_count(),
                consumer_count: q.consumer_count(),
            });
        }
        // RabbitMQ accepts a dead-letter exchange that does not exist (yet)
        let args = QueueArgs::parse(&d.arguments)?;
        // exclusive queues never outlive their connection, so they are never durable
        let durable = d.durable && !d.exclusive;
        let created = {
            let mut queues = self.queues_mut();
            if let Some(q) = queues.get(&name) {
                // lost a race with another declare
                let q = q.clone();
                drop(queues);
                self.check_exclusive(&q, d.conn)?;
                return Ok(QueueDeclareOk {
                    name,
                    message_count: q.message_count(),
                    consumer_count: q.consumer_count(),
                });
            }
            if self.max_queues > 0 && queues.len() >= self.max_queues {
                tracing::info!(vhost = %self.name, queue = %name, max = self.max_queues, "queue limit reached");
                return Err(CoreError::PreconditionFailed(format!(
                    "cannot declare queue '{name}': queue limit in vhost '{}' ({}) is reached",
                    self.name, self.max_queues
                )));
            }
            let id = self.store.create_queue(&self.name, &name, durable)?;
            let q = Queue::new(
                QueueSpec {
                    name: name.clone(),
                    vhost_name: self.name.clone(),
                    id,
                    durable,
                    exclusive_owner: d.exclusive.then_some(d.conn),
                    auto_delete: d.auto_delete,
                    arguments: d.arguments.clone(),
                    args,
                    window: self.window,
                },
                self.store.clone(),
                self.me.clone(),
            )?;
            queues.insert(name.clone(), q);
            true
        };
        if created && durable {
            self.save()?;
        }
        Ok(QueueDeclareOk {
            name,
            message_count: 0,
            consumer_count: 0,
        })
    }

    fn check_equivalent(&self, q: &Queue, d: &QueueDeclare) -> Result<(), CoreError> {
        let inequivalent = |what: &str, got: String, have: String| {
            Err(CoreError::PreconditionFailed(format!(
                "inequivalent arg '{what}' for queue '{}' in vhost '{}': received '{got}' but current is '{have}'",
                q.name(),
                self.name
            )))
        };
        let durable = d.durable && !d.exclusive;
        if q.durable() != durable {
            return inequivalent("durable", durable.to_string(), q.durable().to_string());
        }
        if q.exclusive_owner().is_some() != d.exclusive {
            return inequivalent(
                "exclusive",
                d.exclusive.to_string(),
                q.exclusive_owner().is_some().to_string(),
            );
        }
        if q.auto_delete() != d.auto_delete {
            return inequivalent(
                "auto_delete",
                d.auto_delete.to_string(),
                q.auto_delete().to_string(),
            );
        }
        for key in [
            "x-message-ttl",
            "x-expires",
            "x-max-length",
            "x-max-length-bytes",
            "x-overflow",
            "x-dead-letter-exchange",
            "x-dead-letter-routing-key",
            "x-max-priority",
            "x-queue-type",
        ] {
            let (a, b) = (d.arguments.get(key), q.arguments().get(key));
            let same = match (a, b) {
                (None, None) => true,
                (Some(a), Some(b)) => a.loosely_equals(b),
                // RabbitMQ: an omitted x-queue-type matches classic
                (None, Some(_)) | (Some(_), None) => key == "x-queue-type",
            };
            if !same {
                return inequivalent(
                    key,
                    a.map(|v| format!("{v:?}")).unwrap_or_else(|| "none".into()),
                    b.map(|v| format!("{v:?}")).unwrap_or_else(|| "none".into()),
                );
            }
        }
        Ok(())
    }

    /// `queue.bind`.
    pub fn bind_queue(
        &self,
        queue: &str,
        exchange: &str,
        key: &str,
        args: &FieldTable,
        conn: ConnectionId,
    ) -> Result<(), CoreError> {
        let q = self.queue_for(queue, conn)?;
        let new = {
            let mut topo = self.topology_mut();
            let queues = self.queues_read();
            let lookup = |n: &str| queues.contains_key(n);
            topo.bind(
                exchange,
                Destination::queue(queue),
                key,
                args.clone(),
                &lookup,
            )?
        };
        if new && q.durable() {
            self.save()?;
        }
        Ok(())
    }

    /// `queue.unbind`.
    pub fn unbind_queue(
        &self,
        queue: &str,
        exchange: &str,
        key: &str,
        args: &FieldTable,
        conn: ConnectionId,
    ) -> Result<(), CoreError> {
        let q = self.queue_for(queue, conn)?;
        let (removed, _) = {
            let mut topo = self.topology_mut();
            let queues = self.queues_read();
            let lookup = |n: &str| queues.contains_key(n);
            topo.unbind(exchange, &Destination::queue(queue), key, args, &lookup)?
        };
        if removed && q.durable() {
            self.save()?;
        }
        Ok(())
    }

    /// `queue.purge`: returns the messages removed.
    pub fn purge_queue(&self, queue: &str, conn: ConnectionId) -> Result<u32, CoreError> {
        Ok(self.queue_for(queue, conn)?.purge())
    }

    /// `queue.delete`: returns the messages it held.
    pub fn delete_queue(
        &self,
        queue: &str,
        if_unused: bool,
        if_empty: bool,
        conn: ConnectionId,
    ) -> Result<u32, CoreError> {
        let q = match self.queue_for(queue, conn) {
            Ok(q) => q,
            // RabbitMQ: deleting a missing queue succeeds with 0 messages
            Err(CoreError::NotFound { .. }) => return Ok(0),
            Err(e) => return Err(e),
        };
        let (consumers, messages) = q.usage();
        if if_unused && consumers > 0 {
            return Err(CoreError::PreconditionFailed(format!(
                "queue '{queue}' in vhost '{}' in use",
                self.name
            )));
        }
        if if_empty && messages > 0 {
            return Err(CoreError::PreconditionFailed(format!(
                "queue '{queue}' in vhost '{}' is not empty",
                self.name
            )));
        }
        Ok(self.remove_queue(&q))
    }

    /// Takes a queue out of the vhost, its bindings and the store.
    fn remove_queue(&self, q: &Arc<Queue>) -> u32 {
        {
            let mut queues = self.queues_mut();
            match queues.get(q.name()) {
                Some(cur) if Arc::ptr_eq(cur, q) => {
                    queues.remove(q.name());
                }
                _ => return 0,
            }
        }
        let n = q.mark_deleted();
        self.topology_mut()
            .remove_destination(&Destination::queue(q.name()));
        if let Err(e) = self.store.delete_queue(q.store_id()) {
            tracing::warn!(queue = q.name(), error = %e, "store: deleting the queue failed");
        }
        if q.durable() {
            if let Err(e) = self.save() {
                tracing::warn!(vhost = %self.name, error = %e, "saving the topology failed");
            }
        }
        n
    }

    pub(crate) fn auto_delete_queue(&self, q: &Queue) {
        if let Some(arc) = self.queue(q.name()) {
            if std::ptr::eq(Arc::as_ptr(&arc), q) {
                self.remove_queue(&arc);
            }
        }
    }

    /// Deletes the exclusive queues of a closed connection.
    pub(crate) fn connection_closed(&self, conn: ConnectionId) {
        let owned: Vec<Arc<Queue>> = self
            .queues_read()
            .values()
            .filter(|q| q.exclusive_owner() == Some(conn))
            .cloned()
            .collect();
        for q in owned {
            self.remove_queue(&q);
        }
    }

    /// Periodic work for every queue: TTL expiry and `x-expires`.
    pub(crate) fn tick(&self) {
        let queues: Vec<Arc<Queue>> = self.queues_read().values().cloned().collect();
        for q in queues {
            if q.tick() {
                self.remove_queue(&q);
            }
        }
    }

    /// Routes a message to its queues: names, resolved to queue objects.
    fn route(
        &self,
        exchange: &str,
        key: &str,
        headers: Option<&FieldTable>,
    ) -> Result<Vec<Arc<Queue>>, CoreError> {
        let topo = self.topology_read();
        let queues = self.queues_read();
        let lookup = |n: &str| queues.contains_key(n);
        let names = topo.route(exchange, key, headers, &lookup)?;
        Ok(names
            .iter()
            .filter_map(|n| queues.get(n).cloned())
            .collect())
    }

    /// `basic.publish` (and STOMP SEND, MQTT PUBLISH).
    pub fn publish(&self, p: Publish) -> Result<Published, CoreError> {
        if p.body.len() > self.max_message_size {
            return Err(CoreError::PreconditionFailed(format!(
                "message size {} is larger than configured max size {}",
                p.body.len(),
                self.max_message_size
            )));
        }
        let targets = self.route(&p.exchange, &p.routing_key, p.properties.headers.as_ref())?;
        self.publish_to(
            targets,
            &p.exchange,
            &p.routing_key,
            p.properties,
            &p.body,
            Some(p.conn),
        )
    }

    fn publish_to(
        &self,
        targets: Vec<Arc<Queue>>,
        exchange: &str,
        routing_key: &str,
        props: Properties,
        body: &Bytes,
        publisher: Option<ConnectionId>,
    ) -> Result<Published, CoreError> {
        if targets.is_empty() {
            return Ok(Published {
                routed: false,
                rejected: false,
                durable: None,
                backpressure: None,
            });
        }
        let mut rejected = false;
        let targets: Vec<Arc<Queue>> = targets
            .into_iter()
            .filter(|q| {
                let r = q.rejects(body.len());
                rejected |= r;
                !r
            })
            .collect();
        if targets.is_empty() {
            return Ok(Published {
                routed: true,
                rejected,
                durable: None,
                backpressure: None,
            });
        }
        let persistent = props.delivery_mode == Some(2);
        let has_ttl = props.expiration.is_some();
        let tag = make_tag(body.len(), props.priority.unwrap_or(0), has_ttl, persistent);
        let env = envelope::encode(exchange, routing_key, &props)?;
        let ids: Vec<u32> = targets.iter().map(|q| q.store_id()).collect();
        let key_buf;
        let keys: &[&[u8]] = match &props.message_id {
            Some(id) if !id.is_empty() && id.len() <= 1024 => {
                key_buf = [id.as_bytes()];
                &key_buf
            }
            _ => &[],
        };
        let appended = self.store.append(&NewMessage {
            queues: &ids,
            flags: if persistent { FLAG_PERSISTENT } else { 0 },
            born_ts_ms: now_ms(),
            tag_hash: tag,
            keys,
            properties: &env,
            body,
        })?;
        let wants_disk = persistent && targets.iter().any(|q| q.durable());
        let hot = Hot {
            exchange: Arc::from(exchange),
            routing_key: Arc::from(routing_key),
            properties: Arc::new(props),
            // the stored copy (page cache), not the publisher's read buffer: deliveries
            // waiting on a slow consumer must not pin heap
            body: appended.body.clone().unwrap_or_else(|| body.clone()),
        };
        let mut throttled = Vec::new();
        for (q, (_, off)) in targets.iter().zip(&appended.queue_offsets) {
            if q.enqueue(*off, appended.commit_offset, tag, publisher, Some(&hot)) {
                throttled.push(q.clone());
            }
        }
        Ok(Published {
            routed: true,
            rejected,
            durable: wants_disk.then_some(appended.durable),
            backpressure: (!throttled.is_empty()).then(|| Backpressure::new(throttled)),
        })
    }

    /// Republishes a message leaving `from` to its dead-letter exchange.
    pub(crate) fn dead_letter(&self, from: &Queue, rec: &StoredRecord, reason: &str) {
        let Ok((exchange, routing_key, mut props)) = envelope::decode(&rec.properties) else {
            return;
        };
        let Some((dlx, key)) = from.dead_letter_target(reason, &exchange, &routing_key, &mut props)
        else {
            return;
        };
        let targets = match self.route(&dlx, &key, props.headers.as_ref()) {
            Ok(t) => t,
            Err(e) => {
                tracing::debug!(queue = from.name(), dlx, error = %e, "dead-letter exchange unusable; message dropped");
                return;
            }
        };
        if let Err(e) = self.publish_to(targets, &dlx, &key, props, &rec.body, None) {
            tracing::warn!(queue = from.name(), error = %e, "dead-lettering failed; message dropped");
        }
    }

    /// `basic.consume`.
    pub fn consume(&self, queue: &str, c: ConsumeRequest) -> Result<ConsumerHandle, CoreError> {
        let q = self.queue_for(queue, c.conn)?;
        q.consume(c)
    }

    /// `basic.get`.
    pub fn get(
        &self,
        queue: &str,
        no_ack: bool,
        conn: ConnectionId,
    ) -> Result<Option<Delivery>, CoreError> {
        Ok(self.queue_for(queue, conn)?.get(no_ack))
    }

    /// The exchange definitions (for listings).
    pub fn exchanges(&self) -> Vec<ExchangeDef> {
        self.topology_read().exchanges().cloned().collect()
    }

    /// Whether an exchange exists.
    pub fn has_exchange(&self, name: &str) -> bool {
        self.topology_read().exchange(name).is_some()
    }

    /// An exchange's kind, if it exists.
    pub fn exchange_kind(&self, name: &str) -> Option<ExchangeKind> {
        self.topology_read().exchange(name).map(|x| x.kind)
    }
}

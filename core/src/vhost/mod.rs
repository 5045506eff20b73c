//! A virtual host: its topology (exchanges and bindings), its queues, and the publish,
//! consume and get operations. Durable topology lives in the store's metadata journal:
//! each durable exchange, queue and binding is one key, and every change is one record,
//! appended under the lock that guards the in-memory change (so the journal's order is
//! the state's) and waited for after it is released.
//!
//! Journal keys (parts length-prefixed, see [`triad_store::journal::KeyBuilder`]):
//! `X vhost name` → exchange, `q vhost name` → queue,
//! `B vhost ("q"|"x") destination source routing-key arguments` → binding (empty value),
//! so a deleted queue's or exchange's incoming bindings are one `DeletePrefix`.
//!
//! Lock order: `topology` before `queues`; a queue's own lock is never held while either
//! is taken.
//!
//! Modules: this one holds the vhost, its topology and queue operations and its opening;
//! `publish` the publish path (routing, storing, handing to queues, delayed messages,
//! direct replies, dead-lettering); `journal` the journal keys and documents.

mod journal;
mod publish;

use std::collections::HashMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

use crate::durability::Durability;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use triad_store::commitlog::StoredRecord;
use triad_store::journal::{key_parts, KeyBuilder, MetaOp};
use triad_store::record::{NewMessage, FLAG_DEAD_LETTERED, FLAG_PERSISTENT};
use triad_store::store::Store;

use crate::access::VhostAccess;
use crate::encoding::{put_table, Reader};
use crate::error::CoreError;
use crate::message::Properties;
use crate::outbox::{Backpressure, Delivery};
use crate::queue::{
    make_tag, now_ms, ConsumeRequest, ConsumerHandle, Hot, Queue, QueueArgs, QueueSpec,
};
use crate::reserved;
use crate::routing::{Destination, ExchangeDef, ExchangeKind, Topology};
use crate::value::FieldTable;
use crate::{envelope, ConnectionId};
use journal::*;

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
    pub durable: Option<Durability>,
    /// `Some`: a queue it went to is throttled (its consumers fall behind); hold the
    /// publisher (delay its ack or stop reading from it) until this clears.
    pub backpressure: Option<Backpressure>,
    /// The queues it was stored for (an exchange's `publish_out`); 0 when it is not
    /// routed yet (delayed, a half message) or went to a direct reply-to consumer.
    pub queues: u32,
}

impl Published {
    /// A message stored but not routed yet (delayed, a transaction's half message): it
    /// counts as routed, and is confirmed once `durable` completes.
    pub(crate) fn held(durable: Durability) -> Published {
        Published {
            routed: true,
            rejected: false,
            durable: Some(durable),
            backpressure: None,
            queues: 0,
        }
    }
}

/// Prefix of the store index key under which [`Vhost::publish_topic_indexed`] indexes a
/// message: `\0topic\0<vhost>\0<routing key>` (the leading NUL keeps it apart from
/// `message-id` keys; a query still checks the record's vhost and routing key).
pub const TOPIC_KEY_PREFIX: &[u8] = b"\0topic\0";

/// Longest topic index key written; a longer one is not indexed.
pub const MAX_TOPIC_KEY: usize = 1024;

/// The store index key of a publish to `routing_key` in `vhost` (see
/// [`TOPIC_KEY_PREFIX`]).
pub fn topic_key(vhost: &str, routing_key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(TOPIC_KEY_PREFIX.len() + vhost.len() + 1 + routing_key.len());
    k.extend_from_slice(TOPIC_KEY_PREFIX);
    k.extend_from_slice(vhost.as_bytes());
    k.push(0);
    k.extend_from_slice(routing_key.as_bytes());
    k
}

/// Calls `f` with [`topic_key`] built on the stack when it fits (no allocation per
/// publish), `None` when it is longer than [`MAX_TOPIC_KEY`].
fn with_topic_key<R>(vhost: &str, routing_key: &str, f: impl FnOnce(Option<&[u8]>) -> R) -> R {
    let len = TOPIC_KEY_PREFIX.len() + vhost.len() + 1 + routing_key.len();
    if len > MAX_TOPIC_KEY {
        return f(None);
    }
    let mut buf = [0u8; 320];
    match buf.get_mut(..len) {
        Some(key) => {
            let (head, rest) = key.split_at_mut(TOPIC_KEY_PREFIX.len());
            head.copy_from_slice(TOPIC_KEY_PREFIX);
            let (v, rest) = rest.split_at_mut(vhost.len());
            v.copy_from_slice(vhost.as_bytes());
            if let Some((nul, rk)) = rest.split_first_mut() {
                *nul = 0;
                rk.copy_from_slice(routing_key.as_bytes());
            }
            f(Some(key))
        }
        None => f(Some(&topic_key(vhost, routing_key))),
    }
}

/// Queues by name, looked up on every publish: seeded foldhash rather than SipHash.
type QueueMap = HashMap<String, Arc<Queue>, foldhash::fast::RandomState>;

/// Totals over a vhost's queues, from one pass ([`Vhost::totals`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QueueTotals {
    /// Queues clients can address.
    pub queues: u64,
    /// Their consumers.
    pub consumers: u64,
    /// Their ready messages.
    pub ready: u64,
    /// Their unacknowledged messages.
    pub unacked: u64,
    /// Bytes of their ready messages.
    pub ready_bytes: u64,
    /// The message counters, as [`Vhost::message_stats`] gives them.
    pub values: crate::stats::Values,
    /// Their per-second rates.
    pub rates: [f64; 8],
}

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
    /// Exclusive queues by owning connection, so a closing connection finds its own
    /// without a scan of every queue. Guarded after `queues` in the lock order.
    exclusive: std::sync::Mutex<HashMap<ConnectionId, Vec<Arc<Queue>>>>,
    /// Direct reply-to consumers' names ([`crate::direct_reply`]).
    replies: Arc<crate::direct_reply::Registry>,
    /// The vhost's policies (see [`crate::policy`]).
    policies: crate::policy::Policies,
    /// Messages clients published into the vhost (sharded: no lock on that path).
    published: crate::stats::Counter,
    /// Per-exchange publish counters, counted by each connection ([`crate::exchange_stats`]).
    exchange_stats: crate::exchange_stats::ExchangeStats,
    /// The management API's last reading of the vhost's counters.
    rate: std::sync::Mutex<Option<crate::stats::RateSample>>,
    /// Half messages ([`crate::txn`]).
    txn: crate::txn::Txn,
    /// The broker's clock ([`crate::clock`]).
    clock: crate::Clock,
    /// Delayed messages ([`crate::delayed`]), once the vhost has had one.
    delayed: std::sync::Mutex<Option<Arc<crate::delayed::Delayed>>>,
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
        txn: crate::txn::TxnConfig,
        clock: crate::Clock,
    ) -> Result<Arc<Vhost>, CoreError> {
        import_legacy_doc(&store, name)?;
        let journal = store.journal();
        let policies = crate::policy::Policies::load(journal, name)?;
        let txn = crate::txn::Txn::open(store.clone(), name, txn, clock.clone())?;
        let vh = Arc::new_cyclic(|me| Vhost {
            name: name.to_string(),
            store: store.clone(),
            topology: RwLock::new(Topology::new()),
            queues: RwLock::new(QueueMap::default()),
            window,
            max_message_size,
            max_queues,
            me: me.clone(),
            exclusive: Default::default(),
            replies: Default::default(),
            policies,
            published: Default::default(),
            exchange_stats: Default::default(),
            rate: Default::default(),
            txn,
            clock: clock.clone(),
            delayed: Default::default(),
        });
        vh.load_exchanges()?;
        let wanted = vh.load_queues()?;
        // store queues of this vhost that the topology does not know: a crash between
        // registering one and journaling the vhost's record of it
        for info in store.queues() {
            if info.vhost == name
                && !wanted.contains(&info.id)
                && info.name != crate::txn::HALF_QUEUE
                && info.name != crate::delayed::DELAY_QUEUE
            {
                store.delete_queue(info.id)?;
            }
        }
        vh.load_bindings()?;
        if let Some(d) = crate::delayed::Delayed::open(&store, name, false, &clock)? {
            *vh.delayed.lock().unwrap_or_else(|e| e.into_inner()) = Some(d.clone());
            crate::delayed::spawn(&vh, d);
        }
        Ok(vh)
    }

    /// The journal key prefix of this vhost's records of one kind.
    fn journal_prefix(&self, tag: u8) -> Vec<u8> {
        KeyBuilder::new(tag).part(self.name.as_bytes()).build()
    }

    /// Declares the durable exchanges the journal holds (at open).
    fn load_exchanges(&self) -> Result<(), CoreError> {
        let mut topo = self.topology_mut();
        for (_, v) in self
            .store
            .journal()
            .scan(&self.journal_prefix(TAG_EXCHANGE))?
        {
            let x: ExchangeDoc = from_json(&v)?;
            let mut def = ExchangeDef::new(x.name.clone(), x.kind.parse::<ExchangeKind>()?);
            def.durable = true;
            def.auto_delete = x.auto_delete;
            def.internal = x.internal;
            def.arguments = table_from_hex(&x.arguments)?;
            topo.declare_exchange(def)?;
        }
        Ok(())
    }

    /// Opens the durable queues the journal holds (at open); returns their store ids.
    fn load_queues(
        &self,
    ) -> Result<std::collections::HashSet<triad_store::store::QueueId>, CoreError> {
        let (name, store) = (self.name.as_str(), &self.store);
        let mut wanted = std::collections::HashSet::new();
        for (_, v) in store.journal().scan(&self.journal_prefix(TAG_QUEUE))? {
            let q: QueueDoc = from_json(&v)?;
            let arguments = table_from_hex(&q.arguments)?;
            let args = QueueArgs::parse_stored(&q.name, &arguments)?;
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
                    window: self.window,
                    clock: self.clock.clone(),
                },
                store.clone(),
                self.me.clone(),
            )?;
            if let Some(p) = self.policies.for_queue(&q.name) {
                queue.apply_policy(Some(p));
            }
            if let Some(s) = queue.stream() {
                s.load_offsets()?;
            }
            self.queues_mut().insert(q.name.clone(), queue);
        }
        Ok(wanted)
    }

    /// Adds the bindings the journal holds (at open, after the queues); a stored binding
    /// the topology refuses is dropped from the journal with a warning.
    fn load_bindings(&self) -> Result<(), CoreError> {
        let name = self.name.as_str();
        let journal = self.store.journal();
        let queues = self.queues_read();
        let lookup = |n: &str| queues.contains_key(n);
        let mut topo = self.topology_mut();
        let mut dropped = Vec::new();
        let mut bad = None;
        // visited in place: a copy of 1,000,000 binding keys would double the peak
        journal.visit(&self.journal_prefix(TAG_BINDING), &mut |k, _| {
            if bad.is_some() {
                return;
            }
            match Self::load_binding(&mut topo, k, &lookup) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(vhost = name, error = %e, "dropping a stored binding");
                    dropped.push(MetaOp::delete(k.to_vec()));
                }
                Err(e) => bad = Some(e),
            }
        })?;
        if let Some(e) = bad {
            return Err(e);
        }
        if !dropped.is_empty() {
            journal.commit(dropped)?;
        }
        Ok(())
    }

    /// Adds the binding stored under journal key `k` to `topo`. The outer error is a
    /// malformed key; the inner one a binding the topology refuses (dropped).
    pub(super) fn load_binding(
        topo: &mut Topology,
        k: &[u8],
        lookup: &dyn crate::routing::QueueLookup,
    ) -> Result<Result<(), CoreError>, CoreError> {
        // vhost, kind, destination, source, key, arguments
        let parts = k.get(1..).and_then(key_parts);
        let Some([_, kind, dest, source, key, args]) = parts.as_deref() else {
            return Err(CoreError::InvalidEncoding("bad stored binding key"));
        };
        let dest_name = String::from_utf8_lossy(dest);
        let dest = if *kind == b"x" {
            Destination::exchange(dest_name)
        } else {
            Destination::queue(dest_name)
        };
        let args = crate::encoding::Reader::new(args).table(0)?;
        Ok(topo
            .bind(
                &String::from_utf8_lossy(source),
                dest,
                &String::from_utf8_lossy(key),
                args,
                lookup,
            )
            .map(|_| ()))
    }

    /// The vhost's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(super) fn topology_read(&self) -> RwLockReadGuard<'_, Topology> {
        self.topology.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn topology_mut(&self) -> RwLockWriteGuard<'_, Topology> {
        self.topology.write().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn queues_read(&self) -> RwLockReadGuard<'_, QueueMap> {
        self.queues.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn queues_mut(&self) -> RwLockWriteGuard<'_, QueueMap> {
        self.queues.write().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn exclusive_mut(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<ConnectionId, Vec<Arc<Queue>>>> {
        self.exclusive.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends `ops` to the metadata journal (call under the lock that guards the change).
    pub(super) fn journal(&self, ops: Vec<MetaOp>) -> Result<Durability, CoreError> {
        if ops.is_empty() {
            return Ok(Durability::ready());
        }
        Ok(self.store.journal().append(ops)?.into())
    }

    /// Waits for a journal record (call after releasing the locks).
    pub(super) fn durable(done: Durability) -> Result<(), CoreError> {
        done.wait()?;
        Ok(())
    }

    /// Whether bindings from / to this exchange are journaled.
    pub(super) fn exchange_is_durable(topo: &Topology, name: &str) -> bool {
        topo.exchange(name).is_some_and(|x| x.durable)
    }

    /// `exchange.declare`.
    pub fn declare_exchange(&self, def: ExchangeDef, passive: bool) -> Result<(), CoreError> {
        if passive {
            self.topology_read().check_exchange(&def.name)?;
            return Ok(());
        }
        let journaled = def.durable && !def.name.is_empty() && !def.name.starts_with("amq.");
        let record = journaled.then(|| {
            to_json(&ExchangeDoc {
                name: def.name.clone(),
                kind: def.kind.as_str().to_string(),
                auto_delete: def.auto_delete,
                internal: def.internal,
                arguments: table_to_hex(&def.arguments),
            })
        });
        let key = exchange_key(&self.name, &def.name);
        let done = {
            let mut topo = self.topology_mut();
            let created = topo.declare_exchange(def)?;
            match record {
                Some(r) if created == crate::routing::Declared::Created => {
                    self.journal(vec![MetaOp::put(key, r)])?
                }
                _ => Durability::ready(),
            }
        };
        Self::durable(done)
    }

    /// `exchange.delete`; deleting a missing exchange succeeds, as in RabbitMQ.
    pub fn delete_exchange(&self, name: &str, if_unused: bool) -> Result<(), CoreError> {
        let done = {
            let mut topo = self.topology_mut();
            let from = topo.bindings_from(name).unwrap_or_default();
            match topo.delete_exchange(name, if_unused) {
                Ok(deleted) => {
                    let mut ops: Vec<MetaOp> = from
                        .iter()
                        .map(|b| {
                            MetaOp::delete(binding_key(
                                &self.name,
                                name,
                                &b.destination,
                                &b.routing_key,
                                &b.arguments,
                            ))
                        })
                        .collect();
                    deleted_exchange_ops(&self.name, &deleted, &mut ops);
                    for x in &deleted {
                        self.exchange_stats.forget(x);
                    }
                    self.journal(ops)?
                }
                Err(CoreError::NotFound { .. }) => return Ok(()),
                Err(e) => return Err(e),
            }
        };
        Self::durable(done)
    }

    /// `exchange.bind`: route from `source` to the `destination` exchange.
    pub fn bind_exchange(
        &self,
        destination: &str,
        source: &str,
        key: &str,
        args: &FieldTable,
    ) -> Result<(), CoreError> {
        let done = self.bind(source, Destination::exchange(destination), key, args)?;
        Self::durable(done)
    }

    /// Adds a binding and journals it when both ends are durable; returns what the reply
    /// waits for.
    pub(super) fn bind(
        &self,
        source: &str,
        dest: Destination,
        key: &str,
        args: &FieldTable,
    ) -> Result<Durability, CoreError> {
        let mut topo = self.topology_mut();
        let queues = self.queues_read();
        let lookup = |n: &str| queues.contains_key(n);
        let new = topo.bind(source, dest.clone(), key, args.clone(), &lookup)?;
        // a queue may have been deleted and declared again since the caller looked
        let durable_dest = match &dest {
            Destination::Queue(q) => queues.get(&**q).is_some_and(|cur| cur.durable()),
            Destination::Exchange(x) => Self::exchange_is_durable(&topo, x),
        };
        if new && durable_dest && Self::exchange_is_durable(&topo, source) {
            let k = binding_key(&self.name, source, &dest, key, args);
            self.journal(vec![MetaOp::put(k, Vec::new())])
        } else {
            Ok(self.journaled_so_far())
        }
    }

    /// `exchange.unbind`.
    pub fn unbind_exchange(
        &self,
        destination: &str,
        source: &str,
        key: &str,
        args: &FieldTable,
    ) -> Result<(), CoreError> {
        let dest = Destination::exchange(destination);
        self.unbind(source, &dest, key, args)
    }

    /// Removes a binding and journals its removal and that of any auto-delete exchange
    /// it cascaded to.
    pub(super) fn unbind(
        &self,
        source: &str,
        dest: &Destination,
        key: &str,
        args: &FieldTable,
    ) -> Result<(), CoreError> {
        let done = {
            let mut topo = self.topology_mut();
            let queues = self.queues_read();
            let lookup = |n: &str| queues.contains_key(n);
            let (removed, deleted) = topo.unbind(source, dest, key, args, &lookup)?;
            let mut ops = Vec::new();
            if removed {
                ops.push(MetaOp::delete(binding_key(
                    &self.name, source, dest, key, args,
                )));
            }
            deleted_exchange_ops(&self.name, &deleted, &mut ops);
            self.journal(ops)?
        };
        Self::durable(done)
    }

    pub(super) fn queue_for(
        &self,
        name: &str,
        conn: ConnectionId,
    ) -> Result<Arc<Queue>, CoreError> {
        let q = self
            .queues_read()
            .get(name)
            .cloned()
            .ok_or_else(|| CoreError::queue_not_found(name))?;
        self.check_exclusive(&q, conn)?;
        Ok(q)
    }

    pub(super) fn check_exclusive(&self, q: &Queue, conn: ConnectionId) -> Result<(), CoreError> {
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

    /// `queue.declare`; returns once the declaration is on disk.
    pub fn declare_queue(&self, d: QueueDeclare) -> Result<QueueDeclareOk, CoreError> {
        let (ok, done) = self.declare_queue_deferred(d)?;
        Self::durable(done)?;
        Ok(ok)
    }

    /// Everything journaled so far is durable once this completes: what a reply about an
    /// entity that already exists waits for (its record may still be in flight).
    pub(super) fn journaled_so_far(&self) -> Durability {
        self.store.journal().durable_end().into()
    }

    /// The reply to a declare of a queue that exists: it may only go once whatever was
    /// journaled before (the queue's own record among it) is on disk.
    pub(super) fn declared(&self, name: String, q: &Queue) -> (QueueDeclareOk, Durability) {
        let ok = QueueDeclareOk {
            name,
            message_count: q.message_count(),
            consumer_count: q.consumer_count(),
        };
        (ok, self.journaled_so_far())
    }

    /// `queue.declare` without blocking on the disk: the reply may be sent once the
    /// returned [`Durability`] completes (an async caller awaits it).
    pub fn declare_queue_deferred(
        &self,
        d: QueueDeclare,
    ) -> Result<(QueueDeclareOk, Durability), CoreError> {
        if d.passive {
            return self.declare_queue_passive(d);
        }
        let name = Self::declared_queue_name(&d)?;
        if let Some(access) = &d.access {
            access.queue_declare(&name, &d.arguments)?;
        }
        if let Some(q) = self.queue(&name) {
            self.check_exclusive(&q, d.conn)?;
            self.check_equivalent(&q, &d)?;
            q.touch();
            return Ok(self.declared(name, &q));
        }
        // RabbitMQ accepts a dead-letter exchange that does not exist (yet)
        let args = QueueArgs::parse(&d.arguments)?;
        if crate::stream::spec::is_stream(&d.arguments) {
            crate::stream::spec::check_properties(
                &name,
                &self.name,
                d.durable,
                d.exclusive,
                d.auto_delete,
            )?;
        }
        self.create_declared_queue(name, &d, args)
    }

    /// `queue.declare` with `passive`: the queue must exist (and be usable by `d.conn`).
    fn declare_queue_passive(
        &self,
        d: QueueDeclare,
    ) -> Result<(QueueDeclareOk, Durability), CoreError> {
        let name = d.name;
        if let Some(access) = &d.access {
            access.queue_declare_passive(&name)?;
        }
        let q = self.queue_for(&name, d.conn)?;
        q.touch();
        Ok(self.declared(name, &q))
    }

    /// The name a (non-passive) declare gets: a generated `amq.gen-` one for an empty
    /// name; a reserved `amq.` name only for the broker's own declare; at most 255 bytes.
    fn declared_queue_name(d: &QueueDeclare) -> Result<String, CoreError> {
        let name = if d.name.is_empty() {
            format!("amq.gen-{}", random_suffix())
        } else {
            // the broker's own declare (no `access`) may use its reserved names
            if d.name.starts_with("amq.")
                && !(d.access.is_none() && reserved::is_reserved_queue(&d.name))
            {
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
        Ok(name)
    }

    /// Creates the queue a declare names, under the queue map's lock: registers it with
    /// the store, journals its record (when durable), applies the policy in force and
    /// files it under its exclusive owner. A queue another declare created meanwhile is
    /// answered as existing.
    fn create_declared_queue(
        &self,
        name: String,
        d: &QueueDeclare,
        args: QueueArgs,
    ) -> Result<(QueueDeclareOk, Durability), CoreError> {
        // exclusive queues never outlive their connection, so they are never durable
        let durable = d.durable && !d.exclusive;
        let mut queues = self.queues_mut();
        if let Some(q) = queues.get(&name) {
            // lost a race with another declare
            let q = q.clone();
            drop(queues);
            self.check_exclusive(&q, d.conn)?;
            return Ok(self.declared(name, &q));
        }
        if self.max_queues > 0 && queues.len() >= self.max_queues {
            tracing::info!(vhost = %self.name, queue = %name, max = self.max_queues, "queue limit reached");
            return Err(CoreError::PreconditionFailed(format!(
                "cannot declare queue '{name}': queue limit in vhost '{}' ({}) is reached",
                self.name, self.max_queues
            )));
        }
        let (id, _registered) = self
            .store
            .create_queue_deferred(&self.name, &name, durable)?;
        // the vhost's own record comes after the store's in the journal, so waiting for
        // it covers both
        let done = if durable {
            let record = to_json(&QueueDoc {
                name: name.clone(),
                auto_delete: d.auto_delete,
                arguments: table_to_hex(&d.arguments),
            });
            self.journal(vec![MetaOp::put(queue_key(&self.name, &name), record)])?
        } else {
            Durability::ready()
        };
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
                clock: self.clock.clone(),
            },
            self.store.clone(),
            self.me.clone(),
        )?;
        // under the queue map's lock: a policy change walks the map after
        // changing the list, so it either sees this queue or this sees it
        if let Some(p) = self.policies.for_queue(&name) {
            q.apply_policy(Some(p));
        }
        if d.exclusive {
            self.exclusive_mut()
                .entry(d.conn)
                .or_default()
                .push(q.clone());
        }
        queues.insert(name.clone(), q);
        drop(queues);
        Ok((
            QueueDeclareOk {
                name,
                message_count: 0,
                consumer_count: 0,
            },
            done,
        ))
    }

    pub(super) fn check_equivalent(&self, q: &Queue, d: &QueueDeclare) -> Result<(), CoreError> {
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
            "x-single-active-consumer",
            "x-delivery-limit",
            "x-retry-backoff",
            "x-max-age",
        ] {
            let (a, b) = (d.arguments.get(key), q.arguments().get(key));
            let same = match (a, b) {
                (None, None) => true,
                (Some(a), Some(b)) => a.loosely_equals(b),
                // RabbitMQ: an omitted x-queue-type matches classic (not a stream)
                (None, Some(v)) | (Some(v), None) => {
                    key == "x-queue-type" && v.as_str().is_some_and(|t| t == "classic")
                }
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

    /// `queue.bind`; returns once the binding is on disk.
    pub fn bind_queue(
        &self,
        queue: &str,
        exchange: &str,
        key: &str,
        args: &FieldTable,
        conn: ConnectionId,
    ) -> Result<(), CoreError> {
        let done = self.bind_queue_deferred(queue, exchange, key, args, conn)?;
        Self::durable(done)
    }

    /// `queue.bind` without blocking on the disk: reply once the result completes.
    pub fn bind_queue_deferred(
        &self,
        queue: &str,
        exchange: &str,
        key: &str,
        args: &FieldTable,
        conn: ConnectionId,
    ) -> Result<Durability, CoreError> {
        self.queue_for(queue, conn)?;
        self.bind(exchange, Destination::queue(queue), key, args)
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
        self.queue_for(queue, conn)?;
        self.unbind(exchange, &Destination::queue(queue), key, args)
    }

    /// `queue.purge`: returns the messages removed.
    pub fn purge_queue(&self, queue: &str, conn: ConnectionId) -> Result<u32, CoreError> {
        let q = self.queue_for(queue, conn)?;
        crate::stream::refuse_on_stream(&q, "queue.purge")?;
        Ok(q.purge())
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
    pub(super) fn remove_queue(&self, q: &Arc<Queue>) -> u32 {
        // Both locks are held until the record is appended, so that a declare of the same
        // name (queues lock) or a bind to it (topology lock) journals after it.
        let done = {
            let mut topo = self.topology_mut();
            let mut queues = self.queues_mut();
            match queues.get(q.name()) {
                Some(cur) if Arc::ptr_eq(cur, q) => {
                    queues.remove(q.name());
                }
                _ => return 0,
            }
            if let Some(owner) = q.exclusive_owner() {
                let mut ex = self.exclusive_mut();
                if let Some(list) = ex.get_mut(&owner) {
                    list.retain(|o| !Arc::ptr_eq(o, q));
                    if list.is_empty() {
                        ex.remove(&owner);
                    }
                }
            }
            let dest = Destination::queue(q.name());
            let deleted = topo.remove_destination(&dest);
            let mut ops = Vec::new();
            if q.durable() {
                ops.push(MetaOp::delete(queue_key(&self.name, q.name())));
                ops.push(MetaOp::delete_prefix(
                    bindings_to_prefix(&self.name, &dest).build(),
                ));
            }
            if let Some(s) = q.stream() {
                // no stored-offset commit may journal after their deletion
                s.stop_commits();
                ops.push(crate::stream::delete_offsets_op(&self.name, q.name()));
            }
            deleted_exchange_ops(&self.name, &deleted, &mut ops);
            self.journal(ops)
        };
        let n = q.mark_deleted();
        // the store's record follows the vhost's: its wait covers both
        if let Err(e) = self.store.delete_queue(q.store_id()) {
            tracing::warn!(queue = q.name(), error = %e, "store: deleting the queue failed");
        }
        if let Err(e) = done.and_then(Self::durable) {
            tracing::warn!(vhost = %self.name, error = %e, "journaling the queue's removal failed");
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
        let owned = self.exclusive_mut().remove(&conn).unwrap_or_default();
        for q in owned {
            self.remove_queue(&q);
        }
    }

    /// Periodic work for every queue: TTL expiry and `x-expires`.
    pub(crate) fn tick(&self) {
        let queues: Vec<Arc<Queue>> = self
            .queues_read()
            .values()
            .filter(|q| q.needs_tick())
            .cloned()
            .collect();
        for q in queues {
            if q.tick() {
                self.remove_queue(&q);
            }
        }
        self.txn.tick(self);
    }

    /// The vhost's half messages ([`crate::txn`]).
    pub fn txn(&self) -> &crate::txn::Txn {
        &self.txn
    }

    pub(crate) fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The broker's clock.
    pub fn clock(&self) -> &crate::Clock {
        &self.clock
    }

    /// `basic.consume`.
    pub fn consume(&self, queue: &str, c: ConsumeRequest) -> Result<ConsumerHandle, CoreError> {
        let q = self.queue_for(queue, c.conn)?;
        q.consume(c)
    }

    /// `basic.consume` with a stream consumer's start position and name
    /// ([`crate::stream`]); refused on other queues when either is set.
    pub fn consume_stream(
        &self,
        queue: &str,
        c: ConsumeRequest,
        opts: crate::stream::StreamConsume,
    ) -> Result<ConsumerHandle, CoreError> {
        let q = self.queue_for(queue, c.conn)?;
        q.consume_with(c, opts)
    }

    /// `basic.get`.
    pub fn get(
        &self,
        queue: &str,
        no_ack: bool,
        conn: ConnectionId,
    ) -> Result<Option<Delivery>, CoreError> {
        let q = self.queue_for(queue, conn)?;
        crate::stream::refuse_on_stream(&q, "basic.get")?;
        Ok(q.get(no_ack))
    }

    /// Deletes every queue, exchange and binding of the vhost, journaled (the vhost
    /// itself is being deleted).
    pub(crate) fn delete_everything(&self) -> Result<(), CoreError> {
        for name in self.queue_names() {
            if let Some(q) = self.queue(&name) {
                let owner = q.exclusive_owner().unwrap_or(0);
                self.delete_queue(&name, false, false, owner)?;
            }
        }
        // its delayed messages go with it (the scheduler ends with the vhost)
        let delayed = self
            .delayed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(d) = delayed {
            // the timer log too (derived data, not the store's)
            d.remove();
            self.store.delete_queue(d.queue_id())?;
        }
        let mut ops = [TAG_EXCHANGE, TAG_QUEUE, TAG_BINDING]
            .map(|t| MetaOp::delete_prefix(KeyBuilder::new(t).part(self.name.as_bytes()).build()))
            .to_vec();
        ops.push(MetaOp::delete_prefix(crate::policy::vhost_prefix(
            &self.name,
        )));
        self.txn.delete()?;
        Self::durable(self.journal(ops)?)
    }

    /// Messages clients published into the vhost since it was opened.
    pub fn published(&self) -> u64 {
        self.published.get()
    }

    /// Totals over the vhost's queues in one pass, one queue lock at a time: what the
    /// management overview, a vhost's entry and `/metrics` show. The broker's own queues
    /// (reserved names) do not count: no client can address them.
    pub fn totals(&self) -> QueueTotals {
        // the broker's own queues (MQTT's retained and session stores, ...) count nothing
        // a client did
        let queues: Vec<Arc<Queue>> = self
            .queues_read()
            .iter()
            .filter(|(n, _)| !reserved::is_reserved_queue(n))
            .map(|(_, q)| Arc::clone(q))
            .collect();
        let mut t = QueueTotals::default();
        for q in queues {
            let s = q.stats();
            for (v, x) in t.values.iter_mut().zip(s.values()) {
                *v = v.wrapping_add(x);
            }
            t.queues += 1;
            t.consumers += u64::from(s.consumers);
            t.ready = t.ready.wrapping_add(s.ready);
            t.unacked = t.unacked.wrapping_add(s.unacked);
            t.ready_bytes = t.ready_bytes.wrapping_add(s.ready_bytes);
        }
        if let Some(p) = t.values.first_mut() {
            *p = self.published();
        }
        t.rates = self.sample_rates(t.values);
        t
    }

    /// Per-second rates of `values` since the last sample (0 at the first).
    pub(super) fn sample_rates(&self, values: crate::stats::Values) -> [f64; 8] {
        let now = std::time::Instant::now();
        let mut rate = self.rate.lock().unwrap_or_else(|e| e.into_inner());
        match rate.as_mut() {
            Some(r) => r.rates(values, now),
            None => {
                *rate = Some(crate::stats::RateSample::new(values, now));
                [0.0; 8]
            }
        }
    }

    /// The vhost's policies, highest priority first.
    pub fn policies(&self) -> Vec<Arc<crate::policy::Policy>> {
        self.policies.list()
    }

    /// Adds or replaces a policy (once on disk) and applies it to the queues it now
    /// governs, walking the vhost's queues once. `true` when it is new.
    pub fn set_policy(&self, p: crate::policy::Policy) -> Result<bool, CoreError> {
        let _change = self.policies.begin_change();
        let created = self.policies.put(self.store.journal(), p)?;
        self.reapply_policies();
        Ok(created)
    }

    /// Deletes a policy (once on disk) and reapplies what governs its queues now;
    /// `false` when there was none.
    pub fn delete_policy(&self, name: &str) -> Result<bool, CoreError> {
        let _change = self.policies.begin_change();
        let deleted = self
            .policies
            .delete(self.store.journal(), &self.name, name)?;
        if deleted {
            self.reapply_policies();
        }
        Ok(deleted)
    }

    /// Gives every queue whose governing policy changed its new one.
    pub(super) fn reapply_policies(&self) {
        let queues: Vec<Arc<Queue>> = self.queues_read().values().cloned().collect();
        for q in queues {
            let now = self.policies.for_queue(q.name());
            let same = match (&now, q.policy()) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, &b),
                (None, None) => true,
                _ => false,
            };
            if !same {
                q.apply_policy(now);
            }
        }
    }

    /// The exchange definitions (for listings).
    pub fn exchanges(&self) -> Vec<ExchangeDef> {
        self.topology_read().exchanges().cloned().collect()
    }

    /// Every binding of the vhost, in no particular order.
    pub fn bindings(&self) -> Vec<crate::routing::Binding> {
        self.topology_read().bindings()
    }

    /// Whether queue `queue` is bound to `exchange` with `key` and no arguments: one
    /// lookup, no scan of the vhost's bindings.
    pub fn has_queue_binding(&self, exchange: &str, queue: &str, key: &str) -> bool {
        self.topology_read().has_binding(
            exchange,
            &Destination::queue(queue),
            key,
            &FieldTable::new(),
        )
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

#[cfg(test)]
mod topic_key_tests {
    use super::*;

    #[test]
    fn stack_key_is_the_heap_key() {
        let long_key = "k".repeat(400);
        for (vh, rk) in [("/", "a.b.c"), ("", ""), ("prod", long_key.as_str())] {
            let got = with_topic_key(vh, rk, |k| k.map(<[u8]>::to_vec));
            assert_eq!(got, Some(topic_key(vh, rk)), "{vh} {rk}");
        }
        let too_long = "x".repeat(MAX_TOPIC_KEY);
        assert_eq!(with_topic_key("/", &too_long, |k| k.map(<[u8]>::len)), None);
        assert!(topic_key("/", "a").starts_with(TOPIC_KEY_PREFIX));
        // the vhost and the routing key are kept apart: ("a", "b.c") is not ("a\0b", "c")
        assert_ne!(topic_key("a", "b.c"), topic_key("a.b", "c"));
    }
}

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

/// A vhost's topology as an earlier version kept it: one document rewritten on every
/// change. Read once at start, moved into the journal, then removed.
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

/// The metadata document name of a vhost (earlier versions).
pub(crate) fn doc_name(vhost: &str) -> String {
    let hex: String = vhost.bytes().map(|b| format!("{b:02x}")).collect();
    format!("vhost-{hex}")
}

const TAG_EXCHANGE: u8 = b'X';
const TAG_QUEUE: u8 = b'q';
const TAG_BINDING: u8 = b'B';

fn exchange_key(vhost: &str, name: &str) -> Vec<u8> {
    KeyBuilder::new(TAG_EXCHANGE)
        .part(vhost.as_bytes())
        .part(name.as_bytes())
        .build()
}

fn queue_key(vhost: &str, name: &str) -> Vec<u8> {
    KeyBuilder::new(TAG_QUEUE)
        .part(vhost.as_bytes())
        .part(name.as_bytes())
        .build()
}

/// The prefix of every binding leading to `dest`.
fn bindings_to_prefix(vhost: &str, dest: &Destination) -> KeyBuilder {
    let (kind, name): (&[u8], &str) = match dest {
        Destination::Queue(q) => (b"q", q),
        Destination::Exchange(x) => (b"x", x),
    };
    KeyBuilder::new(TAG_BINDING)
        .part(vhost.as_bytes())
        .part(kind)
        .part(name.as_bytes())
}

fn binding_key(
    vhost: &str,
    source: &str,
    dest: &Destination,
    key: &str,
    args: &FieldTable,
) -> Vec<u8> {
    let mut a = Vec::new();
    if put_table(&mut a, args, 0).is_err() {
        a.clear();
    }
    bindings_to_prefix(vhost, dest)
        .part(source.as_bytes())
        .part(key.as_bytes())
        .part(&a)
        .build()
}

/// Journal operations for exchanges a deletion cascaded to: each one's record and the
/// bindings leading to it (auto-delete exchanges are deleted once they have no bindings
/// of their own left, so none start from them).
fn deleted_exchange_ops(vhost: &str, deleted: &[String], ops: &mut Vec<MetaOp>) {
    for x in deleted {
        ops.push(MetaOp::delete(exchange_key(vhost, x)));
        ops.push(MetaOp::delete_prefix(
            bindings_to_prefix(vhost, &Destination::exchange(x.clone())).build(),
        ));
    }
}

fn to_json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

fn from_json<T: serde::de::DeserializeOwned>(v: &[u8]) -> Result<T, CoreError> {
    serde_json::from_slice(v).map_err(|_| CoreError::InvalidEncoding("bad stored topology record"))
}

/// Moves an earlier version's topology document of `vhost` into the journal.
fn import_legacy_doc(store: &Store, vhost: &str) -> Result<(), CoreError> {
    let Some(doc) = store.meta().get::<VhostDoc>(&doc_name(vhost))? else {
        return Ok(());
    };
    let mut ops = Vec::new();
    for x in &doc.exchanges {
        ops.push(MetaOp::put(exchange_key(vhost, &x.name), to_json(x)));
    }
    for q in &doc.queues {
        ops.push(MetaOp::put(queue_key(vhost, &q.name), to_json(q)));
    }
    for b in &doc.bindings {
        let dest = if b.to_exchange {
            Destination::exchange(b.destination.clone())
        } else {
            Destination::queue(b.destination.clone())
        };
        let args = table_from_hex(&b.arguments)?;
        ops.push(MetaOp::put(
            binding_key(vhost, &b.source, &dest, &b.key, &args),
            Vec::new(),
        ));
    }
    store.journal().commit(ops)?;
    store.meta().delete(&doc_name(vhost))?;
    tracing::info!(
        vhost,
        "moved the vhost's topology document into the metadata journal"
    );
    Ok(())
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
        let vhost_prefix = |tag: u8| KeyBuilder::new(tag).part(name.as_bytes()).build();
        {
            let mut topo = vh.topology_mut();
            for (_, v) in journal.scan(&vhost_prefix(TAG_EXCHANGE))? {
                let x: ExchangeDoc = from_json(&v)?;
                let mut def = ExchangeDef::new(x.name.clone(), x.kind.parse::<ExchangeKind>()?);
                def.durable = true;
                def.auto_delete = x.auto_delete;
                def.internal = x.internal;
                def.arguments = table_from_hex(&x.arguments)?;
                topo.declare_exchange(def)?;
            }
        }
        let mut wanted = std::collections::HashSet::new();
        for (_, v) in journal.scan(&vhost_prefix(TAG_QUEUE))? {
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
                    window,
                    clock: clock.clone(),
                },
                store.clone(),
                Arc::downgrade(&vh),
            )?;
            if let Some(p) = vh.policies.for_queue(&q.name) {
                queue.apply_policy(Some(p));
            }
            if let Some(s) = queue.stream() {
                s.load_offsets()?;
            }
            vh.queues_mut().insert(q.name.clone(), queue);
        }
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
        {
            let queues = vh.queues_read();
            let lookup = |n: &str| queues.contains_key(n);
            let mut topo = vh.topology_mut();
            let mut dropped = Vec::new();
            let mut bad = None;
            // visited in place: a copy of 1,000,000 binding keys would double the peak
            journal.visit(&vhost_prefix(TAG_BINDING), &mut |k, _| {
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
        }
        if let Some(d) = crate::delayed::Delayed::open(&store, name, false, &clock)? {
            *vh.delayed.lock().unwrap_or_else(|e| e.into_inner()) = Some(d.clone());
            crate::delayed::spawn(&vh, d);
        }
        Ok(vh)
    }

    /// Adds the binding stored under journal key `k` to `topo`. The outer error is a
    /// malformed key; the inner one a binding the topology refuses (dropped).
    fn load_binding(
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
    fn exclusive_mut(&self) -> std::sync::MutexGuard<'_, HashMap<ConnectionId, Vec<Arc<Queue>>>> {
        self.exclusive.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends `ops` to the metadata journal (call under the lock that guards the change).
    fn journal(&self, ops: Vec<MetaOp>) -> Result<Durability, CoreError> {
        if ops.is_empty() {
            return Ok(Durability::ready());
        }
        Ok(self.store.journal().append(ops)?.into())
    }

    /// Waits for a journal record (call after releasing the locks).
    fn durable(done: Durability) -> Result<(), CoreError> {
        done.wait()?;
        Ok(())
    }

    /// Whether bindings from / to this exchange are journaled.
    fn exchange_is_durable(topo: &Topology, name: &str) -> bool {
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
    fn bind(
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
    fn unbind(
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

    /// `queue.declare`; returns once the declaration is on disk.
    pub fn declare_queue(&self, d: QueueDeclare) -> Result<QueueDeclareOk, CoreError> {
        let (ok, done) = self.declare_queue_deferred(d)?;
        Self::durable(done)?;
        Ok(ok)
    }

    /// Everything journaled so far is durable once this completes: what a reply about an
    /// entity that already exists waits for (its record may still be in flight).
    fn journaled_so_far(&self) -> Durability {
        self.store.journal().durable_end().into()
    }

    /// The reply to a declare of a queue that exists: it may only go once whatever was
    /// journaled before (the queue's own record among it) is on disk.
    fn declared(&self, name: String, q: &Queue) -> (QueueDeclareOk, Durability) {
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
            let name = d.name;
            if let Some(access) = &d.access {
                access.queue_declare_passive(&name)?;
            }
            let q = self.queue_for(&name, d.conn)?;
            q.touch();
            return Ok(self.declared(name, &q));
        }
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
        // exclusive queues never outlive their connection, so they are never durable
        let durable = d.durable && !d.exclusive;
        let done = {
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
            done
        };
        Ok((
            QueueDeclareOk {
                name,
                message_count: 0,
                consumer_count: 0,
            },
            done,
        ))
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
    fn remove_queue(&self, q: &Arc<Queue>) -> u32 {
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

    /// Routes a message to its queues: names, resolved to queue objects.
    pub(crate) fn route(
        &self,
        exchange: &str,
        key: &str,
        props: &Properties,
    ) -> Result<Vec<Arc<Queue>>, CoreError> {
        let topo = self.topology_read();
        let queues = self.queues_read();
        let lookup = |n: &str| queues.contains_key(n);
        let names = topo.route_message(exchange, key, props, &lookup)?;
        // no exchange routes to the broker's own queues (see `publish_reserved`)
        Ok(names
            .iter()
            .filter(|n| !reserved::is_reserved_queue(n))
            .filter_map(|n| queues.get(n).cloned())
            .collect())
    }

    /// Publishes to the broker's own queue `p.routing_key` ([`crate::reserved`]), which
    /// no exchange routes to; `p.exchange` must be the default one.
    pub fn publish_reserved(&self, p: Publish) -> Result<Published, CoreError> {
        if !p.exchange.is_empty() || !reserved::is_reserved_queue(&p.routing_key) {
            return Err(CoreError::Internal(format!(
                "'{}' is not a reserved queue",
                p.routing_key
            )));
        }
        if p.body.len() > self.max_message_size {
            return Err(CoreError::PreconditionFailed(format!(
                "message size {} is larger than configured max size {}",
                p.body.len(),
                self.max_message_size
            )));
        }
        let q = self.queue_for(&p.routing_key, p.conn)?;
        self.publish_to(
            vec![q],
            "",
            &p.routing_key,
            p.properties,
            &p.body,
            Some(p.conn),
        )
    }

    /// The vhost's direct reply-to names.
    pub fn direct_replies(&self) -> &Arc<crate::direct_reply::Registry> {
        &self.replies
    }

    /// The vhost's per-exchange publish counters ([`crate::exchange_stats`]).
    pub fn exchange_stats(&self) -> &crate::exchange_stats::ExchangeStats {
        &self.exchange_stats
    }

    /// A publish to the default exchange with a direct reply-to name as routing key: to
    /// that channel's consumer, or nowhere (unroutable) when it is gone.
    fn publish_reply(&self, p: Publish) -> Result<Published, CoreError> {
        self.check_size(&p)?;
        let routed = self.replies.deliver(&p.routing_key, p.properties, &p.body);
        Ok(Published {
            routed,
            rejected: false,
            durable: None,
            backpressure: None,
            queues: 0,
        })
    }

    fn is_reply(p: &Publish) -> bool {
        p.exchange.is_empty() && p.routing_key.starts_with(crate::direct_reply::REPLY_PREFIX)
    }

    /// `basic.publish` (and STOMP SEND, MQTT PUBLISH).
    pub fn publish(&self, p: Publish) -> Result<Published, CoreError> {
        self.publish_keyed(p, false)
    }

    /// [`Vhost::publish`], the stored message also indexed under [`topic_key`] of this
    /// vhost and its routing key (MQTT's publishes: found by topic and time). A delayed
    /// publish is not indexed (it is routed when due).
    pub fn publish_topic_indexed(&self, p: Publish) -> Result<Published, CoreError> {
        self.publish_keyed(p, true)
    }

    fn publish_keyed(&self, p: Publish, index_topic: bool) -> Result<Published, CoreError> {
        if Self::is_reply(&p) {
            return self.publish_reply(p);
        }
        // the broker's own `$SYS` publishes are not client traffic
        if !reserved::is_reserved_topic(&p.exchange, &p.routing_key) {
            self.published.add(1);
        }
        if let Some(ms) = crate::delayed::requested_delay(p.properties.headers.as_ref())? {
            return self.publish_delayed(&p, ms);
        }
        let targets = self.check_and_route(&p)?;
        if index_topic && !targets.is_empty() {
            return with_topic_key(&self.name, &p.routing_key, |key| {
                self.publish_to_keyed(
                    targets,
                    &p.exchange,
                    &p.routing_key,
                    p.properties,
                    &p.body,
                    Some(p.conn),
                    key,
                )
            });
        }
        self.publish_to(
            targets,
            &p.exchange,
            &p.routing_key,
            p.properties,
            &p.body,
            Some(p.conn),
        )
    }

    /// A transaction's publishes (AMQP `tx.commit`, STOMP `COMMIT`), all or nothing as
    /// far as the publisher can cause it: every message is checked and routed (its delay
    /// read) before the first is stored, so one whose exchange is gone, that is too large
    /// or whose `x-delay` is bad stores none.
    pub fn publish_all(&self, batch: Vec<Publish>) -> Result<Vec<Published>, CoreError> {
        /// Where a checked message goes in phase 2.
        enum Plan {
            Reply,
            Delayed(u64),
            Now(Vec<Arc<Queue>>),
        }
        self.published.add(batch.len() as u64);
        let mut routed = Vec::with_capacity(batch.len());
        for p in batch {
            if Self::is_reply(&p) {
                self.check_size(&p)?;
                routed.push((p, Plan::Reply));
                continue;
            }
            if let Some(ms) = crate::delayed::requested_delay(p.properties.headers.as_ref())? {
                self.check_delayed(&p)?;
                routed.push((p, Plan::Delayed(ms)));
                continue;
            }
            let targets = self.check_and_route(&p)?;
            routed.push((p, Plan::Now(targets)));
        }
        routed
            .into_iter()
            .map(|(p, plan)| match plan {
                Plan::Reply => self.publish_reply(p),
                Plan::Delayed(ms) => self.store_delayed(&p, ms),
                Plan::Now(targets) => self.publish_to(
                    targets,
                    &p.exchange,
                    &p.routing_key,
                    p.properties,
                    &p.body,
                    Some(p.conn),
                ),
            })
            .collect()
    }

    /// What a delayed publish is checked for: its size, and that its exchange exists
    /// and is not internal (where it goes is decided when it is due).
    fn check_delayed(&self, p: &Publish) -> Result<(), CoreError> {
        self.check_size(p)?;
        let topo = self.topology_read();
        let x = topo
            .exchange(&p.exchange)
            .ok_or_else(|| CoreError::exchange_not_found(&p.exchange))?;
        if x.internal {
            return Err(CoreError::AccessRefused(format!(
                "cannot publish to internal exchange '{}'",
                p.exchange
            )));
        }
        Ok(())
    }

    /// A publish with `x-delay` / `x-delay-level` ([`crate::delayed`]): stored in the
    /// delay queue now (its exchange must exist), routed when it is due.
    fn publish_delayed(&self, p: &Publish, delay_ms: u64) -> Result<Published, CoreError> {
        self.check_delayed(p)?;
        self.store_delayed(p, delay_ms)
    }

    /// Stores a checked delayed publish ([`Vhost::check_delayed`]) in the delay queue.
    fn store_delayed(&self, p: &Publish, delay_ms: u64) -> Result<Published, CoreError> {
        let d = {
            let mut slot = self.delayed.lock().unwrap_or_else(|e| e.into_inner());
            match &*slot {
                Some(d) => d.clone(),
                None => {
                    let d =
                        crate::delayed::Delayed::open(&self.store, &self.name, true, &self.clock)?
                            .ok_or_else(|| CoreError::Internal("no delay queue".into()))?;
                    *slot = Some(d.clone());
                    if let Some(me) = self.me.upgrade() {
                        crate::delayed::spawn(&me, d.clone());
                    }
                    d
                }
            }
        };
        let appended = d.store(
            &self.store,
            &p.exchange,
            &p.routing_key,
            &p.properties,
            &p.body,
            delay_ms,
        )?;
        Ok(Published {
            // where it goes is decided when it is due
            routed: true,
            rejected: false,
            durable: Some(appended.durable.into()),
            backpressure: None,
            queues: 0,
        })
    }

    /// Routes delayed messages that are due (queue offsets in `d`'s queue) through
    /// their exchanges, then acks them in the delay queue. A routed message's `x-delay`
    /// is the negative of its delay, as the delayed-message plugin sets it, so a consumer
    /// that republishes it with the same headers does not delay it again. Returns the
    /// offsets not routed (routing one failed: it and the ones after it), for the
    /// scheduler to try again.
    pub(crate) fn fire_delayed(&self, d: &crate::delayed::Delayed, due: &[u64]) -> Vec<u64> {
        let qid = d.queue_id();
        let mut done = 0;
        for off in due {
            let Some(e) = self.store.entry(qid, *off) else {
                done += 1;
                continue;
            };
            let rec = match self.store.read_entry(qid, *off, e.commit_offset) {
                Ok(r) => r,
                Err(err) => {
                    tracing::warn!(vhost = %self.name, error = %err, "dropping an unreadable delayed message");
                    done += 1;
                    continue;
                }
            };
            let Ok((exchange, routing_key, mut props)) = envelope::decode(&rec.properties) else {
                tracing::warn!(vhost = %self.name, "dropping a delayed message with undecodable properties");
                done += 1;
                continue;
            };
            crate::delayed::mark_fired(&mut props);
            let targets = match self.route(&exchange, &routing_key, &props) {
                Ok(t) => t,
                Err(err) => {
                    tracing::debug!(vhost = %self.name, exchange, error = %err, "delayed message's exchange is gone; dropped");
                    done += 1;
                    continue;
                }
            };
            // connection 0: the broker (not a dead-lettering, which `None` would mean)
            if let Err(err) =
                self.publish_to(targets, &exchange, &routing_key, props, &rec.body, Some(0))
            {
                tracing::warn!(vhost = %self.name, error = %err, "routing a delayed message failed; it and the ones after it are tried again in a second");
                break;
            }
            done += 1;
        }
        let (acked, left) = due.split_at(done.min(due.len()));
        if !acked.is_empty() {
            if let Err(err) = self.store.ack(qid, acked) {
                tracing::warn!(vhost = %self.name, error = %err, "acking delayed messages failed");
            }
        }
        left.to_vec()
    }

    /// Delayed messages waiting for their time.
    pub fn delayed_pending(&self) -> u64 {
        self.delayed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map_or(0, |d| d.pending())
    }

    pub(crate) fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The broker's clock.
    pub fn clock(&self) -> &crate::Clock {
        &self.clock
    }

    pub(crate) fn check_size(&self, p: &Publish) -> Result<(), CoreError> {
        if p.body.len() > self.max_message_size {
            return Err(CoreError::PreconditionFailed(format!(
                "message size {} is larger than configured max size {}",
                p.body.len(),
                self.max_message_size
            )));
        }
        Ok(())
    }

    fn check_and_route(&self, p: &Publish) -> Result<Vec<Arc<Queue>>, CoreError> {
        self.check_size(p)?;
        self.route(&p.exchange, &p.routing_key, &p.properties)
    }

    /// That a publish to `exchange` would be routed (it exists and is not internal),
    /// without routing it: what storing a half message ([`crate::txn`]) checks.
    pub(crate) fn check_publishable(&self, exchange: &str) -> Result<(), CoreError> {
        let topo = self.topology_read();
        if topo.check_exchange(exchange)?.internal {
            return Err(CoreError::AccessRefused(format!(
                "cannot publish to internal exchange '{exchange}'"
            )));
        }
        Ok(())
    }

    /// A committed half message ([`crate::txn`]): routed as published, its copy indexed
    /// under `commit_key` too.
    pub(crate) fn publish_committed(
        &self,
        exchange: &str,
        routing_key: &str,
        props: Properties,
        body: &Bytes,
        commit_key: &[u8],
        conn: ConnectionId,
    ) -> Result<Published, CoreError> {
        self.published.add(1);
        let targets = self.route(exchange, routing_key, &props)?;
        self.publish_to_keyed(
            targets,
            exchange,
            routing_key,
            props,
            body,
            Some(conn),
            Some(commit_key),
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
        self.publish_to_keyed(targets, exchange, routing_key, props, body, publisher, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn publish_to_keyed(
        &self,
        targets: Vec<Arc<Queue>>,
        exchange: &str,
        routing_key: &str,
        props: Properties,
        body: &Bytes,
        publisher: Option<ConnectionId>,
        extra_key: Option<&[u8]>,
    ) -> Result<Published, CoreError> {
        if targets.is_empty() {
            return Ok(Published {
                routed: false,
                rejected: false,
                durable: None,
                backpressure: None,
                queues: 0,
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
                queues: 0,
            });
        }
        let persistent = props.delivery_mode == Some(2);
        let has_ttl = props.expiration.is_some();
        let tag = make_tag(body.len(), props.priority.unwrap_or(0), has_ttl, persistent)
            | crate::filter::tag_bits(&props);
        let env = envelope::encode(exchange, routing_key, &props)?;
        let ids: Vec<u32> = targets.iter().map(|q| q.store_id()).collect();
        let mut key_buf: [&[u8]; 2] = [&[], &[]];
        let mut n = 0;
        if let Some(id) = props.message_id.as_deref() {
            if !id.is_empty() && id.len() <= 1024 {
                key_buf[0] = id.as_bytes();
                n = 1;
            }
        }
        if let Some(k) = extra_key {
            if let Some(slot) = key_buf.get_mut(n) {
                *slot = k;
                n += 1;
            }
        }
        let keys: &[&[u8]] = key_buf.get(..n).unwrap_or(&[]);
        let appended = self.store.append(&NewMessage {
            queues: &ids,
            flags: if persistent { FLAG_PERSISTENT } else { 0 }
                | if publisher.is_none() {
                    FLAG_DEAD_LETTERED
                } else {
                    0
                },
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
            durable: wants_disk.then_some(appended.durable.into()),
            backpressure: (!throttled.is_empty()).then(|| Backpressure::new(throttled)),
            queues: u32::try_from(targets.len()).unwrap_or(u32::MAX),
        })
    }

    /// Republishes a message leaving `from` to its dead-letter exchange.
    pub(crate) fn dead_letter(&self, from: &Queue, rec: &StoredRecord, reason: &str) {
        let Ok((exchange, routing_key, mut props)) = envelope::decode(&rec.properties) else {
            return;
        };
        // Only an x-death the broker wrote counts (RabbitMQ 4 no longer interprets one a
        // client published): a forged one could make a message look like a cycle.
        let own_deaths = rec.flags & FLAG_DEAD_LETTERED != 0;
        let Some((dlx, key)) =
            from.dead_letter_target(reason, &exchange, &routing_key, &mut props, own_deaths)
        else {
            return;
        };
        let targets = match self.route(&dlx, &key, &props) {
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
    fn sample_rates(&self, values: crate::stats::Values) -> [f64; 8] {
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
    fn reapply_policies(&self) {
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

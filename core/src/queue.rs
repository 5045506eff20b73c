//! A queue: its ready messages, consumers, unacked deliveries, limits, TTL and
//! dead-lettering. All state sits behind one mutex whose critical sections are short
//! (no I/O but reads of the mapped store); work that touches other queues (dead-letter
//! publishes, waking other queues) runs after the lock is released.
//!
//! Messages live in the store; the queue keeps a bounded window of ready entries in
//! memory (the oldest ones, keyed by priority then queue offset) and loads more from its
//! consume queue as the window drains, so a backlog of millions costs disk, not RAM.
//! Priority ordering (`x-max-priority`) therefore applies within the window.
//!
//! The consume-queue tag of each entry carries what the queue needs without reading the
//! record: body length (bits 0-31), priority (32-39), "has a per-message TTL" (40),
//! persistent (41), the hash of its `x-tag` (42-63, see [`crate::filter`]).
//!
//! Consumers with a filter (selector or tag filter): while a queue has one, dispatch
//! walks the ready window in order and hands each entry to the best consumer with credit
//! whose filter accepts it; an entry no consumer accepts stays, for consumers to come
//! (as ActiveMQ and Artemis do). A dispatch passes over at most a window's worth of
//! entries (`queue_window`, 2048 by default): messages behind a full window of entries
//! nobody accepts are not seen until those go (ActiveMQ's `maxPageSize` has the same
//! effect). An entry that no consumer accepts is marked with the consumer set's epoch,
//! so later walks skip it without reading its record again until a consumer comes or
//! goes; an entry ruled out by its tag hash is never read at all. What a walk still
//! re-reads are entries some consumer accepts but that consumer has no credit now: at
//! most a window's worth per dispatch, never a scan of the whole queue.

mod info;
pub use info::{ConsumerInfo, QueueStats, RATE_NAMES};

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use triad_store::commitlog::StoredRecord;
use triad_store::returns::Returned;
use triad_store::store::{QueueId, Store};

use crate::error::CoreError;
use crate::message::Properties;
use crate::outbox::{CreditGate, Delivery, OutEvent, Outbox};
use crate::policy::Policy;
use crate::value::{FieldTable, FieldValue};
use crate::vhost::Vhost;
use crate::{envelope, ConnectionId};

/// Identifies a consumer within its queue.
pub type ConsumerId = u64;

const TAG_PRIORITY_SHIFT: u32 = 32;
const TAG_HAS_TTL: u64 = 1 << 40;
const TAG_PERSISTENT: u64 = 1 << 41;

/// Publisher flow control (RabbitMQ's credit flow, applied to consumer backlog): once a
/// queue with consumers holds more than this many messages (ready + unacked) beyond its
/// consumers' credit (the sum of their prefetch limits, the in-memory window for a
/// consumer without one), a publish routed to it carries
/// a [`Backpressure`](crate::outbox::Backpressure) that the adapter waits on before
/// acknowledging it or reading more from that publisher. Small on purpose: at 30k
/// deliveries/s per queue, 64 messages are 2 ms of queueing. An MQTT QoS 1 run
/// (`mqtt-qos1-64`, 4 publishers with 100 in flight each) kept its throughput with 64,
/// 128, 256 or 1,024; p99 was 5-11 ms with 64 against 11-22 ms with 128 (alternated),
/// and 19-26, 28-30 and 98-130 ms with 128, 256 and 1,024 in an earlier, busier session.
pub const FLOW_HIGH: u64 = 64;
/// The backlog (beyond the consumers' credit) at which a throttled queue lets its
/// publishers go again.
pub const FLOW_LOW: u64 = FLOW_HIGH / 2;

/// The consume-queue tag for a message.
pub(crate) fn make_tag(body_len: usize, priority: u8, has_ttl: bool, persistent: bool) -> u64 {
    (body_len.min(u32::MAX as usize) as u64)
        | ((priority as u64) << TAG_PRIORITY_SHIFT)
        | if has_ttl { TAG_HAS_TTL } else { 0 }
        | if persistent { TAG_PERSISTENT } else { 0 }
}

fn tag_len(tag: u64) -> u64 {
    tag & 0xffff_ffff
}

fn tag_priority(tag: u64) -> u8 {
    ((tag >> TAG_PRIORITY_SHIFT) & 0xff) as u8
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What happens when a queue is full.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Overflow {
    /// Drop (or dead-letter) the oldest messages.
    #[default]
    DropHead,
    /// Refuse new messages (publisher confirms nack them).
    RejectPublish,
    /// Refuse new messages and dead-letter them.
    RejectPublishDlx,
}

/// The `x-` arguments a queue understands, validated.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueueArgs {
    /// `x-message-ttl`, ms.
    pub message_ttl: Option<u64>,
    /// `x-expires`, ms.
    pub expires: Option<u64>,
    /// `x-max-length`, messages.
    pub max_length: Option<u64>,
    /// `x-max-length-bytes`, body bytes.
    pub max_length_bytes: Option<u64>,
    /// `x-overflow`.
    pub overflow: Overflow,
    /// `x-dead-letter-exchange`.
    pub dead_letter_exchange: Option<String>,
    /// `x-dead-letter-routing-key`.
    pub dead_letter_routing_key: Option<String>,
    /// `x-max-priority` (1-255).
    pub max_priority: Option<u8>,
    /// `x-single-active-consumer`: only the earliest registered consumer gets messages;
    /// when it goes, the next one takes over.
    pub single_active_consumer: bool,
    /// `x-delivery-limit`: a message returned more often than this (nacked or rejected
    /// with requeue, or left unacked by a consumer that went) is dead-lettered with
    /// reason `delivery_limit`, or dropped without a dead-letter exchange. `None`: no
    /// limit (also what `-1` declares, as in RabbitMQ 4).
    pub delivery_limit: Option<u64>,
    /// `x-retry-backoff` (e.g. `1s,5s,10s,30s,1m,2m`): a returned message waits the
    /// step for its return count (the last step from then on) before it is ready again.
    /// With it, `x-delivery-limit` defaults to [`DEFAULT_BACKOFF_LIMIT`].
    pub retry_backoff: Option<Arc<[u64]>>,
}

/// The highest `x-delivery-limit`: delivery counts stop at 65,535, so a higher limit
/// could never be passed.
pub const MAX_DELIVERY_LIMIT: u64 = u16::MAX as u64 - 1;

/// `x-delivery-limit` when `x-retry-backoff` is set and the limit is not.
pub const DEFAULT_BACKOFF_LIMIT: u64 = 16;
/// Most steps in an `x-retry-backoff`.
pub const MAX_BACKOFF_STEPS: usize = 64;

/// Parses `x-retry-backoff`: comma-separated durations (`500ms`, `1s`, `2m`, `1h`; a
/// bare number is ms), 1 to [`MAX_BACKOFF_STEPS`] of them, each at most
/// [`crate::delayed::MAX_DELAY_MS`].
pub fn parse_backoff(v: &str) -> Result<Arc<[u64]>, String> {
    let mut out = Vec::new();
    for step in v.split(',') {
        let step = step.trim();
        let (num, unit) = match step.find(|c: char| !c.is_ascii_digit()) {
            Some(i) => step.split_at(i),
            None => (step, "ms"),
        };
        let mult = match unit.trim() {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            other => return Err(format!("'{step}': unknown unit '{other}' (ms, s, m, h)")),
        };
        let ms = num
            .parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(mult))
            .filter(|ms| *ms <= crate::delayed::MAX_DELAY_MS)
            .ok_or_else(|| format!("'{step}' is not a duration up to 49 days"))?;
        out.push(ms);
        if out.len() > MAX_BACKOFF_STEPS {
            return Err(format!("more than {MAX_BACKOFF_STEPS} steps"));
        }
    }
    Ok(out.into())
}

fn non_negative(args: &FieldTable, name: &str) -> Result<Option<u64>, CoreError> {
    match args.get(name) {
        None => Ok(None),
        Some(v) => match v.as_i64() {
            Some(n) if n >= 0 => Ok(Some(n as u64)),
            _ => Err(CoreError::PreconditionFailed(format!(
                "invalid arg '{name}' for queue: {v:?} is not a non-negative integer"
            ))),
        },
    }
}

fn string_arg(args: &FieldTable, name: &str) -> Result<Option<String>, CoreError> {
    match args.get(name) {
        None => Ok(None),
        Some(v) => v.as_str().map(|s| Some(s.to_string())).ok_or_else(|| {
            CoreError::PreconditionFailed(format!("invalid arg '{name}' for queue: not a string"))
        }),
    }
}

impl QueueArgs {
    /// [`QueueArgs::parse`] for a queue read back from the metadata at start. Arguments
    /// that an earlier version accepted and ignored but declare now refuses (a
    /// non-boolean `x-single-active-consumer`) stay ignored for that queue, with a
    /// warning, so that the broker still starts. (`x-delivery-limit`, which earlier
    /// versions ignored, is now in force for such a queue.)
    pub fn parse_stored(queue: &str, args: &FieldTable) -> Result<QueueArgs, CoreError> {
        match Self::parse(args) {
            Ok(a) => Ok(a),
            Err(first) => {
                let mut t = args.clone();
                if t.get("x-single-active-consumer")
                    .is_some_and(|v| v.as_bool().is_none())
                {
                    t.remove("x-single-active-consumer");
                }
                let a = Self::parse(&t).map_err(|_| first.clone())?;
                tracing::warn!(queue, error = %first, "stored queue has an argument declare now refuses; it stays ignored for this queue");
                Ok(a)
            }
        }
    }

    /// Parses and validates a queue's arguments as RabbitMQ does (unknown `x-` arguments
    /// are kept but ignored).
    pub fn parse(args: &FieldTable) -> Result<QueueArgs, CoreError> {
        let expires = non_negative(args, "x-expires")?;
        if expires == Some(0) {
            return Err(CoreError::PreconditionFailed(
                "invalid arg 'x-expires' for queue: must be positive".into(),
            ));
        }
        let overflow = match string_arg(args, "x-overflow")?.as_deref() {
            None | Some("drop-head") => Overflow::DropHead,
            Some("reject-publish") => Overflow::RejectPublish,
            Some("reject-publish-dlx") => Overflow::RejectPublishDlx,
            Some(other) => {
                return Err(CoreError::PreconditionFailed(format!(
                    "invalid arg 'x-overflow' for queue: '{other}'"
                )))
            }
        };
        let max_priority = match non_negative(args, "x-max-priority")? {
            None => None,
            Some(n @ 1..=255) => Some(n as u8),
            Some(n) => {
                return Err(CoreError::PreconditionFailed(format!(
                    "invalid arg 'x-max-priority' for queue: {n} is not in 1..255"
                )))
            }
        };
        match string_arg(args, "x-queue-type")?.as_deref() {
            None | Some("classic") => {}
            Some("stream") => {
                crate::stream::StreamArgs::parse(args)?;
            }
            Some(other) => {
                return Err(CoreError::PreconditionFailed(format!(
                    "invalid arg 'x-queue-type' for queue: '{other}' is not supported"
                )))
            }
        }
        // RabbitMQ has it for quorum queues only (where -1 means no limit); every
        // queue keeps its messages' delivery counts here
        let delivery_limit = match args.get("x-delivery-limit") {
            None => None,
            Some(v) => match v.as_i64() {
                Some(-1) => None,
                Some(n) if n >= 0 && n as u64 <= MAX_DELIVERY_LIMIT => Some(n as u64),
                Some(n) if n >= 0 => {
                    return Err(CoreError::PreconditionFailed(format!(
                        "invalid arg 'x-delivery-limit' for queue: {n} is above {MAX_DELIVERY_LIMIT} (delivery counts stop at 65535)"
                    )))
                }
                _ => {
                    return Err(CoreError::PreconditionFailed(format!(
                        "invalid arg 'x-delivery-limit' for queue: {v:?} is not a non-negative integer (or -1 for no limit)"
                    )))
                }
            },
        };
        let single_active_consumer = match args.get("x-single-active-consumer") {
            None => false,
            Some(v) => v.as_bool().ok_or_else(|| {
                CoreError::PreconditionFailed(format!(
                    "invalid arg 'x-single-active-consumer' for queue: {v:?} is not a boolean"
                ))
            })?,
        };
        let retry_backoff = match string_arg(args, "x-retry-backoff")? {
            None => None,
            Some(v) => Some(parse_backoff(&v).map_err(|why| {
                CoreError::PreconditionFailed(format!(
                    "invalid arg 'x-retry-backoff' for queue: {why}"
                ))
            })?),
        };
        let delivery_limit = match (delivery_limit, &retry_backoff) {
            (None, Some(_)) if !args.contains("x-delivery-limit") => Some(DEFAULT_BACKOFF_LIMIT),
            (l, _) => l,
        };
        Ok(QueueArgs {
            single_active_consumer,
            delivery_limit,
            retry_backoff,
            message_ttl: non_negative(args, "x-message-ttl")?,
            expires,
            max_length: non_negative(args, "x-max-length")?,
            max_length_bytes: non_negative(args, "x-max-length-bytes")?,
            overflow,
            dead_letter_exchange: string_arg(args, "x-dead-letter-exchange")?,
            dead_letter_routing_key: string_arg(args, "x-dead-letter-routing-key")?,
            max_priority,
        })
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    commit_offset: u64,
    tag: u64,
    redelivered: bool,
    /// Times returned to the queue (the delivery count), stopping at 65,535 (hence
    /// [`MAX_DELIVERY_LIMIT`]); a u16 keeps the entry at 24 bytes.
    returns: u16,
    /// Whether the store holds a delivery count for this entry (to be forgotten when it
    /// leaves the queue).
    count_stored: bool,
    /// The filter epoch (see [`State::filter_epoch`]) in which no consumer's filter
    /// accepted this entry; 0: not judged.
    unmatched: u32,
}

struct Consumer {
    id: ConsumerId,
    conn: ConnectionId,
    /// Transient messages are acked as they are handed over (see
    /// [`ConsumerHandle::ack_transient_on_delivery`]).
    ack_transient: bool,
    tag: Arc<str>,
    no_ack: bool,
    exclusive: bool,
    prefetch: u32,
    unacked: u32,
    priority: i32,
    outbox: Arc<Outbox>,
    gate: Option<Arc<CreditGate>>,
    /// What this consumer takes (selector, tag filter); `None`: everything.
    filter: Option<Arc<crate::filter::MessageFilter>>,
}

struct Unacked {
    entry: Entry,
    consumer: ConsumerId,
    gate: Option<Arc<CreditGate>>,
}

/// A ready message taken out of the window, about to be delivered.
struct Ready {
    offset: u64,
    entry: Entry,
    body: Bytes,
    exchange: Arc<str>,
    routing_key: Arc<str>,
    properties: Arc<Properties>,
}

/// A message as it was just published, decoded once for all the queues it went to: a
/// copy dispatched while it is being enqueued is built from this (reference counts)
/// instead of a store read, a checksum and an envelope decode per queue.
#[derive(Debug, Clone)]
pub(crate) struct Hot {
    pub exchange: Arc<str>,
    pub routing_key: Arc<str>,
    pub properties: Arc<Properties>,
    pub body: Bytes,
}

/// `props` with the `x-delivery-count` header (RabbitMQ's quorum queues: absent on the
/// first delivery, the number of returns on each redelivery), replacing any a client set.
fn with_delivery_count(props: &Properties, returns: u16) -> Arc<Properties> {
    let mut p = props.clone();
    let mut h = p.headers.take().unwrap_or_default();
    h.remove("x-delivery-count");
    h.insert("x-delivery-count", FieldValue::I64(i64::from(returns)));
    p.headers = Some(h);
    Arc::new(p)
}

impl Ready {
    fn into_delivery(
        self,
        tag: Arc<str>,
        queue: Arc<Queue>,
        message_count: u32,
        needs_ack: bool,
    ) -> Delivery {
        Delivery {
            tag,
            queue,
            offset: self.offset,
            redelivered: self.entry.redelivered,
            exchange: self.exchange,
            routing_key: self.routing_key,
            properties: if self.entry.returns > 0 {
                with_delivery_count(&self.properties, self.entry.returns)
            } else {
                self.properties
            },
            body: self.body,
            message_count,
            needs_ack,
        }
    }
}

struct State {
    /// Ready entries in memory: (255 - priority, queue offset) → entry.
    ready: BTreeMap<(u8, u64), Entry>,
    /// Next consume-queue offset not yet looked at; every ready entry below it is in
    /// `ready` or `unacked`.
    loaded_upto: u64,
    /// Entries below this were in the queue when it was opened.
    recovered_next: u64,
    /// One past the highest consume-queue entry announced by `enqueue` (or found at
    /// open): `fill` loads up to here.
    cq_next: u64,
    unacked: HashMap<u64, Unacked>,
    /// Ready messages, loaded or not.
    ready_count: u64,
    /// Body bytes of the ready messages.
    ready_bytes: u64,
    consumers: Vec<Consumer>,
    /// Single active consumer: deliveries the cancelled active consumer still holds
    /// (unacked, or queued to its connection) that have not come back yet. While any
    /// is out, nothing is handed to the next consumer, so that they reach it before
    /// the messages behind them (per-key order across a failover).
    sac_handover: u32,
    /// The cancelled active consumer [`State::sac_handover`] counts for.
    sac_old: ConsumerId,
    /// How many consumers have a filter: when 0, dispatch takes the plain path.
    filtered: usize,
    /// Bumped whenever the consumer set changes (from 1): an entry marked unmatched in
    /// an older epoch is judged again.
    filter_epoch: u32,
    rr: usize,
    next_consumer: ConsumerId,
    had_consumers: bool,
    last_used: Instant,
    deleted: bool,
    /// Over [`FLOW_HIGH`] and not yet back at [`FLOW_LOW`]: publishers are asked to wait.
    throttled: bool,
    /// Sum of the consumers' prefetch limits (what they may hold unacked).
    credit: u64,
    /// Publishers waiting for the throttle to lift: made by the first one to wait, so
    /// a queue that never throttles (most MQTT session queues) does not carry it.
    flow: Option<Arc<tokio::sync::Notify>>,
    /// The settings in force (the same `Arc` as [`Queue::args`]), read here by the
    /// paths that hold this lock anyway.
    args: Arc<QueueArgs>,
    /// Delivery counts read back at open for entries not loaded into `ready` yet (see
    /// [`triad_store::returns`]), and whether the entry was put in `parked` at open
    /// (still waiting out its back-off: `fill` skips it); `None` once none are left,
    /// which is the normal case. Boxed: 8 bytes in every queue's state instead of an
    /// empty map's 48.
    #[allow(clippy::box_collection)]
    restored: Option<Box<HashMap<u64, (u16, bool)>>>,
    /// Returned messages waiting out their `x-retry-backoff` step: (ready at ms, queue
    /// offset) → entry. The ready-at time is stored with the delivery count (the same
    /// journal record, see [`triad_store::returns`]), so a restart parks them again
    /// until that time. `None` while empty; boxed: 8 bytes per queue, not 24.
    #[allow(clippy::box_collection)]
    parked: Option<Box<BTreeMap<(u64, u64), Entry>>>,
    /// Deliver / get / ack / redeliver counters.
    counts: crate::stats::Counts,
    /// The management API's last reading of the counters (made when first read).
    rate: Option<Box<crate::stats::RateSample>>,
}

/// A queue's settings in force and the policy they come from.
struct Applied {
    args: Arc<QueueArgs>,
    policy: Option<Arc<Policy>>,
}

/// Work to do once the queue's lock is released.
#[derive(Default)]
struct After {
    acks: Vec<u64>,
    dead: Vec<(u64, StoredRecord, &'static str)>,
    gates: Vec<Arc<CreditGate>>,
    cancelled_all: bool,
    /// The queue left the throttled state: wake the publishers waiting on it.
    flow_clear: bool,
    /// Returned entries whose stored delivery count (and back-off wait) is to be written.
    counted: Vec<Returned>,
    /// Entries that left the queue with a stored delivery count, to be forgotten.
    forget: Vec<u64>,
}

/// A queue. Shared as `Arc<Queue>`; deliveries carry one so consumers can ack.
pub struct Queue {
    name: String,
    vhost_name: String,
    id: QueueId,
    durable: bool,
    exclusive_owner: Option<ConnectionId>,
    auto_delete: bool,
    arguments: FieldTable,
    /// What the arguments set.
    declared: QueueArgs,
    /// The settings in force: the arguments combined with the policy that applies
    /// (see [`crate::policy`]); replaced when a policy changes.
    applied: std::sync::RwLock<Applied>,
    window: usize,
    store: Arc<Store>,
    vhost: Weak<Vhost>,
    me: Weak<Queue>,
    state: Mutex<State>,
    /// Set (for good) once the queue held a message with its own TTL or throttled its
    /// publishers, or a policy gave it a TTL or `expires`: only then, or with
    /// `x-message-ttl` / `x-expires`, does the periodic
    /// tick have work here, so the tick skips the many queues that never need it.
    tick_wanted: AtomicBool,
    /// Whether the settings in force refuse publishes when full (`x-overflow`
    /// reject-publish with a length limit): read without a lock on every publish.
    rejecting: AtomicBool,
    /// Set for a stream queue (`x-queue-type=stream`), which keeps its own state
    /// ([`crate::stream`]): the methods below hand over to it.
    stream: Option<crate::stream::Stream>,
}

fn refuses_when_full(a: &QueueArgs) -> bool {
    a.overflow != Overflow::DropHead && (a.max_length.is_some() || a.max_length_bytes.is_some())
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("vhost", &self.vhost_name)
            .field("name", &self.name)
            .finish()
    }
}

/// Creation parameters of a queue object (the store queue already exists).
pub(crate) struct QueueSpec {
    pub name: String,
    pub vhost_name: String,
    pub id: QueueId,
    pub durable: bool,
    pub exclusive_owner: Option<ConnectionId>,
    pub auto_delete: bool,
    pub arguments: FieldTable,
    pub args: QueueArgs,
    pub window: usize,
}

/// What a consumer asks for.
#[derive(Debug, Clone)]
pub struct ConsumeRequest {
    /// Consumer tag (unique per channel; the adapter generates one when empty).
    pub tag: String,
    /// Deliveries need no ack.
    pub no_ack: bool,
    /// No other consumer may use the queue meanwhile.
    pub exclusive: bool,
    /// Most unacked deliveries (0 = unlimited).
    pub prefetch: u32,
    /// Consumer priority (`x-priority`): higher gets messages first.
    pub priority: i32,
    /// The consuming connection.
    pub conn: ConnectionId,
    /// Where deliveries go.
    pub outbox: Arc<Outbox>,
    /// Channel-wide unacked limit, if any.
    pub gate: Option<Arc<CreditGate>>,
    /// Only messages this accepts (selector, tag filter); `None`: all.
    pub filter: Option<Arc<crate::filter::MessageFilter>>,
}

/// A registered consumer. Cancel it explicitly; dropping it does not.
#[derive(Debug, Clone)]
pub struct ConsumerHandle {
    queue: Arc<Queue>,
    id: ConsumerId,
    tag: Arc<str>,
}

impl ConsumerHandle {
    /// The consumer tag.
    pub fn tag(&self) -> &Arc<str> {
        &self.tag
    }
    /// The consumer's connection has gone idle ([`crate::outbox::Outbox::note_idle`]):
    /// if its queue holds nothing ready or unacked, the queue lets go of its maps'
    /// memory. A taken and acked message leaves a `BTreeMap` leaf (about 0.5 KiB) and a
    /// `HashMap` table for three more behind, which the many idle queues of a device
    /// fleet would otherwise keep.
    pub fn release_idle(&self) {
        let mut st = lock(&self.queue.state);
        if st.unacked.is_empty() && st.ready.is_empty() {
            if st.unacked.capacity() > 0 {
                st.unacked = HashMap::new();
            }
            st.ready = BTreeMap::new();
        }
    }
    /// The queue consumed from.
    pub fn queue(&self) -> &Arc<Queue> {
        &self.queue
    }
    /// Stops deliveries. Unacked deliveries stay unacked until acked or nacked.
    pub fn cancel(&self) {
        self.queue.cancel(self.id);
    }

    /// From now on, transient (non-persistent) messages are acked as they are handed to
    /// this consumer (`Delivery::needs_ack` false), persistent ones still need an ack.
    /// For MQTT, where a transient message is QoS 0 and so delivered at most once: the
    /// ack round trip per copy is saved.
    pub fn ack_transient_on_delivery(&self) {
        self.queue.set_ack_transient(self.id);
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Queue {
    pub(crate) fn new(
        spec: QueueSpec,
        store: Arc<Store>,
        vhost: Weak<Vhost>,
    ) -> Result<Arc<Queue>, CoreError> {
        // Everything pending in the store is ready: nothing is delivered yet. Transient
        // messages (delivery mode 1) do not outlive the broker, as in RabbitMQ's classic
        // queues: the ones a restart finds are dropped here. Walked in batches, so a
        // backlog of millions is not held as a vector of offsets while the broker starts.
        const BATCH: usize = 1 << 16;
        let stream = match crate::stream::spec::is_stream(&spec.arguments) {
            true => Some(crate::stream::Stream::open(
                store.clone(),
                spec.id,
                &spec.vhost_name,
                &spec.name,
                crate::stream::StreamArgs::parse(&spec.arguments)?,
            )?),
            false => None,
        };
        let (mut ready_count, mut ready_bytes, mut dropped) = (0u64, 0u64, 0usize);
        let mut from = 0;
        // a stream keeps every entry (transient ones too) and counts its own
        while stream.is_none() {
            let pending = store.unacked_from(spec.id, from, BATCH)?;
            let Some(&last) = pending.last() else {
                break;
            };
            let mut transient = Vec::new();
            for off in &pending {
                if let Some(e) = store.entry(spec.id, *off) {
                    if e.tag_hash & TAG_PERSISTENT == 0 {
                        transient.push(*off);
                    } else {
                        ready_bytes += tag_len(e.tag_hash);
                    }
                }
            }
            ready_count += (pending.len() - transient.len()) as u64;
            if !transient.is_empty() {
                dropped += transient.len();
                drop(store.ack(spec.id, &transient)?);
            }
            if pending.len() < BATCH {
                break;
            }
            from = last + 1;
        }
        if dropped > 0 {
            tracing::debug!(queue = %spec.name, dropped, "dropping transient messages after a restart");
        }
        let head = store.queue_info(spec.id)?.ack_head;
        let next = store.queue_next_offset(spec.id)?;
        // delivery counts of returned messages; those of entries acked since (the ack
        // and the count's removal are separate writes) are forgotten now
        let mut restored = HashMap::new();
        let mut stale = Vec::new();
        // those still waiting out a back-off step are parked again until its end
        let mut parked = BTreeMap::new();
        let now = now_ms();
        for r in store.take_returns(spec.id) {
            let off = r.offset;
            if off < next && !store.is_acked(spec.id, off).unwrap_or(true) {
                let returns = u16::try_from(r.count).unwrap_or(u16::MAX);
                let waiting = match store.entry(spec.id, off) {
                    Some(e) if r.ready_at_ms > now && e.tag_hash & TAG_PERSISTENT != 0 => {
                        parked.insert(
                            (r.ready_at_ms, off),
                            Entry {
                                commit_offset: e.commit_offset,
                                tag: e.tag_hash,
                                redelivered: true,
                                returns,
                                count_stored: true,
                                unmatched: 0,
                            },
                        );
                        ready_count = ready_count.saturating_sub(1);
                        ready_bytes = ready_bytes.saturating_sub(tag_len(e.tag_hash));
                        true
                    }
                    _ => false,
                };
                restored.insert(off, (returns, waiting));
            } else {
                stale.push(off);
            }
        }
        if !stale.is_empty() {
            drop(store.drop_delivery_counts(spec.id, &stale)?);
        }
        let state = State {
            ready: BTreeMap::new(),
            loaded_upto: head,
            recovered_next: next,
            cq_next: next,
            unacked: HashMap::new(),
            ready_count,
            ready_bytes,
            consumers: Vec::new(),
            sac_handover: 0,
            sac_old: 0,
            filtered: 0,
            filter_epoch: 1,
            rr: 0,
            next_consumer: 1,
            had_consumers: false,
            last_used: Instant::now(),
            deleted: false,
            throttled: false,
            credit: 0,
            flow: None,
            counts: Default::default(),
            rate: None,
            restored: (!restored.is_empty()).then(|| Box::new(restored)),
            parked: (!parked.is_empty()).then(|| Box::new(parked)),
            args: Arc::new(spec.args.clone()),
        };
        Ok(Arc::new_cyclic(|me| Queue {
            name: spec.name,
            vhost_name: spec.vhost_name,
            id: spec.id,
            durable: spec.durable,
            exclusive_owner: spec.exclusive_owner,
            auto_delete: spec.auto_delete,
            rejecting: AtomicBool::new(refuses_when_full(&spec.args)),
            applied: std::sync::RwLock::new(Applied {
                args: state.args.clone(),
                policy: None,
            }),
            arguments: spec.arguments,
            declared: spec.args,
            window: spec.window.max(16),
            store,
            vhost,
            me: me.clone(),
            tick_wanted: AtomicBool::new(state.parked.is_some()),
            state: Mutex::new(state),
            stream,
        }))
    }

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The vhost's name.
    pub fn vhost_name(&self) -> &str {
        &self.vhost_name
    }
    /// Whether it survives a restart.
    pub fn durable(&self) -> bool {
        self.durable
    }
    /// The connection that owns it, for exclusive queues.
    pub fn exclusive_owner(&self) -> Option<ConnectionId> {
        self.exclusive_owner
    }
    /// Deleted when its last consumer goes.
    pub fn auto_delete(&self) -> bool {
        self.auto_delete
    }
    /// Declared arguments.
    pub fn arguments(&self) -> &FieldTable {
        &self.arguments
    }
    /// The settings in force (arguments and policy).
    pub fn args(&self) -> Arc<QueueArgs> {
        self.applied
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .args
            .clone()
    }
    /// What the declared arguments set.
    pub fn declared_args(&self) -> &QueueArgs {
        &self.declared
    }
    /// The policy that applies, if any.
    pub fn policy(&self) -> Option<Arc<Policy>> {
        self.applied
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .policy
            .clone()
    }

    /// Applies `policy` (or none): the settings become the arguments combined with it,
    /// and a lowered length limit or TTL takes effect now, as in RabbitMQ.
    pub(crate) fn apply_policy(&self, policy: Option<Arc<Policy>>) {
        // no policy applies to a stream: `queues` and `classic_queues` policies do not
        // match it (RabbitMQ's classic_queues does not), and none of the keys Triad
        // implements means anything to a stream (its retention is its arguments)
        if self.stream.is_some() {
            return;
        }
        let args = match &policy {
            Some(p) => p.definition.effective(&self.declared, &self.arguments),
            None => self.declared.clone(),
        };
        let ttl = args.message_ttl.is_some();
        if ttl || args.expires.is_some() {
            self.tick_wanted.store(true, Ordering::Relaxed);
        }
        let args = Arc::new(args);
        let mut after = After::default();
        {
            let mut st = lock(&self.state);
            *self.applied.write().unwrap_or_else(|e| e.into_inner()) = Applied {
                args: args.clone(),
                policy,
            };
            self.rejecting
                .store(refuses_when_full(&args), Ordering::Relaxed);
            st.args = args;
            if st.deleted {
                return;
            }
            if ttl {
                self.expire_head(&mut st, &mut after);
            }
            self.enforce_limits(&mut st, &mut after);
        }
        self.finish(after);
    }
    pub(crate) fn store_id(&self) -> QueueId {
        self.id
    }

    /// The stream state of a stream queue (`x-queue-type=stream`).
    pub fn stream(&self) -> Option<&crate::stream::Stream> {
        self.stream.as_ref()
    }

    /// Whether this is a stream queue.
    pub fn is_stream(&self) -> bool {
        self.stream.is_some()
    }

    /// Ready messages (not delivered and unacked). Messages past their TTL at the head
    /// are expired first, as RabbitMQ does, rather than counted until the next tick.
    /// For a stream: the entries it retains.
    pub fn message_count(&self) -> u32 {
        if let Some(s) = &self.stream {
            return s.message_count();
        }
        let mut after = After::default();
        let count = {
            let mut st = lock(&self.state);
            if !st.deleted && (st.args.message_ttl.is_some() || self.has_message_ttls(&st)) {
                self.expire_head(&mut st, &mut after);
            }
            u32::try_from(st.ready_count).unwrap_or(u32::MAX)
        };
        self.finish(after);
        count
    }

    /// Active consumers.
    pub fn consumer_count(&self) -> u32 {
        if let Some(s) = &self.stream {
            return s.consumer_count();
        }
        lock(&self.state).consumers.len() as u32
    }

    /// Delivered but not yet acked.
    pub fn unacked_count(&self) -> u32 {
        if let Some(s) = &self.stream {
            return s.unacked_count();
        }
        lock(&self.state).unacked.len() as u32
    }

    pub(crate) fn touch(&self) {
        lock(&self.state).last_used = Instant::now();
    }

    /// Whether a new message of `body_len` bytes would be refused (`x-overflow`
    /// reject-publish with the queue at its limit).
    pub(crate) fn rejects(&self, body_len: usize) -> bool {
        if !self.rejecting.load(Ordering::Relaxed) {
            return false;
        }
        let st = lock(&self.state);
        let args = &st.args;
        args.overflow != Overflow::DropHead
            && (args.max_length.is_some_and(|m| st.ready_count >= m)
                || args
                    .max_length_bytes
                    .is_some_and(|m| st.ready_bytes + body_len as u64 > m))
    }

    fn me(&self) -> Option<Arc<Queue>> {
        self.me.upgrade()
    }

    /// Loads ready entries from the consume queue into the window.
    fn fill(&self, st: &mut State) {
        if st.ready.len() >= self.window / 2 {
            return;
        }
        // every append reaches `enqueue` (which raises `cq_next`) after it is in the
        // consume queue, so this bound saves a store lookup per dispatch
        let next = st.cq_next;
        while st.ready.len() < self.window && st.loaded_upto < next {
            let off = st.loaded_upto;
            st.loaded_upto += 1;
            if st.unacked.contains_key(&off) || self.store.is_acked(self.id, off).unwrap_or(true) {
                continue;
            }
            let Some(e) = self.store.entry(self.id, off) else {
                continue;
            };
            let redelivered = off < st.recovered_next
                && self
                    .store
                    .may_have_been_delivered(self.id, off)
                    .unwrap_or(false);
            let (returns, parked_at_open) = match st.restored.as_mut() {
                Some(r) => {
                    let n = r.remove(&off).unwrap_or((0, false));
                    if r.is_empty() {
                        st.restored = None;
                    }
                    n
                }
                None => (0, false),
            };
            if parked_at_open {
                // it has been in `parked` (and maybe since in `ready` or unacked) from
                // the start
                continue;
            }
            self.note_tag(e.tag_hash);
            st.ready.insert(
                (255 - self.priority_of(e.tag_hash), off),
                Entry {
                    commit_offset: e.commit_offset,
                    tag: e.tag_hash,
                    redelivered: redelivered || returns > 0,
                    returns,
                    // restored counts come from the store
                    count_stored: returns > 0,
                    unmatched: 0,
                },
            );
        }
    }

    /// Whether `e`'s delivery count is to be written to the store: a returned persistent
    /// message of a durable queue (transient ones do not outlive the broker anyway)
    /// whose count matters, that is, with a delivery limit or a retry back-off. Without
    /// them the count only feeds the informational `x-delivery-count` header and stays
    /// in memory (it does not survive a restart).
    fn store_count(&self, args: &QueueArgs, e: &Entry) -> bool {
        e.returns > 0
            && self.durable
            && e.tag & TAG_PERSISTENT != 0
            && (args.delivery_limit.is_some() || args.retry_backoff.is_some())
    }

    /// Entry `off` leaves the queue for good (acked): its count goes with it.
    fn gone(&self, off: u64, e: &Entry, after: &mut After) {
        after.acks.push(off);
        if e.count_stored {
            after.forget.push(off);
        }
    }

    fn priority_of(&self, tag: u64) -> u8 {
        match self.declared.max_priority {
            Some(max) => tag_priority(tag).min(max),
            None => 0,
        }
    }

    /// A message was appended for this queue at `offset` by `publisher` (`None`: by the
    /// broker itself, e.g. dead-lettering). Returns whether the publisher should wait
    /// for [`Queue::wait_flow`] (the queue is throttled, see [`FLOW_HIGH`]).
    ///
    /// A queue throttles only while it has consumers (a queue nobody consumes from is
    /// bounded by its length limits and the broker's alarms instead; blocking on it would
    /// stop publishers for good), and never a publisher that consumes from it itself (it
    /// has to keep reading its socket for the acks that drain the queue).
    pub(crate) fn enqueue(
        &self,
        offset: u64,
        commit_offset: u64,
        tag: u64,
        publisher: Option<ConnectionId>,
        hot: Option<&Hot>,
    ) -> bool {
        if let Some(s) = &self.stream {
            if let Some(me) = self.me() {
                s.enqueue(&me, offset, tag, hot);
            }
            return false;
        }
        let mut after = After::default();
        let wait;
        {
            let mut st = lock(&self.state);
            if st.deleted {
                return false;
            }
            st.ready_count += 1;
            st.ready_bytes += tag_len(tag);
            st.cq_next = st.cq_next.max(offset + 1);
            if st.loaded_upto == offset && st.ready.len() < self.window {
                st.loaded_upto += 1;
                self.note_tag(tag);
                st.ready.insert(
                    (255 - self.priority_of(tag), offset),
                    Entry {
                        commit_offset,
                        tag,
                        redelivered: false,
                        returns: 0,
                        count_stored: false,
                        unmatched: 0,
                    },
                );
            }
            self.enforce_limits(&mut st, &mut after);
            self.dispatch_hot(&mut st, &mut after, hot.map(|h| (offset, h)));
            self.flow_check(&mut st, &mut after);
            if !st.throttled
                && st.ready_count + st.unacked.len() as u64 > FLOW_HIGH + st.credit
                && !st.consumers.is_empty()
            {
                st.throttled = true;
                self.tick_wanted.store(true, Ordering::Relaxed);
            }
            wait =
                st.throttled && publisher.is_some_and(|p| st.consumers.iter().all(|c| c.conn != p));
        }
        self.finish(after);
        wait
    }

    /// Leaves the throttled state once the backlog is at [`FLOW_LOW`] or the queue has
    /// no consumers (or is deleted).
    fn flow_check(&self, st: &mut State, after: &mut After) {
        if st.throttled
            && (st.deleted
                || st.consumers.is_empty()
                || st.ready_count + st.unacked.len() as u64 <= FLOW_LOW + st.credit)
        {
            st.throttled = false;
            after.flow_clear = st.flow.is_some();
        }
    }

    /// What a consumer may hold unacked, for flow control: its prefetch, or the
    /// in-memory window when it has no limit (it acks in its own time, e.g. in batches).
    fn credit_of(&self, prefetch: u32) -> u64 {
        if prefetch == 0 {
            self.window as u64
        } else {
            u64::from(prefetch)
        }
    }

    /// Whether publishers may go on (the queue is not throttled).
    pub(crate) fn flow_clear(&self) -> bool {
        !lock(&self.state).throttled
    }

    fn wake_flow(&self) {
        let flow = lock(&self.state).flow.clone();
        if let Some(n) = flow {
            n.notify_waiters();
        }
    }

    /// Completes once the queue no longer throttles its publishers (cancel-safe).
    pub(crate) async fn wait_flow(&self) {
        let flow = lock(&self.state)
            .flow
            .get_or_insert_with(|| Arc::new(tokio::sync::Notify::new()))
            .clone();
        loop {
            let mut n = std::pin::pin!(flow.notified());
            n.as_mut().enable();
            if self.flow_clear() {
                return;
            }
            n.await;
        }
    }

    /// Takes the oldest ready entry out (for drop-head, purge-like removal).
    fn pop_oldest(&self, st: &mut State) -> Option<(u64, Entry)> {
        self.fill(st);
        // the oldest is the lowest offset, whatever its priority
        let key = *st.ready.keys().min_by_key(|(_, off)| *off)?;
        let e = st.ready.remove(&key)?;
        st.ready_count = st.ready_count.saturating_sub(1);
        st.ready_bytes = st.ready_bytes.saturating_sub(tag_len(e.tag));
        Some((key.1, e))
    }

    fn enforce_limits(&self, st: &mut State, after: &mut After) {
        if st.args.overflow != Overflow::DropHead {
            return;
        }
        let (max_length, max_bytes) = (st.args.max_length, st.args.max_length_bytes);
        loop {
            let over = max_length.is_some_and(|m| st.ready_count > m)
                || max_bytes.is_some_and(|m| st.ready_bytes > m);
            if !over {
                return;
            }
            let Some((off, e)) = self.pop_oldest(st) else {
                return;
            };
            self.drop_entry(off, e, "maxlen", after);
        }
    }

    /// A ready entry leaves the queue without a consumer: dead-letter it if configured.
    fn drop_entry(&self, off: u64, e: Entry, reason: &'static str, after: &mut After) {
        if e.count_stored {
            after.forget.push(off);
        }
        if self.args().dead_letter_exchange.is_some() {
            if let Ok(rec) = self.store.read_entry(self.id, off, e.commit_offset) {
                after.dead.push((off, rec, reason));
                return;
            }
        }
        after.acks.push(off);
    }

    fn expiry(
        &self,
        queue_ttl: Option<u64>,
        tag: u64,
        rec: &StoredRecord,
        props: &Properties,
    ) -> Option<u64> {
        let msg_ttl = if tag & TAG_HAS_TTL != 0 {
            props
                .expiration
                .as_deref()
                .and_then(|s| s.parse::<u64>().ok())
        } else {
            None
        };
        let ttl = match (queue_ttl, msg_ttl) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }?;
        Some(rec.store_ts_ms.saturating_add(ttl))
    }

    fn pick_consumer(&self, st: &State) -> Option<usize> {
        self.pick_consumer_where(st, |_, _| true)
    }

    /// [`Queue::pick_consumer`] among the consumers `accept` takes (given their index in
    /// `st.consumers`).
    fn pick_consumer_where(
        &self,
        st: &State,
        accept: impl Fn(usize, &Consumer) -> bool,
    ) -> Option<usize> {
        // single active consumer: the earliest registered one only (consumers are kept
        // in registration order), whatever the others' priorities
        let n = if self.declared.single_active_consumer {
            st.consumers.len().min(1)
        } else {
            st.consumers.len()
        };
        let me = self.me();
        let mut best: Option<(i32, usize)> = None;
        for k in 0..n {
            let i = if n == 1 { 0 } else { (st.rr + k) % n };
            let Some(c) = st.consumers.get(i) else {
                continue;
            };
            if c.prefetch != 0 && c.unacked >= c.prefetch {
                continue;
            }
            if best.is_some_and(|(p, _)| p >= c.priority) || !accept(i, c) {
                continue;
            }
            if let Some(g) = &c.gate {
                if !g.has_room() {
                    if let Some(me) = &me {
                        g.wait_for_room(me);
                    }
                    continue;
                }
            }
            if !c.outbox.has_room() {
                if let Some(me) = &me {
                    c.outbox.wait_for_room(me);
                }
                continue;
            }
            best = Some((c.priority, i));
        }
        best.map(|(_, i)| i)
    }

    /// Hands ready messages to consumers with credit, round robin within the highest
    /// consumer priority.
    fn dispatch(&self, st: &mut State, after: &mut After) {
        self.dispatch_hot(st, after, None);
    }

    /// [`Queue::dispatch`], with the message at queue offset `hot.0` already decoded.
    fn dispatch_hot(&self, st: &mut State, after: &mut After, hot: Option<(u64, &Hot)>) {
        if st.sac_handover > 0 {
            return;
        }
        if st.filtered > 0 {
            return self.dispatch_filtered(st, after, hot);
        }
        let Some(me) = self.me() else {
            return;
        };
        loop {
            if st.consumers.is_empty() {
                return;
            }
            self.fill(st);
            if st.ready.is_empty() {
                return;
            }
            let Some(ci) = self.pick_consumer(st) else {
                return;
            };
            let Some(m) = self.take_next(st, after, hot) else {
                continue;
            };
            if !self.hand_over(st, after, ci, m, &me) {
                return;
            }
        }
    }

    /// Delivers `m` (already out of the window) to consumer `ci`; `false` when its
    /// outbox filled up meanwhile (`m` is back in the window).
    fn hand_over(
        &self,
        st: &mut State,
        after: &mut After,
        ci: usize,
        m: Ready,
        me: &Arc<Queue>,
    ) -> bool {
        let (key, e) = ((255 - self.priority_of(m.entry.tag), m.offset), m.entry);
        let off = m.offset;
        {
            let Some(c) = st.consumers.get_mut(ci) else {
                return false;
            };
            let no_ack = c.no_ack || (c.ack_transient && e.tag & TAG_PERSISTENT == 0);
            let delivery = m.into_delivery(c.tag.clone(), me.clone(), 0, !no_ack);
            if !c.outbox.push(OutEvent::Deliver(delivery)) {
                // filled up since pick_consumer looked: put it back, wait for room
                c.outbox.wait_for_room(me);
                self.note_tag(e.tag);
                st.ready.insert(key, e);
                st.ready_count += 1;
                st.ready_bytes += tag_len(e.tag);
                return false;
            }
            if no_ack {
                st.counts.deliver_no_ack += 1;
            } else {
                st.counts.deliver += 1;
            }
            st.counts.redeliver += u64::from(e.redelivered);
            let _ = self.store.mark_delivered(self.id, off);
            if no_ack {
                self.gone(off, &e, after);
            } else {
                c.unacked += 1;
                if let Some(g) = &c.gate {
                    g.take();
                }
                let (consumer, gate) = (c.id, c.gate.clone());
                st.unacked.insert(
                    off,
                    Unacked {
                        entry: e,
                        consumer,
                        gate,
                    },
                );
            }
            st.rr = ci + 1;
        }
        true
    }

    /// [`Queue::dispatch_hot`] while some consumer has a filter: walks the window in
    /// order (passing over at most a window of entries) and hands each entry to the best
    /// consumer with credit that accepts it; entries nobody accepts stay (see the
    /// module's notes). An entry's record is read only when a consumer with credit may
    /// take it by its tag.
    fn dispatch_filtered(&self, st: &mut State, after: &mut After, hot: Option<(u64, &Hot)>) {
        use std::ops::Bound::{Excluded, Unbounded};
        let Some(me) = self.me() else {
            return;
        };
        self.fill(st);
        let epoch = st.filter_epoch;
        // single active consumer: only the active one's filter counts
        let judged = if self.declared.single_active_consumer {
            1
        } else {
            usize::MAX
        };
        // credit changes only with a delivery (checked again after each)
        if st.consumers.is_empty() || self.pick_consumer(st).is_none() {
            return;
        }
        let mut cursor: Option<(u8, u64)> = None;
        let mut walked = 0usize;
        while walked < self.window {
            let next = match cursor {
                None => st.ready.iter().next(),
                Some(k) => st.ready.range((Excluded(k), Unbounded)).next(),
            };
            let Some((&key, &e)) = next else {
                return;
            };
            cursor = Some(key);
            walked += 1;
            if e.unmatched == epoch {
                continue;
            }
            let off = key.1;
            let may = |c: &Consumer| c.filter.as_ref().is_none_or(|f| f.may_match(e.tag));
            if !st.consumers.iter().take(judged).any(may) {
                // the tag hash alone rules it out for everyone: no record read
                if let Some(x) = st.ready.get_mut(&key) {
                    x.unmatched = epoch;
                }
                continue;
            }
            if self.pick_consumer_where(st, |_, c| may(c)).is_none() {
                // those that may take it have no credit now: it waits, unread
                continue;
            }
            let Some(m) = self.ready_message(st, off, e, hot, after) else {
                // unreadable (acked by `load`) or expired (dropped): it leaves the queue
                st.ready.remove(&key);
                st.ready_count = st.ready_count.saturating_sub(1);
                st.ready_bytes = st.ready_bytes.saturating_sub(tag_len(e.tag));
                continue;
            };
            // each consumer's filter judged once
            let accepted: Vec<bool> = st
                .consumers
                .iter()
                .take(judged)
                .map(|c| {
                    c.filter
                        .as_ref()
                        .is_none_or(|f| f.may_match(e.tag) && f.matches(&m.properties))
                })
                .collect();
            if !accepted.contains(&true) {
                if let Some(x) = st.ready.get_mut(&key) {
                    x.unmatched = epoch;
                }
                continue;
            }
            let Some(ci) =
                self.pick_consumer_where(st, |i, _| accepted.get(i).copied().unwrap_or(false))
            else {
                // those that take it have no credit now: it waits for them
                continue;
            };
            st.ready.remove(&key);
            st.ready_count = st.ready_count.saturating_sub(1);
            st.ready_bytes = st.ready_bytes.saturating_sub(tag_len(e.tag));
            if !self.hand_over(st, after, ci, m, &me) {
                return;
            }
            if st.consumers.is_empty() || self.pick_consumer(st).is_none() {
                return;
            }
            // the bound is on entries passed over; a delivery is progress
            walked -= 1;
            self.fill(st);
        }
    }

    /// Takes the next ready message out of the window, loaded and not expired (expired
    /// and unreadable ones on the way are dropped or dead-lettered). `None`: empty.
    fn take_next(
        &self,
        st: &mut State,
        after: &mut After,
        hot: Option<(u64, &Hot)>,
    ) -> Option<Ready> {
        loop {
            self.fill(st);
            let (key, e) = st.ready.pop_first()?;
            st.ready_count = st.ready_count.saturating_sub(1);
            st.ready_bytes = st.ready_bytes.saturating_sub(tag_len(e.tag));
            if let Some(m) = self.ready_message(st, key.1, e, hot, after) {
                return Some(m);
            }
        }
    }

    /// Ready entry `e` (queue offset `off`) as a message to deliver: from `hot` when it
    /// was just published (no need to read it back; TTL checks need the record), else
    /// read from the store. `None`: it leaves the queue, unreadable (acked by
    /// [`Queue::load`]) or expired (dropped or dead-lettered here); the caller takes it
    /// out of the window.
    fn ready_message(
        &self,
        st: &State,
        off: u64,
        e: Entry,
        hot: Option<(u64, &Hot)>,
        after: &mut After,
    ) -> Option<Ready> {
        if let Some((_, h)) = hot.filter(|(o, _)| *o == off) {
            if e.tag & TAG_HAS_TTL == 0 && st.args.message_ttl.is_none() {
                return Some(Ready {
                    offset: off,
                    entry: e,
                    body: h.body.clone(),
                    exchange: h.exchange.clone(),
                    routing_key: h.routing_key.clone(),
                    properties: h.properties.clone(),
                });
            }
        }
        let (rec, exchange, routing_key, properties) = self.load(off, &e, after)?;
        if self
            .expiry(st.args.message_ttl, e.tag, &rec, &properties)
            .is_some_and(|t| t <= now_ms())
        {
            self.drop_entry(off, e, "expired", after);
            return None;
        }
        Some(Ready {
            offset: off,
            entry: e,
            body: rec.body,
            exchange,
            routing_key,
            properties: Arc::new(properties),
        })
    }

    /// Reads and decodes an entry's record; an unreadable one is dropped (acked) with a
    /// warning rather than wedging the queue.
    fn load(
        &self,
        off: u64,
        e: &Entry,
        after: &mut After,
    ) -> Option<(StoredRecord, Arc<str>, Arc<str>, Properties)> {
        let rec = match self.store.read_entry(self.id, off, e.commit_offset) {
            Ok(r) => r,
            Err(err) => {
                tracing::warn!(queue = %self.name, offset = off, error = %err, "dropping an unreadable message");
                self.gone(off, e, after);
                return None;
            }
        };
        match envelope::decode_shared(&rec.properties) {
            Ok((x, rk, p)) => Some((rec, x, rk, p)),
            Err(err) => {
                tracing::warn!(queue = %self.name, offset = off, error = %err, "dropping a message with undecodable properties");
                self.gone(off, e, after);
                None
            }
        }
    }

    /// Runs after the lock is released: store acks, dead-letter publishes, wake-ups.
    fn finish(&self, after: After) {
        let After {
            mut acks,
            dead,
            gates,
            cancelled_all,
            flow_clear,
            counted,
            forget,
        } = after;
        if !counted.is_empty() {
            if let Err(e) = self.store.put_returns(self.id, &counted) {
                tracing::warn!(queue = %self.name, error = %e, "storing delivery counts failed");
            }
        }
        if !forget.is_empty() {
            if let Err(e) = self.store.drop_delivery_counts(self.id, &forget) {
                tracing::warn!(queue = %self.name, error = %e, "dropping delivery counts failed");
            }
        }
        if flow_clear {
            self.wake_flow();
        }
        if !dead.is_empty() {
            if let Some(vh) = self.vhost.upgrade() {
                for (off, rec, reason) in dead {
                    vh.dead_letter(self, &rec, reason);
                    acks.push(off);
                }
            } else {
                acks.extend(dead.iter().map(|d| d.0));
            }
        }
        if !acks.is_empty() {
            if let Err(e) = self.store.ack(self.id, &acks) {
                tracing::warn!(queue = %self.name, error = %e, "store ack failed");
            }
        }
        for g in gates {
            g.wake();
        }
        if cancelled_all && self.auto_delete {
            if let Some(vh) = self.vhost.upgrade() {
                vh.auto_delete_queue(self);
            }
        }
    }

    /// Resumes deliveries after an outbox or credit gate had no room.
    pub(crate) fn kick(&self) {
        if let (Some(s), Some(me)) = (&self.stream, self.me()) {
            return s.kick(&me);
        }
        let mut after = After::default();
        {
            let mut st = lock(&self.state);
            if st.deleted {
                return;
            }
            self.dispatch(&mut st, &mut after);
            self.flow_check(&mut st, &mut after);
        }
        self.finish(after);
    }

    pub(crate) fn consume(&self, req: ConsumeRequest) -> Result<ConsumerHandle, CoreError> {
        self.consume_with(req, crate::stream::StreamConsume::default())
    }

    /// [`Queue::consume`] with a stream consumer's start position and name, which only a
    /// stream queue accepts.
    pub(crate) fn consume_with(
        &self,
        req: ConsumeRequest,
        opts: crate::stream::StreamConsume,
    ) -> Result<ConsumerHandle, CoreError> {
        let me = self
            .me()
            .ok_or_else(|| CoreError::queue_not_found(&self.name))?;
        if let Some(s) = &self.stream {
            if req.filter.is_some() {
                return Err(CoreError::NotImplemented(format!(
                    "selectors and tag filters on stream queue '{}' (only on classic queues)",
                    self.name
                )));
            }
            let (id, tag) = s.consume(&me, req, opts)?;
            return Ok(ConsumerHandle { queue: me, id, tag });
        }
        if !opts.is_empty() {
            let arg = if opts.offset.is_some() {
                "x-stream-offset"
            } else {
                "x-stream-consumer-name"
            };
            return Err(CoreError::PreconditionFailed(format!(
                "invalid arg '{arg}' for queue '{}' in vhost '{}' of queue type classic (it is for stream queues)",
                self.name, self.vhost_name
            )));
        }
        let mut after = After::default();
        let handle;
        {
            let mut st = lock(&self.state);
            if st.deleted {
                return Err(CoreError::queue_not_found(&self.name));
            }
            if st.consumers.iter().any(|c| c.exclusive)
                || (req.exclusive && !st.consumers.is_empty())
            {
                return Err(CoreError::AccessRefused(format!(
                    "queue '{}' in vhost '{}' in exclusive use",
                    self.name, self.vhost_name
                )));
            }
            let id = st.next_consumer;
            st.next_consumer += 1;
            let tag: Arc<str> = Arc::from(req.tag.as_str());
            if !self.declared.single_active_consumer || st.consumers.is_empty() {
                st.credit += self.credit_of(req.prefetch);
            }
            // most queues have one consumer: room for exactly one, not Vec's first four
            st.consumers.reserve_exact(1);
            st.consumers.push(Consumer {
                id,
                conn: req.conn,
                ack_transient: false,
                tag: tag.clone(),
                no_ack: req.no_ack,
                exclusive: req.exclusive,
                prefetch: req.prefetch,
                unacked: 0,
                priority: req.priority,
                outbox: req.outbox,
                gate: req.gate,
                filter: req.filter.clone(),
            });
            st.filtered += usize::from(req.filter.is_some());
            st.filter_epoch = st.filter_epoch.wrapping_add(1).max(1);
            st.had_consumers = true;
            st.last_used = Instant::now();
            handle = ConsumerHandle { queue: me, id, tag };
            self.dispatch(&mut st, &mut after);
            self.flow_check(&mut st, &mut after);
        }
        self.finish(after);
        Ok(handle)
    }

    fn set_ack_transient(&self, id: ConsumerId) {
        if let Some(c) = lock(&self.state).consumers.iter_mut().find(|c| c.id == id) {
            c.ack_transient = true;
        }
    }

    fn cancel(&self, id: ConsumerId) {
        if let Some(s) = &self.stream {
            return s.cancel(id);
        }
        let mut after = After::default();
        {
            let mut st = lock(&self.state);
            let sac = self.declared.single_active_consumer;
            let was_active = st.consumers.first().map(|c| (c.id, c.unacked));
            let before = st.consumers.len();
            st.consumers.retain(|c| c.id != id);
            st.filtered = st.consumers.iter().filter(|c| c.filter.is_some()).count();
            st.filter_epoch = st.filter_epoch.wrapping_add(1).max(1);
            let active = if sac { 1 } else { usize::MAX };
            st.credit = st
                .consumers
                .iter()
                .take(active)
                .map(|c| self.credit_of(c.prefetch))
                .sum();
            if st.consumers.len() != before {
                st.last_used = Instant::now();
                after.cancelled_all = st.consumers.is_empty() && st.had_consumers && !st.deleted;
            }
            // Single active consumer: the active one went, the next registered takes
            // over. Handed messages now only if the old one held none unacked: those go
            // back to the queue first when its channel closes (the adapter requeues them
            // right after cancelling), and the next ack, nack or publish hands on.
            if sac && !st.deleted && was_active == Some((id, 0)) {
                self.dispatch(&mut st, &mut after);
            }
            // It held some: the next one gets nothing until every one of them is back
            // (acked, or requeued by the adapter: those in the connection's outbox are
            // requeued after the channel's unacked ones, and must not be overtaken).
            if let Some((old, n)) = was_active.filter(|(old, n)| sac && *old == id && *n > 0) {
                st.sac_old = old;
                st.sac_handover = n;
            }
            self.flow_check(&mut st, &mut after);
        }
        self.finish(after);
    }

    /// Acks deliveries (by queue offset); unknown offsets are ignored.
    pub fn ack(&self, offsets: &[u64]) {
        if let (Some(s), Some(me)) = (&self.stream, self.me()) {
            return s.settle(&me, offsets, true);
        }
        let mut after = After::default();
        {
            let mut st = lock(&self.state);
            for off in offsets {
                if let Some(u) = st.unacked.remove(off) {
                    release(&mut st, &u, &mut after);
                    self.gone(*off, &u.entry, &mut after);
                    st.counts.ack += 1;
                }
            }
            if !st.deleted {
                self.dispatch(&mut st, &mut after);
            }
            self.flow_check(&mut st, &mut after);
        }
        self.finish(after);
    }

    /// Rejects deliveries: back to the queue (marked redelivered, their delivery count
    /// one up) or, without requeue, dead-lettered when the queue has a dead-letter
    /// exchange, else dropped. A return past `x-delivery-limit` dead-letters (reason
    /// `delivery_limit`) or drops the message instead.
    pub fn nack(&self, offsets: &[u64], requeue: bool) {
        self.put_back(offsets, requeue, true);
    }

    /// Puts back deliveries that never reached the client (still in a closed
    /// connection's outbox): as a requeueing nack, without counting a return.
    pub fn requeue_unsent(&self, offsets: &[u64]) {
        self.put_back(offsets, true, false);
    }

    fn put_back(&self, offsets: &[u64], requeue: bool, count: bool) {
        // a stream redelivers nothing: a nack (or a requeue) only returns credit
        if let (Some(s), Some(me)) = (&self.stream, self.me()) {
            return s.settle(&me, offsets, false);
        }
        let mut after = After::default();
        {
            let mut st = lock(&self.state);
            for off in offsets {
                let Some(u) = st.unacked.remove(off) else {
                    continue;
                };
                release(&mut st, &u, &mut after);
                if st.deleted {
                    continue;
                }
                if requeue {
                    let mut e = u.entry;
                    e.redelivered = true;
                    e.unmatched = 0;
                    if count {
                        e.returns = e.returns.saturating_add(1);
                        if st
                            .args
                            .delivery_limit
                            // (a policy's limit is not capped where it is read)
                            .is_some_and(|l| u64::from(e.returns) > l.min(MAX_DELIVERY_LIMIT))
                        {
                            // `u.entry`: its count as stored (if it was)
                            self.drop_entry(*off, u.entry, "delivery_limit", &mut after);
                            continue;
                        }
                        let ready_at = st.args.retry_backoff.as_ref().map(|steps| {
                            let i = (e.returns as usize).saturating_sub(1);
                            let wait = steps.get(i).or(steps.last()).copied().unwrap_or(0);
                            now_ms().saturating_add(wait)
                        });
                        if self.store_count(&st.args, &e) {
                            e.count_stored = true;
                            after.counted.push(Returned {
                                offset: *off,
                                count: u32::from(e.returns),
                                ready_at_ms: ready_at.unwrap_or(0),
                            });
                        }
                        if let Some(at) = ready_at {
                            st.parked
                                .get_or_insert_with(Default::default)
                                .insert((at, *off), e);
                            self.tick_wanted.store(true, Ordering::Relaxed);
                            continue;
                        }
                    }
                    st.ready_count += 1;
                    st.ready_bytes += tag_len(e.tag);
                    self.note_tag(e.tag);
                    st.ready.insert((255 - self.priority_of(e.tag), *off), e);
                } else {
                    self.drop_entry(*off, u.entry, "rejected", &mut after);
                }
            }
            if !st.deleted {
                self.dispatch(&mut st, &mut after);
            }
            self.flow_check(&mut st, &mut after);
        }
        self.finish(after);
    }

    /// `basic.get`: one message, or `None` when the queue is empty.
    pub(crate) fn get(&self, no_ack: bool) -> Option<Delivery> {
        let me = self.me()?;
        let mut after = After::default();
        let out;
        {
            let mut st = lock(&self.state);
            if st.deleted {
                return None;
            }
            st.last_used = Instant::now();
            out = self.take_next(&mut st, &mut after, None).map(|m| {
                let off = m.offset;
                let _ = self.store.mark_delivered(self.id, off);
                st.counts.redeliver += u64::from(m.entry.redelivered);
                if no_ack {
                    st.counts.get_no_ack += 1;
                } else {
                    st.counts.get += 1;
                }
                if no_ack {
                    self.gone(off, &m.entry, &mut after);
                } else {
                    st.unacked.insert(
                        off,
                        Unacked {
                            entry: m.entry,
                            consumer: 0,
                            gate: None,
                        },
                    );
                }
                let remaining = u32::try_from(st.ready_count).unwrap_or(u32::MAX);
                m.into_delivery(Arc::from(""), me.clone(), remaining, !no_ack)
            });
        }
        self.finish(after);
        out
    }

    /// Removes every ready message; returns how many.
    pub(crate) fn purge(&self) -> u32 {
        let mut acks_range = None;
        let mut skip = std::collections::HashSet::new();
        let mut after = After::default();
        let n;
        {
            let mut st = lock(&self.state);
            n = st.ready_count;
            let ready = std::mem::take(&mut st.ready);
            for (k, e) in &ready {
                self.gone(k.1, e, &mut after);
            }
            // entries not loaded yet: none is unacked, all go below, except those parked
            // at open, which are wherever they went since (parked, ready, unacked)
            if let Some(r) = st.restored.take() {
                for (off, (_, parked_at_open)) in r.iter() {
                    if *parked_at_open {
                        skip.insert(*off);
                    } else {
                        after.forget.push(*off);
                    }
                }
            }
            // backing-off messages are purged too
            if let Some(p) = st.parked.take() {
                for ((_, off), e) in p.iter() {
                    self.gone(*off, e, &mut after);
                }
            }
            if let Ok(next) = self.store.queue_next_offset(self.id) {
                if next > st.loaded_upto {
                    acks_range = Some((st.loaded_upto, next));
                }
                st.loaded_upto = next;
                st.cq_next = st.cq_next.max(next);
            }
            st.ready_count = 0;
            st.ready_bytes = 0;
            self.flow_check(&mut st, &mut after);
        }
        if let Some((a, b)) = acks_range {
            // entries not loaded yet: none of them is delivered, so all can go
            let unacked: Vec<u64> = (a..b)
                .filter(|o| !skip.contains(o) && !self.store.is_acked(self.id, *o).unwrap_or(true))
                .collect();
            after.acks.extend(unacked);
        }
        self.finish(after);
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Marks the queue deleted and tells its consumers; returns the ready count.
    pub(crate) fn mark_deleted(&self) -> u32 {
        if let Some(s) = &self.stream {
            lock(&self.state).deleted = true;
            return s.mark_deleted();
        }
        let mut st = lock(&self.state);
        st.deleted = true;
        st.throttled = false;
        st.credit = 0;
        for c in st.consumers.drain(..) {
            c.outbox
                .push_control(OutEvent::Cancelled { tag: c.tag.clone() });
        }
        if let Some(n) = &st.flow {
            n.notify_waiters();
        }
        u32::try_from(st.ready_count).unwrap_or(u32::MAX)
    }

    /// Whether the queue has consumers, messages (for delete if-unused / if-empty): the
    /// ready ones and those waiting out their back-off (parked: neither ready nor
    /// unacked, so not in [`Queue::message_count`], but the queue is not empty).
    pub(crate) fn usage(&self) -> (u32, u32) {
        if let Some(s) = &self.stream {
            return (s.consumer_count(), s.message_count());
        }
        let st = lock(&self.state);
        let parked = st.parked.as_ref().map_or(0, |p| p.len() as u64);
        (
            st.consumers.len() as u32,
            u32::try_from(st.ready_count + parked).unwrap_or(u32::MAX),
        )
    }

    /// Periodic work: expire messages at the head (TTL) and report whether the queue has
    /// been unused past `x-expires`.
    /// Whether [`Queue::tick`] may have anything to do.
    pub(crate) fn needs_tick(&self) -> bool {
        // the declared settings and a flag (set by a policy with a TTL or `expires`):
        // no lock, since every tick asks every queue
        self.stream.is_some()
            || self.declared.message_ttl.is_some()
            || self.declared.expires.is_some()
            || self.tick_wanted.load(Ordering::Relaxed)
    }

    /// Notes an entry going into the ready set (TTL messages make the tick needed).
    fn note_tag(&self, tag: u64) {
        if tag & TAG_HAS_TTL != 0 && !self.tick_wanted.load(Ordering::Relaxed) {
            self.tick_wanted.store(true, Ordering::Relaxed);
        }
    }

    pub(crate) fn tick(&self) -> bool {
        if let Some(s) = &self.stream {
            s.tick(now_ms());
            return false;
        }
        let mut after = After::default();
        let expired;
        {
            let mut st = lock(&self.state);
            if st.deleted {
                return false;
            }
            if st.args.message_ttl.is_some() || self.has_message_ttls(&st) {
                self.expire_head(&mut st, &mut after);
            }
            if self.unpark(&mut st) {
                self.dispatch(&mut st, &mut after);
            }
            self.flow_check(&mut st, &mut after);
            expired = st.args.expires.is_some_and(|ms| {
                st.consumers.is_empty() && st.last_used.elapsed() >= Duration::from_millis(ms)
            });
        }
        self.finish(after);
        expired
    }

    /// Makes the parked (backing-off) messages whose wait is over ready again; returns
    /// whether there were any.
    fn unpark(&self, st: &mut State) -> bool {
        let Some(parked) = st.parked.as_mut() else {
            return false;
        };
        let now = now_ms();
        let mut due = Vec::new();
        while let Some(entry) = parked.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let ((_, off), e) = entry.remove_entry();
            due.push((off, e));
        }
        if parked.is_empty() {
            st.parked = None;
        }
        for (off, e) in &due {
            st.ready_count += 1;
            st.ready_bytes += tag_len(e.tag);
            self.note_tag(e.tag);
            st.ready.insert((255 - self.priority_of(e.tag), *off), *e);
        }
        !due.is_empty()
    }

    /// Returned messages waiting out their back-off step.
    pub fn parked_count(&self) -> u32 {
        lock(&self.state)
            .parked
            .as_ref()
            .map_or(0, |p| u32::try_from(p.len()).unwrap_or(u32::MAX))
    }

    fn has_message_ttls(&self, st: &State) -> bool {
        st.ready
            .values()
            .next()
            .is_some_and(|e| e.tag & TAG_HAS_TTL != 0)
    }

    fn expire_head(&self, st: &mut State, after: &mut After) {
        let now = now_ms();
        loop {
            self.fill(st);
            let Some((&key, &e)) = st.ready.iter().next() else {
                return;
            };
            let Ok(rec) = self.store.read_entry(self.id, key.1, e.commit_offset) else {
                return;
            };
            let Ok((_, _, props)) = envelope::decode(&rec.properties) else {
                return;
            };
            if self
                .expiry(st.args.message_ttl, e.tag, &rec, &props)
                .is_none_or(|t| t > now)
            {
                return;
            }
            st.ready.remove(&key);
            st.ready_count = st.ready_count.saturating_sub(1);
            st.ready_bytes = st.ready_bytes.saturating_sub(tag_len(e.tag));
            self.drop_entry(key.1, e, "expired", after);
        }
    }

    /// Dead-letter routing for a message leaving this queue, with RabbitMQ's `x-death`
    /// bookkeeping; `None` when there is no dead-letter exchange or the message would
    /// cycle (already expired out of this queue before).
    ///
    /// `own_deaths`: the message was stored by an earlier dead-lettering, so its `x-death`
    /// is the broker's. Otherwise a client published it, and any `x-death` and
    /// `x-first-death-*` headers it set are replaced, not read (as RabbitMQ 4, which
    /// keeps deaths apart from client headers): a forged record could otherwise make a
    /// message look like a cycle and be dropped, or inflate its counts.
    pub(crate) fn dead_letter_target(
        &self,
        reason: &str,
        exchange: &str,
        routing_key: &str,
        props: &mut Properties,
        own_deaths: bool,
    ) -> Option<(String, String)> {
        let dlx = self.args().dead_letter_exchange.clone()?;
        let mut headers = props.headers.take().unwrap_or_default();
        if !own_deaths {
            for k in [
                "x-death",
                "x-first-death-reason",
                "x-first-death-queue",
                "x-first-death-exchange",
            ] {
                headers.remove(k);
            }
        }
        let mut deaths: Vec<FieldValue> = headers
            .get("x-death")
            .and_then(|v| v.as_array())
            .map(|a| a.to_vec())
            .unwrap_or_default();
        let same = |t: &FieldTable| {
            t.get_str("queue") == Some(self.name.as_str()) && t.get_str("reason") == Some(reason)
        };
        let existing = deaths.iter().position(|d| d.as_table().is_some_and(&same));
        let any_rejected = deaths.iter().any(|d| {
            d.as_table()
                .is_some_and(|t| t.get_str("reason") == Some("rejected"))
        });
        if reason != "rejected" && existing.is_some() && !any_rejected {
            // it left this queue for the same reason before and no client rejected it
            // on the way: a dead-letter cycle, which RabbitMQ breaks by dropping it
            props.headers = Some(headers);
            return None;
        }
        let mut entry = match existing {
            Some(i) => {
                let t = deaths.remove(i);
                t.as_table().cloned().unwrap_or_default()
            }
            None => FieldTable::default(),
        };
        let count = entry.get_i64("count").unwrap_or(0) + 1;
        entry.insert("count", FieldValue::I64(count));
        entry.insert(
            "reason",
            FieldValue::LongString(Bytes::from(reason.to_string())),
        );
        entry.insert(
            "queue",
            FieldValue::LongString(Bytes::from(self.name.clone())),
        );
        entry.insert("time", FieldValue::Timestamp(now_ms() / 1000));
        entry.insert(
            "exchange",
            FieldValue::LongString(Bytes::from(exchange.to_string())),
        );
        entry.insert(
            "routing-keys",
            FieldValue::Array(vec![FieldValue::LongString(Bytes::from(
                routing_key.to_string(),
            ))]),
        );
        if let Some(exp) = props.expiration.take() {
            entry.insert(
                "original-expiration",
                FieldValue::LongString(Bytes::from(exp)),
            );
        }
        deaths.insert(0, FieldValue::Table(entry));
        headers.insert("x-death", FieldValue::Array(deaths));
        for (k, v) in [
            ("x-first-death-reason", reason),
            ("x-first-death-queue", self.name.as_str()),
            ("x-first-death-exchange", exchange),
        ] {
            if headers.get(k).is_none() {
                headers.insert(k, FieldValue::LongString(Bytes::from(v.to_string())));
            }
        }
        props.headers = Some(headers);
        let key = self
            .args()
            .dead_letter_routing_key
            .clone()
            .unwrap_or_else(|| routing_key.to_string());
        Some((dlx, key))
    }
}

fn release(st: &mut State, u: &Unacked, after: &mut After) {
    if st.sac_handover > 0 && u.consumer == st.sac_old {
        st.sac_handover -= 1;
    }
    if let Some(c) = st.consumers.iter_mut().find(|c| c.id == u.consumer) {
        c.unacked = c.unacked.saturating_sub(1);
    }
    if let Some(g) = &u.gate {
        g.release(1);
        if !after.gates.iter().any(|x| Arc::ptr_eq(x, g)) {
            after.gates.push(g.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_pack_and_unpack() {
        let t = make_tag(1234, 7, true, true);
        assert_eq!(tag_len(t), 1234);
        assert_eq!(tag_priority(t), 7);
        assert!(t & TAG_HAS_TTL != 0 && t & TAG_PERSISTENT != 0);
    }

    #[test]
    fn args_are_validated() {
        let mut t = FieldTable::default();
        t.insert("x-message-ttl", FieldValue::I32(100));
        t.insert(
            "x-overflow",
            FieldValue::LongString(Bytes::from_static(b"reject-publish")),
        );
        t.insert("x-max-priority", FieldValue::U8(10));
        let a = QueueArgs::parse(&t).unwrap();
        assert_eq!(a.message_ttl, Some(100));
        assert_eq!(a.overflow, Overflow::RejectPublish);
        assert_eq!(a.max_priority, Some(10));
        let mut bad = FieldTable::default();
        bad.insert("x-message-ttl", FieldValue::I32(-1));
        assert!(QueueArgs::parse(&bad).is_err());
        let mut bad = FieldTable::default();
        bad.insert(
            "x-overflow",
            FieldValue::LongString(Bytes::from_static(b"nope")),
        );
        assert!(QueueArgs::parse(&bad).is_err());
        let mut bad = FieldTable::default();
        bad.insert("x-expires", FieldValue::I32(0));
        assert!(QueueArgs::parse(&bad).is_err());
    }

    #[test]
    fn an_entry_is_24_bytes() {
        assert_eq!(std::mem::size_of::<Entry>(), 24);
    }

    #[test]
    fn delivery_limit_is_parsed() {
        let limit = |v: FieldValue| {
            let mut t = FieldTable::default();
            t.insert("x-delivery-limit", v);
            QueueArgs::parse(&t).map(|a| a.delivery_limit)
        };
        assert_eq!(limit(FieldValue::I32(3)).unwrap(), Some(3));
        assert_eq!(limit(FieldValue::I64(0)).unwrap(), Some(0));
        assert_eq!(limit(FieldValue::I32(-1)).unwrap(), None);
        assert_eq!(
            limit(FieldValue::I32(65_534)).unwrap(),
            Some(MAX_DELIVERY_LIMIT)
        );
        for bad in [
            FieldValue::I32(-2),
            // counts stop at 65535: a higher limit could never be reached
            FieldValue::I32(65_535),
            FieldValue::I64(1 << 40),
            FieldValue::LongString(Bytes::from_static(b"3")),
        ] {
            match limit(bad) {
                Err(CoreError::PreconditionFailed(m)) => {
                    assert!(m.contains("x-delivery-limit"), "{m}")
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(
            QueueArgs::parse(&FieldTable::default())
                .unwrap()
                .delivery_limit,
            None
        );
    }

    #[test]
    fn a_stored_queue_with_a_refused_argument_still_opens() {
        let mut t = FieldTable::default();
        t.insert("x-delivery-limit", FieldValue::I32(3));
        t.insert(
            "x-single-active-consumer",
            FieldValue::LongString(Bytes::from_static(b"yes")),
        );
        t.insert("x-max-length", FieldValue::I32(5));
        assert!(QueueArgs::parse(&t).is_err());
        // declared by an earlier version that ignored it: ignored still, the rest kept
        // (the delivery limit, now implemented, in force)
        let a = QueueArgs::parse_stored("q", &t).unwrap();
        assert_eq!(a.max_length, Some(5));
        assert_eq!(a.delivery_limit, Some(3));
        assert!(!a.single_active_consumer);
        // anything else that is wrong stays an error
        t.insert("x-max-priority", FieldValue::I32(1000));
        assert!(QueueArgs::parse_stored("q", &t).is_err());
    }
}

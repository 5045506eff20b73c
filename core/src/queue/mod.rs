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
//!
//! Modules: this one holds the queue's types and state, its accessors, `get`, `purge`
//! and the work done after the lock (`finish`); `open` rebuilds the state from the store;
//! `args` parses the `x-` arguments; `tag` packs the consume-queue tag; `window` loads and
//! enqueues ready entries; `consumer` registers consumers (and single active consumer);
//! `dispatch` hands messages to them; `settle` takes acks and nacks; `returns` keeps
//! delivery counts and the retry back-off; `flow` throttles publishers; `limits` applies
//! the length limits; `ttl` expires messages and queues; `dead_letter` routes what leaves
//! to the dead-letter exchange; `info` is what the management API reads.

mod args;
mod consumer;
mod dead_letter;
mod dispatch;
mod flow;
mod info;
mod limits;
mod open;
mod returns;
mod settle;
mod tag;
mod ttl;
mod window;

pub use args::{
    parse_backoff, Overflow, QueueArgs, DEFAULT_BACKOFF_LIMIT, MAX_BACKOFF_STEPS,
    MAX_DELIVERY_LIMIT,
};
pub use consumer::{ConsumeRequest, ConsumerHandle};
pub(crate) use dispatch::Hot;
pub use flow::{FLOW_HIGH, FLOW_LOW};
pub use info::{ConsumerInfo, QueueStats, RATE_NAMES};
use limits::refuses_when_full;
pub(crate) use tag::make_tag;
pub(crate) use window::replicated_waker;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use triad_store::commitlog::StoredRecord;
use triad_store::returns::Returned;
use triad_store::store::{QueueId, Store};

use crate::outbox::{CreditGate, Delivery, OutEvent, Outbox};
use crate::policy::Policy;
use crate::value::FieldTable;
use crate::vhost::Vhost;
use crate::ConnectionId;

/// Identifies a consumer within its queue.
pub type ConsumerId = u64;

/// Milliseconds since the Unix epoch by the system clock, for timestamps (expiry
/// decisions read the broker's [`crate::Clock`] instead).
pub(crate) fn now_ms() -> u64 {
    crate::clock::system_now_ms()
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
    /// In `replication.mode = sync`: the window stopped at a message not yet on
    /// `min_insync` replicas, and the replica gate will kick this queue (see `fill`).
    replication_wait: bool,
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
    /// The broker's clock, which expiry decisions read.
    clock: crate::Clock,
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
    pub clock: crate::Clock,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Queue {
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
        lock(&self.state).last_used = self.clock.instant();
    }

    fn me(&self) -> Option<Arc<Queue>> {
        self.me.upgrade()
    }

    /// Entry `off` leaves the queue for good (acked): its count goes with it.
    fn gone(&self, off: u64, e: &Entry, after: &mut After) {
        after.acks.push(off);
        if e.count_stored {
            after.forget.push(off);
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
            st.last_used = self.clock.instant();
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_24_bytes() {
        assert_eq!(std::mem::size_of::<Entry>(), 24);
    }
}

//! Stream queues (`x-queue-type=stream`): non-destructive logs, Kafka's model and
//! RabbitMQ's streams as AMQP 0-9-1 reaches them.
//!
//! A stream is a [`Queue`] whose consume queue is never consumed away: each consumer
//! reads from a position of its own (its cursor), acks only return credit (consumers
//! must have a prefetch), and entries leave the stream only by retention
//! (`x-max-age`, `x-max-length-bytes`), which acks the oldest entries in the store so that
//! its usual mechanisms (ack head, segment deletion, compaction) free the disk.
//!
//! Positions are consume-queue offsets. A consumer starts at `first`, `last`, `next`
//! (the default), an offset, or a time: the first entry stored at or after it, found by a
//! binary search over the retained entries' commitlog store timestamps (which grow with
//! the offset: one writer appends in order), so O(log n) record reads, never a scan.
//!
//! Stored offsets: a consumer with a name (`x-stream-consumer-name`) commits the offset
//! after its highest ack; a later consumer with the same name and no explicit start
//! resumes there. This is Kafka's committed offset (what the consumer commits), not the
//! lowest unacked entry: an entry below the highest ack that was never acked (out of
//! order acks, then a cancel) is not read again by a resuming consumer, so a consumer
//! that needs every entry at least once acks in order. Commits are coalesced: at most
//! one metadata-journal record per stream per broker tick (1 s) holds every name that
//! moved, and one more when a named consumer is cancelled, so a consumer acking 100,000
//! messages a second costs one record a second, not 100,000. The record is appended
//! under the stream's lock (so a reset through the management API, also appended
//! under it, is never overtaken by an older commit) and never after the stream is
//! deleted. A crash loses at most the last second's commits: the consumer then
//! re-reads those entries (at least once for what it had acked). Names live under journal keys
//! `o / vhost / queue / name` (value: the next offset, u64 big-endian), loaded when the
//! broker starts and deleted with the queue.
//!
//! Cost: an idle stream holds this struct and its stored names (at most
//! [`MAX_NAMES`]); a consumer is one [`StreamConsumer`] (about 100 bytes).
//!
//! An ack handle ([`Delivery::offset`]) carries the consumer's id in its top 24 bits
//! and the stream offset in the low 40 (a stream of up to 2^40 entries), so that an ack
//! finds its consumer even when several consumers hold the same offset.

pub mod spec;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use triad_store::journal::{KeyBuilder, MetaOp};
use triad_store::store::{QueueId, Store};

use crate::durability::Durability;
use crate::envelope;
use crate::error::CoreError;
use crate::message::Properties;
use crate::outbox::{CreditGate, Delivery, OutEvent, Outbox};
use crate::queue::{ConsumeRequest, ConsumerId, Hot, Queue};
use crate::value::FieldValue;

pub use spec::{StreamArgs, StreamOffset};

/// Wall-clock ms since the Unix epoch (what store timestamps and start times use).
pub fn now_ms() -> u64 {
    crate::queue::now_ms()
}

/// Most stored consumer names per stream.
pub const MAX_NAMES: usize = 10_000;

const TAG_STREAM_OFFSET: u8 = b'o';
const OFFSET_BITS: u32 = 40;
const OFFSET_MASK: u64 = (1 << OFFSET_BITS) - 1;
const ID_MASK: u64 = (1 << 24) - 1;

/// How a stream consumer starts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamConsume {
    /// Explicit start (`x-stream-offset`); `None`: the stored offset of `name`, else
    /// `next`.
    pub offset: Option<StreamOffset>,
    /// The consumer name whose offset is stored (`x-stream-consumer-name`).
    pub name: Option<String>,
}

impl StreamConsume {
    /// Whether anything stream-specific was asked for.
    pub fn is_empty(&self) -> bool {
        self.offset.is_none() && self.name.is_none()
    }
}

/// How a stored offset is reset (management API).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffsetReset {
    /// The next read is at this offset.
    Offset(u64),
    /// The next read is at the first entry stored at or after this time (ms).
    Timestamp(u64),
}

fn offsets_prefix(vhost: &str, queue: &str) -> KeyBuilder {
    KeyBuilder::new(TAG_STREAM_OFFSET)
        .part(vhost.as_bytes())
        .part(queue.as_bytes())
}

/// The journal operation deleting every stored offset of a stream (with the queue).
pub(crate) fn delete_offsets_op(vhost: &str, queue: &str) -> MetaOp {
    MetaOp::delete_prefix(offsets_prefix(vhost, queue).build())
}

/// RabbitMQ's refusal of an operation a stream does not have (`basic.get`,
/// `queue.purge`).
pub(crate) fn refuse_on_stream(q: &Queue, what: &str) -> Result<(), CoreError> {
    if q.is_stream() {
        return Err(CoreError::NotImplemented(format!(
            "{what} not supported by stream queues queue '{}' in vhost '{}'",
            q.name(),
            q.vhost_name()
        )));
    }
    Ok(())
}

struct StreamConsumer {
    id: ConsumerId,
    tag: Arc<str>,
    conn: crate::ConnectionId,
    priority: i32,
    name: Option<Arc<str>>,
    /// Next offset to deliver.
    cursor: u64,
    prefetch: u32,
    unacked: u32,
    exclusive: bool,
    outbox: Arc<Outbox>,
    gate: Option<Arc<CreditGate>>,
}

struct State {
    /// First retained offset (everything below was dropped by retention).
    first: u64,
    /// One past the last entry.
    next: u64,
    /// In `replication.mode = sync`: one past the last entry known to be on
    /// `min_insync` replicas; consumers read below it only (as a classic queue's window
    /// loads, see `Queue::fill`). Raised as dispatches find entries replicated.
    replicated: u64,
    /// The replica gate holds a waker that dispatches again once more is replicated.
    replication_wait: bool,
    /// Body bytes of the retained entries, kept only with `x-max-length-bytes` (0
    /// otherwise: counting costs an index read per entry).
    bytes: u64,
    consumers: Vec<StreamConsumer>,
    next_id: u64,
    /// Stored offsets: name → next offset to read.
    stored: HashMap<Arc<str>, u64>,
    /// Names whose stored offset moved since the last journal record.
    dirty: Vec<Arc<str>>,
    deleted: bool,
    delivered: u64,
    acked: u64,
}

/// A stream queue's state (inside its [`Queue`]).
pub struct Stream {
    args: StreamArgs,
    store: Arc<Store>,
    id: QueueId,
    vhost: String,
    queue: String,
    st: Mutex<State>,
}

fn body_len(tag: u64) -> u64 {
    tag & 0xffff_ffff
}

/// The ack handle of `offset` delivered to consumer `id`.
fn handle(id: ConsumerId, offset: u64) -> u64 {
    ((id & ID_MASK) << OFFSET_BITS) | (offset & OFFSET_MASK)
}

fn split(handle: u64) -> (ConsumerId, u64) {
    (handle >> OFFSET_BITS, handle & OFFSET_MASK)
}

/// The next consumer id (1..=[`ID_MASK`], an ack handle holds 24 bits) not `in_use`:
/// ids wrap, and one still held by a consumer is skipped (a stream has far fewer than
/// 2^24 consumers, so this ends).
fn next_free_id(next_id: &mut u64, in_use: impl Fn(u64) -> bool) -> ConsumerId {
    loop {
        let id = *next_id;
        *next_id = if id >= ID_MASK { 1 } else { id + 1 };
        if !in_use(id) {
            return id;
        }
    }
}

/// An entry as delivered (shared by the consumers reading it in one dispatch).
struct Entry {
    offset: u64,
    exchange: Arc<str>,
    routing_key: Arc<str>,
    properties: Arc<Properties>,
    body: Bytes,
}

/// Work to do once the lock is released.
#[derive(Default)]
struct After {
    /// Retention: ack `start..end` in the store.
    drop: Option<(u64, u64)>,
    gates: Vec<Arc<CreditGate>>,
}

impl Stream {
    /// Opens the stream of store queue `id`: its retained range is the store's unacked
    /// range (retention acks from the front only).
    pub(crate) fn open(
        store: Arc<Store>,
        id: QueueId,
        vhost: &str,
        queue: &str,
        args: StreamArgs,
    ) -> Result<Stream, CoreError> {
        let first = store.queue_info(id)?.ack_head;
        let next = store.queue_next_offset(id)?;
        let mut bytes = 0;
        if args.max_bytes.is_some() {
            for off in first..next {
                if let Some(e) = store.entry(id, off) {
                    bytes += body_len(e.tag_hash);
                }
            }
        }
        Ok(Stream {
            args,
            store,
            id,
            vhost: vhost.to_string(),
            queue: queue.to_string(),
            st: Mutex::new(State {
                first,
                next,
                // entries stored before this open may not be replicated yet either
                replicated: first,
                replication_wait: false,
                bytes,
                consumers: Vec::new(),
                next_id: 1,
                stored: HashMap::new(),
                dirty: Vec::new(),
                deleted: false,
                delivered: 0,
                acked: 0,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Loads the stored consumer offsets (at start, while the journal's state is held).
    pub(crate) fn load_offsets(&self) -> Result<(), CoreError> {
        let prefix = offsets_prefix(&self.vhost, &self.queue).build();
        let rows = self.store.journal().scan(&prefix)?;
        let mut st = self.lock();
        for (k, v) in rows {
            let Some(name) = k
                .get(prefix.len()..)
                .and_then(triad_store::journal::key_parts)
            else {
                continue;
            };
            let (Some(name), Ok(v)) = (name.first(), <[u8; 8]>::try_from(v.as_slice())) else {
                continue;
            };
            let name: Arc<str> = Arc::from(String::from_utf8_lossy(name).as_ref());
            st.stored.insert(name, u64::from_be_bytes(v));
        }
        Ok(())
    }

    fn key(&self, name: &str) -> Vec<u8> {
        offsets_prefix(&self.vhost, &self.queue)
            .part(name.as_bytes())
            .build()
    }

    /// Retained entries.
    pub fn message_count(&self) -> u32 {
        let st = self.lock();
        u32::try_from(st.next - st.first).unwrap_or(u32::MAX)
    }

    /// Consumers reading the stream.
    pub fn consumer_count(&self) -> u32 {
        self.lock().consumers.len() as u32
    }

    /// Deliveries not yet acked, over all consumers.
    pub fn unacked_count(&self) -> u32 {
        self.lock().consumers.iter().map(|c| c.unacked).sum()
    }

    /// The consumers (management API).
    pub fn consumers(&self) -> Vec<crate::queue::ConsumerInfo> {
        self.lock()
            .consumers
            .iter()
            .map(|c| crate::queue::ConsumerInfo {
                tag: c.tag.clone(),
                conn: c.conn,
                no_ack: false,
                exclusive: c.exclusive,
                prefetch: c.prefetch,
                unacked: c.unacked,
                priority: c.priority,
            })
            .collect()
    }

    /// `(delivered, acked)` since the broker started.
    pub fn counts(&self) -> (u64, u64) {
        let st = self.lock();
        (st.delivered, st.acked)
    }

    /// The retained range `first..next`.
    pub fn range(&self) -> (u64, u64) {
        let st = self.lock();
        (st.first, st.next)
    }

    /// The stored offset of consumer `name` (the next offset it reads).
    pub fn stored_offset(&self, name: &str) -> Option<u64> {
        self.lock().stored.get(name).copied()
    }

    /// The store time of entry `off`, ms.
    fn store_ts(&self, off: u64) -> Option<u64> {
        self.store
            .read_queue(self.id, off)
            .ok()
            .flatten()
            .map(|(_, r)| r.store_ts_ms)
    }

    /// The first offset in `first..next` stored at or after `ts_ms` (`next` if none):
    /// a binary search over store timestamps, O(log n) record reads.
    fn seek_time(&self, first: u64, next: u64, ts_ms: u64) -> u64 {
        let (mut lo, mut hi) = (first, next);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            // an unreadable entry counts as old: the search moves past it
            if self.store_ts(mid).is_some_and(|t| t >= ts_ms) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        lo
    }

    /// As [`Stream::seek_time`], for a time expected near `first` (age retention, each
    /// tick): probes `first`, `first + 1`, `first + 3`, ... (doubling) until an entry is
    /// at or after `ts_ms`, then binary-searches that last step. O(log k) record reads
    /// for an answer k entries in: one read when nothing is old enough to drop.
    fn seek_time_from_front(&self, first: u64, next: u64, ts_ms: u64) -> u64 {
        let (mut lo, mut hi, mut step) = (first, first, 1u64);
        // everything below `lo` is older than `ts_ms`
        while hi < next {
            if self.store_ts(hi).is_some_and(|t| t >= ts_ms) {
                break;
            }
            lo = hi + 1;
            hi = hi.saturating_add(step).min(next);
            step = step.saturating_mul(2);
        }
        self.seek_time(lo, hi.max(lo), ts_ms)
    }

    fn resolve(&self, st: &State, o: StreamOffset) -> u64 {
        match o {
            StreamOffset::First => st.first,
            StreamOffset::Last => st.next.saturating_sub(1).max(st.first),
            StreamOffset::Next => st.next,
            StreamOffset::Offset(n) => n.clamp(st.first, st.next),
            StreamOffset::Timestamp(t) => self.seek_time(st.first, st.next, t),
        }
    }

    pub(crate) fn consume(
        &self,
        me: &Arc<Queue>,
        req: ConsumeRequest,
        opts: StreamConsume,
    ) -> Result<(ConsumerId, Arc<str>), CoreError> {
        if req.no_ack {
            return Err(CoreError::NotImplemented(format!(
                "automatic acknowledgement not supported by stream queues queue '{}' in vhost '{}'",
                self.queue, self.vhost
            )));
        }
        if req.prefetch == 0 {
            return Err(CoreError::PreconditionFailed(format!(
                "consumer prefetch count is not set for 'queue '{}' in vhost '{}''",
                self.queue, self.vhost
            )));
        }
        if let Some(n) = &opts.name {
            if n.is_empty() || n.len() > spec::MAX_CONSUMER_NAME {
                return Err(CoreError::PreconditionFailed(format!(
                    "invalid arg 'x-stream-consumer-name': 1 to {} bytes",
                    spec::MAX_CONSUMER_NAME
                )));
            }
        }
        let out;
        {
            let mut st = self.lock();
            if st.deleted {
                return Err(CoreError::queue_not_found(&self.queue));
            }
            if st.consumers.iter().any(|c| c.exclusive)
                || (req.exclusive && !st.consumers.is_empty())
            {
                return Err(CoreError::AccessRefused(format!(
                    "queue '{}' in vhost '{}' in exclusive use",
                    self.queue, self.vhost
                )));
            }
            let name: Option<Arc<str>> = opts.name.as_deref().map(Arc::from);
            if let Some(n) = &name {
                if !st.stored.contains_key(n) && st.stored.len() >= MAX_NAMES {
                    return Err(CoreError::PreconditionFailed(format!(
                        "stream '{}' has {MAX_NAMES} stored consumer names: no more",
                        self.queue
                    )));
                }
            }
            let start = match (opts.offset, &name) {
                (Some(o), _) => self.resolve(&st, o),
                (None, Some(n)) => match st.stored.get(n) {
                    Some(&o) => o.clamp(st.first, st.next),
                    None => st.next,
                },
                (None, None) => st.next,
            };
            let State {
                next_id, consumers, ..
            } = &mut *st;
            let id = next_free_id(next_id, |id| consumers.iter().any(|c| c.id == id));
            let tag: Arc<str> = Arc::from(req.tag.as_str());
            st.consumers.push(StreamConsumer {
                id,
                tag: tag.clone(),
                conn: req.conn,
                priority: req.priority,
                name,
                cursor: start,
                prefetch: req.prefetch,
                unacked: 0,
                exclusive: req.exclusive,
                outbox: req.outbox,
                gate: req.gate,
            });
            self.dispatch(me, &mut st, None);
            out = (id, tag);
        }
        Ok(out)
    }

    pub(crate) fn cancel(&self, id: ConsumerId) {
        let mut after = After::default();
        {
            let mut st = self.lock();
            let Some(i) = st.consumers.iter().position(|c| c.id == id) else {
                return;
            };
            let c = st.consumers.remove(i);
            if let Some(g) = &c.gate {
                g.release(c.unacked);
                after.gates.push(g.clone());
            }
            // a named consumer's offset is written when it goes, not a tick later
            if c.name.is_some() {
                self.commit_dirty(&mut st);
            }
        }
        self.finish(after);
    }

    /// Settles deliveries (ack handles): credit comes back; an ack (not a nack) of a
    /// named consumer moves its stored offset past the acked entry.
    pub(crate) fn settle(&self, me: &Arc<Queue>, handles: &[u64], ack: bool) {
        let mut after = After::default();
        {
            let mut st = self.lock();
            for h in handles {
                let (id, off) = split(*h);
                let Some(c) = st.consumers.iter_mut().find(|c| c.id & ID_MASK == id) else {
                    continue;
                };
                if c.unacked == 0 {
                    continue;
                }
                c.unacked -= 1;
                if let Some(g) = &c.gate {
                    g.release(1);
                    if !after.gates.iter().any(|x| Arc::ptr_eq(x, g)) {
                        after.gates.push(g.clone());
                    }
                }
                let name = if ack { c.name.clone() } else { None };
                st.acked += u64::from(ack);
                if let Some(n) = name {
                    let cur = st.stored.get(&n).copied();
                    if cur.is_none_or(|o| o < off + 1) {
                        st.stored.insert(n.clone(), off + 1);
                        if !st.dirty.contains(&n) {
                            st.dirty.push(n);
                        }
                    }
                }
            }
            if !st.deleted {
                self.dispatch(me, &mut st, None);
            }
        }
        self.finish(after);
    }

    /// An entry was appended at `offset`.
    pub(crate) fn enqueue(&self, me: &Arc<Queue>, offset: u64, tag: u64, hot: Option<&Hot>) {
        let mut after = After::default();
        {
            let mut st = self.lock();
            if st.deleted {
                return;
            }
            if offset >= st.next {
                if self.args.max_bytes.is_some() {
                    // enqueues of concurrent publishes may arrive out of order; every
                    // entry below `offset` is in the consume queue already
                    for o in st.next..offset {
                        if let Some(e) = self.store.entry(self.id, o) {
                            st.bytes += body_len(e.tag_hash);
                        }
                    }
                    st.bytes += body_len(tag);
                }
                st.next = offset + 1;
            }
            self.retain_bytes(&mut st, &mut after);
            self.dispatch(me, &mut st, hot.map(|h| (offset, h)));
        }
        self.finish(after);
    }

    /// Resumes deliveries after an outbox or credit gate had room again.
    pub(crate) fn kick(&self, me: &Arc<Queue>) {
        let mut st = self.lock();
        if !st.deleted {
            self.dispatch(me, &mut st, None);
        }
    }

    /// Periodic work: age retention and the coalesced offset commits.
    pub(crate) fn tick(&self, now_ms: u64) {
        let mut after = After::default();
        {
            let mut st = self.lock();
            if st.deleted {
                return;
            }
            if let Some(age) = self.args.max_age_ms {
                let cut = self.seek_time_from_front(st.first, st.next, now_ms.saturating_sub(age));
                self.drop_to(&mut st, cut, &mut after);
            }
            self.commit_dirty(&mut st);
        }
        self.finish(after);
    }

    /// Journals the stored offsets that moved. Called under the lock, so that the journal
    /// holds the commits and resets of a name in the order they were made; nothing after
    /// the stream is deleted (its stored offsets are deleted with it). Not waited for: a
    /// commit is at least once (a lost one re-reads entries).
    fn commit_dirty(&self, st: &mut State) {
        let dirty = std::mem::take(&mut st.dirty);
        if st.deleted {
            return;
        }
        let ops: Vec<MetaOp> = dirty
            .iter()
            .filter_map(|n| {
                let o = st.stored.get(n)?;
                Some(MetaOp::put(self.key(n), o.to_be_bytes().to_vec()))
            })
            .collect();
        if ops.is_empty() {
            return;
        }
        if let Err(e) = self.store.journal().append(ops) {
            tracing::warn!(queue = %self.queue, error = %e, "storing stream consumer offsets failed");
        }
    }

    fn retain_bytes(&self, st: &mut State, after: &mut After) {
        let Some(max) = self.args.max_bytes else {
            return;
        };
        let mut cut = st.first;
        let mut bytes = st.bytes;
        while bytes > max && cut < st.next {
            if let Some(e) = self.store.entry(self.id, cut) {
                bytes = bytes.saturating_sub(body_len(e.tag_hash));
            }
            cut += 1;
        }
        self.drop_to(st, cut, after);
    }

    /// Retention: entries below `cut` leave the stream.
    fn drop_to(&self, st: &mut State, cut: u64, after: &mut After) {
        let cut = cut.min(st.next);
        if cut <= st.first {
            return;
        }
        if self.args.max_bytes.is_some() {
            for off in st.first..cut {
                if let Some(e) = self.store.entry(self.id, off) {
                    st.bytes = st.bytes.saturating_sub(body_len(e.tag_hash));
                }
            }
        }
        let start = after.drop.map_or(st.first, |(s, _)| s);
        after.drop = Some((start, cut));
        st.first = cut;
    }

    /// Hands entries to every consumer with credit from its own cursor.
    fn dispatch(&self, me: &Arc<Queue>, st: &mut State, hot: Option<(u64, &Hot)>) {
        let (first, next) = (st.first, self.replicated_next(me, st));
        let mut delivered = 0;
        // the last entry read: consumers at the same offset (those following the tail)
        // share its properties (with `x-stream-offset`) instead of each building them
        let mut cached: Option<Entry> = None;
        for c in st.consumers.iter_mut() {
            if c.cursor < first {
                c.cursor = first;
            }
            while c.cursor < next && c.unacked < c.prefetch {
                if let Some(g) = &c.gate {
                    if !g.has_room() {
                        g.wait_for_room(me);
                        break;
                    }
                }
                if !c.outbox.has_room() {
                    c.outbox.wait_for_room(me);
                    break;
                }
                let off = c.cursor;
                let Some(d) = self.delivery(me, c, off, hot, &mut cached) else {
                    // unreadable (retention raced, or a damaged record): skip it
                    c.cursor += 1;
                    continue;
                };
                if !c.outbox.push(OutEvent::Deliver(d)) {
                    c.outbox.wait_for_room(me);
                    break;
                }
                c.cursor += 1;
                c.unacked += 1;
                if let Some(g) = &c.gate {
                    g.take();
                }
                delivered += 1;
            }
        }
        st.delivered += delivered;
    }

    /// One past the last entry consumers may read: `next`, except in
    /// `replication.mode = sync`, where it is one past the last entry on `min_insync`
    /// replicas, so that no consumer reads an entry a failover then loses (what the
    /// confirm waited for). When it stops short of `next`, the replica gate dispatches
    /// again once more is replicated (one registration at a time). Each entry is looked
    /// at once (a compaction's copy may sit later in the log than a newer entry, so one
    /// entry's replication says nothing of the next's).
    fn replicated_next(&self, me: &Arc<Queue>, st: &mut State) -> u64 {
        let Some(gate) = self.store.delivery_gate() else {
            return st.next;
        };
        st.replicated = st.replicated.max(st.first);
        while st.replicated < st.next {
            let Some(e) = self.store.entry(self.id, st.replicated) else {
                // gone (retention raced) or unreadable: dispatch skips it too
                st.replicated += 1;
                continue;
            };
            let end = e.commit_offset + u64::from(e.size);
            if gate.reached_or_wake(end, None) {
                st.replicated += 1;
                continue;
            }
            if st.replication_wait {
                break;
            }
            // registered under the gate's lock, which looks again
            if gate.reached_or_wake(end, Some(crate::queue::replicated_waker(me))) {
                st.replicated += 1;
                continue;
            }
            st.replication_wait = true;
            break;
        }
        st.replicated
    }

    /// The replica gate's wake-up: more is replicated (or the gate fenced); dispatch.
    pub(crate) fn on_replicated(&self, me: &Arc<Queue>) {
        let mut st = self.lock();
        st.replication_wait = false;
        if !st.deleted {
            self.dispatch(me, &mut st, None);
        }
    }

    /// Entry `off` as delivered (its properties with `x-stream-offset`): from `cached`
    /// when that is `off`, else built (from `hot` when that is `off`, else read from the
    /// store) and left in `cached`.
    fn entry<'a>(
        &self,
        off: u64,
        hot: Option<(u64, &Hot)>,
        cached: &'a mut Option<Entry>,
    ) -> Option<&'a Entry> {
        if cached.as_ref().is_some_and(|e| e.offset == off) {
            return cached.as_ref();
        }
        let (exchange, routing_key, mut props, body): (Arc<str>, Arc<str>, Properties, Bytes) =
            match hot.filter(|(o, _)| *o == off) {
                Some((_, h)) => (
                    h.exchange.clone(),
                    h.routing_key.clone(),
                    (*h.properties).clone(),
                    h.body.clone(),
                ),
                None => {
                    let (_, rec) = self.store.read_queue(self.id, off).ok()??;
                    let (x, rk, p) = envelope::decode_shared(&rec.properties).ok()?;
                    (x, rk, p, rec.body)
                }
            };
        props
            .headers
            .get_or_insert_with(Default::default)
            .insert("x-stream-offset", FieldValue::I64(off as i64));
        *cached = Some(Entry {
            offset: off,
            exchange,
            routing_key,
            properties: Arc::new(props),
            body,
        });
        cached.as_ref()
    }

    fn delivery(
        &self,
        me: &Arc<Queue>,
        c: &StreamConsumer,
        off: u64,
        hot: Option<(u64, &Hot)>,
        cached: &mut Option<Entry>,
    ) -> Option<Delivery> {
        let e = self.entry(off, hot, cached)?;
        Some(Delivery {
            tag: c.tag.clone(),
            queue: me.clone(),
            offset: handle(c.id, off),
            redelivered: false,
            exchange: e.exchange.clone(),
            routing_key: e.routing_key.clone(),
            properties: e.properties.clone(),
            body: e.body.clone(),
            message_count: 0,
            needs_ack: true,
        })
    }

    fn finish(&self, after: After) {
        let After { drop, gates } = after;
        if let Some((a, b)) = drop {
            if let Err(e) = self.store.ack_range(self.id, a, b) {
                tracing::warn!(queue = %self.queue, error = %e, "stream retention: store ack failed");
            }
        }
        for g in gates {
            g.wake();
        }
    }

    /// Stops stored-offset commits (the first step of a deletion: called before the
    /// deletion of the stored offsets is journaled, so that no commit lands after it).
    pub(crate) fn stop_commits(&self) {
        let mut st = self.lock();
        st.deleted = true;
        st.dirty.clear();
    }

    /// Marks the stream deleted and tells its consumers; their unacked deliveries go
    /// back to their credit gates (as a cancel does).
    pub(crate) fn mark_deleted(&self) -> u32 {
        let mut after = After::default();
        let n = {
            let mut st = self.lock();
            st.deleted = true;
            st.dirty.clear();
            for c in st.consumers.drain(..) {
                if let Some(g) = &c.gate {
                    g.release(c.unacked);
                    if !after.gates.iter().any(|x| Arc::ptr_eq(x, g)) {
                        after.gates.push(g.clone());
                    }
                }
                c.outbox
                    .push_control(OutEvent::Cancelled { tag: c.tag.clone() });
            }
            u32::try_from(st.next - st.first).unwrap_or(u32::MAX)
        };
        self.finish(after);
        n
    }

    /// Sets the stored offset of consumer `name` (management API); durable on return
    /// of the [`Durability`]. Returns the new stored offset.
    pub fn reset_offset(
        &self,
        name: &str,
        to: OffsetReset,
    ) -> Result<(u64, Durability), CoreError> {
        self.store_offset(name, |this, st| match to {
            OffsetReset::Offset(o) => o.clamp(st.first, st.next),
            OffsetReset::Timestamp(t) => this.seek_time(st.first, st.next, t),
        })
    }

    /// Sets the stored offset of consumer `name` to where a consumer starting at `start`
    /// would start now (`first`, `last`, `next`, an offset or a time), replacing any
    /// stored one: a subscription that resumes under that name later (MQTT's persistent
    /// `$stream/...` subscriptions) goes on from there even if it acked nothing. The
    /// record is appended now; durable with the next journal flush.
    pub fn start_offset(
        &self,
        name: &str,
        start: StreamOffset,
    ) -> Result<(u64, Durability), CoreError> {
        self.store_offset(name, |this, st| this.resolve(st, start))
    }

    /// Forgets the stored offset of consumer `name`, if there is one (a subscription
    /// that ended for good); the deletion is journaled under the lock, after any commit
    /// of the name.
    pub fn forget_offset(&self, name: &str) -> Result<Option<Durability>, CoreError> {
        let mut st = self.lock();
        if st.deleted || st.stored.remove(name).is_none() {
            return Ok(None);
        }
        st.dirty.retain(|d| **d != *name);
        let done = self
            .store
            .journal()
            .append(vec![MetaOp::delete(self.key(name))])?;
        Ok(Some(done.into()))
    }

    fn store_offset(
        &self,
        name: &str,
        at: impl FnOnce(&Self, &State) -> u64,
    ) -> Result<(u64, Durability), CoreError> {
        if name.is_empty() || name.len() > spec::MAX_CONSUMER_NAME {
            return Err(CoreError::PreconditionFailed(format!(
                "a consumer name is 1 to {} bytes",
                spec::MAX_CONSUMER_NAME
            )));
        }
        let mut st = self.lock();
        if st.deleted {
            return Err(CoreError::queue_not_found(&self.queue));
        }
        let n: Arc<str> = Arc::from(name);
        if !st.stored.contains_key(&n) && st.stored.len() >= MAX_NAMES {
            return Err(CoreError::PreconditionFailed(format!(
                "stream '{}' has {MAX_NAMES} stored consumer names: no more",
                self.queue
            )));
        }
        let off = at(self, &st);
        st.stored.insert(n.clone(), off);
        st.dirty.retain(|d| *d != n);
        // appended under the lock: a concurrent commit of the same name journals after
        let done = self.store.journal().append(vec![MetaOp::put(
            self.key(name),
            off.to_be_bytes().to_vec(),
        )])?;
        Ok((off, done.into()))
    }

    /// Stored consumer names and offsets, sorted by name.
    pub fn stored_offsets(&self) -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = self
            .lock()
            .stored
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_carry_consumer_and_offset() {
        let h = handle(7, 123_456_789);
        assert_eq!(split(h), (7, 123_456_789));
        let h = handle(ID_MASK, OFFSET_MASK);
        assert_eq!(split(h), (ID_MASK, OFFSET_MASK));
        // ids wrap into 24 bits
        assert_eq!(split(handle(ID_MASK + 2, 5)).0, 1);
    }

    #[test]
    fn consumer_ids_wrap_past_ids_in_use() {
        let mut next = ID_MASK - 1;
        let in_use = |id: u64| id == ID_MASK || id == 1 || id == 2;
        assert_eq!(next_free_id(&mut next, in_use), ID_MASK - 1);
        // ID_MASK, 1 and 2 are held by live consumers: skipped
        assert_eq!(next_free_id(&mut next, in_use), 3);
        assert_eq!(next, 4);
    }
}

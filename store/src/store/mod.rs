//! The store: one writer path over the commitlog, consume queues and index; durability
//! through [`crate::flush`]; checkpoints, crash recovery and retention.
//!
//! On disk (under the data directory):
//!
//! ```text
//! lock                      flock held while a broker runs on this directory
//! abort                     exists while running: found at start = unclean shutdown
//! checkpoint                commitlog offset below which consume queues, index and the
//!                           ack states are flushed (earlier versions also kept every
//!                           durable queue's ack state here; read once, then journaled)
//! commitlog/<20 digits>     segments
//! consumequeue/<vhost>/<queue>/<20 digits>
//!                           only for queues holding more than `small_queue_entries`
//!                           (files of 20-byte entries); a small queue has no directory
//! sharedcq/<20 digits>      the shared index: 40-byte entries (queue, logical offset,
//!                           commitlog offset, size, tag hash, CRC) of every small durable
//!                           queue, in segments deleted once nothing in them is live
//! index/<20 digits>
//! meta/journal-*, snapshot-*  the metadata journal (see [`crate::journal`]); the store's
//!                           queue registry is its `Q` (queue id → record) and `N` (id
//!                           ceiling) keys, and each durable queue's ack state as of the
//!                           checkpoint its `A` key, journaled only when it changed
//! ```
//!
//! Appends, acks and queue offsets are serialised by one writer lock whose critical
//! section is a copy into the mapping plus one 20-byte entry per target queue. Acks are
//! records in the commitlog too, so they share the group commit and recovery replays them
//! after the checkpoint's ack snapshot. Recovery always scans from the checkpoint (on a
//! clean start that finds the end at once) and rebuilds consume-queue, index and ack
//! state from the records it finds. Small queues first take their entries from the shared
//! index; after the replay their live entries are written to fresh shared-index segments
//! and the old segments deleted, so entries cut by the recovery cannot come back.
//!
//! Retention and compaction (every `retention_interval`, and at once after the checkpoint
//! that follows a segment's sealing): a sealed segment below the
//! checkpoint is deleted once no queue holds a live (unacked) entry in it, wherever it is
//! in the log; the offsets it covered become a gap, which only recovery from a checkpoint
//! above it ever meets (a gap above the checkpoint is still damage). Liveness is counted
//! by walking every queue's unacked entries, O(pending entries) per pass, nothing on the
//! publish or ack path. A segment whose live bytes are below half its size is compacted:
//! its live records are copied to the end of the log (same timestamps, keys, properties
//! and body; the queue list cut to the entries still live, at their logical offsets, so
//! that replaying the copy repoints them), their entries repointed, and the segment deleted
//! once the log is flushed up to the last copy. The checkpoint is below every copy it does not cover, so a
//! crash at any step replays the copies and leaves every entry pointing at exactly one
//! record. One slow queue holding a few old messages thus costs their bytes, not the log
//! from them on. Core keeps commit offsets of loaded entries; a read that finds the
//! segment gone asks the consume queue again ([`Store::read_entry`]).
//! While a sealed segment awaits its pass, no segment is created ahead of the writer, and
//! appends leave the second half of the writer's segment to that pass's copies (they wait
//! for the pass, at most 2 s, without the writer lock): so even when appends outrun the
//! passes (async flushing at disk speed) the log holds at most the sealed segment, the
//! writer's, and segments at least half live, which is within 2 × live + 2 segments.
//!
//! Cost of a queue: an idle or near-empty durable queue owns no file and no mapping;
//! 40 bytes of shared index and 24 bytes of heap per entry held, plus its `QueueState`.
//!
//! Modules, by concern:
//! - this one: the settings, the public types and the [`Store`] facade;
//! - `open`: [`Store::open`] in steps: lock, checkpoint, registry, queues, replay, threads;
//! - `write`: the writer path: appends, acks, flushes;
//! - `registry`: the queue registry (records, journal keys, create and delete, orphans);
//! - `checkpoint`: the checkpoint file's codec and the journaled ack states;
//! - `threads`: the flusher and the maintenance thread (checkpoints, retention passes);
//! - `compaction`: retention passes: live bytes per segment, compaction, deletion.

mod checkpoint;
mod compaction;
mod open;
mod registry;
mod threads;
mod write;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::ack::AckState;
use crate::commitlog::{CommitLog, StoredRecord, Writer};
use crate::consumequeue::{ConsumeQueue, CqEntry};
use crate::error::{Result, StoreError};
use crate::file::sync_dir;
use crate::flush::{Durable, FlushMode, FlushShared};
use crate::index::{IndexConfig, IndexService};
use crate::journal::MetaJournal;
use crate::meta::MetaStore;
use crate::record::NewMessage;
use crate::smallcq::SharedIndex;
use registry::{QueueRecord, RegState};

/// A queue's id in the store; never reused.
pub type QueueId = u32;

/// Store settings. `StoreConfig::new(dir)` gives the defaults.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub dir: PathBuf,
    /// Commitlog segment size (default 1 GiB).
    pub segment_size: u64,
    /// Consume-queue entries per file (default 300,000: 6 MB files, as RocketMQ), for
    /// queues that hold more than `small_queue_entries`.
    pub cq_entries_per_file: u64,
    /// A queue holding at most this many entries keeps them in heap and in the shared
    /// index instead of its own files (default 64; at least 8; 0 = every queue has its own
    /// files, as before the shared index).
    pub small_queue_entries: u64,
    /// Entries per shared-index segment (default 32,768: 1.25 MiB files).
    pub shared_index_segment_entries: u64,
    pub index: IndexConfig,
    pub flush: FlushMode,
    /// How often consume queues and ack state are flushed and the checkpoint written.
    pub checkpoint_interval: Duration,
    /// How often unneeded segments and files are deleted.
    pub retention_interval: Duration,
    /// Cut the log at corruption inside a sealed segment instead of refusing to start.
    pub repair: bool,
    /// The metadata journal is compacted once past this size and twice its last snapshot
    /// (default [`crate::journal::COMPACT_MIN`]).
    pub meta_compact_bytes: u64,
    /// Replication (issue 18): the leader's gate; `None` without `[cluster]`.
    pub replica: Option<Arc<crate::replica::ReplicaGate>>,
}

impl StoreConfig {
    pub fn new(dir: impl Into<PathBuf>) -> StoreConfig {
        StoreConfig {
            dir: dir.into(),
            segment_size: 1 << 30,
            cq_entries_per_file: 300_000,
            small_queue_entries: 64,
            shared_index_segment_entries: 32_768,
            index: IndexConfig::default(),
            flush: FlushMode::Sync,
            checkpoint_interval: Duration::from_secs(1),
            retention_interval: Duration::from_secs(10),
            repair: false,
            meta_compact_bytes: crate::journal::COMPACT_MIN,
            replica: None,
        }
    }
}

/// What an append produced.
#[derive(Debug)]
pub struct Appended {
    pub commit_offset: u64,
    pub size: u32,
    /// The logical offset the message got in each target queue, in the order given.
    pub queue_offsets: Vec<(QueueId, u64)>,
    /// Completes once the message is on disk (at once in async mode).
    pub durable: Durable,
    /// The stored body, zero copy from the commitlog's mapping: what a consumer that takes
    /// the message at once can be handed without holding the publisher's buffer in heap.
    /// `None` only if the mapping could not be sliced (never expected).
    pub body: Option<bytes::Bytes>,
}

/// A queue as the store sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueInfo {
    pub id: QueueId,
    pub vhost: String,
    pub name: String,
    pub durable: bool,
    /// First entry still held.
    pub min_offset: u64,
    /// One past the last entry.
    pub next_offset: u64,
    /// Lowest entry not yet acked.
    pub ack_head: u64,
    /// Acked entries above the head.
    pub acked_above_head: u64,
}

impl QueueInfo {
    /// Entries not yet acked.
    pub fn pending(&self) -> u64 {
        self.next_offset
            .saturating_sub(self.ack_head)
            .saturating_sub(self.acked_above_head)
    }
}

/// Counters for monitoring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreStats {
    pub commitlog_min: u64,
    pub commitlog_end: u64,
    pub flushed: u64,
    pub checkpoint: u64,
    pub segments: usize,
    pub queues: usize,
    /// Bytes of the commitlog's segment files on disk (each preallocated whole).
    pub segment_bytes: u64,
    /// Records appended since the store opened (compaction's copies included).
    pub appends: u64,
    /// Segments compacted since the store opened (live records copied forward, the
    /// segment deleted).
    pub compactions: u64,
    /// Bytes those compactions gave back (segment size less the bytes copied).
    pub compacted_bytes_reclaimed: u64,
    /// Segments deleted since the store opened (no queue needed them, or compacted).
    pub segments_deleted: u64,
    /// Appends that waited for a retention pass before sealing a segment, and those of
    /// them whose wait ended at its limit instead (see `Inner::wait_for_pass`).
    pub pass_waits: u64,
    pub pass_wait_timeouts: u64,
}

/// The queues by id. Looked up several times per message: foldhash, not SipHash.
type QueueMap = HashMap<QueueId, Arc<QueueState>, foldhash::fast::RandomState>;

struct QueueState {
    rec: QueueRecord,
    dir: PathBuf,
    cq: ConsumeQueue,
    ack: Mutex<AckState>,
    /// One past the highest entry ever handed to a consumer (or, after a crash, every
    /// entry the queue had).
    delivered: AtomicU64,
    /// Its ack state or `delivered` changed since the last checkpoint journaled them.
    dirty: AtomicBool,
}

impl QueueState {
    fn ack(&self) -> MutexGuard<'_, AckState> {
        self.ack.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Inner {
    cfg: StoreConfig,
    log: CommitLog,
    writer: Mutex<Writer>,
    queues: RwLock<QueueMap>,
    registry: Mutex<RegState>,
    index: IndexService,
    /// Makes small queues' entries durable; `None` when `small_queue_entries` is 0.
    shared: Option<Arc<SharedIndex>>,
    meta: MetaStore,
    journal: MetaJournal,
    flush: Arc<FlushShared>,
    /// Commitlog offset of the last checkpoint; the lock also serialises checkpoints.
    checkpoint: Mutex<u64>,
    /// The log's end after the last record compaction copied forward: segments are
    /// deleted only once the log is flushed up to it.
    copied_to: AtomicU64,
    /// How long the last retention pass took to count live bytes (paces the passes).
    live_walk_ns: AtomicU64,
    /// Live bytes the last retention pass counted in the sealed segments it kept: what
    /// a pass held back by its pacing may lean on (see `Inner::maintenance`).
    kept_live: AtomicU64,
    /// Segments compacted, the bytes that gave back, and segments deleted, since open
    /// (`/metrics`; counted by the retention pass, never on a message path).
    compactions: AtomicU64,
    compacted_reclaimed: AtomicU64,
    segments_deleted: AtomicU64,
    pass_waits: AtomicU64,
    pass_wait_timeouts: AtomicU64,
    /// Set when a write failed for want of space (a new segment could not be
    /// preallocated); the broker raises its disk alarm until enough space is free again.
    disk_full: AtomicBool,
    /// Delivery counts read at open, until each queue's owner takes its own
    /// (see [`crate::returns`]).
    loaded_counts: Mutex<crate::returns::Loaded>,
    /// Set by an append that sealed a segment: the maintenance thread checkpoints past it
    /// and runs a retention pass at once instead of at its next period (in `async` mode a
    /// segment can fill faster than the period, and each period a sealed segment waits
    /// is disk the bound 2 × live + 2 segments does not have).
    sealed: AtomicBool,
    /// Segments sealed, and how many of those the last finished retention pass covered:
    /// while a sealed segment awaits its pass, no segment is created ahead, and an append
    /// that would seal the next one waits for the pass (see `Inner::wait_for_pass`).
    seals: Mutex<Seals>,
    passed_cv: Condvar,
    /// Serialises retention passes (the maintenance thread's and [`Store::run_retention`]'s).
    pass: Mutex<()>,
    stop: Mutex<bool>,
    stop_cv: Condvar,
    _lock: File,
}

/// Segments sealed and segments covered by a finished retention pass (counts since open).
#[derive(Default)]
struct Seals {
    sealed: u64,
    passed: u64,
}

/// The durable store. Dropping it closes it cleanly; share it with `Arc<Store>`.
pub struct Store {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
    closed: bool,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Store {
    /// `Err(Fatal)` once a flush failed: the store takes no more writes and the broker
    /// must stop.
    pub fn health(&self) -> Result<()> {
        self.inner.flush.check()
    }

    /// Whether a write was refused for want of disk space (a new commitlog segment could
    /// not be preallocated) since the last [`Store::clear_disk_full`]. The broker keeps its
    /// disk alarm raised meanwhile, so publishers are blocked rather than refused.
    pub fn disk_full(&self) -> bool {
        self.inner.disk_full.load(Ordering::Acquire)
    }

    /// Forgets an earlier [`Store::disk_full`] (space was freed); the next write tries again.
    pub fn clear_disk_full(&self) {
        self.inner.disk_full.store(false, Ordering::Release);
    }

    /// The size every commitlog segment is preallocated to: the free space the store
    /// needs before it can start its next segment.
    pub fn segment_size(&self) -> u64 {
        self.inner.cfg.segment_size
    }

    /// The store's metadata documents (as earlier versions wrote them; read once at start
    /// to move them into the journal).
    pub fn meta(&self) -> &MetaStore {
        &self.inner.meta
    }

    /// The metadata journal: every durable metadata change is one record in it.
    pub fn journal(&self) -> &MetaJournal {
        &self.inner.journal
    }

    /// The replica gate deliveries wait on: `Some` only in `replication.mode = sync`
    /// (see [`ReplicaGate::reached_or_wake`]).
    pub fn delivery_gate(&self) -> Option<&Arc<crate::replica::ReplicaGate>> {
        self.inner.cfg.replica.as_ref().filter(|g| g.is_sync())
    }

    /// The commitlog, for replication (issue 18) to read raw bytes from.
    pub fn commitlog(&self) -> &CommitLog {
        &self.inner.log
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.inner.cfg.dir
    }

    /// Appends a message for `msg.queues`; see [`Appended`].
    pub fn append(&self, msg: &NewMessage<'_>) -> Result<Appended> {
        self.inner.append(msg)
    }

    /// Acks entries of a queue (idempotent). The returned handle completes when the ack
    /// is durable; callers need not wait for it.
    pub fn ack(&self, queue: QueueId, offsets: &[u64]) -> Result<Durable> {
        if let [o] = offsets {
            // One ack per delivery (no-ack consumers, single acks): no sorting, no vectors.
            return self.inner.ack_ranges(queue, &[(*o, o.saturating_add(1))]);
        }
        let mut sorted = offsets.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for o in sorted {
            match ranges.last_mut() {
                Some((_, e)) if *e == o => *e = o + 1,
                _ => ranges.push((o, o + 1)),
            }
        }
        if ranges.is_empty() {
            return Ok(Durable::ready());
        }
        self.inner.ack_ranges(queue, &ranges)
    }

    /// Acks every entry in `start..end` (purge).
    pub fn ack_range(&self, queue: QueueId, start: u64, end: u64) -> Result<Durable> {
        if start >= end {
            return Ok(Durable::ready());
        }
        self.inner.ack_ranges(queue, &[(start, end)])
    }

    /// The consume-queue entry `logical` of `queue`.
    pub fn entry(&self, queue: QueueId, logical: u64) -> Option<CqEntry> {
        self.inner.queue(queue).ok()?.cq.get(logical)
    }

    /// The record at a commitlog offset (zero copy; checksum verified).
    pub fn read(&self, commit_offset: u64) -> Result<StoredRecord> {
        self.inner.log.read(commit_offset)
    }

    /// The record of entry `logical` of `queue` whose commit offset the caller noted as
    /// `commit_offset`: read there, or, if compaction moved the record since (its old
    /// segment is gone), wherever the entry points now.
    pub fn read_entry(
        &self,
        queue: QueueId,
        logical: u64,
        commit_offset: u64,
    ) -> Result<StoredRecord> {
        match self.inner.log.read(commit_offset) {
            Err(StoreError::NotFound(why)) => match self.entry(queue, logical) {
                Some(e) if e.commit_offset != commit_offset => self.inner.log.read(e.commit_offset),
                _ => Err(StoreError::NotFound(why)),
            },
            r => r,
        }
    }

    /// Entry `logical` of `queue` and its record, or `None` past the end.
    pub fn read_queue(
        &self,
        queue: QueueId,
        logical: u64,
    ) -> Result<Option<(CqEntry, StoredRecord)>> {
        let q = self.inner.queue(queue)?;
        match q.cq.get(logical) {
            Some(e) => {
                let rec = self.read_entry(queue, logical, e.commit_offset)?;
                Ok(Some((e, rec)))
            }
            None => Ok(None),
        }
    }

    /// One past the last entry of `queue` (cheap: no locks beyond the queue map's).
    pub fn queue_next_offset(&self, queue: QueueId) -> Result<u64> {
        Ok(self.inner.queue(queue)?.cq.next_offset())
    }

    /// Whether entry `logical` of `queue` has been acked.
    pub fn is_acked(&self, queue: QueueId, logical: u64) -> Result<bool> {
        Ok(self.inner.queue(queue)?.ack().is_acked(logical))
    }

    /// Up to `max` unacked entries of `queue` from its ack head, ascending.
    pub fn unacked(&self, queue: QueueId, max: usize) -> Result<Vec<u64>> {
        self.unacked_from(queue, 0, max)
    }

    /// As [`Store::unacked`], the entries from logical offset `from` on (to walk a long
    /// queue in bounded batches).
    pub fn unacked_from(&self, queue: QueueId, from: u64, max: usize) -> Result<Vec<u64>> {
        let q = self.inner.queue(queue)?;
        let end = q.cq.next_offset();
        let out = q.ack().unacked_from(from, end, max);
        Ok(out)
    }

    /// Notes that entry `logical` was handed to a consumer.
    pub fn mark_delivered(&self, queue: QueueId, logical: u64) -> Result<()> {
        let q = self.inner.queue(queue)?;
        if q.delivered.fetch_max(logical + 1, Ordering::Relaxed) <= logical {
            q.dirty.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Whether entry `logical` may have been delivered before (AMQP `redelivered`): true
    /// for anything at or below the highest entry delivered, which after a crash is every
    /// entry the queue held.
    pub fn may_have_been_delivered(&self, queue: QueueId, logical: u64) -> Result<bool> {
        Ok(logical < self.inner.queue(queue)?.delivered.load(Ordering::Relaxed))
    }

    /// Whether `queue` is registered and durable.
    pub fn is_durable_queue(&self, queue: QueueId) -> bool {
        self.inner.queue(queue).is_ok_and(|q| q.rec.durable)
    }

    /// The delivery counts ([`crate::returns`]) stored for `queue` when the store
    /// opened, as `(offset, count)`; a second call (or a queue created since) gets none.
    pub fn take_delivery_counts(&self, queue: QueueId) -> Vec<(u64, u32)> {
        self.take_returns(queue)
            .into_iter()
            .map(|r| (r.offset, r.count))
            .collect()
    }

    /// As [`Store::take_delivery_counts`], with each one's back-off wait.
    pub fn take_returns(&self, queue: QueueId) -> Vec<crate::returns::Returned> {
        lock(&self.inner.loaded_counts)
            .remove(&queue)
            .unwrap_or_default()
    }

    /// Registers a queue (idempotent for the same vhost and name) and returns its id once
    /// its registration is on disk. Transient (`durable == false`) queues are removed at
    /// the next start.
    pub fn create_queue(&self, vhost: &str, name: &str, durable: bool) -> Result<QueueId> {
        let (id, durable) = self.inner.create_queue(vhost, name, durable)?;
        durable.wait()?;
        Ok(id)
    }

    /// As [`Store::create_queue`], without waiting: the registration is durable once the
    /// returned handle completes, or once any later metadata journal record is durable
    /// (the journal is ordered), which is how a caller that journals its own record of
    /// the queue next waits for both with one flush.
    pub fn create_queue_deferred(
        &self,
        vhost: &str,
        name: &str,
        durable: bool,
    ) -> Result<(QueueId, Durable)> {
        self.inner.create_queue(vhost, name, durable)
    }

    /// The id of a registered queue.
    pub fn find_queue(&self, vhost: &str, name: &str) -> Option<QueueId> {
        lock(&self.inner.registry)
            .by_name
            .get(&(vhost.to_string(), name.to_string()))
            .copied()
    }

    /// Removes a queue and then, once its removal is on disk, its files. Its messages stay
    /// in the commitlog until retention.
    pub fn delete_queue(&self, queue: QueueId) -> Result<()> {
        self.inner.delete_queue(queue)
    }

    /// Every registered queue.
    pub fn queues(&self) -> Vec<QueueInfo> {
        let qs = self.inner.queues.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<QueueInfo> = qs.values().map(|q| info(q)).collect();
        out.sort_by_key(|q| q.id);
        out
    }

    /// One queue.
    pub fn queue_info(&self, queue: QueueId) -> Result<QueueInfo> {
        Ok(info(self.inner.queue(queue)?.as_ref()))
    }

    /// Messages indexed under `key`, newest first, at most `max`.
    pub fn lookup_key(&self, key: &[u8], max: usize) -> Result<Vec<StoredRecord>> {
        self.lookup_key_between(key, max, 0, u64::MAX)
    }

    /// Messages indexed under `key` and stored within `from_ms..=to_ms` (store time, ms
    /// since the epoch), newest first, at most `max`.
    pub fn lookup_key_between(
        &self,
        key: &[u8],
        max: usize,
        from_ms: u64,
        to_ms: u64,
    ) -> Result<Vec<StoredRecord>> {
        let cands = self
            .inner
            .index
            .lookup(key, max.saturating_mul(4).max(16), from_ms, to_ms)?;
        let mut out = Vec::new();
        for off in cands {
            if out.len() >= max {
                break;
            }
            if let Ok(r) = self.inner.log.read(off) {
                // compaction indexes a copy under the same keys; until the original's
                // segment is deleted both are found: one message, listed once
                let copy_of = |o: &StoredRecord| {
                    o.store_ts_ms == r.store_ts_ms
                        && o.born_ts_ms == r.born_ts_ms
                        && o.properties == r.properties
                        && o.body == r.body
                };
                // the index keeps seconds: the exact time is the record's
                let in_range = (from_ms..=to_ms).contains(&r.store_ts_ms);
                if in_range
                    && r.keys().iter().any(|k| k.as_ref() == key)
                    && !out.iter().any(copy_of)
                {
                    out.push(r);
                }
            }
        }
        Ok(out)
    }

    /// Flushes everything appended so far (also in async mode).
    pub fn flush(&self) -> Result<()> {
        self.inner.flush_to(self.inner.log.end())
    }

    /// Writes a checkpoint now.
    pub fn checkpoint(&self) -> Result<()> {
        self.inner.checkpoint()
    }

    /// Copies up to `max` live records of the oldest sealed segment below the checkpoint
    /// forward, as compaction does, and deletes nothing: a crash test's way to stop a
    /// compaction half-way. Returns the records copied.
    #[doc(hidden)]
    pub fn compact_partly(&self, max: usize) -> Result<usize> {
        let _pass = lock(&self.inner.pass);
        let ckpt = *lock(&self.inner.checkpoint);
        let Some(seg) = self
            .inner
            .log
            .sealed_segments()
            .into_iter()
            .find(|s| s.end() <= ckpt)
        else {
            return Ok(0);
        };
        Ok(self.inner.copy_live(seg.start(), max)?.1)
    }

    /// Deletes segments and files no queue needs any more and compacts segments with
    /// little live data (see the module notes); returns the segments deleted.
    pub fn run_retention(&self) -> Result<usize> {
        self.inner.retention()
    }

    pub fn stats(&self) -> StoreStats {
        let segments = self.inner.log.segment_list().len();
        StoreStats {
            commitlog_min: self.inner.log.min_offset(),
            commitlog_end: self.inner.log.end(),
            flushed: self.inner.flush.flushed(),
            checkpoint: *lock(&self.inner.checkpoint),
            segments,
            segment_bytes: (segments as u64).saturating_mul(self.inner.cfg.segment_size),
            appends: self.inner.writer().appends(),
            compactions: self.inner.compactions.load(Ordering::Relaxed),
            compacted_bytes_reclaimed: self.inner.compacted_reclaimed.load(Ordering::Relaxed),
            segments_deleted: self.inner.segments_deleted.load(Ordering::Relaxed),
            pass_waits: self.inner.pass_waits.load(Ordering::Relaxed),
            pass_wait_timeouts: self.inner.pass_wait_timeouts.load(Ordering::Relaxed),
            queues: self
                .inner
                .queues
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .len(),
        }
    }

    /// The commitlog flushes' durations and sizes (fsync latency, group-commit batches).
    pub fn flush_stats(&self) -> &crate::flush::FlushStats {
        &self.inner.flush.stats
    }

    /// Paths of the commitlog segments, oldest first (for tests and tools).
    pub fn segment_paths(&self) -> Vec<PathBuf> {
        self.inner
            .log
            .segment_list()
            .iter()
            .map(|s| s.path().to_path_buf())
            .collect()
    }

    fn stop_threads(&mut self) {
        *lock(&self.inner.stop) = true;
        self.inner.stop_cv.notify_all();
        self.inner.flush.shutdown();
        self.inner.log.stop_warming();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    /// Clean shutdown: flush, checkpoint, remove the `abort` marker (last).
    pub fn close(mut self) -> Result<()> {
        self.close_inner()
    }

    fn close_inner(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.stop_threads();
        self.inner.flush.check()?;
        self.inner.checkpoint()?;
        self.inner.journal.close();
        let abort = self.inner.cfg.dir.join("abort");
        std::fs::remove_file(&abort).map_err(StoreError::at(&abort))?;
        sync_dir(&self.inner.cfg.dir)
    }

    /// Stops without a final checkpoint and leaves the `abort` marker, as `kill -9`
    /// would (what was written to the mappings stays in the page cache). For crash tests.
    #[doc(hidden)]
    pub fn abandon(mut self) {
        self.closed = true;
        *lock(&self.inner.stop) = true;
        self.inner.stop_cv.notify_all();
        self.inner.flush.fail("abandoned".into());
        self.inner.log.stop_warming();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Err(e) = self.close_inner() {
            tracing::error!(error = %e, "store: unclean close");
        }
    }
}

fn info(q: &QueueState) -> QueueInfo {
    let a = q.ack();
    QueueInfo {
        id: q.rec.id,
        vhost: q.rec.vhost.clone(),
        name: q.rec.name.clone(),
        durable: q.rec.durable,
        min_offset: q.cq.min_offset(),
        next_offset: q.cq.next_offset(),
        ack_head: a.head(),
        acked_above_head: a.acked_above_head(),
    }
}

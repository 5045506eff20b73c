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
//!
//! Cost of a queue: an idle or near-empty durable queue owns no file and no mapping;
//! 40 bytes of shared index and 24 bytes of heap per entry held, plus its `QueueState`.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::ack::AckState;
use crate::commitlog::{CommitLog, StoredRecord, Writer};
use crate::consumequeue::{ConsumeQueue, CqEntry, SmallConfig};
use crate::error::{Result, StoreError};
use crate::file::{sync_dir, write_atomic};
use crate::flush::{Durable, FlushMode, FlushShared};
use crate::index::{IndexConfig, IndexService};
use crate::journal::{MetaJournal, MetaOp};
use crate::meta::MetaStore;
use crate::record::{self, Decoded, NewMessage};
use crate::smallcq::{SharedIndex, SharedRecord};

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
}

#[derive(Serialize, Deserialize, Clone, Debug)]
struct QueueRecord {
    id: QueueId,
    vhost: String,
    name: String,
    durable: bool,
    dir: String,
}

/// The queue registry as an earlier version kept it: one JSON document rewritten whole
/// on every change. Read once at start, moved into the journal, then removed.
#[derive(Serialize, Deserialize, Default, Clone, Debug)]
struct Registry {
    next_id: QueueId,
    queues: Vec<QueueRecord>,
}

const LEGACY_REGISTRY: &str = "store-queues";
/// Transient queue ids are reserved in blocks of this many (one journal record each).
const ID_BLOCK: QueueId = 1024;
/// Journal key tag of a durable queue's record (`Q` + big-endian id).
const TAG_QUEUE: u8 = b'Q';
/// Journal key of the id ceiling: no id at or above it was ever handed out.
const KEY_NEXT_ID: &[u8] = b"N";

fn queue_key(id: QueueId) -> Vec<u8> {
    let mut k = vec![TAG_QUEUE];
    k.extend_from_slice(&id.to_be_bytes());
    k
}

/// The durable queues and the id ceiling, from the journal (importing an earlier
/// version's registry document the first time).
fn load_registry(journal: &MetaJournal, meta: &MetaStore) -> Result<Registry> {
    if let Some(legacy) = meta.get::<Registry>(LEGACY_REGISTRY)? {
        if journal.get(KEY_NEXT_ID)?.is_none() {
            let mut ops = Vec::with_capacity(legacy.queues.len() + 1);
            for q in legacy.queues.iter().filter(|q| q.durable) {
                ops.push(MetaOp::put(queue_key(q.id), encode_queue_record(q)?));
            }
            ops.push(MetaOp::put(
                KEY_NEXT_ID.to_vec(),
                legacy.next_id.to_le_bytes().to_vec(),
            ));
            journal.commit(ops)?;
            tracing::info!(
                queues = legacy.queues.len(),
                "store: moved the queue registry document into the metadata journal"
            );
        }
        meta.delete(LEGACY_REGISTRY)?;
    }
    let next_id = journal
        .get(KEY_NEXT_ID)?
        .and_then(|v| v.as_slice().try_into().ok().map(u32::from_le_bytes))
        .unwrap_or(0);
    let mut queues = Vec::new();
    for (k, v) in journal.scan(&[TAG_QUEUE])? {
        let rec: QueueRecord = serde_json::from_slice(&v).map_err(|e| StoreError::Corrupt {
            path: PathBuf::from("meta/journal"),
            offset: 0,
            reason: format!("queue record {k:?}: {e}"),
        })?;
        queues.push(rec);
    }
    Ok(Registry { next_id, queues })
}

/// Journal key tag of a durable queue's ack state as of the last checkpoint (`A` +
/// big-endian id); the value is `u64 delivered` then the encoded [`AckState`].
const TAG_ACK: u8 = b'A';
/// Ack states are journaled in records of about this size at most.
const ACK_RECORD_BYTES: usize = 4 << 20;

fn ack_key(id: QueueId) -> Vec<u8> {
    let mut k = vec![TAG_ACK];
    k.extend_from_slice(&id.to_be_bytes());
    k
}

fn decode_ack_value(v: &[u8]) -> Option<(u64, AckState)> {
    let (delivered, ack) = v.split_first_chunk::<8>()?;
    Some((u64::from_le_bytes(*delivered), AckState::decode(ack).ok()?))
}

fn encode_queue_record(q: &QueueRecord) -> Result<Vec<u8>> {
    serde_json::to_vec(q).map_err(|e| StoreError::Invalid(format!("queue record: {e}")))
}

/// The id ceiling on disk and the next id to hand out.
struct RegState {
    /// The id ceiling recorded in the journal.
    next_id: QueueId,
    next_free: QueueId,
    /// (vhost, name) → id of every registered queue, durable or not.
    by_name: HashMap<(String, String), QueueId>,
}

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
    /// Looked up several times per message: foldhash, not SipHash.
    queues: RwLock<HashMap<QueueId, Arc<QueueState>, foldhash::fast::RandomState>>,
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
    /// Segments compacted, the bytes that gave back, and segments deleted, since open
    /// (`/metrics`; counted by the retention pass, never on a message path).
    compactions: AtomicU64,
    compacted_reclaimed: AtomicU64,
    segments_deleted: AtomicU64,
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
    /// Serialises retention passes (the maintenance thread's and [`Store::run_retention`]'s).
    pass: Mutex<()>,
    stop: Mutex<bool>,
    stop_cv: Condvar,
    _lock: File,
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

/// A file-system-safe, reversible name: bytes outside `[A-Za-z0-9_-]` (and a leading
/// dot) are percent-encoded; very long names are cut and suffixed with the queue id.
fn dir_name(name: &str, id: Option<QueueId>) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (b == b'.' && !out.is_empty()) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    if out.is_empty() {
        out.push('%');
    }
    match id {
        Some(id) if out.len() > 200 => format!("{}~{id}", out.get(..180).unwrap_or("")),
        _ => out,
    }
}

impl Store {
    /// Opens (creating) the store in `cfg.dir`: takes the lock, recovers, starts the
    /// flusher and the maintenance thread.
    pub fn open(cfg: StoreConfig) -> Result<Store> {
        let dir = cfg.dir.clone();
        std::fs::create_dir_all(&dir).map_err(StoreError::at(&dir))?;
        let lock_path = dir.join("lock");
        let lock_file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(StoreError::at(&lock_path))?;
        match lock_file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Err(StoreError::Locked(dir)),
            Err(std::fs::TryLockError::Error(e)) => return Err(StoreError::io(&lock_path, e)),
        }
        let abort_path = dir.join("abort");
        let unclean = abort_path.exists();

        let meta = MetaStore::open(&dir.join("meta"))?;
        let journal = MetaJournal::open(&dir.join("meta"), cfg.meta_compact_bytes)?;
        let log = CommitLog::open(&dir.join("commitlog"), cfg.segment_size)?;
        let index = IndexService::open(&dir.join("index"), cfg.index)?;
        let (ckpt_offset, mut snapshot) = read_checkpoint(&dir.join("checkpoint"), cfg.repair)?;
        let legacy_snapshot = !snapshot.is_empty();
        for (k, v) in journal.scan(&[TAG_ACK])? {
            let id = k
                .get(1..5)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_be_bytes);
            match (id, decode_ack_value(&v)) {
                (Some(id), Some(state)) => {
                    snapshot.insert(id, state);
                }
                _ => {
                    return Err(StoreError::Corrupt {
                        path: dir.join("meta"),
                        offset: 0,
                        reason: format!("bad ack state record {k:?}"),
                    })
                }
            }
        }

        // Queues: transient ones vanish at every start, unknown directories are leftovers.
        // Transient queues are never in the registry; their leftover directories are
        // orphans like those of queues deleted just before a crash.
        let registry = load_registry(&journal, &meta)?;
        let loaded_counts = crate::returns::load(&journal)?;
        let cq_root = dir.join("consumequeue");
        remove_orphans(&cq_root, &registry)?;
        // Queue directories appear later (a queue that outgrows the shared index); their
        // root exists from the start, so the data directory's fsync below covers it.
        std::fs::create_dir_all(&cq_root).map_err(StoreError::at(&cq_root))?;

        // Small queues' entries, grouped by queue (in append order within each).
        let (shared, mut loaded) = open_shared(&dir, &cfg)?;
        let mut queues = HashMap::with_hasher(foldhash::fast::RandomState::default());
        for rec in &registry.queues {
            let qdir = queue_dir(&cq_root, rec);
            let head = snapshot.get(&rec.id).map_or(0, |(_, a)| a.head());
            let mine = loaded.remove(&rec.id).unwrap_or_default();
            let cq = open_cq(&qdir, &cfg, &shared, rec, &mine, head)?;
            drop(mine);
            let (ack, delivered) = match snapshot.get(&rec.id) {
                Some((delivered, ack)) => (ack.clone(), *delivered),
                None => (AckState::new(cq.min_offset()), 0),
            };
            let ack = if ack.head() < cq.min_offset() {
                let mut a = ack;
                a.ack_range(a.head(), cq.min_offset());
                a
            } else {
                ack
            };
            queues.insert(
                rec.id,
                Arc::new(QueueState {
                    rec: rec.clone(),
                    dir: qdir,
                    cq,
                    ack: Mutex::new(ack),
                    delivered: AtomicU64::new(delivered),
                    // an earlier version's checkpoint held every queue's ack state: the
                    // first checkpoint moves them into the journal
                    dirty: AtomicBool::new(legacy_snapshot),
                }),
            );
        }

        // Replay the log from the checkpoint: consume-queue entries, index keys, acks.
        let mut replayed = 0u64;
        let recovered = log.recover(ckpt_offset, unclean, cfg.repair, |off, d| {
            replayed += 1;
            match d {
                Decoded::Message { len, view } => {
                    let size = u32::try_from(*len).unwrap_or(u32::MAX);
                    for (qid, qoff) in view.queues() {
                        if let Some(q) = queues.get(&qid) {
                            let entry = CqEntry {
                                commit_offset: off,
                                size,
                                tag_hash: view.tag_hash,
                            };
                            q.cq.put(qoff, entry)?;
                        }
                    }
                    for key in view.keys() {
                        index.put(key, off, view.store_ts_ms)?;
                    }
                }
                Decoded::Ack { view, .. } => {
                    if let Some(q) = queues.get(&view.queue) {
                        let mut a = q.ack();
                        for (s, e) in view.ranges() {
                            a.ack_range(s, e);
                        }
                        // the next checkpoint moves past this record: journal the state
                        q.dirty.store(true, Ordering::Relaxed);
                    }
                }
                _ => {}
            }
            Ok(())
        })?;
        drop(loaded);
        for q in queues.values() {
            q.cq.truncate_commit_from(recovered.end)?;
            let head = q.ack().head();
            q.cq.ensure_next(head)?;
            if unclean {
                q.delivered.store(q.cq.next_offset(), Ordering::Relaxed);
                q.dirty.store(true, Ordering::Relaxed);
            }
        }
        // The shared index now holds exactly the live entries: move them out of the
        // segments found at start (which may hold entries this recovery cut) and delete those.
        if let Some(sh) = &shared {
            let old = sh.opened_segments().to_vec();
            for q in queues.values() {
                q.cq.relocate(&old)?;
            }
            sh.retire()?;
        }
        if unclean || recovered.truncated {
            tracing::info!(
                dir = %dir.display(), from = ckpt_offset, end = recovered.end, records = replayed,
                truncated = recovered.truncated, "store recovered after an unclean shutdown"
            );
        }

        let writer = log.writer()?;
        let flush = FlushShared::new(recovered.end);
        if let Some(gate) = &cfg.replica {
            flush.set_gate(gate.clone()); // replication (issue 18)
        }
        let inner = Arc::new(Inner {
            cfg: cfg.clone(),
            log,
            writer: Mutex::new(writer),
            queues: RwLock::new(queues),
            registry: Mutex::new(RegState {
                next_free: registry.next_id,
                by_name: registry
                    .queues
                    .iter()
                    .map(|q| ((q.vhost.clone(), q.name.clone()), q.id))
                    .collect(),
                next_id: registry.next_id,
            }),
            index,
            shared,
            meta,
            journal,
            flush,
            checkpoint: Mutex::new(ckpt_offset),
            copied_to: AtomicU64::new(0),
            live_walk_ns: AtomicU64::new(0),
            compactions: AtomicU64::new(0),
            compacted_reclaimed: AtomicU64::new(0),
            segments_deleted: AtomicU64::new(0),
            disk_full: AtomicBool::new(false),
            loaded_counts: Mutex::new(loaded_counts),
            sealed: AtomicBool::new(false),
            pass: Mutex::new(()),
            stop: Mutex::new(false),
            stop_cv: Condvar::new(),
            _lock: lock_file,
        });
        // A fresh checkpoint at the recovered end, so the next crash replays only new data.
        if unclean || recovered.end != ckpt_offset {
            inner.checkpoint()?;
        }
        File::create(&abort_path)
            .and_then(|f| f.sync_all())
            .map_err(StoreError::at(&abort_path))?;
        sync_dir(&dir)?;

        let mut threads = Vec::new();
        let i = inner.clone();
        threads.push(
            std::thread::Builder::new()
                .name("store-flush".into())
                .spawn(move || i.flusher())
                .map_err(StoreError::at(&dir))?,
        );
        let i = inner.clone();
        threads.push(
            std::thread::Builder::new()
                .name("store-maint".into())
                .spawn(move || i.maintenance())
                .map_err(StoreError::at(&dir))?,
        );
        let i = inner.clone();
        threads.push(
            std::thread::Builder::new()
                .name("store-warm".into())
                .spawn(move || i.log.warm_ahead())
                .map_err(StoreError::at(&dir))?,
        );
        Ok(Store {
            inner,
            threads,
            closed: false,
        })
    }

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

fn queue_dir(root: &Path, q: &QueueRecord) -> PathBuf {
    root.join(dir_name(&q.vhost, None)).join(&q.dir)
}

/// Opens the shared index (when small queues are on) and groups what it holds by queue.
#[allow(clippy::type_complexity)]
fn open_shared(
    dir: &Path,
    cfg: &StoreConfig,
) -> Result<(
    Option<Arc<SharedIndex>>,
    HashMap<QueueId, Vec<SharedRecord>>,
)> {
    let mut by_queue: HashMap<QueueId, Vec<SharedRecord>> = HashMap::new();
    if cfg.small_queue_entries == 0 {
        return Ok((None, by_queue));
    }
    let (shared, records) =
        SharedIndex::open(&dir.join("sharedcq"), cfg.shared_index_segment_entries)?;
    for r in records {
        by_queue.entry(r.queue).or_default().push(r);
    }
    Ok((Some(Arc::new(shared)), by_queue))
}

/// A queue's consume queue: small while it holds few entries unless that is off.
fn open_cq(
    qdir: &Path,
    cfg: &StoreConfig,
    shared: &Option<Arc<SharedIndex>>,
    rec: &QueueRecord,
    loaded: &[SharedRecord],
    ack_head: u64,
) -> Result<ConsumeQueue> {
    if cfg.small_queue_entries == 0 {
        return ConsumeQueue::open(qdir, cfg.cq_entries_per_file);
    }
    let small = SmallConfig {
        shared: shared.clone().filter(|_| rec.durable),
        id: rec.id,
        max: cfg.small_queue_entries,
    };
    ConsumeQueue::open_small(qdir, cfg.cq_entries_per_file, small, loaded, ack_head)
}

fn remove_dir_if_exists(p: &Path) -> Result<()> {
    match std::fs::remove_dir_all(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::io(p, e)),
    }
}

/// Removes consume-queue directories no registered queue owns (a crash between
/// unregistering a queue and deleting its files).
fn remove_orphans(root: &Path, reg: &Registry) -> Result<()> {
    let Ok(vhosts) = std::fs::read_dir(root) else {
        return Ok(());
    };
    let known: std::collections::HashSet<PathBuf> =
        reg.queues.iter().map(|q| queue_dir(root, q)).collect();
    for vh in vhosts.flatten() {
        let Ok(qs) = std::fs::read_dir(vh.path()) else {
            continue;
        };
        for q in qs.flatten() {
            if !known.contains(&q.path()) {
                tracing::info!(path = %q.path().display(), "store: removing an orphaned consume queue");
                remove_dir_if_exists(&q.path())?;
            }
        }
    }
    Ok(())
}

impl Inner {
    fn queue(&self, id: QueueId) -> Result<Arc<QueueState>> {
        self.queues
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
            .ok_or_else(|| StoreError::NotFound(format!("queue {id}")))
    }

    fn writer(&self) -> MutexGuard<'_, Writer> {
        lock(&self.writer)
    }

    /// Tells the flusher about new bytes and returns what to wait on.
    fn after_append(&self, end: u64) -> Durable {
        match self.cfg.flush {
            FlushMode::Sync => {
                // no wake-up here: the flusher runs once somebody waits (Durable)
                self.flush.appended(end, u64::MAX);
                Durable::new(end, self.flush.clone())
            }
            FlushMode::Async { dirty_bytes, .. } => {
                let flushed = self.flush.appended(end, dirty_bytes);
                // Appends are durable at once, unless they outrun the disk: past
                // ASYNC_BACKLOG_FLUSHES flushes' worth of unflushed bytes, an append's
                // Durable waits until the flusher has brought the backlog back to that.
                // The append itself returns now: this slows the publishers that wait for
                // their confirms (receipts, PUBACKs), not those that wait for none. It
                // bounds the backlog (and the log the checkpoint cannot pass) for the
                // former only.
                match async_wait(end, flushed, dirty_bytes) {
                    Some(offset) => Durable::new(offset, self.flush.clone()),
                    None => Durable::ready(),
                }
            }
        }
    }

    fn append(&self, msg: &NewMessage<'_>) -> Result<Appended> {
        self.flush.check()?;
        if msg.queues.is_empty() {
            return Err(StoreError::Invalid(
                "a message needs at least one queue".into(),
            ));
        }
        let len = record::message_len(msg)? as u64;
        let size = u32::try_from(len).map_err(|_| StoreError::TooLarge {
            size: len,
            max: u32::MAX as u64,
        })?;
        let qs: Vec<Arc<QueueState>> = {
            let map = self.queues.read().unwrap_or_else(|e| e.into_inner());
            msg.queues
                .iter()
                .map(|id| {
                    map.get(id)
                        .cloned()
                        .ok_or_else(|| StoreError::NotFound(format!("queue {id}")))
                })
                .collect::<Result<_>>()?
        };
        for (i, q) in msg.queues.iter().enumerate() {
            if msg.queues.get(..i).is_some_and(|before| before.contains(q)) {
                return Err(StoreError::Invalid(format!("queue {q} given twice")));
            }
        }
        let store_ts = now_ms();
        let mut w = self.writer();
        let offs: Vec<u64> = qs.iter().map(|q| q.cq.next_offset()).collect();
        let before = w.pos();
        let commit_offset = self.note_disk_full(self.log.append(&mut w, len, |buf| {
            record::encode_message(buf, msg, store_ts, &offs)
        }))?;
        self.log.publish(&w);
        if commit_offset != before {
            // the record did not fit: the segment it would have ended is sealed
            self.note_sealed();
        }
        let body = w.record_tail(commit_offset, len, msg.body.len() as u64);
        let entry = CqEntry {
            commit_offset,
            size,
            tag_hash: msg.tag_hash,
        };
        for (q, qoff) in qs.iter().zip(&offs) {
            if let Err(e) = q.cq.put(*qoff, entry) {
                // The record is in the log but not in the queue: only recovery can make
                // them agree again, so stop taking writes.
                let why = format!("consume queue write failed: {e}");
                self.flush.fail(why.clone());
                return Err(StoreError::Fatal(why));
            }
        }
        for key in msg.keys {
            if let Err(e) = self.index.put(key, commit_offset, store_ts) {
                tracing::warn!(error = %e, "store: index write failed; lookups by key may miss");
            }
        }
        let end = w.pos();
        drop(w);
        Ok(Appended {
            commit_offset,
            size,
            queue_offsets: msg.queues.iter().copied().zip(offs).collect(),
            durable: self.after_append(end),
            body,
        })
    }

    /// Wakes the maintenance thread for a sealed segment (once per segment: a mutex
    /// and a notify per segment, nothing per record).
    fn note_sealed(&self) {
        self.sealed.store(true, Ordering::Release);
        let _stop = lock(&self.stop);
        self.stop_cv.notify_all();
    }

    /// Remembers a write refused for want of space (see [`Store::disk_full`]).
    fn note_disk_full<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e @ StoreError::DiskFull { .. }) = &r {
            if !self.disk_full.swap(true, Ordering::AcqRel) {
                tracing::warn!(error = %e, "store: out of disk space; writes refused");
            }
        }
        r
    }

    fn ack_ranges(&self, queue: QueueId, ranges: &[(u64, u64)]) -> Result<Durable> {
        self.flush.check()?;
        let q = self.queue(queue)?;
        let next = q.cq.next_offset();
        if let Some((s, e)) = ranges.iter().find(|(s, e)| s >= e || *e > next) {
            return Err(StoreError::Invalid(format!(
                "ack of {s}..{e} on queue {queue} with {next} entries"
            )));
        }
        if !q.rec.durable {
            // transient queues do not outlive the process: no record needed
            let mut a = q.ack();
            for (s, e) in ranges {
                a.ack_range(*s, *e);
            }
            return Ok(Durable::ready());
        }
        let mut w = self.writer();
        let ts = now_ms();
        let len = record::ack_len(ranges.len()) as u64;
        self.note_disk_full(self.log.append(&mut w, len, |buf| {
            record::encode_ack(buf, ts, queue, ranges)
        }))?;
        self.log.publish(&w);
        {
            let mut a = q.ack();
            for (s, e) in ranges {
                a.ack_range(*s, *e);
            }
            // a small queue drops consumed entries at once (heap only), so it stays small
            q.cq.trim_below(a.head());
        }
        q.dirty.store(true, Ordering::Relaxed);
        let end = w.pos();
        drop(w);
        Ok(self.after_append(end))
    }

    fn create_queue(&self, vhost: &str, name: &str, durable: bool) -> Result<(QueueId, Durable)> {
        if name.is_empty() {
            return Err(StoreError::Invalid("empty queue name".into()));
        }
        let mut reg = lock(&self.registry);
        let key = (vhost.to_string(), name.to_string());
        if let Some(id) = reg.by_name.get(&key) {
            return Ok((*id, Durable::ready()));
        }
        let id = reg.next_free;
        let next_free = id
            .checked_add(1)
            .ok_or_else(|| StoreError::Invalid("queue ids exhausted".into()))?;
        let rec = QueueRecord {
            id,
            vhost: vhost.to_string(),
            name: name.to_string(),
            durable,
            dir: dir_name(name, Some(id)),
        };
        let qdir = queue_dir(&self.cfg.dir.join("consumequeue"), &rec);
        remove_dir_if_exists(&qdir)?;
        let cq = open_cq(&qdir, &self.cfg, &self.shared, &rec, &[], 0)?;
        // A durable queue is one journal record. Transient ones never are (they vanish at
        // the next start, and their leftover files are removed as orphans); only the id
        // ceiling is, in blocks, so ids are never reused.
        let mut ops = Vec::new();
        if durable {
            ops.push(MetaOp::put(queue_key(id), encode_queue_record(&rec)?));
        }
        let mut ceiling = reg.next_id;
        if next_free > ceiling {
            ceiling = if durable {
                next_free
            } else {
                next_free.saturating_add(ID_BLOCK)
            };
            ops.push(MetaOp::put(
                KEY_NEXT_ID.to_vec(),
                ceiling.to_le_bytes().to_vec(),
            ));
        }
        let done = if ops.is_empty() {
            Durable::ready()
        } else {
            self.journal.append(ops)?
        };
        reg.next_id = ceiling;
        reg.next_free = next_free;
        reg.by_name.insert(key, id);
        self.queues
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                id,
                Arc::new(QueueState {
                    rec,
                    dir: qdir,
                    cq,
                    ack: Mutex::new(AckState::new(0)),
                    delivered: AtomicU64::new(0),
                    dirty: AtomicBool::new(false),
                }),
            );
        Ok((id, done))
    }

    fn delete_queue(&self, queue: QueueId) -> Result<()> {
        // The registry lock is held until the files are gone: a queue declared again under
        // the same name may get the same directory.
        let mut reg = lock(&self.registry);
        let Ok(q) = self.queue(queue) else {
            return Err(StoreError::NotFound(format!("queue {queue}")));
        };
        // The record first, durably: a crash before it leaves the queue whole.
        self.journal
            .append(vec![
                MetaOp::delete(queue_key(queue)),
                MetaOp::delete(ack_key(queue)),
                MetaOp::delete_prefix(crate::returns::queue_prefix(queue)),
            ])?
            .wait()?;
        let key = (q.rec.vhost.clone(), q.rec.name.clone());
        if reg.by_name.get(&key) == Some(&queue) {
            reg.by_name.remove(&key);
        }
        drop(q);
        // Take it out under the writer lock so no append is half-way into it.
        let q = {
            let _w = self.writer();
            self.queues
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&queue)
        };
        if let Some(q) = q {
            remove_dir_if_exists(&q.dir)?;
        }
        Ok(())
    }

    /// Makes the log durable up to `end`, whoever is flushing.
    fn flush_to(&self, end: u64) -> Result<()> {
        self.flush_from(end).map(|_| ())
    }

    /// [`Self::flush_to`], returning where the flush started (`None`: nothing to do).
    fn flush_from(&self, end: u64) -> Result<Option<u64>> {
        self.flush.check()?;
        let from = self.flush.flushed();
        if from >= end {
            return Ok(None);
        }
        if let Err(e) = self.log.flush(from, end) {
            self.flush.fail(e.to_string());
            return Err(e);
        }
        self.flush.complete(end);
        Ok(Some(from))
    }

    /// The flusher thread's flush (group commit, or async mode's interval): timed and
    /// sized for `/metrics`. Checkpoint and compaction flushes are not group commits and
    /// are not counted.
    fn group_commit(&self, end: u64) -> Result<()> {
        let started = std::time::Instant::now();
        if let Some(from) = self.flush_from(end)? {
            let st = &self.flush.stats;
            st.sync_us
                .record(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX));
            st.batch_bytes.record(end - from);
        }
        Ok(())
    }

    /// Flushes consume queues and index up to the log's end, journals the ack state of
    /// every queue whose state changed since the last checkpoint (one record for all of
    /// them, not a rewrite of every queue's), then records the offset.
    fn checkpoint(&self) -> Result<()> {
        let mut last = lock(&self.checkpoint);
        let (end, snaps) = {
            let w = self.writer();
            let qs = self.queues.read().unwrap_or_else(|e| e.into_inner());
            let snaps: Vec<(QueueId, u64, Vec<u8>)> = qs
                .values()
                .filter(|q| q.rec.durable && q.dirty.swap(false, Ordering::Relaxed))
                .map(|q| {
                    (
                        q.rec.id,
                        q.delivered.load(Ordering::Relaxed),
                        q.ack().encode(),
                    )
                })
                .collect();
            (w.pos(), snaps)
        };
        let res = self.checkpoint_to(end, &snaps);
        if res.is_err() {
            // journal them again next time
            let qs = self.queues.read().unwrap_or_else(|e| e.into_inner());
            for (id, _, _) in &snaps {
                if let Some(q) = qs.get(id) {
                    q.dirty.store(true, Ordering::Relaxed);
                }
            }
        }
        res?;
        *last = end;
        Ok(())
    }

    fn checkpoint_to(&self, end: u64, snaps: &[(QueueId, u64, Vec<u8>)]) -> Result<()> {
        self.flush_to(end)?;
        let qs: Vec<Arc<QueueState>> = self
            .queues
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|q| q.rec.durable)
            .cloned()
            .collect();
        for q in qs {
            q.cq.flush()?;
        }
        if let Some(sh) = &self.shared {
            sh.flush()?;
        }
        self.index.flush()?;
        // The ack states go in bounded records; each is a whole queue's state, so a crash
        // between two leaves every queue at its old or its new state, both of which the
        // replay from the old offset brings up to date (acks are idempotent).
        let mut ops = Vec::new();
        let mut bytes = 0usize;
        for (id, delivered, ack) in snaps {
            let mut v = Vec::with_capacity(8 + ack.len());
            v.extend_from_slice(&delivered.to_le_bytes());
            v.extend_from_slice(ack);
            bytes += v.len() + 16;
            ops.push(MetaOp::put(ack_key(*id), v));
            if bytes >= ACK_RECORD_BYTES {
                self.journal.commit(std::mem::take(&mut ops))?;
                bytes = 0;
            }
        }
        self.journal.commit(ops)?;
        write_atomic(
            &self.cfg.dir.join("checkpoint"),
            &encode_checkpoint(end, &[]),
        )?;
        Ok(())
    }

    /// Deletes what no queue needs any more and compacts the log (see the module notes):
    /// every sealed commitlog segment below the checkpoint that holds nothing live, and,
    /// for those whose live share is below [`COMPACT_LIVE_PERCENT`], copies the live
    /// records to the end of the log, repoints their entries and deletes the segment once
    /// the copies are on disk; then consume-queue files below each ack head and
    /// shared-index segments. Returns the segments deleted.
    fn retention(&self) -> Result<usize> {
        let _pass = lock(&self.pass);
        let ckpt = *lock(&self.checkpoint);
        let qs: Vec<Arc<QueueState>> = self
            .queues
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        // Only sealed segments the checkpoint covers: recovery never replays them.
        let sealed: Vec<(u64, u64)> = self
            .log
            .sealed_segments()
            .iter()
            .map(|s| (s.start(), s.end()))
            .filter(|(_, end)| *end <= ckpt)
            .collect();
        let walk = std::time::Instant::now();
        let live = live_bytes(&qs, &sealed);
        let walk = u64::try_from(walk.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.live_walk_ns.store(walk, Ordering::Relaxed);
        // Segments left dead by an earlier pass's copies go only once those are on disk
        // (always so, unless that pass's flush failed).
        let copies_durable = self.flush.flushed() >= self.copied_to.load(Ordering::Acquire);
        let mut deleted = 0;
        let mut compacted = Vec::new();
        // a bound on one pass's copying (a log left pinned by an earlier version can hold
        // many candidates at once); the next pass goes on where this one stopped
        let mut budget = self
            .cfg
            .segment_size
            .saturating_mul(COMPACT_SEGMENTS_PER_PASS);
        for ((start, end), live) in sealed.iter().zip(&live) {
            if *live == 0 {
                if copies_durable {
                    deleted += usize::from(self.log.delete_segment(*start)?);
                }
            } else if budget > 0 && live * 100 < (end - start) * COMPACT_LIVE_PERCENT {
                let copied = self.compact_segment(*start)?;
                budget = budget.saturating_sub(copied.max(1));
                compacted.push((*start, *live, copied));
            }
        }
        if !compacted.is_empty() {
            // The copies are on disk before the originals go: a flush up to the last copy,
            // which group commit (or the async flusher) has mostly done already. A crash
            // after this replays them from the checkpoint (which is below them) and repoints
            // the entries again.
            self.flush_to(self.copied_to.load(Ordering::Acquire))?;
            for (start, live, copied) in compacted {
                let gone = self.log.delete_segment(start)?;
                deleted += usize::from(gone);
                if gone {
                    self.compactions.fetch_add(1, Ordering::Relaxed);
                    self.compacted_reclaimed.fetch_add(
                        self.cfg.segment_size.saturating_sub(copied),
                        Ordering::Relaxed,
                    );
                }
                tracing::debug!(
                    segment = start,
                    live,
                    copied,
                    deleted = gone,
                    "store: compacted a commitlog segment"
                );
            }
        }
        // Then the queues' own files (after the log: a sealed segment is what the pass
        // is most often woken for).
        // Shared-index segments with few live entries left: their queues move them on.
        let victims = self
            .shared
            .as_ref()
            .map(|s| s.victims())
            .unwrap_or_default();
        for q in &qs {
            let head = q.ack().head();
            q.cq.delete_files_below(head)?;
            q.cq.relocate(&victims)?;
        }
        if let Some(sh) = &self.shared {
            sh.retire()?;
        }
        drop(qs);
        self.index.delete_files_below(self.log.min_offset())?;
        self.segments_deleted
            .fetch_add(deleted as u64, Ordering::Relaxed);
        if deleted > 0 {
            tracing::debug!(segments = deleted, "store: retention deleted segments");
        }
        Ok(deleted)
    }

    /// Copies the live records of the sealed segment at `start` to the end of the log
    /// (a record keeps its timestamps, keys, properties and body, and lists only the
    /// queue entries still live, at their logical offsets) and points those entries at
    /// the copies. Returns the bytes written.
    fn compact_segment(&self, start: u64) -> Result<u64> {
        Ok(self.copy_live(start, usize::MAX)?.0)
    }

    /// Copies forward up to `max` live records of the sealed segment at `start`; returns
    /// the bytes and records written. The scan picks the records that may be live without
    /// any lock; they are then checked again and copied in batches, one writer lock each.
    fn copy_live(&self, start: u64, max: usize) -> Result<(u64, usize)> {
        // Each queue's ack head as the scan first meets it: an entry below it is acked for
        // good, so most dead records are told apart without a lock.
        let mut heads: HashMap<QueueId, Option<u64>> = HashMap::new();
        // At most one batch of candidates is held: memory does not grow with the segment.
        let mut batch: Vec<u64> = Vec::with_capacity(COPY_BATCH);
        let (mut bytes, mut records) = (0u64, 0usize);
        let mut copy = |batch: &mut Vec<u64>| -> Result<()> {
            // read (and checksum-verified) outside the lock
            let recs: Vec<StoredRecord> = batch
                .drain(..)
                .map(|off| self.log.read(off))
                .collect::<Result<_>>()?;
            let mut w = self.writer();
            for rec in recs.iter().take(max.saturating_sub(records)) {
                let n = self.copy_forward(&mut w, rec)?;
                bytes += n;
                records += usize::from(n > 0);
            }
            let end = w.pos();
            self.copied_to.fetch_max(end, Ordering::AcqRel);
            drop(w);
            drop(self.after_append(end));
            Ok(())
        };
        self.log.scan_segment(start, |off, _, d| {
            let Decoded::Message { view, .. } = d else {
                return Ok(());
            };
            let maybe_live = view.queues().any(|(id, l)| {
                let head = heads.entry(id).or_insert_with(|| {
                    let map = self.queues.read().unwrap_or_else(|e| e.into_inner());
                    map.get(&id).map(|q| q.ack().head())
                });
                head.is_some_and(|h| l >= h)
            });
            if maybe_live {
                batch.push(off);
                if batch.len() == COPY_BATCH {
                    copy(&mut batch)?;
                }
            }
            Ok(())
        })?;
        if !batch.is_empty() {
            copy(&mut batch)?;
        }
        Ok((bytes, records))
    }

    /// One record of [`Inner::copy_live`], under the writer lock: acks of durable queues
    /// take it too, so the entries found live here stay live until repointed.
    fn copy_forward(&self, w: &mut Writer, rec: &StoredRecord) -> Result<u64> {
        let off = rec.commit_offset;
        let Decoded::Message { view, .. } = record::decode_unverified(&rec.raw) else {
            return Ok(0);
        };
        let live: Vec<(Arc<QueueState>, u64)> = {
            let map = self.queues.read().unwrap_or_else(|e| e.into_inner());
            view.queues()
                .filter_map(|(id, l)| {
                    let q = map.get(&id)?;
                    let here = q.cq.get(l).is_some_and(|e| e.commit_offset == off);
                    (here && !q.ack().is_acked(l)).then(|| (q.clone(), l))
                })
                .collect()
        };
        if live.is_empty() {
            return Ok(0);
        }
        let ids: Vec<QueueId> = live.iter().map(|(q, _)| q.rec.id).collect();
        let offs: Vec<u64> = live.iter().map(|(_, l)| *l).collect();
        let keys: Vec<&[u8]> = view.keys().collect();
        let msg = NewMessage {
            queues: &ids,
            flags: view.flags,
            born_ts_ms: view.born_ts_ms,
            tag_hash: view.tag_hash,
            keys: &keys,
            properties: &rec.properties,
            body: &rec.body,
        };
        let len = record::message_len(&msg)? as u64;
        let size = u32::try_from(len).map_err(|_| StoreError::TooLarge {
            size: len,
            max: u32::MAX as u64,
        })?;
        let commit_offset = self.note_disk_full(self.log.append(w, len, |buf| {
            record::encode_message(buf, &msg, view.store_ts_ms, &offs)
        }))?;
        self.log.publish(w);
        let entry = CqEntry {
            commit_offset,
            size,
            tag_hash: view.tag_hash,
        };
        for (q, l) in &live {
            if let Err(e) = q.cq.put(*l, entry) {
                let why = format!("consume queue write failed during compaction: {e}");
                self.flush.fail(why.clone());
                return Err(StoreError::Fatal(why));
            }
        }
        for key in &keys {
            if let Err(e) = self.index.put(key, commit_offset, view.store_ts_ms) {
                tracing::warn!(error = %e, "store: index write failed; lookups by key may miss");
            }
        }
        Ok(len)
    }

    fn flusher(&self) {
        match self.cfg.flush {
            FlushMode::Sync => {
                while let Some(target) = self.flush.next_target() {
                    if self.group_commit(target).is_err() {
                        break;
                    }
                }
            }
            FlushMode::Async {
                interval,
                dirty_bytes,
            } => loop {
                match self.flush.next_target_async(interval, dirty_bytes) {
                    Some(target) if self.group_commit(target).is_err() => break,
                    Some(_) => {}
                    None if self.flush.is_shutdown() || self.flush.check().is_err() => break,
                    None => {}
                }
            },
        }
        if let Err(e) = self.flush.check() {
            tracing::error!(error = %e, "store: flusher stopped; the store accepts no more writes");
        }
    }

    fn maintenance(&self) {
        let mut last_retention = std::time::Instant::now();
        loop {
            {
                let stop = lock(&self.stop);
                if *stop {
                    return;
                }
                if !self.sealed.load(Ordering::Acquire) {
                    let (stop, _) = self
                        .stop_cv
                        .wait_timeout(stop, self.cfg.checkpoint_interval)
                        .unwrap_or_else(|e| e.into_inner());
                    if *stop {
                        return;
                    }
                }
            }
            if self.flush.check().is_err() {
                return;
            }
            let sealed = self.sealed.swap(false, Ordering::AcqRel);
            let changed = *lock(&self.checkpoint) != self.log.end();
            if changed {
                if let Err(e) = self.checkpoint() {
                    tracing::error!(error = %e, "store: checkpoint failed");
                    if matches!(e, StoreError::Fatal(_)) {
                        return;
                    }
                }
            }
            // A pass walks every pending entry (O(backlog)): with a backlog of hundreds of
            // millions that takes seconds, so passes are spaced to keep the walks under a
            // tenth of this thread's time, whatever `retention_interval` says or however
            // fast segments seal. A sealed segment otherwise gets its pass at once: the
            // checkpoint above now covers it, so it can be compacted or deleted.
            let walk = Duration::from_nanos(self.live_walk_ns.load(Ordering::Relaxed));
            let since = last_retention.elapsed();
            let due = sealed || since >= self.cfg.retention_interval;
            if due && since >= walk * RETENTION_PACE {
                last_retention = std::time::Instant::now();
                if let Err(e) = self.retention() {
                    tracing::warn!(error = %e, "store: retention failed");
                }
            } else if sealed {
                // paced: keep it for the next wake-up
                self.sealed.store(true, Ordering::Release);
                let stop = lock(&self.stop);
                if !*stop {
                    let pause = (walk * RETENTION_PACE).saturating_sub(since);
                    let _ = self
                        .stop_cv
                        .wait_timeout(stop, pause.min(self.cfg.checkpoint_interval))
                        .unwrap_or_else(|e| e.into_inner());
                }
            }
        }
    }
}

/// A sealed segment whose live bytes are below this share of its size is compacted, so
/// the log holds at most about twice the live data plus the segments the checkpoint has
/// not reached yet.
const COMPACT_LIVE_PERCENT: u64 = 50;
/// In `async` flush mode, appends' [`Durable`]s (the confirms) wait once the unflushed
/// bytes exceed this many times the flusher's `dirty_bytes` (64 MiB with the defaults).
const ASYNC_BACKLOG_FLUSHES: u64 = 4;
/// What an `async`-mode append that ends at `end` waits for: nothing while at most
/// [`ASYNC_BACKLOG_FLUSHES`] × `dirty_bytes` are unflushed, else the offset that brings
/// the backlog back to that.
fn async_wait(end: u64, flushed: u64, dirty_bytes: u64) -> Option<u64> {
    let limit = dirty_bytes.saturating_mul(ASYNC_BACKLOG_FLUSHES);
    (end.saturating_sub(flushed) > limit).then(|| end - limit)
}

/// Retention passes start at least this many times their last liveness walk apart.
const RETENTION_PACE: u32 = 10;
/// One retention pass copies at most this many segments' worth of live records.
const COMPACT_SEGMENTS_PER_PASS: u64 = 4;
/// Compaction copies live records in batches of this many per writer lock.
const COPY_BATCH: usize = 64;
/// Unacked entries are walked in batches of this many (bounded memory per queue).
const LIVE_BATCH: usize = 4096;

/// Bytes of entries still needed (unacked, in a queue that exists) in each of the
/// `sealed` segments (sorted, disjoint `(start, end)`), in the same order. An entry is
/// counted once per queue that holds it, so a message stored for several queues may count
/// more than once: the estimate errs towards keeping a segment.
fn live_bytes(qs: &[Arc<QueueState>], sealed: &[(u64, u64)]) -> Vec<u64> {
    let mut live = vec![0u64; sealed.len()];
    let Some(&(_, below)) = sealed.last() else {
        return live;
    };
    for q in qs {
        let next = q.cq.next_offset();
        let mut from = 0;
        loop {
            let batch = q.ack().unacked_from(from, next, LIVE_BATCH);
            for l in &batch {
                let Some(e) = q.cq.get(*l).filter(|e| e.commit_offset < below) else {
                    continue;
                };
                let i = sealed.partition_point(|(_, end)| *end <= e.commit_offset);
                if let Some(((start, _), n)) = sealed.get(i).zip(live.get_mut(i)) {
                    if *start <= e.commit_offset {
                        *n += u64::from(e.size);
                    }
                }
            }
            match batch.last() {
                Some(last) if batch.len() == LIVE_BATCH => from = last + 1,
                _ => break,
            }
        }
    }
    live
}

const CKPT_MAGIC: &[u8; 4] = b"TCKP";

fn encode_checkpoint(offset: u64, snaps: &[(QueueId, u64, Vec<u8>)]) -> Vec<u8> {
    let mut b = Vec::with_capacity(32 + snaps.iter().map(|s| 16 + s.2.len()).sum::<usize>());
    b.extend_from_slice(CKPT_MAGIC);
    b.push(1);
    b.extend_from_slice(&offset.to_le_bytes());
    b.extend_from_slice(&now_ms().to_le_bytes());
    b.extend_from_slice(&(snaps.len() as u32).to_le_bytes());
    for (id, delivered, ack) in snaps {
        b.extend_from_slice(&id.to_le_bytes());
        b.extend_from_slice(&delivered.to_le_bytes());
        b.extend_from_slice(&(ack.len() as u32).to_le_bytes());
        b.extend_from_slice(ack);
    }
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

type Snapshot = HashMap<QueueId, (u64, AckState)>;

fn decode_checkpoint(b: &[u8]) -> Option<(u64, Snapshot)> {
    let (body, crc) = b.split_at_checked(b.len().checked_sub(4)?)?;
    if crc32c::crc32c(body).to_le_bytes() != crc {
        return None;
    }
    let mut p = body;
    let mut take = |n: usize| -> Option<&[u8]> {
        let (a, rest) = p.split_at_checked(n)?;
        p = rest;
        Some(a)
    };
    if take(4)? != CKPT_MAGIC || take(1)? != [1] {
        return None;
    }
    let offset = u64::from_le_bytes(take(8)?.try_into().ok()?);
    let _ts = take(8)?;
    let n = u32::from_le_bytes(take(4)?.try_into().ok()?);
    let mut snap = HashMap::new();
    for _ in 0..n {
        let id = u32::from_le_bytes(take(4)?.try_into().ok()?);
        let delivered = u64::from_le_bytes(take(8)?.try_into().ok()?);
        let len = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
        let ack = AckState::decode(take(len)?).ok()?;
        snap.insert(id, (delivered, ack));
    }
    Some((offset, snap))
}

fn read_checkpoint(path: &Path, repair: bool) -> Result<(u64, Snapshot)> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((0, HashMap::new())),
        Err(e) => return Err(StoreError::io(path, e)),
    };
    match decode_checkpoint(&bytes) {
        Some(c) => Ok(c),
        None if repair => {
            tracing::error!(path = %path.display(), "repair: ignoring a damaged checkpoint; replaying the whole log");
            Ok((0, HashMap::new()))
        }
        None => Err(StoreError::Corrupt {
            path: path.to_path_buf(),
            offset: 0,
            reason: "damaged checkpoint; start with --repair to replay the whole log".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dir_names_are_safe() {
        assert_eq!(dir_name("/", None), "%2F");
        assert_eq!(dir_name("orders.v1", None), "orders.v1");
        assert_eq!(dir_name("..", None), "%2E.");
        assert_eq!(dir_name("", None), "%");
        assert_eq!(dir_name("a b/c", None), "a%20b%2Fc");
        let long = "x".repeat(300);
        assert_eq!(dir_name(&long, Some(7)).len(), 182);
    }

    #[test]
    fn async_appends_wait_only_past_the_backlog_limit() {
        let mib = 1 << 20;
        assert_eq!(async_wait(10 * mib, 0, 16 * mib), None);
        assert_eq!(async_wait(64 * mib, 0, 16 * mib), None);
        assert_eq!(async_wait(100 * mib, 0, 16 * mib), Some(36 * mib));
        assert_eq!(async_wait(100 * mib, 90 * mib, 16 * mib), None);
        assert_eq!(async_wait(5, 9, 16 * mib), None, "flushed past the end");
    }

    #[test]
    fn checkpoint_round_trip_and_damage() {
        let mut a = AckState::new(3);
        a.ack(5);
        let b = encode_checkpoint(99, &[(1, 7, a.encode())]);
        let (off, snap) = decode_checkpoint(&b).unwrap();
        assert_eq!(off, 99);
        assert_eq!(snap.get(&1), Some(&(7, a)));
        for i in 0..b.len() {
            let mut bad = b.clone();
            bad[i] ^= 0x40;
            assert!(decode_checkpoint(&bad).is_none());
            assert!(decode_checkpoint(&b[..i]).is_none());
        }
    }
}

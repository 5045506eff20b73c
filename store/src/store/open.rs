//! [`Store::open`] in named steps: take the directory's lock, read the checkpoint and
//! the journaled ack states, load the queue registry, remove orphaned queue directories,
//! open the queues, replay the log from the checkpoint, then write a fresh checkpoint,
//! mark the store running and start its threads.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};

use super::checkpoint::{load_checkpoint, Checkpointed};
use super::registry::{load_registry, queue_dir, remove_orphans, QueueRecord, RegState, Registry};
use super::{Inner, QueueId, QueueMap, QueueState, Store, StoreConfig};
use crate::ack::AckState;
use crate::commitlog::{CommitLog, Recovered};
use crate::consumequeue::{ConsumeQueue, CqEntry, SmallConfig};
use crate::error::{Result, StoreError};
use crate::file::{lock_dir, sync_dir};
use crate::flush::FlushShared;
use crate::index::IndexService;
use crate::journal::MetaJournal;
use crate::meta::MetaStore;
use crate::record::Decoded;
use crate::smallcq::{SharedIndex, SharedRecord};

impl Store {
    /// Opens (creating) the store in `cfg.dir`: takes the lock, recovers, starts the
    /// flusher and the maintenance thread.
    pub fn open(cfg: StoreConfig) -> Result<Store> {
        let dir = cfg.dir.clone();
        let lock = lock_dir(&dir)?;
        let abort_path = dir.join("abort");
        let unclean = abort_path.exists();

        let meta = MetaStore::open(&dir.join("meta"))?;
        let journal = MetaJournal::open(&dir.join("meta"), cfg.meta_compact_bytes)?;
        let log = CommitLog::open(&dir.join("commitlog"), cfg.segment_size)?;
        let index = IndexService::open(&dir.join("index"), cfg.index)?;
        let ckpt = load_checkpoint(&dir, cfg.repair, &journal)?;

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
        let queues = open_queues(&cfg, &cq_root, &registry, &ckpt, &shared, &mut loaded)?;
        let (recovered, replayed) =
            replay(&log, &index, &queues, ckpt.offset, unclean, cfg.repair)?;
        drop(loaded);
        settle_queues(&queues, shared.as_deref(), recovered.end, unclean)?;
        if unclean || recovered.truncated {
            tracing::info!(
                dir = %dir.display(), from = ckpt.offset, end = recovered.end, records = replayed,
                truncated = recovered.truncated, "store recovered after an unclean shutdown"
            );
        }

        let opened = Opened {
            log,
            index,
            meta,
            journal,
            queues,
            registry,
            shared,
            checkpoint: ckpt.offset,
            end: recovered.end,
            loaded_counts,
            lock,
        };
        let inner = Arc::new(Inner::new(cfg, opened)?);
        // A fresh checkpoint at the recovered end, so the next crash replays only new data.
        if unclean || recovered.end != ckpt.offset {
            inner.checkpoint()?;
        }
        File::create(&abort_path)
            .and_then(|f| f.sync_all())
            .map_err(StoreError::at(&abort_path))?;
        sync_dir(&dir)?;
        let threads = inner.start_threads(&dir)?;
        Ok(Store {
            inner,
            threads,
            closed: false,
        })
    }
}

/// What [`Store::open`] opened and recovered, before it becomes the store's [`Inner`].
struct Opened {
    log: CommitLog,
    index: IndexService,
    meta: MetaStore,
    journal: MetaJournal,
    queues: QueueMap,
    registry: Registry,
    shared: Option<Arc<SharedIndex>>,
    /// The checkpoint's commitlog offset.
    checkpoint: u64,
    /// The recovered end of the log.
    end: u64,
    loaded_counts: crate::returns::Loaded,
    lock: File,
}

impl Inner {
    fn new(cfg: StoreConfig, o: Opened) -> Result<Inner> {
        let writer = o.log.writer()?;
        let flush = FlushShared::new(o.end);
        if let Some(gate) = &cfg.replica {
            flush.set_gate(gate.clone()); // replication (issue 18)
        }
        Ok(Inner {
            cfg,
            log: o.log,
            writer: Mutex::new(writer),
            queues: RwLock::new(o.queues),
            registry: Mutex::new(RegState::new(&o.registry)),
            index: o.index,
            shared: o.shared,
            meta: o.meta,
            journal: o.journal,
            flush,
            checkpoint: Mutex::new(o.checkpoint),
            copied_to: AtomicU64::new(0),
            live_walk_ns: AtomicU64::new(0),
            kept_live: AtomicU64::new(0),
            compactions: AtomicU64::new(0),
            compacted_reclaimed: AtomicU64::new(0),
            segments_deleted: AtomicU64::new(0),
            pass_waits: AtomicU64::new(0),
            pass_wait_timeouts: AtomicU64::new(0),
            disk_full: AtomicBool::new(false),
            loaded_counts: Mutex::new(o.loaded_counts),
            sealed: AtomicBool::new(false),
            seals: Mutex::new(Default::default()),
            passed_cv: Condvar::new(),
            pass: Mutex::new(()),
            stop: Mutex::new(false),
            stop_cv: Condvar::new(),
            _lock: o.lock,
        })
    }
}

/// Opens every registered queue: its consume queue (a small queue takes its entries out
/// of `loaded`, what the shared index held) and its ack state as of the checkpoint.
fn open_queues(
    cfg: &StoreConfig,
    cq_root: &Path,
    registry: &Registry,
    ckpt: &Checkpointed,
    shared: &Option<Arc<SharedIndex>>,
    loaded: &mut HashMap<QueueId, Vec<SharedRecord>>,
) -> Result<QueueMap> {
    let snapshot = &ckpt.acks;
    let mut queues = HashMap::with_hasher(foldhash::fast::RandomState::default());
    for rec in &registry.queues {
        let qdir = queue_dir(cq_root, rec);
        let head = snapshot.get(&rec.id).map_or(0, |(_, a)| a.head());
        let mine = loaded.remove(&rec.id).unwrap_or_default();
        let cq = open_cq(&qdir, cfg, shared, rec, &mine, head)?;
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
                dirty: AtomicBool::new(ckpt.legacy),
            }),
        );
    }
    Ok(queues)
}

/// Replays the log from the checkpoint at `from`: consume-queue entries, index keys,
/// acks. Returns what the log recovered and the records replayed.
fn replay(
    log: &CommitLog,
    index: &IndexService,
    queues: &QueueMap,
    from: u64,
    unclean: bool,
    repair: bool,
) -> Result<(Recovered, u64)> {
    let mut replayed = 0u64;
    let recovered = log.recover(from, unclean, repair, |off, d| {
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
    Ok((recovered, replayed))
}

/// After the replay: cuts every queue's entries at the log's recovered `end`, and moves
/// small queues' live entries out of the shared-index segments found at start.
fn settle_queues(
    queues: &QueueMap,
    shared: Option<&SharedIndex>,
    end: u64,
    unclean: bool,
) -> Result<()> {
    for q in queues.values() {
        q.cq.truncate_commit_from(end)?;
        let head = q.ack().head();
        q.cq.ensure_next(head)?;
        if unclean {
            q.delivered.store(q.cq.next_offset(), Ordering::Relaxed);
            q.dirty.store(true, Ordering::Relaxed);
        }
    }
    // The shared index now holds exactly the live entries: move them out of the
    // segments found at start (which may hold entries this recovery cut) and delete those.
    if let Some(sh) = shared {
        let old = sh.opened_segments().to_vec();
        for q in queues.values() {
            q.cq.relocate(&old)?;
        }
        sh.retire()?;
    }
    Ok(())
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
pub(super) fn open_cq(
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

//! ConsumeQueue: one per queue, the queue's entries (commitlog offset, size, tag hash)
//! addressed by logical queue offset.
//!
//! A queue is in one of two forms, and moves between them on its own:
//! - **small** (at most `small_max` entries held): the entries live in heap, in a ring
//!   of 24-byte slots, and a durable queue's entries are made durable in the store's
//!   shared index ([`crate::smallcq`]), 40 bytes each. A small queue owns no file, no
//!   directory, no mapping and no file descriptor: an idle queue costs a few hundred
//!   bytes of heap and no disk, so 100,000 of them fit within `vm.max_map_count` and
//!   the fd limit.
//! - **files** ([`crate::cqfile`]): its own directory of preallocated, mapped files of
//!   20-byte entries, as RocketMQ. A small queue is *promoted* when a put would make it
//!   hold more than `small_max` entries; a files queue is *demoted* back when retention
//!   finds it holds at most `small_max / 8`.
//!
//! Which form a durable queue is in is decided on disk by one rule: **a queue whose
//! directory holds consume-queue files is a files queue, and its files are the truth;
//! otherwise the shared index is.** Both moves keep that rule true at every instant:
//! - promotion writes the files into `<dir>+promote`, syncs them, renames the directory
//!   to `<dir>` and syncs its parent, and only then releases the shared entries;
//! - demotion appends the live entries to the shared index and syncs it, then renames
//!   `<dir>` to `<dir>+demote`, syncs the parent and deletes it.
//!
//! A crash between the steps leaves a `+promote` / `+demote` directory, which the store
//! removes at start as an orphan (`dir_name` never produces a `+`).
//!
//! Small queues keep their last entry even when it is consumed, so that `next_offset`
//! survives a restart (a files queue keeps its last file for the same reason); the store
//! drops consumed entries from small queues as they are acked ([`ConsumeQueue::trim_below`]),
//! so a queue whose consumer keeps up stays small however busy it is.
//!
//! Concurrency: as for [`crate::cqfile`], writers are serialised by the caller (the
//! store's writer lock; retention and compaction take the queue's own lock). Readers take
//! a read lock on the queue's form; appends to a files queue also take only the read
//! lock, so readers of a busy queue never wait for the form's lock behind a writer.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::cqfile::FileQueue;
use crate::error::{Result, StoreError};
use crate::file;
use crate::smallcq::{SegId, SharedIndex, SharedRecord};

/// Size of one entry in a consume-queue file.
pub const CQ_ENTRY_SIZE: u64 = 20;

const ENTRY_LEN: usize = CQ_ENTRY_SIZE as usize;

/// One consume-queue entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CqEntry {
    /// Offset of the record in the commitlog.
    pub commit_offset: u64,
    /// Size of the whole record in the commitlog (never 0 for a written entry).
    pub size: u32,
    /// Caller-defined 64-bit tag (hash) stored with the entry.
    pub tag_hash: u64,
}

impl CqEntry {
    pub(crate) fn to_bytes(self) -> [u8; ENTRY_LEN] {
        let mut b = [0u8; ENTRY_LEN];
        let (c, rest) = b.split_at_mut(8);
        c.copy_from_slice(&self.commit_offset.to_le_bytes());
        let (s, t) = rest.split_at_mut(4);
        s.copy_from_slice(&self.size.to_le_bytes());
        t.copy_from_slice(&self.tag_hash.to_le_bytes());
        b
    }

    pub(crate) fn from_bytes(b: &[u8; ENTRY_LEN]) -> CqEntry {
        let (c, rest) = b.split_first_chunk::<8>().unwrap_or((&[0; 8], &[]));
        let (s, rest) = rest.split_first_chunk::<4>().unwrap_or((&[0; 4], &[]));
        let t = rest.first_chunk::<8>().unwrap_or(&[0; 8]);
        CqEntry {
            commit_offset: u64::from_le_bytes(*c),
            size: u32::from_le_bytes(*s),
            tag_hash: u64::from_le_bytes(*t),
        }
    }
}

/// How a queue keeps few entries.
#[derive(Clone)]
pub struct SmallConfig {
    /// The store's shared index; `None` for a transient queue (its entries need not
    /// survive the process, so they are kept in heap only).
    pub shared: Option<Arc<SharedIndex>>,
    /// The queue's id in the shared index.
    pub id: u32,
    /// Most entries held in heap before the queue gets its own files (at least 8).
    pub max: u64,
}

/// A slot of a small queue: the entry and the shared-index segment holding its copy.
#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    commit_offset: u64,
    tag_hash: u64,
    /// 0 = not written.
    size: u32,
    seg: SegId,
}

/// No copy in the shared index (transient queue, or not written).
const NO_SEG: SegId = SegId::MAX;

impl Slot {
    fn entry(self) -> Option<CqEntry> {
        (self.size != 0).then_some(CqEntry {
            commit_offset: self.commit_offset,
            size: self.size,
            tag_hash: self.tag_hash,
        })
    }
}

/// Entries `base .. base + slots.len()`; `next_offset` is the end.
#[derive(Default)]
struct Small {
    base: u64,
    slots: VecDeque<Slot>,
}

impl Small {
    fn next(&self) -> u64 {
        self.base + self.slots.len() as u64
    }

    fn written(&self) -> impl Iterator<Item = (u64, CqEntry)> + '_ {
        (self.base..)
            .zip(self.slots.iter())
            .filter_map(|(l, s)| Some((l, s.entry()?)))
    }
}

enum Form {
    Small(Small),
    Files(Box<FileQueue>),
}

/// A queue's consume queue.
pub struct ConsumeQueue {
    dir: PathBuf,
    per_file: u64,
    /// `None`: always files (the shared index is off).
    small: Option<SmallConfig>,
    form: RwLock<Form>,
}

fn suffixed(dir: &Path, suffix: &str) -> PathBuf {
    let mut s = dir.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

fn remove_dir_if_exists(p: &Path) -> Result<bool> {
    match std::fs::remove_dir_all(p) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(StoreError::io(p, e)),
    }
}

fn sync_parent(dir: &Path) -> Result<()> {
    match dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => file::sync_dir(p),
        None => Ok(()),
    }
}

impl ConsumeQueue {
    /// Opens (creating `dir` if missing) a queue that always keeps its entries in its own
    /// files (see [`crate::cqfile::FileQueue::open`]).
    pub fn open(dir: &Path, entries_per_file: u64) -> Result<ConsumeQueue> {
        let fq = FileQueue::open(dir, entries_per_file)?;
        Ok(ConsumeQueue {
            dir: dir.to_path_buf(),
            per_file: entries_per_file,
            small: None,
            form: RwLock::new(Form::Files(Box::new(fq))),
        })
    }

    /// Opens a queue that is small while it holds few entries. If `dir` holds files
    /// (a queue that was big, or a data directory from before the shared index), they
    /// are opened and `loaded` is ignored. Otherwise the queue is small and takes the
    /// entries `loaded` (its records from [`SharedIndex::open`], in append order, a later
    /// one replacing an earlier one at the same offset), dropping those below
    /// `keep_from` (its ack head) except the last entry; it is promoted at once if they
    /// are too many. Creates nothing on disk for a small queue.
    pub fn open_small(
        dir: &Path,
        entries_per_file: u64,
        cfg: SmallConfig,
        loaded: &[SharedRecord],
        keep_from: u64,
    ) -> Result<ConsumeQueue> {
        if entries_per_file == 0 || cfg.max < 8 {
            return Err(StoreError::Invalid(format!(
                "consume queue: entries_per_file {entries_per_file} and small max {} must be > 0 and >= 8",
                cfg.max
            )));
        }
        if FileQueue::has_files(dir)? {
            let fq = FileQueue::open(dir, entries_per_file)?;
            return Ok(ConsumeQueue {
                dir: dir.to_path_buf(),
                per_file: entries_per_file,
                small: Some(cfg),
                form: RwLock::new(Form::Files(Box::new(fq))),
            });
        }
        // An empty directory is left from a queue that never held an entry (or from an
        // older version that created it up front): a small queue has none.
        if let Ok(true) = remove_dir_if_exists(dir) {
            sync_parent(dir)?;
        }
        // Latest copy of each offset, then the ones still needed.
        let mut latest: std::collections::BTreeMap<u64, (CqEntry, SegId)> = Default::default();
        for r in loaded {
            latest.insert(r.logical, (r.entry, r.seg));
        }
        // From the head on, and the last entry, which holds `next_offset` (if a recovery
        // then cuts everything from the head on, `ensure_next` puts it at the head).
        // Entries below the head are consumed; copies of them may be stale (from before
        // the queue last had files), so they are not taken.
        let keep = latest
            .keys()
            .next_back()
            .map_or(0, |&last| last.min(keep_from));
        let kept = latest.range(keep..);
        let base = kept.clone().next().map_or(0, |(&l, _)| l);
        let end = kept.clone().next_back().map_or(0, |(&l, _)| l + 1);
        let form = if end - base > cfg.max {
            // Too many to hold (a crash caught it between growing and promotion).
            Form::Files(Box::new(Self::files_from(
                dir,
                entries_per_file,
                cfg.shared.is_some(),
                kept.map(|(&l, &(e, _))| (l, e)),
            )?))
        } else {
            let mut small = Small {
                base,
                slots: VecDeque::with_capacity((end - base) as usize),
            };
            for (&l, &(e, seg)) in kept {
                if let Some(shared) = &cfg.shared {
                    shared.adopt(seg);
                }
                let gap = l - small.next();
                small
                    .slots
                    .extend(std::iter::repeat_n(Slot::default(), gap as usize));
                small.slots.push_back(Slot {
                    commit_offset: e.commit_offset,
                    tag_hash: e.tag_hash,
                    size: e.size,
                    seg,
                });
            }
            Form::Small(small)
        };
        Ok(ConsumeQueue {
            dir: dir.to_path_buf(),
            per_file: entries_per_file,
            small: Some(cfg),
            form: RwLock::new(form),
        })
    }

    /// Writes `entries` into new files at `dir` (crash-safe: see the module docs).
    fn files_from(
        dir: &Path,
        per_file: u64,
        durable: bool,
        entries: impl Iterator<Item = (u64, CqEntry)>,
    ) -> Result<FileQueue> {
        let tmp = suffixed(dir, "+promote");
        remove_dir_if_exists(&tmp)?;
        let mut fq = FileQueue::open(&tmp, per_file)?;
        for (l, e) in entries {
            fq.put(l, e)?;
        }
        if durable {
            fq.flush()?;
        }
        // A leftover empty directory at the final name (nothing else can be there: files
        // there would have made this a files queue).
        remove_dir_if_exists(dir)?;
        fq.rename_dir(dir)?;
        if durable {
            sync_parent(dir)?;
            if let Some(vhost) = dir.parent() {
                sync_parent(vhost)?;
            }
        }
        Ok(fq)
    }

    fn read(&self) -> RwLockReadGuard<'_, Form> {
        self.form.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> RwLockWriteGuard<'_, Form> {
        self.form.write().unwrap_or_else(PoisonError::into_inner)
    }

    fn durable_shared(&self) -> Option<&Arc<SharedIndex>> {
        self.small.as_ref()?.shared.as_ref()
    }

    fn release_slots<'a>(&self, slots: impl IntoIterator<Item = &'a Slot>) {
        let Some(shared) = self.durable_shared() else {
            return;
        };
        let mut run: Option<(SegId, u64)> = None;
        for s in slots {
            if s.size == 0 || s.seg == NO_SEG {
                continue;
            }
            match &mut run {
                Some((seg, n)) if *seg == s.seg => *n += 1,
                _ => {
                    if let Some((seg, n)) = run.take() {
                        shared.release(seg, n);
                    }
                    run = Some((s.seg, 1));
                }
            }
        }
        if let Some((seg, n)) = run {
            shared.release(seg, n);
        }
    }

    /// Whether the queue currently keeps its entries in its own files.
    pub fn has_own_files(&self) -> bool {
        matches!(&*self.read(), Form::Files(_))
    }

    /// Entries per file (when the queue has files).
    pub fn entries_per_file(&self) -> u64 {
        self.per_file
    }

    /// Number of files currently held (0 for a small queue).
    pub fn file_count(&self) -> usize {
        match &*self.read() {
            Form::Small(_) => 0,
            Form::Files(fq) => fq.file_count(),
        }
    }

    /// Writes `entry` at `logical`. `logical == next_offset` appends; below overwrites (replay
    /// after a crash); above leaves a gap of unwritten entries (also only in recovery).
    /// `next_offset` becomes max(next, logical + 1). An entry with `size == 0` (which would
    /// read back as unwritten) is `Invalid`. May promote a small queue (see the module docs):
    /// a few fsyncs, once.
    pub fn put(&self, logical: u64, entry: CqEntry) -> Result<()> {
        if entry.size == 0 {
            return Err(StoreError::Invalid(
                "consume queue entry with size 0".into(),
            ));
        }
        logical
            .checked_add(1)
            .ok_or_else(|| StoreError::Invalid("logical offset overflows".into()))?;
        if let Form::Files(fq) = &*self.read() {
            return fq.put(logical, entry);
        }
        let mut form = self.write();
        let Form::Small(small) = &mut *form else {
            let Form::Files(fq) = &*form else {
                return Err(StoreError::Fatal("consume queue form changed".into()));
            };
            return fq.put(logical, entry);
        };
        let max = self.small.as_ref().map_or(0, |c| c.max);
        // Slots the queue would span after this put.
        let (lo, hi) = if small.slots.is_empty() {
            (logical, logical + 1)
        } else {
            (small.base.min(logical), small.next().max(logical + 1))
        };
        if hi - lo > max {
            match self.promote(&mut form) {
                Ok(()) => {
                    let Form::Files(fq) = &*form else {
                        return Err(StoreError::Fatal("consume queue promotion failed".into()));
                    };
                    return fq.put(logical, entry);
                }
                // Out of space for the queue's own files: it stays small (heap and shared
                // index) past the threshold, and the next put tries again. The commitlog
                // record this entry belongs to is already written, so failing here would
                // stop the store; a full disk must raise the alarm, not stop the broker.
                Err(e @ StoreError::DiskFull { .. }) => {
                    let _ = remove_dir_if_exists(&suffixed(&self.dir, "+promote"));
                    tracing::warn!(dir = %self.dir.display(), error = %e,
                        "consume queue: no space to promote to files; staying in the shared index");
                }
                Err(e) => return Err(e),
            }
        }
        let Form::Small(small) = &mut *form else {
            return Err(StoreError::Fatal("consume queue form changed".into()));
        };
        let seg = match (self.durable_shared(), &self.small) {
            (Some(shared), Some(c)) => shared.append(c.id, logical, entry)?,
            _ => NO_SEG,
        };
        let slot = Slot {
            commit_offset: entry.commit_offset,
            tag_hash: entry.tag_hash,
            size: entry.size,
            seg,
        };
        if small.slots.is_empty() {
            small.base = logical;
        } else if logical < small.base {
            for _ in logical..small.base {
                small.slots.push_front(Slot::default());
            }
            small.base = logical;
        } else if logical >= small.next() {
            let gap = logical - small.next();
            small
                .slots
                .extend(std::iter::repeat_n(Slot::default(), gap as usize));
        }
        let Some(dst) = usize::try_from(logical - small.base)
            .ok()
            .and_then(|i| small.slots.get_mut(i))
        else {
            small.slots.push_back(slot);
            return Ok(());
        };
        let old = std::mem::replace(dst, slot);
        self.release_slots([&old]);
        Ok(())
    }

    /// Gives a small queue its own files (see the module docs for the crash-safe order).
    /// The caller holds the write lock.
    fn promote(&self, form: &mut RwLockWriteGuard<'_, Form>) -> Result<()> {
        let Form::Small(small) = &**form else {
            return Ok(());
        };
        let fq = Self::files_from(
            &self.dir,
            self.per_file,
            self.durable_shared().is_some(),
            small.written(),
        )?;
        tracing::debug!(dir = %self.dir.display(), "consume queue: promoted to files");
        let old = std::mem::replace(&mut **form, Form::Files(Box::new(fq)));
        if let Form::Small(s) = &old {
            self.release_slots(&s.slots);
        }
        Ok(())
    }

    /// The entry at `logical`, or `None` when it is outside `min_offset..next_offset`,
    /// was dropped, or is unwritten.
    pub fn get(&self, logical: u64) -> Option<CqEntry> {
        match &*self.read() {
            Form::Files(fq) => fq.get(logical),
            Form::Small(s) => {
                let i = usize::try_from(logical.checked_sub(s.base)?).ok()?;
                s.slots.get(i)?.entry()
            }
        }
    }

    /// One past the highest written entry.
    pub fn next_offset(&self) -> u64 {
        match &*self.read() {
            Form::Files(fq) => fq.next_offset(),
            Form::Small(s) => s.next(),
        }
    }

    /// The first logical offset still held.
    pub fn min_offset(&self) -> u64 {
        match &*self.read() {
            Form::Files(fq) => fq.min_offset(),
            Form::Small(s) => s.base,
        }
    }

    /// Discards entries at `logical` and above (recovery only).
    pub fn truncate_from(&self, logical: u64) -> Result<()> {
        let mut form = self.write();
        match &mut *form {
            Form::Files(fq) => fq.truncate_from(logical),
            Form::Small(s) => {
                let keep = logical.saturating_sub(s.base).min(s.slots.len() as u64);
                let cut: Vec<Slot> = s.slots.drain(keep as usize..).collect();
                if s.slots.is_empty() {
                    s.base = s.base.min(logical);
                }
                self.release_slots(&cut);
                Ok(())
            }
        }
    }

    /// Discards every entry whose `commit_offset >= commit_offset` (recovery after the
    /// commitlog tail was cut). Entries are in increasing commit-offset order.
    pub fn truncate_commit_from(&self, commit_offset: u64) -> Result<()> {
        let cut = match &*self.read() {
            Form::Files(fq) => return fq.truncate_commit_from(commit_offset),
            Form::Small(s) => s
                .written()
                .find(|(_, e)| e.commit_offset >= commit_offset)
                .map(|(l, _)| l),
        };
        match cut {
            Some(l) => self.truncate_from(l),
            None => Ok(()),
        }
    }

    /// After a recovery: a queue whose entries from `logical` (its ack head) on were all
    /// cut (or, for a files queue, whose files hold nothing below the cut) starts again
    /// at `logical`, not below: entries below the ack head are consumed, so no new entry
    /// may take their offsets. Such a files queue holds nothing and becomes small.
    pub fn ensure_next(&self, logical: u64) -> Result<()> {
        let mut form = self.write();
        if let Form::Files(fq) = &*form {
            let next = fq.next_offset();
            if next >= logical || self.small.is_none() {
                return Ok(());
            }
            self.demote(&mut form, next)?;
        }
        if let Form::Small(s) = &mut *form {
            if s.next() < logical {
                let dropped: Vec<Slot> = s.slots.drain(..).collect();
                s.base = logical;
                self.release_slots(&dropped);
            }
        }
        Ok(())
    }

    /// Drops consumed entries of a small queue: those below `logical`, except the last
    /// entry. Heap only; a files queue is left to [`ConsumeQueue::delete_files_below`].
    pub fn trim_below(&self, logical: u64) {
        {
            let form = self.read();
            match &*form {
                Form::Small(s) if s.base < logical && s.slots.len() > 1 => {}
                _ => return,
            }
        }
        if let Form::Small(s) = &mut *self.write() {
            let upto = logical.min(s.next().saturating_sub(1));
            let n = upto.saturating_sub(s.base).min(s.slots.len() as u64) as usize;
            if n == 0 {
                return;
            }
            self.release_slots(s.slots.range(..n));
            s.slots.drain(..n);
            s.base += n as u64;
            if s.slots.capacity() > 4 * s.slots.len().max(4) {
                s.slots.shrink_to(s.slots.len().max(4));
            }
        }
    }

    /// Deletes what is no longer needed below `logical` (the ack head): files all of whose
    /// entries are below it (never the one holding `next_offset - 1`), or, for a small
    /// queue, the entries below it but the last. A files queue holding at most
    /// `small max / 8` entries from `logical` on is demoted to a small one. Returns the
    /// number of files deleted.
    pub fn delete_files_below(&self, logical: u64) -> Result<usize> {
        let deleted = match &*self.read() {
            Form::Files(fq) => fq.delete_files_below(logical)?,
            Form::Small(_) => 0,
        };
        self.trim_below(logical);
        if let Some(c) = self
            .small
            .as_ref()
            .filter(|_| deleted > 0 || self.has_own_files())
        {
            let mut form = self.write();
            if let Form::Files(fq) = &*form {
                let next = fq.next_offset();
                let from = logical.min(next.saturating_sub(1)).max(fq.min_offset());
                if next > 0 && next - from <= c.max / 8 {
                    self.demote(&mut form, from)?;
                }
            }
        }
        Ok(deleted)
    }

    /// Moves a files queue's entries from `from` on into heap (and the shared index) and
    /// deletes its files (see the module docs for the crash-safe order). The caller holds
    /// the write lock.
    fn demote(&self, form: &mut RwLockWriteGuard<'_, Form>, from: u64) -> Result<()> {
        let Form::Files(fq) = &**form else {
            return Ok(());
        };
        let next = fq.next_offset();
        let mut small = Small {
            base: from,
            slots: VecDeque::with_capacity((next - from) as usize),
        };
        let mut result = Ok(());
        for l in from..next {
            let mut slot = Slot {
                seg: NO_SEG,
                ..Slot::default()
            };
            if let Some(e) = fq.get(l) {
                let seg = match (self.durable_shared(), &self.small) {
                    (Some(shared), Some(c)) => match shared.append(c.id, l, e) {
                        Ok(seg) => seg,
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    },
                    _ => NO_SEG,
                };
                slot = Slot {
                    commit_offset: e.commit_offset,
                    tag_hash: e.tag_hash,
                    size: e.size,
                    seg,
                };
            }
            small.slots.push_back(slot);
        }
        if let Some(shared) = self.durable_shared() {
            if result.is_ok() {
                result = shared.flush();
            }
        }
        if let Err(e) = result {
            self.release_slots(&small.slots);
            return Err(e);
        }
        let doomed = suffixed(&self.dir, "+demote");
        remove_dir_if_exists(&doomed)?;
        if let Err(e) = std::fs::rename(&self.dir, &doomed) {
            self.release_slots(&small.slots);
            return Err(StoreError::io(&self.dir, e));
        }
        // From here on the shared index is the truth, whatever happens next.
        **form = Form::Small(small);
        if self.durable_shared().is_some() {
            sync_parent(&self.dir)?;
        }
        remove_dir_if_exists(&doomed)?;
        tracing::debug!(dir = %self.dir.display(), "consume queue: demoted to the shared index");
        Ok(())
    }

    /// Moves this small queue's entries whose copies are in the `victims` segments to
    /// the end of the shared index (compaction, and the rewrite after a start); returns
    /// how many moved. They are durable at the next [`SharedIndex::flush`].
    pub fn relocate(&self, victims: &[SegId]) -> Result<usize> {
        let Some((shared, c)) = self.durable_shared().zip(self.small.as_ref()) else {
            return Ok(0);
        };
        if victims.is_empty() {
            return Ok(0);
        }
        let mut form = self.write();
        let Form::Small(s) = &mut *form else {
            return Ok(0);
        };
        let mut moved = 0;
        for (l, slot) in (s.base..).zip(s.slots.iter_mut()) {
            if slot.size == 0 || !victims.contains(&slot.seg) {
                continue;
            }
            let Some(e) = slot.entry() else { continue };
            let seg = shared.append(c.id, l, e)?;
            shared.release(slot.seg, 1);
            slot.seg = seg;
            moved += 1;
        }
        Ok(moved)
    }

    /// Makes everything written so far durable: msync of a files queue's dirty files. A
    /// small queue's entries are made durable by [`SharedIndex::flush`].
    pub fn flush(&self) -> Result<()> {
        match &*self.read() {
            Form::Files(fq) => fq.flush(),
            Form::Small(_) => Ok(()),
        }
    }

    /// Deletes the queue's files (if any) and releases its shared entries.
    pub fn destroy(self) -> Result<()> {
        let dir = self.dir.clone();
        drop(self);
        if remove_dir_if_exists(&dir)? {
            sync_parent(&dir)?;
        }
        Ok(())
    }
}

impl Drop for ConsumeQueue {
    fn drop(&mut self) {
        let form = std::mem::replace(
            self.form.get_mut().unwrap_or_else(PoisonError::into_inner),
            Form::Small(Small::default()),
        );
        if let Form::Small(s) = form {
            self.release_slots(&s.slots);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn ent(l: u64, tag: u64) -> CqEntry {
        CqEntry {
            commit_offset: l * 16 + 1,
            size: (l % 1000) as u32 + 1,
            tag_hash: tag,
        }
    }

    /// A data directory's worth: the shared index and one queue in `<root>/vh/q`.
    struct Fixture {
        root: tempfile::TempDir,
        shared: Arc<SharedIndex>,
    }

    const PER_FILE: u64 = 16;
    const MAX: u64 = 16;

    impl Fixture {
        fn new() -> Fixture {
            let root = tempfile::tempdir().unwrap();
            let (shared, recs) = SharedIndex::open(&root.path().join("sharedcq"), 8).unwrap();
            assert!(recs.is_empty());
            Fixture {
                root,
                shared: Arc::new(shared),
            }
        }

        fn dir(&self) -> PathBuf {
            self.root.path().join("vh").join("q")
        }

        fn cfg(&self) -> SmallConfig {
            SmallConfig {
                shared: Some(Arc::clone(&self.shared)),
                id: 3,
                max: MAX,
            }
        }

        fn open(&self, loaded: &[SharedRecord], keep_from: u64) -> ConsumeQueue {
            ConsumeQueue::open_small(&self.dir(), PER_FILE, self.cfg(), loaded, keep_from).unwrap()
        }

        /// What the store does at a start: reopen the index, hand the queue its entries,
        /// cut (recovery), move everything out of the old segments, delete them.
        fn restart(&mut self, cq: ConsumeQueue, keep_from: u64, cut: Option<u64>) -> ConsumeQueue {
            drop(cq);
            let (shared, recs) = SharedIndex::open(&self.root.path().join("sharedcq"), 8).unwrap();
            self.shared = Arc::new(shared);
            let mine: Vec<SharedRecord> = recs.into_iter().filter(|r| r.queue == 3).collect();
            let cq = self.open(&mine, keep_from);
            if let Some(c) = cut {
                cq.truncate_commit_from(c).unwrap();
            }
            cq.ensure_next(keep_from).unwrap();
            cq.relocate(self.shared.opened_segments()).unwrap();
            self.shared.retire().unwrap();
            cq
        }
    }

    #[test]
    fn small_queue_owns_no_file_until_promoted_and_is_demoted_when_drained() {
        let mut fx = Fixture::new();
        let cq = fx.open(&[], 0);
        assert_eq!((cq.min_offset(), cq.next_offset(), cq.get(0)), (0, 0, None));
        for l in 0..MAX {
            cq.put(l, ent(l, 1)).unwrap();
        }
        assert!(!cq.has_own_files());
        assert!(!fx.dir().exists(), "a small queue has no directory");
        assert_eq!(fx.shared.live_entries(), MAX);
        // consumed entries leave the heap and the index, except the last
        cq.trim_below(MAX);
        assert_eq!((cq.min_offset(), cq.next_offset()), (MAX - 1, MAX));
        assert_eq!(cq.get(MAX - 2), None);
        assert_eq!(cq.get(MAX - 1), Some(ent(MAX - 1, 1)));
        assert_eq!(fx.shared.live_entries(), 1);
        // the last entry (and so next_offset) survives a restart
        let cq = fx.restart(cq, MAX, None);
        assert_eq!((cq.min_offset(), cq.next_offset()), (MAX - 1, MAX));
        assert_eq!(fx.shared.live_entries(), 1);
        assert_eq!(fx.shared.segment_count(), 1, "old segments retired");
        // growing past MAX held entries gives it files, with everything it held
        for l in MAX..2 * MAX {
            cq.put(l, ent(l, 2)).unwrap();
        }
        assert!(cq.has_own_files());
        assert!(fx.dir().exists());
        assert_eq!(fx.shared.live_entries(), 0);
        assert!(!PathBuf::from(format!("{}+promote", fx.dir().display())).exists());
        assert_eq!(cq.get(MAX - 1), Some(ent(MAX - 1, 1)));
        for l in MAX..2 * MAX {
            assert_eq!(cq.get(l), Some(ent(l, 2)));
        }
        // still files after a restart: the directory decides
        let cq = fx.restart(cq, MAX - 1, None);
        assert!(cq.has_own_files());
        assert_eq!(cq.next_offset(), 2 * MAX);
        // drained to MAX/8: back to small, directory gone, entries from the head kept
        cq.delete_files_below(2 * MAX - 2).unwrap();
        assert!(!cq.has_own_files());
        assert!(!fx.dir().exists());
        assert_eq!((cq.min_offset(), cq.next_offset()), (2 * MAX - 2, 2 * MAX));
        assert_eq!(cq.get(2 * MAX - 2), Some(ent(2 * MAX - 2, 2)));
        assert_eq!(fx.shared.live_entries(), 2);
        let cq = fx.restart(cq, 2 * MAX - 2, None);
        assert!(!cq.has_own_files());
        assert_eq!((cq.min_offset(), cq.next_offset()), (2 * MAX - 2, 2 * MAX));
        assert_eq!(cq.get(2 * MAX - 1), Some(ent(2 * MAX - 1, 2)));
        cq.destroy().unwrap();
        fx.shared.retire().unwrap();
        assert_eq!(fx.shared.live_entries(), 0);
    }

    #[test]
    fn crash_leftovers_of_promotion_and_old_layout_open() {
        let fx = Fixture::new();
        // A data directory from before the shared index: files, no shared entries.
        {
            let old = ConsumeQueue::open(&fx.dir(), PER_FILE).unwrap();
            for l in 0..5 {
                old.put(l, ent(l, 9)).unwrap();
            }
            old.flush().unwrap();
        }
        // and stale shared entries for the same queue: ignored, files are the truth
        let stale = [SharedRecord {
            queue: 3,
            logical: 0,
            entry: ent(0, 1),
            seg: 0,
        }];
        let cq = fx.open(&stale, 0);
        assert!(cq.has_own_files());
        assert_eq!(cq.next_offset(), 5);
        assert_eq!(cq.get(0), Some(ent(0, 9)));
        assert_eq!(fx.shared.live_entries(), 0);
        cq.destroy().unwrap();
        assert!(!fx.dir().exists());
        // An empty directory (an old queue that never held anything): small, removed.
        std::fs::create_dir_all(fx.dir()).unwrap();
        let cq = fx.open(&[], 0);
        assert!(!cq.has_own_files());
        assert!(!fx.dir().exists());
        // Too many entries in the index for a small queue: promoted at open.
        let many: Vec<SharedRecord> = (0..MAX + 3)
            .map(|l| SharedRecord {
                queue: 3,
                logical: l,
                entry: ent(l, 4),
                seg: 0,
            })
            .collect();
        drop(cq);
        let cq = fx.open(&many, 0);
        assert!(cq.has_own_files());
        assert_eq!(cq.next_offset(), MAX + 3);
        assert_eq!(cq.get(MAX + 2), Some(ent(MAX + 2, 4)));
        // below the ack head only the last is kept
        drop(cq);
        std::fs::remove_dir_all(fx.dir()).unwrap();
        let cq = fx.open(&many, 1_000);
        assert!(!cq.has_own_files());
        assert_eq!((cq.min_offset(), cq.next_offset()), (MAX + 2, MAX + 3));
        assert!(matches!(
            ConsumeQueue::open_small(
                &fx.dir(),
                PER_FILE,
                SmallConfig { max: 4, ..fx.cfg() },
                &[],
                0
            ),
            Err(StoreError::Invalid(_))
        ));
    }

    #[test]
    fn transient_small_queue_uses_no_index() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("q");
        let cfg = SmallConfig {
            shared: None,
            id: 1,
            max: 8,
        };
        let cq = ConsumeQueue::open_small(&d, 4, cfg, &[], 0).unwrap();
        for l in 0..8 {
            cq.put(l, ent(l, 0)).unwrap();
        }
        assert!(!d.exists());
        cq.put(8, ent(8, 0)).unwrap();
        assert!(cq.has_own_files());
        assert_eq!(cq.get(3), Some(ent(3, 0)));
        cq.delete_files_below(8).unwrap();
        assert!(!cq.has_own_files());
        assert!(!d.exists());
        assert_eq!(cq.get(8), Some(ent(8, 0)));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Append(u64),
        Overwrite(u64),
        Trim(u64),
        DeleteBelow(u64),
        Compact,
        Restart(Option<u64>),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (1u64..12).prop_map(Op::Append),
            1 => (0u64..1000).prop_map(Op::Overwrite),
            3 => (0u64..1000).prop_map(Op::Trim),
            2 => (0u64..1000).prop_map(Op::DeleteBelow),
            1 => Just(Op::Compact),
            2 => proptest::option::of(0u64..1000).prop_map(Op::Restart),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        /// Whatever the queue's form and however often it restarts, every entry at or
        /// above the consumed point is there, with the latest value written.
        #[test]
        fn matches_model_across_forms_and_restarts(ops in proptest::collection::vec(op(), 1..50)) {
            let mut fx = Fixture::new();
            let mut cq = fx.open(&[], 0);
            let mut e: BTreeMap<u64, CqEntry> = BTreeMap::new();
            let (mut next, mut floor, mut tag) = (0u64, 0u64, 0u64);
            for o in ops {
                tag += 1;
                match o {
                    Op::Append(n) => {
                        for l in next..next + n {
                            cq.put(l, ent(l, tag)).unwrap();
                            e.insert(l, ent(l, tag));
                        }
                        next += n;
                    }
                    Op::Overwrite(x) => {
                        let min = cq.min_offset();
                        if next > min {
                            let l = min + x % (next - min);
                            cq.put(l, ent(l, tag)).unwrap();
                            e.insert(l, ent(l, tag));
                        }
                    }
                    Op::Trim(x) | Op::DeleteBelow(x) => {
                        let t = floor + x % (next - floor + 1);
                        if matches!(o, Op::Trim(_)) {
                            cq.trim_below(t);
                        } else {
                            cq.delete_files_below(t).unwrap();
                        }
                        floor = t;
                    }
                    Op::Compact => {
                        let v = fx.shared.victims();
                        cq.relocate(&v).unwrap();
                        fx.shared.retire().unwrap();
                    }
                    Op::Restart(cut) => {
                        // a recovery cuts the newest records (a torn log tail), not
                        // below what was consumed
                        let cut = cut.map(|x| floor + x % (next - floor + 1));
                        cq = fx.restart(cq, floor, cut.map(|c| c * 16 + 1));
                        if let Some(c) = cut {
                            e.retain(|&l, _| l < c);
                            next = next.min(c);
                            floor = floor.min(next);
                        }
                    }
                }
                prop_assert_eq!(cq.next_offset(), next);
                let min = cq.min_offset();
                if floor < next {
                    prop_assert!(min <= floor, "min {} above the consumed point {}", min, floor);
                }
                for l in min..next + 2 {
                    let got = cq.get(l);
                    if l >= floor || got.is_some() {
                        // below the consumed point an entry may be gone, never wrong
                        prop_assert_eq!(got, e.get(&l).copied(), "entry {}", l);
                    }
                }
                prop_assert_eq!(fx.dir().exists(), cq.has_own_files());
                if !cq.has_own_files() {
                    let held = (min..next).filter(|&l| cq.get(l).is_some()).count() as u64;
                    prop_assert_eq!(fx.shared.live_entries(), held);
                    prop_assert!(next - min <= MAX);
                }
            }
        }
    }
}

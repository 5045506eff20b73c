//! The file-backed form of a consume queue: files of fixed 20-byte entries addressed by
//! logical queue offset. [`crate::consumequeue::ConsumeQueue`] uses it for queues that
//! hold more than a few entries (and for every queue when the shared index is off).
//!
//! Layout: `<dir>/<20-digit first logical offset>`, each file `entries_per_file * 20`
//! bytes, preallocated (`file::open_preallocated`) and memory-mapped. An entry is
//! little-endian `u64 commit_offset, u32 size, u64 tag_hash`; an all-zero entry (size 0)
//! is "not written". Entry N lives in file `N / entries_per_file * entries_per_file` at
//! byte `(N % entries_per_file) * 20`, so reading entry N is O(1). Files are created on
//! the first entry written into them, never for an empty queue.
//!
//! Concurrency: writers (`put`, `truncate_*`, `delete_files_below`) are serialised by the
//! caller (the store's writer lock); readers (`get`, `next_offset`, `min_offset`) run on
//! any thread at the same time and must see only fully written entries (publish
//! `next_offset` with Release after the bytes are in place, read it with Acquire).
//! `flush` may run on another thread (the flusher) concurrently with both.
//!
//! Implementation notes:
//! - The files live in a `RwLock<BTreeMap<start, Arc<CqFile>>>`. `get` holds the read
//!   lock while it loads `next_offset` and copies the 20 bytes out, so it never races
//!   with the operations that rewrite or zero published entries (overwriting `put`,
//!   `truncate_*`), which take the write lock; appends (at or above `next_offset`) only
//!   take the read lock because no reader looks at those bytes until `next` is published.
//! - Invariant: every written entry is below `next_offset`; `min_offset` is the start of
//!   the first file, or `next_offset` when there are no files.
//! - After `open`, `next_offset` is one past the highest written entry (scanning back from
//!   the last file), or `min_offset` when nothing is written.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use memmap2::MmapRaw;

use crate::error::{Result, StoreError};
use crate::file;

use crate::consumequeue::{CqEntry, CQ_ENTRY_SIZE};

const ENTRY_LEN: usize = CQ_ENTRY_SIZE as usize;

/// One mapped file.
struct CqFile {
    path: PathBuf,
    map: MmapRaw,
    /// Written since the last msync.
    dirty: AtomicBool,
}

impl CqFile {
    fn open(path: PathBuf, len: u64, create: bool) -> Result<CqFile> {
        let f = if create {
            file::open_preallocated(&path, len)?
        } else {
            fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(StoreError::at(&path))?
        };
        let actual = f.metadata().map_err(StoreError::at(&path))?.len();
        if actual != len {
            return Err(StoreError::Corrupt {
                path,
                offset: 0,
                reason: format!("consume queue file is {actual} bytes, expected {len}"),
            });
        }
        let map = MmapRaw::map_raw(&f).map_err(StoreError::at(&path))?;
        if create {
            // A new file is written at its tail and read back from the page cache: without
            // this, each first touch reads ahead and zeroes pages of the unwritten extent
            // (~100 ms for the first message to 50 new MQTT subscription queues). Files
            // opened again at recovery keep the default readahead for their sequential scan.
            let _ = map.advise(memmap2::Advice::Random);
        }
        if map.len() as u64 != len {
            return Err(StoreError::Corrupt {
                path,
                offset: 0,
                reason: format!("mapped {} bytes, expected {len}", map.len()),
            });
        }
        Ok(CqFile {
            path,
            map,
            dirty: AtomicBool::new(false),
        })
    }

    /// Byte offset of slot `idx`, if the whole entry lies inside the mapping.
    fn slot(&self, idx: u64) -> Option<usize> {
        let off = usize::try_from(idx.checked_mul(CQ_ENTRY_SIZE)?).ok()?;
        (off.checked_add(ENTRY_LEN)? <= self.map.len()).then_some(off)
    }

    /// Reads slot `idx`; `None` when out of range.
    fn read(&self, idx: u64) -> Option<CqEntry> {
        let off = self.slot(idx)?;
        let mut b = [0u8; ENTRY_LEN];
        // SAFETY: `off + 20 <= map.len()` (checked by `slot`), so the source range lies in
        // the live mapping owned by `self`, and `b` is a distinct local buffer. No thread
        // writes these bytes concurrently: appends only write slots at or above
        // `next_offset`, which readers do not read until `next` is published (Release /
        // Acquire), and rewrites of published slots (overwrite, truncate) hold the files
        // write lock, which excludes readers (they read under the read lock).
        unsafe {
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(off), b.as_mut_ptr(), ENTRY_LEN);
        }
        Some(CqEntry::from_bytes(&b))
    }

    /// Writes slot `idx`; `false` when out of range.
    fn write(&self, idx: u64, bytes: &[u8; ENTRY_LEN]) -> bool {
        let Some(off) = self.slot(idx) else {
            return false;
        };
        // SAFETY: bounds checked by `slot`; the mapping is shared and writable (`map_raw`
        // of a read-write file) and lives as long as `self`. Writers are serialised by the
        // caller, and readers never read this slot concurrently (see `read`).
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.map.as_mut_ptr().add(off),
                ENTRY_LEN,
            );
        }
        self.dirty.store(true, Ordering::Release);
        true
    }

    fn zero_from(&self, idx: u64, count: u64) {
        let zero = [0u8; ENTRY_LEN];
        for i in idx..count {
            self.write(i, &zero);
        }
    }

    fn msync(&self) -> Result<()> {
        if self.dirty.swap(false, Ordering::AcqRel) {
            if let Err(e) = self.map.flush() {
                self.dirty.store(true, Ordering::Release);
                return Err(StoreError::Fatal(format!(
                    "msync of {} failed: {e}",
                    self.path.display()
                )));
            }
        }
        Ok(())
    }
}

type Files = BTreeMap<u64, Arc<CqFile>>;

/// A queue's consume queue.
pub(crate) struct FileQueue {
    dir: PathBuf,
    per_file: u64,
    file_len: u64,
    files: RwLock<Files>,
    next: AtomicU64,
    min: AtomicU64,
    /// Files were created since the last directory fsync.
    dir_dirty: AtomicBool,
}

impl FileQueue {
    /// Opens (creating `dir` if missing) the queue's files; `next_offset` becomes one past
    /// the last written (non-zero) entry of the last file, `min_offset` the first file's start.
    pub fn open(dir: &Path, entries_per_file: u64) -> Result<FileQueue> {
        if entries_per_file == 0 {
            return Err(StoreError::Invalid(
                "consume queue entries_per_file must be > 0".into(),
            ));
        }
        let file_len = entries_per_file
            .checked_mul(CQ_ENTRY_SIZE)
            .filter(|&l| usize::try_from(l).is_ok())
            .ok_or_else(|| {
                StoreError::Invalid(format!("entries_per_file {entries_per_file} too large"))
            })?;
        fs::create_dir_all(dir).map_err(StoreError::at(dir))?;
        let mut files = Files::new();
        for ent in fs::read_dir(dir).map_err(StoreError::at(dir))? {
            let ent = ent.map_err(StoreError::at(dir))?;
            let name = ent.file_name();
            let Some(start) = name.to_str().and_then(file::parse_offset_name) else {
                continue;
            };
            let path = ent.path();
            if start % entries_per_file != 0 {
                return Err(StoreError::Corrupt {
                    path,
                    offset: 0,
                    reason: format!(
                        "file start {start} is not a multiple of {entries_per_file} entries"
                    ),
                });
            }
            // A file shorter than its size is one a crash caught while it was being
            // created: extend it with unwritten entries (recovery replays the log into
            // it). A longer one is damage.
            let len = ent.metadata().map_err(StoreError::at(&path))?.len();
            if len < file_len {
                tracing::info!(path = %path.display(), len, "consume queue: extending a short file");
            }
            files.insert(
                start,
                Arc::new(CqFile::open(path, file_len, len < file_len)?),
            );
        }
        let min = files.keys().next().copied().unwrap_or(0);
        let mut next = min;
        'files: for (&start, f) in files.iter().rev() {
            for idx in (0..entries_per_file).rev() {
                if f.read(idx).is_some_and(|e| e.size != 0) {
                    next = start
                        .checked_add(idx + 1)
                        .ok_or_else(|| StoreError::Corrupt {
                            path: f.path.clone(),
                            offset: idx * CQ_ENTRY_SIZE,
                            reason: "logical offset overflows".into(),
                        })?;
                    break 'files;
                }
            }
        }
        Ok(FileQueue {
            dir: dir.to_path_buf(),
            per_file: entries_per_file,
            file_len,
            files: RwLock::new(files),
            next: AtomicU64::new(next),
            min: AtomicU64::new(min),
            dir_dirty: AtomicBool::new(false),
        })
    }

    fn read_files(&self) -> RwLockReadGuard<'_, Files> {
        self.files.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_files(&self) -> RwLockWriteGuard<'_, Files> {
        self.files.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Start of the file holding `logical`, and the slot inside it.
    fn locate(&self, logical: u64) -> (u64, u64) {
        let idx = logical % self.per_file;
        (logical - idx, idx)
    }

    /// Number of files currently held.
    pub fn file_count(&self) -> usize {
        self.read_files().len()
    }

    /// Recomputes `min` from the files (call with the write lock held).
    fn update_min(&self, files: &Files) {
        let min = files
            .keys()
            .next()
            .copied()
            .unwrap_or_else(|| self.next.load(Ordering::Acquire));
        self.min.store(min, Ordering::Release);
    }

    fn create_file(&self, start: u64) -> Result<Arc<CqFile>> {
        let path = self.dir.join(file::offset_name(start));
        let f = Arc::new(CqFile::open(path, self.file_len, true)?);
        self.dir_dirty.store(true, Ordering::Release);
        Ok(f)
    }

    /// Writes `entry` at `logical`. `logical == next_offset` appends; below overwrites (replay
    /// after a crash); above leaves a gap of unwritten entries (also only in recovery).
    /// Creates and preallocates files as needed. `next_offset` becomes max(next, logical + 1).
    /// An entry with `size == 0` (which would read back as unwritten) is `Invalid`.
    pub fn put(&self, logical: u64, entry: CqEntry) -> Result<()> {
        if entry.size == 0 {
            return Err(StoreError::Invalid(
                "consume queue entry with size 0".into(),
            ));
        }
        let new_next = logical
            .checked_add(1)
            .ok_or_else(|| StoreError::Invalid("logical offset overflows".into()))?;
        let bytes = entry.to_bytes();
        let (start, idx) = self.locate(logical);
        let next = self.next.load(Ordering::Acquire);
        if logical < next {
            // Overwrite of a possibly published slot: exclude readers.
            let mut files = self.write_files();
            let f = match files.get(&start) {
                Some(f) => Arc::clone(f),
                None => {
                    let f = self.create_file(start)?;
                    files.insert(start, Arc::clone(&f));
                    self.update_min(&files);
                    f
                }
            };
            f.write(idx, &bytes);
            return Ok(());
        }
        // Append (or gap): nobody reads this slot before `next` is published.
        let existing = self.read_files().get(&start).cloned();
        let f = match existing {
            Some(f) => f,
            None => {
                let f = self.create_file(start)?;
                let mut files = self.write_files();
                files.insert(start, Arc::clone(&f));
                self.update_min(&files);
                f
            }
        };
        f.write(idx, &bytes);
        self.next.fetch_max(new_next, Ordering::Release);
        Ok(())
    }

    /// The entry at `logical`, or `None` when it is outside `min_offset..next_offset`,
    /// its file was deleted, or it is unwritten (size 0).
    pub fn get(&self, logical: u64) -> Option<CqEntry> {
        let (start, idx) = self.locate(logical);
        let files = self.read_files();
        if logical >= self.next.load(Ordering::Acquire) {
            return None;
        }
        let e = files.get(&start)?.read(idx)?;
        (e.size != 0).then_some(e)
    }

    /// One past the highest written entry.
    pub fn next_offset(&self) -> u64 {
        self.next.load(Ordering::Acquire)
    }

    /// The first logical offset still held (start of the oldest remaining file).
    pub fn min_offset(&self) -> u64 {
        self.min.load(Ordering::Acquire)
    }

    /// Discards entries at `logical` and above (zeroes them, deletes files wholly above).
    /// The file containing `logical` is kept (zeroed from `logical` on) and synced.
    pub fn truncate_from(&self, logical: u64) -> Result<()> {
        let (start, idx) = self.locate(logical);
        let mut files = self.write_files();
        self.next.fetch_min(logical, Ordering::Release);
        let above: Vec<u64> = files
            .range(start.saturating_add(1)..)
            .map(|(&s, _)| s)
            .collect();
        let removed = !above.is_empty();
        for s in above.into_iter().rev() {
            if let Some(f) = files.get(&s) {
                fs::remove_file(&f.path).map_err(StoreError::at(&f.path))?;
            }
            files.remove(&s);
        }
        let kept = files.get(&start).cloned();
        if let Some(f) = &kept {
            f.zero_from(idx, self.per_file);
        }
        self.update_min(&files);
        drop(files);
        if let Some(f) = kept {
            f.msync()?;
        }
        if removed {
            file::sync_dir(&self.dir)?;
        }
        Ok(())
    }

    /// Discards every entry whose `commit_offset >= commit_offset` (recovery after the
    /// commitlog tail was cut). Entries are in increasing commit-offset order.
    pub fn truncate_commit_from(&self, commit_offset: u64) -> Result<()> {
        let next = self.next_offset();
        let snapshot: Vec<(u64, Arc<CqFile>)> = self
            .read_files()
            .range(..next)
            .map(|(&s, f)| (s, Arc::clone(f)))
            .collect();
        // Lowest written entry found with commit_offset >= the cut.
        let mut first_bad: Option<u64> = None;
        'files: for (start, f) in snapshot.iter().rev() {
            let limit = next.saturating_sub(*start).min(self.per_file);
            let written = |i: u64| f.read(i).filter(|e| e.size != 0);
            // Fast path: a file whose first written entry is already cut is cut whole.
            match (0..limit).find_map(|i| written(i).map(|e| (i, e))) {
                None => continue,
                Some((i, e)) if e.commit_offset >= commit_offset => {
                    first_bad = Some(start + i);
                    continue;
                }
                Some(_) => {}
            }
            for i in (0..limit).rev() {
                if let Some(e) = written(i) {
                    if e.commit_offset >= commit_offset {
                        first_bad = Some(start + i);
                    } else {
                        break 'files;
                    }
                }
            }
            break;
        }
        match first_bad {
            Some(l) => self.truncate_from(l),
            None => Ok(()),
        }
    }

    /// Deletes files all of whose entries are below `logical`, never the file holding
    /// `next_offset` (nor the one holding `next_offset - 1`, nor the last file); returns
    /// how many were deleted. `min_offset` moves up accordingly.
    pub fn delete_files_below(&self, logical: u64) -> Result<usize> {
        let mut files = self.write_files();
        let next = self.next.load(Ordering::Acquire);
        let last = files.keys().next_back().copied();
        let doomed: Vec<u64> = files
            .keys()
            .copied()
            .take_while(|&s| {
                let end = s.saturating_add(self.per_file);
                end <= logical && end < next && Some(s) != last
            })
            .collect();
        let mut deleted = 0;
        let mut result = Ok(());
        for s in doomed {
            if let Some(f) = files.get(&s) {
                if let Err(e) = fs::remove_file(&f.path) {
                    result = Err(StoreError::io(&f.path, e));
                    break;
                }
            }
            files.remove(&s);
            deleted += 1;
        }
        self.update_min(&files);
        drop(files);
        result?;
        if deleted > 0 {
            file::sync_dir(&self.dir)?;
        }
        Ok(deleted)
    }

    /// Makes everything written so far durable (msync of the dirty files).
    pub fn flush(&self) -> Result<()> {
        if self.dir_dirty.swap(false, Ordering::AcqRel) {
            if let Err(e) = file::sync_dir(&self.dir) {
                self.dir_dirty.store(true, Ordering::Release);
                return Err(e);
            }
        }
        let dirty: Vec<Arc<CqFile>> = self
            .read_files()
            .values()
            .filter(|f| f.dirty.load(Ordering::Acquire))
            .cloned()
            .collect();
        for f in dirty {
            f.msync()?;
        }
        Ok(())
    }

    /// Whether `dir` holds any consume-queue file (`false` when it does not exist).
    pub fn has_files(dir: &Path) -> Result<bool> {
        let it = match fs::read_dir(dir) {
            Ok(it) => it,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(StoreError::io(dir, e)),
        };
        for ent in it {
            let ent = ent.map_err(StoreError::at(dir))?;
            if ent
                .file_name()
                .to_str()
                .and_then(file::parse_offset_name)
                .is_some()
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Renames the queue's directory to `to` (which must not exist) and keeps using the
    /// files there. Not durable until the parent directory is synced.
    pub fn rename_dir(&mut self, to: &Path) -> Result<()> {
        fs::rename(&self.dir, to).map_err(StoreError::at(to))?;
        self.dir = to.to_path_buf();
        let files = self.files.get_mut().unwrap_or_else(PoisonError::into_inner);
        for (&start, f) in files.iter_mut() {
            let path = to.join(file::offset_name(start));
            match Arc::get_mut(f) {
                Some(f) => f.path = path,
                None => {
                    return Err(StoreError::Fatal(format!(
                        "consume queue file {} is shared during a rename",
                        path.display()
                    )))
                }
            }
        }
        Ok(())
    }

    /// Deletes the queue's directory and all its files.
    #[cfg(test)]
    pub fn destroy(self) -> Result<()> {
        let FileQueue { dir, files, .. } = self;
        drop(files);
        fs::remove_dir_all(&dir).map_err(StoreError::at(&dir))?;
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            file::sync_dir(parent)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ent(l: u64) -> CqEntry {
        CqEntry {
            commit_offset: l * 100 + 7,
            size: (l % 1000) as u32 + 1,
            tag_hash: l.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        }
    }

    fn fill(cq: &FileQueue, n: u64) {
        for l in 0..n {
            cq.put(l, ent(l)).unwrap();
        }
    }

    #[test]
    fn round_trip_and_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("q");
        let cq = FileQueue::open(&d, 7).unwrap();
        assert_eq!((cq.min_offset(), cq.next_offset()), (0, 0));
        assert_eq!(cq.get(0), None);
        fill(&cq, 100);
        assert_eq!(cq.next_offset(), 100);
        assert_eq!(cq.file_count(), 15);
        for l in 0..100 {
            assert_eq!(cq.get(l), Some(ent(l)));
        }
        assert_eq!(cq.get(100), None);
        cq.flush().unwrap();
        drop(cq);
        std::fs::write(d.join("00000000000000000007.tmp"), b"x").unwrap();
        std::fs::write(d.join("garbage"), b"x").unwrap();
        let cq = FileQueue::open(&d, 7).unwrap();
        assert_eq!((cq.min_offset(), cq.next_offset()), (0, 100));
        for l in 0..100 {
            assert_eq!(cq.get(l), Some(ent(l)));
        }
        cq.put(100, ent(100)).unwrap();
        assert_eq!(cq.get(100), Some(ent(100)));
        cq.destroy().unwrap();
        assert!(!d.exists());
    }

    #[test]
    fn overwrite_gap_and_zero_size() {
        let dir = tempfile::tempdir().unwrap();
        let cq = FileQueue::open(dir.path(), 4).unwrap();
        fill(&cq, 6);
        cq.put(2, ent(50)).unwrap();
        assert_eq!(cq.get(2), Some(ent(50)));
        assert_eq!(cq.next_offset(), 6);
        cq.put(13, ent(13)).unwrap(); // gap 6..13, file 8 never created
        assert_eq!(cq.next_offset(), 14);
        assert_eq!(cq.file_count(), 3);
        for l in 6..13 {
            assert_eq!(cq.get(l), None);
        }
        assert_eq!(cq.get(13), Some(ent(13)));
        assert!(matches!(
            cq.put(20, CqEntry::default()),
            Err(StoreError::Invalid(_))
        ));
        drop(cq);
        let cq = FileQueue::open(dir.path(), 4).unwrap();
        assert_eq!((cq.min_offset(), cq.next_offset()), (0, 14));
        assert_eq!(cq.get(2), Some(ent(50)));
        assert_eq!(cq.get(8), None);
        assert_eq!(cq.get(13), Some(ent(13)));
    }

    #[test]
    fn truncate_from_every_position() {
        for per in [4u64, 7] {
            for cut in 0..=30 {
                let dir = tempfile::tempdir().unwrap();
                let cq = FileQueue::open(dir.path(), per).unwrap();
                fill(&cq, 30);
                cq.truncate_from(cut).unwrap();
                assert_eq!(cq.next_offset(), cut);
                for l in 0..32 {
                    assert_eq!(
                        cq.get(l),
                        (l < cut).then(|| ent(l)),
                        "per {per} cut {cut} l {l}"
                    );
                }
                let files = cq.file_count() as u64;
                assert_eq!(files, cut / per + 1, "per {per} cut {cut}");
                drop(cq);
                let cq = FileQueue::open(dir.path(), per).unwrap();
                assert_eq!((cq.min_offset(), cq.next_offset()), (0, cut));
                for l in 0..32 {
                    assert_eq!(cq.get(l), (l < cut).then(|| ent(l)));
                }
                // Appending after a truncation works and survives a reopen.
                fill(&cq, 33);
                drop(cq);
                let cq = FileQueue::open(dir.path(), per).unwrap();
                assert_eq!(cq.next_offset(), 33);
                assert_eq!(cq.get(32), Some(ent(32)));
            }
        }
    }

    #[test]
    fn truncate_commit_from_cuts_at_first_entry_at_or_above() {
        let dir = tempfile::tempdir().unwrap();
        let cq = FileQueue::open(dir.path(), 4).unwrap();
        fill(&cq, 20); // commit offsets 7, 107, 207, ...
        cq.truncate_commit_from(5_000).unwrap();
        assert_eq!(cq.next_offset(), 20);
        cq.truncate_commit_from(1_907).unwrap();
        assert_eq!(cq.next_offset(), 19);
        cq.truncate_commit_from(1_000).unwrap(); // 1007 is entry 10
        assert_eq!(cq.next_offset(), 10);
        assert_eq!(cq.get(9), Some(ent(9)));
        assert_eq!(cq.get(10), None);
        cq.truncate_commit_from(808).unwrap(); // entries 0..=8 stay
        assert_eq!(cq.next_offset(), 9);
        // With a gap: entries 0..9, then 30 (3007).
        cq.put(30, ent(30)).unwrap();
        cq.truncate_commit_from(3_000).unwrap();
        assert_eq!(cq.next_offset(), 30);
        cq.truncate_commit_from(0).unwrap();
        assert_eq!(cq.next_offset(), 0);
        assert_eq!(cq.get(0), None);
    }

    #[test]
    fn delete_files_below_keeps_the_tail() {
        let dir = tempfile::tempdir().unwrap();
        let cq = FileQueue::open(dir.path(), 4).unwrap();
        fill(&cq, 18); // files 0,4,8,12,16
        assert_eq!(cq.delete_files_below(7).unwrap(), 1);
        assert_eq!(cq.min_offset(), 4);
        assert_eq!(cq.get(3), None);
        assert_eq!(cq.get(4), Some(ent(4)));
        assert_eq!(cq.delete_files_below(1000).unwrap(), 3);
        assert_eq!(cq.min_offset(), 16);
        assert_eq!(cq.file_count(), 1);
        assert_eq!(cq.get(17), Some(ent(17)));
        cq.put(18, ent(18)).unwrap();
        cq.put(19, ent(19)).unwrap(); // exactly fills file 16: it holds next - 1
        assert_eq!(cq.delete_files_below(1000).unwrap(), 0);
        drop(cq);
        let cq = FileQueue::open(dir.path(), 4).unwrap();
        assert_eq!((cq.min_offset(), cq.next_offset()), (16, 20));
    }

    #[test]
    fn wrong_file_length_is_corrupt_but_short_is_extended() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(file::offset_name(0)), [0u8; 81]).unwrap();
        assert!(matches!(
            FileQueue::open(dir.path(), 4),
            Err(StoreError::Corrupt { .. })
        ));
        // a crash while a file was being created leaves it short: extended, not an error
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(file::offset_name(0)), [0u8; 0]).unwrap();
        let cq = FileQueue::open(dir.path(), 4).unwrap();
        assert_eq!(cq.next_offset(), 0);
        assert_eq!(
            std::fs::metadata(dir.path().join(file::offset_name(0)))
                .unwrap()
                .len(),
            80
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(file::offset_name(0)), [0u8; 79]).unwrap();
        assert!(!matches!(
            FileQueue::open(dir.path(), 4),
            Err(StoreError::Corrupt { .. })
        ));
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(file::offset_name(3)), [0u8; 80]).unwrap();
        assert!(matches!(
            FileQueue::open(dir.path(), 4),
            Err(StoreError::Corrupt { .. })
        ));
        assert!(FileQueue::open(dir.path(), 0).is_err());
    }

    #[test]
    fn concurrent_reader_never_sees_torn_entries() {
        let dir = tempfile::tempdir().unwrap();
        let cq = Arc::new(FileQueue::open(dir.path(), 1000).unwrap());
        const N: u64 = 100_000;
        let reader = {
            let cq = Arc::clone(&cq);
            std::thread::spawn(move || {
                let mut seen = 0u64;
                let mut probe = 0u64;
                while seen < N {
                    let next = cq.next_offset();
                    assert!(next >= seen);
                    seen = next;
                    if next > 0 {
                        assert_eq!(cq.get(next - 1), Some(ent(next - 1)));
                        probe = (probe + 7919) % next;
                        assert_eq!(cq.get(probe), Some(ent(probe)));
                    }
                }
            })
        };
        for l in 0..N {
            cq.put(l, ent(l)).unwrap();
            if l % 10_000 == 0 {
                cq.flush().unwrap();
            }
        }
        reader.join().unwrap();
        cq.flush().unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put(u64, u32, u64),
        Truncate(u64),
        TruncateCommit(u64),
        DeleteBelow(u64),
        Reopen,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            8 => (0u64..40, 1u32.., any::<u64>()).prop_map(|(l, s, t)| Op::Put(l, s, t)),
            1 => (0u64..45).prop_map(Op::Truncate),
            1 => (0u64..45 * 16).prop_map(Op::TruncateCommit),
            1 => (0u64..45).prop_map(Op::DeleteBelow),
            1 => Just(Op::Reopen),
        ]
    }

    /// Model: entries, file starts, next.
    struct Model {
        per: u64,
        e: Vec<Option<CqEntry>>,
        files: std::collections::BTreeSet<u64>,
        next: u64,
    }

    impl Model {
        fn truncate(&mut self, l: u64) {
            for x in l..self.e.len() as u64 {
                self.e[x as usize] = None;
            }
            let fs = l / self.per * self.per;
            self.files.retain(|&s| s <= fs);
            self.next = self.next.min(l);
        }
        fn min(&self) -> u64 {
            self.files.first().copied().unwrap_or(self.next)
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        #[test]
        fn matches_vec_model(per in prop_oneof![Just(4u64), Just(7u64)], ops in proptest::collection::vec(op(), 1..60)) {
            let dir = tempfile::tempdir().unwrap();
            let mut cq = FileQueue::open(dir.path(), per).unwrap();
            let mut m = Model { per, e: vec![None; 64], files: Default::default(), next: 0 };
            for o in ops {
                match o {
                    Op::Put(l, size, tag) => {
                        let e = CqEntry { commit_offset: l * 16 + 1, size, tag_hash: tag };
                        cq.put(l, e).unwrap();
                        m.e[l as usize] = Some(e);
                        m.files.insert(l / per * per);
                        m.next = m.next.max(l + 1);
                    }
                    Op::Truncate(l) => {
                        cq.truncate_from(l).unwrap();
                        m.truncate(l);
                    }
                    Op::TruncateCommit(c) => {
                        cq.truncate_commit_from(c).unwrap();
                        let cut = m.e.iter().position(|e| e.is_some_and(|e| e.commit_offset >= c));
                        if let Some(cut) = cut {
                            m.truncate(cut as u64);
                        }
                    }
                    Op::DeleteBelow(l) => {
                        let last = m.files.last().copied();
                        let doomed: Vec<u64> = m.files.iter().copied()
                            .take_while(|&s| s + per <= l && s + per < m.next && Some(s) != last)
                            .collect();
                        prop_assert_eq!(cq.delete_files_below(l).unwrap(), doomed.len());
                        for s in doomed {
                            m.files.remove(&s);
                            for x in s..s + per {
                                m.e[x as usize] = None;
                            }
                        }
                    }
                    Op::Reopen => {
                        cq.flush().unwrap();
                        drop(cq);
                        cq = FileQueue::open(dir.path(), per).unwrap();
                        m.next = match m.e.iter().rposition(Option::is_some) {
                            Some(p) => p as u64 + 1,
                            None => m.files.first().copied().unwrap_or(0),
                        };
                    }
                }
                prop_assert_eq!(cq.next_offset(), m.next);
                prop_assert_eq!(cq.min_offset(), m.min());
                prop_assert_eq!(cq.file_count(), m.files.len());
                for l in 0..m.e.len() as u64 {
                    prop_assert_eq!(cq.get(l), m.e[l as usize], "entry {}", l);
                }
            }
        }
    }
}

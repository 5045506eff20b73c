//! IndexFile: an on-disk hash index from message key to commitlog offsets.
//!
//! RocketMQ's layout: a header (magic, version, begin/end store timestamp, begin/end
//! commitlog offset, slot count, entry count), a slot table (u32 per slot: index of the
//! newest entry whose key hashes there, 0 = empty), then fixed 20-byte entries (u32 key
//! hash, u64 commitlog offset, u32 seconds since the file's begin timestamp, u32 index of
//! the previous entry in the same slot). Files are named `<dir>/<20-digit created ms>`,
//! bounded by `max_entries`; a full file is sealed and a new one started.
//!
//! Triad's header is 64 bytes, little-endian:
//!
//! | bytes  | field                                              |
//! |--------|----------------------------------------------------|
//! | 0..4   | magic `b"TIDX"`                                    |
//! | 4..8   | version (1)                                        |
//! | 8..16  | begin store timestamp (ms, of the first entry)     |
//! | 16..24 | end store timestamp (ms, highest stored)           |
//! | 24..32 | begin commit offset (of the first entry)           |
//! | 32..40 | end commit offset (highest stored)                 |
//! | 40..44 | slot count                                         |
//! | 44..48 | max entries (capacity)                             |
//! | 48..52 | entry count                                        |
//! | 52..64 | reserved (0)                                       |
//!
//! Entry numbers start at 1 (0 = none); entry `n` lives at
//! `64 + slots * 4 + (n - 1) * 20`. The key hash is CRC32C and its slot `hash % slots`.
//! A file is `64 + slots * 4 + max_entries * 20` bytes, preallocated and mapped.
//!
//! Crash safety: `put` writes the entry, then the slot, then the header (entry count
//! last), so a crash leaves at worst one entry past the count; `open` undoes a slot that
//! points at it. New files are initialised under a `.tmp` name and renamed into place.
//! Damage never panics: a file with an invalid header or length is renamed to
//! `<name>.bad`, counts are clamped, and a chain walk stops at a link that does not
//! strictly decrease or after `max_entries` steps.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use memmap2::MmapMut;

use crate::error::{Result, StoreError};
use crate::file::{offset_name, open_preallocated, parse_offset_name, sync_dir};

/// Size of an index file's header.
pub const INDEX_HEADER_SIZE: u64 = 64;
/// Size of one slot of the slot table.
pub const INDEX_SLOT_SIZE: u64 = 4;
/// Size of one index entry.
pub const INDEX_ENTRY_SIZE: u64 = 20;
/// Magic bytes at the start of every index file.
pub const INDEX_MAGIC: [u8; 4] = *b"TIDX";
/// Current index file format version.
pub const INDEX_VERSION: u32 = 1;

const H_MAGIC: usize = 0;
const H_VERSION: usize = 4;
const H_BEGIN_TS: usize = 8;
const H_END_TS: usize = 16;
const H_BEGIN_OFF: usize = 24;
const H_END_OFF: usize = 32;
const H_SLOTS: usize = 40;
const H_MAX: usize = 44;
const H_COUNT: usize = 48;

/// Sizes of one index file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Hash slots per file.
    pub slots: u32,
    /// Entries per file before a new file is started.
    pub max_entries: u32,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            slots: 1 << 20,
            max_entries: 4 << 20,
        }
    }
}

impl IndexConfig {
    /// Size in bytes of one file with these sizes (`None` when it overflows).
    pub fn file_size(&self) -> Option<u64> {
        file_size(self.slots, self.max_entries)
    }
}

/// What one index file covers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexFileInfo {
    pub path: PathBuf,
    pub begin_ts_ms: u64,
    pub end_ts_ms: u64,
    pub begin_offset: u64,
    pub end_offset: u64,
    pub entries: u32,
}

/// All index files of a store. Send + Sync; `put` is called under the store's writer lock.
pub struct IndexService {
    dir: PathBuf,
    cfg: IndexConfig,
    /// Oldest first; the last one is the active file (appended to unless full).
    files: Mutex<Vec<IndexFile>>,
}

impl IndexService {
    /// Opens `dir` (creating it), loading existing files; a damaged header or chain is
    /// tolerated (bounded, never a panic): lookups stop at an invalid link.
    pub fn open(dir: &Path, cfg: IndexConfig) -> Result<IndexService> {
        if cfg.slots == 0 || cfg.max_entries == 0 {
            return Err(StoreError::Invalid(
                "index slots and max_entries must be at least 1".into(),
            ));
        }
        let size = cfg
            .file_size()
            .ok_or_else(|| StoreError::Invalid("index file size overflows".into()))?;
        usize::try_from(size)
            .map_err(|_| StoreError::Invalid("index file size exceeds the address space".into()))?;
        fs::create_dir_all(dir).map_err(StoreError::at(dir))?;

        let mut names = Vec::new();
        let mut changed = false;
        for item in fs::read_dir(dir).map_err(StoreError::at(dir))? {
            let item = item.map_err(StoreError::at(dir))?;
            let name = item.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Some(ms) = parse_offset_name(name) {
                names.push((ms, item.path()));
            } else if name
                .strip_suffix(".tmp")
                .and_then(parse_offset_name)
                .is_some()
            {
                // A file whose creation was interrupted: it never held entries.
                let p = item.path();
                fs::remove_file(&p).map_err(StoreError::at(&p))?;
                changed = true;
            }
        }
        names.sort();

        let mut files = Vec::with_capacity(names.len());
        for (_, path) in names {
            match IndexFile::load(&path)? {
                Ok(mut f) => {
                    f.repair_torn_put();
                    files.push(f);
                }
                Err(reason) => {
                    let mut bad = path.clone().into_os_string();
                    bad.push(".bad");
                    let bad = PathBuf::from(bad);
                    tracing::warn!(
                        path = %path.display(),
                        aside = %bad.display(),
                        %reason,
                        "invalid index file set aside"
                    );
                    fs::rename(&path, &bad).map_err(StoreError::at(&path))?;
                    changed = true;
                }
            }
        }
        if changed {
            sync_dir(dir)?;
        }
        Ok(IndexService {
            dir: dir.to_path_buf(),
            cfg,
            files: Mutex::new(files),
        })
    }

    /// Adds `key -> commit_offset`, stored at `store_ts_ms`.
    pub fn put(&self, key: &[u8], commit_offset: u64, store_ts_ms: u64) -> Result<()> {
        self.put_hash(key_hash(key), commit_offset, store_ts_ms)
    }

    /// Candidate commitlog offsets for `key` stored within `begin_ts_ms..=end_ts_ms`, newest
    /// first, without duplicates, at most `max`. Hash collisions are possible: the caller
    /// verifies the key against the record.
    ///
    /// Entries keep their time at second granularity (relative to their file's first
    /// entry), so an entry stored up to a second before `begin_ts_ms` may be included.
    pub fn lookup(
        &self,
        key: &[u8],
        max: usize,
        begin_ts_ms: u64,
        end_ts_ms: u64,
    ) -> Result<Vec<u64>> {
        Ok(self.lookup_hash(key_hash(key), max, begin_ts_ms, end_ts_ms))
    }

    /// Makes everything written so far durable.
    pub fn flush(&self) -> Result<()> {
        let mut files = self.lock();
        for f in files.iter_mut() {
            f.flush()?;
        }
        Ok(())
    }

    /// Deletes sealed files whose `end_offset < commit_offset`; returns how many.
    pub fn delete_files_below(&self, commit_offset: u64) -> Result<usize> {
        let mut files = self.lock();
        let mut deleted = 0;
        // The newest file is the active one and always kept.
        let mut i: usize = 0;
        while i.saturating_add(1) < files.len() {
            let doomed = files.get(i).is_some_and(|f| f.end_off < commit_offset);
            if !doomed {
                i += 1;
                continue;
            }
            let f = files.remove(i);
            let path = f.path.clone();
            drop(f);
            fs::remove_file(&path).map_err(StoreError::at(&path))?;
            deleted += 1;
        }
        if deleted > 0 {
            sync_dir(&self.dir)?;
        }
        Ok(deleted)
    }

    /// What each file covers, oldest first.
    pub fn files(&self) -> Vec<IndexFileInfo> {
        self.lock().iter().map(IndexFile::info).collect()
    }

    fn lock(&self) -> MutexGuard<'_, Vec<IndexFile>> {
        // A panic while holding the lock cannot leave a file inconsistent beyond what a
        // crash could, and readers tolerate that.
        self.files.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put_hash(&self, hash: u32, commit_offset: u64, store_ts_ms: u64) -> Result<()> {
        let mut files = self.lock();
        let need_new = files.last().is_none_or(IndexFile::is_full);
        if need_new {
            if let Some(sealed) = files.last_mut() {
                sealed.flush()?;
            }
            let after = files.last().map(|f| f.name_ms);
            let f = IndexFile::create(&self.dir, self.cfg, after)?;
            files.push(f);
        }
        let active = files
            .last_mut()
            .ok_or_else(|| StoreError::Fatal("index has no active file".into()))?;
        active.append(hash, commit_offset, store_ts_ms)
    }

    fn lookup_hash(&self, hash: u32, max: usize, begin_ts_ms: u64, end_ts_ms: u64) -> Vec<u64> {
        let mut out = Vec::new();
        if max == 0 || begin_ts_ms > end_ts_ms {
            return out;
        }
        let mut seen = HashSet::new();
        let files = self.lock();
        for f in files.iter().rev() {
            if out.len() >= max {
                break;
            }
            if f.count == 0 || end_ts_ms < f.begin_ts || begin_ts_ms > f.end_ts {
                continue;
            }
            f.collect(hash, max, begin_ts_ms, end_ts_ms, &mut seen, &mut out);
        }
        out
    }
}

fn key_hash(key: &[u8]) -> u32 {
    crc32c::crc32c(key)
}

fn file_size(slots: u32, max_entries: u32) -> Option<u64> {
    INDEX_HEADER_SIZE
        .checked_add(u64::from(slots).checked_mul(INDEX_SLOT_SIZE)?)?
        .checked_add(u64::from(max_entries).checked_mul(INDEX_ENTRY_SIZE)?)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn rd_u32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(s.try_into().ok()?))
}

fn rd_u64(b: &[u8], at: usize) -> Option<u64> {
    let s = b.get(at..at.checked_add(8)?)?;
    Some(u64::from_le_bytes(s.try_into().ok()?))
}

fn wr(b: &mut [u8], at: usize, bytes: &[u8]) -> Option<()> {
    b.get_mut(at..at.checked_add(bytes.len())?)?
        .copy_from_slice(bytes);
    Some(())
}

/// One decoded entry.
#[derive(Clone, Copy, Debug)]
struct Entry {
    hash: u32,
    offset: u64,
    secs: u32,
    prev: u32,
}

/// One mapped index file; header fields are cached and written through.
struct IndexFile {
    path: PathBuf,
    name_ms: u64,
    map: MmapMut,
    slots: u32,
    max_entries: u32,
    count: u32,
    begin_ts: u64,
    end_ts: u64,
    begin_off: u64,
    end_off: u64,
    /// Written since the last msync.
    dirty: bool,
}

impl IndexFile {
    /// Creates, initialises and durably publishes a new empty file named after the current
    /// time (or one past `after`, the newest existing name, if the clock is behind it).
    fn create(dir: &Path, cfg: IndexConfig, after: Option<u64>) -> Result<IndexFile> {
        let size = cfg
            .file_size()
            .ok_or_else(|| StoreError::Invalid("index file size overflows".into()))?;
        let mut name_ms = now_ms();
        if let Some(a) = after {
            name_ms = name_ms.max(a.saturating_add(1));
        }
        let mut path = dir.join(offset_name(name_ms));
        while path.exists() {
            name_ms = name_ms
                .checked_add(1)
                .ok_or_else(|| StoreError::Invalid("no free index file name".into()))?;
            path = dir.join(offset_name(name_ms));
        }
        let tmp = dir.join(format!("{}.tmp", offset_name(name_ms)));
        // A temp file left by an interrupted creation may hold old bytes: start afresh.
        match fs::remove_file(&tmp) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(StoreError::io(&tmp, e)),
        }
        let file = open_preallocated(&tmp, size)?;
        // SAFETY: the file is ours (fresh name; the data directory is locked against other
        // brokers) and fully allocated, so accesses through the mapping cannot fault.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(StoreError::at(&tmp))?;
        let mut f = IndexFile {
            path: path.clone(),
            name_ms,
            map,
            slots: cfg.slots,
            max_entries: cfg.max_entries,
            count: 0,
            begin_ts: 0,
            end_ts: 0,
            begin_off: 0,
            end_off: 0,
            dirty: false,
        };
        f.write_header_all()?;
        f.map
            .flush_range(0, INDEX_HEADER_SIZE as usize)
            .map_err(|e| StoreError::Fatal(format!("msync {}: {e}", tmp.display())))?;
        f.dirty = false;
        fs::rename(&tmp, &path).map_err(StoreError::at(&path))?;
        sync_dir(dir)?;
        Ok(f)
    }

    /// Maps and validates an existing file. The inner `Err` is why its content is invalid
    /// (the caller sets it aside); the outer one is an I/O failure.
    fn load(path: &Path) -> Result<std::result::Result<IndexFile, String>> {
        let name_ms = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_offset_name)
            .unwrap_or(0);
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(StoreError::at(path))?;
        let len = file.metadata().map_err(StoreError::at(path))?.len();
        if len < INDEX_HEADER_SIZE {
            return Ok(Err(format!("file of {len} bytes is shorter than a header")));
        }
        if usize::try_from(len).is_err() {
            return Ok(Err(format!("file of {len} bytes cannot be mapped")));
        }
        // SAFETY: index files are only written by this process (the data directory is
        // locked); the length was checked and the file is not truncated while mapped.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(StoreError::at(path))?;
        let b: &[u8] = &map;
        if b.get(H_MAGIC..H_MAGIC + 4) != Some(&INDEX_MAGIC[..]) {
            return Ok(Err("bad magic".into()));
        }
        let version = rd_u32(b, H_VERSION).unwrap_or(0);
        if version != INDEX_VERSION {
            return Ok(Err(format!("unknown version {version}")));
        }
        let slots = rd_u32(b, H_SLOTS).unwrap_or(0);
        let max_entries = rd_u32(b, H_MAX).unwrap_or(0);
        if slots == 0 || max_entries == 0 {
            return Ok(Err(format!(
                "invalid sizes: {slots} slots, {max_entries} max entries"
            )));
        }
        let want = file_size(slots, max_entries);
        if want != Some(len) {
            return Ok(Err(format!(
                "length {len} does not match {slots} slots and {max_entries} entries"
            )));
        }
        let mut count = rd_u32(b, H_COUNT).unwrap_or(0);
        if count > max_entries {
            tracing::warn!(
                path = %path.display(),
                count,
                max_entries,
                "index entry count clamped to capacity"
            );
            count = max_entries;
        }
        let f = IndexFile {
            path: path.to_path_buf(),
            name_ms,
            slots,
            max_entries,
            count,
            begin_ts: rd_u64(b, H_BEGIN_TS).unwrap_or(0),
            end_ts: rd_u64(b, H_END_TS).unwrap_or(0),
            begin_off: rd_u64(b, H_BEGIN_OFF).unwrap_or(0),
            end_off: rd_u64(b, H_END_OFF).unwrap_or(0),
            dirty: false,
            map,
        };
        Ok(Ok(f))
    }

    fn is_full(&self) -> bool {
        self.count >= self.max_entries
    }

    fn info(&self) -> IndexFileInfo {
        IndexFileInfo {
            path: self.path.clone(),
            begin_ts_ms: self.begin_ts,
            end_ts_ms: self.end_ts,
            begin_offset: self.begin_off,
            end_offset: self.end_off,
            entries: self.count,
        }
    }

    fn slot_pos(&self, hash: u32) -> Option<usize> {
        let slot = u64::from(hash.checked_rem(self.slots)?);
        let pos = INDEX_HEADER_SIZE.checked_add(slot.checked_mul(INDEX_SLOT_SIZE)?)?;
        usize::try_from(pos).ok()
    }

    /// Byte position of entry `n` (1-based), if it is within the capacity.
    fn entry_pos(&self, n: u32) -> Option<usize> {
        if n == 0 || n > self.max_entries {
            return None;
        }
        let pos = INDEX_HEADER_SIZE
            .checked_add(u64::from(self.slots).checked_mul(INDEX_SLOT_SIZE)?)?
            .checked_add(u64::from(n - 1).checked_mul(INDEX_ENTRY_SIZE)?)?;
        usize::try_from(pos).ok()
    }

    fn read_slot(&self, hash: u32) -> Option<u32> {
        rd_u32(&self.map, self.slot_pos(hash)?)
    }

    fn read_entry(&self, n: u32) -> Option<Entry> {
        let p = self.entry_pos(n)?;
        let b: &[u8] = &self.map;
        Some(Entry {
            hash: rd_u32(b, p)?,
            offset: rd_u64(b, p.checked_add(4)?)?,
            secs: rd_u32(b, p.checked_add(12)?)?,
            prev: rd_u32(b, p.checked_add(16)?)?,
        })
    }

    fn corrupt(&self, offset: usize, reason: &str) -> StoreError {
        StoreError::Corrupt {
            path: self.path.clone(),
            offset: offset as u64,
            reason: reason.into(),
        }
    }

    fn write_header_all(&mut self) -> Result<()> {
        let mut h = [0u8; INDEX_HEADER_SIZE as usize];
        let fields: [(usize, &[u8]); 9] = [
            (H_MAGIC, &INDEX_MAGIC),
            (H_VERSION, &INDEX_VERSION.to_le_bytes()),
            (H_BEGIN_TS, &self.begin_ts.to_le_bytes()),
            (H_END_TS, &self.end_ts.to_le_bytes()),
            (H_BEGIN_OFF, &self.begin_off.to_le_bytes()),
            (H_END_OFF, &self.end_off.to_le_bytes()),
            (H_SLOTS, &self.slots.to_le_bytes()),
            (H_MAX, &self.max_entries.to_le_bytes()),
            (H_COUNT, &self.count.to_le_bytes()),
        ];
        for (at, bytes) in fields {
            wr(&mut h, at, bytes).ok_or_else(|| self.corrupt(at, "header field out of range"))?;
        }
        wr(&mut self.map, 0, &h).ok_or_else(|| self.corrupt(0, "file shorter than header"))?;
        self.dirty = true;
        Ok(())
    }

    fn write_at(&mut self, at: usize, bytes: &[u8], what: &str) -> Result<()> {
        match wr(&mut self.map, at, bytes) {
            Some(()) => Ok(()),
            None => Err(self.corrupt(at, what)),
        }
    }

    /// Appends one entry; the caller made sure the file is not full.
    fn append(&mut self, hash: u32, offset: u64, ts_ms: u64) -> Result<()> {
        let n = self
            .count
            .checked_add(1)
            .filter(|&n| n <= self.max_entries)
            .ok_or_else(|| self.corrupt(H_COUNT, "index file is full"))?;
        let entry_at = self
            .entry_pos(n)
            .ok_or_else(|| self.corrupt(H_COUNT, "entry position out of range"))?;
        let slot_at = self
            .slot_pos(hash)
            .ok_or_else(|| self.corrupt(0, "slot position out of range"))?;
        if self.count == 0 {
            self.begin_ts = ts_ms;
            self.begin_off = offset;
            self.end_ts = ts_ms;
            self.end_off = offset;
            self.write_at(H_BEGIN_TS, &ts_ms.to_le_bytes(), "header")?;
            self.write_at(H_BEGIN_OFF, &offset.to_le_bytes(), "header")?;
        }
        // A head beyond the count is a leftover of a torn put (or damage): not a valid link.
        let prev = rd_u32(&self.map, slot_at)
            .filter(|&p| p <= self.count)
            .unwrap_or(0);
        let secs = u32::try_from(ts_ms.saturating_sub(self.begin_ts) / 1000).unwrap_or(u32::MAX);
        let mut e = [0u8; INDEX_ENTRY_SIZE as usize];
        e[0..4].copy_from_slice(&hash.to_le_bytes());
        e[4..12].copy_from_slice(&offset.to_le_bytes());
        e[12..16].copy_from_slice(&secs.to_le_bytes());
        e[16..20].copy_from_slice(&prev.to_le_bytes());
        self.dirty = true;
        self.write_at(entry_at, &e, "entry out of range")?;
        fence(Ordering::Release);
        self.write_at(slot_at, &n.to_le_bytes(), "slot out of range")?;
        fence(Ordering::Release);
        self.end_ts = self.end_ts.max(ts_ms);
        self.end_off = self.end_off.max(offset);
        let (end_ts, end_off) = (self.end_ts, self.end_off);
        self.write_at(H_END_TS, &end_ts.to_le_bytes(), "header")?;
        self.write_at(H_END_OFF, &end_off.to_le_bytes(), "header")?;
        fence(Ordering::Release);
        self.write_at(H_COUNT, &n.to_le_bytes(), "header")?;
        self.count = n;
        Ok(())
    }

    /// A put interrupted after its slot write but before the count: the slot points at
    /// entry `count + 1`. Point the slot back at that entry's predecessor.
    fn repair_torn_put(&mut self) {
        let Some(n) = self.count.checked_add(1) else {
            return;
        };
        let Some(e) = self.read_entry(n) else { return };
        let Some(slot_at) = self.slot_pos(e.hash) else {
            return;
        };
        if rd_u32(&self.map, slot_at) != Some(n) {
            return;
        }
        let prev = if e.prev < n { e.prev } else { 0 };
        if wr(&mut self.map, slot_at, &prev.to_le_bytes()).is_some() {
            self.dirty = true;
            tracing::warn!(path = %self.path.display(), entry = n, "undid a torn index put");
        }
    }

    /// Whether an entry stored `secs` after the file's begin may lie within `begin..=end`.
    fn time_matches(&self, secs: u32, begin: u64, end: u64) -> bool {
        let lo = self
            .begin_ts
            .saturating_add(u64::from(secs).saturating_mul(1000));
        let hi = lo.saturating_add(999).min(self.end_ts.max(lo));
        lo <= end && hi >= begin
    }

    /// Walks `hash`'s chain newest to oldest, appending matching offsets to `out`.
    fn collect(
        &self,
        hash: u32,
        max: usize,
        begin: u64,
        end: u64,
        seen: &mut HashSet<u64>,
        out: &mut Vec<u64>,
    ) {
        let mut cur = self.read_slot(hash).unwrap_or(0);
        if cur > self.count {
            // Dangling head (torn put or damage): nothing in this chain is trustworthy.
            return;
        }
        let mut steps = 0u32;
        while cur != 0 && steps < self.max_entries && out.len() < max {
            let Some(e) = self.read_entry(cur) else { break };
            if e.hash == hash && self.time_matches(e.secs, begin, end) && seen.insert(e.offset) {
                out.push(e.offset);
            }
            if e.prev >= cur {
                break;
            }
            cur = e.prev;
            steps += 1;
        }
    }

    fn flush(&mut self) -> Result<()> {
        if self.dirty {
            self.map
                .flush()
                .map_err(|e| StoreError::Fatal(format!("msync {}: {e}", self.path.display())))?;
            self.dirty = false;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BASE: u64 = 1_700_000_000_000;

    fn cfg(slots: u32, max_entries: u32) -> IndexConfig {
        IndexConfig { slots, max_entries }
    }

    fn all(svc: &IndexService, key: &[u8]) -> Vec<u64> {
        svc.lookup(key, usize::MAX, 0, u64::MAX).unwrap()
    }

    fn dir_names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn service_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<IndexService>();
    }

    /// Puts `rounds` offsets for each of `keys` keys; returns what each key should give.
    fn fill(svc: &IndexService, keys: u64, rounds: u64) -> Vec<Vec<u64>> {
        let mut want = vec![Vec::new(); keys as usize];
        for i in 0..keys * rounds {
            let k = i % keys;
            svc.put(format!("key-{k}").as_bytes(), i * 100, BASE + i)
                .unwrap();
            want[k as usize].insert(0, i * 100);
        }
        want
    }

    fn check_many(slots: u32) {
        let dir = tempfile::tempdir().unwrap();
        let svc = IndexService::open(dir.path(), cfg(slots, 100_000)).unwrap();
        let want = fill(&svc, 500, 3);
        for (k, w) in want.iter().enumerate() {
            let key = format!("key-{k}");
            assert_eq!(&all(&svc, key.as_bytes()), w, "key {k}, {slots} slots");
            assert_eq!(
                svc.lookup(key.as_bytes(), 2, 0, u64::MAX).unwrap(),
                w[..2].to_vec()
            );
        }
        assert!(all(&svc, b"missing").is_empty());
        assert!(svc.lookup(b"key-1", 0, 0, u64::MAX).unwrap().is_empty());
        let files = svc.files();
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].entries, 1500);
        assert_eq!(files[0].begin_offset, 0);
        assert_eq!(files[0].end_offset, 1499 * 100);
        assert_eq!(files[0].begin_ts_ms, BASE);
        assert_eq!(files[0].end_ts_ms, BASE + 1499);
    }

    #[test]
    fn many_keys() {
        check_many(1024);
        check_many(64);
    }

    #[test]
    fn colliding_slots() {
        check_many(1);
        check_many(2);
    }

    #[test]
    fn colliding_hashes_are_candidates_and_deduplicated() {
        let dir = tempfile::tempdir().unwrap();
        let svc = IndexService::open(dir.path(), cfg(2, 100)).unwrap();
        svc.put_hash(7, 10, BASE).unwrap();
        svc.put_hash(7, 20, BASE).unwrap();
        svc.put_hash(8, 30, BASE).unwrap();
        svc.put_hash(7, 10, BASE + 5).unwrap();
        svc.put_hash(7, 40, BASE + 5).unwrap();
        assert_eq!(svc.lookup_hash(7, 100, 0, u64::MAX), vec![40, 10, 20]);
        assert_eq!(svc.lookup_hash(8, 100, 0, u64::MAX), vec![30]);
        assert_eq!(svc.lookup_hash(9, 100, 0, u64::MAX), Vec::<u64>::new());
        assert_eq!(svc.lookup_hash(7, 2, 0, u64::MAX), vec![40, 10]);
    }

    #[test]
    fn time_range_filtering() {
        let dir = tempfile::tempdir().unwrap();
        // 20 entries per file: files cover 20 s each.
        let svc = IndexService::open(dir.path(), cfg(8, 20)).unwrap();
        for k in 0..100u64 {
            svc.put(b"a", k, BASE + k * 1000).unwrap();
            svc.put(b"b", 1000 + k, BASE + k * 1000).unwrap();
        }
        assert_eq!(svc.files().len(), 10);
        let got = svc.lookup(b"a", 100, BASE + 5000, BASE + 9000).unwrap();
        assert_eq!(got, vec![9, 8, 7, 6, 5]);
        // Across a file boundary (file 0 ends at 9 s, file 1 starts at 10 s).
        let got = svc.lookup(b"b", 100, BASE + 8000, BASE + 11_500).unwrap();
        assert_eq!(got, vec![1011, 1010, 1009, 1008]);
        assert!(svc.lookup(b"a", 100, 0, BASE - 1).unwrap().is_empty());
        assert!(svc
            .lookup(b"a", 100, BASE + 100_000, u64::MAX)
            .unwrap()
            .is_empty());
        assert!(svc.lookup(b"a", 100, BASE + 9000, BASE).unwrap().is_empty());
        assert_eq!(all(&svc, b"a").len(), 100);
        // Second granularity: an entry is kept if its second overlaps the range.
        assert_eq!(
            svc.lookup(b"a", 100, BASE + 3500, BASE + 3600).unwrap(),
            vec![3]
        );
        assert_eq!(
            svc.lookup(b"a", 3, BASE + 3000, u64::MAX).unwrap(),
            vec![99, 98, 97]
        );
    }

    #[test]
    fn rollover_and_lookup_across_files() {
        let dir = tempfile::tempdir().unwrap();
        let svc = IndexService::open(dir.path(), cfg(4, 10)).unwrap();
        for i in 0..95u64 {
            svc.put(format!("k{}", i % 7).as_bytes(), i * 10, BASE + i * 1000)
                .unwrap();
        }
        let files = svc.files();
        assert_eq!(files.len(), 10);
        for (n, f) in files.iter().enumerate() {
            let n = n as u64;
            assert_eq!(f.entries, if n < 9 { 10 } else { 5 });
            assert_eq!(f.begin_offset, n * 100);
            assert_eq!(f.end_offset, (n * 10 + u64::from(f.entries) - 1) * 10);
            assert_eq!(f.begin_ts_ms, BASE + n * 10_000);
            assert!(f.path.starts_with(dir.path()));
        }
        // Names strictly increase.
        assert!(files.windows(2).all(|w| w[0].path < w[1].path));
        for k in 0..7u64 {
            let want: Vec<u64> = (0..95u64)
                .rev()
                .filter(|i| i % 7 == k)
                .map(|i| i * 10)
                .collect();
            assert_eq!(all(&svc, format!("k{k}").as_bytes()), want);
            assert_eq!(
                svc.lookup(format!("k{k}").as_bytes(), 5, 0, u64::MAX)
                    .unwrap(),
                want[..5].to_vec()
            );
        }
        svc.flush().unwrap();
    }

    #[test]
    fn reopen_keeps_answers_and_appends_to_active_file() {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(16, 50);
        let (want, files) = {
            let svc = IndexService::open(dir.path(), c).unwrap();
            let want = fill(&svc, 30, 4); // 120 entries: 3 files, the last one 20 entries
            svc.flush().unwrap();
            (want, svc.files())
        };
        assert_eq!(files.len(), 3);
        let svc = IndexService::open(dir.path(), c).unwrap();
        assert_eq!(svc.files(), files);
        for (k, w) in want.iter().enumerate() {
            assert_eq!(&all(&svc, format!("key-{k}").as_bytes()), w);
        }
        svc.put(b"key-3", 999_999, BASE + 10_000).unwrap();
        let after = svc.files();
        assert_eq!(after.len(), 3);
        assert_eq!(after[2].path, files[2].path);
        assert_eq!(after[2].entries, 21);
        assert_eq!(after[2].end_offset, 999_999);
        let mut w3 = want[3].clone();
        w3.insert(0, 999_999);
        assert_eq!(all(&svc, b"key-3"), w3);
        drop(svc);
        // Reopening with other sizes keeps each file's own geometry.
        let svc = IndexService::open(dir.path(), cfg(3, 7)).unwrap();
        assert_eq!(all(&svc, b"key-3"), w3);
        for i in 0..40u64 {
            svc.put(b"new", i, BASE + 20_000).unwrap();
        }
        let f = svc.files();
        assert_eq!(f[2].entries, 50);
        assert_eq!(f.len(), 5); // 30 more in the old active file, then 7 + 3
        assert_eq!(f[3].entries, 7);
        assert_eq!(all(&svc, b"new"), (0..40u64).rev().collect::<Vec<_>>());
    }

    #[test]
    fn delete_files_below_keeps_the_active_file() {
        let dir = tempfile::tempdir().unwrap();
        let svc = IndexService::open(dir.path(), cfg(4, 10)).unwrap();
        for i in 0..100u64 {
            svc.put(b"k", i * 10, BASE + i).unwrap();
        }
        let files = svc.files();
        assert_eq!(files.len(), 10); // end offsets 90, 190, ..., 990
        assert_eq!(svc.delete_files_below(90).unwrap(), 0);
        assert_eq!(svc.delete_files_below(250).unwrap(), 2);
        assert!(!files[0].path.exists() && !files[1].path.exists());
        assert_eq!(svc.files(), files[2..].to_vec());
        assert_eq!(all(&svc, b"k").len(), 80);
        assert_eq!(svc.delete_files_below(u64::MAX).unwrap(), 7);
        assert_eq!(svc.files(), files[9..].to_vec());
        assert_eq!(dir_names(dir.path()).len(), 1);
        // The newest file is full: the next put starts a new one.
        svc.put(b"k", 5000, BASE + 500).unwrap();
        assert_eq!(svc.files().len(), 2);
        drop(svc);
        let svc = IndexService::open(dir.path(), cfg(4, 10)).unwrap();
        assert_eq!(svc.files().len(), 2);
        assert_eq!(all(&svc, b"k")[..2], [5000, 990]);
    }

    #[test]
    fn ignores_foreign_names_and_removes_temp_files() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("notes"), b"x").unwrap();
        fs::write(dir.path().join("123"), b"x").unwrap();
        fs::write(dir.path().join("00000000000000000001.tmp"), b"x").unwrap();
        let svc = IndexService::open(dir.path(), cfg(4, 10)).unwrap();
        assert!(svc.files().is_empty());
        assert!(all(&svc, b"k").is_empty());
        assert_eq!(dir_names(dir.path()), vec!["123", "notes"]);
        svc.put(b"k", 1, BASE).unwrap();
        assert_eq!(all(&svc, b"k"), vec![1]);
    }

    #[test]
    fn torn_put_is_undone_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(1, 100);
        let path = {
            let svc = IndexService::open(dir.path(), c).unwrap();
            for i in 0..5u64 {
                svc.put(b"k", i, BASE).unwrap();
            }
            svc.flush().unwrap();
            svc.files()[0].path.clone()
        };
        // Entry 5 and its slot were written, the count was not.
        let mut bytes = fs::read(&path).unwrap();
        bytes[H_COUNT..H_COUNT + 4].copy_from_slice(&4u32.to_le_bytes());
        fs::write(&path, &bytes).unwrap();
        let svc = IndexService::open(dir.path(), c).unwrap();
        assert_eq!(all(&svc, b"k"), vec![3, 2, 1, 0]);
        svc.put(b"k", 10, BASE).unwrap();
        svc.put(b"k", 11, BASE).unwrap();
        assert_eq!(all(&svc, b"k"), vec![11, 10, 3, 2, 1, 0]);
    }

    #[test]
    fn dangling_slot_head_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(1, 100);
        let path = {
            let svc = IndexService::open(dir.path(), c).unwrap();
            svc.put(b"k", 1, BASE).unwrap();
            svc.flush().unwrap();
            svc.files()[0].path.clone()
        };
        let mut bytes = fs::read(&path).unwrap();
        bytes[64..68].copy_from_slice(&50u32.to_le_bytes());
        fs::write(&path, &bytes).unwrap();
        let svc = IndexService::open(dir.path(), c).unwrap();
        assert!(all(&svc, b"k").is_empty());
        svc.put(b"k", 2, BASE).unwrap();
        assert_eq!(all(&svc, b"k"), vec![2]);
    }

    /// Writes three small files (`4` slots, `16` entries) holding keys `k0..k9`.
    fn sample(dir: &Path) -> Vec<IndexFileInfo> {
        let svc = IndexService::open(dir, cfg(4, 16)).unwrap();
        for i in 0..40u64 {
            svc.put(format!("k{}", i % 10).as_bytes(), i, BASE + i * 700)
                .unwrap();
        }
        svc.flush().unwrap();
        svc.files()
    }

    fn exercise(dir: &Path) {
        let svc = IndexService::open(dir, cfg(4, 16)).unwrap();
        let total: u64 = svc.files().iter().map(|f| u64::from(f.entries)).sum();
        for k in 0..12 {
            let key = format!("k{k}");
            let got = all(&svc, key.as_bytes());
            assert!(got.len() as u64 <= total);
            let mut d = got.clone();
            d.sort_unstable();
            d.dedup();
            assert_eq!(d.len(), got.len());
            let _ = svc
                .lookup(key.as_bytes(), 3, BASE + 2000, BASE + 9000)
                .unwrap();
        }
        for i in 0..20u64 {
            svc.put(b"after", 1000 + i, BASE + 100_000).unwrap();
        }
        let got = all(&svc, b"after");
        assert_eq!(got, (1000..1020u64).rev().collect::<Vec<_>>());
        let _ = svc.files();
        svc.flush().unwrap();
        let _ = svc.delete_files_below(u64::MAX).unwrap();
    }

    #[test]
    fn bad_header_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let files = sample(dir.path());
        let mut bytes = fs::read(&files[1].path).unwrap();
        bytes[0] ^= 0xff;
        fs::write(&files[1].path, &bytes).unwrap();
        let svc = IndexService::open(dir.path(), cfg(4, 16)).unwrap();
        let now = svc.files();
        assert_eq!(now, vec![files[0].clone(), files[2].clone()]);
        let mut bad = files[1].path.clone().into_os_string();
        bad.push(".bad");
        assert!(Path::new(&bad).exists());
        // k0 had offsets 0, 10, 20, 30; 20 and 30 were in the set-aside file
        // (offsets 16..32), 0 and 10 in the first one.
        assert_eq!(all(&svc, b"k0"), vec![10, 0]);
        assert_eq!(all(&svc, b"k5"), vec![35, 15, 5]);
    }

    #[test]
    fn wrong_lengths_are_set_aside() {
        let size = cfg(4, 16).file_size().unwrap();
        for len in [0, 10, 63, 64, 100, size - 1, size + 1, size * 2] {
            let dir = tempfile::tempdir().unwrap();
            let files = sample(dir.path());
            fs::OpenOptions::new()
                .write(true)
                .open(&files[2].path)
                .unwrap()
                .set_len(len)
                .unwrap();
            let svc = IndexService::open(dir.path(), cfg(4, 16)).unwrap();
            assert_eq!(svc.files(), files[..2].to_vec(), "len {len}");
            drop(svc);
            exercise(dir.path());
        }
    }

    #[test]
    fn huge_count_is_clamped() {
        let dir = tempfile::tempdir().unwrap();
        let files = sample(dir.path());
        let mut bytes = fs::read(&files[2].path).unwrap();
        bytes[H_COUNT..H_COUNT + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        fs::write(&files[2].path, &bytes).unwrap();
        let svc = IndexService::open(dir.path(), cfg(4, 16)).unwrap();
        assert_eq!(svc.files()[2].entries, 16);
        drop(svc);
        exercise(dir.path());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn random_damage_never_panics(
            flips in proptest::collection::vec((0usize..3, any::<usize>(), 1u8..=255), 1..40),
            header_only in any::<bool>(),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let files = sample(dir.path());
            for (fi, pos, x) in flips {
                let path = &files[fi].path;
                let mut bytes = fs::read(path).unwrap();
                let limit = if header_only { 64 } else { bytes.len() };
                bytes[pos % limit] ^= x;
                fs::write(path, &bytes).unwrap();
            }
            exercise(dir.path());
        }

        #[test]
        fn random_lengths_never_panic(fi in 0usize..3, len in 0u64..2000) {
            let dir = tempfile::tempdir().unwrap();
            let files = sample(dir.path());
            fs::OpenOptions::new()
                .write(true)
                .open(&files[fi].path)
                .unwrap()
                .set_len(len)
                .unwrap();
            exercise(dir.path());
        }
    }

    #[test]
    fn concurrent_puts_and_lookups() {
        let dir = tempfile::tempdir().unwrap();
        let svc = std::sync::Arc::new(IndexService::open(dir.path(), cfg(8, 64)).unwrap());
        let reader = {
            let svc = svc.clone();
            std::thread::spawn(move || {
                for _ in 0..200 {
                    let got = all(&svc, b"k");
                    assert!(got.windows(2).all(|w| w[0] > w[1]));
                }
            })
        };
        for i in 0..500u64 {
            svc.put(b"k", i, BASE + i).unwrap();
        }
        reader.join().unwrap();
        assert_eq!(all(&svc, b"k").len(), 500);
    }
}

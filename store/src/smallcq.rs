//! The shared index: one append-only, segmented file holding the consume-queue entries of
//! every small durable queue (after RocketMQ 5's light message queues), so that a queue
//! with a handful of entries owns no file, no mapping and no file descriptor.
//!
//! Layout: `<dir>/<20-digit segment number>`, each segment `entries * 40` bytes,
//! preallocated and memory-mapped while it is written. An entry is little-endian
//! `u32 queue, u32 size, u64 logical, u64 commit_offset, u64 tag_hash, u32 crc32c of the
//! first 32 bytes, u32 zero`. Slots are written in order; an unwritten slot is all zero
//! (its CRC does not match), and so is anything a crash tore.
//!
//! The entries themselves live in the queues' heap ([`crate::consumequeue`]): this file
//! only makes them durable. Each segment counts its *live* entries (those a queue still
//! holds); a queue that drops, overwrites or moves an entry releases it. A segment that
//! is not the one being written and has no live entry is deleted ([`SharedIndex::retire`]);
//! one with only a few left is compacted: its owners re-append them forward
//! ([`SharedIndex::victims`] names the segments, the queues move their entries), so one
//! old entry never pins a segment.
//!
//! At open every segment is read back ([`SharedIndex::open`] returns the entries in
//! append order: a later entry for the same queue and logical offset replaces an earlier
//! one) and a fresh segment is started; the store hands the entries to their queues,
//! replays the commitlog, then moves every live entry into the new segments and deletes
//! the old ones. So after each start the file holds exactly the live entries, and entries
//! a recovery cut (beyond a torn commitlog tail) cannot come back.
//!
//! Durability: [`SharedIndex::flush`] msyncs the written segments and fsyncs the
//! directory; the store calls it in each checkpoint before writing the checkpoint, and
//! `retire` calls it before deleting anything, so an entry moved forward is on disk
//! before its old copy goes.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use memmap2::MmapRaw;

use crate::consumequeue::CqEntry;
use crate::error::{Result, StoreError};
use crate::file;

/// Size of one shared-index entry on disk.
pub const SHARED_ENTRY_SIZE: u64 = 40;

const LEN: usize = SHARED_ENTRY_SIZE as usize;

/// A segment number; entries held in heap remember the segment their copy is in.
pub type SegId = u32;

/// One entry read back at open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedRecord {
    pub queue: u32,
    pub logical: u64,
    pub entry: CqEntry,
    /// The segment it was read from.
    pub seg: SegId,
}

fn encode(queue: u32, logical: u64, e: CqEntry) -> [u8; LEN] {
    let mut b = [0u8; LEN];
    let fields: [&[u8]; 5] = [
        &queue.to_le_bytes(),
        &e.size.to_le_bytes(),
        &logical.to_le_bytes(),
        &e.commit_offset.to_le_bytes(),
        &e.tag_hash.to_le_bytes(),
    ];
    let mut at = 0;
    for f in fields {
        if let Some(dst) = b.get_mut(at..at + f.len()) {
            dst.copy_from_slice(f);
        }
        at += f.len();
    }
    let crc = crc32c::crc32c(b.get(..32).unwrap_or_default());
    if let Some(dst) = b.get_mut(32..36) {
        dst.copy_from_slice(&crc.to_le_bytes());
    }
    b
}

fn decode(b: &[u8]) -> Option<(u32, u64, CqEntry)> {
    let le4 = |at: usize| -> Option<[u8; 4]> { b.get(at..at + 4)?.try_into().ok() };
    let le8 = |at: usize| -> Option<[u8; 8]> { b.get(at..at + 8)?.try_into().ok() };
    let crc = u32::from_le_bytes(le4(32)?);
    if crc != crc32c::crc32c(b.get(..32)?) || u32::from_le_bytes(le4(36)?) != 0 {
        return None;
    }
    let size = u32::from_le_bytes(le4(4)?);
    if size == 0 {
        return None;
    }
    Some((
        u32::from_le_bytes(le4(0)?),
        u64::from_le_bytes(le8(8)?),
        CqEntry {
            commit_offset: u64::from_le_bytes(le8(16)?),
            size,
            tag_hash: u64::from_le_bytes(le8(24)?),
        },
    ))
}

struct Segment {
    path: PathBuf,
    /// Mapped while it is (or was, until its next flush) being written.
    map: Option<Arc<MmapRaw>>,
    /// Slots written.
    used: u64,
    /// Entries some queue still holds.
    live: u64,
    /// Written since the last msync.
    dirty: bool,
}

struct State {
    segs: BTreeMap<SegId, Segment>,
    /// The segment appends go to (always present in `segs`).
    active: SegId,
    /// Segments were created or deleted since the last directory fsync.
    dir_dirty: bool,
}

/// The shared index of a data directory. Appends are serialised by one small mutex (the
/// store's writer lock already serialises almost all of them).
pub struct SharedIndex {
    dir: PathBuf,
    entries: u64,
    seg_len: u64,
    /// Segments that existed when the index was opened.
    opened: Vec<SegId>,
    state: Mutex<State>,
}

fn seg_len(entries: u64) -> Result<u64> {
    entries
        .checked_mul(SHARED_ENTRY_SIZE)
        .filter(|&l| entries > 0 && usize::try_from(l).is_ok())
        .ok_or_else(|| StoreError::Invalid(format!("shared index: bad segment size {entries}")))
}

impl SharedIndex {
    /// Opens (creating) the index in `dir`, reads every entry of every segment (in append
    /// order, damaged and unwritten slots skipped) and starts a new segment for appends.
    /// No entry read back counts as live until a queue takes it ([`SharedIndex::adopt`]).
    pub fn open(dir: &Path, entries_per_segment: u64) -> Result<(SharedIndex, Vec<SharedRecord>)> {
        let seg_len = seg_len(entries_per_segment)?;
        fs::create_dir_all(dir).map_err(StoreError::at(dir))?;
        let mut segs = BTreeMap::new();
        for ent in fs::read_dir(dir).map_err(StoreError::at(dir))? {
            let ent = ent.map_err(StoreError::at(dir))?;
            let Some(id) = ent
                .file_name()
                .to_str()
                .and_then(file::parse_offset_name)
                .and_then(|n| SegId::try_from(n).ok())
            else {
                continue;
            };
            segs.insert(
                id,
                Segment {
                    path: ent.path(),
                    map: None,
                    used: 0,
                    live: 0,
                    dirty: false,
                },
            );
        }
        let mut records = Vec::new();
        for (&id, s) in segs.iter_mut() {
            let bytes = fs::read(&s.path).map_err(StoreError::at(&s.path))?;
            let mut damaged = 0u64;
            for (slot, chunk) in bytes.chunks_exact(LEN).enumerate() {
                match decode(chunk) {
                    Some((queue, logical, entry)) => {
                        s.used = slot as u64 + 1;
                        records.push(SharedRecord {
                            queue,
                            logical,
                            entry,
                            seg: id,
                        });
                    }
                    None if chunk.iter().any(|&b| b != 0) => damaged += 1,
                    None => {}
                }
            }
            if damaged > 0 {
                // Only a torn write (power loss) leaves these, and only in entries written
                // after the last checkpoint, which recovery rebuilds from the commitlog.
                tracing::warn!(path = %s.path.display(), damaged, "shared index: skipped damaged entries");
            }
        }
        let opened: Vec<SegId> = segs.keys().copied().collect();
        let active = match segs.keys().next_back() {
            Some(&last) => last.checked_add(1).ok_or_else(|| {
                StoreError::Invalid("shared index: segment numbers exhausted".into())
            })?,
            None => 0,
        };
        let index = SharedIndex {
            dir: dir.to_path_buf(),
            entries: entries_per_segment,
            seg_len,
            opened,
            state: Mutex::new(State {
                segs,
                active,
                dir_dirty: false,
            }),
        };
        {
            let mut st = index.lock();
            let seg = index.create_segment(active)?;
            st.segs.insert(active, seg);
            st.dir_dirty = true;
        }
        Ok((index, records))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn create_segment(&self, id: SegId) -> Result<Segment> {
        let path = self.dir.join(file::offset_name(u64::from(id)));
        let f = file::open_preallocated(&path, self.seg_len)?;
        let map = MmapRaw::map_raw(&f).map_err(StoreError::at(&path))?;
        if map.len() as u64 != self.seg_len {
            return Err(StoreError::Corrupt {
                path,
                offset: 0,
                reason: format!("mapped {} bytes, expected {}", map.len(), self.seg_len),
            });
        }
        Ok(Segment {
            path,
            map: Some(Arc::new(map)),
            used: 0,
            live: 0,
            dirty: false,
        })
    }

    /// Segments that existed when the index was opened: after recovery the store moves
    /// every live entry out of them, then [`SharedIndex::retire`] deletes them.
    pub fn opened_segments(&self) -> &[SegId] {
        &self.opened
    }

    /// A queue took over an entry read back at open from segment `seg`.
    pub fn adopt(&self, seg: SegId) {
        if let Some(s) = self.lock().segs.get_mut(&seg) {
            s.live += 1;
        }
    }

    /// Appends an entry; returns the segment it went to (which counts it live).
    pub fn append(&self, queue: u32, logical: u64, entry: CqEntry) -> Result<SegId> {
        let bytes = encode(queue, logical, entry);
        let mut st = self.lock();
        let full = st
            .segs
            .get(&st.active)
            .is_none_or(|s| s.used >= self.entries);
        if full {
            let id = st.active.checked_add(1).ok_or_else(|| {
                StoreError::Invalid("shared index: segment numbers exhausted".into())
            })?;
            let seg = self.create_segment(id)?;
            st.segs.insert(id, seg);
            st.active = id;
            st.dir_dirty = true;
        }
        let id = st.active;
        let seg = st
            .segs
            .get_mut(&id)
            .ok_or_else(|| StoreError::Fatal("shared index: active segment missing".into()))?;
        let map = seg
            .map
            .as_ref()
            .ok_or_else(|| StoreError::Fatal("shared index: active segment not mapped".into()))?;
        let off = seg
            .used
            .checked_mul(SHARED_ENTRY_SIZE)
            .and_then(|o| usize::try_from(o).ok())
            .filter(|&o| o.checked_add(LEN).is_some_and(|end| end <= map.len()))
            .ok_or_else(|| StoreError::Fatal("shared index: slot out of range".into()))?;
        // SAFETY: `off + LEN <= map.len()` (checked above); the mapping is shared and
        // writable and lives as long as the `Arc`. Writers are serialised by the state
        // mutex (held), and nothing reads the mapping (entries are read back with
        // `fs::read` at open only).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), map.as_mut_ptr().add(off), LEN);
        }
        seg.used += 1;
        seg.live += 1;
        seg.dirty = true;
        Ok(id)
    }

    /// `n` entries of segment `seg` are no longer held by any queue.
    pub fn release(&self, seg: SegId, n: u64) {
        if n == 0 {
            return;
        }
        if let Some(s) = self.lock().segs.get_mut(&seg) {
            s.live = s.live.saturating_sub(n);
        }
    }

    /// Makes every entry appended so far durable: msync of the written segments, fsync of
    /// the directory. Segments no longer written are unmapped afterwards.
    pub fn flush(&self) -> Result<()> {
        let (maps, dir_dirty) = {
            let mut st = self.lock();
            let maps: Vec<(SegId, PathBuf, Arc<MmapRaw>)> = st
                .segs
                .iter_mut()
                .filter(|(_, s)| s.dirty)
                .filter_map(|(&id, s)| {
                    s.dirty = false;
                    Some((id, s.path.clone(), Arc::clone(s.map.as_ref()?)))
                })
                .collect();
            (maps, std::mem::take(&mut st.dir_dirty))
        };
        let mut result = Ok(());
        if dir_dirty {
            result = file::sync_dir(&self.dir);
        }
        for (_, path, map) in &maps {
            if result.is_ok() {
                if let Err(e) = map.flush() {
                    result = Err(StoreError::Fatal(format!(
                        "msync of {} failed: {e}",
                        path.display()
                    )));
                }
            }
        }
        let mut st = self.lock();
        if result.is_err() {
            // Mark them again: whoever flushes next must not believe they are on disk.
            st.dir_dirty |= dir_dirty;
            for (id, _, _) in &maps {
                if let Some(s) = st.segs.get_mut(id) {
                    s.dirty = true;
                }
            }
            return result;
        }
        let active = st.active;
        for (&id, s) in st.segs.iter_mut() {
            if id != active && !s.dirty {
                s.map = None;
            }
        }
        Ok(())
    }

    /// Sealed segments with at most a quarter of their entries live (and at least one):
    /// their owners should move those entries forward so the segments can be deleted.
    pub fn victims(&self) -> Vec<SegId> {
        let st = self.lock();
        st.segs
            .iter()
            .filter(|(&id, s)| id != st.active && s.live > 0 && s.live * 4 <= self.entries)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Flushes, then deletes every sealed segment with no live entry; returns how many.
    pub fn retire(&self) -> Result<usize> {
        self.flush()?;
        let doomed: Vec<(SegId, PathBuf)> = {
            let st = self.lock();
            st.segs
                .iter()
                .filter(|(&id, s)| id != st.active && s.live == 0)
                .map(|(&id, s)| (id, s.path.clone()))
                .collect()
        };
        if doomed.is_empty() {
            return Ok(0);
        }
        let mut n = 0;
        let mut result = Ok(());
        for (id, path) in &doomed {
            match fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    result = Err(StoreError::io(path, e));
                    break;
                }
            }
            self.lock().segs.remove(id);
            n += 1;
        }
        result?;
        file::sync_dir(&self.dir)?;
        Ok(n)
    }

    /// Number of segment files.
    pub fn segment_count(&self) -> usize {
        self.lock().segs.len()
    }

    /// Live entries over all segments.
    pub fn live_entries(&self) -> u64 {
        self.lock().segs.values().map(|s| s.live).sum()
    }

    /// Bytes the segment files take (their preallocated size).
    pub fn disk_bytes(&self) -> u64 {
        self.segment_count() as u64 * self.seg_len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(i: u64) -> CqEntry {
        CqEntry {
            commit_offset: i * 64,
            size: i as u32 + 1,
            tag_hash: !i,
        }
    }

    #[test]
    fn entry_codec_round_trip_and_damage() {
        let b = encode(7, 9, e(3));
        assert_eq!(decode(&b), Some((7, 9, e(3))));
        assert_eq!(decode(&[0u8; LEN]), None);
        for i in 0..LEN {
            let mut bad = b;
            bad[i] ^= 0x10;
            assert_eq!(decode(&bad), None, "flipped byte {i}");
        }
        assert_eq!(decode(&b[..LEN - 1]), None);
    }

    #[test]
    fn append_reopen_reads_back_in_order_and_rolls_segments() {
        let dir = tempfile::tempdir().unwrap();
        let (ix, recs) = SharedIndex::open(dir.path(), 4).unwrap();
        assert!(recs.is_empty());
        assert_eq!(ix.opened_segments(), &[] as &[SegId]);
        let mut segs = Vec::new();
        for i in 0..10u64 {
            segs.push(ix.append((i % 3) as u32, i, e(i)).unwrap());
        }
        assert_eq!(segs, vec![0, 0, 0, 0, 1, 1, 1, 1, 2, 2]);
        assert_eq!(ix.segment_count(), 3);
        assert_eq!(ix.live_entries(), 10);
        ix.flush().unwrap();
        drop(ix);
        let (ix, recs) = SharedIndex::open(dir.path(), 4).unwrap();
        assert_eq!(ix.opened_segments(), &[0, 1, 2]);
        let got: Vec<(u32, u64, CqEntry, SegId)> = recs
            .iter()
            .map(|r| (r.queue, r.logical, r.entry, r.seg))
            .collect();
        let want: Vec<_> = (0..10u64)
            .map(|i| ((i % 3) as u32, i, e(i), segs[i as usize]))
            .collect();
        assert_eq!(got, want);
        // nothing adopted: all old segments retire; the new active one stays
        assert_eq!(ix.live_entries(), 0);
        assert_eq!(ix.segment_count(), 4);
        assert_eq!(ix.retire().unwrap(), 3);
        assert_eq!(ix.segment_count(), 1);
        drop(ix);
        let (ix, recs) = SharedIndex::open(dir.path(), 4).unwrap();
        assert!(recs.is_empty());
        assert_eq!(ix.opened_segments(), &[3]);
    }

    #[test]
    fn live_counts_decide_retirement_and_victims() {
        let dir = tempfile::tempdir().unwrap();
        let (ix, _) = SharedIndex::open(dir.path(), 8).unwrap();
        for i in 0..17u64 {
            ix.append(1, i, e(i)).unwrap(); // segments 0, 1 full; 2 active
        }
        assert!(ix.victims().is_empty());
        ix.release(0, 8);
        ix.release(1, 6); // 2 of 8 live: a quarter
        assert_eq!(ix.victims(), vec![1]);
        assert_eq!(ix.retire().unwrap(), 1); // segment 0
        assert!(!dir.path().join(file::offset_name(0)).exists());
        // moving the two forward frees segment 1
        ix.append(1, 14, e(14)).unwrap();
        ix.append(1, 15, e(15)).unwrap();
        ix.release(1, 2);
        assert!(ix.victims().is_empty());
        assert_eq!(ix.retire().unwrap(), 1);
        assert_eq!(ix.segment_count(), 1);
        // the active segment is never retired, even when empty
        ix.release(2, 100);
        assert_eq!(ix.retire().unwrap(), 0);
        drop(ix);
        let (_, recs) = SharedIndex::open(dir.path(), 8).unwrap();
        let logicals: Vec<u64> = recs.iter().map(|r| r.logical).collect();
        assert_eq!(logicals, vec![16, 14, 15]);
    }

    #[test]
    fn torn_and_garbage_slots_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let (ix, _) = SharedIndex::open(dir.path(), 8).unwrap();
        for i in 0..4u64 {
            ix.append(2, i, e(i)).unwrap();
        }
        ix.flush().unwrap();
        drop(ix);
        let p = dir.path().join(file::offset_name(0));
        let mut b = std::fs::read(&p).unwrap();
        b[LEN + 17] ^= 1; // entry 1 damaged
        b[5 * LEN..5 * LEN + 12].fill(0xAB); // garbage in an unwritten slot
        std::fs::write(&p, &b).unwrap();
        std::fs::write(dir.path().join("00000000000000000009.tmp"), b"x").unwrap();
        let (ix, recs) = SharedIndex::open(dir.path(), 8).unwrap();
        let logicals: Vec<u64> = recs.iter().map(|r| r.logical).collect();
        assert_eq!(logicals, vec![0, 2, 3]);
        assert_eq!(ix.opened_segments(), &[0]);
        // a short (crash-time) segment file is read as far as it goes
        drop(ix);
        std::fs::write(dir.path().join(file::offset_name(1)), &b[..2 * LEN + 3]).unwrap();
        let (_, recs) = SharedIndex::open(dir.path(), 8).unwrap();
        assert_eq!(recs.len(), 3 + 1);
        assert!(SharedIndex::open(dir.path(), 0).is_err());
    }
}

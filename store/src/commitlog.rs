//! The CommitLog: append-only, fixed-size, memory-mapped segments named by their start
//! offset (20 digits), every message stored once (RocketMQ's `MappedFileQueue`).
//!
//! One writer (the store's writer lock) copies records into the mapping past the
//! published end; readers only ever look below the published end, so a record is never
//! read while it is written. Reads hand out `Bytes` that share the mapping (zero copy):
//! a segment's mapping lives until its last reader drops it, even after the file is
//! deleted by retention.
//!
//! Segments are preallocated before they are mapped, so a full disk is an error at
//! segment creation rather than a SIGBUS on a write. When a segment fills, its tail is
//! padded with an END_OF_SEGMENT record and the whole segment is flushed before the next
//! one gets any data: a later segment holding data therefore proves every earlier one
//! complete, which is how recovery tells a torn tail (repaired silently) from corruption
//! inside a sealed segment (refused unless the operator asks for `--repair`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use memmap2::MmapRaw;

use crate::error::{Result, StoreError};
use crate::file::{offset_name, open_preallocated, parse_offset_name, sync_dir};
use crate::record::{self, Decoded, MessageView, MIN_PADDING};

/// One mapped segment file.
pub struct Segment {
    start: u64,
    len: u64,
    path: PathBuf,
    map: Arc<MmapRaw>,
}

/// A byte range of a mapping, owned, so a `Bytes` can share the mapping.
struct MapSlice {
    map: Arc<MmapRaw>,
    start: usize,
    len: usize,
}

impl AsRef<[u8]> for MapSlice {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `start..start+len` was bounds-checked against the mapping when the
        // slice was made, the mapping lives as long as `self.map`, and the range lies
        // below the published end, which the single writer never writes again.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(self.start), self.len) }
    }
}

impl Segment {
    fn open(path: PathBuf, start: u64, len: u64) -> Result<Segment> {
        let file = open_preallocated(&path, len)?;
        let map = MmapRaw::map_raw(&file).map_err(StoreError::at(&path))?;
        if (map.len() as u64) < len {
            return Err(StoreError::Corrupt {
                path,
                offset: 0,
                reason: format!("mapped {} bytes, expected {len}", map.len()),
            });
        }
        Ok(Segment {
            start,
            len,
            path,
            map: Arc::new(map),
        })
    }

    /// Offset of the segment's first byte in the log.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// One past the segment's last byte in the log.
    pub fn end(&self) -> u64 {
        self.start + self.len
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The bytes `from..to` (segment-local). Callers pass only ranges below the
    /// published end, or ranges during recovery when there is no writer.
    fn slice(&self, from: u64, to: u64) -> Option<&[u8]> {
        if from > to || to > self.len {
            return None;
        }
        // SAFETY: bounds checked above; see `MapSlice::as_ref` for the aliasing argument.
        Some(unsafe {
            std::slice::from_raw_parts(self.map.as_ptr().add(from as usize), (to - from) as usize)
        })
    }

    /// Mutable access to `from..to` (segment-local), for the single writer only, and only
    /// above the published end where no reader looks.
    #[allow(clippy::mut_from_ref)]
    fn slice_mut(&self, from: u64, to: u64) -> Option<&mut [u8]> {
        if from > to || to > self.len {
            return None;
        }
        // SAFETY: bounds checked; the caller holds the writer role and the range is above
        // the published end, so no other reference to these bytes exists.
        Some(unsafe {
            std::slice::from_raw_parts_mut(
                self.map.as_mut_ptr().add(from as usize),
                (to - from) as usize,
            )
        })
    }

    fn bytes(&self, from: u64, len: u64) -> Option<Bytes> {
        self.slice(from, from.checked_add(len)?)?;
        Some(Bytes::from_owner(MapSlice {
            map: self.map.clone(),
            start: from as usize,
            len: len as usize,
        }))
    }

    fn flush_range(&self, from: u64, to: u64) -> Result<()> {
        let to = to.min(self.len);
        if from >= to {
            return Ok(());
        }
        self.map
            .flush_range(from as usize, (to - from) as usize)
            .map_err(|e| StoreError::Fatal(format!("flush of {} failed: {e}", self.path.display())))
    }

    /// Whether anything was ever written at the segment's start.
    fn has_data(&self) -> bool {
        self.slice(0, MIN_PADDING)
            .is_some_and(|h| h.iter().any(|b| *b != 0))
    }
}

/// A record read back from the log; `properties` and `body` share the mapping.
#[derive(Debug, Clone)]
pub struct StoredRecord {
    pub commit_offset: u64,
    pub flags: u16,
    pub store_ts_ms: u64,
    pub born_ts_ms: u64,
    /// The whole encoded record.
    pub raw: Bytes,
    pub properties: Bytes,
    pub body: Bytes,
}

impl StoredRecord {
    /// `(queue id, queue offset)` of every queue the message was stored for.
    pub fn queues(&self) -> Vec<(u32, u64)> {
        match record::decode(&self.raw) {
            Decoded::Message { view, .. } => view.queues().collect(),
            _ => Vec::new(),
        }
    }
    /// The message's index keys.
    pub fn keys(&self) -> Vec<Bytes> {
        match record::decode(&self.raw) {
            Decoded::Message { view, .. } => view.keys().map(|k| self.raw.slice_ref(k)).collect(),
            _ => Vec::new(),
        }
    }
}

/// What the writer needs between appends; owned by the store's writer lock.
pub struct Writer {
    seg: Arc<Segment>,
    /// Absolute offset of the next append.
    pos: u64,
}

impl Writer {
    /// The last `tail` bytes of the `len`-byte record this writer appended at `offset`
    /// (always in its current segment: a roll happens before a record is written), zero
    /// copy from the mapping and without a checksum pass: a message's body as page cache,
    /// not heap.
    pub fn record_tail(&self, offset: u64, len: u64, tail: u64) -> Option<Bytes> {
        let local = offset.checked_sub(self.seg.start())?;
        self.seg
            .bytes(local.checked_add(len)?.checked_sub(tail)?, tail)
    }

    /// Absolute offset of the next append.
    pub fn pos(&self) -> u64 {
        self.pos
    }
}

/// The segmented log.
pub struct CommitLog {
    dir: PathBuf,
    segment_size: u64,
    segments: RwLock<BTreeMap<u64, Arc<Segment>>>,
    /// Everything below is fully written; readers stay below it.
    end: AtomicU64,
}

/// How recovery ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// Offset of the next append.
    pub end: u64,
    /// Bytes past `end` that were cut (torn or, with repair, corrupt data).
    pub truncated: bool,
}

impl CommitLog {
    /// Opens the log in `dir`, mapping every segment. Call `recover` before appending.
    pub fn open(dir: &Path, segment_size: u64) -> Result<CommitLog> {
        if segment_size < 4096 {
            return Err(StoreError::Invalid(format!(
                "segment size {segment_size} is below 4096 bytes"
            )));
        }
        std::fs::create_dir_all(dir).map_err(StoreError::at(dir))?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(StoreError::at(dir))? {
            let entry = entry.map_err(StoreError::at(dir))?;
            if let Some(start) = parse_offset_name(&entry.file_name().to_string_lossy()) {
                let len = entry
                    .metadata()
                    .map_err(StoreError::at(&entry.path()))?
                    .len();
                found.push((start, len, entry.path()));
            }
        }
        found.sort();
        let mut segments = BTreeMap::new();
        let count = found.len();
        let mut expect: Option<u64> = None;
        for (i, (start, len, path)) in found.into_iter().enumerate() {
            if let Some(e) = expect {
                if e != start {
                    return Err(StoreError::Corrupt {
                        path,
                        offset: 0,
                        reason: format!("segment starts at {start}, the previous one ends at {e}"),
                    });
                }
            }
            let last = i + 1 == count;
            // A short last segment (a crash during creation, or a cut file) is extended
            // back to full size; a short sealed segment is damage.
            let len = if last { len.max(segment_size) } else { len };
            if len < 4096 {
                return Err(StoreError::Corrupt {
                    path,
                    offset: 0,
                    reason: format!("sealed segment of only {len} bytes"),
                });
            }
            expect = Some(start + len);
            segments.insert(start, Arc::new(Segment::open(path, start, len)?));
        }
        Ok(CommitLog {
            dir: dir.to_path_buf(),
            segment_size,
            segments: RwLock::new(segments),
            end: AtomicU64::new(0),
        })
    }

    fn segments(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<u64, Arc<Segment>>> {
        self.segments.read().unwrap_or_else(|e| e.into_inner())
    }

    fn segments_mut(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<u64, Arc<Segment>>> {
        self.segments.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The first offset still held.
    pub fn min_offset(&self) -> u64 {
        self.segments().keys().next().copied().unwrap_or(0)
    }

    /// One past the last fully written byte.
    pub fn end(&self) -> u64 {
        self.end.load(Ordering::Acquire)
    }

    /// Every segment, oldest first.
    pub fn segment_list(&self) -> Vec<Arc<Segment>> {
        self.segments().values().cloned().collect()
    }

    fn segment_for(&self, offset: u64) -> Option<Arc<Segment>> {
        let segs = self.segments();
        let (_, seg) = segs.range(..=offset).next_back()?;
        (offset < seg.end()).then(|| seg.clone())
    }

    fn create_segment(&self, start: u64) -> Result<Arc<Segment>> {
        let path = self.dir.join(offset_name(start));
        let seg = Arc::new(Segment::open(path, start, self.segment_size)?);
        sync_dir(&self.dir)?;
        self.segments_mut().insert(start, seg.clone());
        Ok(seg)
    }

    /// Scans from `from` (a record boundary: the checkpoint) to the end of the log,
    /// calling `visit` for every valid record, and cuts whatever follows the last one.
    /// `unclean` also zeroes stale bytes after the end so they can never be mistaken for
    /// records later. Invalid data followed by a segment holding data is corruption of a
    /// sealed segment: an error unless `repair`, which cuts the log there.
    pub fn recover(
        &self,
        from: u64,
        unclean: bool,
        repair: bool,
        mut visit: impl FnMut(u64, &Decoded<'_>) -> Result<()>,
    ) -> Result<Recovered> {
        let segs = self.segment_list();
        let Some(first) = segs.first() else {
            // a new log (or one whose files were all removed): start at the checkpoint
            let start = from;
            self.create_segment(start)?;
            self.end.store(start, Ordering::Release);
            return Ok(Recovered {
                end: start,
                truncated: false,
            });
        };
        let mut pos = from.max(first.start());
        let mut idx = segs
            .iter()
            .position(|s| pos < s.end())
            .unwrap_or(segs.len().saturating_sub(1));
        let mut stop_reason: Option<String> = None;
        'segments: while let Some(seg) = segs.get(idx) {
            let mut local = pos.saturating_sub(seg.start());
            loop {
                let Some(rest) = seg.slice(local, seg.len) else {
                    stop_reason = Some("position past the segment end".into());
                    break 'segments;
                };
                if rest.is_empty() {
                    // exactly at the end of a full segment
                    idx += 1;
                    match segs.get(idx) {
                        Some(next) => {
                            pos = next.start();
                            continue 'segments;
                        }
                        None => break 'segments,
                    }
                }
                let d = record::decode(rest);
                match &d {
                    Decoded::Message { len, .. } | Decoded::Ack { len, .. } => {
                        visit(pos, &d)?;
                        pos += len;
                        local += len;
                    }
                    Decoded::Padding => {
                        pos = seg.end();
                        idx += 1;
                        match segs.get(idx) {
                            Some(next) if next.start() == pos => continue 'segments,
                            _ => break 'segments,
                        }
                    }
                    Decoded::Empty => break 'segments,
                    Decoded::Invalid(why) => {
                        stop_reason = Some(why.clone());
                        break 'segments;
                    }
                }
            }
        }
        // `pos` is the end. Anything later that holds data means a sealed segment is bad.
        let later_data = segs
            .iter()
            .filter(|s| s.start() > pos)
            .find(|s| s.has_data())
            .cloned();
        let mut truncated = stop_reason.is_some();
        if let Some(later) = later_data {
            let (path, offset) = self
                .segment_for(pos)
                .map(|s| (s.path().to_path_buf(), pos - s.start()))
                .unwrap_or_else(|| (later.path().to_path_buf(), 0));
            let reason = stop_reason
                .clone()
                .unwrap_or_else(|| "unwritten gap".to_string());
            if !repair {
                return Err(StoreError::Corrupt {
                    path,
                    offset,
                    reason: format!(
                        "{reason}, but later segments hold data (from {}); start with \
                         --repair to cut the log at this point and lose what follows",
                        later.path().display()
                    ),
                });
            }
            tracing::error!(
                path = %path.display(), offset, %reason,
                "repair: cutting the commitlog inside a sealed segment; later data is lost"
            );
            truncated = true;
        }
        if let Some(reason) = &stop_reason {
            tracing::info!(offset = pos, %reason, "commitlog: cut a torn tail");
        }
        // Drop segments wholly after the end, then clean the tail of the end segment.
        let doomed: Vec<Arc<Segment>> = segs.iter().filter(|s| s.start() > pos).cloned().collect();
        for s in &doomed {
            self.segments_mut().remove(&s.start());
            std::fs::remove_file(s.path()).map_err(StoreError::at(s.path()))?;
        }
        if !doomed.is_empty() {
            sync_dir(&self.dir)?;
        }
        if let Some(seg) = self.segment_for(pos) {
            if unclean || truncated {
                let local = pos - seg.start();
                if let Some(tail) = seg.slice_mut(local, seg.len) {
                    // zero up to the last non-zero byte: stale records must not reappear
                    let dirty = tail
                        .chunks(4096)
                        .rposition(|c| c.iter().any(|b| *b != 0))
                        .map(|i| ((i + 1) * 4096).min(tail.len()));
                    if let Some(n) = dirty {
                        if let Some(t) = tail.get_mut(..n) {
                            t.fill(0);
                        }
                        seg.flush_range(local, local + n as u64)?;
                        truncated = true;
                    }
                }
            }
        }
        self.end.store(pos, Ordering::Release);
        Ok(Recovered {
            end: pos,
            truncated,
        })
    }

    /// The writer, positioned at the recovered end.
    pub fn writer(&self) -> Result<Writer> {
        let pos = self.end();
        let seg = match self.segment_for(pos) {
            Some(s) => s,
            None => self.create_segment(pos)?,
        };
        Ok(Writer { seg, pos })
    }

    /// Largest record that fits in a segment.
    pub fn max_record_len(&self) -> u64 {
        self.segment_size - MIN_PADDING
    }

    /// Appends one record of `len` bytes, written by `encode` straight into the mapping,
    /// rolling to a new segment when it does not fit. Returns the record's offset.
    /// Nothing is published (visible to readers) until `publish`.
    pub fn append(
        &self,
        w: &mut Writer,
        len: u64,
        encode: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<u64> {
        if len > self.max_record_len() {
            return Err(StoreError::TooLarge {
                size: len,
                max: self.max_record_len(),
            });
        }
        let mut local = w.pos - w.seg.start();
        if local + len + MIN_PADDING > w.seg.len {
            self.roll(w)?;
            local = 0;
        }
        let buf = w
            .seg
            .slice_mut(local, local + len)
            .ok_or_else(|| StoreError::Invalid("record outside its segment".into()))?;
        encode(buf)?;
        let offset = w.pos;
        w.pos += len;
        Ok(offset)
    }

    /// Makes everything appended through `w` visible to readers.
    pub fn publish(&self, w: &Writer) {
        self.end.store(w.pos, Ordering::Release);
    }

    /// Seals the writer's segment (padding, full flush) and moves to a new one.
    fn roll(&self, w: &mut Writer) -> Result<()> {
        let local = w.pos - w.seg.start();
        if let Some(pad) = w.seg.slice_mut(local, w.seg.len) {
            if !pad.is_empty() {
                record::encode_padding(pad)?;
            }
        }
        // the whole segment is durable before the next one holds anything
        w.seg.flush_range(0, w.seg.len)?;
        let next = w.seg.end();
        let seg = match self.segment_for(next) {
            Some(s) => s,
            None => self.create_segment(next)?,
        };
        w.seg = seg;
        w.pos = next;
        self.end.store(next, Ordering::Release);
        Ok(())
    }

    /// Makes `from..to` durable (msync of each overlapping segment). An error is fatal.
    pub fn flush(&self, from: u64, to: u64) -> Result<()> {
        if from >= to {
            return Ok(());
        }
        let segs: Vec<Arc<Segment>> = self
            .segments()
            .range(..to)
            .filter(|(_, s)| s.end() > from)
            .map(|(_, s)| s.clone())
            .collect();
        for s in segs {
            let a = from.max(s.start()) - s.start();
            let b = to.min(s.end()) - s.start();
            s.flush_range(a, b)?;
        }
        Ok(())
    }

    /// Reads and verifies the record at `offset`.
    pub fn read(&self, offset: u64) -> Result<StoredRecord> {
        if offset >= self.end() {
            return Err(StoreError::NotFound(format!("commitlog offset {offset}")));
        }
        let seg = self
            .segment_for(offset)
            .ok_or_else(|| StoreError::NotFound(format!("commitlog offset {offset} (deleted)")))?;
        let local = offset - seg.start();
        let rest = seg
            .slice(local, seg.len)
            .ok_or_else(|| StoreError::NotFound(format!("commitlog offset {offset}")))?;
        let corrupt = |reason: String| StoreError::Corrupt {
            path: seg.path().to_path_buf(),
            offset: local,
            reason,
        };
        match record::decode(rest) {
            Decoded::Message { len, view } => {
                let raw = seg
                    .bytes(local, len)
                    .ok_or_else(|| corrupt("record past the segment end".into()))?;
                Ok(stored(offset, raw, &view))
            }
            Decoded::Ack { .. } => Err(StoreError::NotFound(format!(
                "commitlog offset {offset} is an ack record"
            ))),
            Decoded::Padding | Decoded::Empty => {
                Err(StoreError::NotFound(format!("commitlog offset {offset}")))
            }
            Decoded::Invalid(why) => Err(corrupt(why)),
        }
    }

    /// Deletes sealed segments that end at or below `offset`; returns how many.
    pub fn delete_below(&self, offset: u64) -> Result<usize> {
        let end = self.end();
        let doomed: Vec<Arc<Segment>> = self
            .segments()
            .values()
            .filter(|s| s.end() <= offset && s.end() <= end)
            .cloned()
            .collect();
        // never the segment the writer is in
        let doomed: Vec<_> = doomed
            .into_iter()
            .filter(|s| s.end() < end || end == 0)
            .collect();
        for s in &doomed {
            self.segments_mut().remove(&s.start());
            std::fs::remove_file(s.path()).map_err(StoreError::at(s.path()))?;
        }
        if !doomed.is_empty() {
            sync_dir(&self.dir)?;
        }
        Ok(doomed.len())
    }
}

fn stored(offset: u64, raw: Bytes, view: &MessageView<'_>) -> StoredRecord {
    StoredRecord {
        commit_offset: offset,
        flags: view.flags,
        store_ts_ms: view.store_ts_ms,
        born_ts_ms: view.born_ts_ms,
        properties: raw.slice(view.properties.clone()),
        body: raw.slice(view.body.clone()),
        raw,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{encode_message, message_len, NewMessage};

    fn put(log: &CommitLog, w: &mut Writer, body: &[u8]) -> u64 {
        let msg = NewMessage {
            queues: &[1],
            body,
            ..Default::default()
        };
        let len = message_len(&msg).unwrap() as u64;
        let off = log
            .append(w, len, |buf| encode_message(buf, &msg, 7, &[0]))
            .unwrap();
        log.publish(w);
        off
    }

    fn recover_count(log: &CommitLog, unclean: bool) -> (Recovered, usize) {
        let mut n = 0;
        let r = log
            .recover(0, unclean, false, |_, _| {
                n += 1;
                Ok(())
            })
            .unwrap();
        (r, n)
    }

    #[test]
    fn append_roll_read_and_recover() {
        let dir = tempfile::tempdir().unwrap();
        let log = CommitLog::open(dir.path(), 4096).unwrap();
        recover_count(&log, false);
        let mut w = log.writer().unwrap();
        let mut offs = Vec::new();
        for i in 0..100u32 {
            let body = vec![i as u8; 100 + i as usize];
            offs.push(put(&log, &mut w, &body));
        }
        assert!(log.segment_list().len() > 3, "rolled over");
        for (i, off) in offs.iter().enumerate() {
            let r = log.read(*off).unwrap();
            assert_eq!(r.body.len(), 100 + i);
            assert!(r.body.iter().all(|b| *b == i as u8));
        }
        let end = log.end();
        drop(w);
        drop(log);
        let log = CommitLog::open(dir.path(), 4096).unwrap();
        let (r, n) = recover_count(&log, true);
        assert_eq!((r.end, n), (end, 100));
        assert_eq!(log.read(offs[42]).unwrap().body.len(), 142);
    }

    #[test]
    fn too_large_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let log = CommitLog::open(dir.path(), 4096).unwrap();
        recover_count(&log, false);
        let mut w = log.writer().unwrap();
        let err = log.append(&mut w, 4096, |_| Ok(())).unwrap_err();
        assert!(matches!(err, StoreError::TooLarge { .. }));
    }

    #[test]
    fn corruption_in_a_sealed_segment_needs_repair() {
        let dir = tempfile::tempdir().unwrap();
        {
            let log = CommitLog::open(dir.path(), 4096).unwrap();
            recover_count(&log, false);
            let mut w = log.writer().unwrap();
            for _ in 0..100 {
                put(&log, &mut w, &[9u8; 200]);
            }
        }
        // flip a byte in the first record of the first segment
        let first = dir.path().join(offset_name(0));
        let mut bytes = std::fs::read(&first).unwrap();
        bytes[30] ^= 0xff;
        std::fs::write(&first, bytes).unwrap();
        let log = CommitLog::open(dir.path(), 4096).unwrap();
        let err = log.recover(0, true, false, |_, _| Ok(())).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
        let r = log.recover(0, true, true, |_, _| Ok(())).unwrap();
        assert_eq!(r.end, 0);
        assert_eq!(log.segment_list().len(), 1);
    }
}

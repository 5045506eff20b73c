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
//!
//! The writer never touches a page first. A new page of a mapping costs a page fault that
//! zeroes it (the preallocated extents are unwritten) and, on a sequential fault pattern,
//! the kernel's readahead: with the block device's `read_ahead_kb` at 8 MiB that was one
//! fault every 8 MiB zeroing 2,048 pages on the writer's thread, a 25–60 ms stall of the
//! connection task that was publishing and of everything queued behind it on its
//! runtime worker. So a background thread ([`CommitLog::warm_ahead`], RocketMQ's
//! `AllocateMappedFileService` and `warmMappedFile` in spirit) keeps [`WARM_AHEAD`] bytes
//! past the writer faulted in and writable (`MADV_POPULATE_WRITE`), and creates the next
//! segment before the writer needs it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};

use bytes::Bytes;
use memmap2::MmapRaw;

use crate::error::{Result, StoreError};
use crate::file::{data_ranges, offset_name, open_preallocated, parse_offset_name, sync_dir};
use crate::record::{self, Decoded, MessageView, MIN_PADDING};

/// How far past the writer [`CommitLog::warm_ahead`] keeps pages faulted in (at most a
/// quarter of a segment).
pub const WARM_AHEAD: u64 = 16 << 20;

/// Bytes warmed per system call (see [`Segment::warm`]).
const WARM_PIECE: u64 = 256 << 10;

/// The writer wakes the warming thread each time it crosses a boundary of an eighth of
/// the warmed distance (2 MiB with 1 GiB segments: one condvar signal per ~10,000 small
/// messages).
fn warm_step_shift(segment_size: u64) -> u32 {
    let step = (WARM_AHEAD.min(segment_size / 4) / 8).max(1);
    step.ilog2()
}

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

    /// Faults `from..to` (segment-local) in, writable, so the writer finds the pages
    /// mapped. Page contents are not touched. Done in [`WARM_PIECE`]s, each first read
    /// into the page cache (`MADV_WILLNEED`: the zeroing, outside the mmap lock) and then
    /// mapped writable (`MADV_POPULATE_WRITE`, Linux 5.14+; without it the writer still
    /// takes minor faults, but no longer zeroes pages or reads ahead). One big call would
    /// hold a core in the kernel for tens of milliseconds (the first fault reads ahead
    /// `read_ahead_kb` at once): a stall for whatever runtime worker shared that core.
    fn warm(&self, from: u64, to: u64) {
        static NO_POPULATE: AtomicBool = AtomicBool::new(false);
        let to = to.min(self.len);
        let mut at = from;
        while at < to {
            let end = (at + WARM_PIECE).min(to);
            let (off, len) = (at as usize, (end - at) as usize);
            if let Err(e) = self.map.advise_range(memmap2::Advice::WillNeed, off, len) {
                tracing::debug!(path = %self.path.display(), error = %e, "commitlog: warming failed");
                return;
            }
            if !NO_POPULATE.load(Ordering::Relaxed) {
                if let Err(e) = self
                    .map
                    .advise_range(memmap2::Advice::PopulateWrite, off, len)
                {
                    if e.raw_os_error() == Some(libc::EINVAL) {
                        NO_POPULATE.store(true, Ordering::Relaxed);
                    } else {
                        tracing::debug!(path = %self.path.display(), error = %e, "commitlog: warming failed");
                        return;
                    }
                }
            }
            at = end;
        }
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
    /// Records appended since the store opened (a plain integer under the writer lock).
    appends: u64,
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

    /// Records appended since the store opened.
    pub fn appends(&self) -> u64 {
        self.appends
    }
}

/// The segmented log.
pub struct CommitLog {
    dir: PathBuf,
    segment_size: u64,
    segments: RwLock<BTreeMap<u64, Arc<Segment>>>,
    /// Everything below is fully written; readers stay below it.
    end: AtomicU64,
    /// Serialises segment creation (the writer's roll and the warming thread's).
    creating: Mutex<()>,
    warm: Warm,
    /// Set while a sealed segment awaits its retention pass: the warming thread then
    /// creates no next segment (see [`CommitLog::hold_next_segment`]).
    hold_next: AtomicBool,
}

/// The writer's position as last announced to the warming thread.
#[derive(Default)]
struct Warm {
    /// `pos >> shift` at the last announcement (the writer's side, lock-free).
    step: AtomicU64,
    shift: u32,
    state: Mutex<WarmState>,
    cv: Condvar,
}

#[derive(Default)]
struct WarmState {
    pos: u64,
    pending: bool,
    stop: bool,
}

impl Warm {
    fn lock(&self) -> MutexGuard<'_, WarmState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
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
            // A gap is a segment deleted by compaction (see [`CommitLog::delete_segment`]);
            // recovery still refuses one above the checkpoint. An overlap is damage.
            if let Some(e) = expect {
                if start < e {
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
            creating: Mutex::new(()),
            warm: Warm {
                // the first publish announces itself
                step: AtomicU64::new(u64::MAX),
                shift: warm_step_shift(segment_size),
                ..Warm::default()
            },
            hold_next: AtomicBool::new(false),
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

    /// The segment starting at `start`, created unless the warming thread already did.
    /// A file this call created but could not preallocate (a full disk) is removed again.
    fn create_segment(&self, start: u64) -> Result<Arc<Segment>> {
        let _creating = self.creating.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = self.segment_for(start).filter(|s| s.start() == start) {
            return Ok(s);
        }
        let path = self.dir.join(offset_name(start));
        let existed = path.exists();
        let seg = match Segment::open(path.clone(), start, self.segment_size) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                if !existed {
                    let _ = std::fs::remove_file(&path);
                }
                return Err(e);
            }
        };
        sync_dir(&self.dir)?;
        self.segments_mut().insert(start, seg.clone());
        Ok(seg)
    }

    /// The warming thread's loop (see the module notes): each time the writer announces
    /// a new position, fault in the pages up to [`WARM_AHEAD`] past it, creating the next
    /// segment when that reaches past the current one. Returns after
    /// [`CommitLog::stop_warming`].
    pub fn warm_ahead(&self) {
        let ahead = WARM_AHEAD.min(self.segment_size / 4);
        let mut warmed = 0u64;
        // a segment whose creation failed is not retried until the writer moves on
        let mut failed: Option<u64> = None;
        {
            // start warming at the recovered end, before the first append
            let mut st = self.warm.lock();
            if !st.pending {
                st.pos = self.end();
                st.pending = true;
            }
        }
        loop {
            let pos = {
                let mut st = self.warm.lock();
                while !st.pending && !st.stop {
                    st = self.warm.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                if st.stop {
                    return;
                }
                st.pending = false;
                st.pos
            };
            let want = pos.saturating_add(ahead);
            let mut at = warmed.max(pos);
            while at < want {
                let seg = match self.segment_for(at) {
                    Some(s) => s,
                    // only the segment right after the writer's, once, and not while
                    // the store holds new segments back
                    None if failed != Some(at)
                        && !self.hold_next.load(Ordering::Acquire)
                        && self.segment_for(pos).is_some_and(|s| s.end() == at) =>
                    {
                        match self.create_segment(at) {
                            Ok(s) => s,
                            Err(e) => {
                                tracing::debug!(offset = at, error = %e, "commitlog: next segment not created ahead");
                                failed = Some(at);
                                break;
                            }
                        }
                    }
                    None => break,
                };
                let to = want.min(seg.end());
                seg.warm(at - seg.start(), to - seg.start());
                at = to;
            }
            warmed = at;
        }
    }

    /// While `hold` is set the warming thread creates no segment ahead of the writer;
    /// only the writer's roll still creates one. The store sets it while a sealed segment
    /// awaits its retention pass, so that the files on disk are that segment and the
    /// writer's, not a third one preallocated ahead (disk bounded by live data, issue 13).
    pub fn hold_next_segment(&self, hold: bool) {
        self.hold_next.store(hold, Ordering::Release);
        if !hold {
            // let the warming thread look again at where the writer is
            let mut st = self.warm.lock();
            st.pos = st.pos.max(self.end());
            st.pending = true;
            drop(st);
            self.warm.cv.notify_one();
        }
    }

    /// Whether new segments are held back ([`CommitLog::hold_next_segment`]).
    pub fn holds_next_segment(&self) -> bool {
        self.hold_next.load(Ordering::Acquire)
    }

    /// Whether appending a record of `len` bytes through `w` would seal its segment and
    /// roll to the next one.
    pub fn would_roll(&self, w: &Writer, len: u64) -> bool {
        self.room(w) < len + MIN_PADDING
    }

    /// Bytes left in the writer's segment.
    pub fn room(&self, w: &Writer) -> u64 {
        w.seg.len.saturating_sub(w.pos - w.seg.start())
    }

    /// Ends [`CommitLog::warm_ahead`].
    pub fn stop_warming(&self) {
        self.warm.lock().stop = true;
        self.warm.cv.notify_all();
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
        let pos = from.max(first.start());
        let (pos, stop_reason) = scan_from(&segs, pos, &mut visit)?;
        let truncated = self.check_after_end(&segs, pos, stop_reason.as_deref(), repair)?;
        if let Some(reason) = &stop_reason {
            tracing::info!(offset = pos, %reason, "commitlog: cut a torn tail");
        }
        self.cut_after(&segs, pos, unclean, truncated)
    }

    /// Whether the log is cut at `pos`, the end the scan found (`stop_reason`: why it
    /// stopped there, when at bad data). A later segment holding data means a sealed
    /// segment is bad: an error unless `repair`, which cuts the log at `pos`.
    fn check_after_end(
        &self,
        segs: &[Arc<Segment>],
        pos: u64,
        stop_reason: Option<&str>,
        repair: bool,
    ) -> Result<bool> {
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
            let reason = stop_reason.unwrap_or("unwritten gap");
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
        Ok(truncated)
    }

    /// Cuts the log at `pos`: deletes the segments wholly after it and, after an unclean
    /// shutdown or a cut, zeroes the rest of the segment it is in.
    fn cut_after(
        &self,
        segs: &[Arc<Segment>],
        pos: u64,
        unclean: bool,
        mut truncated: bool,
    ) -> Result<Recovered> {
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
                // stale records past the end must not reappear: zero them
                if zero_stale(&seg, local)? {
                    truncated = true;
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
        Ok(Writer {
            seg,
            pos,
            appends: 0,
        })
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
        if self.would_roll(w, len) {
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
        w.appends += 1;
        Ok(offset)
    }

    /// Makes everything appended through `w` visible to readers (and tells the warming
    /// thread when the writer has moved on by another step).
    pub fn publish(&self, w: &Writer) {
        self.end.store(w.pos, Ordering::Release);
        let step = w.pos >> self.warm.shift;
        if self.warm.step.load(Ordering::Relaxed) != step {
            self.warm.step.store(step, Ordering::Relaxed);
            let mut st = self.warm.lock();
            st.pos = w.pos;
            st.pending = true;
            drop(st);
            self.warm.cv.notify_one();
        }
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

impl CommitLog {
    /// The sealed segments (never the one holding `end`), oldest first: what retention
    /// and compaction may work on.
    pub fn sealed_segments(&self) -> Vec<Arc<Segment>> {
        let end = self.end();
        self.segments()
            .values()
            .filter(|s| s.end() < end)
            .cloned()
            .collect()
    }

    /// Visits every record of the sealed segment starting at `start`, in order, with its
    /// offset and bytes, until padding or the end. The CRC is not checked (a caller that
    /// uses a record's body checks it with [`record::verify`]); a record whose fields do
    /// not decode is an error (a sealed segment was fully written and flushed when it was
    /// rolled).
    pub fn scan_segment(
        &self,
        start: u64,
        mut visit: impl FnMut(u64, &[u8], &Decoded<'_>) -> Result<()>,
    ) -> Result<()> {
        let seg = self
            .segment_for(start)
            .filter(|s| s.start() == start && s.end() < self.end())
            .ok_or_else(|| StoreError::NotFound(format!("sealed segment at {start}")))?;
        let mut local = 0u64;
        while local < seg.len {
            let Some(rest) = seg.slice(local, seg.len) else {
                break;
            };
            let d = record::decode_unverified(rest);
            match &d {
                Decoded::Message { len, .. } | Decoded::Ack { len, .. } => {
                    let raw = rest.get(..*len as usize).unwrap_or_default();
                    visit(seg.start() + local, raw, &d)?;
                    local += len;
                }
                Decoded::Padding | Decoded::Empty => break,
                Decoded::Invalid(why) => {
                    return Err(StoreError::Corrupt {
                        path: seg.path().to_path_buf(),
                        offset: local,
                        reason: why.clone(),
                    })
                }
            }
        }
        Ok(())
    }

    /// Deletes the sealed segment starting at `start` wherever it is, leaving a gap in
    /// the offsets (compaction: nothing live is left in it). Returns whether it existed.
    pub fn delete_segment(&self, start: u64) -> Result<bool> {
        let end = self.end();
        let seg = {
            let mut segs = self.segments_mut();
            match segs.get(&start) {
                Some(s) if s.end() < end => segs.remove(&start),
                _ => None,
            }
        };
        let Some(seg) = seg else {
            return Ok(false);
        };
        std::fs::remove_file(seg.path()).map_err(StoreError::at(seg.path()))?;
        sync_dir(&self.dir)?;
        // Unmapping a segment and freeing its page cache takes 0.1-0.5 s for 128 MiB on a
        // busy machine: done beside the caller (the retention pass), which goes on. Readers
        // holding the segment keep it until they are done either way.
        let name = "triad-unmap".to_string();
        if let Err(e) = std::thread::Builder::new()
            .name(name)
            .spawn(move || drop(seg))
        {
            tracing::debug!(error = %e, "commitlog: segment unmapped on the caller's thread");
        }
        Ok(true)
    }
}

/// Visits every valid record of `segs` from `pos` (a record boundary) on; returns the
/// end, one past the last valid record, and why the scan stopped there when it stopped
/// at bad data.
fn scan_from(
    segs: &[Arc<Segment>],
    mut pos: u64,
    visit: &mut impl FnMut(u64, &Decoded<'_>) -> Result<()>,
) -> Result<(u64, Option<String>)> {
    let mut idx = segs
        .iter()
        .position(|s| pos < s.end())
        .unwrap_or(segs.len().saturating_sub(1));
    let mut stop_reason: Option<String> = None;
    'segments: while let Some(seg) = segs.get(idx) {
        // after a hole (or from a position in one), the scan starts at the segment's start
        pos = pos.max(seg.start());
        let mut local = pos - seg.start();
        loop {
            let Some(rest) = seg.slice(local, seg.len) else {
                stop_reason = Some("position past the segment end".into());
                break 'segments;
            };
            if rest.is_empty() {
                // exactly at the end of a full segment
                pos = seg.end();
                idx += 1;
                if next_segment_follows(segs, idx, pos) {
                    continue 'segments;
                }
                break 'segments;
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
                    if next_segment_follows(segs, idx, pos) {
                        continue 'segments;
                    }
                    break 'segments;
                }
                Decoded::Empty => break 'segments,
                Decoded::Invalid(why) => {
                    stop_reason = Some(why.clone());
                    break 'segments;
                }
            }
        }
    }
    Ok((pos, stop_reason))
}

/// Whether the scan, at `pos`, the clean end of a sealed segment (its padding, or its
/// last byte), goes on with `segs[idx]`: the segment starting there, or one starting
/// later that holds data. The latter is a hole of whole segments that retention or
/// compaction deleted: they lie below a checkpoint, so only a replay from the log's start
/// meets them (a demoted leader's directory, which has no checkpoint; see
/// `replica::drop_broker_state`), and the ack states journaled at that checkpoint cover
/// the acks they held. A hole after a torn or invalid record is not this: the scan stops
/// there and recovery decides.
fn next_segment_follows(segs: &[Arc<Segment>], idx: usize, pos: u64) -> bool {
    match segs.get(idx) {
        Some(next) if next.start() == pos => true,
        Some(next) if next.start() > pos && next.has_data() => {
            tracing::info!(
                from = pos,
                to = next.start(),
                "commitlog: replay goes on after segments retention deleted"
            );
            true
        }
        _ => false,
    }
}

/// Replication (see [`crate::replica`]): the leader reads raw bytes at offsets, a
/// follower writes them at the same offsets. Kept apart from the append path, which it
/// does not touch.
impl CommitLog {
    /// The segment size this log was opened with (a follower's must be the leader's).
    pub fn segment_size(&self) -> u64 {
        self.segment_size
    }

    /// Up to `max` bytes of the log from `from`, zero copy from the mapping, never past
    /// the published end nor across a segment's end (the next call continues there).
    /// Empty at the end; `NotFound` when `from` lies in a segment no longer held
    /// (retention or compaction deleted it) or below the first one.
    pub fn read_raw(&self, from: u64, max: u64) -> Result<Bytes> {
        let end = self.end();
        if from >= end {
            return Ok(Bytes::new());
        }
        let seg = self.segment_for(from).ok_or_else(|| {
            StoreError::NotFound(format!(
                "commitlog offset {from} is no longer held (first held: {})",
                self.min_offset()
            ))
        })?;
        let to = end.min(seg.end()).min(from.saturating_add(max.max(1)));
        seg.bytes(from - seg.start(), to - from)
            .ok_or_else(|| StoreError::Invalid(format!("commitlog range {from}..{to}")))
    }

    /// Cuts a follower's log at `offset` (a divergent suffix from an older leader term):
    /// segments wholly after it are deleted, the rest of its segment zeroed and flushed.
    /// `offset` must be held and not past the end. Only for a log that has no other
    /// writer (a follower's).
    pub fn truncate(&self, offset: u64) -> Result<()> {
        let end = self.end();
        if offset >= end {
            return Ok(());
        }
        if offset < self.min_offset() {
            return Err(StoreError::Invalid(format!(
                "cannot truncate the commitlog to {offset}, below its first offset {}",
                self.min_offset()
            )));
        }
        let segs = self.segment_list();
        self.cut_after(&segs, offset, true, true).map(|_| ())
    }

    /// Writes `data` at `offset` as a follower copies the leader's log: `offset` must not
    /// be past the end (a gap is refused); bytes below the end must equal what is there
    /// (an overlap that differs is refused, one that agrees is skipped); the rest is
    /// written and the end moved past it, creating segments (at the previous one's end)
    /// as needed. Nothing is flushed: call [`CommitLog::flush`]. Only for a log that has
    /// no other writer (a follower's); `recover` must have run.
    pub fn write_raw(&self, offset: u64, data: &[u8]) -> Result<()> {
        let end = self.end();
        if offset > end {
            return Err(StoreError::Invalid(format!(
                "replicated bytes at {offset} leave a gap after the end {end}"
            )));
        }
        let stop = offset
            .checked_add(data.len() as u64)
            .ok_or_else(|| StoreError::Invalid("offset overflows".into()))?;
        // the overlap with what is there must agree
        let mut at = offset;
        while at < end.min(stop) {
            let seg = self.segment_for(at).ok_or_else(|| {
                StoreError::Invalid(format!("replicated bytes at {at}: segment not held"))
            })?;
            let to = end.min(stop).min(seg.end());
            let have = seg
                .slice(at - seg.start(), to - seg.start())
                .unwrap_or_default();
            let want = data
                .get((at - offset) as usize..(to - offset) as usize)
                .unwrap_or_default();
            if have != want {
                return Err(StoreError::Invalid(format!(
                    "replicated bytes at {at}..{to} differ from the log's"
                )));
            }
            at = to;
        }
        while at < stop {
            let seg = match self.segment_for(at) {
                Some(s) => s,
                None => {
                    let last_end = self.segments().values().next_back().map(|s| s.end());
                    if last_end.is_some_and(|e| e != at) {
                        return Err(StoreError::Invalid(format!(
                            "replicated bytes at {at} do not start where the last segment ends"
                        )));
                    }
                    self.create_segment(at)?
                }
            };
            let to = stop.min(seg.end());
            let dst = seg
                .slice_mut(at - seg.start(), to - seg.start())
                .ok_or_else(|| StoreError::Invalid("replicated bytes outside a segment".into()))?;
            dst.copy_from_slice(
                data.get((at - offset) as usize..(to - offset) as usize)
                    .unwrap_or_default(),
            );
            at = to;
            self.end.store(at, Ordering::Release);
        }
        Ok(())
    }
}

/// Zeroes (and flushes) every 4 KiB chunk of `seg` from `local` on that holds a non-zero
/// byte; returns whether there was one. Only the parts the filesystem says may hold data
/// are read ([`data_ranges`]: the never-written rest of a preallocated segment is not
/// even faulted in). A chunk is compared whole with a zero chunk (one `memcmp`, also in
/// debug builds, where a byte-by-byte scan of a 1 GiB segment took 11 s of a restart)
/// and written only if stale.
fn zero_stale(seg: &Segment, local: u64) -> Result<bool> {
    const CHUNK: u64 = 4096;
    static ZEROS: [u8; CHUNK as usize] = [0; CHUNK as usize];
    let mut span: Option<(u64, u64)> = None;
    for (from, to) in data_ranges(&seg.path, local, seg.len) {
        let Some(part) = seg.slice_mut(from, to) else {
            continue;
        };
        for (i, c) in part.chunks_mut(CHUNK as usize).enumerate() {
            if c != ZEROS.get(..c.len()).unwrap_or(&ZEROS) {
                c.fill(0);
                let at = from + i as u64 * CHUNK;
                span = Some((span.map_or(at, |s| s.0), at + c.len() as u64));
            }
        }
    }
    let Some((a, b)) = span else {
        return Ok(false);
    };
    seg.flush_range(a, b)?;
    Ok(true)
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

    /// Waits (bounded) for `cond`.
    fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !cond() {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Stops the warming thread when dropped, so a failed assertion inside a thread scope
    /// does not leave the scope waiting for it.
    struct StopWarming<'a>(&'a CommitLog);

    impl Drop for StopWarming<'_> {
        fn drop(&mut self) {
            self.0.stop_warming();
        }
    }

    /// Whether the pages of `from..to` (segment-local) are in memory (`mincore`).
    fn resident(seg: &Segment, from: u64, to: u64) -> bool {
        let page = 4096usize;
        let (from, to) = (
            from as usize / page * page,
            (to as usize).div_ceil(page) * page,
        );
        let mut vec = vec![0u8; (to - from) / page];
        // SAFETY: a page-aligned range inside the live mapping; `vec` has one byte per page.
        let rc = unsafe {
            libc::mincore(
                seg.map.as_mut_ptr().add(from).cast(),
                to - from,
                vec.as_mut_ptr(),
            )
        };
        rc == 0 && vec.iter().all(|v| v & 1 == 1)
    }

    #[test]
    fn no_segment_is_created_ahead_while_held() {
        let dir = tempfile::tempdir().unwrap();
        let seg = 64 << 10;
        let log = CommitLog::open(dir.path(), seg).unwrap();
        recover_count(&log, false);
        let next = dir.path().join(offset_name(seg));
        std::thread::scope(|s| {
            s.spawn(|| log.warm_ahead());
            let _stop = StopWarming(&log);
            log.hold_next_segment(true);
            let mut w = log.writer().unwrap();
            while w.pos() < seg - seg / 8 {
                put(&log, &mut w, &[7u8; 200]);
            }
            // the warming thread got as far as the end of the writer's segment...
            let first = log.segment_list()[0].clone();
            eventually("the last pages warmed", || {
                resident(&first, seg - 4096, seg)
            });
            // ...and stopped there
            assert!(!next.exists(), "no segment ahead while held");
            assert!(log.would_roll(&w, seg / 8));
            assert!(!log.would_roll(&w, 1024));
            log.hold_next_segment(false);
            eventually("the next segment once let go", || {
                log.segment_list().len() == 2
            });
            assert!(next.exists());
        });
    }

    #[test]
    fn warming_creates_the_next_segment_ahead_and_the_writer_rolls_into_it() {
        let dir = tempfile::tempdir().unwrap();
        let seg = 64 << 10;
        let log = CommitLog::open(dir.path(), seg).unwrap();
        recover_count(&log, false);
        let next = dir.path().join(offset_name(seg));
        let written = std::thread::scope(|s| {
            s.spawn(|| log.warm_ahead());
            let _stop = StopWarming(&log);
            let mut w = log.writer().unwrap();
            // the pages ahead of the writer are brought in before it gets there
            let first = log.segment_list()[0].clone();
            eventually("the first pages warmed", || resident(&first, 0, 16 << 10));
            let mut offs = Vec::new();
            // up to the last quarter of the first segment: not yet created
            while w.pos() < seg / 2 {
                offs.push(put(&log, &mut w, &[7u8; 200]));
            }
            assert!(
                !next.exists(),
                "created only once the writer is near the end"
            );
            while w.pos() < seg - seg / 8 {
                offs.push(put(&log, &mut w, &[7u8; 200]));
            }
            eventually("the next segment", || log.segment_list().len() == 2);
            assert!(next.exists());
            let ahead = log.segment_list()[1].clone();
            eventually("its first pages warmed", || resident(&ahead, 0, 4096));
            // the writer rolls into the segment made ahead, not a second copy of it
            while w.pos() < seg + 4096 {
                offs.push(put(&log, &mut w, &[8u8; 200]));
            }
            assert!(Arc::ptr_eq(&log.segment_list()[1], &ahead));
            for (i, off) in offs.iter().enumerate() {
                let r = log.read(*off).unwrap();
                assert_eq!(r.body.len(), 200, "record {i}");
            }
            offs.len()
        });
        // and everything is found again by recovery, across both segments
        drop(log);
        let log = CommitLog::open(dir.path(), seg).unwrap();
        let (r, n) = recover_count(&log, true);
        assert_eq!(n, written);
        assert!(r.end > seg);
    }

    #[test]
    fn an_unused_segment_made_ahead_is_dropped_by_recovery() {
        let dir = tempfile::tempdir().unwrap();
        let seg = 64 << 10;
        let log = CommitLog::open(dir.path(), seg).unwrap();
        recover_count(&log, false);
        std::thread::scope(|s| {
            s.spawn(|| log.warm_ahead());
            let _stop = StopWarming(&log);
            let mut w = log.writer().unwrap();
            while w.pos() < seg - seg / 8 {
                put(&log, &mut w, &[7u8; 200]);
            }
            eventually("the next segment", || log.segment_list().len() == 2);
        });
        let end = log.end();
        drop(log);
        let log = CommitLog::open(dir.path(), seg).unwrap();
        assert_eq!(log.segment_list().len(), 2);
        let (r, _) = recover_count(&log, true);
        assert_eq!(r.end, end);
        assert_eq!(
            log.segment_list().len(),
            1,
            "the empty segment after the end is gone"
        );
        assert!(!dir.path().join(offset_name(seg)).exists());
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

    /// An unclean recovery zeroes every stale byte past the end, however far into the
    /// (preallocated) segment it lies.
    #[test]
    fn unclean_recovery_zeroes_stale_bytes_anywhere_past_the_end() {
        use std::os::unix::fs::FileExt;
        let size = 1u64 << 20;
        let dir = tempfile::tempdir().unwrap();
        let log = CommitLog::open(dir.path(), size).unwrap();
        recover_count(&log, false);
        let mut w = log.writer().unwrap();
        for i in 0..3u8 {
            put(&log, &mut w, &[i; 100]);
        }
        let end = log.end();
        let path = log.segment_for(0).unwrap().path().to_path_buf();
        drop(w);
        drop(log);
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        for at in [end, 300_000, size / 2 + 7, size - 10] {
            f.write_all_at(&[0xAB; 10], at).unwrap();
        }
        drop(f);
        let log = CommitLog::open(dir.path(), size).unwrap();
        let (r, n) = recover_count(&log, true);
        assert_eq!((r.end, n, r.truncated), (end, 3, true));
        drop(log);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len() as u64, size);
        assert!(
            bytes[end as usize..].iter().all(|b| *b == 0),
            "stale bytes left"
        );
    }

    /// Compaction deletes sealed segments anywhere in the log: recovery goes on after the
    /// hole, whether it starts below or above it; the writer's segment is never
    /// deleted; a scan visits each record of a sealed segment with its bytes.
    #[test]
    fn a_deleted_middle_segment_leaves_a_hole_recovery_goes_on_after() {
        let dir = tempfile::tempdir().unwrap();
        let mut offs = Vec::new();
        {
            let log = CommitLog::open(dir.path(), 4096).unwrap();
            recover_count(&log, false);
            let mut w = log.writer().unwrap();
            for i in 0..60u8 {
                offs.push(put(&log, &mut w, &[i; 200]));
            }
            let segs = log.sealed_segments();
            assert!(segs.len() >= 3);
            let mut seen = Vec::new();
            log.scan_segment(segs[1].start(), |off, raw, d| {
                assert!(matches!(d, Decoded::Message { len, .. } if *len as usize == raw.len()));
                seen.push(off);
                Ok(())
            })
            .unwrap();
            let expect: Vec<u64> = offs
                .iter()
                .copied()
                .filter(|o| (segs[1].start()..segs[1].end()).contains(o))
                .collect();
            assert_eq!(seen, expect);
            assert!(log.delete_segment(segs[1].start()).unwrap());
            assert!(
                !log.delete_segment(segs[1].start()).unwrap(),
                "gone already"
            );
            let tail = log.segment_list().last().unwrap().start();
            assert!(
                !log.delete_segment(tail).unwrap(),
                "the writer's segment stays"
            );
            assert!(matches!(log.read(expect[0]), Err(StoreError::NotFound(_))));
            assert_eq!(log.read(offs[0]).unwrap().body.as_ref(), &[0u8; 200]);
        }
        let third = offset_name(2 * 4096);
        assert!(dir.path().join(third).exists());
        // from the start (a demoted leader's replay, without its checkpoint) the scan goes
        // on after the hole: every record but the deleted segment's, to the same end
        let log = CommitLog::open(dir.path(), 4096).unwrap();
        let mut seen = Vec::new();
        let r = log
            .recover(0, true, false, |off, _| {
                seen.push(off);
                Ok(())
            })
            .unwrap();
        let kept: Vec<u64> = offs
            .iter()
            .copied()
            .filter(|o| !(4096..2 * 4096).contains(o))
            .collect();
        assert_eq!(seen, kept);
        assert_eq!(r.end, log.end());
        assert!(!r.truncated);
        drop(log);
        let log = CommitLog::open(dir.path(), 4096).unwrap();
        let mut n = 0;
        let r = log
            .recover(2 * 4096, true, false, |_, _| {
                n += 1;
                Ok(())
            })
            .unwrap();
        assert_eq!(r.end, log.end());
        let later = offs.iter().filter(|o| **o >= 2 * 4096).count();
        assert_eq!(n, later);
        assert_eq!(
            log.read(*offs.last().unwrap()).unwrap().body.as_ref(),
            &[59u8; 200]
        );
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

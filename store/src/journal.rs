//! The metadata journal: every change to durable metadata (the store's queue registry,
//! vhosts, exchanges, queues, bindings) is one record appended to an ordered log,
//! group-committed with one `fdatasync` for all concurrent appends, and compacted into a
//! snapshot now and then. No change rewrites a whole document, so a declare or bind
//! costs O(the change) however many entities exist. The journal is also the unit a
//! leader will later ship to followers: an ordered log of changes with sequence numbers.
//!
//! The model is a key → value map of byte strings. A record holds a batch of operations,
//! applied atomically (one checksum covers the batch): `Put`, `Delete`, and
//! `DeletePrefix` (every key starting with a prefix, e.g. all bindings of a deleted
//! queue).
//!
//! On disk, in `meta/`:
//!
//! ```text
//! journal-<20 digits>   records appended since the snapshot at that position
//! snapshot-<20 digits>  the whole map as of that journal position (written atomically)
//! ```
//!
//! A position is a byte offset over the journal's whole history: `journal-P` holds the
//! records from position P on, and `snapshot-P` the state at P. A record is
//! `u32 body length, u32 CRC32C(body), body`; the body is `u64 sequence, u32 op count`,
//! then per op `u8 kind, u32 key length, key` and, for `Put`, `u32 value length, value`.
//! A snapshot is a header (`TMSN`, version 1, u64 position, u64 sequence) followed by one
//! `Put` record per key and an end record (kind `End`, carrying the key count).
//!
//! Compaction: once the journals since the last snapshot are larger than a threshold
//! (`[store] metadata_compact_size`, default [`COMPACT_MIN`]) and twice that snapshot,
//! appends switch to a new file `journal-P` at the current end P (the old file made
//! durable first: the only work done under the journal's lock), and a background thread
//! merges the old snapshot and the journals before P, read back from their files, into
//! `snapshot-P` (temp file, fsync, rename, directory fsync), then removes the files it
//! replaces. So appends never wait for a snapshot to be written, and the cost is
//! amortised O(1) per change. Recovery takes the newest snapshot, replays the journals
//! at or after it in order (contiguous positions), cuts a torn tail off the last one,
//! and removes older files; a crash at any step of a compaction leaves either the old
//! snapshot with its complete journals or the new snapshot.
//!
//! Memory: the state replayed at open is held in memory only for start-up, while the
//! store and the broker load their entities from it with [`MetaJournal::scan`]; then
//! [`MetaJournal::release_state`] drops it (1,000,000 bindings cost about 200 bytes each
//! in such a map), and later scans read the snapshot and journals back from their files
//! (under the journal lock, so appends wait for such a scan: only a vhost created at run
//! time does one). The journal itself needs no state to append or to compact.
//!
//! Durability: [`MetaJournal::append`] writes the record with `write(2)` (under the
//! journal lock, so records are in the order callers made their changes) and returns a
//! [`Durable`] that completes once an `fdatasync` covered it; the journal's flusher
//! thread serves all waiters with one `fdatasync` per round (group commit), as the
//! commitlog's does.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::error::{Result, StoreError};
use crate::file::{parse_offset_name, sync_dir};
use crate::flush::{Durable, FlushShared};

/// A journal is compacted once it is past this size and twice the last snapshot.
pub const COMPACT_MIN: u64 = 8 << 20;
/// The largest record (one batch of operations) the journal accepts.
pub const MAX_RECORD: usize = 16 << 20;

const SNAP_MAGIC: &[u8; 4] = b"TMSN";
const KIND_PUT: u8 = 1;
const KIND_DELETE: u8 = 2;
const KIND_DELETE_PREFIX: u8 = 3;
const KIND_END: u8 = 4;

/// One change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaOp {
    /// Sets `key` to `value`.
    Put { key: Vec<u8>, value: Vec<u8> },
    /// Removes `key`.
    Delete { key: Vec<u8> },
    /// Removes every key that starts with `prefix`.
    DeletePrefix { prefix: Vec<u8> },
}

impl MetaOp {
    pub fn put(key: Vec<u8>, value: Vec<u8>) -> MetaOp {
        MetaOp::Put { key, value }
    }
    pub fn delete(key: Vec<u8>) -> MetaOp {
        MetaOp::Delete { key }
    }
    pub fn delete_prefix(prefix: Vec<u8>) -> MetaOp {
        MetaOp::DeletePrefix { prefix }
    }
}

/// Builds a key from a namespace tag and length-prefixed parts, so that a prefix made of
/// the first parts matches exactly the keys that share those parts.
#[derive(Debug, Clone, Default)]
pub struct KeyBuilder(Vec<u8>);

impl KeyBuilder {
    pub fn new(tag: u8) -> KeyBuilder {
        KeyBuilder(vec![tag])
    }
    /// Appends one part (u32 big-endian length, then the bytes).
    pub fn part(mut self, bytes: &[u8]) -> KeyBuilder {
        self.0
            .extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes());
        self.0.extend_from_slice(bytes);
        self
    }
    /// Appends one raw byte (a kind marker).
    pub fn byte(mut self, b: u8) -> KeyBuilder {
        self.0.push(b);
        self
    }
    pub fn build(self) -> Vec<u8> {
        self.0
    }
}

/// Splits a key made by [`KeyBuilder`] (after its tag and `raw` marker bytes) into its
/// parts; `None` if it is malformed.
pub fn key_parts(mut rest: &[u8]) -> Option<Vec<&[u8]>> {
    let mut out = Vec::new();
    while !rest.is_empty() {
        let (len, tail) = rest.split_first_chunk::<4>()?;
        let len = u32::from_be_bytes(*len) as usize;
        let (part, tail) = tail.split_at_checked(len)?;
        out.push(part);
        rest = tail;
    }
    Some(out)
}

type Map = BTreeMap<Vec<u8>, Vec<u8>>;

struct State {
    file: Arc<File>,
    path: PathBuf,
    /// Journal position where the current file starts.
    base: u64,
    /// Position of the newest snapshot (the journals from there on hold the rest).
    snap_base: u64,
    /// A background compaction is writing the next snapshot.
    compacting: bool,
    /// Journal position of the end of the current file.
    pos: u64,
    seq: u64,
    /// The replayed state, held from open until [`MetaJournal::release_state`].
    map: Option<Map>,
    /// Size of the snapshot at `snap_base` (0 when there is none).
    snapshot_len: u64,
    /// Compact once the current file is past this size (and twice the snapshot).
    compact_min: u64,
    failed: bool,
}

struct Shared {
    dir: PathBuf,
    state: Mutex<State>,
    flush: Arc<FlushShared>,
    /// The background compaction in flight, if any.
    compactor: Mutex<Option<JoinHandle<()>>>,
}

/// The metadata journal; see the module docs.
pub struct MetaJournal {
    shared: Arc<Shared>,
    flusher: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for MetaJournal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaJournal")
            .field("dir", &self.shared.dir)
            .finish()
    }
}

fn journal_name(pos: u64) -> String {
    format!("journal-{pos:020}")
}
fn snapshot_name(pos: u64) -> String {
    format!("snapshot-{pos:020}")
}

fn encode_body(seq: u64, ops: &[MetaOp], out: &mut Vec<u8>) {
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(ops.len() as u32).to_le_bytes());
    for op in ops {
        let (kind, key, value) = match op {
            MetaOp::Put { key, value } => (KIND_PUT, key, Some(value)),
            MetaOp::Delete { key } => (KIND_DELETE, key, None),
            MetaOp::DeletePrefix { prefix } => (KIND_DELETE_PREFIX, prefix, None),
        };
        out.push(kind);
        out.extend_from_slice(&(key.len() as u32).to_le_bytes());
        out.extend_from_slice(key);
        if let Some(v) = value {
            out.extend_from_slice(&(v.len() as u32).to_le_bytes());
            out.extend_from_slice(v);
        }
    }
}

fn frame(body: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
    out.extend_from_slice(body);
}

/// What [`decode_record`] found at a position.
enum Decoded<'a> {
    Record {
        len: usize,
        body: &'a [u8],
    },
    /// Not a whole, valid record: the end of what was written.
    Torn,
    End,
}

fn decode_record(buf: &[u8]) -> Decoded<'_> {
    if buf.is_empty() {
        return Decoded::End;
    }
    let Some((len, rest)) = buf.split_first_chunk::<4>() else {
        return Decoded::Torn;
    };
    let Some((crc, rest)) = rest.split_first_chunk::<4>() else {
        return Decoded::Torn;
    };
    let len = u32::from_le_bytes(*len) as usize;
    if len > MAX_RECORD {
        return Decoded::Torn;
    }
    let Some(body) = rest.get(..len) else {
        return Decoded::Torn;
    };
    if crc32c::crc32c(body) != u32::from_le_bytes(*crc) || len < 12 {
        return Decoded::Torn;
    }
    Decoded::Record { len: 8 + len, body }
}

/// Parses a record body into its sequence number and operations (`End` ops are returned
/// as `None` with their count).
fn parse_body(body: &[u8]) -> Option<(u64, Vec<MetaOp>, Option<u64>)> {
    let (seq, rest) = body.split_first_chunk::<8>()?;
    let (n, mut p) = rest.split_first_chunk::<4>()?;
    let n = u32::from_le_bytes(*n);
    let mut ops = Vec::new();
    let mut end = None;
    let take = |p: &mut &[u8]| -> Option<Vec<u8>> {
        let (len, rest) = p.split_first_chunk::<4>()?;
        let (v, rest) = rest.split_at_checked(u32::from_le_bytes(*len) as usize)?;
        *p = rest;
        Some(v.to_vec())
    };
    for _ in 0..n {
        let (&kind, rest) = p.split_first()?;
        p = rest;
        match kind {
            KIND_PUT => {
                let key = take(&mut p)?;
                let value = take(&mut p)?;
                ops.push(MetaOp::Put { key, value });
            }
            KIND_DELETE => ops.push(MetaOp::Delete { key: take(&mut p)? }),
            KIND_DELETE_PREFIX => ops.push(MetaOp::DeletePrefix {
                prefix: take(&mut p)?,
            }),
            KIND_END => {
                let (count, rest) = p.split_first_chunk::<8>()?;
                p = rest;
                end = Some(u64::from_le_bytes(*count));
            }
            _ => return None,
        }
    }
    p.is_empty().then_some((u64::from_le_bytes(*seq), ops, end))
}

fn prefix_range<'a>(
    map: &'a Map,
    prefix: &'a [u8],
) -> impl Iterator<Item = (&'a Vec<u8>, &'a Vec<u8>)> + 'a {
    map.range::<[u8], _>((Bound::Included(prefix), Bound::Unbounded))
        .take_while(move |(k, _)| k.starts_with(prefix))
}

/// Applies `ops` to `map`, which holds only keys starting with `within` (empty: all).
fn apply(map: &mut Map, ops: Vec<MetaOp>, within: &[u8]) {
    for op in ops {
        let op = match op {
            MetaOp::Put { ref key, .. } | MetaOp::Delete { ref key }
                if !key.starts_with(within) =>
            {
                continue
            }
            // a prefix shorter than `within` removes every key the map may hold
            MetaOp::DeletePrefix { ref prefix } if !prefix.starts_with(within) => {
                if within.starts_with(prefix) {
                    MetaOp::DeletePrefix {
                        prefix: within.to_vec(),
                    }
                } else {
                    continue;
                }
            }
            op => op,
        };
        match op {
            MetaOp::Put { key, value } => {
                map.insert(key, value);
            }
            MetaOp::Delete { key } => {
                map.remove(&key);
            }
            MetaOp::DeletePrefix { prefix } => {
                let keys: Vec<Vec<u8>> =
                    prefix_range(map, &prefix).map(|(k, _)| k.clone()).collect();
                for k in keys {
                    map.remove(&k);
                }
            }
        }
    }
}

/// Whether `op` would change `map`.
fn changes(map: &Map, op: &MetaOp) -> bool {
    match op {
        MetaOp::Put { key, value } => map.get(key) != Some(value),
        MetaOp::Delete { key } => map.contains_key(key),
        MetaOp::DeletePrefix { prefix } => prefix_range(map, prefix).next().is_some(),
    }
}

fn corrupt(path: &Path, offset: u64, reason: &str) -> StoreError {
    StoreError::Corrupt {
        path: path.to_path_buf(),
        offset,
        reason: reason.to_string(),
    }
}

/// Reads a snapshot: (sequence, the keys starting with `within` and their values).
fn read_snapshot(path: &Path, pos: u64, within: &[u8]) -> Result<(u64, Map)> {
    let bytes = std::fs::read(path).map_err(StoreError::at(path))?;
    let header = bytes
        .get(..21)
        .ok_or_else(|| corrupt(path, 0, "short snapshot"))?;
    if header.get(..4) != Some(SNAP_MAGIC.as_slice()) || header.get(4) != Some(&1) {
        return Err(corrupt(path, 0, "not a metadata snapshot"));
    }
    let at = |r: std::ops::Range<usize>| -> u64 {
        header
            .get(r)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .unwrap_or(0)
    };
    if at(5..13) != pos {
        return Err(corrupt(
            path,
            5,
            "snapshot position does not match its name",
        ));
    }
    let seq = at(13..21);
    // a snapshot holds one put per key in key order: collected, then built into the map
    // in one pass (1,000,000 inserts one by one cost a second of key comparisons)
    let mut puts: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut keys = 0u64;
    let mut off = 21usize;
    loop {
        let rest = bytes.get(off..).unwrap_or(&[]);
        match decode_record(rest) {
            Decoded::Record { len, body } => {
                let (_, ops, end) =
                    parse_body(body).ok_or_else(|| corrupt(path, off as u64, "bad record"))?;
                if let Some(count) = end {
                    if count != keys || off + len != bytes.len() {
                        return Err(corrupt(path, off as u64, "snapshot key count mismatch"));
                    }
                    return Ok((seq, puts.into_iter().collect()));
                }
                for op in ops {
                    let MetaOp::Put { key, value } = op else {
                        return Err(corrupt(
                            path,
                            off as u64,
                            "a snapshot record that is not a put",
                        ));
                    };
                    keys += 1;
                    if key.starts_with(within) {
                        puts.push((key, value));
                    }
                }
                off += len;
            }
            Decoded::Torn | Decoded::End => {
                return Err(corrupt(
                    path,
                    off as u64,
                    "snapshot ends without its end record",
                ))
            }
        }
    }
}

impl MetaJournal {
    /// Opens the journal in `dir` (creating it): loads the newest snapshot, replays the
    /// journal after it, cuts a torn tail, and starts the flusher thread.
    pub fn open(dir: &Path, compact_min: u64) -> Result<MetaJournal> {
        std::fs::create_dir_all(dir).map_err(StoreError::at(dir))?;
        let mut snaps = Vec::new();
        let mut journals = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(StoreError::at(dir))? {
            let entry = entry.map_err(StoreError::at(dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(p) = name.strip_prefix("snapshot-").and_then(parse_offset_name) {
                snaps.push(p);
            } else if let Some(p) = name.strip_prefix("journal-").and_then(parse_offset_name) {
                journals.push(p);
            }
        }
        snaps.sort_unstable();
        journals.sort_unstable();
        let base = snaps.last().copied().unwrap_or(0);
        let (mut seq, mut map, snapshot_len) = match snaps.last() {
            Some(&p) => {
                let path = dir.join(snapshot_name(p));
                let len = std::fs::metadata(&path)
                    .map_err(StoreError::at(&path))?
                    .len();
                let (seq, map) = read_snapshot(&path, p, &[])?;
                (seq, map, len)
            }
            None => (0, Map::new(), 0),
        };
        if snaps.is_empty() && journals.first().is_some_and(|&j| j > 0) {
            return Err(corrupt(
                dir,
                0,
                "metadata journal starts after position 0 but there is no snapshot",
            ));
        }
        // Older generations are superseded by the snapshot.
        for &p in snaps.iter().filter(|&&p| p < base) {
            remove(&dir.join(snapshot_name(p)))?;
        }
        for &p in journals.iter().filter(|&&p| p < base) {
            remove(&dir.join(journal_name(p)))?;
        }
        let live: Vec<u64> = journals.into_iter().filter(|&p| p >= base).collect();
        let (mut pos, mut cur_base) = (base, base);
        if !live.is_empty() {
            (pos, cur_base) = replay_journals(dir, base, &live, &mut map, &mut seq, true, &[])?;
        }
        let path = dir.join(journal_name(cur_base));
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(StoreError::at(&path))?;
        if live.is_empty() {
            file.sync_all().map_err(StoreError::at(&path))?;
            sync_dir(dir)?;
        }
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            state: Mutex::new(State {
                file: Arc::new(file),
                path,
                base: cur_base,
                snap_base: base,
                pos,
                seq,
                map: Some(map),
                snapshot_len,
                compacting: false,
                compact_min,
                failed: false,
            }),
            flush: FlushShared::new(pos),
            compactor: Mutex::new(None),
        });
        let s = shared.clone();
        let flusher = std::thread::Builder::new()
            .name("meta-flush".into())
            .spawn(move || s.flusher())
            .map_err(StoreError::at(dir))?;
        Ok(MetaJournal {
            shared,
            flusher: Mutex::new(Some(flusher)),
        })
    }

    /// The value of `key`.
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self
            .scan(key)?
            .into_iter()
            .find_map(|(k, v)| (k == key).then_some(v)))
    }

    /// Every key starting with `prefix` and its value, in key order: from the state held
    /// since open, or, once it was released, read back from the files.
    pub fn scan(&self, prefix: &[u8]) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let st = self.shared.lock();
        match &st.map {
            Some(map) => Ok(prefix_range(map, prefix)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()),
            None => Ok(self.shared.read_files(&st, prefix)?.into_iter().collect()),
        }
    }

    /// Calls `f` with every key starting with `prefix` and its value, in key order,
    /// without copying them out (under the journal lock: `f` must not use the journal).
    pub fn visit(&self, prefix: &[u8], f: &mut dyn FnMut(&[u8], &[u8])) -> Result<()> {
        let st = self.shared.lock();
        match &st.map {
            Some(map) => prefix_range(map, prefix).for_each(|(k, v)| f(k, v)),
            None => self
                .shared
                .read_files(&st, prefix)?
                .iter()
                .for_each(|(k, v)| f(k, v)),
        }
        Ok(())
    }

    /// Number of keys.
    pub fn len(&self) -> Result<usize> {
        Ok(self.scan(&[])?.len())
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Drops the state replayed at open (start-up is done: every entity was loaded from
    /// it) and gives the freed memory back to the system. Later scans read the files.
    pub fn release_state(&self) {
        let map = self.shared.lock().map.take();
        if map.is_some() {
            drop(map);
            crate::file::release_free_memory();
        }
    }

    /// The journal position after the last record, and the last sequence number.
    pub fn position(&self) -> (u64, u64) {
        let st = self.shared.lock();
        (st.pos, st.seq)
    }

    /// Appends one record holding `ops` (applied atomically, in order) and returns what to
    /// wait on for its durability. While the state replayed at open is held, operations
    /// that change nothing are left out; after [`MetaJournal::release_state`] there is
    /// nothing to compare with and each is written (replaying one changes nothing). When
    /// no operation is left nothing is written and the result is already durable. Records are in the
    /// order of the calls: make a change to in-memory state and append its record under
    /// the same lock, so that the journal's order is the state's.
    pub fn append(&self, ops: Vec<MetaOp>) -> Result<Durable> {
        self.shared.flush.check()?;
        let mut st = self.shared.lock();
        let ops: Vec<MetaOp> = match &st.map {
            Some(map) => ops.into_iter().filter(|op| changes(map, op)).collect(),
            None => ops,
        };
        if ops.is_empty() {
            return Ok(Durable::ready());
        }
        if st.failed {
            return Err(StoreError::Fatal("metadata journal failed".into()));
        }
        let seq = st.seq + 1;
        let mut body = Vec::new();
        encode_body(seq, &ops, &mut body);
        if body.len() > MAX_RECORD {
            return Err(StoreError::TooLarge {
                size: body.len() as u64,
                max: MAX_RECORD as u64,
            });
        }
        let mut rec = Vec::with_capacity(body.len() + 8);
        frame(&body, &mut rec);
        if let Err(e) = (&*st.file).write_all(&rec) {
            // A short write may have left part of the record: nothing more can be
            // appended after it safely.
            st.failed = true;
            let e = StoreError::io(&st.path, e);
            self.shared.flush.fail(e.to_string());
            return Err(e);
        }
        st.seq = seq;
        st.pos += rec.len() as u64;
        if let Some(map) = st.map.as_mut() {
            apply(map, ops, &[]);
        }
        let end = st.pos;
        self.shared.flush.appended(end, u64::MAX);
        let due = st.pos - st.snap_base > st.compact_min.max(st.snapshot_len.saturating_mul(2));
        if due && !st.compacting {
            // Only the switch to a new journal file happens here, under the lock; the
            // snapshot is written by a thread of its own from the files.
            match self.shared.rotate(&mut st) {
                Ok(Some(job)) => {
                    drop(st);
                    self.shared.spawn_compaction(job);
                    return Ok(Durable::new(end, self.shared.flush.clone()));
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "metadata journal: compaction failed; will retry")
                }
            }
        }
        drop(st);
        Ok(Durable::new(end, self.shared.flush.clone()))
    }

    /// Completes once every record appended so far is on disk.
    pub fn durable_end(&self) -> Durable {
        let end = self.shared.lock().pos;
        if self.shared.flush.flushed() >= end {
            return Durable::ready();
        }
        Durable::new(end, self.shared.flush.clone())
    }

    /// Appends and waits until the record is on disk.
    pub fn commit(&self, ops: Vec<MetaOp>) -> Result<()> {
        self.append(ops)?.wait()
    }

    /// Starts a new journal file and writes the snapshot at its start, in this thread
    /// (after any background compaction in flight).
    pub fn compact(&self) -> Result<()> {
        self.shared.join_compaction();
        let job = {
            let mut st = self.shared.lock();
            self.shared.rotate(&mut st)?
        };
        match job {
            Some(job) => self.shared.compact_files(job),
            None => Ok(()),
        }
    }

    /// Flushes what is left and stops the flusher (and waits for a compaction).
    pub fn close(&self) {
        self.shared.join_compaction();
        self.shared.flush.shutdown();
        if let Some(t) = self
            .flusher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = t.join();
        }
    }
}

impl Drop for MetaJournal {
    fn drop(&mut self) {
        self.close();
    }
}

/// What the leader ships of its journal from a follower's position (see
/// [`MetaJournal::read_raw`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawJournal {
    /// Record bytes starting at `pos` (possibly cut mid-record: the follower writes them
    /// raw, and its recovery cuts an incomplete tail).
    Records { pos: u64, bytes: Vec<u8> },
    /// The follower's position was compacted away: the whole snapshot file at `pos`;
    /// records follow from `pos`.
    Snapshot { pos: u64, bytes: Vec<u8> },
}

/// Replication (see [`crate::replica`]): reading the journal's raw bytes by position.
impl MetaJournal {
    /// Up to `max` bytes of records from journal position `from`, or, when `from` lies
    /// before the newest snapshot, that snapshot. `Ok(None)` when `from` is the end.
    /// An error when `from` is past the end (a follower ahead of its leader). Reads the
    /// files under the journal lock (a compaction cannot remove them meanwhile).
    pub fn read_raw(&self, from: u64, max: usize) -> Result<Option<RawJournal>> {
        use std::os::unix::fs::FileExt;
        let st = self.shared.lock();
        if from > st.pos {
            return Err(StoreError::Invalid(format!(
                "journal position {from} is past this journal's end {}",
                st.pos
            )));
        }
        if from == st.pos {
            return Ok(None);
        }
        if from < st.snap_base {
            let path = self.shared.dir.join(snapshot_name(st.snap_base));
            let bytes = std::fs::read(&path).map_err(StoreError::at(&path))?;
            return Ok(Some(RawJournal::Snapshot {
                pos: st.snap_base,
                bytes,
            }));
        }
        // the file holding `from`: the newest journal starting at or before it
        let files = list_journals(&self.shared.dir)?;
        let base = files
            .iter()
            .copied()
            .filter(|&p| p <= from && p >= st.snap_base)
            .max()
            .ok_or_else(|| corrupt(&self.shared.dir, from, "no journal file holds it"))?;
        // a read stops at the end of its file (the next file starts there)
        let file_end = files
            .iter()
            .copied()
            .filter(|&p| p > base && p <= st.pos)
            .min()
            .unwrap_or(st.pos);
        let path = self.shared.dir.join(journal_name(base));
        let file = File::open(&path).map_err(StoreError::at(&path))?;
        let len = (file_end - from).min(max.max(1) as u64) as usize;
        let mut bytes = vec![0u8; len];
        let mut got = 0usize;
        while got < len {
            let n = file
                .read_at(
                    bytes.get_mut(got..).unwrap_or_default(),
                    from - base + got as u64,
                )
                .map_err(StoreError::at(&path))?;
            if n == 0 {
                break;
            }
            got += n;
        }
        bytes.truncate(got);
        if bytes.is_empty() {
            return Err(corrupt(&path, from - base, "journal file ends early"));
        }
        Ok(Some(RawJournal::Records { pos: from, bytes }))
    }
}

/// Names of the journal's files, for a follower writing its copy.
pub(crate) fn file_names(pos: u64) -> (String, String) {
    (journal_name(pos), snapshot_name(pos))
}

fn remove(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::io(path, e)),
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn flusher(&self) {
        while self.flush.next_target().is_some() {
            // The file and its end are taken together, so `end` lies in `file` (or in an
            // older file, which a compaction synced before it switched).
            let (file, path, end) = {
                let st = self.lock();
                (st.file.clone(), st.path.clone(), st.pos)
            };
            if let Err(e) = file.sync_data() {
                let e = StoreError::io(&path, e);
                tracing::error!(error = %e, "metadata journal: fdatasync failed; no more metadata changes");
                self.flush.fail(e.to_string());
                break;
            }
            self.flush.complete(end);
        }
    }

    /// Switches appends to a new journal file at the current position, after making the
    /// old one durable, and returns the compaction to run: the snapshot at `snap_base`
    /// plus the journals up to the new position, merged into a snapshot there. `None` when
    /// nothing was written since the last snapshot. Called under the state lock.
    fn rotate(&self, st: &mut State) -> Result<Option<CompactJob>> {
        let pos = st.pos;
        if pos == st.snap_base || st.compacting {
            return Ok(None);
        }
        if pos != st.base {
            // Everything in the old file must be durable before it stops being the one
            // the flusher syncs.
            if let Err(e) = st.file.sync_data() {
                let e = StoreError::io(&st.path, e);
                self.flush.fail(e.to_string());
                st.failed = true;
                return Err(e);
            }
            self.flush.complete(pos);
            let path = self.dir.join(journal_name(pos));
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(StoreError::at(&path))?;
            file.sync_all().map_err(StoreError::at(&path))?;
            sync_dir(&self.dir)?;
            st.file = Arc::new(file);
            st.path = path;
            st.base = pos;
        }
        st.compacting = true;
        Ok(Some(CompactJob {
            from: st.snap_base,
            to: pos,
            has_snapshot: st.snapshot_len > 0,
        }))
    }

    fn spawn_compaction(self: &Arc<Self>, job: CompactJob) {
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("meta-compact".into())
            .spawn(move || {
                if let Err(e) = me.compact_files(job) {
                    tracing::warn!(error = %e, "metadata journal: compaction failed; will retry");
                }
            });
        match spawned {
            Ok(h) => {
                let old = self
                    .compactor
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .replace(h);
                if let Some(old) = old {
                    let _ = old.join();
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "metadata journal: cannot start a compaction");
                self.lock().compacting = false;
            }
        }
    }

    fn join_compaction(&self) {
        let h = self
            .compactor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }

    /// Reads the snapshot at `job.from` and the journals from there to `job.to` (all
    /// complete and durable: appends go to the file at `job.to`), writes their merge as
    /// the snapshot at `job.to`, then removes what it replaces. Takes the lock only at the
    /// end; a crash at any point leaves a loadable set of files.
    fn compact_files(&self, job: CompactJob) -> Result<()> {
        let res = self.merge_and_write(&job);
        let mut st = self.lock();
        st.compacting = false;
        let len = res?;
        st.snap_base = job.to;
        st.snapshot_len = len;
        drop(st);
        if job.has_snapshot {
            remove(&self.dir.join(snapshot_name(job.from)))?;
        }
        for p in list_journals(&self.dir)? {
            if p < job.to {
                remove(&self.dir.join(journal_name(p)))?;
            }
        }
        Ok(())
    }

    /// The keys starting with `within`, and their values, as of `st.pos`, read from the
    /// newest snapshot and the journals after it. Called under the state lock: the files
    /// read cannot be replaced meanwhile (a compaction removes files only after it has
    /// moved `snap_base` past them, under the lock).
    fn read_files(&self, st: &State, within: &[u8]) -> Result<Map> {
        if st.failed {
            return Err(StoreError::Fatal("metadata journal failed".into()));
        }
        let (mut seq, mut map) = if st.snapshot_len > 0 {
            read_snapshot(
                &self.dir.join(snapshot_name(st.snap_base)),
                st.snap_base,
                within,
            )?
        } else {
            (0, Map::new())
        };
        let journals: Vec<u64> = list_journals(&self.dir)?
            .into_iter()
            .filter(|&p| p >= st.snap_base && p <= st.base)
            .collect();
        let (end, _) = replay_journals(
            &self.dir,
            st.snap_base,
            &journals,
            &mut map,
            &mut seq,
            false,
            within,
        )?;
        if end != st.pos {
            return Err(corrupt(
                &self.dir,
                end,
                "metadata journals end before the last append",
            ));
        }
        Ok(map)
    }

    fn merge_and_write(&self, job: &CompactJob) -> Result<u64> {
        let (mut seq, mut map) = if job.has_snapshot {
            read_snapshot(&self.dir.join(snapshot_name(job.from)), job.from, &[])?
        } else {
            (0, Map::new())
        };
        let journals: Vec<u64> = list_journals(&self.dir)?
            .into_iter()
            .filter(|&p| p >= job.from && p < job.to)
            .collect();
        let (end, _) = replay_journals(
            &self.dir,
            job.from,
            &journals,
            &mut map,
            &mut seq,
            false,
            &[],
        )?;
        if end != job.to {
            return Err(corrupt(
                &self.dir,
                end,
                "metadata journals end before the compaction point",
            ));
        }
        let mut out = Vec::with_capacity(64 + map.len() * 64);
        out.extend_from_slice(SNAP_MAGIC);
        out.push(1);
        out.extend_from_slice(&job.to.to_le_bytes());
        out.extend_from_slice(&seq.to_le_bytes());
        let mut body = Vec::new();
        for (k, v) in map.iter() {
            body.clear();
            encode_body(
                seq,
                &[MetaOp::Put {
                    key: k.clone(),
                    value: v.clone(),
                }],
                &mut body,
            );
            frame(&body, &mut out);
        }
        body.clear();
        body.extend_from_slice(&seq.to_le_bytes());
        body.extend_from_slice(&1u32.to_le_bytes());
        body.push(KIND_END);
        body.extend_from_slice(&(map.len() as u64).to_le_bytes());
        frame(&body, &mut out);
        drop(map);
        crate::file::write_atomic(&self.dir.join(snapshot_name(job.to)), &out)?;
        tracing::debug!(
            position = job.to,
            bytes = out.len(),
            "metadata journal compacted"
        );
        Ok(out.len() as u64)
    }
}

/// A compaction to run: merge the snapshot at `from` (if any) and the journals up to
/// `to` into the snapshot at `to`.
struct CompactJob {
    from: u64,
    to: u64,
    has_snapshot: bool,
}

fn list_journals(dir: &Path) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(StoreError::at(dir))? {
        let entry = entry.map_err(StoreError::at(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(p) = name.strip_prefix("journal-").and_then(parse_offset_name) {
            out.push(p);
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// Replays the journal files starting at the positions in `journals` (ascending, the
/// first at `start`, each starting where the previous one ends) into `map` (the keys
/// starting with `within` only), and returns
/// the end position and the start of the last file. A damaged record ends the last file
/// (a torn tail: cut off when `cut_tail`, an error otherwise) and is an error in any
/// other file.
fn replay_journals(
    dir: &Path,
    start: u64,
    journals: &[u64],
    map: &mut Map,
    seq: &mut u64,
    cut_tail: bool,
    within: &[u8],
) -> Result<(u64, u64)> {
    let mut pos = start;
    let mut cur_base = start;
    for (i, &p) in journals.iter().enumerate() {
        let path = dir.join(journal_name(p));
        if p != pos {
            return Err(corrupt(&path, 0, "gap between metadata journal files"));
        }
        cur_base = p;
        let bytes = std::fs::read(&path).map_err(StoreError::at(&path))?;
        let mut off = 0usize;
        let last = i + 1 == journals.len();
        loop {
            match decode_record(bytes.get(off..).unwrap_or(&[])) {
                Decoded::Record { len, body } => {
                    let (s, ops, end) = parse_body(body)
                        .ok_or_else(|| corrupt(&path, off as u64, "bad journal record"))?;
                    if end.is_some() {
                        return Err(corrupt(&path, off as u64, "end record in a journal"));
                    }
                    *seq = (*seq).max(s);
                    apply(map, ops, within);
                    off += len;
                }
                Decoded::End => break,
                Decoded::Torn if last && cut_tail => {
                    tracing::info!(
                        path = %path.display(), offset = off, len = bytes.len(),
                        "metadata journal: cutting a torn tail (never acknowledged)"
                    );
                    let f = OpenOptions::new()
                        .write(true)
                        .open(&path)
                        .map_err(StoreError::at(&path))?;
                    f.set_len(off as u64).map_err(StoreError::at(&path))?;
                    f.sync_all().map_err(StoreError::at(&path))?;
                    break;
                }
                Decoded::Torn => {
                    return Err(corrupt(
                        &path,
                        off as u64,
                        "damaged record before the end of the last journal",
                    ))
                }
            }
        }
        pos = p + off as u64;
    }
    Ok((pos, cur_base))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    #[test]
    fn put_delete_prefix_and_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let j = MetaJournal::open(dir.path(), COMPACT_MIN).unwrap();
            j.commit(vec![
                MetaOp::put(k("a/1"), k("x")),
                MetaOp::put(k("a/2"), k("y")),
            ])
            .unwrap();
            j.commit(vec![MetaOp::put(k("b/1"), k("z"))]).unwrap();
            j.commit(vec![MetaOp::delete_prefix(k("a/"))]).unwrap();
            assert_eq!(j.scan(b"a/").unwrap(), vec![]);
            // a no-op writes nothing
            let before = j.position();
            j.commit(vec![MetaOp::delete(k("nope"))]).unwrap();
            assert_eq!(j.position(), before);
            j.commit(vec![MetaOp::put(k("a/3"), k("w"))]).unwrap();
        }
        let j = MetaJournal::open(dir.path(), COMPACT_MIN).unwrap();
        assert_eq!(j.get(b"b/1").unwrap(), Some(k("z")));
        assert_eq!(j.scan(b"a/").unwrap(), vec![(k("a/3"), k("w"))]);
        assert_eq!(j.position().1, 4);
    }

    #[test]
    fn torn_tail_is_cut_and_appends_continue() {
        let dir = tempfile::tempdir().unwrap();
        {
            let j = MetaJournal::open(dir.path(), COMPACT_MIN).unwrap();
            j.commit(vec![MetaOp::put(k("q1"), k("1"))]).unwrap();
            j.commit(vec![MetaOp::put(k("q2"), k("2"))]).unwrap();
        }
        let path = dir.path().join(journal_name(0));
        let len = std::fs::metadata(&path).unwrap().len();
        // every cut inside the second record loses exactly that record
        let full = std::fs::read(&path).unwrap();
        let first_len = 8 + u32::from_le_bytes(full[..4].try_into().unwrap()) as u64;
        for cut in first_len + 1..len {
            std::fs::write(&path, &full[..cut as usize]).unwrap();
            let j = MetaJournal::open(dir.path(), COMPACT_MIN).unwrap();
            assert_eq!(j.get(b"q1").unwrap(), Some(k("1")));
            assert_eq!(j.get(b"q2").unwrap(), None, "cut at {cut}");
            drop(j);
            assert_eq!(std::fs::metadata(&path).unwrap().len(), first_len);
        }
        // a flipped byte in the last record: the same
        let mut bad = full.clone();
        let n = bad.len();
        bad[n - 1] ^= 1;
        std::fs::write(&path, &bad).unwrap();
        let j = MetaJournal::open(dir.path(), COMPACT_MIN).unwrap();
        assert_eq!(j.get(b"q2").unwrap(), None);
        j.commit(vec![MetaOp::put(k("q3"), k("3"))]).unwrap();
        drop(j);
        let j = MetaJournal::open(dir.path(), COMPACT_MIN).unwrap();
        assert_eq!(j.get(b"q1").unwrap(), Some(k("1")));
        assert_eq!(j.get(b"q3").unwrap(), Some(k("3")));
    }

    #[test]
    fn compaction_keeps_state_and_survives_every_crash_point() {
        let dir = tempfile::tempdir().unwrap();
        let j = MetaJournal::open(dir.path(), COMPACT_MIN).unwrap();
        for i in 0..100 {
            j.commit(vec![MetaOp::put(k(&format!("k{i:03}")), vec![i as u8; 10])])
                .unwrap();
        }
        for i in 0..50 {
            j.commit(vec![MetaOp::delete(k(&format!("k{i:03}")))])
                .unwrap();
        }
        let before_compact: Vec<_> = j.scan(b"").unwrap();
        let old_journal = std::fs::read(dir.path().join(journal_name(0))).unwrap();
        j.compact().unwrap();
        let (pos, _) = j.position();
        j.commit(vec![MetaOp::put(k("after"), k("1"))]).unwrap();
        drop(j);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.contains(&snapshot_name(pos)), "{names:?}");
        assert!(!names.contains(&journal_name(0)), "{names:?}");
        let j = MetaJournal::open(dir.path(), COMPACT_MIN).unwrap();
        assert_eq!(j.len().unwrap(), 51);
        assert_eq!(j.get(b"after").unwrap(), Some(k("1")));
        drop(j);

        // crash after the snapshot's rename, before the new journal existed: the old
        // journal is still there and must be ignored, the snapshot wins
        std::fs::remove_file(dir.path().join(journal_name(pos))).unwrap();
        std::fs::write(dir.path().join(journal_name(0)), &old_journal).unwrap();
        let j = MetaJournal::open(dir.path(), COMPACT_MIN).unwrap();
        assert_eq!(j.scan(b"").unwrap(), before_compact);
        drop(j);
        assert!(!dir.path().join(journal_name(0)).exists());

        // crash before the rename: only a temp file, the old generation is complete
        let dir2 = tempfile::tempdir().unwrap();
        std::fs::write(dir2.path().join(journal_name(0)), &old_journal).unwrap();
        std::fs::write(
            dir2.path().join(format!("{}.tmp", snapshot_name(pos))),
            b"half",
        )
        .unwrap();
        let j = MetaJournal::open(dir2.path(), COMPACT_MIN).unwrap();
        assert_eq!(j.scan(b"").unwrap(), before_compact);
    }

    #[test]
    fn background_compactions_while_appending_keep_every_change() {
        let dir = tempfile::tempdir().unwrap();
        let j = Arc::new(MetaJournal::open(dir.path(), 4096).unwrap());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let j = j.clone();
                std::thread::spawn(move || {
                    for i in 0..500 {
                        j.commit(vec![MetaOp::put(k(&format!("t{t}/{i:04}")), vec![7; 40])])
                            .unwrap();
                        if i % 3 == 0 {
                            j.commit(vec![MetaOp::delete(k(&format!("t{t}/{:04}", i / 2)))])
                                .unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let want = j.scan(b"").unwrap();
        drop(j);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.iter().any(|n| n.starts_with("snapshot-")),
            "{names:?}"
        );
        assert!(names.len() <= 3, "old generations left behind: {names:?}");
        let j = MetaJournal::open(dir.path(), 4096).unwrap();
        assert_eq!(j.scan(b"").unwrap(), want);
    }

    #[test]
    fn a_crash_between_rotation_and_snapshot_replays_both_journals() {
        let dir = tempfile::tempdir().unwrap();
        let j = MetaJournal::open(dir.path(), COMPACT_MIN).unwrap();
        j.commit(vec![MetaOp::put(k("a"), k("1"))]).unwrap();
        // the switch to a new file, then a "crash" before the snapshot is written
        let job = {
            let mut st = j.shared.lock();
            j.shared.rotate(&mut st).unwrap().unwrap()
        };
        j.commit(vec![MetaOp::put(k("b"), k("2"))]).unwrap();
        drop(j);
        assert!(!dir.path().join(snapshot_name(job.to)).exists());
        let j = MetaJournal::open(dir.path(), COMPACT_MIN).unwrap();
        assert_eq!(j.get(b"a").unwrap(), Some(k("1")));
        assert_eq!(j.get(b"b").unwrap(), Some(k("2")));
        // and the next compaction merges them
        j.compact().unwrap();
        j.commit(vec![MetaOp::put(k("c"), k("3"))]).unwrap();
        drop(j);
        let j = MetaJournal::open(dir.path(), COMPACT_MIN).unwrap();
        assert_eq!(j.len().unwrap(), 3);
    }

    #[test]
    fn group_commit_from_many_threads() {
        let dir = tempfile::tempdir().unwrap();
        let j = Arc::new(MetaJournal::open(dir.path(), COMPACT_MIN).unwrap());
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let j = j.clone();
                std::thread::spawn(move || {
                    for i in 0..50 {
                        j.commit(vec![MetaOp::put(k(&format!("t{t}/{i}")), k("v"))])
                            .unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(j.len().unwrap(), 400);
        drop(j);
        assert_eq!(
            MetaJournal::open(dir.path(), COMPACT_MIN)
                .unwrap()
                .len()
                .unwrap(),
            400
        );
    }

    #[test]
    fn released_state_is_read_back_from_the_files() {
        let dir = tempfile::tempdir().unwrap();
        let j = MetaJournal::open(dir.path(), 2048).unwrap();
        for i in 0..200 {
            j.commit(vec![MetaOp::put(k(&format!("a/{i:03}")), vec![1; 20])])
                .unwrap();
            j.commit(vec![MetaOp::put(k(&format!("b/{i:03}")), vec![2; 20])])
                .unwrap();
        }
        j.commit(vec![MetaOp::delete_prefix(k("a/1"))]).unwrap();
        let want_a = j.scan(b"a/").unwrap();
        let want_all = j.scan(b"").unwrap();
        assert_eq!(want_a.len(), 100);
        j.release_state();
        assert!(j.shared.lock().map.is_none());
        // the same answers from the snapshot and journals, compactions included
        assert_eq!(j.scan(b"a/").unwrap(), want_a);
        assert_eq!(j.scan(b"").unwrap(), want_all);
        // changes after the release: puts, deletes, a prefix shorter than the scan's
        j.commit(vec![MetaOp::put(k("a/new"), k("n"))]).unwrap();
        j.commit(vec![MetaOp::delete(k("b/000"))]).unwrap();
        assert_eq!(j.get(b"a/new").unwrap(), Some(k("n")));
        assert_eq!(j.get(b"b/000").unwrap(), None);
        assert_eq!(j.scan(b"b/").unwrap().len(), 199);
        j.commit(vec![MetaOp::delete_prefix(k("b"))]).unwrap();
        assert!(j.scan(b"b/").unwrap().is_empty());
        let mut seen = 0;
        j.visit(b"a/", &mut |key, _| {
            assert!(key.starts_with(b"a/"));
            seen += 1;
        })
        .unwrap();
        assert_eq!(seen, 101);
        // with no state to compare with, a no-op is written (and replays as one)
        let before = j.position();
        j.commit(vec![MetaOp::delete(k("nope"))]).unwrap();
        assert!(j.position().0 > before.0);
        // many more changes: compactions run from the files alone
        for i in 0..300 {
            j.commit(vec![MetaOp::put(k(&format!("c/{i:03}")), vec![3; 30])])
                .unwrap();
        }
        let want = j.scan(b"").unwrap();
        assert_eq!(want.len(), 101 + 300);
        drop(j);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.iter().any(|n| n.starts_with("snapshot-")),
            "{names:?}"
        );
        let j = MetaJournal::open(dir.path(), 2048).unwrap();
        assert_eq!(j.scan(b"").unwrap(), want);
    }

    #[test]
    fn a_scan_restricted_to_a_prefix_applies_only_what_touches_it() {
        let mut map = Map::new();
        let ops = vec![
            MetaOp::put(k("a/1"), k("x")),
            MetaOp::put(k("b/1"), k("y")),
            MetaOp::put(k("a/2"), k("z")),
        ];
        apply(&mut map, ops, b"a/");
        assert_eq!(map.len(), 2);
        // a longer prefix removes some keys, a shorter one all of them, another none
        apply(&mut map, vec![MetaOp::delete_prefix(k("a/1"))], b"a/");
        assert_eq!(map.keys().collect::<Vec<_>>(), [&k("a/2")]);
        apply(&mut map, vec![MetaOp::delete_prefix(k("b"))], b"a/");
        assert_eq!(map.len(), 1);
        apply(&mut map, vec![MetaOp::delete_prefix(k("a"))], b"a/");
        assert!(map.is_empty());
    }

    #[test]
    fn key_builder_parts_round_trip_and_prefixes_are_exact() {
        let a = KeyBuilder::new(b'B').part(b"/").part(b"q1").build();
        let b = KeyBuilder::new(b'B').part(b"/").part(b"q10").build();
        let p = KeyBuilder::new(b'B').part(b"/").part(b"q1").build();
        assert!(a.starts_with(&p));
        assert!(!b.starts_with(&p));
        assert_eq!(key_parts(&a[1..]).unwrap(), vec![b"/".as_slice(), b"q1"]);
        assert!(key_parts(&a[1..a.len() - 1]).is_none());
    }
}

//! ConsumeQueue: one per queue, files of fixed 20-byte entries addressed by logical
//! queue offset. CONTRACT STUB: replaced by the real implementation.
//!
//! Layout: `<dir>/<20-digit first logical offset>`, each file `entries_per_file * 20`
//! bytes, preallocated (`file::open_preallocated`) and memory-mapped. An entry is
//! little-endian `u64 commit_offset, u32 size, u64 tag_hash`; an all-zero entry (size 0)
//! is "not written". Entry N lives in file `N / entries_per_file * entries_per_file` at
//! byte `(N % entries_per_file) * 20`, so reading entry N is O(1).
//!
//! Concurrency: writers (`put`, `truncate_*`, `delete_files_below`) are serialised by the
//! caller (the store's writer lock); readers (`get`, `next_offset`, `min_offset`) run on
//! any thread at the same time and must see only fully written entries (publish
//! `next_offset` with Release after the bytes are in place, read it with Acquire).

use std::path::Path;

use crate::error::Result;

/// Size of one entry on disk.
pub const CQ_ENTRY_SIZE: u64 = 20;

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

/// A queue's consume queue.
pub struct ConsumeQueue {}

#[allow(unused_variables)]
impl ConsumeQueue {
    /// Opens (creating `dir` if missing) the queue's files; `next_offset` becomes one past
    /// the last written (non-zero) entry of the last file, `min_offset` the first file's start.
    pub fn open(dir: &Path, entries_per_file: u64) -> Result<ConsumeQueue> {
        unimplemented!()
    }
    /// Writes `entry` at `logical`. `logical == next_offset` appends; below overwrites (replay
    /// after a crash); above leaves a gap of unwritten entries (also only in recovery).
    /// Creates and preallocates files as needed. `next_offset` becomes max(next, logical + 1).
    pub fn put(&self, logical: u64, entry: CqEntry) -> Result<()> {
        unimplemented!()
    }
    /// The entry at `logical`, or `None` when it is outside `min_offset..next_offset`,
    /// its file was deleted, or it is unwritten (size 0).
    pub fn get(&self, logical: u64) -> Option<CqEntry> {
        unimplemented!()
    }
    /// One past the highest written entry.
    pub fn next_offset(&self) -> u64 {
        unimplemented!()
    }
    /// The first logical offset still held (start of the oldest remaining file).
    pub fn min_offset(&self) -> u64 {
        unimplemented!()
    }
    /// Discards entries at `logical` and above (zeroes them, deletes files wholly above).
    pub fn truncate_from(&self, logical: u64) -> Result<()> {
        unimplemented!()
    }
    /// Discards every entry whose `commit_offset >= commit_offset` (recovery after the
    /// commitlog tail was cut). Entries are in increasing commit-offset order.
    pub fn truncate_commit_from(&self, commit_offset: u64) -> Result<()> {
        unimplemented!()
    }
    /// Deletes files all of whose entries are below `logical`, never the file holding
    /// `next_offset`; returns how many were deleted. `min_offset` moves up accordingly.
    pub fn delete_files_below(&self, logical: u64) -> Result<usize> {
        unimplemented!()
    }
    /// Makes everything written so far durable (msync of the dirty files).
    pub fn flush(&self) -> Result<()> {
        unimplemented!()
    }
    /// Deletes the queue's directory and all its files.
    pub fn destroy(self) -> Result<()> {
        unimplemented!()
    }
}

//! IndexFile: an on-disk hash index from message key to commitlog offsets.
//! CONTRACT STUB: replaced by the real implementation.
//!
//! RocketMQ's layout: a header (magic, version, begin/end store timestamp, begin/end
//! commitlog offset, slot count, entry count), a slot table (u32 per slot: index of the
//! newest entry whose key hashes there, 0 = empty), then fixed 20-byte entries (u32 key
//! hash, u64 commitlog offset, u32 seconds since the file's begin timestamp, u32 index of
//! the previous entry in the same slot). Files are named `<dir>/<20-digit created ms>`,
//! bounded by `max_entries`; a full file is sealed and a new one started.

use std::path::{Path, PathBuf};

use crate::error::Result;

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
pub struct IndexService {}

#[allow(unused_variables)]
impl IndexService {
    /// Opens `dir` (creating it), loading existing files; a damaged header or chain is
    /// tolerated (bounded, never a panic): lookups stop at an invalid link.
    pub fn open(dir: &Path, cfg: IndexConfig) -> Result<IndexService> {
        unimplemented!()
    }
    /// Adds `key -> commit_offset`, stored at `store_ts_ms`.
    pub fn put(&self, key: &[u8], commit_offset: u64, store_ts_ms: u64) -> Result<()> {
        unimplemented!()
    }
    /// Candidate commitlog offsets for `key` stored within `begin_ts_ms..=end_ts_ms`, newest
    /// first, without duplicates, at most `max`. Hash collisions are possible: the caller
    /// verifies the key against the record.
    pub fn lookup(&self, key: &[u8], max: usize, begin_ts_ms: u64, end_ts_ms: u64) -> Result<Vec<u64>> {
        unimplemented!()
    }
    /// Makes everything written so far durable.
    pub fn flush(&self) -> Result<()> {
        unimplemented!()
    }
    /// Deletes sealed files whose `end_offset < commit_offset`; returns how many.
    pub fn delete_files_below(&self, commit_offset: u64) -> Result<usize> {
        unimplemented!()
    }
    /// What each file covers, oldest first.
    pub fn files(&self) -> Vec<IndexFileInfo> {
        unimplemented!()
    }
}

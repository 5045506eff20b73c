//! The store's error type.

use std::io;
use std::path::{Path, PathBuf};

/// Everything the store can fail with.
///
/// Callers handle `Invalid`, `NotFound`, `TooLarge`, `DiskFull` and `Corrupt` (a single
/// unreadable record); `Fatal` means the store can no longer promise durability (a failed
/// `fsync`, an I/O error under a mapping) and the broker must stop.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("data directory {0} is in use by another broker (its lock file is held)")]
    Locked(PathBuf),
    #[error("corrupt data in {path} at offset {offset}: {reason}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("no space left for {path}: {source}")]
    DiskFull {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("store stopped after a fatal error: {0}")]
    Fatal(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("record of {size} bytes is larger than the limit of {max} bytes")]
    TooLarge { size: u64, max: u64 },
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// Replication (`replication.mode = sync`): fewer than `min_insync` replicas are in
    /// sync, so the record cannot be confirmed (it may still be kept).
    #[error("not enough replicas in sync: {0}")]
    NotEnoughReplicas(String),
}

impl StoreError {
    /// Wraps an I/O error with the path it happened on; `ENOSPC` becomes `DiskFull`.
    pub fn io(path: &Path, source: io::Error) -> StoreError {
        if source.raw_os_error() == Some(libc::ENOSPC) {
            StoreError::DiskFull {
                path: path.to_path_buf(),
                source,
            }
        } else {
            StoreError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    }

    /// A closure for `map_err` that wraps an I/O error with `path`.
    pub fn at(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
        move |e| StoreError::io(path, e)
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

//! Small file-system helpers shared by the store's files: the data directory's lock,
//! preallocation, durable directory entries and fixed-width names.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::error::{Result, StoreError};

/// Creates the data directory `dir` and takes its lock (`lock`, flock): one broker or
/// follower per directory. The lock holds while the returned file is open.
pub fn lock_dir(dir: &Path) -> Result<File> {
    std::fs::create_dir_all(dir).map_err(StoreError::at(dir))?;
    let lock_path = dir.join("lock");
    let lock_file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(StoreError::at(&lock_path))?;
    match lock_file.try_lock() {
        Ok(()) => Ok(lock_file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::Locked(dir.to_path_buf())),
        Err(std::fs::TryLockError::Error(e)) => Err(StoreError::io(&lock_path, e)),
    }
}

/// Opens (creating if missing) `path` read-write and makes sure `len` bytes are really
/// allocated on disk (`fallocate`), so that a write through a mapping of it can never
/// hit a full disk (which would be a SIGBUS, not an error).
pub fn open_preallocated(path: &Path, len: u64) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(StoreError::at(path))?;
    let cur = file.metadata().map_err(StoreError::at(path))?.len();
    if cur < len {
        preallocate(&file, len).map_err(StoreError::at(path))?;
    }
    Ok(file)
}

fn preallocate(file: &File, len: u64) -> std::io::Result<()> {
    let len_off = libc::off_t::try_from(len)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "file too large"))?;
    // SAFETY: plain syscall on an fd we own; no memory is passed.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len_off) };
    match rc {
        0 => Ok(()),
        // Filesystems without fallocate support: fall back to extending the file.
        libc::EOPNOTSUPP | libc::EINVAL => file.set_len(len),
        err => Err(std::io::Error::from_raw_os_error(err)),
    }
}

/// `fsync`s a directory so that entries created, renamed or removed in it are durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(StoreError::at(dir))
}

/// Name of a file that starts at `offset`: 20 decimal digits, zero padded (RocketMQ).
pub fn offset_name(offset: u64) -> String {
    format!("{offset:020}")
}

/// Parses a 20-digit offset file name; `None` for anything else (temp files etc.).
pub fn parse_offset_name(name: &str) -> Option<u64> {
    if name.len() == 20 && name.bytes().all(|b| b.is_ascii_digit()) {
        name.parse().ok()
    } else {
        None
    }
}

/// Writes `bytes` to `path` atomically and durably: temp file, fsync, rename, dir fsync.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let dir = path
        .parent()
        .ok_or_else(|| StoreError::Invalid(format!("{} has no parent", path.display())))?;
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    {
        let mut f = File::create(&tmp).map_err(StoreError::at(&tmp))?;
        f.write_all(bytes).map_err(StoreError::at(&tmp))?;
        f.sync_all().map_err(StoreError::at(&tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(StoreError::at(path))?;
    sync_dir(dir)
}

/// Gives memory freed by a large drop back to the system. glibc's `free` returns only
/// the top of the heap; a big structure freed below later allocations (the metadata
/// state replayed at start, below the topology built from it) would otherwise stay
/// resident. `malloc_trim` releases the free pages wherever they are.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offset_names_round_trip() {
        assert_eq!(offset_name(1024), "00000000000000001024");
        assert_eq!(parse_offset_name(&offset_name(u64::MAX)), Some(u64::MAX));
        assert_eq!(parse_offset_name("0000000000000000102"), None);
        assert_eq!(parse_offset_name("0000000000000000102x"), None);
    }

    #[test]
    fn preallocates_and_writes_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("seg");
        let f = open_preallocated(&p, 4096).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 4096);
        let m = dir.path().join("meta.json");
        write_atomic(&m, b"{}").unwrap();
        write_atomic(&m, b"{\"a\":1}").unwrap();
        assert_eq!(std::fs::read(&m).unwrap(), b"{\"a\":1}");
        assert!(!dir.path().join("meta.json.tmp").exists());
    }
}

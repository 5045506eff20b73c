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

/// The parts of `path`'s `from..to` that may hold data, as `SEEK_DATA`/`SEEK_HOLE` tell:
/// what lies outside them reads as zeros (holes, and on ext4 and xfs preallocated extents
/// never written whose pages are not cached either). Where the filesystem cannot tell, or
/// the file cannot be opened, the whole range. Recovery reads only these to find stale
/// bytes past the log's end: faulting in a preallocated segment's untouched gigabyte only
/// to compare zeros cost about 3 s of a restart (the kernel zeroing each page).
pub fn data_ranges(path: &Path, from: u64, to: u64) -> Vec<(u64, u64)> {
    if from >= to {
        return Vec::new();
    }
    let Ok(file) = File::open(path) else {
        return vec![(from, to)];
    };
    let fd = file.as_raw_fd();
    let seek = |at: u64, whence: libc::c_int| -> std::result::Result<u64, i32> {
        let at = libc::off_t::try_from(at).map_err(|_| libc::EINVAL)?;
        // SAFETY: plain syscall on an fd we own; no memory is passed.
        let r = unsafe { libc::lseek(fd, at, whence) };
        u64::try_from(r).map_err(|_| std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    };
    let mut out = Vec::new();
    let mut at = from;
    while at < to {
        let data = match seek(at, libc::SEEK_DATA) {
            Ok(d) => d,
            // no data at or past `at`
            Err(libc::ENXIO) => break,
            Err(_) => {
                out.push((at, to));
                break;
            }
        };
        if data >= to {
            break;
        }
        let hole = seek(data, libc::SEEK_HOLE).map_or(to, |h| h.clamp(data + 1, to));
        out.push((data, hole));
        at = hole;
    }
    out
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
    fn data_ranges_cover_every_written_byte() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("seg");
        let len = 64 << 20;
        let f = open_preallocated(&p, len).unwrap();
        for at in [4096 * 3 + 17, 40 << 20, len - 1] {
            f.write_at(&[1], at).unwrap();
        }
        let ranges = data_ranges(&p, 4096, len);
        for at in [4096 * 3 + 17, 40 << 20, len - 1] {
            assert!(
                ranges.iter().any(|(a, b)| (*a..*b).contains(&at)),
                "{at} not in {ranges:?}"
            );
        }
        assert!(ranges.iter().all(|(a, b)| 4096 <= *a && a < b && *b <= len));
        // on filesystems that tell (ext4, xfs, tmpfs, btrfs), far less than the whole
        let covered: u64 = ranges.iter().map(|(a, b)| b - a).sum();
        eprintln!("data ranges cover {covered} of {} bytes", len - 4096);
        assert!(data_ranges(&p, 10, 10).is_empty());
    }

    /// The log is written through a shared mapping: bytes written that way, flushed or
    /// still only in the page cache (after a kill -9), are data too.
    #[test]
    fn data_ranges_cover_bytes_written_through_a_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("seg");
        let len: u64 = 64 << 20;
        let f = open_preallocated(&p, len).unwrap();
        // SAFETY: a private test file nobody else maps or truncates.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&f).unwrap() };
        let dirty = [5 * 4096 + 1, 20 << 20, (len - 3) as usize];
        let flushed = [9 * 4096, 33 << 20];
        for at in flushed {
            map[at] = 0xAB;
        }
        map.flush().unwrap();
        for at in dirty {
            map[at] = 0xCD;
        }
        let ranges = data_ranges(&p, 4096, len);
        for at in dirty.iter().chain(&flushed).map(|a| *a as u64) {
            assert!(
                ranges.iter().any(|(a, b)| (*a..*b).contains(&at)),
                "{at} not in {ranges:?}"
            );
        }
        let covered: u64 = ranges.iter().map(|(a, b)| b - a).sum();
        eprintln!("data ranges cover {covered} of {} bytes", len - 4096);
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

//! The resource monitor: raises the memory alarm while the broker's resident memory is
//! above the high-water mark and the disk alarm while the data directory's file system
//! is short of free space (RabbitMQ's `vm_memory_high_watermark` and `disk_free_limit`).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use triad_core::Alarms;

/// Checks memory and disk against their limits.
#[derive(Debug, Clone)]
pub struct ResourceMonitor {
    data_dir: PathBuf,
    memory_limit: Option<u64>,
    disk_free_limit: u64,
}

impl ResourceMonitor {
    /// `memory_fraction` of the machine's RAM; `disk_free_limit` bytes free.
    pub fn new(data_dir: &Path, memory_fraction: f64, disk_free_limit: u64) -> ResourceMonitor {
        let memory_limit = total_memory().map(|t| (t as f64 * memory_fraction) as u64);
        ResourceMonitor {
            data_dir: data_dir.to_path_buf(),
            memory_limit,
            disk_free_limit,
        }
    }

    /// The alarms as things stand now (an unreadable figure raises nothing).
    pub fn check(&self) -> Alarms {
        Alarms {
            memory: match (self.memory_limit, resident_memory()) {
                (Some(limit), Some(rss)) => rss > limit,
                _ => false,
            },
            disk: free_disk(&self.data_dir).is_some_and(|free| free < self.disk_free_limit),
        }
    }
}

impl ResourceMonitor {
    /// [`ResourceMonitor::check`], plus the store's own report of a write refused for want
    /// of space: segments are preallocated whole, so the store can be out of room while the
    /// file system still has more than `disk_free_limit` free. The disk alarm then stays
    /// raised (publishers blocked, not refused) until a whole segment fits above the limit
    /// again; the store's next write tries anew.
    pub fn check_with_store(&self, store: &triad_store::store::Store) -> Alarms {
        let mut alarms = self.check();
        if store.disk_full() {
            let needed = store.segment_size().saturating_add(self.disk_free_limit);
            if free_disk(&self.data_dir).is_some_and(|free| free >= needed) {
                store.clear_disk_full();
                tracing::info!("store: enough disk space for a new segment again");
            } else {
                alarms.disk = true;
            }
        }
        alarms
    }
}

fn total_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// This process's anonymous resident memory in bytes (`RssAnon`): the heap and stacks.
/// Pages of the mapped store files are left out: they are page cache the kernel can
/// drop, not memory the broker holds on to.
pub fn resident_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with("RssAnon:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Bytes available to unprivileged users on the file system holding `dir`.
pub fn free_disk(dir: &Path) -> Option<u64> {
    let c = CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a valid NUL-terminated path and `st` a writable statvfs.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return None;
    }
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_machine() {
        assert!(resident_memory().is_some_and(|r| r > 0));
        assert!(free_disk(Path::new(".")).is_some());
        let lax = ResourceMonitor::new(Path::new("."), 1.0, 0);
        assert_eq!(lax.check(), Alarms::default());
        // a limit of everything on the disk and a sliver of RAM raise both alarms
        let strict = ResourceMonitor::new(Path::new("."), 1e-9, u64::MAX);
        assert_eq!(
            strict.check(),
            Alarms {
                memory: true,
                disk: true
            }
        );
    }
}

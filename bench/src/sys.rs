//! Process CPU time, block-device counters, file-system type, scratch directories.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// User and system CPU time of the whole process (every thread, the store's too).
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu {
    pub user: Duration,
    pub sys: Duration,
}

impl Cpu {
    pub fn now() -> Cpu {
        // SAFETY: getrusage only writes the struct it is given.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
        if rc != 0 {
            return Cpu::default();
        }
        let tv = |t: libc::timeval| {
            Duration::from_secs(t.tv_sec.max(0) as u64)
                + Duration::from_micros(t.tv_usec.max(0) as u64)
        };
        Cpu {
            user: tv(ru.ru_utime),
            sys: tv(ru.ru_stime),
        }
    }

    pub fn since(self, before: Cpu) -> Cpu {
        Cpu {
            user: self.user.saturating_sub(before.user),
            sys: self.sys.saturating_sub(before.sys),
        }
    }

    pub fn total(self) -> Duration {
        self.user + self.sys
    }
}

/// The 1-minute load average: other work on the machine skews every figure.
pub fn loadavg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The mount holding `path`: (device, mount point, file-system type).
pub fn mount_of(path: &Path) -> Option<(String, String, String)> {
    let canon = path.canonicalize().ok()?;
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    let mut best: Option<(String, String, String)> = None;
    for line in mounts.lines() {
        let mut it = line.split_whitespace();
        let (Some(dev), Some(mp), Some(fs)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        let mp = mp.replace("\\040", " ");
        if canon.starts_with(&mp) && best.as_ref().is_none_or(|b| mp.len() >= b.1.len()) {
            best = Some((dev.to_string(), mp, fs.to_string()));
        }
    }
    best
}

/// Counters from `/sys/class/block/<dev>/stat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevStat {
    pub writes: u64,
    pub sectors_written: u64,
    /// Flush requests completed (kernels >= 5.5); what each fdatasync/msync costs the disk.
    pub flushes: u64,
}

impl DevStat {
    pub fn parse(s: &str) -> Option<DevStat> {
        let f: Vec<u64> = s
            .split_whitespace()
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        Some(DevStat {
            writes: *f.get(4)?,
            sectors_written: *f.get(6)?,
            flushes: f.get(15).copied().unwrap_or(0),
        })
    }

    pub fn since(self, before: DevStat) -> DevStat {
        DevStat {
            writes: self.writes.saturating_sub(before.writes),
            sectors_written: self.sectors_written.saturating_sub(before.sectors_written),
            flushes: self.flushes.saturating_sub(before.flushes),
        }
    }
}

/// Reads the counters of the block device behind `dev` ("/dev/vda"), if it is one.
pub fn dev_stat(dev: &str) -> Option<DevStat> {
    let name = dev.strip_prefix("/dev/")?;
    let s = std::fs::read_to_string(format!("/sys/class/block/{name}/stat")).ok()?;
    DevStat::parse(&s)
}

/// Where the benchmark writes: a fresh directory under a parent, removed on drop unless kept.
pub struct Scratch {
    pub path: PathBuf,
    pub dev: Option<String>,
    pub fs: String,
    keep: bool,
}

impl Scratch {
    pub fn create(
        parent: &Path,
        prefix: &str,
        allow_tmpfs: bool,
        keep: bool,
    ) -> Result<Scratch, String> {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        let path = parent.join(format!("{prefix}-{}", std::process::id()));
        if path.exists() {
            return Err(format!("{} exists already", path.display()));
        }
        let (dev, _mp, fs) = mount_of(parent).unwrap_or_default();
        if matches!(fs.as_str(), "tmpfs" | "ramfs") && !allow_tmpfs {
            return Err(format!(
                "{} is on {fs}, not a disk; use --dir on a real disk (or --allow-tmpfs)",
                parent.display()
            ));
        }
        std::fs::create_dir(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Scratch {
            path,
            dev: dev.starts_with("/dev/").then_some(dev),
            fs,
            keep,
        })
    }

    pub fn dev_stat(&self) -> Option<DevStat> {
        self.dev.as_deref().and_then(dev_stat)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_block_stat() {
        let s =
            "   26091     3815  2552978    75711   669439    35738 10271912   101984        1    \
                 69816   213909   116984      119  5212232    15857   235770    20355\n";
        let d = DevStat::parse(s).unwrap();
        assert_eq!(d.writes, 669439);
        assert_eq!(d.sectors_written, 10271912);
        assert_eq!(d.flushes, 235770);
        let old = "1 2 3 4 5 6 7 8 9 10 11";
        assert_eq!(DevStat::parse(old).unwrap().flushes, 0);
        assert!(DevStat::parse("1 2 x").is_none());
    }

    #[test]
    fn cpu_moves_forward() {
        let a = Cpu::now();
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(Cpu::now().since(a).total() < Duration::from_secs(60));
    }
}

//! `triad-bench disk`: what the machine can do without the store.
//!
//! - `dd`: sequential bandwidth, `dd if=/dev/zero of=F bs=1M count=N oflag=direct
//!   conv=fdatasync` (the real `dd`; its output is parsed).
//! - `overwrite`: a loop of `pwrite(size)` + `fdatasync` at increasing offsets of a file
//!   whose blocks were written beforehand: each iteration is one durable write and no
//!   metadata changes, the best case for one synchronous writer.
//! - `fallocated`: the same loop on a `posix_fallocate`d file, as commitlog segments are
//!   made: on ext4 the first write to each block also converts an unwritten extent, so
//!   `fdatasync` commits the journal too.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::args::{DiskArgs, DiskTest};
use crate::report::{latency_json, new_histogram, round};
use crate::store_bench::pattern;
use crate::sys::{loadavg, Cpu, DevStat, Scratch};

/// Parses dd's summary line, `N bytes (...) copied, S s, R MB/s`: (bytes, seconds).
pub fn parse_dd(stderr: &str) -> Option<(u64, f64)> {
    let line = stderr.lines().rev().find(|l| l.contains(" copied, "))?;
    let bytes: u64 = line.split_whitespace().next()?.parse().ok()?;
    let after = line.split(" copied, ").nth(1)?;
    let secs: f64 = after.split_whitespace().next()?.parse().ok()?;
    Some((bytes, secs))
}

fn dev_json(before: Option<DevStat>, after: Option<DevStat>) -> Value {
    match (before, after) {
        (Some(a), Some(b)) => {
            let d = b.since(a);
            json!({
                "flushes": d.flushes,
                "writes": d.writes,
                "write_mb": round(d.sectors_written as f64 * 512.0 / 1e6, 1),
            })
        }
        _ => Value::Null,
    }
}

fn dd(scratch: &Scratch, mib: u64) -> Result<Value, String> {
    let path = scratch.path.join("dd.bin");
    let load = loadavg();
    let dev0 = scratch.dev_stat();
    let t0 = Instant::now();
    let out = Command::new("dd")
        .env("LC_ALL", "C")
        .arg("if=/dev/zero")
        .arg(format!("of={}", path.display()))
        .arg("bs=1M")
        .arg(format!("count={mib}"))
        .arg("oflag=direct")
        .arg("conv=fdatasync")
        .output()
        .map_err(|e| format!("running dd: {e}"))?;
    let wall = t0.elapsed().as_secs_f64();
    let dev = dev_json(dev0, scratch.dev_stat());
    let _ = std::fs::remove_file(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("dd failed: {}", stderr.trim()));
    }
    let (bytes, secs) = parse_dd(&stderr).unwrap_or((mib << 20, wall));
    Ok(json!({
        "bench": "dd",
        "size": 1u64 << 20,
        "ops": bytes >> 20,
        "seconds": round(secs, 3),
        "ops_per_s": round((bytes >> 20) as f64 / secs, 0),
        "mb_per_s": round(bytes as f64 / secs / 1e6, 1),
        "lat_us": Value::Null,
        "dev": dev,
        "fs": scratch.fs,
        "loadavg_at_start": load,
        "command": format!("dd if=/dev/zero of=F bs=1M count={mib} oflag=direct conv=fdatasync"),
    }))
}

fn prepare(path: &Path, len: u64, written: bool) -> Result<File, String> {
    let err = |e: std::io::Error| format!("{}: {e}", path.display());
    let f = File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(err)?;
    if written {
        let chunk = vec![0u8; 1 << 20];
        let mut off = 0;
        while off < len {
            let n = chunk.len().min((len - off) as usize);
            f.write_all_at(&chunk[..n], off).map_err(err)?;
            off += n as u64;
        }
    } else {
        let len_off = libc::off_t::try_from(len).map_err(|_| "file too large".to_string())?;
        // SAFETY: plain syscall on an open descriptor.
        let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len_off) };
        if rc != 0 {
            return Err(format!(
                "posix_fallocate: {}",
                std::io::Error::from_raw_os_error(rc)
            ));
        }
    }
    f.sync_all().map_err(err)?;
    if let Some(dir) = path.parent() {
        File::open(dir).and_then(|d| d.sync_all()).map_err(err)?;
    }
    Ok(f)
}

fn fsync_loop(scratch: &Scratch, a: &DiskArgs, test: DiskTest) -> Result<Value, String> {
    let path = scratch.path.join(format!("{}.bin", test.name()));
    let len = a.file_mib << 20;
    let f = prepare(&path, len, test == DiskTest::Overwrite)?;
    let buf = pattern(a.size);
    let load = loadavg();
    let size = a.size as u64;
    let mut hist = new_histogram();
    let dev0 = scratch.dev_stat();
    let cpu0 = Cpu::now();
    let t0 = Instant::now();
    let mut next_tick = t0 + Duration::from_secs(1);
    let (mut ops, mut last_ops, mut off) = (0u64, 0u64, 0u64);
    let mut hit_end = false;
    loop {
        if a.count.is_some_and(|c| ops >= c) {
            break;
        }
        let now = Instant::now();
        if a.count.is_none() && now.duration_since(t0) >= a.duration {
            break;
        }
        if off + size > len {
            hit_end = true;
            break;
        }
        if now >= next_tick {
            if !a.quiet {
                eprintln!(
                    "[{:>4.0}s] {} {}: {} ops/s",
                    now.duration_since(t0).as_secs_f64(),
                    test.name(),
                    crate::report::fmt_size(size),
                    ops - last_ops
                );
            }
            last_ops = ops;
            next_tick += Duration::from_secs(1);
        }
        let t = Instant::now();
        f.write_all_at(&buf, off)
            .map_err(|e| format!("write: {e}"))?;
        f.sync_data().map_err(|e| format!("fdatasync: {e}"))?;
        hist.saturating_record(t.elapsed().as_nanos().max(1) as u64);
        off += size;
        ops += 1;
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = Cpu::now().since(cpu0);
    let dev = dev_json(dev0, scratch.dev_stat());
    drop(f);
    let _ = std::fs::remove_file(&path);
    Ok(json!({
        "bench": "fsync-loop",
        "variant": test.name(),
        "size": size,
        "ops": ops,
        "seconds": round(secs, 3),
        "ops_per_s": round(ops as f64 / secs, 0),
        "mb_per_s": round((ops * size) as f64 / secs / 1e6, 2),
        "lat_us": latency_json(&hist),
        "cpu_us_per_op": round(cpu.total().as_secs_f64() * 1e6 / ops.max(1) as f64, 2),
        "dev": dev,
        "fs": scratch.fs,
        "loadavg_at_start": load,
        "stopped_at_end_of_file": hit_end,
    }))
}

pub fn run(a: &DiskArgs) -> Result<Vec<Value>, String> {
    let scratch = Scratch::create(&a.dir, "bench-disk", a.allow_tmpfs, false)?;
    a.tests
        .iter()
        .map(|&t| match t {
            DiskTest::Dd => dd(&scratch, a.dd_mib),
            _ => fsync_loop(&scratch, a, t),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dd_output() {
        let s = "1024+0 records in\n1024+0 records out\n\
                 1073741824 bytes (1.1 GB, 1.0 GiB) copied, 2.34567 s, 458 MB/s\n";
        assert_eq!(parse_dd(s), Some((1073741824, 2.34567)));
        let one = "1+0 records in\n1+0 records out\n1048576 bytes (1.0 MB, 1.0 MiB) copied, 0.0101 s, 104 MB/s";
        assert_eq!(parse_dd(one), Some((1048576, 0.0101)));
        assert_eq!(parse_dd("dd: error"), None);
    }
}

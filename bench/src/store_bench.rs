//! `triad-bench store`: writer threads appending through `triad-store`, each waiting for
//! its append to be durable before the next one; with `--fleet N`, the consume-queue
//! layer alone at N queues (what a queue costs idle and with a few messages).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Barrier};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hdrhistogram::Histogram;
use serde_json::{json, Value};
use triad_store::flush::FlushMode;
use triad_store::record::{NewMessage, FLAG_PERSISTENT};
use triad_store::store::{QueueId, Store, StoreConfig, StoreStats};

use crate::args::{Flush, StoreArgs};
use crate::report::{latency_json, new_histogram, round};
use crate::sys::{loadavg, Cpu, DevStat, Scratch};

/// Bytes 0..4 of a body: writer id, 4..12: the writer's sequence number (little endian);
/// then a fixed pattern. Bodies under 12 bytes are the pattern alone.
pub const HEADER: usize = 12;

pub fn pattern(size: usize) -> Vec<u8> {
    (0..size)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect()
}

pub fn stamp(body: &mut [u8], writer: u32, seq: u64) {
    if let Some(h) = body.get_mut(..HEADER) {
        h[..4].copy_from_slice(&writer.to_le_bytes());
        h[4..].copy_from_slice(&seq.to_le_bytes());
    }
}

/// Checks a body read back: the pattern, and for bodies with a header, that each writer's
/// messages arrive in order with no gap (`next[w]` is the writer's next sequence number).
pub fn verify(body: &[u8], pat: &[u8], next: &mut [u64]) -> Result<(), String> {
    if body.len() != pat.len() {
        return Err(format!(
            "body of {} bytes, expected {}",
            body.len(),
            pat.len()
        ));
    }
    if body.len() < HEADER {
        return if body == pat {
            Ok(())
        } else {
            Err("body differs".into())
        };
    }
    let mut w = [0u8; 4];
    w.copy_from_slice(&body[..4]);
    let mut s = [0u8; 8];
    s.copy_from_slice(&body[4..HEADER]);
    let (w, s) = (u32::from_le_bytes(w) as usize, u64::from_le_bytes(s));
    let Some(expect) = next.get_mut(w) else {
        return Err(format!("unknown writer {w}"));
    };
    if s != *expect {
        return Err(format!("writer {w}: sequence {s}, expected {expect}"));
    }
    *expect += 1;
    if body[HEADER..] != pat[HEADER..] {
        return Err(format!("writer {w} seq {s}: body differs"));
    }
    Ok(())
}

#[repr(align(128))]
#[derive(Default)]
struct Padded(AtomicU64);

struct Done {
    writer: usize,
    result: Result<Histogram<u64>, String>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What a writer does besides appending (`--consume`, `--slow-every`).
#[derive(Clone, Copy)]
struct Consume {
    ack: bool,
    /// The slow queue and how often it gets a message.
    slow: Option<(QueueId, u64)>,
}

#[allow(clippy::too_many_arguments)]
fn writer(
    store: &Store,
    id: usize,
    queue: QueueId,
    size: usize,
    quota: Option<u64>,
    stop: &AtomicBool,
    progress: &AtomicU64,
    start: &Barrier,
    consume: Consume,
) -> Result<Histogram<u64>, String> {
    let mut hist = new_histogram();
    let mut body = pattern(size);
    let only = [queue];
    let with_slow = consume.slow.map(|(s, _)| [queue, s]);
    start.wait();
    let mut seq = 0u64;
    while quota.is_none_or(|q| seq < q) && !stop.load(Ordering::Relaxed) {
        stamp(&mut body, id as u32, seq);
        let queues: &[QueueId] = match (consume.slow, &with_slow) {
            (Some((_, every)), Some(both)) if seq.is_multiple_of(every) => both,
            _ => &only,
        };
        let msg = NewMessage {
            queues,
            flags: FLAG_PERSISTENT,
            born_ts_ms: now_ms(),
            tag_hash: 0,
            keys: &[],
            properties: &[],
            body: &body,
        };
        let t0 = Instant::now();
        let app = store.append(&msg).map_err(|e| format!("append: {e}"))?;
        app.durable.wait().map_err(|e| format!("durable: {e}"))?;
        if consume.ack {
            let off = app.queue_offsets.first().map_or(0, |(_, o)| *o);
            drop(store.ack(queue, &[off]).map_err(|e| format!("ack: {e}"))?);
        }
        let ns = t0.elapsed().as_nanos().max(1) as u64;
        hist.saturating_record(ns);
        seq += 1;
        progress.store(seq, Ordering::Relaxed);
    }
    Ok(hist)
}

/// Bytes of the commitlog's segment files.
fn log_on_disk(store: &Store) -> u64 {
    store
        .segment_paths()
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}

fn read_back(store: &Store, queues: &[QueueId], a: &StoreArgs) -> Result<Value, String> {
    let pat = pattern(a.size);
    let t0 = Instant::now();
    let results: Vec<Result<(u64, u64), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = queues
            .iter()
            .map(|&q| {
                let pat = &pat;
                s.spawn(move || -> Result<(u64, u64), String> {
                    let mut next = vec![0u64; a.writers];
                    let mut n = 0u64;
                    let mut bytes = 0u64;
                    loop {
                        match store
                            .read_queue(q, n)
                            .map_err(|e| format!("read_queue({q}, {n}): {e}"))?
                        {
                            Some((_, rec)) => {
                                verify(&rec.body, pat, &mut next)
                                    .map_err(|e| format!("queue {q} entry {n}: {e}"))?;
                                bytes += rec.body.len() as u64;
                                n += 1;
                            }
                            None => return Ok((n, bytes)),
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("reader panicked".into())))
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    let mut ops = 0;
    let mut bytes = 0;
    for r in results {
        let (n, b) = r?;
        ops += n;
        bytes += b;
    }
    Ok(json!({
        "ops": ops,
        "seconds": round(secs, 3),
        "ops_per_s": round(ops as f64 / secs, 0),
        "mb_per_s": round(bytes as f64 / secs / 1e6, 1),
        "verified": ops,
        "source": "page cache (just written)",
    }))
}

pub fn run(a: &StoreArgs) -> Result<Value, String> {
    if let Some(n) = a.fleet {
        return fleet::run(a, n);
    }
    let load = loadavg();
    let scratch = Scratch::create(&a.dir, "bench-data", a.allow_tmpfs, a.keep)?;
    let store = open_store(a, &scratch)?;
    let (queues, slow) = create_queues(a, &store)?;
    let consume = Consume {
        ack: a.consume,
        slow,
    };
    // the log's size on disk once a second (with --consume)
    let mut disk_samples: Vec<u64> = Vec::new();
    let run = run_writers(a, &store, &queues, consume, &scratch, &mut disk_samples)?;
    let ops = run.hist.len();
    let stats = store.stats();
    let on_disk = log_on_disk(&store);
    let slow_live: Option<u64> = slow.map(|(q, _)| {
        store
            .unacked(q, usize::MAX)
            .unwrap_or_default()
            .iter()
            .filter_map(|o| store.entry(q, *o))
            .map(|e| u64::from(e.size))
            .sum()
    });
    let read = if a.read {
        Some(read_back(&store, &queues, a)?)
    } else {
        None
    };
    if let Some(r) = &read {
        if r["ops"].as_u64() != Some(ops) {
            return Err(format!("read back {} messages, wrote {ops}", r["ops"]));
        }
    }
    let read = read.map(|mut r| {
        r["ok"] = json!(true);
        r
    });
    store.close().map_err(|e| format!("close: {e}"))?;

    let report = Report {
        run,
        stats,
        on_disk,
        disk_samples,
        slow_live,
        load,
        read,
    };
    Ok(report.json(a, &scratch))
}

/// Opens the store the writers append to, configured from the arguments.
fn open_store(a: &StoreArgs, scratch: &Scratch) -> Result<Store, String> {
    let mut cfg = StoreConfig::new(&scratch.path);
    cfg.segment_size = a.segment_size;
    if let Some(n) = a.small_queue_entries {
        cfg.small_queue_entries = n;
    }
    if let Some(n) = a.cq_entries_per_file {
        cfg.cq_entries_per_file = n;
    }
    cfg.flush = match a.flush {
        Flush::Sync => FlushMode::Sync,
        Flush::Async => FlushMode::async_default(),
    };
    if a.consume {
        cfg.retention_interval = Duration::from_secs(1);
    }
    Store::open(cfg).map_err(|e| format!("open store: {e}"))
}

/// `--slow-every`'s queue and how often it gets a message.
type SlowQueue = (QueueId, u64);

/// The writers' queues (`bench-N`) and, with `--slow-every`, the slow queue.
fn create_queues(
    a: &StoreArgs,
    store: &Store,
) -> Result<(Vec<QueueId>, Option<SlowQueue>), String> {
    let queues: Vec<QueueId> = (0..a.queues)
        .map(|i| store.create_queue("/", &format!("bench-{i}"), true))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("create queue: {e}"))?;
    let slow = match a.slow_every {
        Some(every) => Some((
            store
                .create_queue("/", "bench-slow", true)
                .map_err(|e| format!("create queue: {e}"))?,
            every,
        )),
        None => None,
    };
    Ok((queues, slow))
}

/// What the writers did: the merged latency histogram, the wall time, CPU and device
/// counters over the run.
struct WritersRun {
    hist: Histogram<u64>,
    secs: f64,
    cpu: Cpu,
    dev: Option<DevStat>,
}

/// Runs the writer threads to their quota or the time cap, printing progress each
/// second (and sampling the log on disk with `--consume`).
fn run_writers(
    a: &StoreArgs,
    store: &Store,
    queues: &[QueueId],
    consume: Consume,
    scratch: &Scratch,
    disk_samples: &mut Vec<u64>,
) -> Result<WritersRun, String> {
    let stop = AtomicBool::new(false);
    let progress: Vec<Padded> = (0..a.writers).map(|_| Padded::default()).collect();
    let barrier = Barrier::new(a.writers + 1);
    let quotas: Vec<Option<u64>> = (0..a.writers as u64)
        .map(|i| {
            a.count
                .map(|c| c / a.writers as u64 + u64::from(i < c % a.writers as u64))
        })
        .collect();

    let (tx, rx) = mpsc::channel::<Done>();
    std::thread::scope(|s| -> Result<_, String> {
        for w in 0..a.writers {
            let tx = tx.clone();
            let (stop, barrier) = (&stop, &barrier);
            let prog = &progress[w].0;
            let q = queues[w % queues.len()];
            let quota = quotas[w];
            std::thread::Builder::new()
                .name(format!("writer-{w}"))
                .spawn_scoped(s, move || {
                    let result = writer(store, w, q, a.size, quota, stop, prog, barrier, consume);
                    if result.is_err() {
                        stop.store(true, Ordering::Relaxed);
                    }
                    let _ = tx.send(Done { writer: w, result });
                })
                .map_err(|e| format!("spawn: {e}"))?;
        }
        drop(tx);
        let dev0 = scratch.dev_stat();
        let cpu0 = Cpu::now();
        barrier.wait();
        let t0 = Instant::now();
        let hist = collect_writers(a, store, &rx, &progress, &stop, t0, disk_samples)?;
        let secs = t0.elapsed().as_secs_f64();
        let cpu = Cpu::now().since(cpu0);
        let dev = match (dev0, scratch.dev_stat()) {
            (Some(a), Some(b)) => Some(b.since(a)),
            _ => None,
        };
        Ok(WritersRun {
            hist,
            secs,
            cpu,
            dev,
        })
    })
}

/// Waits for the writers, stopping them at the time cap and printing progress each
/// second; returns their merged histogram, or the first writer's error.
fn collect_writers(
    a: &StoreArgs,
    store: &Store,
    rx: &mpsc::Receiver<Done>,
    progress: &[Padded],
    stop: &AtomicBool,
    t0: Instant,
    disk_samples: &mut Vec<u64>,
) -> Result<Histogram<u64>, String> {
    let cap = a.time_cap();
    let mut merged = new_histogram();
    let mut finished = 0;
    let mut first_err = None;
    let mut last = (t0, 0u64);
    let mut next_tick = t0 + Duration::from_secs(1);
    while finished < a.writers {
        let now = Instant::now();
        if let Some(c) = cap {
            if now >= t0 + c {
                stop.store(true, Ordering::Relaxed);
            }
        }
        let mut wake = next_tick;
        if let Some(c) = cap {
            if !stop.load(Ordering::Relaxed) {
                wake = wake.min(t0 + c);
            }
        }
        match rx.recv_timeout(wake.saturating_duration_since(now)) {
            Ok(d) => {
                finished += 1;
                match d.result {
                    Ok(h) => merged.add(&h).map_err(|e| format!("merge: {e}"))?,
                    Err(e) => {
                        first_err.get_or_insert(format!("writer {}: {e}", d.writer));
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        let now = Instant::now();
        if now >= next_tick {
            let total: u64 = progress.iter().map(|p| p.0.load(Ordering::Relaxed)).sum();
            let dt = now.duration_since(last.0).as_secs_f64();
            let rate = (total - last.1) as f64 / dt;
            if !a.quiet {
                eprintln!(
                    "[{:>4.0}s] {:>10.0} appends/s {:>9.1} MB/s  total {}",
                    now.duration_since(t0).as_secs_f64(),
                    rate,
                    rate * a.size as f64 / 1e6,
                    total
                );
            }
            last = (now, total);
            next_tick += Duration::from_secs(1);
            if a.consume {
                disk_samples.push(log_on_disk(store));
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(merged)
}

/// What the run's JSON report is made of, besides the arguments.
struct Report {
    run: WritersRun,
    stats: StoreStats,
    on_disk: u64,
    disk_samples: Vec<u64>,
    slow_live: Option<u64>,
    load: Option<f64>,
    read: Option<Value>,
}

impl Report {
    /// The run's JSON report.
    fn json(self, a: &StoreArgs, scratch: &Scratch) -> Value {
        let Report {
            run:
                WritersRun {
                    hist,
                    secs,
                    cpu,
                    dev,
                },
            stats,
            on_disk,
            disk_samples,
            slow_live,
            load,
            read,
        } = self;
        let ops = hist.len();
        let size = a.size as u64;
        json!({
            "bench": "store",
            "flush": a.flush.name(),
            "size": size,
            "writers": a.writers,
            "queues": a.queues,
            "ops": ops,
            "seconds": round(secs, 3),
            "ops_per_s": round(ops as f64 / secs, 0),
            "mb_per_s": round((ops * size) as f64 / secs / 1e6, 2),
            "lat_us": latency_json(&hist),
            "cpu_us_per_op": round(cpu.total().as_secs_f64() * 1e6 / ops.max(1) as f64, 2),
            "cpu_user_s": round(cpu.user.as_secs_f64(), 3),
            "cpu_sys_s": round(cpu.sys.as_secs_f64(), 3),
            "commitlog_written": stats.commitlog_end,
            "commitlog_on_disk": on_disk,
            "commitlog_on_disk_max": disk_samples.iter().max(),
            "commitlog_on_disk_samples": disk_samples.len(),
            "segments": stats.segments,
            "compactions": stats.compactions,
            "pass_waits": stats.pass_waits,
            "pass_wait_timeouts": stats.pass_wait_timeouts,
            "consume": a.consume,
            "slow_every": a.slow_every,
            "slow_live_bytes": slow_live,
            "dev": dev.map(|d| json!({
                "flushes": d.flushes,
                "writes": d.writes,
                "write_mb": round(d.sectors_written as f64 * 512.0 / 1e6, 1),
            })),
            "fs": scratch.fs,
            "loadavg_at_start": load,
            "segment_size": a.segment_size,
            "small_queue_entries": a.small_queue_entries.unwrap_or(64),
            "cq_entries_per_file": a.cq_entries_per_file.unwrap_or(300_000),
            "read": read,
        })
    }
}

mod fleet {
    //! `--fleet N`: N consume queues as the store opens them (`ConsumeQueue::open_small`
    //! with the shared index, or `ConsumeQueue::open` with per-queue files when
    //! `--small-queue-entries 0`), without the rest of the store, so the figures are the
    //! consume-queue layer's own: the store's queue registry and ack state come on top.

    use std::path::{Path, PathBuf};
    use std::sync::Arc;
    use std::time::Instant;

    use serde_json::{json, Value};
    use triad_store::consumequeue::{ConsumeQueue, CqEntry, SmallConfig};
    use triad_store::smallcq::SharedIndex;

    use crate::args::StoreArgs;
    use crate::report::round;
    use crate::sys::{loadavg, Cpu, Scratch};

    /// What the process holds at one moment.
    struct Snap {
        rss_anon: u64,
        maps: u64,
        fds: u64,
        disk: u64,
    }

    fn status_kib(key: &str) -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix(key))
                    .and_then(|v| v.split_whitespace().next()?.parse().ok())
            })
            .unwrap_or(0)
    }

    /// Bytes allocated on disk under `p`, directories' own blocks included.
    fn disk_bytes(p: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        let own = std::fs::symlink_metadata(p).map_or(0, |m| m.blocks() * 512);
        let Ok(rd) = std::fs::read_dir(p) else {
            return own;
        };
        own + rd
            .flatten()
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() => disk_bytes(&e.path()),
                _ => e.metadata().map_or(0, |m| m.blocks() * 512),
            })
            .sum::<u64>()
    }

    fn snap(dir: &Path) -> Snap {
        let count = |p: &str| std::fs::read_dir(p).map_or(0, |d| d.count() as u64);
        Snap {
            rss_anon: status_kib("RssAnon:") * 1024,
            maps: std::fs::read_to_string("/proc/self/maps")
                .map_or(0, |m| m.lines().count() as u64),
            fds: count("/proc/self/fd"),
            disk: disk_bytes(dir),
        }
    }

    fn per(delta: i128, n: u64) -> f64 {
        round(delta as f64 / n.max(1) as f64, 1)
    }

    fn costs(before: &Snap, after: &Snap, n: u64) -> Value {
        let d = |a: u64, b: u64| i128::from(b) - i128::from(a);
        json!({
            "rss_anon_bytes_per_queue": per(d(before.rss_anon, after.rss_anon), n),
            "disk_bytes_per_queue": per(d(before.disk, after.disk), n),
            "mappings_per_queue": per(d(before.maps, after.maps), n),
            "fds_per_queue": per(d(before.fds, after.fds), n),
            "rss_anon_mib": round(after.rss_anon as f64 / 1048576.0, 1),
            "disk_mib": round(after.disk as f64 / 1048576.0, 1),
            "mappings": after.maps,
            "fds": after.fds,
        })
    }

    fn rate(ops: u64, t0: Instant, cpu0: Cpu) -> Value {
        let secs = t0.elapsed().as_secs_f64();
        let cpu = Cpu::now().since(cpu0);
        json!({
            "ops": ops,
            "seconds": round(secs, 3),
            "ops_per_s": round(ops as f64 / secs.max(1e-9), 0),
            "cpu_us_per_op": round(cpu.total().as_secs_f64() * 1e6 / ops.max(1) as f64, 2),
        })
    }

    /// Refuses runs whose preallocated files would take more than half the free space
    /// (the disk is shared).
    fn check_space(dir: &Path, bytes: u64) -> Result<(), String> {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: statvfs writes only the struct it is given; `c` is NUL-terminated.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
            return Ok(());
        }
        let free = st.f_bavail as u64 * st.f_frsize as u64;
        if bytes > free / 2 {
            return Err(format!(
                "this run would preallocate about {} MiB of consume-queue files, over half \
                 the {} MiB free; lower --fleet or --cq-entries-per-file",
                bytes >> 20,
                free >> 20
            ));
        }
        Ok(())
    }

    fn entry(commit_offset: u64) -> CqEntry {
        CqEntry {
            commit_offset,
            size: 100,
            tag_hash: 0,
        }
    }

    /// The queues of a fleet run: where they live and how they are opened.
    struct Fleet {
        root: PathBuf,
        shared: Option<Arc<SharedIndex>>,
        per_file: u64,
        small: u64,
        quiet: bool,
    }

    impl Fleet {
        fn open(&self, i: u64) -> Result<ConsumeQueue, String> {
            let dir = self.root.join(format!("dev-{i}"));
            let r = match &self.shared {
                Some(sh) => ConsumeQueue::open_small(
                    &dir,
                    self.per_file,
                    SmallConfig {
                        shared: Some(Arc::clone(sh)),
                        id: u32::try_from(i).map_err(|_| "too many queues")?,
                        max: self.small,
                    },
                    &[],
                    0,
                ),
                None => ConsumeQueue::open(&dir, self.per_file),
            };
            r.map_err(|e| format!("queue {i}: {e}"))
        }

        fn progress(&self, what: &str, i: u64) {
            if !self.quiet && i > 0 && i.is_multiple_of(20_000) {
                eprintln!("  {what}: {i}");
            }
        }

        /// Creates `n` queues (stopping at the first failure, noted in `failed`).
        fn create(&self, n: u64, failed: &mut Option<String>) -> Vec<ConsumeQueue> {
            let mut queues = Vec::with_capacity(n as usize);
            for i in 0..n {
                match self.open(i) {
                    Ok(q) => queues.push(q),
                    Err(e) => {
                        *failed = Some(format!("create: {e}"));
                        break;
                    }
                }
                self.progress("created", i);
            }
            queues
        }

        /// `per_queue` entries in every queue, round robin (a fan-out of one message per
        /// round to every queue); returns how many were put.
        fn put_rounds(
            &self,
            queues: &[ConsumeQueue],
            per_queue: u64,
            failed: &mut Option<String>,
        ) -> u64 {
            let mut puts = 0u64;
            'rounds: for m in 0..per_queue {
                for (i, q) in queues.iter().enumerate() {
                    if failed.is_some() {
                        break 'rounds;
                    }
                    if let Err(e) = q.put(m, entry(puts * 100)) {
                        *failed = Some(format!("put {m} into queue {i} after {puts} puts: {e}"));
                        break 'rounds;
                    }
                    puts += 1;
                    self.progress("put", puts);
                }
            }
            puts
        }

        /// The checkpoint's flush: the shared index, then every queue.
        fn flush(&self, queues: &[ConsumeQueue], failed: &mut Option<String>) {
            let mut flush_err = None;
            if let Some(sh) = &self.shared {
                flush_err = sh.flush().err();
            }
            for q in queues {
                if let Err(e) = q.flush() {
                    flush_err.get_or_insert(e);
                }
            }
            if let Some(e) = flush_err {
                failed.get_or_insert(format!("flush: {e}"));
            }
        }

        /// One busy queue (queue `n` or `n + 1`): with a consumer that keeps up (entries
        /// acked as they are appended) and without one (the queue grows: own files in
        /// both designs).
        fn busy(&self, n: u64, entries: u64) -> Result<serde_json::Map<String, Value>, String> {
            let mut busy = serde_json::Map::new();
            for (name, consumed) in [("kept_up", true), ("backlog", false)] {
                let q = self.open(n + u64::from(!consumed))?;
                let (t0, cpu0) = (Instant::now(), Cpu::now());
                for l in 0..entries {
                    q.put(l, entry(l * 100))
                        .map_err(|e| format!("busy put {l}: {e}"))?;
                    if consumed {
                        q.trim_below(l + 1);
                    }
                }
                let mut r = rate(entries, t0, cpu0);
                r["own_files"] = json!(q.has_own_files());
                busy.insert(name.into(), r);
            }
            Ok(busy)
        }
    }

    pub fn run(a: &StoreArgs, n: u64) -> Result<Value, String> {
        let load = loadavg();
        let small = a.small_queue_entries.unwrap_or(64);
        let per_file = a.cq_entries_per_file.unwrap_or(300_000);
        if small == 0 {
            check_space(&a.dir, n.saturating_mul(per_file).saturating_mul(20))?;
        }
        let scratch = Scratch::create(&a.dir, "bench-fleet", a.allow_tmpfs, a.keep)?;
        let root = scratch.path.join("consumequeue").join("%2F");
        std::fs::create_dir_all(&root).map_err(|e| e.to_string())?;
        let shared = if small > 0 {
            let (ix, _) = SharedIndex::open(&scratch.path.join("sharedcq"), 32_768)
                .map_err(|e| format!("shared index: {e}"))?;
            Some(Arc::new(ix))
        } else {
            None
        };
        let fleet = Fleet {
            root,
            shared,
            per_file,
            small,
            quiet: a.quiet,
        };

        // 1. create: what an idle queue costs
        let s0 = snap(&scratch.path);
        let (t0, cpu0) = (Instant::now(), Cpu::now());
        let mut failed = None;
        let queues = fleet.create(n, &mut failed);
        let create = rate(queues.len() as u64, t0, cpu0);
        let s1 = snap(&scratch.path);

        // 2. --per-queue entries in every queue, then the checkpoint's flush
        let (t0, cpu0) = (Instant::now(), Cpu::now());
        let puts = fleet.put_rounds(&queues, a.per_queue, &mut failed);
        let put = rate(puts, t0, cpu0);
        let (t0, cpu0) = (Instant::now(), Cpu::now());
        fleet.flush(&queues, &mut failed);
        let flush = rate(1, t0, cpu0);
        let s2 = snap(&scratch.path);
        let held = queues.len() as u64;
        drop(queues);

        // 3. one busy queue, consumed and not
        let busy = if a.busy > 0 && failed.is_none() {
            fleet.busy(n, a.busy)?
        } else {
            serde_json::Map::new()
        };
        let out = json!({
            "bench": "store-fleet",
            "design": if small > 0 { "shared" } else { "files" },
            "small_queue_entries": small,
            "cq_entries_per_file": per_file,
            "queues": n,
            "queues_opened": held,
            "per_queue": a.per_queue,
            "failed": failed,
            "create": create,
            "idle": costs(&s0, &s1, held),
            "put": put,
            "flush": flush,
            "with_entries": costs(&s0, &s2, held),
            "busy": busy,
            "fs": scratch.fs,
            "loadavg_at_start": load,
        });
        if !a.quiet {
            // removing 100,000 directories can take minutes on a disk mounted with discard
            eprintln!("{out}");
            eprintln!("data directory {}", scratch.path.display());
        }
        drop(scratch);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamp_and_verify() {
        let pat = pattern(64);
        let mut next = vec![0u64; 2];
        let mut b = pat.clone();
        stamp(&mut b, 1, 0);
        verify(&b, &pat, &mut next).unwrap();
        stamp(&mut b, 1, 2);
        assert!(verify(&b, &pat, &mut next).is_err(), "gap");
        stamp(&mut b, 1, 1);
        verify(&b, &pat, &mut next).unwrap();
        b[40] ^= 1;
        stamp(&mut b, 0, 0);
        assert!(verify(&b, &pat, &mut next).is_err(), "flipped bit");
        stamp(&mut b, 5, 0);
        assert!(verify(&b, &pat, &mut next).is_err(), "unknown writer");
        let small = pattern(8);
        let mut sb = small.clone();
        stamp(&mut sb, 3, 3);
        assert_eq!(sb, small);
        verify(&sb, &small, &mut next).unwrap();
        assert!(verify(&small[..4], &small, &mut next).is_err());
    }

    #[test]
    fn small_run_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let a = StoreArgs {
            dir: dir.path().to_path_buf(),
            size: 100,
            writers: 3,
            queues: 2,
            count: Some(50),
            segment_size: 1 << 20,
            read: true,
            allow_tmpfs: true,
            quiet: true,
            flush: Flush::Async,
            ..StoreArgs::default()
        };
        let v = run(&a).unwrap();
        assert_eq!(v["ops"], 50);
        assert_eq!(v["read"]["ops"], 50);
        assert_eq!(v["read"]["ok"], true);
        assert!(
            std::fs::read_dir(dir.path()).unwrap().next().is_none(),
            "scratch removed"
        );
    }

    #[test]
    fn fleet_runs_both_designs() {
        for small in [64, 0] {
            let dir = tempfile::tempdir().unwrap();
            let a = StoreArgs {
                dir: dir.path().to_path_buf(),
                fleet: Some(50),
                per_queue: 2,
                busy: 100,
                small_queue_entries: Some(small),
                cq_entries_per_file: Some(64),
                allow_tmpfs: true,
                quiet: true,
                ..StoreArgs::default()
            };
            let v = run(&a).unwrap();
            assert_eq!(v["failed"], Value::Null, "{v}");
            assert_eq!(v["queues_opened"], 50);
            assert_eq!(v["put"]["ops"], 100);
            assert_eq!(v["busy"]["kept_up"]["own_files"], small == 0);
            assert_eq!(v["busy"]["backlog"]["own_files"], true);
            if small > 0 {
                let maps = v["with_entries"]["mappings_per_queue"].as_f64().unwrap();
                assert!(maps < 0.5, "{maps} mappings per small queue");
            }
        }
    }
}

//! What the broker benchmarks (`amqp`, `stomp`, `mqtt`) share: the message stamp, the
//! sequence checker, run-wide counters, pacing, the per-second progress line, the broker
//! probe (`/proc/PID/stat` CPU time, `/proc/PID/status` RSS) and the result line.
//!
//! Every body starts with a 16-byte stamp: producer id (u32 LE), sequence number (u32 LE,
//! from 0 per producer) and send time (u64 LE, nanoseconds since the run's clock epoch; the
//! producers and consumers are in this process, so receive − send is the latency). The rest
//! of the body is a fixed byte pattern; consumers check the length and the stamp.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::args::LoadArgs;
use crate::report::{latency_json, new_histogram, round};
use crate::sys::{loadavg, Cpu};

pub const STAMP: usize = 16;
/// Sequence numbers at or above this are taken as corrupt (it bounds the bitmap at 32 MiB
/// per stream; no bounded run publishes 2^28 messages from one producer).
const MAX_SEQ: u32 = 1 << 28;

fn epoch() -> Instant {
    static E: OnceLock<Instant> = OnceLock::new();
    *E.get_or_init(Instant::now)
}

/// `--slow-ms`: the threshold in ns (0: off) and the messages slower than that, as
/// (producer, send time, latency).
struct SlowLog {
    threshold_ns: u64,
    slow: Vec<(u32, u64, u64)>,
}
static SLOW: Mutex<SlowLog> = Mutex::new(SlowLog {
    threshold_ns: 0,
    slow: Vec::new(),
});
/// At most this many slow messages are kept.
const SLOW_MAX: usize = 1 << 20;

/// Turns on the slow-message log for this run (`--slow-ms`).
pub fn log_slow(ms: Option<u64>) {
    if let Some(ms) = ms {
        epoch();
        SLOW.lock().unwrap_or_else(|e| e.into_inner()).threshold_ns = ms.saturating_mul(1_000_000);
    }
}

fn note_slow(producer: u32, ts: u64, latency: u64) {
    let mut s = SLOW.lock().unwrap_or_else(|e| e.into_inner());
    if s.slow.len() < SLOW_MAX {
        s.slow.push((producer, ts, latency));
    }
}

/// Prints the slow-message log: per 5 ms window of send times, how many messages were
/// slower than `--slow-ms`, the slowest, and which producers sent them. The clock origin
/// is printed in CLOCK_MONOTONIC nanoseconds, the clock `perf record -k mono` stamps
/// samples with, so a window can be matched with what the broker was doing.
pub fn report_slow() {
    let s = SLOW.lock().unwrap_or_else(|e| e.into_inner());
    if s.threshold_ns == 0 {
        return;
    }
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let mono_now = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    eprintln!(
        "slow messages (> {} ms): {}{}; send times from CLOCK_MONOTONIC {} ns",
        s.threshold_ns / 1_000_000,
        s.slow.len(),
        if s.slow.len() == SLOW_MAX {
            " (log full)"
        } else {
            ""
        },
        mono_now.saturating_sub(now_ns())
    );
    let mut windows: std::collections::BTreeMap<u64, (u64, u64, Vec<u32>)> = Default::default();
    for &(p, sent, lat) in &s.slow {
        let w = windows.entry(sent / 5_000_000).or_default();
        w.0 += 1;
        w.1 = w.1.max(lat);
        if !w.2.contains(&p) {
            w.2.push(p);
        }
    }
    for (w, (n, max, mut ps)) in windows {
        ps.sort_unstable();
        eprintln!(
            "  sent at {:>6} ms: {n:>6} slow, max {:.1} ms, producers {ps:?}",
            w * 5,
            max as f64 / 1e6
        );
    }
}

/// Nanoseconds since the run's clock epoch.
pub fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// A body of `size` bytes (at least [`STAMP`]) with the pattern after the stamp.
pub fn body_template(size: usize) -> Vec<u8> {
    (0..size.max(STAMP))
        .map(|i| b'a' + (i % 26) as u8)
        .collect()
}

pub fn stamp(body: &mut [u8], producer: u32, seq: u32, ts: u64) {
    body[0..4].copy_from_slice(&producer.to_le_bytes());
    body[4..8].copy_from_slice(&seq.to_le_bytes());
    body[8..16].copy_from_slice(&ts.to_le_bytes());
}

pub fn unstamp(body: &[u8]) -> Option<(u32, u32, u64)> {
    if body.len() < STAMP {
        return None;
    }
    let u32_at = |i: usize| u32::from_le_bytes([body[i], body[i + 1], body[i + 2], body[i + 3]]);
    let mut ts = [0u8; 8];
    ts.copy_from_slice(&body[8..16]);
    Some((u32_at(0), u32_at(4), u64::from_le_bytes(ts)))
}

/// One producer's stream as seen by one consumer: which sequence numbers arrived (a
/// bitmap), the highest so far, and the counts.
#[derive(Clone, Debug, Default)]
pub struct Stream {
    seen: Vec<u64>,
    max: Option<u32>,
    pub received: u64,
    pub distinct: u64,
    pub duplicated: u64,
    pub out_of_order: u64,
}

impl Stream {
    pub fn record(&mut self, seq: u32) {
        self.received += 1;
        let (w, b) = ((seq / 64) as usize, seq % 64);
        if w >= self.seen.len() {
            self.seen.resize((w + 1).max(self.seen.len() * 2), 0);
        }
        if self.seen[w] & (1 << b) != 0 {
            self.duplicated += 1;
            return;
        }
        self.seen[w] |= 1 << b;
        self.distinct += 1;
        match self.max {
            Some(m) if seq < m => self.out_of_order += 1,
            _ => self.max = Some(seq),
        }
    }

    /// Folds another consumer's view of the same stream into this one (competing consumers
    /// on one queue): a message both saw is a duplicate; reordering stays per consumer.
    pub fn merge(&mut self, o: &Stream) {
        if o.seen.len() > self.seen.len() {
            self.seen.resize(o.seen.len(), 0);
        }
        let mut overlap = 0u64;
        for (a, b) in self.seen.iter_mut().zip(&o.seen) {
            overlap += u64::from((*a & b).count_ones());
            *a |= b;
        }
        self.received += o.received;
        self.distinct = self.distinct + o.distinct - overlap;
        self.duplicated += o.duplicated + overlap;
        self.out_of_order += o.out_of_order;
        self.max = self.max.max(o.max);
    }

    /// Sequence numbers below `sent` that never arrived.
    pub fn lost(&self, sent: u64) -> u64 {
        let mut have = 0u64;
        let full = (sent / 64) as usize;
        for w in self.seen.iter().take(full) {
            have += u64::from(w.count_ones());
        }
        let rem = sent % 64;
        if rem > 0 {
            if let Some(w) = self.seen.get(full) {
                have += u64::from((w & ((1u64 << rem) - 1)).count_ones());
            }
        }
        sent - have
    }

    /// Arrived with a sequence number the producer never reported sending.
    pub fn unexpected(&self, sent: u64) -> u64 {
        self.distinct - (sent - self.lost(sent))
    }
}

/// What one consumer saw: a stream per producer, latency, bytes, bad bodies.
pub struct Checker {
    pub streams: Vec<Stream>,
    pub hist: Histogram<u64>,
    pub corrupt: u64,
    pub bytes: u64,
    pub last: Option<Instant>,
    size: usize,
    /// `--slow-ms` in ns (`u64::MAX`: off).
    slow_ns: u64,
}

impl Checker {
    pub fn new(producers: usize, size: usize) -> Checker {
        Checker {
            streams: vec![Stream::default(); producers],
            hist: new_histogram(),
            corrupt: 0,
            bytes: 0,
            last: None,
            size: size.max(STAMP),
            slow_ns: match SLOW.lock().unwrap_or_else(|e| e.into_inner()).threshold_ns {
                0 => u64::MAX,
                ns => ns,
            },
        }
    }

    /// Checks one received body; false if it is not one of ours.
    pub fn check(&mut self, body: &[u8]) -> bool {
        self.bytes += body.len() as u64;
        self.last = Some(Instant::now());
        let Some((p, seq, ts)) = unstamp(body).filter(|_| body.len() == self.size) else {
            self.corrupt += 1;
            return false;
        };
        let Some(s) = self.streams.get_mut(p as usize).filter(|_| seq < MAX_SEQ) else {
            self.corrupt += 1;
            return false;
        };
        s.record(seq);
        let latency = now_ns().saturating_sub(ts).max(1);
        self.hist.saturating_record(latency);
        if latency > self.slow_ns {
            note_slow(p, ts, latency);
        }
        true
    }
}

/// Counts over all groups. A group is what must receive every message of its producers
/// exactly once: a queue (its consumers compete) or an MQTT subscriber.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub expected: u64,
    pub received: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub out_of_order: u64,
    pub unexpected: u64,
}

/// `checkers[i]` belongs to `group_of[i]`; `sent[p]` is what producer p sent and
/// `feeds(g, p)` says whether producer p's messages should reach group g.
pub fn tally(
    checkers: &[&Checker],
    group_of: &[usize],
    groups: usize,
    sent: &[u64],
    feeds: impl Fn(usize, usize) -> bool,
) -> Tally {
    let mut t = Tally::default();
    for g in 0..groups {
        for (p, &n) in sent.iter().enumerate() {
            let mut merged = Stream::default();
            for (c, _) in checkers.iter().zip(group_of).filter(|(_, &cg)| cg == g) {
                if let Some(s) = c.streams.get(p) {
                    merged.merge(s);
                }
            }
            t.received += merged.received;
            t.duplicated += merged.duplicated;
            t.out_of_order += merged.out_of_order;
            if feeds(g, p) {
                t.expected += n;
                t.lost += merged.lost(n);
                t.unexpected += merged.unexpected(n);
            } else {
                t.unexpected += merged.distinct;
            }
        }
    }
    t
}

/// Run-wide counters the progress line reads.
#[derive(Default)]
pub struct Counters {
    pub sent: AtomicU64,
    pub received: AtomicU64,
    pub confirmed: AtomicU64,
}

/// Paces one producer at `rate` msgs/s (None: as fast as it can).
pub struct Pacer {
    start: Instant,
    interval: Option<Duration>,
}

impl Pacer {
    pub fn new(rate: Option<f64>) -> Pacer {
        Pacer {
            start: Instant::now(),
            interval: rate.map(|r| Duration::from_secs_f64(1.0 / r)),
        }
    }

    /// How long to wait before sending message number `n` (0-based), if at all.
    pub fn wait(&self, n: u64) -> Option<Duration> {
        let due = self.start + self.interval? * u32::try_from(n).unwrap_or(u32::MAX);
        let now = Instant::now();
        (due > now).then(|| due - now)
    }
}

/// Messages per producer: `count` split evenly, or unbounded.
pub fn quotas(count: Option<u64>, producers: usize) -> Vec<Option<u64>> {
    let n = producers.max(1) as u64;
    (0..n)
        .map(|i| count.map(|c| c / n + u64::from(i < c % n)))
        .collect()
}

/// CPU time (all threads) and resident memory of the broker process.
#[derive(Clone, Copy, Debug)]
pub struct ProcSample {
    /// utime + stime.
    pub cpu: Duration,
    /// stime alone (the kernel's share: syscalls, TCP, page faults).
    pub sys: Duration,
    pub rss_kib: u64,
}

pub fn proc_sample(pid: u32) -> Option<ProcSample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // the command name is in parentheses and may hold spaces: split after the last ')'
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // fields 14 and 15 of stat(5) are utime and stime; rest starts at field 3
    let sys_ticks: u64 = f.get(12)?.parse().ok()?;
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + sys_ticks;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let cpu = Duration::from_nanos(ticks * 1_000_000_000 / hz);
    Some(ProcSample {
        cpu,
        sys: Duration::from_nanos(sys_ticks * 1_000_000_000 / hz),
        rss_kib: rss_kib(pid)?,
    })
}

pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vmrss(&status)
}

fn parse_vmrss(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Samples the broker at the start, once a second (peak RSS) and at the end. With several
/// processes (a replica group's nodes), their CPU times and RSS are summed.
pub struct BrokerProbe {
    pids: Vec<u32>,
    first: Vec<ProcSample>,
    peak_rss: u64,
}

impl BrokerProbe {
    pub fn start(pids: &[u32]) -> Result<Option<BrokerProbe>, String> {
        if pids.is_empty() {
            return Ok(None);
        }
        let first = pids
            .iter()
            .map(|&p| proc_sample(p).ok_or_else(|| format!("cannot read /proc/{p}/stat")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(BrokerProbe {
            pids: pids.to_vec(),
            peak_rss: first.iter().map(|s| s.rss_kib).sum(),
            first,
        }))
    }

    pub fn tick(&mut self) {
        let rss: Option<u64> = self.pids.iter().map(|&p| rss_kib(p)).sum();
        if let Some(r) = rss {
            self.peak_rss = self.peak_rss.max(r);
        }
    }

    /// The JSON summary, with CPU time per `msgs` messages; with several processes, also
    /// each one's CPU time (`cpu_s_each`, in `pids` order).
    pub fn finish(mut self, msgs: u64) -> Value {
        self.tick();
        let last: Option<Vec<ProcSample>> = self.pids.iter().map(|&p| proc_sample(p)).collect();
        let pid_field = if self.pids.len() == 1 {
            json!(self.pids[0])
        } else {
            Value::Null
        };
        let Some(last) = last else {
            return json!({"pid": pid_field, "pids": self.pids, "error": "broker gone"});
        };
        let each: Vec<f64> = last
            .iter()
            .zip(&self.first)
            .map(|(l, f)| l.cpu.saturating_sub(f.cpu).as_secs_f64())
            .collect();
        let cpu: f64 = each.iter().sum();
        json!({
            "pid": pid_field,
            "pids": self.pids,
            "cpu_s": round(cpu, 3),
            "cpu_s_each": (self.pids.len() > 1)
                .then(|| each.iter().map(|c| round(*c, 3)).collect::<Vec<_>>()),
            "cpu_us_per_msg": (msgs > 0).then(|| round(cpu * 1e6 / msgs as f64, 2)),
            "rss_kib_before": self.first.iter().map(|s| s.rss_kib).sum::<u64>(),
            "rss_kib_after": last.iter().map(|s| s.rss_kib).sum::<u64>(),
            "rss_kib_peak": self.peak_rss,
        })
    }
}

/// A multi-threaded tokio runtime for the clients.
pub fn runtime(threads: usize) -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))
}

/// Prints `[  3s] sent 12,345/s recv 12,300/s ...` once a second on stderr until told to
/// stop; samples the broker's RSS on each tick.
pub async fn progress(
    c: Arc<Counters>,
    quiet: bool,
    stop: CancellationToken,
    probe: Arc<std::sync::Mutex<Option<BrokerProbe>>>,
) {
    let t0 = Instant::now();
    let mut last = (t0, 0u64, 0u64);
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + Duration::from_secs(1),
        Duration::from_secs(1),
    );
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if let Ok(mut p) = probe.lock() {
            if let Some(p) = p.as_mut() {
                p.tick();
            }
        }
        let now = Instant::now();
        let s = c.sent.load(Ordering::Relaxed);
        let r = c.received.load(Ordering::Relaxed);
        let dt = now.duration_since(last.0).as_secs_f64();
        if !quiet {
            eprintln!(
                "[{:>4.0}s] sent {:>9.0}/s recv {:>9.0}/s  total sent {} recv {} confirmed {}",
                now.duration_since(t0).as_secs_f64(),
                (s - last.1) as f64 / dt,
                (r - last.2) as f64 / dt,
                s,
                r,
                c.confirmed.load(Ordering::Relaxed),
            );
        }
        last = (now, s, r);
    }
}

/// A producer task's result: messages sent (stamped and written), and the error that
/// ended it early, if one did.
pub type ProducerResult = (u64, Option<String>);
/// A consumer task's result: what it saw, and the error that ended it early, if one did.
pub type ConsumerResult = (Checker, Option<String>);

/// Runs the measured part: progress line, broker probe, client CPU time, waiting for the
/// producers and then for the consumers to drain.
pub struct Harness {
    pub counters: Arc<Counters>,
    /// Cancelled when the consumers should stop (drained or given up).
    pub stop: CancellationToken,
    probe: Arc<std::sync::Mutex<Option<BrokerProbe>>>,
    progress_stop: CancellationToken,
    progress: tokio::task::JoinHandle<()>,
    t0: Instant,
    cpu0: Cpu,
}

/// What [`Harness::finish`] measured.
pub struct Finished {
    pub sent: Vec<u64>,
    pub checkers: Vec<Checker>,
    pub errors: Vec<String>,
    pub send_seconds: f64,
    pub seconds: f64,
    pub broker: Option<Value>,
    pub client_cpu: Cpu,
    pub drained: bool,
}

impl Harness {
    /// Call after every connection is set up, right before the producers start.
    pub fn start(a: &LoadArgs) -> Result<Harness, String> {
        let probe = Arc::new(std::sync::Mutex::new(BrokerProbe::start(&a.broker_pid)?));
        let counters = Arc::new(Counters::default());
        let progress_stop = CancellationToken::new();
        let progress = tokio::spawn(progress(
            counters.clone(),
            a.quiet,
            progress_stop.clone(),
            probe.clone(),
        ));
        Ok(Harness {
            counters,
            stop: CancellationToken::new(),
            probe,
            progress_stop,
            progress,
            t0: Instant::now(),
            cpu0: Cpu::now(),
        })
    }

    /// The publishing deadline.
    pub fn deadline(&self, a: &LoadArgs) -> Option<Instant> {
        a.time_cap().map(|d| self.t0 + d)
    }

    pub async fn finish(
        self,
        a: &LoadArgs,
        producers: Vec<tokio::task::JoinHandle<ProducerResult>>,
        consumers: Vec<tokio::task::JoinHandle<ConsumerResult>>,
        expected: impl Fn(&[u64]) -> u64,
    ) -> Finished {
        let mut errors = Vec::new();
        let mut sent = Vec::new();
        for (i, h) in producers.into_iter().enumerate() {
            match h.await {
                Ok((n, e)) => {
                    sent.push(n);
                    if let Some(e) = e {
                        errors.push(format!("producer {i}: {e}"));
                    }
                }
                Err(e) => {
                    sent.push(0);
                    errors.push(format!("producer {i}: {e}"));
                }
            }
        }
        let send_seconds = self.t0.elapsed().as_secs_f64();
        let want = expected(&sent);
        let mut last = (Instant::now(), u64::MAX);
        let hard_cap = Instant::now() + a.drain_timeout.max(Duration::from_secs(60));
        let drained = loop {
            let r = self.counters.received.load(Ordering::Relaxed);
            if r >= want {
                break true;
            }
            let now = Instant::now();
            if r != last.1 {
                last = (now, r);
            } else if now.duration_since(last.0) >= a.drain_timeout || now >= hard_cap {
                break false;
            }
            if consumers.iter().all(|h| h.is_finished()) {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let received = self.counters.received.load(Ordering::Relaxed);
        let client_cpu = Cpu::now().since(self.cpu0);
        let broker = self
            .probe
            .lock()
            .ok()
            .and_then(|mut p| p.take())
            .map(|p| p.finish(received));
        // a short grace period to catch duplicates that arrive after the last expected one
        if drained {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.stop.cancel();
        self.progress_stop.cancel();
        let _ = self.progress.await;
        let mut checkers = Vec::new();
        for (i, h) in consumers.into_iter().enumerate() {
            match h.await {
                Ok((c, e)) => {
                    checkers.push(c);
                    if let Some(e) = e {
                        errors.push(format!("consumer {i}: {e}"));
                    }
                }
                Err(e) => {
                    checkers.push(Checker::new(sent.len(), a.size));
                    errors.push(format!("consumer {i}: {e}"));
                }
            }
        }
        let end = checkers
            .iter()
            .filter_map(|c| c.last)
            .max()
            .unwrap_or_else(Instant::now);
        Finished {
            sent,
            checkers,
            errors,
            send_seconds,
            seconds: end.saturating_duration_since(self.t0).as_secs_f64(),
            broker,
            client_cpu,
            drained,
        }
    }
}

impl Finished {
    /// Tallies the checkers (see [`tally`]) and builds the common result fields.
    pub fn outcome(
        self,
        group_of: &[usize],
        groups: usize,
        feeds: impl Fn(usize, usize) -> bool,
    ) -> Outcome {
        let refs: Vec<&Checker> = self.checkers.iter().collect();
        let t = tally(&refs, group_of, groups, &self.sent, feeds);
        let mut hist = new_histogram();
        for c in &self.checkers {
            let _ = hist.add(&c.hist);
        }
        Outcome {
            tally: t,
            corrupt: self.checkers.iter().map(|c| c.corrupt).sum(),
            bytes: self.checkers.iter().map(|c| c.bytes).sum(),
            hist,
            seconds: self.seconds,
            send_seconds: self.send_seconds,
            client_cpu: self.client_cpu,
            broker: self.broker,
            errors: self.errors,
            drained: self.drained,
            sent: self.sent,
        }
    }
}

/// The fields every broker benchmark's result line has; the caller adds its own.
pub struct Outcome {
    pub sent: Vec<u64>,
    pub tally: Tally,
    pub corrupt: u64,
    pub bytes: u64,
    pub hist: Histogram<u64>,
    /// From the first publish to the last message received (or the end of sending).
    pub seconds: f64,
    pub send_seconds: f64,
    pub client_cpu: Cpu,
    pub broker: Option<Value>,
    pub errors: Vec<String>,
    pub drained: bool,
}

pub fn result(bench: &str, a: &LoadArgs, o: &Outcome, mut extra: Value) -> Value {
    let sent: u64 = o.sent.iter().sum();
    let recv = o.tally.received;
    let lat = latency_json(&o.hist);
    let mut v = json!({
        "bench": bench,
        "target": format!("{}:{}", a.host, a.port),
        "size": a.size,
        "producers": a.producers,
        "consumers": a.consumers,
        "rate": a.rate,
        "sent": sent,
        "expected": o.tally.expected,
        "received": recv,
        "lost": o.tally.lost,
        "duplicated": o.tally.duplicated,
        "out_of_order": o.tally.out_of_order,
        "unexpected": o.tally.unexpected,
        "corrupt": o.corrupt,
        "drained": o.drained,
        "seconds": round(o.seconds, 3),
        "send_seconds": round(o.send_seconds, 3),
        "send_per_s": round(sent as f64 / o.send_seconds.max(1e-9), 0),
        "msgs_per_s": round(recv as f64 / o.seconds.max(1e-9), 0),
        "mb_per_s": round(o.bytes as f64 / o.seconds.max(1e-9) / 1e6, 2),
        "lat_us": lat,
        "p99_us": lat.get("p99").cloned(),
        "client_cpu_us_per_msg": round(
            o.client_cpu.total().as_secs_f64() * 1e6 / recv.max(1) as f64, 2),
        "broker": o.broker,
        "broker_cpu_us_per_msg": o.broker.as_ref().and_then(|b| b.get("cpu_us_per_msg").cloned()),
        "errors": o.errors,
        "loadavg_at_start": loadavg(),
    });
    if let (Some(m), Value::Object(e)) = (v.as_object_mut(), extra.take()) {
        m.extend(e);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamp_round_trip() {
        let mut b = body_template(20);
        stamp(&mut b, 7, 42, 123456789);
        assert_eq!(unstamp(&b), Some((7, 42, 123456789)));
        assert_eq!(unstamp(&b[..15]), None);
        assert_eq!(body_template(4).len(), STAMP);
    }

    #[test]
    fn stream_counts_loss_dups_reorder() {
        let mut s = Stream::default();
        for q in [0, 1, 2, 4, 3, 3, 7, 100] {
            s.record(q);
        }
        assert_eq!(s.received, 8);
        assert_eq!(s.distinct, 7);
        assert_eq!(s.duplicated, 1);
        assert_eq!(s.out_of_order, 1, "3 after 4");
        // sent 0..8: 5 and 6 missing; 100 was never sent
        assert_eq!(s.lost(8), 2);
        assert_eq!(s.unexpected(8), 1);
        assert_eq!(s.lost(0), 0);
        assert_eq!(Stream::default().lost(5), 5);
        assert_eq!(s.lost(200), 193);
    }

    #[test]
    fn merge_competing_consumers() {
        let mut a = Stream::default();
        let mut b = Stream::default();
        for q in [0, 2, 4, 6] {
            a.record(q);
        }
        for q in [1, 3, 5, 4] {
            b.record(q);
        }
        a.merge(&b);
        assert_eq!(a.received, 8);
        assert_eq!(a.distinct, 7);
        assert_eq!(a.duplicated, 1, "4 went to both");
        assert_eq!(a.out_of_order, 1, "b saw 4 after 5");
        assert_eq!(a.lost(8), 1, "7 missing");
    }

    #[test]
    fn checker_and_tally() {
        let mut c0 = Checker::new(2, 32);
        let mut c1 = Checker::new(2, 32);
        let mut b = body_template(32);
        for seq in 0..10 {
            stamp(&mut b, 0, seq, now_ns());
            if seq != 5 {
                assert!(c0.check(&b));
            }
            stamp(&mut b, 1, seq, now_ns());
            assert!(c1.check(&b));
        }
        stamp(&mut b, 9, 0, 0);
        assert!(!c1.check(&b), "unknown producer");
        stamp(&mut b, 1, u32::MAX, 0);
        assert!(!c1.check(&b), "absurd sequence number");
        assert!(!c1.check(&b[..20]), "wrong size");
        assert_eq!(c1.corrupt, 3);
        assert_eq!(c0.hist.len(), 9);
        // one queue per producer: producer p feeds group p
        let t = tally(&[&c0, &c1], &[0, 1], 2, &[10, 10], |g, p| g == p);
        assert_eq!(
            t,
            Tally {
                expected: 20,
                received: 19,
                lost: 1,
                ..Tally::default()
            }
        );
        // fan-out: both groups expect both producers
        let t = tally(&[&c0, &c1], &[0, 1], 2, &[10, 10], |_, _| true);
        assert_eq!((t.expected, t.lost), (40, 21));
        // competing consumers in one group
        let t = tally(&[&c0, &c1], &[0, 0], 1, &[10, 12], |_, _| true);
        assert_eq!((t.expected, t.lost, t.duplicated), (22, 3, 0));
    }

    #[test]
    fn quotas_split() {
        assert_eq!(quotas(Some(10), 3), vec![Some(4), Some(3), Some(3)]);
        assert_eq!(quotas(None, 2), vec![None, None]);
    }

    #[test]
    fn vmrss() {
        let s = "Name:\tbeam.smp\nVmPeak:\t 1 kB\nVmRSS:\t   123456 kB\nThreads: 3\n";
        assert_eq!(parse_vmrss(s), Some(123456));
        assert_eq!(parse_vmrss("Name: x\n"), None);
        let me = proc_sample(std::process::id()).unwrap();
        assert!(me.rss_kib > 0);
    }
}

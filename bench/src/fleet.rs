//! `triad-bench fleet`: what a fleet of persistent MQTT sessions costs a broker.
//!
//! Device `n` connects with clean session 0 and client id `dev-<n>`, subscribes at QoS 1
//! to `dev/<n>/cmd` and disconnects. The phases, each bounded by `--time-limit`:
//!
//! 1. **create**: N such sessions, `--parallel` at a time; the rate of each block of
//!    `--block` completed sessions (first vs last block shows whether a session costs
//!    more when many exist), latency per session, broker CPU per session.
//! 2. **disk, idle**: data directory growth per session (allocated blocks, as `du`).
//! 3. **publish**: one publisher connection sends one 5-byte QoS 1 message to each
//!    session's topic (or to the first `--publish` sessions) and waits for every PUBACK;
//!    disk per session again.
//! 4. **idle connections**: up to `--idle-connections` sessions reconnect (persistent,
//!    no keep-alive), take their queued message, ack it and stay connected; the
//!    broker's RssAnon growth per connection. Source addresses rotate over
//!    127.0.0.1..127.0.0.`--sources` so that ephemeral ports do not run out.
//! 5. **restart** (only for a broker the bench started): SIGTERM, start again on the
//!    same data directory, time until the listener accepts and until a session's
//!    reconnect gets CONNACK with session-present = 1; RSS after the restart.
//!
//! The broker is either started here on a fresh data directory under `--dir` (`--triad
//! BIN`, or `--mosquitto BIN` with persistence on), or one already running is named by
//! `--port`, `--broker-pid` and `--data-dir` (RabbitMQ from the peers tool); what cannot
//! be measured then is reported as such.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::args::{FleetArgs, FleetTarget};
use crate::e2e;
use crate::idle::raise_nofile;
use crate::mqtt::{
    connect_with, packet, packet_at, pid_packet, publish, put_str, want, CONNACK, DISCONNECT,
    PUBACK, PUBLISH, SUBACK, SUBSCRIBE,
};
use crate::report::{latency_json, new_histogram, round};
use crate::sys::{loadavg, Cpu, Scratch};
use crate::wire::ReadBuf;

/// Per-step time limit of one session's exchange with the broker.
const STEP: Duration = Duration::from_secs(15);
/// How long the broker may take to start or stop.
const START_LIMIT: Duration = Duration::from_secs(300);
const STOP_LIMIT: Duration = Duration::from_secs(120);
/// Payload of the message queued for each session.
const PAYLOAD: &[u8] = b"hello";
/// QoS 1 publishes in flight on the publisher connection.
const WINDOW: usize = 500;

/// Space the files under `path` take on disk (allocated blocks, as `du`; not apparent
/// size), or `None` if it cannot be read.
pub fn du(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0u64;
    let mut stack = vec![(path.to_path_buf(), 0u32)];
    while let Some((p, depth)) = stack.pop() {
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue; // removed while walking
        };
        total += m.blocks() * 512;
        if m.is_dir() && depth < 64 {
            let Ok(rd) = std::fs::read_dir(&p) else {
                continue;
            };
            for e in rd.flatten() {
                stack.push((e.path(), depth + 1));
            }
        }
    }
    std::fs::metadata(path).ok().map(|_| total)
}

/// A field of `/proc/<pid>/status` in KiB (`VmRSS`, `RssAnon`).
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_status_kib(&s, field)
}

fn parse_status_kib(s: &str, field: &str) -> Option<u64> {
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("local_addr: {e}"))
}

/// The `listening proto=PROTO addr=IP:PORT` port in a Triad log.
fn triad_port(log: &str, proto: &str) -> Option<u16> {
    let marker = format!("listening proto={proto} addr=");
    log.lines().find_map(|l| {
        let rest = l.split(marker.as_str()).nth(1)?;
        let addr: SocketAddr = rest.split_whitespace().next()?.parse().ok()?;
        Some(addr.port())
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Triad,
    Mosquitto,
}

/// A broker process the bench started and may restart.
pub(crate) struct Managed {
    kind: Kind,
    bin: PathBuf,
    work: PathBuf,
    pub(crate) data: PathBuf,
    /// The MQTT port (learnt from Triad's log at the first start, then kept).
    pub(crate) port: u16,
    /// Triad's AMQP port, learnt and kept the same way (0 for Mosquitto).
    pub(crate) amqp_port: u16,
    child: Option<Child>,
    starts: u32,
}

impl Managed {
    pub(crate) fn new(kind: Kind, bin: &Path, work: &Path) -> Result<Managed, String> {
        let data = work.join("data");
        std::fs::create_dir_all(&data).map_err(|e| format!("{}: {e}", data.display()))?;
        let port = match kind {
            Kind::Triad => 0,
            Kind::Mosquitto => free_port()?,
        };
        Ok(Managed {
            kind,
            bin: bin.to_path_buf(),
            work: work.to_path_buf(),
            data,
            port,
            amqp_port: 0,
            child: None,
            starts: 0,
        })
    }

    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Triad => "triad",
            Kind::Mosquitto => "mosquitto",
        }
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Spawns the broker; returns once the process exists (not yet accepting).
    fn spawn(&mut self) -> Result<PathBuf, String> {
        self.starts += 1;
        let log = self
            .work
            .join(format!("{}-{}.log", self.name(), self.starts));
        let logf = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let mut cmd = Command::new(&self.bin);
        match self.kind {
            Kind::Triad => {
                let mqtt = format!("127.0.0.1:{}", self.port);
                let amqp = format!("127.0.0.1:{}", self.amqp_port);
                cmd.arg("--data-dir")
                    .arg(&self.data)
                    .args(["--amqp-listen", &amqp])
                    .args(["--stomp-listen", "127.0.0.1:0"])
                    .args(["--mqtt-listen", &mqtt])
                    .args(["--http-listen", "127.0.0.1:0"])
                    .env("RUST_LOG", "info");
            }
            Kind::Mosquitto => {
                let conf = self.work.join("mosquitto.conf");
                let text = format!(
                    "listener {} 127.0.0.1\nallow_anonymous true\npersistence true\n\
                     persistence_location {}/\nuser root\nlog_dest stderr\n",
                    self.port,
                    self.data.display()
                );
                std::fs::write(&conf, text).map_err(|e| format!("{}: {e}", conf.display()))?;
                cmd.arg("-c").arg(&conf);
            }
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.bin.display()))?;
        self.child = Some(child);
        Ok(log)
    }

    /// Starts the broker and waits (bounded) until it accepts; returns seconds from
    /// spawn to the first accepted TCP connection.
    pub(crate) fn start(&mut self) -> Result<f64, String> {
        let t0 = Instant::now();
        let log = self.spawn()?;
        let deadline = t0 + START_LIMIT;
        loop {
            if let Some(Ok(Some(st))) = self.child.as_mut().map(Child::try_wait) {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!("{} exited ({st}): {}", self.name(), tail(&text)));
            }
            if self.kind == Kind::Triad && (self.port == 0 || self.amqp_port == 0) {
                // Triad on ephemeral ports: learn them from the log, then keep them for
                // restarts
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if let (Some(m), Some(a)) = (triad_port(&text, "mqtt"), triad_port(&text, "amqp")) {
                    (self.port, self.amqp_port) = (m, a);
                }
            }
            if self.port != 0
                && std::net::TcpStream::connect_timeout(
                    &SocketAddr::from((Ipv4Addr::LOCALHOST, self.port)),
                    Duration::from_millis(200),
                )
                .is_ok()
            {
                return Ok(t0.elapsed().as_secs_f64());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{} did not accept within {START_LIMIT:?}",
                    self.name()
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGTERM, then waits (bounded; SIGKILL after `STOP_LIMIT`). Returns (seconds,
    /// whether it exited by itself).
    pub(crate) fn stop(&mut self) -> (f64, bool) {
        let Some(mut child) = self.child.take() else {
            return (0.0, true);
        };
        let t0 = Instant::now();
        // SAFETY: kill(2) on the pid of a child we have not reaped yet.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
        while t0.elapsed() < STOP_LIMIT {
            if let Ok(Some(_)) = child.try_wait() {
                return (t0.elapsed().as_secs_f64(), true);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = child.kill();
        let _ = child.wait();
        (t0.elapsed().as_secs_f64(), false)
    }
}

impl Drop for Managed {
    fn drop(&mut self) {
        self.stop();
    }
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

/// Where the clients connect, and from which source addresses.
#[derive(Clone)]
struct Target {
    addr: SocketAddr,
    sources: Vec<Ipv4Addr>,
    user: Option<String>,
    pass: Option<String>,
}

impl Target {
    async fn tcp(&self, i: usize) -> Result<TcpStream, String> {
        let sock = TcpSocket::new_v4().map_err(|e| format!("socket: {e}"))?;
        if let (Some(src), IpAddr::V4(_)) = (
            self.sources.get(i % self.sources.len().max(1)),
            self.addr.ip(),
        ) {
            crate::idle::bind_source(&sock, *src)?;
        }
        let s = tokio::time::timeout(STEP, sock.connect(self.addr))
            .await
            .map_err(|_| format!("connect {}: timed out", self.addr))?
            .map_err(|e| format!("connect {}: {e}", self.addr))?;
        let _ = s.set_nodelay(true);
        Ok(s)
    }

    /// TCP connect and CONNECT; returns the connection and the session-present flag.
    async fn open(
        &self,
        i: usize,
        client_id: &str,
        clean: bool,
        bufsize: usize,
    ) -> Result<(Client, bool), String> {
        let s = self.tcp(i).await?;
        let (rd, w) = s.into_split();
        let mut c = Client {
            r: ReadBuf::with_capacity(rd, bufsize),
            w,
            out: Vec::new(),
        };
        connect_with(
            &mut c.out,
            client_id,
            0,
            clean,
            self.user.as_deref(),
            self.pass.as_deref(),
        );
        c.flush().await?;
        let b = c.expect(CONNACK).await?;
        match (b.first(), b.get(1)) {
            (Some(flags), Some(0)) => Ok((c, flags & 1 == 1)),
            (_, Some(rc)) => Err(format!("{client_id}: CONNACK return code {rc}")),
            _ => Err(format!("{client_id}: short CONNACK")),
        }
    }
}

struct Client {
    r: ReadBuf,
    w: OwnedWriteHalf,
    out: Vec<u8>,
}

impl Client {
    async fn flush(&mut self) -> Result<(), String> {
        if !self.out.is_empty() {
            self.w
                .write_all(&self.out)
                .await
                .map_err(|e| format!("write: {e}"))?;
            self.out.clear();
        }
        Ok(())
    }

    /// The body of the next packet of type `typ` (others are skipped), within `STEP`.
    async fn expect(&mut self, typ: u8) -> Result<Vec<u8>, String> {
        loop {
            if let Some((first, off, len)) = packet_at(self.r.data())? {
                let body = self.r.data()[off..off + len].to_vec();
                self.r.consume(off + len);
                if first >> 4 == typ {
                    return Ok(body);
                }
                continue;
            }
            let w = want(self.r.data());
            self.r.fill_within(w, STEP).await?;
        }
    }

    /// DISCONNECT, then waits (bounded) for the broker to close: once it has, the
    /// broker has finished with the session.
    async fn disconnect(mut self) -> Result<(), String> {
        self.out.extend_from_slice(&[DISCONNECT << 4, 0]);
        self.flush().await?;
        let _ = self.w.shutdown().await;
        let mut buf = [0u8; 256];
        let closed = async {
            loop {
                match self.r.rd.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        };
        tokio::time::timeout(STEP, closed)
            .await
            .map_err(|_| "the broker did not close after DISCONNECT".to_string())
    }
}

fn client_id(n: usize) -> String {
    format!("dev-{n}")
}

fn topic(n: usize) -> String {
    format!("dev/{n}/cmd")
}

/// Errors: how many, and the first few.
#[derive(Default)]
struct Errors {
    count: AtomicU64,
    first: Mutex<Vec<String>>,
}

impl Errors {
    fn push(&self, e: String) {
        self.count.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut f) = self.first.lock() {
            if f.len() < 5 {
                f.push(e);
            }
        }
    }

    fn json(&self, phase: &str) -> Vec<String> {
        let n = self.count.load(Ordering::Relaxed);
        let first = self.first.lock().map(|f| f.clone()).unwrap_or_default();
        if n == 0 {
            return Vec::new();
        }
        vec![format!(
            "{phase}: {n} error(s), first: {}",
            first.join(" / ")
        )]
    }
}

/// One session: connect (persistent), subscribe at QoS 1 to its topic, disconnect.
async fn create_one(t: &Target, n: usize) -> Result<(), String> {
    let id = client_id(n);
    let (mut c, _) = t.open(n, &id, false, 256).await?;
    packet(&mut c.out, SUBSCRIBE << 4 | 0x02, |o| {
        o.extend_from_slice(&1u16.to_be_bytes());
        put_str(o, &topic(n));
        o.push(1);
    });
    c.flush().await?;
    let ack = c.expect(SUBACK).await?;
    match ack.get(2) {
        Some(1) => {}
        Some(q) => return Err(format!("{id}: SUBACK granted {q}, asked 1")),
        None => return Err(format!("{id}: short SUBACK")),
    }
    c.disconnect().await
}

/// Session `dev-<n>` of the broker on `127.0.0.1:port` (persistent): connects from one of
/// `sources` loopback addresses, subscribes at QoS 1 to every filter in one SUBSCRIBE,
/// disconnects.
pub(crate) async fn subscribe_session(
    port: u16,
    sources: u8,
    n: usize,
    filters: &[String],
) -> Result<(), String> {
    let t = Target {
        addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        sources: (1..=sources.max(1))
            .map(|k| Ipv4Addr::new(127, 0, 0, k))
            .collect(),
        user: None,
        pass: None,
    };
    let id = client_id(n);
    let (mut c, _) = t.open(n, &id, false, 256).await?;
    packet(&mut c.out, SUBSCRIBE << 4 | 0x02, |o| {
        o.extend_from_slice(&1u16.to_be_bytes());
        for f in filters {
            put_str(o, f);
            o.push(1);
        }
    });
    c.flush().await?;
    let ack = c.expect(SUBACK).await?;
    let codes = ack.get(2..).unwrap_or_default();
    if codes.len() != filters.len() || codes.iter().any(|&q| q != 1) {
        return Err(format!(
            "{id}: SUBACK granted {codes:?} for {} filters at QoS 1",
            filters.len()
        ));
    }
    c.disconnect().await
}

/// Block rates from the sorted completion times: block k spans completions
/// (k*B, (k+1)*B]; block 0 starts at `t0`.
fn block_rates(t0: Instant, done: &[Instant], block: usize) -> Vec<f64> {
    let mut rates = Vec::new();
    let mut start = t0;
    for chunk in done.chunks(block) {
        if chunk.len() < block {
            break;
        }
        let Some(&end) = chunk.last() else { break };
        let secs = end.saturating_duration_since(start).as_secs_f64().max(1e-9);
        rates.push(block as f64 / secs);
        start = end;
    }
    rates
}

struct Phase {
    value: Value,
    errors: Vec<String>,
}

/// What the create workers share: the next session number, when each creation
/// finished, their latency and errors.
#[derive(Clone)]
struct Creating {
    next: Arc<AtomicUsize>,
    done: Arc<Mutex<Vec<Instant>>>,
    hist: Arc<Mutex<hdrhistogram::Histogram<u64>>>,
    errors: Arc<Errors>,
}

/// `--parallel` workers, each creating the next session until all are made or the
/// deadline passes.
fn spawn_creators(
    a: &FleetArgs,
    t: &Target,
    c: &Creating,
    deadline: Instant,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut workers = Vec::new();
    for _ in 0..a.parallel.min(a.sessions) {
        let Creating {
            next,
            done,
            hist,
            errors,
        } = c.clone();
        let t = t.clone();
        let n_max = a.sessions;
        workers.push(tokio::spawn(async move {
            loop {
                if Instant::now() >= deadline {
                    return;
                }
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= n_max {
                    return;
                }
                let s = Instant::now();
                match create_one(&t, n).await {
                    Ok(()) => {
                        let end = Instant::now();
                        if let Ok(mut h) = hist.lock() {
                            h.saturating_record(end.duration_since(s).as_nanos().max(1) as u64);
                        }
                        if let Ok(mut d) = done.lock() {
                            d.push(end);
                        }
                    }
                    Err(e) => errors.push(e),
                }
            }
        }));
    }
    workers
}

/// Prints the creation rate every 5 s (unless `quiet`) until aborted.
fn create_progress(quiet: bool, t0: Instant, c: &Creating) -> tokio::task::JoinHandle<()> {
    let (done, errors) = (c.done.clone(), c.errors.clone());
    tokio::spawn(async move {
        let mut last = 0usize;
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            let n = done.lock().map(|d| d.len()).unwrap_or(0);
            if !quiet {
                eprintln!(
                    "[{:>5.0}s] create: {n} sessions ({:.0}/s over the last 5 s), {} errors",
                    t0.elapsed().as_secs_f64(),
                    (n - last) as f64 / 5.0,
                    errors.count.load(Ordering::Relaxed)
                );
            }
            last = n;
        }
    })
}

async fn create_phase(a: &FleetArgs, t: &Target, pid: Option<u32>) -> (Phase, usize) {
    let c = Creating {
        next: Arc::new(AtomicUsize::new(0)),
        done: Arc::new(Mutex::new(Vec::<Instant>::with_capacity(a.sessions))),
        hist: Arc::new(Mutex::new(new_histogram())),
        errors: Arc::new(Errors::default()),
    };
    let b0 = pid.and_then(e2e::proc_sample);
    let t0 = Instant::now();
    let deadline = t0 + a.time_limit;
    let workers = spawn_creators(a, t, &c, deadline);
    let progress = create_progress(a.quiet, t0, &c);
    for w in workers {
        let _ = w.await;
    }
    progress.abort();
    let Creating {
        next,
        done,
        hist,
        errors,
    } = c;
    let secs = t0.elapsed().as_secs_f64();
    let b1 = pid.and_then(e2e::proc_sample);
    let mut done = done.lock().map(|d| d.clone()).unwrap_or_default();
    done.sort();
    let created = done.len();
    let attempted = next.load(Ordering::Relaxed).min(a.sessions);
    let cut_short = attempted < a.sessions;
    let rates = block_rates(t0, &done, a.block);
    let first = rates.first().copied();
    let last = rates.last().copied();
    let cpu = match (b0, b1) {
        (Some(x), Some(y)) => Some(y.cpu.saturating_sub(x.cpu).as_secs_f64()),
        _ => None,
    };
    let lat = hist.lock().map(|h| latency_json(&h)).unwrap_or(Value::Null);
    let mut errs = errors.json("create");
    if cut_short {
        errs.push(format!(
            "create: cut short by --time-limit after {created} of {} sessions",
            a.sessions
        ));
    }
    let value = json!({
        "sessions": created,
        "failed": errors.count.load(Ordering::Relaxed),
        "cut_short": cut_short,
        "seconds": round(secs, 3),
        "sessions_per_s": round(created as f64 / secs.max(1e-9), 1),
        "block": a.block,
        "block_per_s": rates.iter().map(|r| round(*r, 1)).collect::<Vec<_>>(),
        "first_block_per_s": first.map(|r| round(r, 1)),
        "last_block_per_s": last.map(|r| round(r, 1)),
        // > 1: the last block took longer than the first (issue target: at most 1.5)
        "last_over_first_time": match (first, last) {
            (Some(f), Some(l)) if l > 0.0 => Some(round(f / l, 2)),
            _ => None,
        },
        "lat_us": lat,
        "broker_cpu_s": cpu.map(|c| round(c, 3)),
        "broker_cpu_us_per_session": cpu.filter(|_| created > 0).map(|c| round(c * 1e6 / created as f64, 1)),
    });
    (
        Phase {
            value,
            errors: errs,
        },
        created,
    )
}

/// One QoS 1 message to each of the first `n` sessions' topics, `WINDOW` in flight.
async fn publish_phase(a: &FleetArgs, t: &Target, n: usize, pid: Option<u32>) -> Phase {
    let b0 = pid.and_then(e2e::proc_sample);
    let t0 = Instant::now();
    let deadline = t0 + a.time_limit;
    let (mut sent, mut acked) = (0usize, 0usize);
    let res: Result<(), String> = async {
        let id = format!("fleet-pub-{}", std::process::id());
        let (mut c, _) = t.open(0, &id, true, 64 << 10).await?;
        loop {
            while sent - acked < WINDOW && sent < n && Instant::now() < deadline {
                publish(
                    &mut c.out,
                    &topic(sent),
                    1,
                    (sent % 65535) as u16 + 1,
                    PAYLOAD,
                );
                sent += 1;
            }
            c.flush().await?;
            if acked == sent {
                break;
            }
            if Instant::now() >= deadline + STEP {
                return Err(format!(
                    "{} PUBACKs missing at the time limit",
                    sent - acked
                ));
            }
            let w = want(c.r.data());
            c.r.fill_within(w, STEP).await?;
            while let Some((first, off, len)) = packet_at(c.r.data())? {
                if first >> 4 == PUBACK {
                    acked += 1;
                }
                c.r.consume(off + len);
            }
        }
        c.disconnect().await
    }
    .await;
    let secs = t0.elapsed().as_secs_f64();
    let b1 = pid.and_then(e2e::proc_sample);
    let cpu = match (b0, b1) {
        (Some(x), Some(y)) => Some(y.cpu.saturating_sub(x.cpu).as_secs_f64()),
        _ => None,
    };
    let mut errors: Vec<String> = res
        .err()
        .map(|e| format!("publish: {e}"))
        .into_iter()
        .collect();
    if sent < n {
        errors.push(format!(
            "publish: cut short by --time-limit after {sent} of {n}"
        ));
    }
    Phase {
        value: json!({
            "messages": n,
            "sent": sent,
            "acked": acked,
            "seconds": round(secs, 3),
            "msgs_per_s": round(acked as f64 / secs.max(1e-9), 1),
            "broker_cpu_us_per_msg": cpu.filter(|_| acked > 0).map(|c| round(c * 1e6 / acked as f64, 1)),
        }),
        errors,
    }
}

/// A connected session that acks what it is sent and otherwise stays idle until `stop`.
async fn hold(mut c: Client, stop: CancellationToken, got: Arc<AtomicU64>) -> Result<(), String> {
    loop {
        while let Some((first, off, len)) = packet_at(c.r.data())? {
            if first >> 4 == PUBLISH {
                let body = &c.r.data()[off..off + len];
                let (qos, pid, _) = crate::mqtt::parse_publish(first, body)?;
                if qos == 1 {
                    pid_packet(&mut c.out, PUBACK, pid);
                }
                got.fetch_add(1, Ordering::Relaxed);
            }
            c.r.consume(off + len);
        }
        c.flush().await?;
        let w = want(c.r.data());
        tokio::select! {
            _ = stop.cancelled() => break,
            r = c.r.fill(w) => r?,
        }
    }
    c.disconnect().await
}

/// What the idle connections share: queued messages received, sessions found present,
/// connections alive, errors.
#[derive(Clone, Default)]
struct Idling {
    got: Arc<AtomicU64>,
    present: Arc<AtomicU64>,
    alive: Arc<AtomicU64>,
    errors: Arc<Errors>,
}

/// Connects sessions `0..m` again (at most `--parallel` at once) and holds them until
/// `stop`; each reports on `tx` whether it connected.
fn spawn_idlers(
    a: &FleetArgs,
    t: &Target,
    m: usize,
    st: &Idling,
    stop: &CancellationToken,
    deadline: Instant,
    tx: tokio::sync::mpsc::UnboundedSender<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let gate = Arc::new(Semaphore::new(a.parallel));
    let mut tasks = Vec::with_capacity(m);
    for i in 0..m {
        let Idling {
            got,
            present,
            alive,
            errors,
        } = st.clone();
        let (t, stop, gate, tx) = (t.clone(), stop.clone(), gate.clone(), tx.clone());
        tasks.push(tokio::spawn(async move {
            let Ok(permit) = gate.acquire_owned().await else {
                let _ = tx.send(false);
                return;
            };
            if Instant::now() >= deadline || stop.is_cancelled() {
                let _ = tx.send(false);
                return;
            }
            let r = t.open(i, &client_id(i), false, 64).await;
            drop(permit);
            match r {
                Ok((c, sp)) => {
                    if sp {
                        present.fetch_add(1, Ordering::Relaxed);
                    }
                    alive.fetch_add(1, Ordering::Relaxed);
                    let _ = tx.send(true);
                    let r = hold(c, stop, got).await;
                    alive.fetch_sub(1, Ordering::Relaxed);
                    if let Err(e) = r {
                        errors.push(format!("{}: {e}", client_id(i)));
                    }
                }
                Err(e) => {
                    errors.push(e);
                    let _ = tx.send(false);
                }
            }
        }));
    }
    tasks
}

/// Waits for each of the `m` connections to report; returns how many connected (an
/// error is noted if they do not all report by the time limit).
async fn idle_connected(
    a: &FleetArgs,
    m: usize,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<bool>,
    t0: Instant,
    deadline: Instant,
    errs_late: &mut Vec<String>,
) -> usize {
    let mut connected = 0usize;
    let mut next_tick = Instant::now() + Duration::from_secs(5);
    // each task reports once (and then keeps its sender while it holds its connection)
    for _ in 0..m {
        let wait = deadline.saturating_duration_since(Instant::now()) + STEP * 2;
        let Ok(Some(ok)) = tokio::time::timeout(wait, rx.recv()).await else {
            errs_late.push("idle: connecting did not finish by the time limit".to_string());
            break;
        };
        connected += usize::from(ok);
        if !a.quiet && Instant::now() >= next_tick {
            eprintln!(
                "[{:>5.0}s] idle: {connected} of {m} connected",
                t0.elapsed().as_secs_f64()
            );
            next_tick += Duration::from_secs(5);
        }
    }
    connected
}

async fn idle_phase(a: &FleetArgs, t: &Target, n: usize, pid: Option<u32>) -> Phase {
    let m = n.min(a.idle_connections);
    let before = pid.map(|p| (status_kib(p, "RssAnon"), status_kib(p, "VmRSS")));
    let stop = CancellationToken::new();
    let st = Idling::default();
    let t0 = Instant::now();
    let deadline = t0 + a.time_limit;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<bool>();
    let mut errs_late = Vec::new();
    let tasks = spawn_idlers(a, t, m, &st, &stop, deadline, tx);
    let connected = idle_connected(a, m, &mut rx, t0, deadline, &mut errs_late).await;
    let Idling {
        got,
        present,
        alive,
        errors,
    } = st;
    let connect_s = t0.elapsed().as_secs_f64();
    // deliveries of the queued messages settle; then the broker holds only idle state
    let settle_until = Instant::now() + Duration::from_secs(30);
    while (got.load(Ordering::Relaxed) as usize) < connected && Instant::now() < settle_until {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(a.hold).await;
    let after = pid.map(|p| (status_kib(p, "RssAnon"), status_kib(p, "VmRSS")));
    let still = alive.load(Ordering::Relaxed);
    stop.cancel();
    let end = tokio::time::Instant::now() + STEP * 2;
    for t in tasks {
        let _ = tokio::time::timeout_at(end, t).await;
    }
    let per = |b: Option<u64>, x: Option<u64>| match (b, x) {
        (Some(b), Some(x)) if connected > 0 => {
            Some(round((x as f64 - b as f64) / connected as f64, 2))
        }
        _ => None,
    };
    let (anon_b, rss_b) = before.unwrap_or((None, None));
    let (anon_a, rss_a) = after.unwrap_or((None, None));
    let mut errs = errors.json("idle");
    errs.append(&mut errs_late);
    if (still as usize) < connected {
        errs.push(format!(
            "idle: {} connections dropped",
            connected as u64 - still
        ));
    }
    Phase {
        value: json!({
            "connections": m,
            "connected": connected,
            "connect_s": round(connect_s, 3),
            "session_present": present.load(Ordering::Relaxed),
            "queued_delivered": got.load(Ordering::Relaxed),
            "alive_at_end": still,
            "rss_anon_kib_before": anon_b,
            "rss_anon_kib_connected": anon_a,
            "rss_anon_kib_per_conn": per(anon_b, anon_a),
            "rss_kib_before": rss_b,
            "rss_kib_connected": rss_a,
            "rss_kib_per_conn": per(rss_b, rss_a),
        }),
        errors: errs,
    }
}

/// Stops the broker, starts it on the same data directory, and reconnects sessions.
async fn restart_phase(m: &mut Managed, created: usize) -> (Value, Vec<String>) {
    let pid = m.pid();
    let rss_before = pid.and_then(|p| status_kib(p, "VmRSS"));
    let (stop_s, clean_exit) = tokio::task::block_in_place(|| m.stop());
    let disk_stopped = du(&m.data);
    let t0 = Instant::now();
    let listen = tokio::task::block_in_place(|| m.start());
    let mut errors = Vec::new();
    let listen_s = match listen {
        Ok(s) => s,
        Err(e) => {
            return (json!({"error": e.clone()}), vec![format!("restart: {e}")]);
        }
    };
    let t = Target {
        addr: SocketAddr::from((Ipv4Addr::LOCALHOST, m.port)),
        sources: vec![Ipv4Addr::LOCALHOST],
        user: None,
        pass: None,
    };
    // the first session: retried until the broker answers (it may accept before it is
    // ready to serve)
    let mut first = None;
    while t0.elapsed() < START_LIMIT {
        match t.open(0, &client_id(0), false, 256).await {
            Ok((c, sp)) => {
                first = Some((t0.elapsed().as_secs_f64(), sp));
                let _ = c.disconnect().await;
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
    let last_sp = match t
        .open(0, &client_id(created.saturating_sub(1)), false, 256)
        .await
    {
        Ok((c, sp)) => {
            let _ = c.disconnect().await;
            Some(sp)
        }
        Err(e) => {
            errors.push(format!("restart: last session: {e}"));
            None
        }
    };
    if first.is_none() {
        errors.push("restart: no CONNACK within the start limit".into());
    }
    if first.is_some_and(|(_, sp)| !sp) || last_sp == Some(false) {
        errors.push("restart: a session came back without session-present".into());
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let pid = m.pid();
    (
        json!({
            "rss_kib_before_stop": rss_before,
            "stop_s": round(stop_s, 3),
            "stopped_by_sigterm": clean_exit,
            "disk_bytes_stopped": disk_stopped,
            "listen_s": round(listen_s, 3),
            "ready_s": first.map(|(s, _)| round(s, 3)),
            "session_present": first.map(|(_, sp)| sp),
            "last_session_present": last_sp,
            "rss_kib_after": pid.and_then(|p| status_kib(p, "VmRSS")),
            "rss_anon_kib_after": pid.and_then(|p| status_kib(p, "RssAnon")),
        }),
        errors,
    )
}

pub fn run(a: &FleetArgs) -> Result<Value, String> {
    let limit = raise_nofile(a.idle_connections as u64 + a.parallel as u64 + 512);
    if limit < (a.sessions.min(a.idle_connections) + a.parallel) as u64 + 64 {
        return Err(format!(
            "RLIMIT_NOFILE is {limit}, too low for {} idle connections (lower --idle-connections)",
            a.sessions.min(a.idle_connections)
        ));
    }
    e2e::runtime(a.threads)?.block_on(run_async(a, limit))
}

/// The broker a fleet run measures: started by the bench (in a scratch directory) or
/// already running.
struct FleetBroker {
    addr: SocketAddr,
    pid: Option<u32>,
    data: Option<PathBuf>,
    name: String,
    scratch: Option<Scratch>,
    managed: Option<Managed>,
}

/// Starts the broker `--target` names, or finds the running one.
fn fleet_broker(a: &FleetArgs) -> Result<FleetBroker, String> {
    Ok(match &a.target {
        FleetTarget::Triad(bin) | FleetTarget::Mosquitto(bin) => {
            let kind = if matches!(a.target, FleetTarget::Triad(_)) {
                Kind::Triad
            } else {
                Kind::Mosquitto
            };
            let s = Scratch::create(&a.dir, "bench-fleet", a.allow_tmpfs, a.keep)?;
            let mut m = Managed::new(kind, bin, &s.path)?;
            tokio::task::block_in_place(|| m.start())?;
            FleetBroker {
                addr: SocketAddr::from((Ipv4Addr::LOCALHOST, m.port)),
                pid: m.pid(),
                data: Some(m.data.clone()),
                name: m.name().to_string(),
                scratch: Some(s),
                managed: Some(m),
            }
        }
        FleetTarget::Running {
            host,
            port,
            pid,
            data_dir,
        } => {
            let ip: IpAddr = match host.as_str() {
                "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
                h => h
                    .parse()
                    .map_err(|_| format!("--host {host:?}: an IP address is needed"))?,
            };
            FleetBroker {
                addr: SocketAddr::new(ip, *port),
                pid: *pid,
                data: data_dir.clone(),
                name: "broker".to_string(),
                scratch: None,
                managed: None,
            }
        }
    })
}

/// The data directory's size at the run's steps, bytes.
struct DiskSizes {
    start: Option<u64>,
    idle: Option<u64>,
    queued: Option<u64>,
    end: Option<u64>,
}

/// The disk cost per session (with a data directory to measure).
fn disk_json(
    data: &Option<PathBuf>,
    d: &DiskSizes,
    created: usize,
    published: usize,
    restart: &Value,
) -> Value {
    let per = |x: Option<u64>| match (d.start, x) {
        (Some(b), Some(x)) if created > 0 => Some(round((x as f64 - b as f64) / created as f64, 0)),
        _ => None,
    };
    match data {
        Some(dir) => json!({
            "data_dir": dir.display().to_string(),
            "bytes_start": d.start,
            "bytes_idle": d.idle,
            "bytes_queued": d.queued,
            "bytes_after_restart": d.end,
            "bytes_per_session_idle": per(d.idle),
            "bytes_per_session_queued": per(d.queued),
            "sessions_with_message": published,
            // idle cost plus the growth per session that got a message (equal to
            // bytes_per_session_queued when every session got one)
            "bytes_per_session_with_message": match (d.start, d.idle, d.queued) {
                (Some(b), Some(i), Some(q)) if created > 0 && published > 0 => Some(round(
                    (i as f64 - b as f64) / created as f64 + (q as f64 - i as f64) / published as f64,
                    0,
                )),
                _ => None,
            },
            "bytes_per_session_after_stop": per(restart.get("disk_bytes_stopped").and_then(Value::as_u64)),
        }),
        None => json!({"note": "not measured: no --data-dir"}),
    }
}

/// Where the clients connect: `addr`, from `--sources` loopback addresses when it is
/// a loopback one.
fn fleet_target(a: &FleetArgs, addr: SocketAddr) -> Target {
    let sources = match addr.ip() {
        IpAddr::V4(ip) if ip.is_loopback() => (1..=a.sources)
            .map(|k| Ipv4Addr::new(127, 0, 0, k))
            .collect(),
        _ => Vec::new(),
    };
    Target {
        addr,
        sources,
        user: a.user.clone(),
        pass: a.pass.clone(),
    }
}

async fn run_async(a: &FleetArgs, nofile: u64) -> Result<Value, String> {
    let load = loadavg();
    let cpu0 = Cpu::now();
    let FleetBroker {
        addr,
        pid,
        data,
        name,
        scratch,
        mut managed,
    } = fleet_broker(a)?;
    let data = &data;
    let name = a.name.clone().filter(|n| !n.is_empty()).unwrap_or(name);
    let t = fleet_target(a, addr);
    let mut errors = Vec::new();
    let disk = |d: &Option<PathBuf>| d.as_deref().and_then(du);
    let rss0 = pid.and_then(|p| status_kib(p, "VmRSS"));
    let anon0 = pid.and_then(|p| status_kib(p, "RssAnon"));
    let disk0 = disk(data);
    if !a.quiet {
        eprintln!(
            "fleet {name} at {addr} (pid {pid:?}, data dir {:?}): {} sessions",
            data, a.sessions
        );
    }

    let (create, created) = create_phase(a, &t, pid).await;
    errors.extend(create.errors);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let disk_idle = disk(data);
    let anon_sessions = pid.and_then(|p| status_kib(p, "RssAnon"));

    let published = a.publish.map_or(created, |p| p.min(created));
    let publish = publish_phase(a, &t, published, pid).await;
    errors.extend(publish.errors);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let disk_queued = disk(data);
    let rss_sessions = pid.and_then(|p| status_kib(p, "VmRSS"));

    let idle = if a.idle_connections > 0 && created > 0 {
        let p = idle_phase(a, &t, created, pid).await;
        errors.extend(p.errors);
        p.value
    } else {
        json!({"note": "skipped (--idle-connections 0)"})
    };

    let restart = match managed.as_mut() {
        Some(m) if a.restart && created > 0 => {
            let (v, e) = restart_phase(m, created).await;
            errors.extend(e);
            v
        }
        Some(_) => json!({"note": "skipped (--no-restart)"}),
        None => json!({"note": "not measured: the broker was not started by the bench"}),
    };
    let disk_end = disk(data);

    let sizes = DiskSizes {
        start: disk0,
        idle: disk_idle,
        queued: disk_queued,
        end: disk_end,
    };
    let disk_json = disk_json(data, &sizes, created, published, &restart);
    let client_cpu = Cpu::now().since(cpu0);
    drop(managed); // stops the broker
    drop(scratch);
    Ok(json!({
        "bench": "fleet",
        "broker_name": name,
        "target": addr.to_string(),
        "broker_pid": pid,
        "sessions_requested": a.sessions,
        "sessions": created,
        "create": create.value,
        "sessions_per_s": create_rate(&create.value),
        "disk": disk_json,
        "rss_kib_start": rss0,
        "rss_anon_kib_start": anon0,
        "rss_anon_kib_sessions": anon_sessions,
        // the broker's anonymous memory per disconnected session, after the create phase
        "rss_anon_kib_per_session": match (anon0, anon_sessions) {
            (Some(a), Some(b)) if created > 0 => Some(round((b as f64 - a as f64) / created as f64, 2)),
            _ => None,
        },
        "rss_kib_sessions": rss_sessions,
        "publish": publish.value,
        "idle": idle,
        "restart": restart,
        "client_cpu_s": round(client_cpu.total().as_secs_f64(), 3),
        "nofile_limit": nofile,
        "errors": errors,
        "loadavg_at_start": load,
    }))
}

fn create_rate(v: &Value) -> Value {
    v.get("sessions_per_s").cloned().unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks() {
        let t0 = Instant::now();
        let done: Vec<Instant> = (1..=25u64)
            .map(|i| t0 + Duration::from_millis(if i <= 10 { i * 10 } else { 100 + (i - 10) * 20 }))
            .collect();
        let r = block_rates(t0, &done, 10);
        assert_eq!(r.len(), 2, "{r:?}");
        assert!((r[0] - 100.0).abs() < 1.0, "{r:?}");
        assert!((r[1] - 50.0).abs() < 1.0, "{r:?}");
    }

    #[test]
    fn status_fields() {
        let s = "Name:\ttriad\nVmRSS:\t  123456 kB\nRssAnon:\t   2048 kB\n";
        assert_eq!(parse_status_kib(s, "VmRSS"), Some(123456));
        assert_eq!(parse_status_kib(s, "RssAnon"), Some(2048));
        assert_eq!(parse_status_kib(s, "RssFile"), None);
        assert_eq!(
            triad_port(
                "x INFO triad: listening proto=mqtt addr=127.0.0.1:40123\n",
                "mqtt"
            ),
            Some(40123)
        );
        assert_eq!(
            triad_port("listening proto=amqp addr=127.0.0.1:1", "mqtt"),
            None
        );
        assert_eq!(
            triad_port("listening proto=amqp addr=127.0.0.1:1", "amqp"),
            Some(1)
        );
    }

    #[test]
    fn du_counts_blocks() {
        let d = std::env::temp_dir().join(format!("fleet-du-{}", std::process::id()));
        std::fs::create_dir_all(d.join("a")).unwrap();
        std::fs::write(d.join("a/f"), vec![1u8; 10_000]).unwrap();
        let n = du(&d).unwrap();
        assert!(n >= 10_000, "{n}");
        std::fs::remove_dir_all(&d).unwrap();
        assert_eq!(du(&d), None);
    }
}

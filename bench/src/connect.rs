//! `triad-bench connect`: connection setup, as a fleet reconnecting after a network blip
//! does it. `--parallel N` clients each loop: TCP connect (from 127.0.0.1 ..= 127.0.0.K in
//! turn), the TLS handshake with `--tls`, the protocol's handshake, its disconnect, then
//! wait until the broker closes the socket, and again. The broker's CPU time (utime +
//! stime of `--broker-pid` from /proc/PID/stat) over the measured connects, divided by
//! their number, is the cost of one connection's whole life: accept, TLS, login, session
//! setup, teardown, and its log lines.
//!
//! - `--proto mqtt` (CONNECT/CONNACK/DISCONNECT, `--session clean|persistent`), `stomp`
//!   (CONNECT/CONNECTED/DISCONNECT), `amqp` (handshake, one channel, connection.close),
//!   or `tls`: the TLS handshake alone, then close_notify, against any TLS listener.
//! - TLS: a rustls client. Without `--resume` it keeps no session, so every handshake is
//!   a full one; with `--resume` one shared session cache (TLS 1.3 tickets, TLS 1.2
//!   session ids and tickets) lets every handshake after the first resume. The result
//!   counts the handshakes the client saw resumed, and which version was negotiated.
//! - Persistent MQTT sessions: client i always uses the id `tb-<pid>-c<i>`, so after its
//!   first connect each connect reattaches to a stored session (CONNACK session-present
//!   is counted); after the run each client connects once more with clean session 1, which
//!   discards the session.
//! - Warm-up connects (`--warmup`, at least one per client when resuming or with persistent
//!   sessions) run before the measurement and are not counted.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;

use crate::args::{ConnectArgs, ConnectProto, MqttSession, Proto};
use crate::e2e;
use crate::idle::{self, Stream};
use crate::report::{latency_json, new_histogram, round};
use crate::sys::{loadavg, Cpu};

pub const ABOUT: &str = "Connection setup: connects/s and the broker's CPU per connect.

--parallel N clients each loop: TCP connect (from 127.0.0.1 ..= 127.0.0.K in turn, \
--sources K), the TLS handshake with --tls, the protocol's handshake and disconnect, then \
wait until the broker closes the socket, and again, until --count connects or \
--time-limit. With --broker-pid, the broker's utime+stime (/proc/PID/stat) over the \
measured connects gives its CPU per connect.

--proto tls measures the TLS handshake alone (then close_notify). Without --resume every \
handshake is a full one; with --resume a shared client session cache resumes them (TLS 1.3 \
tickets, TLS 1.2 session ids and tickets); the result counts the resumed handshakes.";

/// Per-connect deadline: TCP, TLS, handshake, disconnect and the broker's close.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

struct Client {
    addr: SocketAddr,
    sources: u8,
    tls: Option<tokio_rustls::TlsConnector>,
    proto: ConnectProto,
    session: MqttSession,
    /// Credentials as given (MQTT sends none unless given).
    user: Option<String>,
    pass: Option<String>,
    /// Round-robin over the source addresses.
    next_source: AtomicU64,
}

/// What one connect saw.
#[derive(Default)]
struct Seen {
    resumed: bool,
    tls12: bool,
    session_present: bool,
}

fn tls_connector(a: &ConnectArgs) -> Result<tokio_rustls::TlsConnector, String> {
    let mut config = idle::tls_client_config(a.tls_version)?;
    config.resumption = if a.resume {
        rustls::client::Resumption::in_memory_sessions(4096)
            .tls12_resumption(rustls::client::Tls12Resumption::SessionIdOrTickets)
    } else {
        rustls::client::Resumption::disabled()
    };
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

fn client_id(i: usize) -> String {
    format!("tb-{}-c{i}", std::process::id())
}

/// Reads until the broker closes the connection (what it sends meanwhile, e.g. TLS 1.3
/// session tickets, is read and dropped).
async fn until_closed(s: &mut Stream) -> Result<(), String> {
    let mut chunk = [0u8; 4096];
    let mut total = 0usize;
    loop {
        match s.read(&mut chunk).await {
            Ok(0) => return Ok(()),
            Ok(n) => {
                total += n;
                if total > 1 << 20 {
                    return Err("more than 1 MiB from the broker after disconnect".into());
                }
            }
            // a reset after our disconnect is a close too
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(()),
            // a peer that closes TCP without close_notify
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(format!("read after disconnect: {e}")),
        }
    }
}

async fn mqtt_session(c: &Client, s: &mut Stream, i: usize, clean: bool) -> Result<bool, String> {
    let mut out = Vec::new();
    crate::mqtt::connect_with(
        &mut out,
        &client_id(i),
        60,
        clean,
        c.user.as_deref(),
        c.pass.as_deref(),
    );
    idle::send(s, &out).await?;
    let mut buf = Vec::new();
    let mut present = false;
    idle::read_until(s, &mut buf, |d| match crate::mqtt::packet_at(d)? {
        Some((first, off, len)) if first >> 4 == 2 => match (d.get(off), d.get(off + 1)) {
            (Some(flags), Some(0)) => {
                present = flags & 1 == 1;
                Ok(Some(off + len))
            }
            (_, Some(rc)) => Err(format!("CONNACK return code {rc}")),
            _ => Err("short CONNACK".into()),
        },
        Some((first, _, _)) => Err(format!("unexpected packet type {}", first >> 4)),
        None => Ok(None),
    })
    .await?;
    idle::send(s, &[0xE0, 0]).await?;
    Ok(present)
}

/// One connect, start to the broker's close.
async fn connect_once(c: &Client, i: usize, clean_override: bool) -> Result<Seen, String> {
    let k = c.next_source.fetch_add(1, Ordering::Relaxed);
    let src = Ipv4Addr::new(127, 0, 0, 1 + (k % u64::from(c.sources)) as u8);
    let sock = TcpSocket::new_v4().map_err(|e| format!("socket: {e}"))?;
    if c.sources > 1 {
        idle::bind_source(&sock, src)?;
    }
    let tcp = sock
        .connect(c.addr)
        .await
        .map_err(|e| format!("connect {} from {src}: {e}", c.addr))?;
    let _ = tcp.set_nodelay(true);
    let mut seen = Seen::default();
    let mut s: Stream = match &c.tls {
        None => Box::new(tcp),
        Some(conn) => {
            let name = rustls_pki_types::ServerName::try_from("localhost")
                .map_err(|e| format!("server name: {e}"))?;
            let tls = conn
                .connect(name, tcp)
                .await
                .map_err(|e| format!("TLS handshake: {e}"))?;
            let state = tls.get_ref().1;
            seen.resumed = state.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
            seen.tls12 = state.protocol_version() == Some(rustls::ProtocolVersion::TLSv1_2);
            Box::new(tls)
        }
    };
    match c.proto {
        ConnectProto::Tls => {}
        ConnectProto::Mqtt => {
            let clean = clean_override || c.session == MqttSession::Clean;
            seen.session_present = mqtt_session(c, &mut s, i, clean).await?;
        }
        ConnectProto::Stomp | ConnectProto::Amqp => {
            let proto = if c.proto == ConnectProto::Stomp {
                Proto::Stomp
            } else {
                Proto::Amqp
            };
            let t = idle::Target {
                addr: c.addr,
                sources: c.sources,
                tls: None,
                proto,
                user: c.user.clone().unwrap_or_else(|| "guest".into()),
                pass: c.pass.clone().unwrap_or_else(|| "guest".into()),
            };
            idle::handshake(&t, &mut s, i).await?;
            let bye: &[u8] = if proto == Proto::Stomp {
                b"DISCONNECT\n\n\0"
            } else {
                // connection.close 200, no text, class 0 method 0
                b"\x01\x00\x00\x00\x00\x00\x0b\x00\x0a\x00\x32\x00\xc8\x00\x00\x00\x00\x00\xce"
            };
            idle::send(&mut s, bye).await?;
        }
    }
    // TLS: close_notify; plain: FIN. Then wait for the broker's close.
    s.shutdown().await.map_err(|e| format!("shutdown: {e}"))?;
    until_closed(&mut s).await?;
    Ok(seen)
}

#[derive(Default)]
struct Totals {
    ok: u64,
    failed: u64,
    resumed: u64,
    tls12: u64,
    session_present: u64,
    first_error: Option<String>,
}

/// Runs connects on `parallel` clients until `count` connects were started or the
/// deadline passes; returns the totals and the connect-time histogram.
async fn phase(
    c: Arc<Client>,
    parallel: usize,
    count: Option<u64>,
    deadline: Instant,
    quiet: bool,
    label: &'static str,
) -> (Totals, Histogram<u64>) {
    let started = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let totals = Arc::new(Mutex::new(Totals::default()));
    let mut tasks = Vec::with_capacity(parallel);
    for i in 0..parallel {
        let (c, started, done, totals) = (c.clone(), started.clone(), done.clone(), totals.clone());
        tasks.push(tokio::spawn(async move {
            let mut h = new_histogram();
            let mut mine = Totals::default();
            loop {
                if Instant::now() >= deadline {
                    break;
                }
                if let Some(n) = count {
                    if started.fetch_add(1, Ordering::Relaxed) >= n {
                        break;
                    }
                }
                let t0 = Instant::now();
                let r = tokio::time::timeout(CONNECT_TIMEOUT, connect_once(&c, i, false))
                    .await
                    .unwrap_or_else(|_| Err("connect: timed out".into()));
                match r {
                    Ok(seen) => {
                        let _ = h.record(t0.elapsed().as_nanos().max(1) as u64);
                        mine.ok += 1;
                        mine.resumed += u64::from(seen.resumed);
                        mine.tls12 += u64::from(seen.tls12);
                        mine.session_present += u64::from(seen.session_present);
                    }
                    Err(e) => {
                        mine.failed += 1;
                        mine.first_error.get_or_insert(e);
                        // a broker that refuses: do not spin
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                done.fetch_add(1, Ordering::Relaxed);
            }
            if let Ok(mut t) = totals.lock() {
                t.ok += mine.ok;
                t.failed += mine.failed;
                t.resumed += mine.resumed;
                t.tls12 += mine.tls12;
                t.session_present += mine.session_present;
                if t.first_error.is_none() {
                    t.first_error = mine.first_error;
                }
            }
            h
        }));
    }
    let progress = (!quiet).then(|| {
        let done = done.clone();
        tokio::spawn(async move {
            let t0 = Instant::now();
            let mut last = 0;
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let n = done.load(Ordering::Relaxed);
                eprintln!(
                    "[{:>4.0}s] {label}: {n} connects ({}/s)",
                    t0.elapsed().as_secs_f64(),
                    n - last
                );
                last = n;
            }
        })
    });
    let mut h = new_histogram();
    for t in tasks {
        if let Ok(part) = t.await {
            let _ = h.add(&part);
        }
    }
    if let Some(p) = progress {
        p.abort();
    }
    let t = Arc::try_unwrap(totals)
        .ok()
        .and_then(|m| m.into_inner().ok())
        .unwrap_or_default();
    (t, h)
}

pub fn run(a: &ConnectArgs) -> Result<Value, String> {
    idle::raise_nofile(a.parallel as u64 * 2 + 256);
    e2e::runtime(a.threads)?.block_on(run_async(a.clone()))
}

async fn run_async(a: ConnectArgs) -> Result<Value, String> {
    let load = loadavg();
    let c = Arc::new(client(&a).await?);
    let persistent = a.proto == ConnectProto::Mqtt && a.session == MqttSession::Persistent;
    let warmup = warm_up(&a, &c, persistent).await?;
    let before = a
        .broker_pid
        .map(|p| e2e::proc_sample(p).ok_or_else(|| format!("cannot read /proc/{p}/stat")))
        .transpose()?;
    let cpu0 = Cpu::now();
    let t0 = Instant::now();
    let deadline = t0 + a.time_limit.unwrap_or(Duration::from_secs(86_400));
    let (t, h) = phase(c.clone(), a.parallel, a.count, deadline, a.quiet, "connect").await;
    let secs = t0.elapsed().as_secs_f64();
    let client_cpu = Cpu::now().since(cpu0).total().as_secs_f64();
    let after = a.broker_pid.and_then(e2e::proc_sample);
    if persistent {
        // discard the sessions: one clean connect per client id
        for i in 0..a.parallel {
            let _ = tokio::time::timeout(CONNECT_TIMEOUT, connect_once(&c, i, true)).await;
        }
    }
    let per = |x: f64| (t.ok > 0).then(|| round(x * 1e3 / t.ok as f64, 4));
    let broker = broker_json(&a, before, after, t.ok);
    let mut errors = Vec::new();
    if t.failed > 0 {
        errors.push(format!(
            "{} connects failed, first: {}",
            t.failed,
            t.first_error.as_deref().unwrap_or("?")
        ));
    }
    let negotiated = if !a.tls {
        Value::Null
    } else if t.tls12 == t.ok {
        json!("1.2")
    } else if t.tls12 == 0 {
        json!("1.3")
    } else {
        json!("mixed")
    };
    Ok(json!({
        "bench": "connect",
        "name": a.name,
        "target": format!("{}:{}", a.host, a.port),
        "proto": a.proto.name(),
        "session": if a.proto == ConnectProto::Mqtt {
            json!(if persistent { "persistent" } else { "clean" })
        } else {
            Value::Null
        },
        "tls": a.tls,
        "tls_version": negotiated,
        "resume": a.resume,
        "parallel": a.parallel,
        "sources": a.sources,
        "warmup": warmup,
        "connects": t.ok,
        "failed": t.failed,
        "resumed": t.resumed,
        "session_present": t.session_present,
        "seconds": round(secs, 3),
        "connects_per_s": round(t.ok as f64 / secs.max(1e-9), 0),
        "lat_us": latency_json(&h),
        "broker": broker,
        "cpu_ms_per_connect": broker.get("cpu_ms_per_connect").cloned(),
        "client_cpu_ms_per_connect": per(client_cpu),
        "loadavg_at_start": load,
        "errors": errors,
    }))
}

/// The connecting client, from the arguments: the first IPv4 address of the host.
async fn client(a: &ConnectArgs) -> Result<Client, String> {
    let addr = tokio::net::lookup_host((a.host.as_str(), a.port))
        .await
        .map_err(|e| format!("resolve {}: {e}", a.host))?
        .find(|s| s.is_ipv4())
        .ok_or_else(|| format!("{}: no IPv4 address", a.host))?;
    Ok(Client {
        addr,
        sources: a.sources,
        tls: if a.tls { Some(tls_connector(a)?) } else { None },
        proto: a.proto,
        session: a.session,
        user: a.user.clone(),
        pass: a.pass.clone(),
        next_source: AtomicU64::new(0),
    })
}

/// The warm-up before the measured connects: one connect per client first when each
/// needs its own (its MQTT session, or a TLS session to resume), then the rest of
/// `--warmup`; returns the warm-up count.
async fn warm_up(a: &ConnectArgs, c: &Arc<Client>, persistent: bool) -> Result<u64, String> {
    let warmup = if a.resume || persistent {
        a.warmup.max(a.parallel as u64)
    } else {
        a.warmup
    };
    // One warm-up connect per client first when each client needs its own (its MQTT
    // session, or a TLS session to resume): a shared count let one client take two and
    // leave another with none.
    let per_client = if a.resume || persistent {
        for i in 0..a.parallel {
            match tokio::time::timeout(CONNECT_TIMEOUT, connect_once(c, i, false)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(format!("warm-up: client {i}: {e}")),
                Err(_) => return Err(format!("warm-up: client {i}: connect timed out")),
            }
        }
        a.parallel as u64
    } else {
        0
    };
    let rest = warmup.saturating_sub(per_client);
    if rest > 0 {
        let (w, _) = phase(
            c.clone(),
            a.parallel,
            Some(rest),
            Instant::now() + Duration::from_secs(120),
            a.quiet,
            "warm-up",
        )
        .await;
        if w.failed > 0 {
            return Err(format!(
                "warm-up: {} of {} connects failed, first: {}",
                w.failed,
                w.ok + w.failed,
                w.first_error.unwrap_or_default()
            ));
        }
    }
    Ok(warmup)
}

/// The broker's CPU per connect and its RSS (with `--broker-pid`).
fn broker_json(
    a: &ConnectArgs,
    before: Option<e2e::ProcSample>,
    after: Option<e2e::ProcSample>,
    ok: u64,
) -> Value {
    let per = |x: f64| (ok > 0).then(|| round(x * 1e3 / ok as f64, 4));
    match (a.broker_pid, before, after) {
        (Some(pid), Some(b), Some(af)) => {
            let cpu = af.cpu.saturating_sub(b.cpu).as_secs_f64();
            let sys = af.sys.saturating_sub(b.sys).as_secs_f64();
            json!({
                "pid": pid,
                "cpu_s": round(cpu, 3),
                "cpu_ms_per_connect": per(cpu),
                "user_ms_per_connect": per(cpu - sys),
                "sys_ms_per_connect": per(sys),
                "rss_kib_before": b.rss_kib,
                "rss_kib_after": af.rss_kib,
            })
        }
        (Some(pid), _, _) => json!({"pid": pid, "error": "broker gone"}),
        _ => Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{parse, Command};
    use std::collections::HashSet;
    use tokio::net::TcpListener;

    fn args(s: &str) -> ConnectArgs {
        let argv: Vec<String> = s.split_whitespace().map(String::from).collect();
        match parse(&argv) {
            Ok(Command::Connect(a)) => a,
            other => panic!("{other:?}"),
        }
    }

    /// Reads one MQTT packet; None at EOF.
    async fn packet<S: tokio::io::AsyncRead + Unpin>(
        s: &mut S,
        buf: &mut Vec<u8>,
    ) -> Option<Vec<u8>> {
        loop {
            if let Ok(Some((_, off, len))) = crate::mqtt::packet_at(buf) {
                let p = buf[..off + len].to_vec();
                buf.drain(..off + len);
                return Some(p);
            }
            let mut chunk = [0u8; 1024];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// A minimal MQTT 3.1.1 broker for the client's sake: CONNACK with session-present
    /// set when a persistent session of that client id exists, then waits for
    /// DISCONNECT and closes. Counts the connections it served.
    async fn serve<S>(mut s: S, sessions: Arc<Mutex<HashSet<Vec<u8>>>>, served: Arc<AtomicU64>)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let mut buf = Vec::new();
        let Some(connect) = packet(&mut s, &mut buf).await else {
            return;
        };
        assert_eq!(connect[0] >> 4, 1, "CONNECT first");
        // fixed header (2 bytes here), "MQTT" (6), level (1), flags (1), keep-alive (2)
        let flags = connect[2 + 7];
        let clean = flags & 0x02 != 0;
        let id_len = usize::from(u16::from_be_bytes([connect[12], connect[13]]));
        let id = connect[14..14 + id_len].to_vec();
        let present = {
            let mut known = sessions.lock().unwrap();
            if clean {
                known.remove(&id);
                false
            } else {
                !known.insert(id)
            }
        };
        s.write_all(&[0x20, 2, u8::from(present), 0]).await.unwrap();
        let disconnect = packet(&mut s, &mut buf).await;
        assert_eq!(disconnect.as_deref(), Some(&[0xE0, 0][..]));
        served.fetch_add(1, Ordering::Relaxed);
        let _ = s.shutdown().await;
    }

    fn test_cert() -> (
        Vec<rustls_pki_types::CertificateDer<'static>>,
        rustls_pki_types::PrivateKeyDer<'static>,
    ) {
        let c = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let key = rustls_pki_types::PrivatePkcs8KeyDer::from(c.signing_key.serialize_der());
        (vec![c.cert.der().clone()], key.into())
    }

    /// Starts the fake broker (TLS when `tls`), returns its port and served counter.
    async fn broker(tls: bool, mqtt: bool) -> (u16, Arc<AtomicU64>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let served = Arc::new(AtomicU64::new(0));
        let sessions = Arc::new(Mutex::new(HashSet::new()));
        let acceptor = tls.then(|| {
            let (chain, key) = test_cert();
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(chain, key)
                .unwrap();
            tokio_rustls::TlsAcceptor::from(Arc::new(config))
        });
        let s2 = served.clone();
        tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = l.accept().await else {
                    return;
                };
                let (sessions, served, acceptor) = (sessions.clone(), s2.clone(), acceptor.clone());
                tokio::spawn(async move {
                    match acceptor {
                        None => serve(sock, sessions, served).await,
                        Some(a) => {
                            let Ok(mut t) = a.accept(sock).await else {
                                return;
                            };
                            if mqtt {
                                serve(t, sessions, served).await
                            } else {
                                // handshake only: wait for the client's close_notify
                                let mut b = [0u8; 64];
                                while matches!(t.read(&mut b).await, Ok(n) if n > 0) {}
                                served.fetch_add(1, Ordering::Relaxed);
                                let _ = t.shutdown().await;
                            }
                        }
                    }
                });
            }
        });
        (port, served)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn plain_clean_counts_every_connect() {
        let (port, served) = broker(false, true).await;
        let a = args(&format!(
            "connect --port {port} --count 40 --parallel 4 --sources 2 --quiet"
        ));
        let v = run_async(a).await.unwrap();
        assert_eq!(v["connects"], 40);
        assert_eq!(v["failed"], 0);
        assert_eq!(v["session_present"], 0);
        assert_eq!(v["tls"], false);
        assert!(v["connects_per_s"].as_f64().unwrap() > 0.0);
        // every connect waited for the broker's close, so the broker served them all
        assert_eq!(served.load(Ordering::Relaxed), 40);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn persistent_sessions_reattach_after_the_warmup() {
        let (port, served) = broker(false, true).await;
        let a = args(&format!(
            "connect --port {port} --count 30 --parallel 3 --session persistent --quiet"
        ));
        let v = run_async(a).await.unwrap();
        assert_eq!(
            (v["connects"].as_u64(), v["warmup"].as_u64()),
            (Some(30), Some(3))
        );
        // the warm-up created the 3 sessions: every measured connect found its session
        assert_eq!(v["session_present"], 30);
        // 3 warm-up + 30 measured + 3 clean connects that discard the sessions
        assert_eq!(served.load(Ordering::Relaxed), 36);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tls_full_and_resumed_handshakes() {
        let (port, _) = broker(true, false).await;
        for v in ["1.3", "1.2"] {
            let full = run_async(args(&format!(
                "connect --proto tls --tls --tls-version {v} --port {port} --count 10 --quiet"
            )))
            .await
            .unwrap();
            assert_eq!(
                (full["connects"].as_u64(), full["resumed"].as_u64()),
                (Some(10), Some(0))
            );
            assert_eq!(full["tls_version"], v);
            let resumed = run_async(args(&format!(
                "connect --proto tls --tls --tls-version {v} --resume --port {port} --count 10 \
                 --parallel 2 --quiet"
            )))
            .await
            .unwrap();
            assert_eq!(resumed["connects"], 10, "{v}");
            assert_eq!(
                resumed["resumed"], 10,
                "TLS {v}: every measured handshake resumed"
            );
        }
        // MQTT over TLS
        let (port, served) = broker(true, true).await;
        let m = run_async(args(&format!(
            "connect --tls --port {port} --count 5 --quiet"
        )))
        .await
        .unwrap();
        assert_eq!(
            (m["connects"].as_u64(), m["failed"].as_u64()),
            (Some(5), Some(0))
        );
        assert_eq!(served.load(Ordering::Relaxed), 5);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refusing_broker_is_an_error_not_a_result() {
        // a port nobody listens on: bind and drop
        let port = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let v = run_async(args(&format!(
            "connect --port {port} --count 3 --sources 1 --quiet"
        )))
        .await
        .unwrap();
        assert_eq!(v["connects"], 0);
        assert_eq!(v["failed"], 3);
        assert_eq!(v["errors"].as_array().map(Vec::len), Some(1));
    }
}

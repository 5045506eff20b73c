//! `triad-bench mqtt-idle`, `stomp-idle`, `amqp-idle`: N connected clients that do
//! nothing but stay connected, held for a while; the broker's RSS before and after gives
//! its memory per idle connection.
//!
//! - MQTT: CONNECT (clean session, keep-alive 60 s), then a PINGREQ every 30 s.
//! - STOMP: CONNECT with `heart-beat:0,0`, CONNECTED, nothing more.
//! - AMQP: the handshake (PLAIN, heartbeat 0) and one open channel, as a client library
//!   leaves a connection that waits for work.
//!
//! `--tls` runs the same over TLS (rustls; the server's certificate is not verified:
//! loopback benchmarks only). `--sources K` spreads the connections over the source
//! addresses 127.0.0.1 ..= 127.0.0.K, so that tens of thousands of connects (and the
//! TIME_WAITs of the run before) do not run out of ephemeral ports.
//!
//! The broker's `VmRSS` and `RssAnon` are read from `/proc/PID/status` before the first
//! connect, one second after the last, and at the end of the hold; per connection is
//! (end − before) / connected. `RssAnon` leaves out file pages (the store's mapped
//! segments), so it is the figure to compare.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpSocket;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::args::{IdleArgs, IdleProto, TlsVersion};
use crate::e2e;
use crate::report::round;
use crate::sys::{loadavg, Cpu};

const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest handshake reply a client buffers (AMQP's connection.start is the largest).
const MAX_REPLY: usize = 64 << 10;

pub(crate) trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

pub(crate) type Stream = Box<dyn Io>;

/// Raises RLIMIT_NOFILE so that `need` descriptors fit; returns the soft limit in force.
pub(crate) fn raise_nofile(need: u64) -> u64 {
    // SAFETY: getrlimit/setrlimit only read and write the struct they are given.
    unsafe {
        let mut rl: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) != 0 {
            return 0;
        }
        if rl.rlim_cur >= need {
            return rl.rlim_cur;
        }
        let want = libc::rlimit {
            rlim_cur: need.max(rl.rlim_cur),
            rlim_max: need.max(rl.rlim_max),
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
            return want.rlim_cur;
        }
        let soft = libc::rlimit {
            rlim_cur: rl.rlim_max,
            rlim_max: rl.rlim_max,
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &soft) == 0 {
            return soft.rlim_cur;
        }
        rl.rlim_cur
    }
}

/// `VmRSS` and `RssAnon` of a process, KiB.
#[derive(Clone, Copy, Debug)]
struct Rss {
    rss: u64,
    anon: u64,
    cpu: Duration,
}

fn rss_sample(pid: u32) -> Option<Rss> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let cpu = e2e::proc_sample(pid)?.cpu;
    Some(Rss {
        rss: field("VmRSS:")?,
        anon: field("RssAnon:")?,
        cpu,
    })
}

// ---- TLS client: no certificate verification (loopback benchmarks only) ----

#[derive(Debug)]
pub(crate) struct AcceptAnyCert(pub(crate) Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AcceptAnyCert {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls_pki_types::CertificateDer<'_>,
        _intermediates: &[rustls_pki_types::CertificateDer<'_>],
        _server_name: &rustls_pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A client configuration offering `version` (default: 1.3 and 1.2, the server picks)
/// that accepts any server certificate.
pub(crate) fn tls_client_config(
    version: Option<TlsVersion>,
) -> Result<rustls::ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let versions: &[&rustls::SupportedProtocolVersion] = match version {
        Some(TlsVersion::V12) => &[&rustls::version::TLS12],
        Some(TlsVersion::V13) => &[&rustls::version::TLS13],
        None => rustls::DEFAULT_VERSIONS,
    };
    Ok(
        rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(versions)
            .map_err(|e| format!("TLS client config: {e}"))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyCert(provider)))
            .with_no_client_auth(),
    )
}

fn tls_connector(version: Option<TlsVersion>) -> Result<tokio_rustls::TlsConnector, String> {
    Ok(tokio_rustls::TlsConnector::from(Arc::new(
        tls_client_config(version)?,
    )))
}

// ---- connecting ----

/// Binds `sock` to `src` with port 0, leaving the port to `connect` (Linux
/// `IP_BIND_ADDRESS_NO_PORT`): a plain `bind` must find a port free for every destination,
/// and with ~100,000 sockets in TIME_WAIT from earlier runs its search cost the client
/// milliseconds per connect; `connect` picks a port free for this 4-tuple.
pub(crate) fn bind_source(sock: &TcpSocket, src: Ipv4Addr) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let one: libc::c_int = 1;
    // SAFETY: setsockopt reads `one` (an int of the size given) for the call's duration.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(format!(
            "IP_BIND_ADDRESS_NO_PORT: {}",
            std::io::Error::last_os_error()
        ));
    }
    sock.bind(SocketAddr::new(IpAddr::V4(src), 0))
        .map_err(|e| format!("bind {src}: {e}"))
}

pub(crate) struct Target {
    pub(crate) addr: SocketAddr,
    pub(crate) sources: u8,
    pub(crate) tls: Option<tokio_rustls::TlsConnector>,
    pub(crate) proto: IdleProto,
    pub(crate) user: String,
    pub(crate) pass: String,
}

async fn open(t: &Target, i: usize) -> Result<Stream, String> {
    let src = Ipv4Addr::new(127, 0, 0, 1 + (i % usize::from(t.sources)) as u8);
    let sock = TcpSocket::new_v4().map_err(|e| format!("socket: {e}"))?;
    if t.sources > 1 {
        bind_source(&sock, src)?;
    }
    let s = sock
        .connect(t.addr)
        .await
        .map_err(|e| format!("connect {} from {src}: {e}", t.addr))?;
    let _ = s.set_nodelay(true);
    match &t.tls {
        None => Ok(Box::new(s)),
        Some(c) => {
            let name = rustls_pki_types::ServerName::try_from("localhost")
                .map_err(|e| format!("server name: {e}"))?;
            let tls = c
                .connect(name, s)
                .await
                .map_err(|e| format!("TLS handshake: {e}"))?;
            Ok(Box::new(tls))
        }
    }
}

/// Reads until `done` finds what it waits for in the bytes so far (`Some(used)`), or
/// fails; `done` may fail too (an ERROR frame, a refusal).
pub(crate) async fn read_until(
    s: &mut Stream,
    buf: &mut Vec<u8>,
    mut done: impl FnMut(&[u8]) -> Result<Option<usize>, String>,
) -> Result<(), String> {
    loop {
        if let Some(used) = done(buf)? {
            buf.drain(..used.min(buf.len()));
            return Ok(());
        }
        if buf.len() > MAX_REPLY {
            return Err("handshake reply too large".into());
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("connection closed by the broker".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

pub(crate) async fn send(s: &mut Stream, b: &[u8]) -> Result<(), String> {
    s.write_all(b).await.map_err(|e| format!("write: {e}"))?;
    s.flush().await.map_err(|e| format!("flush: {e}"))
}

pub(crate) async fn handshake(t: &Target, s: &mut Stream, i: usize) -> Result<(), String> {
    let mut buf = Vec::new();
    match t.proto {
        IdleProto::Mqtt => {
            let mut out = Vec::new();
            crate::mqtt::connect(
                &mut out,
                &crate::mqtt::client_id('i', i),
                60,
                Some(&t.user),
                Some(&t.pass),
            );
            send(s, &out).await?;
            read_until(s, &mut buf, |d| match crate::mqtt::packet_at(d)? {
                Some((first, off, len)) if first >> 4 == 2 => match d.get(off + 1) {
                    Some(0) => Ok(Some(off + len)),
                    Some(rc) => Err(format!("CONNACK return code {rc}")),
                    None => Err("short CONNACK".into()),
                },
                Some((first, _, _)) => Err(format!("unexpected packet type {}", first >> 4)),
                None => Ok(None),
            })
            .await
        }
        IdleProto::Stomp => {
            let connect = format!(
                "CONNECT\naccept-version:1.2\nhost:/\nlogin:{}\npasscode:{}\nheart-beat:0,0\n\n\0",
                t.user, t.pass
            );
            send(s, connect.as_bytes()).await?;
            read_until(s, &mut buf, |d| match crate::stomp::parse(d)? {
                Some((f, used)) if f.command == "CONNECTED" => Ok(Some(used)),
                Some((f, _)) => Err(format!(
                    "{}: {}",
                    f.command,
                    f.header("message").unwrap_or("")
                )),
                None => Ok(None),
            })
            .await
        }
        IdleProto::Amqp => amqp_handshake(t, s, &mut buf).await,
    }
}

/// AMQP frame: type, channel, payload.
fn amqp_frame(out: &mut Vec<u8>, ch: u16, class: u16, method: u16, args: &[u8]) {
    out.push(1);
    out.extend_from_slice(&ch.to_be_bytes());
    out.extend_from_slice(&((args.len() + 4) as u32).to_be_bytes());
    out.extend_from_slice(&class.to_be_bytes());
    out.extend_from_slice(&method.to_be_bytes());
    out.extend_from_slice(args);
    out.push(0xCE);
}

/// Waits for method (class, method) on `ch`; connection.close is an error. Returns the
/// method's arguments.
async fn amqp_expect(
    s: &mut Stream,
    buf: &mut Vec<u8>,
    ch: u16,
    id: (u16, u16),
) -> Result<Vec<u8>, String> {
    let mut args = Vec::new();
    read_until(s, buf, |d| {
        if d.len() < 7 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([d[3], d[4], d[5], d[6]]) as usize;
        if d.len() < len + 8 {
            return Ok(None);
        }
        let payload = &d[7..7 + len];
        let chan = u16::from_be_bytes([d[1], d[2]]);
        if d[0] != 1 || payload.len() < 4 {
            return Err(format!("unexpected frame type {}", d[0]));
        }
        let got = (
            u16::from_be_bytes([payload[0], payload[1]]),
            u16::from_be_bytes([payload[2], payload[3]]),
        );
        if got == (10, 50) || got == (20, 40) {
            let text = payload
                .get(7..)
                .and_then(|r| r.get(..usize::from(payload[6]).min(r.len())))
                .map(String::from_utf8_lossy)
                .unwrap_or_default();
            return Err(format!("closed by the broker: {text}"));
        }
        if chan != ch || got != id {
            return Err(format!("expected method {id:?}, got {got:?}"));
        }
        args = payload[4..].to_vec();
        Ok(Some(len + 8))
    })
    .await?;
    Ok(args)
}

async fn amqp_handshake(t: &Target, s: &mut Stream, buf: &mut Vec<u8>) -> Result<(), String> {
    send(s, b"AMQP\x00\x00\x09\x01").await?;
    amqp_expect(s, buf, 0, (10, 10)).await?;
    let mut out = Vec::new();
    let mut args = Vec::new();
    args.extend_from_slice(&0u32.to_be_bytes()); // client-properties: empty table
    args.push(5);
    args.extend_from_slice(b"PLAIN");
    let resp = format!("\0{}\0{}", t.user, t.pass);
    args.extend_from_slice(&(resp.len() as u32).to_be_bytes());
    args.extend_from_slice(resp.as_bytes());
    args.push(5);
    args.extend_from_slice(b"en_US");
    amqp_frame(&mut out, 0, 10, 11, &args);
    send(s, &out).await?;
    let tune = amqp_expect(s, buf, 0, (10, 30)).await?;
    let (channel_max, frame_max) = match tune.get(..6) {
        Some(t) => (
            u16::from_be_bytes([t[0], t[1]]),
            u32::from_be_bytes([t[2], t[3], t[4], t[5]]),
        ),
        None => return Err("short connection.tune".into()),
    };
    out.clear();
    let mut args = Vec::new();
    args.extend_from_slice(&channel_max.to_be_bytes());
    args.extend_from_slice(&frame_max.to_be_bytes());
    args.extend_from_slice(&0u16.to_be_bytes()); // no heartbeats
    amqp_frame(&mut out, 0, 10, 31, &args);
    amqp_frame(&mut out, 0, 10, 40, b"\x01/\x00\x00"); // vhost "/", "", no flags
    send(s, &out).await?;
    amqp_expect(s, buf, 0, (10, 41)).await?;
    out.clear();
    amqp_frame(&mut out, 1, 20, 10, b"\x00");
    send(s, &out).await?;
    amqp_expect(s, buf, 1, (20, 11)).await?;
    Ok(())
}

/// One idle client: connected, answering nothing but its keep-alive, until `stop`.
async fn idle_client(
    mut s: Stream,
    proto: IdleProto,
    stop: CancellationToken,
    alive: Arc<AtomicU64>,
) -> Result<(), String> {
    let res: Result<(), String> = async {
        let mut ping = tokio::time::interval(Duration::from_secs(30));
        ping.tick().await;
        let mut pending = Vec::new();
        loop {
            let mut chunk = [0u8; 256];
            tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                _ = ping.tick(), if proto == IdleProto::Mqtt => send(&mut s, &[0xC0, 0]).await?,
                r = s.read(&mut chunk) => {
                    let n = r.map_err(|e| format!("read: {e}"))?;
                    if n == 0 {
                        return Err("connection closed by the broker".into());
                    }
                    if proto != IdleProto::Mqtt {
                        return Err(format!("unexpected {n} bytes from the broker while idle"));
                    }
                    pending.extend_from_slice(&chunk[..n]);
                    while let Some((first, off, len)) = crate::mqtt::packet_at(&pending)? {
                        if first >> 4 != 13 {
                            return Err(format!("unexpected packet type {}", first >> 4));
                        }
                        pending.drain(..off + len);
                    }
                }
            }
        }
    }
    .await;
    alive.fetch_sub(1, Ordering::Relaxed);
    if res.is_ok() {
        let bye: &[u8] = match proto {
            IdleProto::Mqtt => &[0xE0, 0],
            IdleProto::Stomp => b"DISCONNECT\n\n\0",
            IdleProto::Amqp => {
                b"\x01\x00\x00\x00\x00\x00\x0b\x00\x0a\x00\x32\x00\xc8\x00\x00\x00\x00\x00\xce"
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            let _ = s.write_all(bye).await;
            let _ = s.shutdown().await;
        })
        .await;
    }
    res
}

pub fn run(a: &IdleArgs) -> Result<Value, String> {
    let limit = raise_nofile(a.connections as u64 + 256);
    if limit < a.connections as u64 + 64 {
        return Err(format!(
            "RLIMIT_NOFILE is {limit}, too low for {} connections",
            a.connections
        ));
    }
    e2e::runtime(2)?.block_on(run_async(a.clone(), limit))
}

async fn run_async(a: IdleArgs, nofile: u64) -> Result<Value, String> {
    let load = loadavg();
    let target = Arc::new(target(&a).await?);
    let before = a
        .broker_pid
        .map(|p| rss_sample(p).ok_or_else(|| format!("cannot read /proc/{p}/status")))
        .transpose()?;
    let cpu0 = Cpu::now();
    let stop = CancellationToken::new();
    let c = Counters::default();
    let t0 = Instant::now();
    let (tasks, connects) = spawn_clients(&a, &target, &stop, &c);
    let connected = wait_connected(&a, connects, t0, &c).await;
    let connect_s = t0.elapsed().as_secs_f64();
    // let the broker settle, then measure; hold; measure again
    tokio::time::sleep(Duration::from_secs(1)).await;
    let settled = a.broker_pid.and_then(rss_sample);
    hold(&a, t0, &c).await;
    let after = a.broker_pid.and_then(rss_sample);
    let alive_at_end = c.alive.load(Ordering::Relaxed);
    stop.cancel();
    let mut dropped = Vec::new();
    for t in tasks {
        if let Ok(Err(e)) = t.await {
            dropped.push(e);
        }
    }
    let client_cpu = Cpu::now().since(cpu0);
    let mut errors: Vec<String> = Vec::new();
    if let Some(e) = c.first_err.lock().ok().and_then(|f| f.clone()) {
        errors.push(format!(
            "{} connects failed, first: {e}",
            c.failed.load(Ordering::Relaxed)
        ));
    }
    if alive_at_end < connected {
        errors.push(format!(
            "{} connections dropped while idle, first: {}",
            connected - alive_at_end,
            dropped.first().map(String::as_str).unwrap_or("?")
        ));
    }
    let broker = broker_json(&a, before, settled, after, connected);
    let failed = &c.failed;
    let per_conn = broker.get("rss_kib_per_conn").cloned();
    let anon_per_conn = broker.get("rss_anon_kib_per_conn").cloned();
    Ok(json!({
        "bench": format!("{}-idle", a.proto.name()),
        "target": format!("{}:{}", a.host, a.port),
        "tls": a.tls,
        "tls_version": a.tls_version.map(|v| match v {
            TlsVersion::V12 => "1.2",
            TlsVersion::V13 => "1.3",
        }),
        "connections": a.connections,
        "connected": connected,
        "failed": failed.load(Ordering::Relaxed),
        "alive_at_end": alive_at_end,
        "connect_s": round(connect_s, 3),
        "connects_per_s": round(connected as f64 / connect_s.max(1e-9), 0),
        "hold_s": a.hold.as_secs_f64(),
        "broker": broker,
        "rss_kib_per_conn": per_conn,
        "rss_anon_kib_per_conn": anon_per_conn,
        "client_cpu_s": round(client_cpu.total().as_secs_f64(), 3),
        "nofile_limit": nofile,
        "errors": errors,
        "loadavg_at_start": load,
    }))
}

/// The target of the run, from the arguments: the first IPv4 address of the host.
async fn target(a: &IdleArgs) -> Result<Target, String> {
    let addr = tokio::net::lookup_host((a.host.as_str(), a.port))
        .await
        .map_err(|e| format!("resolve {}: {e}", a.host))?
        .find(|s| s.is_ipv4())
        .ok_or_else(|| format!("{}: no IPv4 address", a.host))?;
    Ok(Target {
        addr,
        sources: a.sources,
        tls: if a.tls {
            Some(tls_connector(a.tls_version)?)
        } else {
            None
        },
        proto: a.proto,
        user: a.user.clone().unwrap_or_else(|| "guest".into()),
        pass: a.pass.clone().unwrap_or_else(|| "guest".into()),
    })
}

/// The clients' shared counters.
#[derive(Default)]
struct Counters {
    alive: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    first_err: Arc<std::sync::Mutex<Option<String>>>,
}

type ClientTask = tokio::task::JoinHandle<Result<(), String>>;

/// Spawns one task per connection (at most `--parallel` connecting at once), each
/// connecting, then idling until `stop`; returns the tasks and, per task, a receiver
/// that gets a value once it is connected (dropped if it fails).
fn spawn_clients(
    a: &IdleArgs,
    target: &Arc<Target>,
    stop: &CancellationToken,
    c: &Counters,
) -> (Vec<ClientTask>, Vec<tokio::sync::oneshot::Receiver<()>>) {
    let gate = Arc::new(Semaphore::new(a.parallel));
    let mut tasks = Vec::with_capacity(a.connections);
    let mut connects = Vec::with_capacity(a.connections);
    for i in 0..a.connections {
        let (target, stop, alive, failed, first_err, gate) = (
            target.clone(),
            stop.clone(),
            c.alive.clone(),
            c.failed.clone(),
            c.first_err.clone(),
            gate.clone(),
        );
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        connects.push(rx);
        tasks.push(tokio::spawn(async move {
            let permit = gate.acquire_owned().await;
            let c = tokio::time::timeout(SETUP_TIMEOUT, async {
                let mut s = open(&target, i).await?;
                handshake(&target, &mut s, i).await?;
                Ok::<_, String>(s)
            })
            .await
            .unwrap_or_else(|_| Err("connect and handshake: timed out".into()));
            drop(permit);
            match c {
                Ok(s) => {
                    alive.fetch_add(1, Ordering::Relaxed);
                    let _ = tx.send(());
                    idle_client(s, target.proto, stop, alive).await
                }
                Err(e) => {
                    failed.fetch_add(1, Ordering::Relaxed);
                    if let Ok(mut f) = first_err.lock() {
                        f.get_or_insert(e.clone());
                    }
                    drop(tx);
                    Err(e)
                }
            }
        }));
    }
    (tasks, connects)
}

/// Waits until every connection has connected or failed, printing progress each second;
/// returns how many connected.
async fn wait_connected(
    a: &IdleArgs,
    connects: Vec<tokio::sync::oneshot::Receiver<()>>,
    t0: Instant,
    c: &Counters,
) -> u64 {
    let mut connected = 0u64;
    let mut next_tick = Instant::now() + Duration::from_secs(1);
    for rx in connects {
        if rx.await.is_ok() {
            connected += 1;
        }
        if !a.quiet && Instant::now() >= next_tick {
            eprintln!(
                "[{:>4.0}s] connected {connected} failed {}",
                t0.elapsed().as_secs_f64(),
                c.failed.load(Ordering::Relaxed)
            );
            next_tick += Duration::from_secs(1);
        }
    }
    connected
}

/// Holds the connections for `--hold`, printing how many are alive each second.
async fn hold(a: &IdleArgs, t0: Instant, c: &Counters) {
    let hold_end = Instant::now() + a.hold;
    while Instant::now() < hold_end {
        tokio::time::sleep(
            hold_end
                .saturating_duration_since(Instant::now())
                .min(Duration::from_secs(1)),
        )
        .await;
        if !a.quiet {
            eprintln!(
                "[{:>4.0}s] holding {} connections",
                t0.elapsed().as_secs_f64(),
                c.alive.load(Ordering::Relaxed)
            );
        }
    }
}

/// The broker's memory and CPU over the run (with `--broker-pid`).
fn broker_json(
    a: &IdleArgs,
    before: Option<Rss>,
    settled: Option<Rss>,
    after: Option<Rss>,
    connected: u64,
) -> Value {
    match (a.broker_pid, before, after) {
        (Some(pid), Some(b), Some(af)) => {
            let per = |x: u64, base: u64| {
                (connected > 0).then(|| round((x as f64 - base as f64) / connected as f64, 2))
            };
            let s = settled.unwrap_or(af);
            json!({
                "pid": pid,
                "rss_kib_before": b.rss,
                "rss_kib_connected": s.rss,
                "rss_kib_after": af.rss,
                "rss_kib_per_conn": per(af.rss, b.rss),
                "rss_kib_per_conn_connected": per(s.rss, b.rss),
                "rss_anon_kib_before": b.anon,
                "rss_anon_kib_after": af.anon,
                "rss_anon_kib_per_conn": per(af.anon, b.anon),
                "cpu_s_connect": round(s.cpu.saturating_sub(b.cpu).as_secs_f64(), 3),
                "cpu_s_hold": round(af.cpu.saturating_sub(s.cpu).as_secs_f64(), 3),
            })
        }
        (Some(pid), _, _) => json!({"pid": pid, "error": "broker gone"}),
        _ => Value::Null,
    }
}

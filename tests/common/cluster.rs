//! Replication test pieces (issue 18): a `triad` process the harness's `TestBroker` does
//! not fit (a follower), leader and follower configurations, the in-sync count read
//! from the leader's log, and [`FaultProxy`], a TCP proxy between nodes that passes,
//! delays, drops or blackholes the traffic.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::amqp::{connect, declare_durable, publish_numbered};
use super::{http_request, TestBroker, TEST_CONFIG};

/// How long a cluster step may take.
pub const T: Duration = Duration::from_secs(30);

/// A follower (or a broker on a directory it did not make) is a [`super::proc::Proc`].
pub use super::proc::Proc;

pub fn leader_config(min_insync: u32) -> String {
    format!(
        "{TEST_CONFIG}\n[cluster]\nrole = \"leader\"\nnode_id = \"l\"\nlisten = \"127.0.0.1:0\"\n\
         [replication]\nmode = \"sync\"\nmin_insync = {min_insync}\nreplica_lag_max = \"16 MiB\"\n"
    )
}

/// A follower of `leader` in a fresh directory under `root`, connected.
pub fn follower(root: &Path, name: &str, leader: SocketAddr) -> (Proc, PathBuf) {
    let (mut p, data) = start_follower(root, name, leader, "");
    p.wait_for_log("follower: connected to the leader", T);
    (p, data)
}

/// A follower of `leader` in a fresh directory under `root`, its config ending with
/// `extra` (e.g. a `[cluster.tls]` section); not waited for.
pub fn start_follower(root: &Path, name: &str, leader: SocketAddr, extra: &str) -> (Proc, PathBuf) {
    let config = root.join(format!("{name}.toml"));
    std::fs::write(
        &config,
        format!(
            "{TEST_CONFIG}\n[cluster]\nrole = \"follower\"\nnode_id = \"{name}\"\nleader = \"{leader}\"\n{extra}"
        ),
    )
    .unwrap();
    let data = root.join(name);
    (Proc::start(name, &data, &config, &[]), data)
}

pub fn in_sync_count(leader: &TestBroker) -> usize {
    let log = leader.log();
    log.matches("joined the in-sync set").count() - log.matches("left the in-sync set").count()
}

/// `GET path` as guest: the JSON answer.
pub fn api(http: SocketAddr, path: &str) -> Value {
    let resp = http_request(
        http,
        &format!(
            "GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\nConnection: close\r\n\r\n"
        ),
    );
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let body = resp.split_once("\r\n\r\n").unwrap().1;
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

pub fn node<'a>(status: &'a Value, name: &str) -> &'a Value {
    status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == name)
        .unwrap_or_else(|| panic!("no node {name} in {status}"))
}

/// Publishes `count` persistent messages with confirms; (confirmed, nacked).
pub fn publish(addr: SocketAddr, queue: &str, start: u64, count: u64) -> (usize, usize) {
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    let nacked = Arc::new(Mutex::new(BTreeSet::new()));
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let conn = connect(addr).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        declare_durable(&ch, queue).await.unwrap();
        publish_numbered(&ch, queue, start, count, &confirmed, Some(&nacked)).await;
    });
    let c = confirmed.lock().unwrap().len();
    let n = nacked.lock().unwrap().len();
    (c, n)
}

/// What a [`FaultProxy`] does to the traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forwards both ways.
    Pass,
    /// Forwards each chunk this long after it arrived.
    Delay(Duration),
    /// Closes every connection, and each new one at accept.
    Drop,
    /// Moves no byte and closes nothing (a partition): connections held, new ones
    /// accepted and held unanswered (closed once the mode changes).
    Blackhole,
}

/// Connections a proxy holds at once; more are closed at accept.
const PROXY_MAX_CONNECTIONS: usize = 32;
/// Bytes one direction of a connection holds in its delay line before it stops reading.
const PROXY_MAX_QUEUED: usize = 16 << 20;
/// How often idle loops look at the mode and the stop flag.
const PROXY_TICK: Duration = Duration::from_millis(5);

struct ProxyShared {
    target: SocketAddr,
    mode: Mutex<Fault>,
    stop: std::sync::atomic::AtomicBool,
    connections: std::sync::atomic::AtomicUsize,
}

impl ProxyShared {
    fn mode(&self) -> Fault {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn stopped(&self) -> bool {
        self.stop.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A TCP proxy on `127.0.0.1:0` in front of `target`, whose [`Fault`] the test sets:
/// one accept thread, two pump threads per connection (each direction reads with a short
/// timeout, keeps what it read in a bounded delay line, writes what is due). Stopped and
/// joined on drop.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<ProxyShared>,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl FaultProxy {
    pub fn start(target: SocketAddr) -> FaultProxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener.set_nonblocking(true).expect("non-blocking accept");
        let addr = listener.local_addr().expect("proxy address");
        let shared = Arc::new(ProxyShared {
            target,
            mode: Mutex::new(Fault::Pass),
            stop: Default::default(),
            connections: Default::default(),
        });
        let s = shared.clone();
        let accept = std::thread::spawn(move || proxy_accept(&s, &listener));
        FaultProxy {
            addr,
            shared,
            accept: Some(accept),
        }
    }

    /// Where to connect instead of the target.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn set(&self, mode: Fault) {
        *self.shared.mode.lock().unwrap_or_else(|e| e.into_inner()) = mode;
    }

    /// Connections being forwarded or held now.
    pub fn connections(&self) -> usize {
        self.shared
            .connections
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared
            .stop
            .store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn proxy_accept(s: &Arc<ProxyShared>, listener: &std::net::TcpListener) {
    use std::sync::atomic::Ordering::SeqCst;
    let mut pumps = Vec::new();
    // connections accepted during a blackhole: held, unanswered, until the mode changes
    let mut held: Vec<std::net::TcpStream> = Vec::new();
    while !s.stopped() {
        if s.mode() != Fault::Blackhole && !held.is_empty() {
            s.connections.fetch_sub(held.len(), SeqCst);
            held.clear();
        }
        let (client, _) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(PROXY_TICK);
                continue;
            }
            Err(_) => {
                std::thread::sleep(PROXY_TICK);
                continue;
            }
        };
        if s.connections.load(SeqCst) >= PROXY_MAX_CONNECTIONS {
            continue; // closed: over the bound
        }
        match s.mode() {
            Fault::Drop => continue,
            Fault::Blackhole => {
                s.connections.fetch_add(1, SeqCst);
                held.push(client);
                continue;
            }
            Fault::Pass | Fault::Delay(_) => {}
        }
        let Ok(upstream) = std::net::TcpStream::connect_timeout(&s.target, Duration::from_secs(5))
        else {
            continue;
        };
        let pair = (client.try_clone(), upstream.try_clone());
        let (Ok(client2), Ok(upstream2)) = pair else {
            continue;
        };
        s.connections.fetch_add(1, SeqCst);
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        for (from, to) in [(client, upstream), (upstream2, client2)] {
            let (s, done) = (s.clone(), done.clone());
            pumps.push(std::thread::spawn(move || {
                pump(&s, from, to, &done);
                // the second direction to end counts the connection closed
                if done.swap(true, SeqCst) {
                    s.connections.fetch_sub(1, SeqCst);
                }
            }));
        }
        pumps.retain(|p: &std::thread::JoinHandle<()>| !p.is_finished());
    }
    s.connections.fetch_sub(held.len(), SeqCst);
    for p in pumps {
        let _ = p.join();
    }
}

/// One direction of one connection, until either side closes, the mode is `Drop`, the
/// other direction ended, or the proxy stops.
fn pump(
    s: &ProxyShared,
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    done: &std::sync::atomic::AtomicBool,
) {
    use std::collections::VecDeque;
    use std::io::{Read, Write};
    let _ = from.set_read_timeout(Some(PROXY_TICK));
    let _ = to.set_write_timeout(Some(Duration::from_secs(10)));
    let mut line: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut queued = 0usize;
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let mode = s.mode();
        if s.stopped() || mode == Fault::Drop || done.load(std::sync::atomic::Ordering::SeqCst) {
            break;
        }
        if mode == Fault::Blackhole {
            // nothing read, nothing written, nothing closed
            std::thread::sleep(PROXY_TICK);
            continue;
        }
        if queued < PROXY_MAX_QUEUED {
            match from.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => {
                    // the mode when the bytes arrived, not when the read began
                    let delay = match s.mode() {
                        Fault::Delay(d) => d,
                        _ => Duration::ZERO,
                    };
                    queued += n;
                    line.push_back((Instant::now() + delay, chunk[..n].to_vec()));
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => break,
            }
        } else {
            std::thread::sleep(PROXY_TICK);
        }
        // what is due, unless a blackhole began meanwhile
        let now = Instant::now();
        while s.mode() != Fault::Blackhole && line.front().is_some_and(|(due, _)| *due <= now) {
            let Some((_, bytes)) = line.pop_front() else {
                break;
            };
            queued -= bytes.len();
            if to.write_all(&bytes).is_err() {
                let _ = from.shutdown(std::net::Shutdown::Both);
                return;
            }
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

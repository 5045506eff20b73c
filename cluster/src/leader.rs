//! The leader's side: a replication listener, one sender thread per follower (journal
//! then commitlog from the positions the follower stated, in chunks of at most
//! [`MAX_CHUNK`], read zero copy from the mapped segments), one reader thread per
//! follower (its acks), and the in-sync set that moves the store's
//! [`ReplicaGate`].
//!
//! In-sync set (Kafka's ISR, counted in bytes): a connected follower whose last ack is
//! at most `replica_lag_max` bytes behind the log's end is in sync; it leaves when it
//! falls further behind or disconnects (or is silent for [`SILENCE`]) and rejoins once
//! it is within the bound again. The replicated offset is the highest offset that
//! `min_insync - 1` in-sync followers all hold (the leader is the other one); with fewer
//! in sync, the gate refuses: waiting confirms fail instead of being sent.
//!
//! [`Leader::status`] tells what the leader knows of each replica (see [`crate::status`]);
//! a follower that disconnects stays in it, out of sync, until it reconnects (at most
//! [`MAX_DEPARTED`] are remembered). At most [`MAX_CONNECTIONS`] replication connections
//! are served at once (each holds two threads); more are closed at accept.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use triad_store::commitlog::CommitLog;
use triad_store::journal::{MetaJournal, RawJournal};
use triad_store::replica::ReplicaGate;
use triad_store::store::Store;

use crate::codec::{self, Frame, MAX_CHUNK, MAX_FRAME, VERSION};
use crate::epochs::EpochHistory;
use crate::status::{EndSamples, LeaderStatus, ReplicaStatus};
use crate::tls::Link;

/// A follower that sends nothing for this long is dropped (it acks every heartbeat).
pub const SILENCE: Duration = Duration::from_secs(5);
/// The leader sends a heartbeat after this long without data.
pub const HEARTBEAT: Duration = Duration::from_millis(500);
/// A follower must say Hello within this.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// Replication connections served at once (handshaking ones included).
pub const MAX_CONNECTIONS: usize = 64;
/// Disconnected followers remembered for [`Leader::status`].
pub const MAX_DEPARTED: usize = 64;

/// The leader's settings.
#[derive(Debug, Clone)]
pub struct LeaderConfig {
    /// This node's id (sent in Welcome).
    pub node_id: String,
    /// The replication listener's address.
    pub listen: String,
    /// The term: the election's epoch (0 for a static leader).
    pub epoch: u64,
    /// This node's epoch history, its own term included (empty for a static leader):
    /// what it answers a follower that last saw an older term.
    pub history: EpochHistory,
    /// Replicas (the leader included) that must hold a record before it is confirmed
    /// (sync mode) and that must be in sync for confirms to be given at all.
    pub min_insync: usize,
    /// A follower further behind than this leaves the in-sync set.
    pub replica_lag_max: u64,
    /// Mutual TLS ([`crate::tls::server_config`]): followers must present a certificate
    /// the configured CA signed. `None`: plain TCP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

/// What the leader knows of one follower (for logs and [`Leader::status`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowerStatus {
    pub node: String,
    pub peer: SocketAddr,
    /// Its durable commitlog end, as last acked.
    pub log_durable: u64,
    /// Its durable journal position, as last acked.
    pub journal_durable: u64,
    pub in_sync: bool,
}

struct Shared {
    store: Arc<Store>,
    gate: Arc<ReplicaGate>,
    cfg: LeaderConfig,
    followers: Mutex<HashMap<u64, FollowerStatus>>,
    /// Followers that disconnected, the latest last (see [`MAX_DEPARTED`]).
    departed: Mutex<VecDeque<FollowerStatus>>,
    /// (log end, time) samples, for lag in seconds.
    samples: Mutex<EndSamples>,
    /// Replication connections being served.
    connections: AtomicUsize,
    addr: SocketAddr,
    next_id: AtomicU64,
    stop: AtomicBool,
}

/// Reads a leader's [`LeaderStatus`] without keeping the leader (or its store) alive:
/// for the management API.
#[derive(Clone)]
pub struct StatusHandle(Weak<Shared>);

impl StatusHandle {
    /// The status; `None` once the leader is gone.
    pub fn status(&self) -> Option<LeaderStatus> {
        self.0.upgrade().map(|s| s.status())
    }
}

impl std::fmt::Debug for StatusHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StatusHandle")
    }
}

/// A running leader; [`Leader::stop`] (or dropping it) ends its threads.
pub struct Leader {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

impl Leader {
    /// Binds the replication listener and starts accepting followers. `gate` must be the
    /// one the store was opened with.
    pub fn start(
        store: Arc<Store>,
        gate: Arc<ReplicaGate>,
        cfg: LeaderConfig,
    ) -> std::io::Result<Leader> {
        let listener = TcpListener::bind(&cfg.listen)?;
        Leader::start_on(listener, store, gate, cfg)
    }

    /// [`Leader::start`] on a listener bound already (an elected node binds it before
    /// the election, to advertise its address); `cfg.listen` is not used.
    pub fn start_on(
        listener: TcpListener,
        store: Arc<Store>,
        gate: Arc<ReplicaGate>,
        cfg: LeaderConfig,
    ) -> std::io::Result<Leader> {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let end = store.commitlog().end();
        let shared = Arc::new(Shared {
            store,
            gate,
            cfg,
            followers: Mutex::new(HashMap::new()),
            departed: Mutex::new(VecDeque::new()),
            samples: Mutex::new(EndSamples::new(end, Instant::now())),
            connections: AtomicUsize::new(0),
            addr,
            next_id: AtomicU64::new(1),
            stop: AtomicBool::new(false),
        });
        shared.recompute();
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("repl-accept".into())
            .spawn(move || s.accept_loop(listener))?;
        Ok(Leader {
            shared,
            addr,
            accept: Some(accept),
        })
    }

    /// The gate this leader moves.
    pub fn gate(&self) -> Arc<ReplicaGate> {
        self.shared.gate.clone()
    }

    /// The replication listener's bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The followers connected now.
    pub fn followers(&self) -> Vec<FollowerStatus> {
        let mut v: Vec<_> = self.shared.lock().values().cloned().collect();
        v.sort_by(|a, b| a.node.cmp(&b.node));
        v
    }

    /// What the leader knows of its group now.
    pub fn status(&self) -> LeaderStatus {
        self.shared.status()
    }

    /// A handle that reads [`Leader::status`] while the leader runs.
    pub fn status_handle(&self) -> StatusHandle {
        StatusHandle(Arc::downgrade(&self.shared))
    }

    /// Stops accepting and shipping (connections close within [`HEARTBEAT`]).
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, FollowerStatus>> {
        self.followers.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn sample(&self) -> (u64, Instant) {
        let end = self.store.commitlog().end();
        let now = Instant::now();
        self.samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(end, now);
        (end, now)
    }

    fn status(&self) -> LeaderStatus {
        let (end, now) = self.sample();
        let (jend, _) = self.store.journal().position();
        let (replicated, refusing) = self.gate.state();
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let row = |f: &FollowerStatus, connected: bool| ReplicaStatus {
            node: f.node.clone(),
            peer: f.peer,
            connected,
            log_durable: f.log_durable,
            journal_durable: f.journal_durable,
            in_sync: connected && f.in_sync,
            lag_bytes: end.saturating_sub(f.log_durable),
            lag_seconds: samples.lag_seconds(f.log_durable, end, now),
        };
        let mut replicas: Vec<ReplicaStatus> = self.lock().values().map(|f| row(f, true)).collect();
        let departed = self.departed.lock().unwrap_or_else(|e| e.into_inner());
        for f in departed.iter() {
            if !replicas.iter().any(|r| r.node == f.node) {
                replicas.push(row(f, false));
            }
        }
        drop((samples, departed));
        replicas.sort_by(|a, b| a.node.cmp(&b.node));
        LeaderStatus {
            node_id: self.cfg.node_id.clone(),
            address: self.addr,
            epoch: self.cfg.epoch,
            sync: self.gate.is_sync(),
            min_insync: self.cfg.min_insync,
            replica_lag_max: self.cfg.replica_lag_max,
            log_end: end,
            journal_pos: jend,
            replicated: replicated.min(end),
            refusing,
            replicas,
        }
    }

    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        while !self.stop.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((sock, peer)) => {
                    if self.connections.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                        self.connections.fetch_sub(1, Ordering::SeqCst);
                        tracing::warn!(%peer, max = MAX_CONNECTIONS, "replication: too many connections; closing this one");
                        continue;
                    }
                    let me = self.clone();
                    let spawned =
                        std::thread::Builder::new()
                            .name("repl-send".into())
                            .spawn(move || {
                                me.clone().serve(sock, peer);
                                me.connections.fetch_sub(1, Ordering::SeqCst);
                            });
                    if let Err(e) = spawned {
                        self.connections.fetch_sub(1, Ordering::SeqCst);
                        tracing::warn!(error = %e, "replication: cannot start a sender");
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => {
                    tracing::debug!(error = %e, "replication: accept failed");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    /// One follower's connection, start to end.
    fn serve(self: Arc<Self>, sock: TcpStream, peer: SocketAddr) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        match self.session(id, sock, peer) {
            Ok(()) => {}
            Err(e) => tracing::info!(%peer, error = %e, "replication: follower connection ended"),
        }
        let gone = self.lock().remove(&id);
        if let Some(mut f) = gone {
            if f.in_sync {
                tracing::warn!(node = %f.node, "replication: replica left the in-sync set (disconnected)");
            }
            tracing::info!(node = %f.node, %peer, "replication: follower disconnected");
            f.in_sync = false;
            let mut d = self.departed.lock().unwrap_or_else(|e| e.into_inner());
            d.retain(|o| o.node != f.node);
            if d.len() >= MAX_DEPARTED {
                d.pop_front();
            }
            d.push_back(f);
        }
        self.recompute();
    }

    /// Why a follower's Hello is refused, if it is (after its epoch's truncation).
    fn refusal(
        &self,
        version: u16,
        log_end: u64,
        journal_pos: u64,
        segment_size: u64,
    ) -> Option<String> {
        let log = self.store.commitlog();
        let (jend, _) = self.store.journal().position();
        if version != VERSION {
            Some(format!(
                "protocol version {version}; this leader speaks {VERSION}"
            ))
        } else if segment_size != log.segment_size() {
            Some(format!(
                "segment size {segment_size} differs from the leader's {}",
                log.segment_size()
            ))
        } else if log_end > log.end() {
            Some(format!(
                "follower's log ends at {log_end}, past the leader's end {} (a divergent copy: \
                 start the follower from an empty data directory)",
                log.end()
            ))
        } else if journal_pos > jend {
            Some(format!(
                "follower's journal is at {journal_pos}, past the leader's {jend} (a divergent \
                 copy: start the follower from an empty data directory)"
            ))
        } else if let Err(e) = log.read_raw(log_end, 1) {
            Some(format!(
                "the leader no longer holds the follower's log end {log_end} ({e}); start the \
                 follower from an empty data directory taken from a copy of the leader's"
            ))
        } else {
            None
        }
    }

    /// Leader-epoch truncation: where a follower whose last epoch is `epoch` and whose
    /// copy ends at (`log_end`, `journal_pos`) resumes. What it holds past the end of its
    /// last epoch in this leader's history was written by a leader that lost that term.
    /// A follower that has seen a later term than this leader's is an error: this leader
    /// is stale (about to be fenced), and closing makes the follower look again.
    fn resume_point(
        &self,
        node: &str,
        epoch: u64,
        log_end: u64,
        journal_pos: u64,
    ) -> std::io::Result<(u64, u64)> {
        if epoch > self.cfg.epoch {
            return Err(invalid(&format!(
                "follower {node} has seen epoch {epoch}, later than this leader's {}",
                self.cfg.epoch
            )));
        }
        let cut = if epoch < self.cfg.epoch {
            self.cfg.history.end_of(epoch)
        } else {
            None
        };
        let log_from = cut.map_or(log_end, |(l, _)| l.min(log_end));
        let journal_from = match cut {
            Some((_, j)) if journal_pos > j => 0,
            _ => journal_pos,
        };
        if (log_from, journal_from) != (log_end, journal_pos) {
            tracing::info!(%node, epoch, log_end, log_from, journal_pos, journal_from,
                "replication: the follower holds a suffix of an older term; it truncates");
        }
        Ok((log_from, journal_from))
    }

    fn session(
        self: &Arc<Self>,
        id: u64,
        sock: TcpStream,
        peer: SocketAddr,
    ) -> std::io::Result<()> {
        sock.set_nodelay(true)?;
        sock.set_nonblocking(false)?;
        sock.set_read_timeout(Some(HANDSHAKE))?;
        sock.set_write_timeout(Some(SILENCE))?;
        let mut sock = match &self.cfg.tls {
            Some(cfg) => Link::accept(sock, cfg.clone())?,
            None => Link::plain(sock),
        };
        let mut buf = BytesMut::with_capacity(4096);
        let hello = read_frame(&mut sock, &mut buf)?;
        let Frame::Hello {
            version,
            node,
            epoch,
            log_end,
            journal_pos,
            segment_size,
        } = hello
        else {
            return Err(invalid("the first frame is not Hello"));
        };
        let (log_end, journal_pos) = self.resume_point(&node, epoch, log_end, journal_pos)?;
        let refusal = self.refusal(version, log_end, journal_pos, segment_size);
        if refusal.is_none() && self.lock().values().any(|f| f.node == node) {
            // transient (its previous connection is not timed out yet): closed without
            // a refusal, so the follower retries rather than stops
            return Err(invalid(&format!(
                "a follower named {node:?} is already connected"
            )));
        }
        if let Some(reason) = refusal {
            tracing::warn!(%node, %peer, %reason, "replication: follower refused");
            send(&mut sock, &Frame::Refused { reason })?;
            return Ok(());
        }
        send(
            &mut sock,
            &Frame::Welcome {
                node: self.cfg.node_id.clone(),
                epoch: self.cfg.epoch,
                log_from: log_end,
                journal_from: journal_pos,
                history: self.cfg.history.entries().to_vec(),
            },
        )?;
        tracing::info!(%node, %peer, log_end, journal_pos, "replication: follower connected");
        self.departed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|f| f.node != node);
        self.lock().insert(
            id,
            FollowerStatus {
                node: node.clone(),
                peer,
                log_durable: log_end,
                journal_durable: journal_pos,
                in_sync: false,
            },
        );
        self.recompute();

        // acks on a thread of their own; it ends when the socket does
        let alive = Arc::new(AtomicBool::new(true));
        let reader = {
            let me = self.clone();
            let mut rsock = sock.try_clone()?;
            rsock.socket().set_read_timeout(Some(SILENCE))?;
            let alive = alive.clone();
            std::thread::Builder::new()
                .name("repl-acks".into())
                .spawn(move || {
                    let r = me.read_acks(id, &mut rsock, buf);
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "replication: ack reader ended");
                    }
                    alive.store(false, Ordering::SeqCst);
                    let _ = rsock.socket().shutdown(std::net::Shutdown::Both);
                })?
        };
        let res = self.ship(&mut sock, log_end, journal_pos, &alive);
        let _ = sock.socket().shutdown(std::net::Shutdown::Both);
        let _ = reader.join();
        res
    }

    fn read_acks(&self, id: u64, sock: &mut Link, mut buf: BytesMut) -> std::io::Result<()> {
        loop {
            match read_frame(sock, &mut buf)? {
                Frame::Ack {
                    log_durable,
                    journal_durable,
                } => {
                    if let Some(f) = self.lock().get_mut(&id) {
                        f.log_durable = f.log_durable.max(log_durable);
                        f.journal_durable = f.journal_durable.max(journal_durable);
                    }
                    self.sample();
                    self.recompute();
                }
                other => {
                    return Err(invalid(&format!(
                        "unexpected frame from a follower: {other:?}"
                    )))
                }
            }
        }
    }

    /// The sender loop: each round ships the journal up to its position, then the log up
    /// to the end read *before* that position (so every record a shipped message needs,
    /// a queue's registration, is shipped first), then waits for appends.
    fn ship(
        &self,
        sock: &mut Link,
        mut log_sent: u64,
        mut journal_sent: u64,
        alive: &AtomicBool,
    ) -> std::io::Result<()> {
        let log = self.store.commitlog();
        let journal = self.store.journal();
        let mut out = BytesMut::with_capacity(MAX_FRAME);
        let mut last = Instant::now();
        let mut retained = Retained::default();
        while !self.stop.load(Ordering::SeqCst) && alive.load(Ordering::SeqCst) {
            if let Some(f) = retained.changed(log, journal) {
                push(&mut out, &f);
                flush(sock, &mut out)?;
            }
            let (end, _) = self.sample();
            let (jend, _) = journal.position();
            let mut sent = false;
            while journal_sent < jend {
                match journal
                    .read_raw(journal_sent, MAX_CHUNK)
                    .map_err(store_err)?
                {
                    None => break,
                    Some(RawJournal::Records { pos, bytes }) => {
                        journal_sent = pos + bytes.len() as u64;
                        push(
                            &mut out,
                            &Frame::Journal {
                                pos,
                                data: bytes.into(),
                            },
                        );
                    }
                    Some(RawJournal::Snapshot { pos, bytes }) => {
                        let total = bytes.len() as u64;
                        let bytes = bytes::Bytes::from(bytes);
                        let mut at = 0usize;
                        loop {
                            let to = (at + MAX_CHUNK).min(bytes.len());
                            push(
                                &mut out,
                                &Frame::Snapshot {
                                    pos,
                                    offset: at as u64,
                                    total,
                                    data: bytes.slice(at..to),
                                },
                            );
                            flush(sock, &mut out)?;
                            at = to;
                            if at >= bytes.len() {
                                break;
                            }
                        }
                        journal_sent = pos;
                    }
                }
                flush(sock, &mut out)?;
                sent = true;
            }
            while log_sent < end {
                let data = log
                    .read_raw(log_sent, (end - log_sent).min(MAX_CHUNK as u64))
                    .map_err(store_err)?;
                if data.is_empty() {
                    break;
                }
                let offset = log_sent;
                log_sent += data.len() as u64;
                push(&mut out, &Frame::Log { offset, data });
                flush(sock, &mut out)?;
                sent = true;
            }
            if sent {
                last = Instant::now();
                continue;
            }
            if last.elapsed() >= HEARTBEAT {
                push(
                    &mut out,
                    &Frame::Heartbeat {
                        log_end: end,
                        journal_pos: jend,
                    },
                );
                flush(sock, &mut out)?;
                last = Instant::now();
                // lag is also judged when nothing is acked
                self.recompute();
            }
            self.gate.wait_appended(log_sent, Duration::from_millis(20));
        }
        Ok(())
    }

    /// Recomputes the in-sync set and moves the gate.
    fn recompute(&self) {
        let end = self.store.commitlog().end();
        let need = self.cfg.min_insync.saturating_sub(1);
        let mut fs = self.lock();
        let mut acks = Vec::with_capacity(fs.len());
        for f in fs.values_mut() {
            let in_sync = end.saturating_sub(f.log_durable) <= self.cfg.replica_lag_max;
            if in_sync != f.in_sync {
                f.in_sync = in_sync;
                if in_sync {
                    tracing::info!(node = %f.node, "replication: replica joined the in-sync set");
                } else {
                    tracing::warn!(node = %f.node, lag = end.saturating_sub(f.log_durable),
                        "replication: replica left the in-sync set");
                }
            }
            if in_sync {
                acks.push(f.log_durable);
            }
        }
        let in_sync = acks.len();
        self.gate
            .set_retention_floor(fs.values().map(|f| f.log_durable).min());
        drop(fs);
        acks.sort_unstable_by(|a, b| b.cmp(a));
        if need == 0 {
            self.gate.set(u64::MAX, None);
        } else if let Some(&r) = acks.get(need - 1) {
            self.gate.set(r, None);
        } else {
            self.gate.set(
                0,
                Some(format!(
                    "{} of {} replicas in sync (replication.min_insync)",
                    in_sync + 1,
                    self.cfg.min_insync
                )),
            );
        }
    }
}

/// What a sender last told its follower about the segments this leader holds; see
/// `Frame::Retained`.
#[derive(Default)]
struct Retained {
    sent: Vec<u64>,
    checked: Option<Instant>,
}

impl Retained {
    /// A `Retained` frame when the segments held changed since the last one (the first
    /// round always sends one, so a follower that was away learns of what went in the
    /// meantime). Looked at every [`RETAINED_EVERY`] at most: one list of the segments,
    /// nothing per record.
    fn changed(&mut self, log: &CommitLog, journal: &MetaJournal) -> Option<Frame> {
        if self.checked.is_some_and(|at| at.elapsed() < RETAINED_EVERY) {
            return None;
        }
        self.checked = Some(Instant::now());
        let held: Vec<u64> = log.segment_list().iter().map(|s| s.start()).collect();
        if held == self.sent || held.len() > codec::MAX_RETAINED {
            return None;
        }
        // the ends are read after the list: whatever let a segment go (its copies, the
        // ack states journaled at its checkpoint) is below them
        let log_end = log.end();
        let (journal_pos, _) = journal.position();
        self.sent = held.clone();
        Some(Frame::Retained {
            log_end,
            journal_pos,
            segments: held,
        })
    }
}

/// How often a sender looks whether retention deleted segments.
const RETAINED_EVERY: Duration = Duration::from_millis(200);

fn invalid(msg: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.to_string())
}

fn store_err(e: triad_store::StoreError) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

fn push(out: &mut BytesMut, f: &Frame) {
    codec::encode(f, out);
}

fn flush(sock: &mut impl Write, out: &mut BytesMut) -> std::io::Result<()> {
    if !out.is_empty() {
        sock.write_all(out)?;
        out.clear();
    }
    Ok(())
}

fn send(sock: &mut impl Write, f: &Frame) -> std::io::Result<()> {
    let mut out = BytesMut::new();
    codec::encode(f, &mut out);
    sock.write_all(&out)
}

/// Reads one whole frame (blocking; the socket's read timeout applies).
pub fn read_frame(sock: &mut impl Read, buf: &mut BytesMut) -> std::io::Result<Frame> {
    loop {
        match codec::decode(buf, MAX_FRAME) {
            Ok(Some(f)) => return Ok(f),
            Ok(None) => {}
            Err(e) => return Err(invalid(&e.to_string())),
        }
        let mut chunk = [0u8; 64 << 10];
        let n = sock.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "peer closed the connection",
            ));
        }
        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
    }
}

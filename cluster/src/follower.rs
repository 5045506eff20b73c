//! The follower's side: connect to the leader, say where this copy ends, write what the
//! leader ships at the same offsets, make it durable, acknowledge. Reconnects (with a
//! bounded back-off) when the connection drops; stops for good when the leader refuses
//! it or when what arrives cannot be written (a gap, a differing overlap): those need an
//! operator, not a retry.
//!
//! Batching: every frame already read is written before one `sync` and one `Ack`, so a
//! burst of chunks costs one fsync (the follower's group commit).

use std::io::Write;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use triad_store::replica::ReplicaStore;

use crate::codec::{self, Frame, MAX_FRAME, VERSION};
use crate::epochs::{EpochError, EpochHistory};
use crate::leader::{read_frame, SILENCE};
use crate::tls::Link;

/// The follower's settings.
#[derive(Debug, Clone)]
pub struct FollowerConfig {
    pub node_id: String,
    /// The leader's replication address, `host:port`.
    pub leader: String,
    pub data_dir: PathBuf,
    pub segment_size: u64,
    /// Mutual TLS ([`crate::tls::client_config`]): the leader's certificate is verified
    /// against the configured CA for the host of `leader`. `None`: plain TCP.
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

/// Why a follower stopped for good.
#[derive(Debug, thiserror::Error)]
pub enum FollowerError {
    #[error("cannot open the follower's data directory: {0}")]
    Open(#[source] triad_store::StoreError),
    #[error("the leader refused this follower: {0}")]
    Refused(String),
    #[error("cannot write what the leader shipped: {0}")]
    Write(#[source] triad_store::StoreError),
    #[error("cluster TLS: {0}")]
    Tls(String),
    #[error("the epoch history: {0}")]
    Epochs(#[source] EpochError),
}

/// Where the follower stands (durable), readable while it runs.
#[derive(Debug, Default)]
pub struct Progress {
    pub log_durable: AtomicU64,
    pub journal_durable: AtomicU64,
    pub connected: AtomicBool,
    /// The connection to the leader, for [`Progress::interrupt`].
    sock: std::sync::Mutex<Option<TcpStream>>,
}

impl Progress {
    /// Ends the connection to the leader now (a blocked read returns), so that a `stop`
    /// set just before is seen without waiting for the leader's next frame.
    pub fn interrupt(&self) {
        let s = self.sock.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = s.as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// One connection's end.
enum Ended {
    /// Reconnect.
    Dropped(std::io::Error),
    /// Stop.
    Fatal(FollowerError),
}

/// Runs the follower until `stop` is set (then `Ok`) or a fatal error.
pub fn run(
    cfg: &FollowerConfig,
    stop: &AtomicBool,
    progress: &Arc<Progress>,
) -> Result<(), FollowerError> {
    let mut store =
        ReplicaStore::open(&cfg.data_dir, cfg.segment_size).map_err(FollowerError::Open)?;
    let mut history = EpochHistory::load(&cfg.data_dir).map_err(FollowerError::Epochs)?;
    tracing::info!(
        data_dir = %cfg.data_dir.display(), log_end = store.log_end(),
        journal_pos = store.journal_pos(), leader = %cfg.leader, "follower ready"
    );
    progress
        .log_durable
        .store(store.log_end(), Ordering::SeqCst);
    progress
        .journal_durable
        .store(store.journal_pos(), Ordering::SeqCst);
    let mut backoff = Duration::from_millis(100);
    while !stop.load(Ordering::SeqCst) {
        match session(cfg, &mut store, &mut history, stop, progress) {
            Ok(()) => break,
            Err(Ended::Fatal(e)) => return Err(e),
            Err(Ended::Dropped(e)) => {
                progress.connected.store(false, Ordering::SeqCst);
                tracing::info!(leader = %cfg.leader, error = %e, "follower: not connected to the leader; retrying");
                let until = std::time::Instant::now() + backoff;
                while !stop.load(Ordering::SeqCst) && std::time::Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(20));
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
    Ok(())
}

fn connect(addr: &str) -> std::io::Result<TcpStream> {
    let mut last = None;
    for a in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, Duration::from_secs(5)) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other(format!("{addr} resolves to nothing"))))
}

fn session(
    cfg: &FollowerConfig,
    store: &mut ReplicaStore,
    history: &mut EpochHistory,
    stop: &AtomicBool,
    progress: &Progress,
) -> Result<(), Ended> {
    let drop_ = Ended::Dropped;
    let sock = connect(&cfg.leader).map_err(drop_)?;
    sock.set_nodelay(true).map_err(drop_)?;
    *progress.sock.lock().unwrap_or_else(|e| e.into_inner()) = sock.try_clone().ok();
    if stop.load(Ordering::SeqCst) {
        return Ok(());
    }
    // the leader heartbeats every HEARTBEAT; silence for longer means it is gone
    sock.set_read_timeout(Some(SILENCE)).map_err(drop_)?;
    sock.set_write_timeout(Some(SILENCE)).map_err(drop_)?;
    let mut sock = match &cfg.tls {
        Some(tls) => {
            let name = crate::tls::server_name(&cfg.leader)
                .map_err(|e| Ended::Fatal(FollowerError::Tls(e.to_string())))?;
            Link::connect(sock, tls.clone(), name).map_err(drop_)?
        }
        None => Link::plain(sock),
    };
    let (log_end, journal_pos) = store
        .sync()
        .map_err(|e| Ended::Fatal(FollowerError::Write(e)))?;
    let mut out = BytesMut::new();
    codec::encode(
        &Frame::Hello {
            version: VERSION,
            node: cfg.node_id.clone(),
            epoch: history.last_epoch(),
            log_end,
            journal_pos,
            segment_size: store.segment_size(),
        },
        &mut out,
    );
    sock.write_all(&out).map_err(drop_)?;
    let mut buf = BytesMut::with_capacity(64 << 10);
    match read_frame(&mut sock, &mut buf).map_err(drop_)? {
        Frame::Welcome {
            node,
            epoch,
            log_from,
            journal_from,
            history: theirs,
        } => {
            let fatal = |e| Ended::Fatal(FollowerError::Write(e));
            // this connection's leader says what it holds afresh
            store.forget_retained();
            truncate_to(
                store,
                (log_end, journal_pos),
                (log_from, journal_from),
                epoch,
            )?;
            store.sync().map_err(fatal)?;
            history
                .replace(&cfg.data_dir, &theirs)
                .map_err(|e| Ended::Fatal(FollowerError::Epochs(e)))?;
            tracing::info!(leader = %node, epoch, log_end = log_from, journal_pos = journal_from,
                "follower: connected to the leader");
        }
        Frame::Refused { reason } => return Err(Ended::Fatal(FollowerError::Refused(reason))),
        other => {
            return Err(Ended::Dropped(std::io::Error::other(format!(
                "unexpected frame from the leader: {other:?}"
            ))))
        }
    }
    progress.connected.store(true, Ordering::SeqCst);
    stream(store, &mut sock, &mut buf, stop, progress)
}

/// Cuts what this copy holds past where the leader ships from (`from`, its Welcome),
/// durably: the divergent suffix of an older term. The journal can only be reset whole.
fn truncate_to(
    store: &mut ReplicaStore,
    (log_end, journal_pos): (u64, u64),
    (log_from, journal_from): (u64, u64),
    epoch: u64,
) -> Result<(), Ended> {
    let fatal = |e| Ended::Fatal(FollowerError::Write(e));
    if log_from > log_end || journal_from > journal_pos {
        return Err(Ended::Dropped(std::io::Error::other(format!(
            "the leader would ship from {log_from}/{journal_from}, past this copy's \
             {log_end}/{journal_pos}"
        ))));
    }
    // truncation first, durable, and only then the leader's history: a crash in
    // between states the old epoch again and gets the same answer
    if log_from < log_end {
        store.truncate_log(log_from).map_err(fatal)?;
        tracing::info!(
            from = log_end,
            to = log_from,
            epoch,
            "follower: truncated a divergent commitlog suffix of an older term"
        );
    }
    if journal_from < journal_pos {
        if journal_from != 0 {
            return Err(Ended::Dropped(std::io::Error::other(format!(
                "the leader asks to cut the journal at {journal_from}; only a reset \
                 to 0 is supported"
            ))));
        }
        store.reset_journal().map_err(fatal)?;
        tracing::info!(
            from = journal_pos,
            epoch,
            "follower: dropped a journal copy that diverged in an older term; refetching"
        );
    }
    Ok(())
}

/// Writes what the leader ships until `stop`: each round one frame (blocking), then
/// every frame already buffered, then one sync and, if anything changed (or on a
/// heartbeat), one ack.
fn stream(
    store: &mut ReplicaStore,
    sock: &mut Link,
    buf: &mut BytesMut,
    stop: &AtomicBool,
    progress: &Progress,
) -> Result<(), Ended> {
    let drop_ = Ended::Dropped;
    let mut out = BytesMut::new();
    let fatal = |e| Ended::Fatal(FollowerError::Write(e));
    let mut acked = (u64::MAX, u64::MAX);
    while !stop.load(Ordering::SeqCst) {
        // one frame (blocking), then every frame already buffered, then one sync + ack
        let first = read_frame(sock, buf).map_err(drop_)?;
        let mut heartbeat = apply(store, first).map_err(fatal)?;
        loop {
            match codec::decode(buf, MAX_FRAME) {
                Ok(Some(f)) => heartbeat |= apply(store, f).map_err(fatal)?,
                Ok(None) => break,
                Err(e) => return Err(Ended::Dropped(std::io::Error::other(e.to_string()))),
            }
        }
        let durable = store.sync().map_err(fatal)?;
        progress.log_durable.store(durable.0, Ordering::SeqCst);
        progress.journal_durable.store(durable.1, Ordering::SeqCst);
        if durable != acked || heartbeat {
            out.clear();
            codec::encode(
                &Frame::Ack {
                    log_durable: durable.0,
                    journal_durable: durable.1,
                },
                &mut out,
            );
            sock.write_all(&out).map_err(drop_)?;
            acked = durable;
        }
    }
    Ok(())
}

/// Writes one shipped frame; returns whether it was a heartbeat (answered even if
/// nothing changed).
fn apply(store: &mut ReplicaStore, f: Frame) -> triad_store::Result<bool> {
    match f {
        Frame::Log { offset, data } => store.write_log(offset, &data)?,
        Frame::Journal { pos, data } => store.write_journal(pos, &data)?,
        Frame::Snapshot {
            pos,
            offset,
            total,
            data,
        } => {
            if store.snapshot_chunk(pos, offset, total, &data)? {
                tracing::info!(
                    position = pos,
                    bytes = total,
                    "follower: installed the leader's journal snapshot"
                );
            }
        }
        Frame::Retained {
            log_end,
            journal_pos,
            segments,
        } => store.note_retained(segments, log_end, journal_pos),
        Frame::Heartbeat { .. } => return Ok(true),
        other => {
            return Err(triad_store::StoreError::Invalid(format!(
                "unexpected frame from the leader: {other:?}"
            )))
        }
    }
    Ok(false)
}

//! The broker's side of replication (issue 18): the gate a leader's store is opened
//! with, the leader's replication listener, the follower mode (the process keeps a copy
//! of its leader's logs and serves no client) and, in phase 2, the roles an election on
//! etcd gives ([`join`]): campaign; follow the winner while it holds the election key;
//! take over when the key is gone; as the leader, renew the lease and, when that fails,
//! fence the store and leave (re-exec: [`Node::finish`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use triad_cluster::codec::EpochEntry;
use triad_cluster::election::{
    candidates_prefix, election_key, Campaign, Etcd, EtcdError, Holder, NodeInfo,
};
use triad_cluster::epochs::EpochHistory;
use triad_cluster::follower::{FollowerConfig, Progress};
use triad_cluster::leader::{Leader, LeaderConfig};
use triad_store::replica::{ReplicaGate, ReplicaStore};
use triad_store::store::Store;

use crate::config::{ClusterRole, Config, ReplicationMode};
use crate::forward::Forwarding;

/// Whether this configuration makes the process a follower.
pub fn is_follower(config: &Config) -> bool {
    config
        .cluster
        .as_ref()
        .is_some_and(|c| c.role == Some(ClusterRole::Follower))
}

/// A leader's gate (for `StoreConfig::replica`); `None` unless `[cluster] role = "leader"`.
pub fn leader_gate(config: &Config) -> Option<Arc<ReplicaGate>> {
    let c = config.cluster.as_ref()?;
    if c.role != Some(ClusterRole::Leader) {
        return None;
    }
    let r = config.replication.clone().unwrap_or_default();
    Some(ReplicaGate::new(r.mode == ReplicationMode::Sync))
}

/// Starts the leader's replication listener and logs
/// `listening proto=replication addr=...`.
pub fn start_leader(
    config: &Config,
    store: Arc<Store>,
    gate: Arc<ReplicaGate>,
) -> anyhow::Result<Leader> {
    let c = config
        .cluster
        .as_ref()
        .context("a leader needs [cluster]")?;
    let r = config.replication.clone().unwrap_or_default();
    let listen = c.listen.clone().unwrap_or_default();
    let leader = Leader::start(
        store,
        gate,
        LeaderConfig {
            node_id: c.node_id.clone(),
            listen: listen.clone(),
            epoch: 0,
            history: EpochHistory::default(),
            min_insync: r.min_insync as usize,
            replica_lag_max: r.replica_lag_max.bytes(),
            tls: server_tls(config)?,
        },
    )
    .with_context(|| format!("cannot listen for replication on {listen}"))?;
    info!(
        proto = %"replication",
        addr = %leader.local_addr(),
        tls = c.tls.is_some(),
        mode = ?r.mode,
        min_insync = r.min_insync,
        "listening"
    );
    Ok(leader)
}

/// The leader's side of `[cluster.tls]` (`None`: plain TCP).
fn server_tls(config: &Config) -> anyhow::Result<Option<Arc<rustls::ServerConfig>>> {
    let files = config
        .cluster
        .as_ref()
        .and_then(|c| c.tls.as_ref()?.files());
    Ok(match files {
        Some(f) => Some(triad_cluster::tls::server_config(&f)?),
        None => None,
    })
}

/// A follower's side of `[cluster.tls]` (`None`: plain TCP).
fn client_tls(config: &Config) -> anyhow::Result<Option<Arc<rustls::ClientConfig>>> {
    let files = config
        .cluster
        .as_ref()
        .and_then(|c| c.tls.as_ref()?.files());
    Ok(match files {
        Some(f) => Some(triad_cluster::tls::client_config(&f)?),
        None => None,
    })
}

/// Follower mode: copies the leader's logs into the data directory until SIGTERM or
/// SIGINT (or a fatal error, such as the leader refusing this follower).
pub fn run_follower(config: &Config) -> anyhow::Result<()> {
    let c = config
        .cluster
        .as_ref()
        .context("a follower needs [cluster]")?;
    let cfg = FollowerConfig {
        node_id: c.node_id.clone(),
        leader: c.leader.clone().unwrap_or_default(),
        data_dir: config.store.data_dir.clone(),
        segment_size: config.store.segment_size.bytes(),
        tls: client_tls(config)?,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
        let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(Progress::default());
        let mut task = {
            let (stop, progress) = (stop.clone(), progress.clone());
            tokio::task::spawn_blocking(move || {
                triad_cluster::follower::run(&cfg, &stop, &progress)
            })
        };
        let finished = tokio::select! {
            r = &mut task => Some(r),
            _ = sigterm.recv() => None,
            _ = sigint.recv() => None,
        };
        let r = match finished {
            Some(r) => r,
            None => {
                info!("shutdown requested");
                stop.store(true, Ordering::SeqCst);
                task.await
            }
        };
        match r.context("the follower's thread failed")? {
            Ok(()) => {
                info!("stopped cleanly");
                Ok(())
            }
            Err(e) => Err(anyhow::anyhow!(e).context("the follower stopped")),
        }
    })
}

// ---------------------------------------------------------------------------------------
// Phase 2: roles from the election on etcd.

/// What [`join`] leaves the broker to run: a standalone broker, a static leader, or the
/// elected leader of a term.
pub struct Node {
    gate: Option<Arc<ReplicaGate>>,
    term: Option<Term>,
    lost: CancellationToken,
    /// An elected leader's client addresses, for the keeper to put in the election key.
    clients: Option<tokio::sync::watch::Sender<Vec<(String, String)>>>,
}

/// What the serving broker tells the cluster and hears from it ([`Node::serving`]).
#[derive(Clone)]
pub struct Serving {
    lost: CancellationToken,
    clients: Option<tokio::sync::watch::Sender<Vec<(String, String)>>>,
    /// The host that stands for an unspecified listen address (0.0.0.0, ::).
    host: String,
}

impl Serving {
    /// Cancelled when this node lost its leadership (see [`Node::lost`]).
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// The client listeners are bound: an elected leader adds their addresses to the
    /// election key's value (a listener on every interface is given with the host of
    /// this node's advertised replication address).
    pub fn clients_bound(&self, bound: &[(crate::listener::Proto, std::net::SocketAddr)]) {
        let Some(tx) = &self.clients else { return };
        let addrs = bound
            .iter()
            .map(|(p, a)| {
                let addr = if a.ip().is_unspecified() {
                    format!("{}:{}", self.host, a.port())
                } else {
                    a.to_string()
                };
                (p.to_string(), addr)
            })
            .collect();
        let _ = tx.send(addrs);
    }
}

/// A won term: its epoch, the replication listener bound before the election, and the
/// thread that renews the lease.
struct Term {
    epoch: u64,
    /// This node's advertised replication address.
    advertised: String,
    /// This node's epoch history, this term included.
    history: EpochHistory,
    node_id: String,
    listener: Option<std::net::TcpListener>,
    keeper: Option<std::thread::JoinHandle<()>>,
    stop_keeper: CancellationToken,
}

impl Node {
    fn plain(gate: Option<Arc<ReplicaGate>>) -> Node {
        Node {
            gate,
            term: None,
            lost: CancellationToken::new(),
            clients: None,
        }
    }

    /// The serving broker's side of this node.
    pub fn serving(&self) -> Serving {
        let host = self
            .term
            .as_ref()
            .and_then(|t| t.advertised.rsplit_once(':'))
            .map(|(h, _)| h.to_owned())
            .unwrap_or_default();
        Serving {
            lost: self.lost.clone(),
            clients: self.clients.clone(),
            host,
        }
    }

    /// The gate the store is to be opened with (`StoreConfig::replica`).
    pub fn gate(&self) -> Option<Arc<ReplicaGate>> {
        self.gate.clone()
    }

    /// This term's epoch (0 when not elected).
    pub fn epoch(&self) -> u64 {
        self.term.as_ref().map_or(0, |t| t.epoch)
    }

    /// Cancelled when this node lost its leadership (the gate is fenced already): the
    /// broker stops serving, closes the store, then calls [`Node::finish`].
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Starts the replication listener of a leader (static or elected) on `store`, which
    /// must have been opened with [`Node::gate`].
    pub fn start_leader(
        &mut self,
        config: &Config,
        store: Arc<Store>,
    ) -> anyhow::Result<Option<Leader>> {
        let Some(gate) = self.gate.clone() else {
            return Ok(None);
        };
        let Some(term) = self.term.as_mut() else {
            return start_leader(config, store, gate).map(Some);
        };
        let r = config.replication.clone().unwrap_or_default();
        let listener = term
            .listener
            .take()
            .context("the replication listener was started already")?;
        let leader = Leader::start_on(
            listener,
            store,
            gate,
            LeaderConfig {
                node_id: term.node_id.clone(),
                listen: String::new(),
                epoch: term.epoch,
                history: term.history.clone(),
                min_insync: r.min_insync as usize,
                replica_lag_max: r.replica_lag_max.bytes(),
                tls: server_tls(config)?,
            },
        )
        .context("cannot start the replication listener")?;
        info!(
            proto = %"replication",
            addr = %leader.local_addr(),
            mode = ?r.mode,
            min_insync = r.min_insync,
            epoch = term.epoch,
            "listening"
        );
        Ok(Some(leader))
    }

    /// The end, once the store is closed. A leader that lost its term comes back
    /// through start-up as a follower: the process re-executes itself with the same
    /// arguments (returns only if that fails). Otherwise the lease is revoked, so the
    /// others elect a leader at once rather than after the TTL.
    ///
    /// Why re-exec rather than demote in place: every handle the old term holds (the
    /// store, the runtime, connection tasks, the replication threads) is gone with the
    /// process image, the data directory's lock is released with its descriptor (all are
    /// close-on-exec), and the way back is the start-up path the tests already cover.
    pub fn finish(mut self) -> anyhow::Result<()> {
        let lost = self.lost.is_cancelled();
        if let Some(mut t) = self.term.take() {
            t.stop();
        }
        if !lost {
            return Ok(());
        }
        use std::os::unix::process::CommandExt;
        let exe = std::env::current_exe().context("cannot find this executable")?;
        info!("restarting as a follower (re-exec)");
        let err = std::process::Command::new(exe)
            .args(std::env::args_os().skip(1))
            .exec();
        Err(anyhow::anyhow!(err).context("cannot re-execute to rejoin as a follower"))
    }
}

impl Term {
    /// Ends the keeper; it revokes the lease unless the term is lost already.
    fn stop(&mut self) {
        self.stop_keeper.cancel();
        if let Some(k) = self.keeper.take() {
            let _ = k.join();
        }
    }
}

impl Drop for Term {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // an error path: nothing more may be confirmed before the lease is let go
        if let Some(mut t) = self.term.take() {
            if let Some(g) = &self.gate {
                g.fence("the leader is stopping");
            }
            t.stop();
        }
    }
}

/// Takes this node's place in its group: a standalone broker or a static leader get a
/// [`Node`] at once; a static follower follows until stopped (`None`); an elected node
/// campaigns, follows whoever leads, and returns the [`Node`] of the term it wins
/// (`None` when stopped by a signal first).
pub fn join(config: &Config) -> anyhow::Result<Option<Node>> {
    let Some(c) = &config.cluster else {
        return Ok(Some(Node::plain(None)));
    };
    if !c.elected() {
        if is_follower(config) {
            run_follower(config)?;
            return Ok(None);
        }
        return Ok(Some(Node::plain(leader_gate(config))));
    }
    Elector::new(config)?.run()
}

/// A won election, for the keeper.
#[derive(Clone, Copy)]
struct Won {
    epoch: u64,
    lease: i64,
    /// When the lease ends at the latest (from the last renewal sent).
    deadline: Instant,
}

/// The follower thread of an elected node.
struct Following {
    holder: Holder,
    stop: Arc<AtomicBool>,
    progress: Arc<Progress>,
    task: std::thread::JoinHandle<Result<(), triad_cluster::follower::FollowerError>>,
}

impl Following {
    /// Stops it; its end (an error if it had failed on its own).
    fn end(self) -> anyhow::Result<u64> {
        self.stop.store(true, Ordering::SeqCst);
        self.progress.interrupt();
        let r = self
            .task
            .join()
            .map_err(|_| anyhow::anyhow!("the follower's thread panicked"))?;
        r.map_err(|e| anyhow::anyhow!(e).context("the follower stopped"))?;
        Ok(self.progress.log_durable.load(Ordering::SeqCst))
    }
}

/// An elected node before it leads: the campaign and follower loop.
struct Elector {
    etcd: Arc<Etcd>,
    key: String,
    candidates: String,
    me: NodeInfo,
    ttl: Duration,
    data_dir: std::path::PathBuf,
    segment_size: u64,
    sync: bool,
    listener: std::net::TcpListener,
    /// `[cluster.tls]`, to verify the leader and present this node's certificate.
    tls: Option<Arc<rustls::ClientConfig>>,
    /// For the client listeners a follower forwards ([`crate::forward::Forwarding`]).
    config: Config,
}

impl Elector {
    fn new(config: &Config) -> anyhow::Result<Elector> {
        let c = config
            .cluster
            .as_ref()
            .context("an elected node needs [cluster]")?;
        let listen = c.listen.clone().unwrap_or_default();
        let listener = std::net::TcpListener::bind(&listen)
            .with_context(|| format!("cannot listen for replication on {listen}"))?;
        let replication = match &c.advertise {
            Some(a) => a.clone(),
            None => listener
                .local_addr()
                .context("cannot read the replication listener's address")?
                .to_string(),
        };
        let ttl = c.lease_ttl();
        let r = config.replication.clone().unwrap_or_default();
        let etcd = match c.etcd_tls.as_ref().and_then(|t| t.files()) {
            Some(f) => {
                let tls =
                    triad_cluster::tls::etcd_client_config(&f).context("[cluster.etcd_tls]")?;
                Etcd::with_tls(&c.etcd, ttl / 3, tls)
            }
            None => Etcd::new(&c.etcd, ttl / 3),
        };
        Ok(Elector {
            etcd: Arc::new(etcd),
            key: election_key(c.group_name()),
            candidates: candidates_prefix(c.group_name()),
            me: NodeInfo {
                node: c.node_id.clone(),
                replication,
                clients: Vec::new(),
            },
            ttl,
            data_dir: config.store.data_dir.clone(),
            segment_size: config.store.segment_size.bytes(),
            sync: r.mode == ReplicationMode::Sync,
            listener,
            tls: client_tls(config)?,
            config: config.clone(),
        })
    }

    fn run(self) -> anyhow::Result<Option<Node>> {
        // A leader's data directory (an earlier term) keeps only its two logs from now
        // on, as a follower's does: a later promotion replays them whole.
        if triad_store::replica::drop_broker_state(&self.data_dir)
            .context("cannot drop an earlier leader term's broker state")?
        {
            info!(data_dir = %self.data_dir.display(), "dropped the broker state of an earlier leader term; keeping the logs");
        }
        let log_end = {
            let s = ReplicaStore::open(&self.data_dir, self.segment_size)
                .context("cannot open the data directory")?;
            s.log_end()
        };
        info!(node = %self.me.node, replication = %self.me.replication, log_end,
            key = %self.key, "joining the election");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the async runtime")?;
        let won = runtime.block_on(async {
            // while following, client connections are spliced to the leader
            let forwarding = Forwarding::start(&self.config).await;
            let won = self.campaign_loop(log_end, &forwarding).await;
            forwarding.stop().await;
            won
        })?;
        drop(runtime);
        let Some(won) = won else {
            return Ok(None);
        };
        info!(node = %self.me.node, epoch = won.epoch, "elected leader");
        let gate = ReplicaGate::new(self.sync);
        let lost = CancellationToken::new();
        let stop_keeper = CancellationToken::new();
        let (clients, clients_rx) = tokio::sync::watch::channel(Vec::new());
        let keeper = {
            let k = Keeper {
                etcd: self.etcd.clone(),
                key: self.key.clone(),
                me: self.me.clone(),
                won,
                ttl: self.ttl,
                gate: gate.clone(),
                lost: lost.clone(),
                stop: stop_keeper.clone(),
                clients: clients_rx,
            };
            std::thread::Builder::new()
                .name("lease-keeper".into())
                .spawn(move || k.run())
                .context("cannot start the lease keeper")?
        };
        // the term's start, before anything of it is written: the copy's ends (recovery
        // cuts a torn tail first), appended to the history and fsynced before serving
        let mut term = Term {
            epoch: won.epoch,
            advertised: self.me.replication.clone(),
            history: EpochHistory::default(),
            node_id: self.me.node.clone(),
            listener: None,
            keeper: Some(keeper),
            stop_keeper,
        };
        let (log_start, journal_start) = {
            let s = ReplicaStore::open(&self.data_dir, self.segment_size)
                .context("cannot open the data directory")?;
            (s.log_end(), s.journal_pos())
        };
        let mut history =
            EpochHistory::load(&self.data_dir).context("cannot read the epoch history")?;
        history
            .append(
                &self.data_dir,
                EpochEntry {
                    epoch: won.epoch,
                    log_start,
                    journal_start,
                },
            )
            .context("cannot record the new term in the epoch history")?;
        info!(
            epoch = won.epoch,
            log_start, journal_start, "term recorded in the epoch history"
        );
        term.history = history;
        term.listener = Some(self.listener);
        Ok(Some(Node {
            gate: Some(gate),
            term: Some(term),
            lost,
            clients: Some(clients),
        }))
    }

    fn follow(&self, leader: &NodeInfo, holder: Holder) -> anyhow::Result<Following> {
        let cfg = FollowerConfig {
            node_id: self.me.node.clone(),
            leader: leader.replication.clone(),
            data_dir: self.data_dir.clone(),
            segment_size: self.segment_size,
            tls: self.tls.clone(),
        };
        info!(leader = %leader.node, addr = %leader.replication, epoch = holder.epoch, "following");
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(Progress::default());
        let task = {
            let (stop, progress) = (stop.clone(), progress.clone());
            std::thread::Builder::new()
                .name("follower".into())
                .spawn(move || triad_cluster::follower::run(&cfg, &stop, &progress))
                .context("cannot start the follower")?
        };
        Ok(Following {
            holder,
            stop,
            progress,
            task,
        })
    }

    /// Follows whoever holds the election key, campaigns when nobody does; returns the
    /// won term, or `None` on SIGTERM/SIGINT.
    async fn campaign_loop(
        &self,
        mut log_end: u64,
        forwarding: &Forwarding,
    ) -> anyhow::Result<Option<Won>> {
        let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
        let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
        let poll = self.ttl / 3;
        let mut following: Option<Following> = None;
        loop {
            if following.as_ref().is_some_and(|f| f.task.is_finished()) {
                if let Some(f) = following.take() {
                    log_end = f.end()?;
                }
            }
            let holder = self.etcd.holder(&self.key).await;
            // a change of the key (the leader's lease ended) ends the wait below early
            let watch_from = holder
                .as_ref()
                .ok()
                .and_then(|h| h.as_ref())
                .map(|h| h.revision + 1);
            if let Ok(h) = &holder {
                // (etcd not answering: keep forwarding where we did)
                let leader = h.as_ref().and_then(|h| NodeInfo::from_json(&h.value));
                let leader = leader.filter(|i| i.node != self.me.node);
                forwarding.follow(leader.as_ref().map(|i| i.clients.as_slice()));
            }
            match holder {
                Err(e) => warn!(error = %e, "election: cannot read the election key"),
                // the same term (its value may change: the leader adds its client
                // addresses once bound)
                Ok(Some(h))
                    if following.as_ref().is_some_and(|f| {
                        (f.holder.epoch, f.holder.lease) == (h.epoch, h.lease)
                    }) => {}
                Ok(Some(h)) => {
                    if let Some(f) = following.take() {
                        log_end = f.end()?;
                    }
                    match NodeInfo::from_json(&h.value) {
                        Some(i) if i.node == self.me.node => {
                            // this node's own earlier term (the process restarted): over
                            info!(
                                epoch = h.epoch,
                                "election: ending this node's previous term"
                            );
                            match self.etcd.revoke(h.lease).await {
                                Ok(()) => continue,
                                Err(e) => {
                                    warn!(error = %e, "election: cannot revoke the previous term's lease")
                                }
                            }
                        }
                        Some(i) => following = Some(self.follow(&i, h)?),
                        None => warn!(
                            key = %self.key,
                            "election: the key holds something that is not a Triad node"
                        ),
                    }
                }
                Ok(None) => {
                    if let Some(f) = following.take() {
                        log_end = f.end()?;
                    }
                    if let Some(won) = self.candidacy(log_end).await {
                        return Ok(Some(won));
                    }
                    continue;
                }
            }
            // Polled every TTL/3, and watched meanwhile: a follower learns that the
            // leader's key went when it goes, not up to TTL/3 later. A watch that fails
            // (etcd unreachable) leaves the poll.
            let watch = async {
                if let Some(from) = watch_from {
                    if self.etcd.watch(&self.key, from).await.is_ok() {
                        return;
                    }
                }
                std::future::pending::<()>().await
            };
            tokio::select! {
                _ = tokio::time::sleep(poll) => {}
                _ = watch => {}
                _ = sigterm.recv() => break,
                _ = sigint.recv() => break,
            }
        }
        info!("shutdown requested");
        if let Some(f) = following.take() {
            f.end()?;
        }
        info!("stopped cleanly");
        Ok(None)
    }

    /// One candidacy: state this copy's log end, let a better-placed candidate win
    /// first, then campaign. `None`: not won (lost, or etcd failed).
    async fn candidacy(&self, log_end: u64) -> Option<Won> {
        let poll = self.ttl / 3;
        let lease = match self.etcd.grant(self.ttl).await {
            Ok(l) => l,
            Err(e) => {
                warn!(error = %e, "election: cannot take a lease");
                tokio::time::sleep(poll).await;
                return None;
            }
        };
        let r = self.try_candidacy(lease, log_end).await;
        match r {
            Ok(Some(w)) => return Some(w),
            Ok(None) => {}
            Err(e) => warn!(error = %e, "election: campaign failed"),
        }
        if let Err(e) = self.etcd.revoke(lease).await {
            warn!(error = %e, "election: cannot revoke a candidacy's lease");
        }
        None
    }

    async fn try_candidacy(&self, lease: i64, log_end: u64) -> Result<Option<Won>, EtcdError> {
        let poll = self.ttl / 3;
        let mine = format!("{}{}", self.candidates, self.me.node);
        // the copy's place: (last epoch seen, log end), compared as Raft's up-to-date
        // check does: a later term's log wins over a longer log of an older term
        let last_epoch = EpochHistory::load(&self.data_dir)
            .map(|h| h.last_epoch())
            .unwrap_or(0);
        let place = (last_epoch, log_end);
        self.etcd
            .put(&mine, format!("{last_epoch} {log_end}").as_bytes(), lease)
            .await?;
        // the other candidates state theirs meanwhile
        tokio::time::sleep(poll).await;
        let better = self
            .etcd
            .range_prefix(&self.candidates, 256)
            .await?
            .into_iter()
            .filter(|(k, _)| k != mine.as_bytes())
            .filter_map(|(_, v)| {
                let (e, end) = std::str::from_utf8(&v).ok()?.split_once(' ')?;
                Some((e.parse::<u64>().ok()?, end.parse::<u64>().ok()?))
            })
            .any(|theirs| theirs > place);
        if better {
            // a node holding more of the log campaigns; wait for it (bounded), then
            // campaign anyway should it not have won
            info!(
                last_epoch,
                log_end, "election: a candidate with more of the log stands; waiting for it"
            );
            for _ in 0..6 {
                tokio::time::sleep(poll).await;
                if self.etcd.holder(&self.key).await?.is_some() {
                    return Ok(None);
                }
                if self.etcd.keepalive(lease).await?.is_none() {
                    return Ok(None);
                }
            }
        }
        let sent = Instant::now();
        let Some(ttl) = self.etcd.keepalive(lease).await? else {
            return Ok(None);
        };
        match self
            .etcd
            .campaign(&self.key, self.me.to_json().as_bytes(), lease)
            .await?
        {
            Campaign::Won { epoch } => Ok(Some(Won {
                epoch,
                lease,
                deadline: sent + ttl,
            })),
            Campaign::Lost(_) => Ok(None),
        }
    }
}

/// The leader's lease keeper (its own thread and runtime, so that neither the store's
/// recovery nor a busy broker delays a renewal): renews every TTL/3; when the lease is
/// gone, or cannot be renewed in time (fenced a quarter TTL before it would end at the
/// latest), or the election key is no longer this term's, fences the gate and cancels
/// `lost`. Puts the client addresses in the key when told them. On `stop`, revokes the
/// lease.
struct Keeper {
    etcd: Arc<Etcd>,
    key: String,
    me: NodeInfo,
    won: Won,
    ttl: Duration,
    gate: Arc<ReplicaGate>,
    lost: CancellationToken,
    stop: CancellationToken,
    clients: tokio::sync::watch::Receiver<Vec<(String, String)>>,
}

impl Keeper {
    fn run(mut self) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(r) => r,
            Err(e) => {
                self.gate
                    .fence(&format!("cannot start the lease keeper: {e}"));
                self.lost.cancel();
                return;
            }
        };
        runtime.block_on(self.keep());
    }

    async fn keep(&mut self) {
        let (etcd, won) = (self.etcd.clone(), self.won);
        let margin = self.ttl / 4;
        let every = self.ttl / 3;
        let mut deadline = won.deadline;
        let mut next = Instant::now();
        let mut advertise = false;
        let mut closed = false;
        let reason = loop {
            let fence_at = deadline.checked_sub(margin).unwrap_or(deadline);
            tokio::select! {
                _ = self.stop.cancelled() => {
                    let _ = tokio::time::timeout(every, etcd.revoke(won.lease)).await;
                    return;
                }
                r = self.clients.changed(), if !closed => match r {
                    Ok(()) => advertise = true,
                    // the broker let go of its side: no more updates
                    Err(_) => closed = true,
                },
                _ = tokio::time::sleep_until(next.min(fence_at).into()) => {}
            }
            let now = Instant::now();
            if now >= fence_at {
                break "the lease could not be renewed in time";
            }
            if advertise {
                let info = NodeInfo {
                    clients: self.clients.borrow_and_update().clone(),
                    ..self.me.clone()
                };
                let value = info.to_json();
                let update = etcd.update_term(&self.key, won.epoch, value.as_bytes(), won.lease);
                match tokio::time::timeout(fence_at - now, update).await {
                    Ok(Ok(true)) => {
                        info!(clients = ?info.clients, "election: client addresses advertised");
                        advertise = false;
                    }
                    Ok(Ok(false)) => break "the election key is no longer this term's",
                    Ok(Err(e)) => {
                        warn!(error = %e, "election: cannot advertise the client addresses")
                    }
                    Err(_) => warn!("election: no answer advertising the client addresses"),
                }
            }
            if now >= next {
                let sent = Instant::now();
                match tokio::time::timeout(fence_at - now, etcd.keepalive(won.lease)).await {
                    Ok(Ok(Some(t))) => deadline = sent + t,
                    Ok(Ok(None)) => break "the lease is gone (expired or revoked)",
                    Ok(Err(e)) => warn!(error = %e, "election: cannot renew the lease"),
                    Err(_) => warn!("election: no answer to the lease renewal"),
                }
                next = sent + every;
            }
        };
        self.gate.fence(reason);
        warn!(epoch = won.epoch, %reason, "leadership lost: no more confirms; leaving the leader role");
        self.lost.cancel();
    }
}

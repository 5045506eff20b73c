//! The broker's side of replication (issue 18, phase 1): the gate a leader's store is
//! opened with, the leader's replication listener, and the follower mode, in which the
//! process keeps a copy of its leader's logs and serves no client.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use tokio::signal::unix::{signal, SignalKind};
use tracing::info;
use triad_cluster::follower::{FollowerConfig, Progress};
use triad_cluster::leader::{Leader, LeaderConfig};
use triad_store::replica::ReplicaGate;
use triad_store::store::Store;

use crate::config::{ClusterRole, Config, ReplicationMode};

/// Whether this configuration makes the process a follower.
pub fn is_follower(config: &Config) -> bool {
    config
        .cluster
        .as_ref()
        .is_some_and(|c| c.role == ClusterRole::Follower)
}

/// A leader's gate (for `StoreConfig::replica`); `None` unless `[cluster] role = "leader"`.
pub fn leader_gate(config: &Config) -> Option<Arc<ReplicaGate>> {
    let c = config.cluster.as_ref()?;
    if c.role != ClusterRole::Leader {
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
            min_insync: r.min_insync as usize,
            replica_lag_max: r.replica_lag_max.bytes(),
            tls: match c.tls.as_ref().and_then(|t| t.files()) {
                Some(f) => Some(triad_cluster::tls::server_config(&f)?),
                None => None,
            },
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
        tls: match c.tls.as_ref().and_then(|t| t.files()) {
            Some(f) => Some(triad_cluster::tls::client_config(&f)?),
            None => None,
        },
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

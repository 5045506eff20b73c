//! `GET /api/cluster` and the replication series of `/metrics`: the replica group as
//! this node's leader sees it ([`triad_cluster::leader::Leader::status`]). A broker
//! without `[cluster]` answers as a group of one (`role: "standalone"`).
//!
//! ```json
//! {"node": "l", "role": "leader", "leader": "l", "epoch": 0, "mode": "sync",
//!  "min_insync": 2, "replica_lag_max": 16777216, "in_sync_replicas": 2,
//!  "accepting_confirms": true, "refusing": null, "log_end": 8192,
//!  "journal_position": 310, "replicated_offset": 8192,
//!  "nodes": [
//!   {"node": "l", "role": "leader", "address": "127.0.0.1:5680", "connected": true,
//!    "in_sync": true, "log_durable": 8192, "journal_durable": 310,
//!    "lag_bytes": 0, "lag_seconds": 0.0},
//!   {"node": "f1", "role": "follower", "address": "127.0.0.1:40112", "connected": true,
//!    "in_sync": true, "log_durable": 8192, "journal_durable": 310,
//!    "lag_bytes": 0, "lag_seconds": 0.0}]}
//! ```
//!
//! The leader's own `log_durable` is its commitlog end (what it has written; its fsync
//! policy is `store.flush`'s). A follower's positions are what it last acknowledged as
//! on its disk; `connected: false` is a follower that went away (remembered, out of sync).

use std::fmt::Write as _;

use serde_json::{json, Value};
use triad_cluster::status::LeaderStatus;

use super::metrics::{esc, head, one};
use crate::listener::ConnContext;

/// The group of one a broker without `[cluster]` is.
fn standalone(ctx: &ConnContext) -> Value {
    let store = ctx.broker.store();
    let end = store.commitlog().end();
    let (jpos, _) = store.journal().position();
    let node = super::node_name();
    json!({
        "node": node,
        "role": "standalone",
        "leader": node,
        "epoch": 0,
        "mode": null,
        "min_insync": 1,
        "replica_lag_max": null,
        "in_sync_replicas": 1,
        "accepting_confirms": true,
        "refusing": null,
        "log_end": end,
        "journal_position": jpos,
        "replicated_offset": end,
        "nodes": [{
            "node": node,
            "role": "standalone",
            "address": null,
            "connected": true,
            "in_sync": true,
            "log_durable": end,
            "journal_durable": jpos,
            "lag_bytes": 0,
            "lag_seconds": 0.0,
        }],
    })
}

fn leader(s: &LeaderStatus) -> Value {
    let mut nodes = vec![json!({
        "node": s.node_id,
        "role": "leader",
        "address": s.address.to_string(),
        "connected": true,
        "in_sync": true,
        "log_durable": s.log_end,
        "journal_durable": s.journal_pos,
        "lag_bytes": 0,
        "lag_seconds": 0.0,
    })];
    nodes.extend(s.replicas.iter().map(|r| {
        json!({
            "node": r.node,
            "role": "follower",
            "address": r.peer.to_string(),
            "connected": r.connected,
            "in_sync": r.in_sync,
            "log_durable": r.log_durable,
            "journal_durable": r.journal_durable,
            "lag_bytes": r.lag_bytes,
            "lag_seconds": r.lag_seconds,
        })
    }));
    // async mode never holds a confirm back, whatever the in-sync set
    let refusing = s.refusing.as_ref().filter(|_| s.sync);
    json!({
        "node": s.node_id,
        "role": "leader",
        "leader": s.node_id,
        "epoch": s.epoch,
        "mode": if s.sync { "sync" } else { "async" },
        "min_insync": s.min_insync,
        "replica_lag_max": s.replica_lag_max,
        "in_sync_replicas": s.in_sync(),
        "accepting_confirms": refusing.is_none(),
        "refusing": refusing,
        "log_end": s.log_end,
        "journal_position": s.journal_pos,
        "replicated_offset": s.replicated,
        "nodes": nodes,
    })
}

/// `GET /api/cluster`'s answer.
pub fn json(ctx: &ConnContext) -> Value {
    match ctx.cluster.as_ref().and_then(|h| h.status()) {
        Some(s) => leader(&s),
        None => standalone(ctx),
    }
}

/// The replication series of `/metrics` (none on a standalone broker).
pub fn metrics(out: &mut String, ctx: &ConnContext) {
    let Some(s) = ctx.cluster.as_ref().and_then(|h| h.status()) else {
        return;
    };
    one(
        out,
        "triad_replication_in_sync_replicas",
        "gauge",
        "Replicas in the in-sync set, the leader included",
        "",
        s.in_sync(),
    );
    one(
        out,
        "triad_replication_min_insync",
        "gauge",
        "replication.min_insync: replicas that must be in sync for confirms (sync mode)",
        "",
        s.min_insync,
    );
    type Series = (
        &'static str,
        &'static str,
        fn(&triad_cluster::status::ReplicaStatus) -> String,
    );
    let series: [Series; 3] = [
        (
            "triad_replication_lag_bytes",
            "Commitlog bytes the leader holds that a replica has not acknowledged as durable",
            |r| r.lag_bytes.to_string(),
        ),
        (
            "triad_replication_lag_seconds",
            "How long ago the leader's commitlog end was at what a replica acknowledged",
            |r| format!("{:.3}", r.lag_seconds),
        ),
        (
            "triad_replication_in_sync",
            "1 if a replica is in the in-sync set",
            |r| u8::from(r.in_sync).to_string(),
        ),
    ];
    for (name, help, value) in series {
        head(out, name, "gauge", help);
        for r in &s.replicas {
            let _ = writeln!(out, "{name}{{replica=\"{}\"}} {}", esc(&r.node), value(r));
        }
    }
}

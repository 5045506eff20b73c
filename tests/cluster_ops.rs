//! Replication operations (issue 18): `GET /api/cluster`, `triadctl cluster_status` and
//! the `triad_replication_*` metrics, with the real binaries: a leader and a follower
//! (static roles, sync mode), and a standalone broker.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::process::Command;

use common::cluster::{api, follower, in_sync_count, leader_config, node, publish, T};
use common::{http_get, TestBroker};
use serde_json::Value;
use triad_core::testing::eventually_blocking;

fn ctl(http: SocketAddr, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_triadctl"))
        .args(["--host", &http.ip().to_string()])
        .args(["--port", &http.port().to_string()])
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "triadctl {args:?}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn api_cli_and_metrics_show_a_caught_up_follower_then_its_departure() {
    let root = tempfile::tempdir().unwrap();
    let leader = TestBroker::start_with_config(&leader_config(2));
    let http = leader.http_addr();
    let (mut fa, _) = follower(root.path(), "fa", leader.addr("replication"));
    eventually_blocking("fa in sync", T, || in_sync_count(&leader) == 1);
    assert_eq!(publish(leader.amqp_addr(), "oq", 0, 300), (300, 0));

    // the API: the follower caught up, lag 0
    eventually_blocking("fa caught up in /api/cluster", T, || {
        let s = api(http, "/api/cluster");
        let f = node(&s, "fa");
        f["lag_bytes"] == 0 && f["log_durable"] == s["log_end"]
    });
    let s = api(http, "/api/cluster");
    assert_eq!(s["role"], "leader");
    assert_eq!(s["node"], "l");
    assert_eq!(s["leader"], "l");
    assert_eq!(s["epoch"], 0);
    assert_eq!(s["mode"], "sync");
    assert_eq!(s["min_insync"], 2);
    assert_eq!(s["in_sync_replicas"], 2);
    assert_eq!(s["accepting_confirms"], true);
    assert!(s["log_end"].as_u64().unwrap() > 300 * 8, "{s}");
    assert_eq!(s["replicated_offset"], s["log_end"]);
    assert_eq!(s["nodes"].as_array().unwrap().len(), 2);
    let l = node(&s, "l");
    assert_eq!(l["role"], "leader");
    assert_eq!(
        l["address"].as_str().unwrap(),
        leader.addr("replication").to_string()
    );
    let f = node(&s, "fa");
    assert_eq!(f["role"], "follower");
    assert_eq!(f["connected"], true);
    assert_eq!(f["in_sync"], true);
    assert_eq!(f["lag_seconds"], 0.0);
    assert_eq!(f["journal_durable"], s["journal_position"]);
    assert!(f["journal_durable"].as_u64().unwrap() > 0, "{s}");

    // the CLI: a summary and one row per node; JSON is the API's answer
    let table = ctl(http, &["cluster_status"]);
    eprintln!("{table}");
    assert!(
        table.contains("role leader  leader l  epoch 0  mode sync"),
        "{table}"
    );
    assert!(
        table.contains("in sync 2 (min_insync 2)  confirms accepted"),
        "{table}"
    );
    let row = table
        .lines()
        .find(|l| l.starts_with("fa "))
        .unwrap_or_else(|| panic!("no fa row: {table}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    // node role address connected in_sync log_durable journal_durable lag_bytes lag_seconds
    assert_eq!(cells[1], "follower", "{row}");
    assert_eq!(cells[3..5], ["true", "true"], "{row}");
    assert_eq!(cells[5], s["log_end"].to_string(), "{row}");
    assert_eq!(cells[7..9], ["0", "0.0"], "{row}");
    let j: Value =
        serde_json::from_str(&ctl(http, &["--format", "json", "cluster_status"])).unwrap();
    assert_eq!(node(&j, "fa")["in_sync"], true);

    // metrics
    let (code, m) = http_get(http, "/metrics");
    assert_eq!(code, 200);
    for line in [
        "triad_replication_in_sync_replicas 2",
        "triad_replication_min_insync 2",
        "triad_replication_lag_bytes{replica=\"fa\"} 0",
        "triad_replication_lag_seconds{replica=\"fa\"} 0.000",
        "triad_replication_in_sync{replica=\"fa\"} 1",
        "# TYPE triad_replication_lag_seconds gauge",
    ] {
        assert!(m.lines().any(|l| l == line), "no {line:?} in\n{m}");
    }

    // the follower goes: remembered, disconnected and out of sync; confirms refused
    fa.kill9();
    eventually_blocking("fa gone in /api/cluster", T, || {
        let s = api(http, "/api/cluster");
        node(&s, "fa")["connected"] == false
    });
    let s = api(http, "/api/cluster");
    assert_eq!(node(&s, "fa")["in_sync"], false);
    assert_eq!(s["in_sync_replicas"], 1);
    assert_eq!(s["accepting_confirms"], false);
    assert!(s["refusing"].as_str().unwrap().contains("1 of 2"), "{s}");
    let (_, m) = http_get(http, "/metrics");
    assert!(
        m.contains("triad_replication_in_sync{replica=\"fa\"} 0"),
        "{m}"
    );
    assert!(m.contains("triad_replication_in_sync_replicas 1"), "{m}");
    // publishing now lags it behind: bytes and (once time passes) seconds
    assert_eq!(publish(leader.amqp_addr(), "oq", 1000, 20), (0, 20));
    eventually_blocking("lag in seconds grows", T, || {
        let s = api(http, "/api/cluster");
        let f = node(&s, "fa");
        f["lag_bytes"].as_u64().unwrap() > 0 && f["lag_seconds"].as_f64().unwrap() >= 0.5
    });
    let table = ctl(http, &["cluster_status"]);
    assert!(table.contains("confirms refused: 1 of 2"), "{table}");
}

#[test]
fn a_standalone_broker_is_a_group_of_one() {
    let b = TestBroker::start();
    let s = api(b.http_addr(), "/api/cluster");
    assert_eq!(s["role"], "standalone");
    assert_eq!(s["leader"], s["node"]);
    assert_eq!(s["in_sync_replicas"], 1);
    assert_eq!(s["nodes"].as_array().unwrap().len(), 1);
    assert_eq!(s["nodes"][0]["role"], "standalone");
    let table = ctl(b.http_addr(), &["cluster_status"]);
    assert!(table.contains("role standalone"), "{table}");
    let (_, m) = http_get(b.http_addr(), "/metrics");
    assert!(!m.contains("triad_replication_"), "{m}");
}

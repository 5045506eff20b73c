//! TLS between nodes (`[cluster.tls]`, issue 18), with the real binary: a leader and a
//! follower with certificates from one CA replicate (sync mode confirms); a follower
//! whose certificate another CA signed is refused by the leader, a follower that does
//! not trust the leader's CA refuses the leader, and a plain-TCP follower gets nowhere.
//!
//! Every certificate and key is generated at run time with rcgen into a temporary
//! directory: no private key is committed.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::certs::{new_ca, node_cert};
use common::cluster::{api, leader_config, node, publish, start_follower, T};
use common::TestBroker;
use triad_core::testing::eventually_blocking;

fn tls_section(cert: &Path, key: &Path, ca: &Path) -> String {
    format!(
        "[cluster.tls]\ncert_file = {:?}\nkey_file = {:?}\nca_file = {:?}\n",
        cert.to_str().unwrap(),
        key.to_str().unwrap(),
        ca.to_str().unwrap()
    )
}

#[test]
fn nodes_with_certificates_from_the_cluster_ca_replicate_over_mutual_tls_and_others_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    let ca = new_ca("Triad cluster CA");
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let other = new_ca("Some other CA");
    let other_file = dir.join("other-ca.pem");
    std::fs::write(&other_file, other.pem()).unwrap();
    let (lc, lk) = node_cert(dir, &ca, "l");
    let (fc, fk) = node_cert(dir, &ca, "fa");
    let (xc, xk) = node_cert(dir, &other, "fx");

    let leader = TestBroker::start_with_config(&format!(
        "{}{}",
        leader_config(2),
        tls_section(&lc, &lk, &ca_file)
    ));
    assert!(
        leader.log().contains("proto=replication") && leader.log().contains("tls=true"),
        "{}",
        leader.log()
    );
    let repl = leader.addr("replication");
    let http = leader.http_addr();

    // one of ours: connects, catches up, sync-mode confirms come
    let (mut fa, _) = start_follower(dir, "fa", repl, &tls_section(&fc, &fk, &ca_file));
    fa.wait_for_log("follower: connected to the leader", T);
    eventually_blocking("fa in sync", T, || {
        node(&api(http, "/api/cluster"), "fa")["in_sync"] == true
    });
    assert_eq!(publish(leader.amqp_addr(), "tq", 0, 300), (300, 0));
    eventually_blocking("fa caught up over TLS", T, || {
        let s = api(http, "/api/cluster");
        node(&s, "fa")["log_durable"] == s["log_end"]
    });

    // a certificate from another CA: the leader refuses it in the handshake
    let (mut fx, _) = start_follower(dir, "fx", repl, &tls_section(&xc, &xk, &ca_file));
    fx.wait_for_log("follower: not connected to the leader; retrying", T);
    leader.wait_for_log("UnknownIssuer", T);
    // a follower that does not trust the leader's CA refuses the leader
    let (mut fy, _) = start_follower(dir, "fy", repl, &tls_section(&fc, &fk, &other_file));
    fy.wait_for_log("follower: not connected to the leader; retrying", T);
    assert!(fy.log().contains("UnknownIssuer"), "{}", fy.log());
    // plain TCP gets nowhere
    let (mut fp, _) = start_follower(dir, "fp", repl, "");
    fp.wait_for_log("follower: not connected to the leader; retrying", T);
    // retried, and still none of them got in
    for p in [&fx, &fy, &fp] {
        eventually_blocking("a second attempt", T, || {
            p.log()
                .matches("follower: not connected to the leader; retrying")
                .count()
                >= 2
        });
        assert!(
            !p.log().contains("follower: connected to the leader"),
            "{}",
            p.log()
        );
    }
    let s = api(http, "/api/cluster");
    let names: Vec<&str> = s["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["node"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["l", "fa"], "{s}");
    assert_eq!(publish(leader.amqp_addr(), "tq", 1_000, 50), (50, 0));
    fa.kill9();
}

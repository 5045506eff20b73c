//! Replication, phase 2 (issue 18), with the real binary and a real etcd: the leader is
//! elected, fails over when killed, the old leader rejoins as a follower (truncating
//! what it wrote that the new leader does not have), and a leader that cannot renew its
//! lease stops confirming within the TTL.
//!
//! Skipped (with a printed message) only when the `etcd` binary is absent; `.ci/run`
//! installs Debian's `etcd-server`.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::amqp::{connect, declare_durable, drain, publish_numbered};
use common::ephemeral_listen_args;
use common::proc::Proc;
use common::raw::{MqttClient, StompClient};
use triad_cluster::election::{election_key, Etcd, NodeInfo};
use triad_cluster::testing::EtcdServer;
use triad_core::testing::eventually_blocking;

const T: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(2);

fn node_config(root: &Path, name: &str, etcd: &str, min_insync: u32, mode: &str) -> Proc {
    let config = root.join(format!("{name}.toml"));
    std::fs::write(
        &config,
        format!(
            "{}\n[cluster]\nnode_id = \"{name}\"\netcd = [\"{etcd}\"]\nlisten = \"127.0.0.1:0\"\n\
             lease_ttl = \"2s\"\n[replication]\nmode = \"{mode}\"\nmin_insync = {min_insync}\n\
             replica_lag_max = \"16 MiB\"\n",
            common::TEST_CONFIG
        ),
    )
    .unwrap();
    Proc::start(name, &root.join(name), &config, &ephemeral_listen_args())
}

async fn publish(
    addr: SocketAddr,
    queue: &str,
    start: u64,
    count: u64,
    confirmed: Arc<Mutex<BTreeSet<u64>>>,
    nacked: Arc<Mutex<BTreeSet<u64>>>,
) {
    let Ok(conn) = connect(addr).await else {
        return;
    };
    let Ok(ch) = conn.create_channel().await else {
        return;
    };
    if declare_durable(&ch, queue).await.is_err() {
        return;
    }
    publish_numbered(&ch, queue, start, count, &confirmed, Some(&nacked)).await;
}

fn numbers(bodies: &[Vec<u8>]) -> Vec<u64> {
    bodies
        .iter()
        .map(|b| u64::from_le_bytes(b.as_slice().try_into().unwrap()))
        .collect()
}

/// The index of the one node that leads (logged `broker ready` since its last start).
fn leader_of(nodes: &[Proc]) -> Option<usize> {
    let ready: Vec<usize> = (0..nodes.len())
        .filter(|&i| nodes[i].count("broker ready") > nodes[i].count("leadership lost"))
        .collect();
    match ready.as_slice() {
        [one] => Some(*one),
        _ => None,
    }
}

/// What every test here starts from: a temp dir, a real etcd in it, its URL, and a
/// runtime for the clients. `None` (the test returns) only when the etcd binary is
/// absent; `.ci/run` installs it.
struct Etcd3 {
    root: tempfile::TempDir,
    etcd: EtcdServer,
    rt: tokio::runtime::Runtime,
    url: String,
}

fn with_etcd() -> Option<Etcd3> {
    let root = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start(root.path())?;
    let url = etcd.url();
    Some(Etcd3 {
        root,
        etcd,
        rt: tokio::runtime::Runtime::new().unwrap(),
        url,
    })
}

/// Nodes a, b and c in sync mode (min_insync 2), once one leads and the other two are
/// connected to it; returns them and the leader's index.
fn three_in_sync_mode(root: &Path, url: &str) -> (Vec<Proc>, usize) {
    let mut nodes: Vec<Proc> = ["a", "b", "c"]
        .iter()
        .map(|n| node_config(root, n, url, 2, "sync"))
        .collect();
    let first = eventually_blocking("one leader", T, || leader_of(&nodes));
    for (i, n) in nodes.iter_mut().enumerate() {
        if i != first {
            n.wait_for_log("follower: connected to the leader", T);
        }
    }
    (nodes, first)
}

#[test]
fn three_nodes_elect_a_leader_fail_over_on_kill_9_and_the_old_leader_rejoins() {
    let Some(Etcd3 {
        root,
        etcd,
        rt,
        url,
    }) = with_etcd()
    else {
        return;
    };
    let (mut nodes, first) = three_in_sync_mode(root.path(), &url);
    eprintln!("leader: {}", nodes[first].name);
    let addr = nodes[first].addr("amqp");
    // the election key names the leader, its replication and its client addresses
    let etcd_client = Etcd::new(std::slice::from_ref(&url), T);
    let want = NodeInfo {
        node: nodes[first].name.clone(),
        replication: nodes[first].addr("replication").to_string(),
        clients: ["amqp", "http", "mqtt", "stomp"]
            .iter()
            .map(|p| (p.to_string(), nodes[first].addr(p).to_string()))
            .collect(),
    };
    eventually_blocking("the leader's client addresses in the key", T, || {
        let h = rt
            .block_on(etcd_client.holder(&election_key("default")))
            .unwrap()
            .unwrap();
        NodeInfo::from_json(&h.value) == Some(want.clone())
    });

    // confirmed publishing (sync mode, min_insync 2), then a publisher in flight when
    // the leader is killed
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    let nacked = Arc::new(Mutex::new(BTreeSet::new()));
    eventually_blocking("a follower in sync", T, || {
        nodes[first].count("joined the in-sync set") >= 1
    });
    rt.block_on(publish(
        addr,
        "q",
        0,
        1_000,
        confirmed.clone(),
        nacked.clone(),
    ));
    assert_eq!(confirmed.lock().unwrap().len(), 1_000, "all confirmed");
    let publisher = {
        let (c, n) = (confirmed.clone(), nacked.clone());
        rt.spawn(async move { publish(addr, "q", 1_000_000, 1_000_000, c, n).await })
    };
    eventually_blocking("more confirms in flight", T, || {
        confirmed.lock().unwrap().len() > 1_500
    });
    nodes[first].kill9();
    let killed = Instant::now();
    rt.block_on(async {
        let _ = tokio::time::timeout(Duration::from_secs(10), publisher).await;
    });
    let confirmed = confirmed.lock().unwrap().clone();

    // a new leader, among the other two
    let second = eventually_blocking("a new leader", T, || {
        (0..3).find(|&i| i != first && nodes[i].count("broker ready") > 0)
    });
    let failover = killed.elapsed();
    eprintln!(
        "failover: {} leads after {failover:?} (lease TTL {TTL:?}); {} confirmed, {} nacked",
        nodes[second].name,
        confirmed.len(),
        nacked.lock().unwrap().len()
    );
    assert!(failover < T, "failover took {failover:?}");
    let addr = nodes[second].addr("amqp");
    let got = numbers(&rt.block_on(drain(addr, "q", T)));
    let got_set: BTreeSet<u64> = got.iter().copied().collect();
    let missing: Vec<_> = confirmed.difference(&got_set).take(10).collect();
    assert!(
        missing.is_empty(),
        "confirmed messages missing on the new leader (first few): {missing:?}"
    );
    let duplicates = got.len() - got_set.len();
    eprintln!(
        "new leader: {} consumed, {duplicates} duplicates, {} unconfirmed extra",
        got.len(),
        got_set.difference(&confirmed).count()
    );
    assert_eq!(duplicates, 0, "duplicates");

    // the old leader comes back: it drops its broker state, truncates what the new
    // leader does not have, and follows
    nodes[first].restart();
    nodes[first].wait_for_log("follower: connected to the leader", T);
    let old = nodes[first].name.clone();
    eventually_blocking("the old leader back in sync", T, || {
        nodes[second].count(&format!("joined the in-sync set node={old}")) >= 1
    });
    // and what it holds is the new leader's: a publish is confirmed with it in sync
    let c2 = Arc::new(Mutex::new(BTreeSet::new()));
    let n2 = Arc::new(Mutex::new(BTreeSet::new()));
    rt.block_on(publish(addr, "q2", 0, 100, c2.clone(), n2.clone()));
    assert_eq!(c2.lock().unwrap().len(), 100);
    assert!(nodes[first].is_running(), "the old leader still follows");
    drop(etcd);
}

#[test]
fn a_leader_that_cannot_renew_its_lease_stops_confirming_within_the_ttl_and_rejoins() {
    let Some(Etcd3 {
        root,
        etcd,
        rt,
        url,
    }) = with_etcd()
    else {
        return;
    };
    // one node: min_insync 1, async mode (fencing must hold there too)
    let mut node = node_config(root.path(), "solo", &url, 1, "async");
    node.wait_for_log("broker ready", T);
    let addr = node.addr("amqp");
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    let nacked = Arc::new(Mutex::new(BTreeSet::new()));
    rt.block_on(publish(
        addr,
        "f",
        0,
        100,
        confirmed.clone(),
        nacked.clone(),
    ));
    assert_eq!(confirmed.lock().unwrap().len(), 100);

    // etcd stops answering: the lease cannot be renewed
    etcd.pause();
    let paused = Instant::now();
    node.wait_for_log("leadership lost", T);
    let fenced_after = paused.elapsed();
    eprintln!("fenced {fenced_after:?} after etcd stopped answering (TTL {TTL:?})");
    assert!(
        fenced_after <= TTL + Duration::from_millis(500),
        "fenced after {fenced_after:?}, past the TTL"
    );
    // nothing is confirmed from now on (nacked, or the connection is closed)
    let c2 = Arc::new(Mutex::new(BTreeSet::new()));
    rt.block_on(async {
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            publish(addr, "f", 1_000, 50, c2.clone(), nacked.clone()),
        )
        .await;
    });
    assert!(
        c2.lock().unwrap().is_empty(),
        "a fenced leader confirmed {:?}",
        c2.lock().unwrap()
    );

    // etcd back: the node re-executes, is elected again, and serves what it confirmed
    etcd.resume();
    node.wait_for_count("elected leader", 2, T);
    node.wait_for_count("broker ready", 2, T);
    let addr = node.addr("amqp");
    let got: BTreeSet<u64> = numbers(&rt.block_on(drain(addr, "f", T)))
        .into_iter()
        .collect();
    let confirmed = confirmed.lock().unwrap().clone();
    assert!(confirmed.is_subset(&got), "confirmed messages lost");
}

#[test]
fn an_old_leader_truncates_what_it_wrote_alone_then_follows_the_new_leader() {
    let Some(Etcd3 {
        root,
        etcd,
        rt,
        url,
    }) = with_etcd()
    else {
        return;
    };
    let mut nodes: Vec<Proc> = ["a", "b", "c"]
        .iter()
        .map(|n| node_config(root.path(), n, &url, 2, "sync"))
        .collect();
    let old = eventually_blocking("one leader", T, || leader_of(&nodes));
    let followers: Vec<usize> = (0..3).filter(|&i| i != old).collect();
    for &i in &followers {
        nodes[i].wait_for_log("follower: connected to the leader", T);
    }
    eventually_blocking("a follower in sync", T, || {
        nodes[old].count("joined the in-sync set") >= 1
    });
    let addr = nodes[old].addr("amqp");
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    let nacked = Arc::new(Mutex::new(BTreeSet::new()));
    rt.block_on(publish(
        addr,
        "d",
        0,
        200,
        confirmed.clone(),
        nacked.clone(),
    ));
    assert_eq!(confirmed.lock().unwrap().len(), 200);

    // both followers die; the leader goes on writing what it cannot confirm (nacked),
    // then dies too: those records are on its disk only
    for &i in &followers {
        nodes[i].kill9();
    }
    eventually_blocking("both followers gone", T, || {
        nodes[old].count("follower disconnected") >= 2
    });
    rt.block_on(publish(
        addr,
        "d",
        1_000,
        300,
        confirmed.clone(),
        nacked.clone(),
    ));
    assert_eq!(nacked.lock().unwrap().len(), 300, "nacked, never confirmed");
    assert_eq!(confirmed.lock().unwrap().len(), 200);
    nodes[old].kill9();

    // the followers come back and elect one of them (once the old lease has expired)
    for &i in &followers {
        nodes[i].restart();
    }
    let new = eventually_blocking("a new leader", T, || {
        followers
            .iter()
            .copied()
            .find(|&i| nodes[i].count("broker ready") > 0)
    });
    let other = followers.iter().copied().find(|&i| i != new).unwrap();
    nodes[other].wait_for_log("follower: connected to the leader", T);
    let addr = nodes[new].addr("amqp");
    rt.block_on(publish(
        addr,
        "d",
        2_000,
        100,
        confirmed.clone(),
        nacked.clone(),
    ));
    assert_eq!(confirmed.lock().unwrap().len(), 300);

    // the old leader restarts: it truncates its lone suffix and follows
    nodes[old].restart();
    nodes[old].wait_for_log("follower: connected to the leader", T);
    assert_eq!(
        nodes[old].count("dropped the broker state of an earlier leader term"),
        1,
        "the old leader dropped what a follower does not keep"
    );
    assert_eq!(
        nodes[old].count("truncated a divergent commitlog suffix"),
        1,
        "the old leader truncated"
    );
    let name = nodes[old].name.clone();
    eventually_blocking("the old leader in sync", T, || {
        nodes[new].count(&format!("joined the in-sync set node={name}")) >= 1
    });
    // what the new leader holds: every confirmed message, none of the nacked ones
    let got = numbers(&rt.block_on(drain(addr, "d", T)));
    let got_set: BTreeSet<u64> = got.iter().copied().collect();
    let confirmed = confirmed.lock().unwrap().clone();
    assert_eq!(got.len(), got_set.len(), "duplicates");
    assert_eq!(got_set, confirmed);
    assert!(nodes[old].is_running());
    drop(etcd);
}

#[test]
fn a_leader_whose_lease_is_revoked_fences_and_the_group_settles_on_one_leader() {
    let Some(Etcd3 {
        root,
        etcd: _etcd,
        rt,
        url,
    }) = with_etcd()
    else {
        return;
    };
    let mut nodes: Vec<Proc> = ["a", "b"]
        .iter()
        .map(|n| node_config(root.path(), n, &url, 1, "async"))
        .collect();
    let first = eventually_blocking("one leader", T, || leader_of(&nodes));
    let other = 1 - first;
    nodes[other].wait_for_log("follower: connected to the leader", T);
    let addr = nodes[first].addr("amqp");
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    let nacked = Arc::new(Mutex::new(BTreeSet::new()));
    rt.block_on(publish(
        addr,
        "r",
        0,
        100,
        confirmed.clone(),
        nacked.clone(),
    ));
    assert_eq!(confirmed.lock().unwrap().len(), 100);

    // somebody revokes the leader's lease: the key goes at once
    let client = Etcd::new(std::slice::from_ref(&url), T);
    let key = election_key("default");
    let held = rt.block_on(client.holder(&key)).unwrap().unwrap();
    rt.block_on(client.revoke(held.lease)).unwrap();
    nodes[first].wait_for_log("leadership lost", T);
    assert!(
        nodes[first]
            .log()
            .contains("the lease is gone (expired or revoked)"),
        "fenced for the lease"
    );
    // the old leader re-executes; one node leads a later term, the other follows it
    let settled = eventually_blocking("a leader of a later term", T, || {
        let h = rt.block_on(client.holder(&key)).ok()??;
        (h.epoch > held.epoch).then_some(h)
    });
    let name = NodeInfo::from_json(&settled.value).unwrap().node;
    let lead = nodes.iter().position(|n| n.name == name).unwrap();
    let follow = 1 - lead;
    eventually_blocking("the other follows the new term", T, || {
        nodes[follow].log().contains(&format!(
            "follower: connected to the leader leader={name} epoch={}",
            settled.epoch
        ))
    });
    eventually_blocking("the new leader serves", T, || {
        nodes[lead].log().matches("broker ready").count() > usize::from(lead == first)
    });
    let got: BTreeSet<u64> = numbers(&rt.block_on(drain(nodes[lead].addr("amqp"), "r", T)))
        .into_iter()
        .collect();
    assert!(
        confirmed.lock().unwrap().is_subset(&got),
        "confirmed messages lost"
    );
    eprintln!(
        "after the revoke: {} leads epoch {} (was {} at epoch {})",
        name, settled.epoch, nodes[first].name, held.epoch
    );
}

/// The long version, behind `TRIAD_FAILOVER_ROUNDS=N`: `kill -9` the leader of three
/// nodes N times under confirmed publishing, restarting each killed node (it truncates
/// and follows); reports the failover times (p50, p99) and checks, at the end, that every
/// confirmed message is on the last leader, without duplicates. Without the variable it
/// does nothing (the short version is the test above).
#[test]
fn repeated_kill_9_of_the_leader_loses_no_confirmed_message() {
    let Some(rounds) = std::env::var("TRIAD_FAILOVER_ROUNDS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    else {
        eprintln!("set TRIAD_FAILOVER_ROUNDS=N to run N failover rounds");
        return;
    };
    let Some(Etcd3 {
        root,
        etcd: _etcd,
        rt,
        url,
    }) = with_etcd()
    else {
        return;
    };
    let mut nodes: Vec<Proc> = ["a", "b", "c"]
        .iter()
        .map(|n| node_config(root.path(), n, &url, 2, "sync"))
        .collect();
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    let nacked = Arc::new(Mutex::new(BTreeSet::new()));
    let mut times = Vec::new();
    let mut leader = eventually_blocking("one leader", T, || leader_of(&nodes));
    for round in 0..rounds {
        eventually_blocking("a follower in sync", T, || {
            nodes[leader].count("joined the in-sync set") >= 1
        });
        let addr = nodes[leader].addr("amqp");
        let before = confirmed.lock().unwrap().len();
        let publisher = {
            let (c, n) = (confirmed.clone(), nacked.clone());
            rt.spawn(async move { publish(addr, "q", round << 32, 1 << 31, c, n).await })
        };
        eventually_blocking("confirms in flight", T, || {
            confirmed.lock().unwrap().len() > before + 300
        });
        nodes[leader].kill9();
        let killed = Instant::now();
        let old = leader;
        leader = eventually_blocking("a new leader", T, || {
            (0..3).find(|&i| i != old && nodes[i].count("broker ready") > 0)
        });
        times.push(killed.elapsed());
        rt.block_on(async {
            let _ = tokio::time::timeout(Duration::from_secs(10), publisher).await;
        });
        nodes[old].restart();
        nodes[old].wait_for_log("follower: connected to the leader", T);
    }
    let confirmed = confirmed.lock().unwrap().clone();
    let got = numbers(&rt.block_on(drain(nodes[leader].addr("amqp"), "q", T * 4)));
    let got_set: BTreeSet<u64> = got.iter().copied().collect();
    let missing: Vec<_> = confirmed.difference(&got_set).take(10).collect();
    times.sort();
    let pct = |p: usize| times[((times.len() - 1) * p) / 100];
    eprintln!(
        "{rounds} failovers: p50 {:?}, p99 {:?}, max {:?}; {} confirmed, {} consumed, {} \
         duplicates, {} nacked",
        pct(50),
        pct(99),
        times.last().unwrap(),
        confirmed.len(),
        got.len(),
        got.len() - got_set.len(),
        nacked.lock().unwrap().len()
    );
    assert!(
        missing.is_empty(),
        "confirmed messages missing: {missing:?}"
    );
    assert_eq!(got.len(), got_set.len(), "duplicates");
}

/// Clients connect to any node: a follower splices AMQP, MQTT and STOMP connections to
/// the leader (the addresses in the election key). After `kill -9` of the leader, the
/// follower that remains forwards to the new leader, where an MQTT persistent session
/// (its subscription and a message queued for it while away), a retained message, and
/// the AMQP and STOMP messages confirmed through the follower all are.
#[test]
fn clients_of_a_follower_reach_the_leader_and_find_their_state_after_failover() {
    let Some(Etcd3 {
        root,
        etcd,
        rt,
        url,
    }) = with_etcd()
    else {
        return;
    };
    let (mut nodes, first) = three_in_sync_mode(root.path(), &url);
    eventually_blocking("a follower in sync", T, || {
        nodes[first].count("joined the in-sync set") >= 1
    });
    let f = (0..3).find(|&i| i != first).unwrap();
    let fwd = |n: &Proc, proto: &str| {
        eventually_blocking("the follower forwarding", T, || n.forward_addr(proto))
    };
    let (f_amqp, f_mqtt, f_stomp) = (
        fwd(&nodes[f], "amqp"),
        fwd(&nodes[f], "mqtt"),
        fwd(&nodes[f], "stomp"),
    );

    // MQTT through the follower (once it has read the leader's addresses from the key):
    // a persistent session subscribes, a retained message is published
    let mut dev = eventually_blocking("MQTT through the follower", T, || {
        MqttClient::connect(f_mqtt, "dev-1", false, T).ok()
    });
    assert_eq!(dev.subscribe(1, "dev/1/cmd", 1).unwrap(), 1);
    dev.publish_retained("dev/1/state", 1, 2, b"on").unwrap();
    dev.read_until(4).unwrap(); // PUBACK: on disk on two replicas
    dev.disconnect().unwrap();
    // AMQP through the follower, confirmed
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    let nacked = Arc::new(Mutex::new(BTreeSet::new()));
    rt.block_on(publish(
        f_amqp,
        "fq",
        0,
        200,
        confirmed.clone(),
        nacked.clone(),
    ));
    assert_eq!(
        confirmed.lock().unwrap().len(),
        200,
        "confirmed through the follower"
    );
    // STOMP through the follower, with a receipt
    let mut st = StompClient::connect(f_stomp, T).unwrap();
    st.send(
        "SEND",
        &[
            ("destination", "/queue/sq"),
            ("persistent", "true"),
            ("receipt", "r1"),
        ],
        b"hello",
    )
    .unwrap();
    let r = st.read_frame().unwrap();
    assert_eq!(
        (r.command.as_str(), r.header("receipt-id")),
        ("RECEIPT", Some("r1"))
    );
    // a message for the session while it is away, through the leader itself
    let mut p = MqttClient::connect(nodes[first].addr("mqtt"), "pub-1", true, T).unwrap();
    p.publish("dev/1/cmd", 1, 1, b"reboot").unwrap();
    p.read_until(4).unwrap();

    nodes[first].kill9();
    let second = eventually_blocking("a new leader", T, || {
        (0..3).find(|&i| i != first && nodes[i].count("broker ready") > 0)
    });
    let third = (0..3).find(|&i| i != first && i != second).unwrap();
    eprintln!(
        "leader {} killed; {} leads, {} forwards",
        nodes[first].name, nodes[second].name, nodes[third].name
    );
    let t_mqtt = fwd(&nodes[third], "mqtt");
    // the session, through the follower that remains: present, with its message
    let (mut dev, present) = eventually_blocking("MQTT through the follower again", T, || {
        MqttClient::connect_session(t_mqtt, "dev-1", false, T).ok()
    });
    assert!(present, "the persistent session is on the new leader");
    let (msg, _) = dev.read_until(3).unwrap();
    let (topic, pkid, body) = msg.publish().unwrap();
    assert_eq!(
        (topic.as_str(), body.as_slice()),
        ("dev/1/cmd", &b"reboot"[..])
    );
    dev.puback(pkid.unwrap()).unwrap();
    // the retained message, to a new subscriber
    let mut w = MqttClient::connect(t_mqtt, "watcher", true, T).unwrap();
    w.send_subscribe(1, &[("dev/1/state", 0)]).unwrap();
    let (retained, _) = w.read_until(3).unwrap();
    assert_eq!(retained.publish().unwrap().2, b"on");
    // AMQP and STOMP messages confirmed through the follower
    let addr = nodes[second].addr("amqp");
    let got: BTreeSet<u64> = numbers(&rt.block_on(drain(addr, "fq", T)))
        .into_iter()
        .collect();
    assert_eq!(got, *confirmed.lock().unwrap());
    assert_eq!(rt.block_on(drain(addr, "sq", T)), vec![b"hello".to_vec()]);
    drop(etcd);
}

/// TLS to etcd (`[cluster.etcd_tls]`): etcd serves `https://` and requires client
/// certificates from its CA (`--client-cert-auth`). A node configured with etcd's CA and a
/// client certificate is elected through it; a client without a certificate, one that
/// does not trust etcd's CA, and a plain `http://` one get nothing from that etcd.
#[test]
fn a_node_is_elected_through_an_etcd_that_requires_tls_and_client_certificates() {
    use common::certs::{new_ca, node_cert};
    use triad_cluster::testing::EtcdTls;
    use triad_cluster::tls::{etcd_client_config, EtcdTlsFiles};

    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    let ca = new_ca("etcd CA");
    let ca_file = dir.join("etcd-ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let (server_cert, server_key) = node_cert(dir, &ca, "etcd");
    let (client_cert, client_key) = node_cert(dir, &ca, "a-client");
    let other = new_ca("another CA");
    let other_file = dir.join("other-ca.pem");
    std::fs::write(&other_file, other.pem()).unwrap();
    let Some(etcd) = EtcdServer::start_tls(
        dir,
        &EtcdTls {
            cert: server_cert,
            key: server_key,
            client_ca: Some(ca_file.clone()),
        },
    ) else {
        return;
    };
    let url = etcd.url();
    assert!(url.starts_with("https://"), "{url}");

    let config = dir.join("a.toml");
    std::fs::write(
        &config,
        format!(
            "{}\n[cluster]\nnode_id = \"a\"\netcd = [\"{url}\"]\nlisten = \"127.0.0.1:0\"\n\
             [cluster.etcd_tls]\nca_file = {:?}\ncert_file = {:?}\nkey_file = {:?}\n\
             [replication]\nmode = \"async\"\n",
            common::TEST_CONFIG,
            ca_file.to_str().unwrap(),
            client_cert.to_str().unwrap(),
            client_key.to_str().unwrap(),
        ),
    )
    .unwrap();
    let mut a = Proc::start("a", &dir.join("a"), &config, &ephemeral_listen_args());
    a.wait_for_log("elected leader", T);
    a.wait_for_log("broker ready", T);

    let rt = tokio::runtime::Runtime::new().unwrap();
    let key = election_key("default");
    let client = |ca: &Path, cert: bool| {
        let files = EtcdTlsFiles {
            ca: ca.to_path_buf(),
            client: cert.then(|| (client_cert.clone(), client_key.clone())),
        };
        Etcd::with_tls(
            std::slice::from_ref(&url),
            T,
            etcd_client_config(&files).unwrap(),
        )
    };
    // with the CA and a client certificate: the election key names node a
    let holder = rt
        .block_on(client(&ca_file, true).holder(&key))
        .unwrap()
        .expect("a holds the key");
    assert_eq!(NodeInfo::from_json(&holder.value).unwrap().node, "a");
    // without a client certificate, trusting another CA, or in plain text: refused
    let no_cert = rt.block_on(client(&ca_file, false).holder(&key));
    assert!(no_cert.is_err(), "{no_cert:?}");
    let wrong_ca = rt.block_on(client(&other_file, true).holder(&key));
    assert!(wrong_ca.is_err(), "{wrong_ca:?}");
    let plain = rt.block_on(
        Etcd::new(
            &[url.replace("https://", "http://")],
            Duration::from_secs(5),
        )
        .holder(&key),
    );
    assert!(plain.is_err(), "{plain:?}");
    for (what, e) in [
        ("no client certificate", no_cert),
        ("another CA", wrong_ca),
        ("plain", plain),
    ] {
        eprintln!("{what}: {}", e.unwrap_err());
    }
    drop(etcd);
}

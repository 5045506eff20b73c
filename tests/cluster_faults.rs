//! Replication under network faults (issue 18): a leader in `replication.mode = sync`
//! with `min_insync = 2` and one follower connected through the harness's
//! [`FaultProxy`]. A blackhole or a dropped link takes the follower out of the in-sync
//! set within a bound, and confirmed publishing is then refused (`basic.nack`), never
//! confirmed falsely; once the link passes again the follower rejoins and publishes are
//! confirmed again; a delayed link still confirms. `/api/cluster` shows each step.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::cluster::{api, follower, leader_config, node, publish, Fault, FaultProxy, T};
use common::TestBroker;
use triad_core::testing::eventually_blocking;

/// A follower leaves the in-sync set within this of a blackhole: its acks stop, and the
/// leader drops a follower silent for 5 s (`leader::SILENCE`; a write blocked on the
/// full link also gives up after 5 s).
const LEAVE_BOUND: Duration = Duration::from_secs(15);

fn in_sync(http: std::net::SocketAddr, name: &str) -> bool {
    node(&api(http, "/api/cluster"), name)["in_sync"] == true
}

#[test]
fn a_blackholed_or_dropped_follower_leaves_the_in_sync_set_and_confirms_stop_until_it_rejoins() {
    let root = tempfile::tempdir().unwrap();
    let leader = TestBroker::start_with_config(&leader_config(2));
    let http = leader.http_addr();
    let amqp = leader.amqp_addr();
    let proxy = FaultProxy::start(leader.addr("replication"));
    let (_fa, _) = follower(root.path(), "fa", proxy.addr());
    eventually_blocking("fa in sync", T, || in_sync(http, "fa"));
    assert_eq!(
        publish(amqp, "fq", 0, 200),
        (200, 0),
        "passing: all confirmed"
    );

    // blackhole: nothing moves, nothing closes
    proxy.set(Fault::Blackhole);
    let t0 = Instant::now();
    // everything published from now on cannot reach the follower: not one may be
    // confirmed; each is nacked once the follower is out of the set
    let (confirmed, nacked) = publish(amqp, "fq", 1_000, 50);
    assert_eq!(
        (confirmed, nacked),
        (0, 50),
        "blackholed: nacked, never confirmed"
    );
    eventually_blocking("fa out of sync", LEAVE_BOUND, || !in_sync(http, "fa"));
    let left = t0.elapsed();
    eprintln!("blackhole: follower out of the in-sync set and publishes nacked after {left:?}");
    assert!(left <= LEAVE_BOUND, "{left:?}");
    let s = api(http, "/api/cluster");
    assert_eq!(s["accepting_confirms"], false, "{s}");
    assert_eq!(s["in_sync_replicas"], 1, "{s}");
    assert!(node(&s, "fa")["lag_bytes"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(publish(amqp, "fq", 2_000, 20), (0, 20), "still out: nacked");

    // the link heals: the follower reconnects, catches up, confirms come back
    proxy.set(Fault::Pass);
    let t1 = Instant::now();
    eventually_blocking("fa in sync again", T, || in_sync(http, "fa"));
    eprintln!("pass: follower back in sync after {:?}", t1.elapsed());
    assert_eq!(
        publish(amqp, "fq", 3_000, 200),
        (200, 0),
        "healed: confirmed"
    );
    eventually_blocking("fa caught up", T, || {
        node(&api(http, "/api/cluster"), "fa")["lag_bytes"] == 0
    });

    // a slow link: confirms still come, a round trip later
    let delay = Duration::from_millis(150);
    proxy.set(Fault::Delay(delay));
    let t2 = Instant::now();
    assert_eq!(
        publish(amqp, "fq", 4_000, 100),
        (100, 0),
        "delayed: confirmed"
    );
    let took = t2.elapsed();
    eprintln!("delay {delay:?}: 100 confirmed in {took:?}");
    assert!(took >= 2 * delay, "the delay was applied: {took:?}");
    assert!(in_sync(http, "fa"));

    // dropped connections: out at once (the leader sees the close), nacks, then back
    proxy.set(Fault::Drop);
    let t3 = Instant::now();
    eventually_blocking("fa out after the drop", LEAVE_BOUND, || {
        !in_sync(http, "fa")
    });
    eprintln!("drop: follower out of sync after {:?}", t3.elapsed());
    assert_eq!(publish(amqp, "fq", 5_000, 20), (0, 20), "dropped: nacked");
    proxy.set(Fault::Pass);
    eventually_blocking("fa in sync after the drop", T, || in_sync(http, "fa"));
    assert_eq!(publish(amqp, "fq", 6_000, 50), (50, 0), "back: confirmed");
}

/// The proxy itself, against an echo server: each mode does what it says.
#[test]
fn the_fault_proxy_passes_delays_blackholes_and_drops() {
    use std::io::{Read, Write};
    let echo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = echo.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in echo.incoming().take(8) {
            let Ok(mut s) = s else { break };
            std::thread::spawn(move || {
                let mut b = [0u8; 1024];
                while let Ok(n) = s.read(&mut b) {
                    if n == 0 || s.write_all(&b[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    let proxy = FaultProxy::start(target);
    let mut c = std::net::TcpStream::connect(proxy.addr()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let round = |c: &mut std::net::TcpStream, msg: &[u8]| -> std::io::Result<Duration> {
        let t = Instant::now();
        c.write_all(msg)?;
        let mut got = vec![0u8; msg.len()];
        c.read_exact(&mut got)?;
        assert_eq!(got, msg);
        Ok(t.elapsed())
    };
    round(&mut c, b"pass").unwrap();
    proxy.set(Fault::Delay(Duration::from_millis(100)));
    let took = round(&mut c, b"slow").unwrap();
    assert!(
        took >= Duration::from_millis(200),
        "both ways delayed: {took:?}"
    );
    proxy.set(Fault::Blackhole);
    c.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    c.write_all(b"lost?").unwrap();
    let mut b = [0u8; 16];
    let r = c.read(&mut b);
    assert!(
        matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "nothing comes back, nothing closes: {r:?}"
    );
    // held, not lost: a partition that heals delivers what TCP had buffered
    proxy.set(Fault::Pass);
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = [0u8; 5];
    c.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"lost?");
    proxy.set(Fault::Drop);
    let r = c.read(&mut b);
    assert!(matches!(r, Ok(0) | Err(_)), "closed: {r:?}");
    eventually_blocking("no connection held", T, || proxy.connections() == 0);
}

//! A leader store, its replication listener and followers in one process, over loopback
//! TCP: what the follower acks is on its disk, sync mode confirms only with enough
//! replicas, and the follower's directory opens as a store holding every confirmed
//! message.

#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use triad_cluster::follower::{self, FollowerConfig, Progress};
use triad_cluster::leader::{Leader, LeaderConfig};
use triad_store::record::NewMessage;
use triad_store::replica::ReplicaGate;
use triad_store::store::{Store, StoreConfig};
use triad_store::StoreError;

const SEG: u64 = 16 << 10;

fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn leader_store(dir: &Path, gate: &Arc<ReplicaGate>) -> Arc<Store> {
    let mut cfg = StoreConfig::new(dir);
    cfg.segment_size = SEG;
    cfg.replica = Some(gate.clone());
    Arc::new(Store::open(cfg).unwrap())
}

/// A store in `dir` and its leader "l" listening on a loopback port. With `sync` the
/// gate is armed: a confirm waits for `min_insync` replicas (the leader included).
fn start_leader(
    dir: &Path,
    sync: bool,
    min_insync: usize,
    replica_lag_max: u64,
) -> (Arc<Store>, Leader) {
    let gate = ReplicaGate::new(sync);
    let store = leader_store(dir, &gate);
    if sync {
        gate.arm();
    }
    let leader = Leader::start(
        store.clone(),
        gate,
        LeaderConfig {
            node_id: "l".into(),
            listen: "127.0.0.1:0".into(),
            epoch: 0,
            history: Default::default(),
            min_insync,
            replica_lag_max,
            tls: None,
        },
    )
    .unwrap();
    (store, leader)
}

/// A follower's directory opened as a store (a promotion).
fn open_replica(dir: &Path) -> Store {
    let mut cfg = StoreConfig::new(dir);
    cfg.segment_size = SEG;
    Store::open(cfg).unwrap()
}

struct RunningFollower {
    stop: Arc<AtomicBool>,
    progress: Arc<Progress>,
    thread: Option<std::thread::JoinHandle<Result<(), follower::FollowerError>>>,
}

impl RunningFollower {
    fn start(node: &str, leader: &Leader, dir: &Path) -> RunningFollower {
        let cfg = FollowerConfig {
            node_id: node.into(),
            leader: leader.local_addr().to_string(),
            data_dir: dir.to_path_buf(),
            segment_size: SEG,
            tls: None,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(Progress::default());
        let thread = {
            let (stop, progress) = (stop.clone(), progress.clone());
            std::thread::spawn(move || follower::run(&cfg, &stop, &progress))
        };
        RunningFollower {
            stop,
            progress,
            thread: Some(thread),
        }
    }

    fn stop(&mut self) -> Result<(), follower::FollowerError> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for RunningFollower {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.stop();
        }
    }
}

fn publish(store: &Store, q: u32, i: u32) -> triad_store::flush::Durable {
    let body = format!("message {i}").into_bytes();
    store
        .append(&NewMessage {
            queues: &[q],
            body: &body,
            ..Default::default()
        })
        .unwrap()
        .durable
}

#[test]
fn sync_mode_confirms_with_a_follower_and_refuses_without_one() {
    let l = tempfile::tempdir().unwrap();
    let f = tempfile::tempdir().unwrap();
    let (store, mut leader) = start_leader(l.path(), true, 2, 1 << 20);
    let q = store.create_queue("/", "q", true).unwrap();
    // no follower: refused, never confirmed
    let err = publish(&store, q, 0).wait().unwrap_err();
    assert!(matches!(err, StoreError::NotEnoughReplicas(_)), "{err}");

    let mut fol = RunningFollower::start("f1", &leader, f.path());
    eventually("the follower in sync", || {
        leader.followers().iter().any(|s| s.in_sync)
    });
    // enough for several segments: padding and rolls are shipped too
    for i in 1..=2000u32 {
        let d = publish(&store, q, i);
        if i % 100 == 0 {
            d.wait().unwrap();
        }
    }
    let last = publish(&store, q, 2001);
    let want = last.offset();
    last.wait().unwrap();
    assert!(
        fol.progress.log_durable.load(Ordering::SeqCst) >= want,
        "a confirm means the follower has it on disk"
    );
    assert!(store.commitlog().segment_list().len() > 3);

    // the follower goes away: the next confirm fails instead of being given
    fol.stop().unwrap();
    eventually("the follower gone", || leader.followers().is_empty());
    let err = publish(&store, q, 2002).wait().unwrap_err();
    assert!(matches!(err, StoreError::NotEnoughReplicas(_)), "{err}");
    leader.stop();
    drop(leader);
    let end = store.commitlog().end();
    drop(store);

    // promotion: the follower's directory opens as a store; every confirmed message
    // (1..=2001, with 0 and 2002 possibly there too) is in the queue, in order
    let promoted = open_replica(f.path());
    let q2 = promoted.find_queue("/", "q").expect("queue replicated");
    let n = promoted.queue_next_offset(q2).unwrap();
    let mut bodies = Vec::new();
    for i in 0..n {
        let e = promoted.entry(q2, i).unwrap();
        let r = promoted.read(e.commit_offset).unwrap();
        bodies.push(String::from_utf8(r.body.to_vec()).unwrap());
    }
    for i in 1..=2001u32 {
        assert!(
            bodies.contains(&format!("message {i}")),
            "confirmed message {i} missing"
        );
    }
    assert!(promoted.commitlog().end() <= end);
}

#[test]
fn a_follower_behind_a_compacted_journal_gets_the_snapshot_and_a_second_one_catches_up() {
    let l = tempfile::tempdir().unwrap();
    let f1 = tempfile::tempdir().unwrap();
    let f2 = tempfile::tempdir().unwrap();
    let (store, leader) = start_leader(l.path(), false, 1, 1 << 20);
    let mut a = RunningFollower::start("a", &leader, f1.path());
    let mut qs = Vec::new();
    for i in 0..50 {
        qs.push(store.create_queue("/", &format!("q{i}"), true).unwrap());
    }
    for (i, q) in qs.iter().enumerate() {
        publish(&store, *q, i as u32).wait().unwrap();
    }
    // the journal compacts: a follower that starts now cannot get its first records
    store.journal().compact().unwrap();
    let mut b = RunningFollower::start("b", &leader, f2.path());
    let end = store.commitlog().end();
    let jpos = store.journal().position().0;
    for fol in [&a, &b] {
        eventually("caught up", || {
            fol.progress.log_durable.load(Ordering::SeqCst) == end
                && fol.progress.journal_durable.load(Ordering::SeqCst) == jpos
        });
    }
    a.stop().unwrap();
    b.stop().unwrap();
    drop(leader);
    drop(store);
    for d in [f1.path(), f2.path()] {
        let s = open_replica(d);
        for i in 0..50 {
            let q = s.find_queue("/", &format!("q{i}")).expect("queue");
            let e = s.entry(q, 0).unwrap();
            assert_eq!(
                s.read(e.commit_offset).unwrap().body.as_ref(),
                format!("message {i}").as_bytes()
            );
        }
    }
}

#[test]
fn a_follower_with_another_segment_size_is_refused_with_the_reason() {
    let l = tempfile::tempdir().unwrap();
    let f = tempfile::tempdir().unwrap();
    let (_store, leader) = start_leader(l.path(), false, 1, 1 << 20);
    let cfg = FollowerConfig {
        node_id: "f".into(),
        leader: leader.local_addr().to_string(),
        data_dir: f.path().to_path_buf(),
        segment_size: SEG * 2,
        tls: None,
    };
    let err = follower::run(
        &cfg,
        &AtomicBool::new(false),
        &Arc::new(Progress::default()),
    )
    .unwrap_err();
    assert!(err.to_string().contains("segment size"), "{err}");
}

/// Kafka's ISR in bytes: a connected follower that stops acknowledging leaves the
/// in-sync set once it is `replica_lag_max` behind (the waiting confirms then fail
/// rather than hang), and rejoins when its ack catches up.
#[test]
fn a_lagging_follower_leaves_the_in_sync_set_and_rejoins_when_caught_up() {
    use bytes::BytesMut;
    use std::io::{Read, Write};
    use triad_cluster::codec::{self, Frame, VERSION};

    let l = tempfile::tempdir().unwrap();
    let (store, leader) = start_leader(l.path(), true, 2, 4096);
    let q = store.create_queue("/", "q", true).unwrap();
    // a hand-made follower: says Hello, reads whatever comes, acks only when told
    let mut sock = std::net::TcpStream::connect(leader.local_addr()).unwrap();
    let mut out = BytesMut::new();
    codec::encode(
        &Frame::Hello {
            version: VERSION,
            node: "slow".into(),
            epoch: 0,
            log_end: 0,
            journal_pos: 0,
            segment_size: SEG,
        },
        &mut out,
    );
    sock.write_all(&out).unwrap();
    let mut reader = sock.try_clone().unwrap();
    std::thread::spawn(move || {
        let mut b = [0u8; 65536];
        while matches!(reader.read(&mut b), Ok(n) if n > 0) {}
    });
    let ack = |sock: &mut std::net::TcpStream, log: u64| {
        let mut out = BytesMut::new();
        codec::encode(
            &Frame::Ack {
                log_durable: log,
                journal_durable: 0,
            },
            &mut out,
        );
        sock.write_all(&out).unwrap();
    };
    eventually("in sync", || leader.followers().iter().any(|f| f.in_sync));
    let mut last = None;
    for i in 0..100 {
        last = Some(publish(&store, q, i));
    }
    // never acked, more than 4 KiB behind: out of the set, and the wait fails
    let err = last.unwrap().wait().unwrap_err();
    assert!(matches!(err, StoreError::NotEnoughReplicas(_)), "{err}");
    assert!(leader.followers().iter().all(|f| !f.in_sync));
    // caught up: back in, and a confirm needs its ack again
    ack(&mut sock, store.commitlog().end());
    eventually("back in sync", || {
        leader.followers().iter().any(|f| f.in_sync)
    });
    let d = publish(&store, q, 100);
    assert!(!d.is_durable(), "waits for the follower");
    ack(&mut sock, store.commitlog().end());
    d.wait().unwrap();
}

/// The leader's retention deletes segments and its compaction copies live records
/// forward; a follower keeps every byte it was shipped, and its directory, opened as a
/// store, has exactly the leader's unacked messages (the copies repoint the entries in
/// the replay, acks are replayed too).
#[test]
fn a_follower_of_a_compacting_leader_promotes_to_the_leaders_unacked_messages() {
    let l = tempfile::tempdir().unwrap();
    let f = tempfile::tempdir().unwrap();
    let (store, leader) = start_leader(l.path(), false, 1, 1 << 20);
    let mut fol = RunningFollower::start("f", &leader, f.path());
    let q = store.create_queue("/", "q", true).unwrap();
    for i in 0..600u32 {
        publish(&store, q, i).wait().unwrap();
    }
    // everything but every tenth acked, then retention and compaction
    let acked: Vec<u64> = (0..600u64).filter(|i| i % 10 != 0).collect();
    store.ack(q, &acked).unwrap().wait().unwrap();
    store.checkpoint().unwrap();
    let segs_before = store.commitlog().segment_list().len();
    store.run_retention().unwrap();
    store.checkpoint().unwrap();
    store.run_retention().unwrap();
    let segs_after = store.commitlog().segment_list().len();
    assert!(segs_after < segs_before, "{segs_before} -> {segs_after}");
    // and more traffic after it
    for i in 600..650u32 {
        publish(&store, q, i).wait().unwrap();
    }
    let want: Vec<(u64, Vec<u8>)> = store
        .unacked(q, 10_000)
        .unwrap()
        .into_iter()
        .map(|o| {
            let e = store.entry(q, o).unwrap();
            (o, store.read(e.commit_offset).unwrap().body.to_vec())
        })
        .collect();
    assert_eq!(want.len(), 60 + 50);
    let (end, jpos) = (store.commitlog().end(), store.journal().position().0);
    // at or past: the maintenance thread may still compact (and so append) meanwhile
    eventually("caught up", || {
        fol.progress.log_durable.load(Ordering::SeqCst) >= end
            && fol.progress.journal_durable.load(Ordering::SeqCst) >= jpos
    });
    fol.stop().unwrap();
    drop(leader);
    drop(store);
    let s = open_replica(f.path());
    let q2 = s.find_queue("/", "q").unwrap();
    let got: Vec<(u64, Vec<u8>)> = s
        .unacked(q2, 10_000)
        .unwrap()
        .into_iter()
        .map(|o| {
            let e = s.entry(q2, o).unwrap();
            (o, s.read(e.commit_offset).unwrap().body.to_vec())
        })
        .collect();
    assert_eq!(got, want);
}

/// Leader-epoch truncation in one process: leader A (epoch 1) and follower B; B stops;
/// A writes more alone and closes as a broker; B leads epoch 5 and writes; A's directory
/// drops its broker state, follows B (truncating its lone suffix) and, promoted, holds
/// exactly B's messages.
#[test]
fn a_demoted_leader_truncates_its_lone_suffix_and_holds_the_new_leaders_log() {
    use triad_cluster::codec::EpochEntry;
    use triad_cluster::epochs::EpochHistory;
    use triad_store::replica::{drop_broker_state, ReplicaStore};
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let term = |dir: &Path, epoch: u64| {
        let (log_start, journal_start) = {
            let r = ReplicaStore::open(dir, SEG).unwrap();
            (r.log_end(), r.journal_pos())
        };
        let mut h = EpochHistory::load(dir).unwrap();
        h.append(
            dir,
            EpochEntry {
                epoch,
                log_start,
                journal_start,
            },
        )
        .unwrap();
        h
    };
    let leader_on = |dir: &Path, epoch: u64, history: EpochHistory| {
        let gate = ReplicaGate::new(false);
        let store = leader_store(dir, &gate);
        let leader = Leader::start(
            store.clone(),
            gate,
            LeaderConfig {
                node_id: format!("n{epoch}"),
                listen: "127.0.0.1:0".into(),
                epoch,
                history,
                min_insync: 1,
                replica_lag_max: 1 << 20,
                tls: None,
            },
        )
        .unwrap();
        (store, leader)
    };
    let bodies = |store: &Store| {
        let q = store.find_queue("/", "q").expect("queue");
        let n = store.queue_next_offset(q).unwrap();
        (0..n)
            .map(|i| {
                let e = store.entry(q, i).unwrap();
                String::from_utf8(store.read(e.commit_offset).unwrap().body.to_vec()).unwrap()
            })
            .collect::<Vec<_>>()
    };

    // term 1: A leads, B follows and gets messages 0..100
    let history = term(a.path(), 1);
    let (store, leader) = leader_on(a.path(), 1, history);
    let q = store.create_queue("/", "q", true).unwrap();
    let mut fb = RunningFollower::start("b", &leader, b.path());
    for i in 0..100 {
        publish(&store, q, i).wait().unwrap();
    }
    let end = store.commitlog().end();
    eventually("b has term 1's messages", || {
        fb.progress.log_durable.load(Ordering::SeqCst) >= end
    });
    fb.stop().unwrap();
    // A goes on alone (nobody has these), then closes as a broker (checkpoint and all)
    for i in 1000..1050 {
        publish(&store, q, i).wait().unwrap();
    }
    drop(leader);
    // the leader's sender threads let go of the store within a heartbeat
    let mut held = Some(store);
    eventually("a's store let go", || {
        match Arc::try_unwrap(held.take().unwrap()) {
            Ok(s) => {
                s.close().unwrap();
                true
            }
            Err(s) => {
                held = Some(s);
                false
            }
        }
    });
    assert!(a.path().join("checkpoint").exists());

    // term 5: B leads and writes
    let history = term(b.path(), 5);
    assert_eq!(
        history.entries().len(),
        2,
        "b adopted term 1, then began term 5"
    );
    let (store, leader) = leader_on(b.path(), 5, history);
    let q = store.find_queue("/", "q").unwrap();
    for i in 2000..2020 {
        publish(&store, q, i).wait().unwrap();
    }
    let want = bodies(&store);
    assert_eq!(want.len(), 120);

    // A comes back as B's follower
    assert!(drop_broker_state(a.path()).unwrap());
    assert!(!a.path().join("checkpoint").exists());
    assert!(!a.path().join("consumequeue").exists());
    let mut fa = RunningFollower::start("a", &leader, a.path());
    let end = store.commitlog().end();
    // its log was longer (its lone suffix): equal once truncated and caught up
    eventually("a has caught up with b", || {
        fa.progress.log_durable.load(Ordering::SeqCst) == end
    });
    fa.stop().unwrap();
    assert_eq!(EpochHistory::load(a.path()).unwrap().last_epoch(), 5);
    drop(leader);
    drop(store);
    // promoted, A holds exactly B's messages: none of its lone 1000..1050
    let promoted = open_replica(a.path());
    assert_eq!(promoted.commitlog().end(), end);
    assert_eq!(bodies(&promoted), want);
}

//! `kill -9` of a process writing with `sync` flush, at a random moment, several rounds
//! on the same directory: every append the child saw acknowledged (durable) must be
//! readable after recovery.
//!
//! The child is this test binary run again with `--ignored --exact crash_child_writer`.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use triad_store::record::{NewMessage, FLAG_PERSISTENT};
use triad_store::store::{Store, StoreConfig};

const DIR_ENV: &str = "TRIAD_CRASH_CHILD_DIR";
const START_ENV: &str = "TRIAD_CRASH_CHILD_START";

fn cfg(dir: &Path) -> StoreConfig {
    let mut c = StoreConfig::new(dir);
    c.segment_size = 64 * 1024;
    c.cq_entries_per_file = 256;
    c.checkpoint_interval = Duration::from_millis(50);
    c.retention_interval = Duration::from_millis(200);
    c
}

/// Deterministic per-message body so corruption is caught, not just absence.
fn body(i: u64) -> Vec<u8> {
    let mut b = i.to_le_bytes().to_vec();
    b.resize(8 + (i % 300) as usize, (i % 251) as u8);
    b
}

#[test]
#[ignore = "child process of kill_9_keeps_every_acknowledged_append"]
fn crash_child_writer() {
    let Ok(dir) = std::env::var(DIR_ENV) else {
        return;
    };
    let start: u64 = std::env::var(START_ENV).unwrap().parse().unwrap();
    let store = std::sync::Arc::new(Store::open(cfg(Path::new(&dir))).unwrap());
    let q = store.create_queue("/", "crash", true).unwrap();
    let out = std::sync::Arc::new(std::sync::Mutex::new(std::io::stdout()));
    println!("ready");
    // 4 writers share group commits; each prints a number only once it is durable
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let store = store.clone();
            let out = out.clone();
            std::thread::spawn(move || {
                for k in 0..1_000_000u64 {
                    let i = start + k * 4 + t;
                    let b = body(i);
                    let a = store
                        .append(&NewMessage {
                            queues: &[q],
                            flags: FLAG_PERSISTENT,
                            body: &b,
                            ..Default::default()
                        })
                        .unwrap();
                    a.durable.wait().unwrap();
                    let mut o = out.lock().unwrap();
                    writeln!(o, "{i}").unwrap();
                    o.flush().unwrap();
                    // consume some, so acks and retention run during the crash window too
                    if i.is_multiple_of(3) {
                        drop(store.ack(q, &[a.queue_offsets[0].1]).unwrap());
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn kill_9_keeps_every_acknowledged_append() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut acknowledged = BTreeSet::new();
    let mut seed = std::process::id() as u64 ^ 0x9e37_79b9_7f4a_7c15;
    for round in 0..5u64 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let kill_after = 50 + seed % 2000;
        let mut child = Command::new(&exe)
            .args([
                "--ignored",
                "--exact",
                "crash_child_writer",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(DIR_ENV, dir.path())
            .env(START_ENV, (round * 10_000_000).to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = 0;
        let mut ready = false;
        while let Some(Ok(line)) = lines.next() {
            if line.ends_with("ready") {
                ready = true;
                continue;
            }
            if let Ok(i) = line.trim().parse::<u64>() {
                acknowledged.insert(i);
                seen += 1;
                if seen >= kill_after || Instant::now() > deadline {
                    break;
                }
            }
        }
        assert!(ready, "child did not start");
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // lines the child wrote before dying were acknowledged too
        for line in lines.map_while(Result::ok) {
            if let Ok(i) = line.trim().parse::<u64>() {
                acknowledged.insert(i);
            }
        }

        let store = Store::open(cfg(dir.path())).unwrap();
        let q = store.find_queue("/", "crash").unwrap();
        let info = store.queue_info(q).unwrap();
        let mut found = BTreeSet::new();
        for off in store.unacked(q, usize::MAX).unwrap() {
            let (_, rec) = store.read_queue(q, off).unwrap().unwrap();
            let i = u64::from_le_bytes(rec.body[..8].try_into().unwrap());
            assert_eq!(
                rec.body.as_ref(),
                body(i).as_slice(),
                "round {round}: body of {i}"
            );
            assert!(found.insert(i), "round {round}: {i} twice");
        }
        let lost: Vec<_> = acknowledged
            .iter()
            .filter(|i| *i % 3 != 0 && !found.contains(i))
            .take(10)
            .collect();
        assert!(
            lost.is_empty(),
            "round {round}: acknowledged but lost: {lost:?} (queue {info:?})"
        );
        store.close().unwrap();
    }
}

const FLEET_DIR_ENV: &str = "TRIAD_CRASH_FLEET_DIR";
const FLEET_ROUND_ENV: &str = "TRIAD_CRASH_FLEET_ROUND";
const FLEET: u64 = 64;

/// Small queues that grow (own files), drain (back to the shared index), and a shared
/// index whose segments roll, compact and retire, all within the crash window.
fn fleet_cfg(dir: &Path) -> StoreConfig {
    let mut c = cfg(dir);
    c.small_queue_entries = 8;
    c.shared_index_segment_entries = 32;
    c
}

#[test]
#[ignore = "child process of kill_9_keeps_every_acknowledged_append_in_small_queues"]
fn crash_child_fleet() {
    let Ok(dir) = std::env::var(FLEET_DIR_ENV) else {
        return;
    };
    let round: u64 = std::env::var(FLEET_ROUND_ENV).unwrap().parse().unwrap();
    let store = std::sync::Arc::new(Store::open(fleet_cfg(Path::new(&dir))).unwrap());
    let qs: Vec<u32> = (0..FLEET)
        .map(|q| store.create_queue("/", &format!("dev-{q}"), true).unwrap())
        .collect();
    // Each round drains half the queues first (so big ones shrink back), durably.
    for (q, id) in qs.iter().enumerate() {
        if (q as u64 + round).is_multiple_of(2) {
            let next = store.queue_info(*id).unwrap().next_offset;
            if next > 0 {
                store.ack_range(*id, 0, next).unwrap().wait().unwrap();
            }
            println!("drain {q}");
        }
    }
    println!("ready");
    let out = std::sync::Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let threads: Vec<_> = (0..2u64)
        .map(|t| {
            let (store, out, qs) = (store.clone(), out.clone(), qs.clone());
            std::thread::spawn(move || {
                for k in 0..1_000_000u64 {
                    let i = round * 10_000_000 + k * 2 + t;
                    let q = qs[(i % FLEET) as usize];
                    let b = body(i);
                    let a = store
                        .append(&NewMessage {
                            queues: &[q],
                            flags: FLAG_PERSISTENT,
                            body: &b,
                            ..Default::default()
                        })
                        .unwrap();
                    a.durable.wait().unwrap();
                    let mut o = out.lock().unwrap();
                    writeln!(o, "{i}").unwrap();
                    o.flush().unwrap();
                    drop(o);
                    // a quarter of the queues are consumed as they go: they stay small
                    if i % FLEET < FLEET / 4 {
                        drop(store.ack(q, &[a.queue_offsets[0].1]).unwrap());
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn kill_9_keeps_every_acknowledged_append_in_small_queues() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut acknowledged = BTreeSet::new();
    let mut consumed: BTreeSet<u64> = BTreeSet::new();
    let mut seed = std::process::id() as u64 ^ 0x2545_f491_4f6c_dd1d;
    for round in 0..5u64 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let kill_after = 100 + seed % 1500;
        let mut child = Command::new(&exe)
            .args([
                "--ignored",
                "--exact",
                "crash_child_fleet",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(FLEET_DIR_ENV, dir.path())
            .env(FLEET_ROUND_ENV, round.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let deadline = Instant::now() + Duration::from_secs(60);
        let (mut seen, mut ready) = (0, false);
        let mut note = |line: &str, acknowledged: &mut BTreeSet<u64>| -> bool {
            if let Some(q) = line.trim().strip_prefix("drain ") {
                let q: u64 = q.parse().unwrap();
                consumed.extend(acknowledged.iter().filter(|i| *i % FLEET == q));
            } else if let Ok(i) = line.trim().parse::<u64>() {
                acknowledged.insert(i);
                return true;
            }
            false
        };
        while let Some(Ok(line)) = lines.next() {
            if line.ends_with("ready") {
                ready = true;
                continue;
            }
            if note(&line, &mut acknowledged) {
                seen += 1;
                if seen >= kill_after || Instant::now() > deadline {
                    break;
                }
            }
        }
        assert!(ready, "child did not start");
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        for line in lines.map_while(Result::ok) {
            note(&line, &mut acknowledged);
        }

        let store = Store::open(fleet_cfg(dir.path())).unwrap();
        let mut found = BTreeSet::new();
        for q in 0..FLEET {
            let id = store.find_queue("/", &format!("dev-{q}")).unwrap();
            for off in store.unacked(id, usize::MAX).unwrap() {
                let (_, rec) = store.read_queue(id, off).unwrap().unwrap();
                let i = u64::from_le_bytes(rec.body[..8].try_into().unwrap());
                assert_eq!(i % FLEET, q, "round {round}: {i} in queue {q}");
                assert_eq!(rec.body.as_ref(), body(i).as_slice(), "round {round}");
                assert!(found.insert(i), "round {round}: {i} twice");
            }
        }
        let lost: Vec<_> = acknowledged
            .iter()
            .filter(|i| *i % FLEET >= FLEET / 4 && !consumed.contains(i) && !found.contains(i))
            .take(10)
            .collect();
        assert!(
            lost.is_empty(),
            "round {round}: acknowledged but lost: {lost:?}"
        );
        store.close().unwrap();
    }
}

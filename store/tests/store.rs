//! Whole-store tests: a model-checked random workload with clean and unclean restarts,
//! torn tails at every byte, corruption, locking, retention, index lookups.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use proptest::prelude::*;
use triad_store::flush::FlushMode;
use triad_store::record::{NewMessage, FLAG_PERSISTENT};
use triad_store::store::{Store, StoreConfig};
use triad_store::StoreError;

fn small_cfg(dir: &Path) -> StoreConfig {
    let mut c = StoreConfig::new(dir);
    c.segment_size = 8192;
    c.cq_entries_per_file = 16;
    // queues move between heap + shared index and their own files, and shared-index
    // segments roll and retire, within the few dozen messages a test writes
    c.small_queue_entries = 8;
    c.shared_index_segment_entries = 8;
    c.index.slots = 64;
    c.index.max_entries = 64;
    c.checkpoint_interval = Duration::from_secs(3600);
    c.retention_interval = Duration::from_secs(3600);
    c
}

fn body_for(i: u64) -> Vec<u8> {
    let len = (i * 37 % 700) as usize;
    (0..len).map(|j| (i as usize + j) as u8).collect()
}

fn append(store: &Store, queues: &[u32], i: u64) -> (u64, Vec<(u32, u64)>) {
    let key = format!("msg-{i}");
    let keys: [&[u8]; 1] = [key.as_bytes()];
    let body = body_for(i);
    let a = store
        .append(&NewMessage {
            queues,
            flags: FLAG_PERSISTENT,
            born_ts_ms: i,
            tag_hash: i,
            keys: &keys,
            properties: format!("p{i}").as_bytes(),
            body: &body,
        })
        .unwrap();
    a.durable.wait().unwrap();
    (a.commit_offset, a.queue_offsets)
}

/// The model: per queue, the message numbers in queue order, and the acked offsets.
#[derive(Default, Clone, Debug)]
struct Model {
    queues: BTreeMap<u32, (Vec<u64>, std::collections::BTreeSet<u64>)>,
}

fn check(store: &Store, model: &Model) {
    for (q, (msgs, acked)) in &model.queues {
        let info = store.queue_info(*q).unwrap();
        assert_eq!(info.next_offset, msgs.len() as u64, "queue {q} length");
        for (off, i) in msgs.iter().enumerate() {
            let off = off as u64;
            assert_eq!(
                store.is_acked(*q, off).unwrap(),
                acked.contains(&off),
                "ack {q}/{off}"
            );
            if acked.contains(&off) {
                continue;
            }
            let (e, rec) = store.read_queue(*q, off).unwrap().expect("entry present");
            assert_eq!(e.tag_hash, *i);
            assert_eq!(rec.body.as_ref(), body_for(*i).as_slice(), "body {q}/{off}");
            assert_eq!(rec.properties.as_ref(), format!("p{i}").as_bytes());
            assert_eq!(rec.born_ts_ms, *i);
        }
        assert!(store.read_queue(*q, msgs.len() as u64).unwrap().is_none());
        let pending: Vec<u64> = (0..msgs.len() as u64)
            .filter(|o| !acked.contains(o))
            .collect();
        assert_eq!(store.unacked(*q, usize::MAX).unwrap(), pending);
    }
}

#[derive(Debug, Clone)]
enum Op {
    Append(Vec<u8>),
    Ack(u8, u16),
    Reopen,
    Crash,
    Checkpoint,
    Retention,
    /// Copy up to this many live records of the oldest sealed segment forward and stop
    /// there (a compaction cut short, as by a crash).
    Compact(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => proptest::collection::vec(0u8..3, 1..3).prop_map(Op::Append),
        4 => (0u8..3, any::<u16>()).prop_map(|(q, o)| Op::Ack(q, o)),
        1 => Just(Op::Reopen),
        1 => Just(Op::Crash),
        1 => Just(Op::Checkpoint),
        1 => Just(Op::Retention),
        1 => (1u8..4).prop_map(Op::Compact),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn random_workload_matches_model(ops in proptest::collection::vec(op(), 1..120), async_mode in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = small_cfg(dir.path());
        if async_mode {
            cfg.flush = FlushMode::async_default();
        }
        let mut store = Store::open(cfg.clone()).unwrap();
        let ids: Vec<u32> = (0..3).map(|i| store.create_queue("/", &format!("q{i}"), true).unwrap()).collect();
        let mut model = Model::default();
        for id in &ids {
            model.queues.insert(*id, Default::default());
        }
        let mut n = 0u64;
        for op in ops {
            match op {
                Op::Append(qs) => {
                    let mut qs: Vec<u32> = qs.iter().map(|q| ids[*q as usize]).collect();
                    qs.sort();
                    qs.dedup();
                    let (_, offs) = append(&store, &qs, n);
                    for (q, off) in offs {
                        let m = model.queues.get_mut(&q).unwrap();
                        assert_eq!(off, m.0.len() as u64);
                        m.0.push(n);
                    }
                    n += 1;
                }
                Op::Ack(q, o) => {
                    let q = ids[q as usize];
                    let m = model.queues.get_mut(&q).unwrap();
                    if !m.0.is_empty() {
                        let off = o as u64 % m.0.len() as u64;
                        store.ack(q, &[off]).unwrap().wait().unwrap();
                        m.1.insert(off);
                    }
                }
                Op::Reopen => {
                    drop(store);
                    store = Store::open(cfg.clone()).unwrap();
                }
                Op::Crash => {
                    // in async mode an unflushed tail may be lost by a power cut, but not
                    // by a process crash: the page cache keeps it, as here
                    store.abandon();
                    store = Store::open(cfg.clone()).unwrap();
                }
                Op::Checkpoint => store.checkpoint().unwrap(),
                Op::Retention => { store.run_retention().unwrap(); }
                Op::Compact(n) => { store.compact_partly(n as usize).unwrap(); }
            }
            check(&store, &model);
        }
        drop(store);
        let store = Store::open(cfg).unwrap();
        check(&store, &model);
    }
}

/// Writes `n` messages to one queue (small segments), acks the first `acked`, then
/// "crashes" (no checkpoint, abort marker left).
fn crashed_store(dir: &Path, n: u64, acked: u64) -> (Vec<(u64, u64)>, u64) {
    let store = Store::open(small_cfg(dir)).unwrap();
    let q = store.create_queue("/", "q", true).unwrap();
    let mut offs = Vec::new();
    for i in 0..n {
        let start = append(&store, &[q], i).0;
        offs.push((start, store.stats().commitlog_end));
    }
    let ackd: Vec<u64> = (0..acked).collect();
    store.ack(q, &ackd).unwrap().wait().unwrap();
    let end = store.stats().commitlog_end;
    store.abandon();
    (offs, end)
}

fn copy_dir(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&dst).unwrap();
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

fn last_segment(dir: &Path) -> std::path::PathBuf {
    let mut segs: Vec<_> = std::fs::read_dir(dir.join("commitlog"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    segs.sort();
    segs.pop().unwrap()
}

/// Recovered state after damage equals a prefix of what was written: messages wholly
/// before the damage are all there, nothing at or after it is.
fn assert_prefix(dir: &Path, offs: &[(u64, u64)], cut: u64) {
    let store = Store::open(small_cfg(dir)).unwrap();
    let q = store.find_queue("/", "q").unwrap();
    let info = store.queue_info(q).unwrap();
    // a record survives when it ends at or before the cut
    let expect = offs.iter().filter(|(_, end)| *end <= cut).count() as u64;
    assert_eq!(info.next_offset, expect, "cut at {cut}");
    for i in 0..info.next_offset {
        let (_, rec) = store.read_queue(q, i).unwrap().unwrap();
        assert_eq!(rec.body.as_ref(), body_for(i).as_slice());
    }
    // and the store keeps working after the repair
    let (_, offs2) = append(&store, &[q], info.next_offset);
    assert_eq!(offs2[0].1, info.next_offset);
    drop(store);
    let store = Store::open(small_cfg(dir)).unwrap();
    assert_eq!(
        store.queue_info(q).unwrap().next_offset,
        info.next_offset + 1
    );
}

#[test]
fn torn_tail_at_every_byte_of_the_last_records() {
    let base = tempfile::tempdir().unwrap();
    let (offs, end) = crashed_store(base.path(), 40, 0);
    let seg = last_segment(base.path());
    let seg_start: u64 = seg.file_name().unwrap().to_str().unwrap().parse().unwrap();
    // the last three records of the last segment
    let from = offs.iter().rev().nth(2).unwrap().0.max(seg_start);
    for cut in from..=end {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(base.path(), dir.path());
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(last_segment(dir.path()))
            .unwrap();
        f.set_len(cut - seg_start).unwrap();
        drop(f);
        assert_prefix(dir.path(), &offs, cut);
    }
}

#[test]
fn flipped_byte_in_the_tail_cuts_there() {
    let base = tempfile::tempdir().unwrap();
    let (offs, end) = crashed_store(base.path(), 40, 0);
    let seg = last_segment(base.path());
    let seg_start: u64 = seg.file_name().unwrap().to_str().unwrap().parse().unwrap();
    let from = offs.iter().rev().nth(1).unwrap().0.max(seg_start);
    for pos in (from..end).step_by(7) {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(base.path(), dir.path());
        let p = last_segment(dir.path());
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[(pos - seg_start) as usize] ^= 0x5a;
        std::fs::write(&p, bytes).unwrap();
        // the damaged record is the one containing `pos`
        let rec_start = offs.iter().rfind(|o| o.0 <= pos).unwrap().0;
        let store = Store::open(small_cfg(dir.path())).unwrap();
        let q = store.find_queue("/", "q").unwrap();
        let expect = offs.iter().filter(|o| o.0 < rec_start).count() as u64;
        assert_eq!(
            store.queue_info(q).unwrap().next_offset,
            expect,
            "flip at {pos}"
        );
    }
}

#[test]
fn acks_survive_clean_and_unclean_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let (_, _) = crashed_store(dir.path(), 30, 10);
    let store = Store::open(small_cfg(dir.path())).unwrap();
    let q = store.find_queue("/", "q").unwrap();
    let info = store.queue_info(q).unwrap();
    assert_eq!(
        (info.ack_head, info.next_offset, info.pending()),
        (10, 30, 20)
    );
    // after a crash every remaining entry may have been delivered
    assert!(store.may_have_been_delivered(q, 29).unwrap());
    store.ack(q, &[12, 13]).unwrap().wait().unwrap();
    store.mark_delivered(q, 14).unwrap();
    drop(store);
    let store = Store::open(small_cfg(dir.path())).unwrap();
    assert_eq!(store.unacked(q, 3).unwrap(), vec![10, 11, 14]);
    // a clean restart keeps the exact delivery mark
    assert!(store.may_have_been_delivered(q, 28).unwrap());
    store.ack_range(q, 0, 30).unwrap().wait().unwrap();
    store.mark_delivered(q, 0).unwrap();
    drop(store);
    let store = Store::open(small_cfg(dir.path())).unwrap();
    assert_eq!(store.queue_info(q).unwrap().pending(), 0);
}

#[test]
fn clean_start_replays_nothing_and_delivery_mark_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(small_cfg(dir.path())).unwrap();
    let q = store.create_queue("/", "q", true).unwrap();
    for i in 0..5 {
        append(&store, &[q], i);
    }
    store.mark_delivered(q, 1).unwrap();
    let end = store.stats().commitlog_end;
    drop(store);
    let store = Store::open(small_cfg(dir.path())).unwrap();
    assert_eq!(store.stats().checkpoint, end);
    assert!(store.may_have_been_delivered(q, 1).unwrap());
    assert!(!store.may_have_been_delivered(q, 2).unwrap());
}

#[test]
fn a_second_store_on_the_same_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _a = Store::open(small_cfg(dir.path())).unwrap();
    match Store::open(small_cfg(dir.path())) {
        Err(StoreError::Locked(_)) => {}
        other => panic!("expected Locked, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn transient_queues_vanish_on_restart() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(small_cfg(dir.path())).unwrap();
    let t = store.create_queue("/", "tmp", false).unwrap();
    let d = store.create_queue("/", "keep", true).unwrap();
    append(&store, &[t, d], 1);
    store.ack(t, &[0]).unwrap().wait().unwrap();
    drop(store);
    let store = Store::open(small_cfg(dir.path())).unwrap();
    assert_eq!(store.find_queue("/", "tmp"), None);
    assert_eq!(store.find_queue("/", "keep"), Some(d));
    assert_eq!(store.queues().len(), 1);
    // ids are never reused
    assert!(store.create_queue("/", "tmp", false).unwrap() > d);
}

#[test]
fn deleted_queue_frees_its_name_and_files() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(small_cfg(dir.path())).unwrap();
    let q = store.create_queue("vh", "a/b", true).unwrap();
    append(&store, &[q], 1);
    store.delete_queue(q).unwrap();
    assert!(matches!(store.queue_info(q), Err(StoreError::NotFound(_))));
    let q2 = store.create_queue("vh", "a/b", true).unwrap();
    assert_ne!(q, q2);
    assert_eq!(store.queue_info(q2).unwrap().next_offset, 0);
    drop(store);
    let store = Store::open(small_cfg(dir.path())).unwrap();
    assert_eq!(store.queue_info(q2).unwrap().next_offset, 0);
}

#[test]
fn retention_deletes_consumed_segments_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(small_cfg(dir.path())).unwrap();
    let a = store.create_queue("/", "a", true).unwrap();
    let b = store.create_queue("/", "b", true).unwrap();
    for i in 0..100 {
        append(&store, &[a], i);
    }
    append(&store, &[b], 100);
    let before = store.stats().segments;
    assert!(before > 4);
    store.checkpoint().unwrap();
    // b still needs its one message near the end; a's first half is consumed
    store.ack_range(a, 0, 50).unwrap().wait().unwrap();
    store.checkpoint().unwrap();
    let deleted = store.run_retention().unwrap();
    assert!(deleted > 0);
    assert!(store.read_queue(a, 50).unwrap().is_some());
    let ackb = store.stats().segments;
    store.ack_range(a, 50, 100).unwrap().wait().unwrap();
    store.checkpoint().unwrap();
    store.run_retention().unwrap();
    assert!(store.stats().segments < ackb);
    assert!(store.read_queue(b, 0).unwrap().is_some());
    drop(store);
    let store = Store::open(small_cfg(dir.path())).unwrap();
    assert_eq!(store.queue_info(a).unwrap().pending(), 0);
    assert!(store.read_queue(b, 0).unwrap().is_some());
}

/// Steady traffic through a queue that is consumed as it goes, and one slow queue that
/// holds every tenth message for a long time: the log (the segment being written
/// included) stays within twice the slow queue's live bytes plus two segments, and the slow queue's
/// messages survive compaction, crashes in the middle of one and restarts, exactly once.
/// The slow queue holds exactly `held` (queue offset -> message number), each message
/// whole and found once by its key (a compaction's copy, never also its original), and
/// the fast queue nothing.
fn check_held(store: &Store, [fast, slow]: [u32; 2], held: &BTreeMap<u64, u64>) {
    assert_eq!(
        store.unacked(slow, usize::MAX).unwrap(),
        held.keys().copied().collect::<Vec<_>>()
    );
    for (off, i) in held {
        let (e, rec) = store.read_queue(slow, *off).unwrap().expect("held entry");
        assert_eq!(e.tag_hash, *i);
        assert_eq!(rec.body.as_ref(), body_for(*i).as_slice(), "message {i}");
        assert_eq!(rec.properties.as_ref(), format!("p{i}").as_bytes());
        assert_eq!(rec.born_ts_ms, *i);
        // one copy is found by its key, even while an older one still exists
        let found = store.lookup_key(format!("msg-{i}").as_bytes(), 8).unwrap();
        assert_eq!(found.len(), 1, "message {i} by key");
    }
    assert_eq!(store.queue_info(fast).unwrap().pending(), 0);
}

#[test]
fn one_slow_queue_does_not_pin_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_cfg(dir.path());
    let mut store = Store::open(cfg.clone()).unwrap();
    let fast = store.create_queue("/", "fast", true).unwrap();
    let slow = store.create_queue("/", "slow", true).unwrap();
    // slow queue offset -> message number
    let mut held: BTreeMap<u64, u64> = BTreeMap::new();
    let mut slow_next = 0u64;
    let mut max_segments = 0;
    // the most segments seen beyond twice the live bytes
    let mut worst = f64::MIN;
    for i in 0..3000u64 {
        let qs: Vec<u32> = if i % 10 == 0 {
            vec![fast, slow]
        } else {
            vec![fast]
        };
        let (_, offs) = append(&store, &qs, i);
        store.ack(fast, &[offs[0].1]).unwrap().wait().unwrap();
        if i % 10 == 0 {
            assert_eq!(offs[1], (slow, slow_next));
            held.insert(slow_next, i);
            slow_next += 1;
        }
        // the slow consumer takes one old message now and then, so copies thin out too
        if i % 70 == 69 {
            let (&off, _) = held.iter().nth(held.len() / 3).unwrap();
            store.ack(slow, &[off]).unwrap().wait().unwrap();
            held.remove(&off);
        }
        if i % 100 == 99 {
            store.checkpoint().unwrap();
            store.run_retention().unwrap();
            let segments = store.stats().segments as u64;
            max_segments = max_segments.max(segments);
            let live: u64 = held
                .keys()
                .map(|o| u64::from(store.entry(slow, *o).unwrap().size))
                .sum();
            worst = worst.max(segments as f64 - 2.0 * live as f64 / cfg.segment_size as f64);
            assert!(
                segments * cfg.segment_size <= 2 * live + 2 * cfg.segment_size,
                "after {i}: {segments} segments of {} bytes for {live} live bytes",
                cfg.segment_size
            );
        }
        // a crash in the middle of a compaction, now and then
        if i % 500 == 250 {
            store.checkpoint().unwrap();
            store.compact_partly(3).unwrap();
            store.abandon();
            store = Store::open(cfg.clone()).unwrap();
        }
    }
    let written = store.stats().commitlog_end;
    assert!(
        written > 40 * cfg.segment_size,
        "the test wrote {written} bytes: enough segments to matter"
    );
    check_held(&store, [fast, slow], &held);
    store.abandon();
    let store = Store::open(cfg.clone()).unwrap();
    check_held(&store, [fast, slow], &held);
    drop(store);
    let store = Store::open(cfg.clone()).unwrap();
    check_held(&store, [fast, slow], &held);
    eprintln!(
        "at most {max_segments} segments, at most {worst:.2} beyond twice the live bytes, \
         for {} held messages",
        held.len()
    );
}

/// A log compaction and retention left with holes (whole segments deleted) replays from
/// its first segment when the checkpoint is gone: a demoted leader's directory (see
/// `replica::drop_broker_state`), opened as a follower and later promoted, as the
/// replication tests do. The holes are deleted segments, not damage: the replay goes on
/// after them, and the ack states journaled at the checkpoint that let them go cover the
/// acks they held.
#[test]
fn a_log_with_deleted_segments_replays_whole_without_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_cfg(dir.path());
    let store = Store::open(cfg.clone()).unwrap();
    let fast = store.create_queue("/", "fast", true).unwrap();
    let slow = store.create_queue("/", "slow", true).unwrap();
    let mut held: BTreeMap<u64, u64> = BTreeMap::new();
    write_fast_and_slow(&store, [fast, slow], 600, |i, slow_entry| {
        held.extend(slow_entry.map(|off| (off, i)));
        if i % 70 == 69 {
            let (&off, _) = held.iter().nth(held.len() / 2).unwrap();
            store.ack(slow, &[off]).unwrap().wait().unwrap();
            held.remove(&off);
        }
        if i % 100 == 99 {
            store.checkpoint().unwrap();
            store.run_retention().unwrap();
        }
    });
    let starts: Vec<u64> = store
        .segment_paths()
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap().parse().unwrap())
        .collect();
    assert!(
        starts.windows(2).any(|w| w[1] - w[0] > cfg.segment_size),
        "no hole in the log: {starts:?}"
    );
    store.close().unwrap();
    assert!(triad_store::replica::drop_broker_state(dir.path()).unwrap());
    // a follower opens it (and cuts nothing)
    let replica = triad_store::replica::ReplicaStore::open(dir.path(), cfg.segment_size).unwrap();
    let end = replica.log_end();
    drop(replica);
    // then a promotion replays it all
    let store = Store::open(cfg.clone()).unwrap();
    assert_eq!(store.stats().commitlog_end, end);
    check_held(&store, [fast, slow], &held);
    store.abandon();
    check_held(&Store::open(cfg).unwrap(), [fast, slow], &held);
}

/// A store with async flushing (as the broker's `flush = "async"`, where a segment can
/// fill faster than any period) and two queues: `fast` (acked at once) and `slow` (never
/// read). Returns the config, the store and the two queues.
fn open_async_fast_and_slow(dir: &Path) -> (StoreConfig, Store, [u32; 2]) {
    let mut cfg = small_cfg(dir);
    cfg.flush = FlushMode::Async {
        interval: Duration::from_millis(5),
        dirty_bytes: 4096,
    };
    let store = Store::open(cfg.clone()).unwrap();
    let fast = store.create_queue("/", "fast", true).unwrap();
    let slow = store.create_queue("/", "slow", true).unwrap();
    (cfg, store, [fast, slow])
}

/// Appends `n` messages to `fast`, every 20th to `slow` too, and acks each on `fast` at
/// once; `after(i, slow entry)` runs after each one's ack.
fn write_fast_and_slow(
    store: &Store,
    [fast, slow]: [u32; 2],
    n: u64,
    mut after: impl FnMut(u64, Option<u64>),
) {
    for i in 0..n {
        let qs: Vec<u32> = if i % 20 == 0 {
            vec![fast, slow]
        } else {
            vec![fast]
        };
        let (_, offs) = append(store, &qs, i);
        store.ack(fast, &[offs[0].1]).unwrap().wait().unwrap();
        after(i, offs.get(1).map(|&(_, off)| off));
    }
}

/// A sealed segment gets its checkpoint and retention pass when it seals, not at the next
/// period: with both periods at an hour, the log still stays within twice the slow queue's
/// live bytes plus two segments once the writes stop (async flushing, as the broker's
/// `flush = "async"`, where a segment can fill faster than any period).
#[test]
fn a_sealed_segment_is_compacted_when_it_seals() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, store, queues) = open_async_fast_and_slow(dir.path());
    let slow = queues[1];
    let mut held = Vec::new();
    write_fast_and_slow(&store, queues, 2000, |i, slow_entry| {
        held.extend(slow_entry.map(|o| (o, i)))
    });
    assert!(store.stats().commitlog_end > 40 * cfg.segment_size);
    let live: u64 = held
        .iter()
        .map(|(o, _)| u64::from(store.entry(slow, *o).unwrap().size))
        .sum();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let segments = store.stats().segments as u64;
        if segments * cfg.segment_size <= 2 * live + 2 * cfg.segment_size {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{segments} segments of {} bytes for {live} live bytes, 30 s after the writes",
            cfg.segment_size
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for (off, i) in &held {
        let (_, rec) = store.read_queue(slow, *off).unwrap().expect("held entry");
        assert_eq!(rec.body.as_ref(), body_for(*i).as_slice(), "message {i}");
    }
}

/// The bound holds while the writes go on, not only once they stop: with async flushing,
/// and the writer sealing a segment every few appends, the log never holds more than
/// twice the slow queue's live bytes plus two segments, checked after every append. The
/// writer does not start a third segment while a sealed one awaits its pass (no segment
/// created ahead; an append that would seal the next one waits for the pass).
#[test]
fn the_log_stays_within_its_bound_during_the_writes() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, store, queues) = open_async_fast_and_slow(dir.path());
    let slow = queues[1];
    let mut live = 0u64;
    write_fast_and_slow(&store, queues, 1500, |i, slow_entry| {
        if let Some(off) = slow_entry {
            live += u64::from(store.entry(slow, off).unwrap().size);
        }
        let on_disk = store.stats().segments as u64 * cfg.segment_size;
        let bound = 2 * live + 2 * cfg.segment_size;
        assert!(
            on_disk <= bound,
            "after append {i}: {on_disk} bytes of segments for {live} live bytes (bound {bound}); {:?}",
            store.stats()
        );
    });
    let st = store.stats();
    assert!(st.commitlog_end > 30 * cfg.segment_size, "{st:?}");
    assert!(st.compactions > 0, "{st:?}");
}

/// A replication leader's retention keeps what a connected follower has not got yet:
/// no segment past the gate's floor is deleted or compacted; once the floor moves (the
/// follower caught up, or left), they go.
#[test]
fn retention_keeps_the_segments_a_connected_follower_still_needs() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small_cfg(dir.path());
    let gate = triad_store::replica::ReplicaGate::new(false);
    cfg.replica = Some(gate.clone());
    let store = Store::open(cfg.clone()).unwrap();
    let q = store.create_queue("/", "q", true).unwrap();
    // a follower that holds only the first segment
    gate.set_retention_floor(Some(cfg.segment_size));
    for i in 0..200u64 {
        let (_, offs) = append(&store, &[q], i);
        store.ack(q, &[offs[0].1]).unwrap().wait().unwrap();
    }
    let written = store.stats().commitlog_end / cfg.segment_size;
    assert!(written > 10, "{:?}", store.stats());
    store.checkpoint().unwrap();
    store.run_retention().unwrap();
    // everything is acked: only the first segment could go
    let st = store.stats();
    assert!(st.commitlog_min <= cfg.segment_size, "{st:?}");
    assert!(st.segments as u64 >= written, "{st:?}");
    // the follower caught up (or left): the dead segments go
    gate.set_retention_floor(None);
    store.run_retention().unwrap();
    let st = store.stats();
    assert!(st.segments <= 2, "{st:?}");
}

#[test]
fn lookup_by_key_across_index_files_and_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(small_cfg(dir.path())).unwrap();
    let q = store.create_queue("/", "q", true).unwrap();
    let mut offs = Vec::new();
    for i in 0..200 {
        offs.push(append(&store, &[q], i).0);
    }
    for i in [0u64, 63, 64, 199] {
        let found = store.lookup_key(format!("msg-{i}").as_bytes(), 5).unwrap();
        assert_eq!(found.len(), 1, "key {i}");
        assert_eq!(found[0].commit_offset, offs[i as usize]);
    }
    assert!(store.lookup_key(b"msg-9999", 5).unwrap().is_empty());
    store.abandon();
    let store = Store::open(small_cfg(dir.path())).unwrap();
    let found = store.lookup_key(b"msg-150", 5).unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].body.as_ref(), body_for(150).as_slice());
}

#[test]
fn invalid_appends_and_acks_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(small_cfg(dir.path())).unwrap();
    let q = store.create_queue("/", "q", true).unwrap();
    let no_queue = NewMessage {
        body: b"x",
        ..Default::default()
    };
    assert!(matches!(
        store.append(&no_queue),
        Err(StoreError::Invalid(_))
    ));
    let twice = NewMessage {
        queues: &[q, q],
        body: b"x",
        ..Default::default()
    };
    assert!(matches!(store.append(&twice), Err(StoreError::Invalid(_))));
    let unknown = NewMessage {
        queues: &[999],
        body: b"x",
        ..Default::default()
    };
    assert!(matches!(
        store.append(&unknown),
        Err(StoreError::NotFound(_))
    ));
    let big = vec![0u8; 9000];
    let huge = NewMessage {
        queues: &[q],
        body: &big,
        ..Default::default()
    };
    assert!(matches!(
        store.append(&huge),
        Err(StoreError::TooLarge { .. })
    ));
    assert!(matches!(store.ack(q, &[0]), Err(StoreError::Invalid(_))));
    assert_eq!(store.queue_info(q).unwrap().next_offset, 0);
}

#[test]
fn corrupt_sealed_segment_refuses_to_start_without_repair() {
    let dir = tempfile::tempdir().unwrap();
    let (offs, _) = crashed_store(dir.path(), 60, 0);
    let first = std::fs::read_dir(dir.path().join("commitlog"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .min()
        .unwrap();
    // remove the checkpoint so recovery scans the first segment
    let _ = std::fs::remove_file(dir.path().join("checkpoint"));
    let mut bytes = std::fs::read(&first).unwrap();
    bytes[(offs[1].0 + 20) as usize] ^= 0xff;
    std::fs::write(&first, bytes).unwrap();
    match Store::open(small_cfg(dir.path())) {
        Err(StoreError::Corrupt { reason, .. }) => assert!(reason.contains("--repair"), "{reason}"),
        other => panic!("expected Corrupt, got {:?}", other.map(|_| ())),
    }
    let mut cfg = small_cfg(dir.path());
    cfg.repair = true;
    let store = Store::open(cfg).unwrap();
    let q = store.find_queue("/", "q").unwrap();
    assert_eq!(store.queue_info(q).unwrap().next_offset, 1);
}

#[test]
fn a_checkpoint_journals_only_the_ack_states_that_changed() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u32>;
    {
        let s = Store::open(small_cfg(dir.path())).unwrap();
        ids = (0..500)
            .map(|i| s.create_queue("/", &format!("q{i}"), true).unwrap())
            .collect();
        for (i, q) in ids.iter().enumerate() {
            append(&s, &[*q], i as u64);
        }
        s.checkpoint().unwrap();
        // one queue acks: the next checkpoint journals that queue's state, not all 500
        let before = s.journal().position().0;
        s.ack(ids[7], &[0]).unwrap().wait().unwrap();
        s.mark_delivered(ids[7], 0).unwrap();
        s.checkpoint().unwrap();
        let grew = s.journal().position().0 - before;
        assert!(
            grew < 200,
            "checkpoint journaled {grew} bytes for one changed queue"
        );
        // nothing changed: nothing journaled
        let before = s.journal().position().0;
        s.checkpoint().unwrap();
        assert_eq!(s.journal().position().0, before);
        // acked after the last checkpoint, then a crash: the replay restores it
        s.ack(ids[9], &[0]).unwrap().wait().unwrap();
        s.abandon();
    }
    let s = Store::open(small_cfg(dir.path())).unwrap();
    for (i, q) in ids.iter().enumerate() {
        let acked = i == 7 || i == 9;
        assert_eq!(s.is_acked(*q, 0).unwrap(), acked, "queue {i}");
    }
    assert!(s.may_have_been_delivered(ids[7], 0).unwrap());
    drop(s);
    // and after a clean restart, from the journal alone
    let s = Store::open(small_cfg(dir.path())).unwrap();
    assert!(s.is_acked(ids[9], 0).unwrap() && s.is_acked(ids[7], 0).unwrap());
    assert!(!s.is_acked(ids[8], 0).unwrap());
}

fn dir_bytes(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = std::fs::read_dir(p) else {
        return 0;
    };
    rd.map(|e| {
        let e = e.unwrap();
        let m = e.metadata().unwrap();
        if m.is_dir() {
            dir_bytes(&e.path())
        } else {
            m.blocks() * 512
        }
    })
    .sum()
}

fn count_entries(p: &Path) -> usize {
    std::fs::read_dir(p).map_or(0, |rd| rd.count())
}

/// Many queues with a message or two: no per-queue file or directory; they survive a
/// kill -9 and a clean restart; consuming and deleting them frees the shared index.
#[test]
fn small_queues_own_no_files_and_survive_crashes() {
    const N: u64 = 500;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(dir.path());
    cfg.segment_size = 1 << 20;
    cfg.shared_index_segment_entries = 64;
    cfg.checkpoint_interval = Duration::from_secs(3600);
    cfg.retention_interval = Duration::from_secs(3600);
    let store = Store::open(cfg.clone()).unwrap();
    let ids: Vec<u32> = (0..N)
        .map(|i| store.create_queue("/", &format!("dev-{i}"), true).unwrap())
        .collect();
    for (i, q) in ids.iter().enumerate() {
        append(&store, &[*q], i as u64);
    }
    // a message for every queue at once: the shape of an MQTT fan-out
    append(&store, &ids, N);
    store.checkpoint().unwrap();
    assert_eq!(
        count_entries(&dir.path().join("consumequeue")),
        0,
        "no queue directory"
    );
    let shared = dir_bytes(&dir.path().join("sharedcq"));
    assert!(
        // segments of 64 entries (2,560 bytes, a 4 KiB block each)
        shared <= ((2 * N).div_ceil(64) + 1) * 4096,
        "shared index {shared} bytes for {N} queues of 2 entries"
    );
    store.abandon();

    let store = Store::open(cfg.clone()).unwrap();
    for (i, q) in ids.iter().enumerate() {
        let info = store.queue_info(*q).unwrap();
        assert_eq!((info.next_offset, info.pending()), (2, 2), "queue {i}");
        let (_, rec) = store.read_queue(*q, 0).unwrap().unwrap();
        assert_eq!(rec.body.as_ref(), body_for(i as u64).as_slice());
        let (_, rec) = store.read_queue(*q, 1).unwrap().unwrap();
        assert_eq!(rec.body.as_ref(), body_for(N).as_slice());
    }
    // consume everything: each queue keeps one entry (its next offset) and no more
    for q in &ids {
        store.ack_range(*q, 0, 2).unwrap().wait().unwrap();
    }
    store.checkpoint().unwrap();
    store.run_retention().unwrap();
    store.abandon();
    let store = Store::open(cfg.clone()).unwrap();
    let live_segments = count_entries(&dir.path().join("sharedcq"));
    assert!(
        live_segments <= (N as usize).div_ceil(64) + 1,
        "{live_segments} segments for {N} live entries"
    );
    for q in &ids {
        let info = store.queue_info(*q).unwrap();
        assert_eq!((info.next_offset, info.pending()), (2, 0));
        assert_eq!(store.read_queue(*q, 0).unwrap().map(|r| r.0), None);
    }
    // the next message gets offset 2, after a clean restart too
    let (_, offs) = append(&store, &ids[..1], N + 1);
    assert_eq!(offs, vec![(ids[0], 2)]);
    drop(store);
    let store = Store::open(cfg.clone()).unwrap();
    assert_eq!(store.queue_info(ids[0]).unwrap().pending(), 1);
    // deleting the queues frees the index down to the segment being written
    for q in &ids {
        store.delete_queue(*q).unwrap();
    }
    store.run_retention().unwrap();
    assert_eq!(count_entries(&dir.path().join("sharedcq")), 1);
    drop(store);
    let store = Store::open(cfg).unwrap();
    assert!(store.queues().is_empty());
    assert_eq!(count_entries(&dir.path().join("sharedcq")), 1);
}

/// A queue that grows gets its own files and loses them when drained; one old live entry
/// does not pin a shared-index segment; crashes at each step lose nothing.
#[test]
fn queues_move_between_forms_and_old_segments_are_compacted() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_cfg(dir.path());
    let store = Store::open(cfg.clone()).unwrap();
    let idle = store.create_queue("/", "idle", true).unwrap();
    let busy = store.create_queue("/", "busy", true).unwrap();
    append(&store, &[idle], 0);
    let qdir = dir.path().join("consumequeue").join("%2F").join("busy");
    let mut n = 1;
    for _ in 0..20 {
        append(&store, &[busy], n);
        n += 1;
    }
    assert!(qdir.exists(), "20 unconsumed entries: own files");
    store.abandon();
    let store = Store::open(cfg.clone()).unwrap();
    assert_eq!(store.queue_info(busy).unwrap().next_offset, 20);
    store.ack_range(busy, 0, 20).unwrap().wait().unwrap();
    store.checkpoint().unwrap();
    store.run_retention().unwrap();
    assert!(!qdir.exists(), "drained: back in the shared index");
    // fill segments with a consumed-as-it-goes queue; idle's one entry must not pin
    // the first segment
    for _ in 0..40 {
        let (_, offs) = append(&store, &[busy], n);
        store.ack(busy, &[offs[0].1]).unwrap().wait().unwrap();
        n += 1;
    }
    store.checkpoint().unwrap();
    store.run_retention().unwrap();
    store.run_retention().unwrap();
    let segs = count_entries(&dir.path().join("sharedcq"));
    assert!(segs <= 2, "{segs} shared-index segments for 2 live entries");
    // the counters /metrics shows: idle's entry was copied out of the first segment
    let st = store.stats();
    assert!(st.compactions >= 1, "{st:?}");
    assert!(st.compacted_bytes_reclaimed > 0, "{st:?}");
    assert!(st.segments_deleted >= st.compactions, "{st:?}");
    assert!(st.appends >= 40, "{st:?}");
    assert_eq!(st.segment_bytes, st.segments as u64 * cfg.segment_size);
    let (syncs, batches) = (
        store.flush_stats().sync_us.snapshot(),
        store.flush_stats().batch_bytes.snapshot(),
    );
    assert!(syncs.count > 0);
    assert_eq!(syncs.count, batches.count);
    assert!(batches.sum > 0);
    store.abandon();
    let store = Store::open(cfg.clone()).unwrap();
    let (_, rec) = store.read_queue(idle, 0).unwrap().unwrap();
    assert_eq!(rec.body.as_ref(), body_for(0).as_slice());
    let info = store.queue_info(busy).unwrap();
    assert_eq!((info.next_offset, info.pending()), (60, 0));
    // a consumed small queue keeps its last entry (its next offset), no more
    let (_, rec) = store.read_queue(busy, 59).unwrap().unwrap();
    assert_eq!(rec.body.as_ref(), body_for(60).as_slice());
    assert!(store.read_queue(busy, 58).unwrap().is_none());
}

/// A data directory written before the shared index (every queue with its own files)
/// opens with its queues intact; drained, they move to the shared index.
#[test]
fn data_dir_with_per_queue_files_still_opens() {
    let dir = tempfile::tempdir().unwrap();
    let mut old = small_cfg(dir.path());
    old.small_queue_entries = 0;
    let store = Store::open(old).unwrap();
    let a = store.create_queue("/", "a", true).unwrap();
    let b = store.create_queue("/", "b", true).unwrap();
    for i in 0..5 {
        append(&store, &[a, b], i);
    }
    store.abandon();
    let qdir = |q: &str| dir.path().join("consumequeue").join("%2F").join(q);
    assert!(qdir("a").exists() && qdir("b").exists());

    let store = Store::open(small_cfg(dir.path())).unwrap();
    for q in [a, b] {
        assert_eq!(store.queue_info(q).unwrap().pending(), 5);
        let (_, rec) = store.read_queue(q, 4).unwrap().unwrap();
        assert_eq!(rec.body.as_ref(), body_for(4).as_slice());
    }
    store.ack_range(a, 0, 5).unwrap().wait().unwrap();
    store.checkpoint().unwrap();
    store.run_retention().unwrap();
    assert!(!qdir("a").exists(), "drained: its files are gone");
    assert!(qdir("b").exists(), "5 pending of at most 8: kept as it was");
    let (_, offs) = append(&store, &[a], 5);
    assert_eq!(offs, vec![(a, 5)]);
    store.abandon();
    let store = Store::open(small_cfg(dir.path())).unwrap();
    assert_eq!(store.queue_info(a).unwrap().pending(), 1);
    assert_eq!(store.queue_info(b).unwrap().pending(), 5);
    assert_eq!(
        store.read_queue(a, 5).unwrap().unwrap().1.body.as_ref(),
        body_for(5).as_slice()
    );
}

//! The timer wheel of delayed messages, after RocketMQ 5's TimerWheel and TimerLog.
//!
//! A delayed message is stored once, in the commitlog, with one consume-queue entry in
//! its vhost's delay queue whose tag is the message's due time (ms since the epoch).
//! That entry is the durable part: a kill -9 loses nothing that was confirmed, and the
//! wheel below is rebuilt from those entries at start.
//!
//! The wheel finds the messages due next without a timer, heap node or in-memory entry
//! per message. [`TimerLog`] is an append-only file of 24-byte records `u64 due ms, u64
//! id (the queue offset), u64 previous record of the same slot + 1 (0 = none)`: each
//! slot (one second of due times, [`SLOT_MS`]) is a backward-linked list through the
//! file, and memory holds only, per slot that has messages, its newest record's
//! position and its count (a `BTreeMap` entry, about 40 bytes per pending second, not
//! per message). A second before a slot's second comes, its list is read back (one
//! `pread` per record) and handed to the scheduler, which holds those messages until
//! each is due (so at most two seconds of them are in memory).
//!
//! The file is derived data: it is truncated and refilled from the queue's entries at
//! every start, truncated again whenever the wheel is empty, and refilled (compacted)
//! by its owner once it is mostly dead ([`TimerLog::wants_rebuild`]). It is never
//! fsynced.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{Result, StoreError};

/// One slot of the wheel spans this many milliseconds of due times.
pub const SLOT_MS: u64 = 1000;
const REC: u64 = 24;

#[derive(Debug, Clone, Copy)]
struct Slot {
    /// Position of the slot's newest record + 1.
    head: u64,
    count: u64,
}

/// The timer log and its wheel (see the module docs).
#[derive(Debug)]
pub struct TimerLog {
    file: File,
    path: PathBuf,
    /// Bytes written.
    end: u64,
    slots: BTreeMap<u64, Slot>,
    pending: u64,
}

impl TimerLog {
    /// Creates (or truncates) the timer log at `path`.
    pub fn create(path: &Path) -> Result<TimerLog> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(StoreError::at(dir))?;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(StoreError::at(path))?;
        Ok(TimerLog {
            file,
            path: path.to_path_buf(),
            end: 0,
            slots: BTreeMap::new(),
            pending: 0,
        })
    }

    /// Adds message `id`, due at `due_ms`.
    pub fn add(&mut self, due_ms: u64, id: u64) -> Result<()> {
        self.add_all(&[(due_ms, id)])
    }

    /// Adds messages `(due ms, id)` with one write.
    pub fn add_all(&mut self, items: &[(u64, u64)]) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::with_capacity(items.len() * REC as usize);
        // the slots' heads as they will be once the write is done
        let mut heads: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        let mut pos = self.end;
        for &(due_ms, id) in items {
            let slot = due_ms / SLOT_MS;
            let prev = match heads.get(&slot) {
                Some(&(head, _)) => head,
                None => self.slots.get(&slot).map_or(0, |s| s.head),
            };
            buf.extend_from_slice(&due_ms.to_le_bytes());
            buf.extend_from_slice(&id.to_le_bytes());
            buf.extend_from_slice(&prev.to_le_bytes());
            let added = heads.get(&slot).map_or(0, |h| h.1);
            heads.insert(slot, (pos + 1, added + 1));
            pos += REC;
        }
        self.file
            .write_all_at(&buf, self.end)
            .map_err(StoreError::at(&self.path))?;
        for (slot, (head, added)) in heads {
            let s = self.slots.entry(slot).or_insert(Slot { head: 0, count: 0 });
            s.head = head;
            s.count += added;
        }
        self.end = pos;
        self.pending += items.len() as u64;
        Ok(())
    }

    /// When the earliest slot with messages starts (ms), if any.
    pub fn next_slot_ms(&self) -> Option<u64> {
        self.slots.keys().next().map(|s| s * SLOT_MS)
    }

    /// Messages in the wheel.
    pub fn pending(&self) -> u64 {
        self.pending
    }

    /// Slots with messages (what the wheel holds in memory).
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Takes out every slot that starts at or before `now_ms`, returning their messages
    /// as `(due ms, id)`, in no particular order (some may be due up to one slot later).
    pub fn take_started(&mut self, now_ms: u64) -> Result<Vec<(u64, u64)>> {
        let mut out = Vec::new();
        while let Some((&slot, &s)) = self.slots.iter().next() {
            if slot * SLOT_MS > now_ms {
                break;
            }
            self.slots.remove(&slot);
            let mut pos = s.head;
            let mut left = s.count;
            while pos != 0 && left > 0 {
                let mut rec = [0u8; REC as usize];
                self.file
                    .read_exact_at(&mut rec, pos - 1)
                    .map_err(StoreError::at(&self.path))?;
                let word = |i: usize| {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(rec.get(i..i + 8).unwrap_or(&[0; 8]));
                    u64::from_le_bytes(b)
                };
                out.push((word(0), word(8)));
                let prev = word(16);
                if prev >= pos {
                    return Err(StoreError::Corrupt {
                        path: self.path.clone(),
                        offset: pos - 1,
                        reason: "timer log link points forward".into(),
                    });
                }
                pos = prev;
                left -= 1;
            }
            self.pending = self.pending.saturating_sub(s.count);
        }
        if self.slots.is_empty() && self.end > 0 {
            self.file.set_len(0).map_err(StoreError::at(&self.path))?;
            self.end = 0;
        }
        Ok(out)
    }

    /// Whether most of the file is records already taken out (its owner then rebuilds
    /// it from the queue: [`TimerLog::create`] and [`TimerLog::add`] again).
    pub fn wants_rebuild(&self) -> bool {
        self.end > (64 << 20) && self.end > 4 * self.pending * REC
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_come_out_in_time_order_and_the_file_empties() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = TimerLog::create(&dir.path().join("timer/1.log")).unwrap();
        let base = 1_000_000_000u64;
        // interleaved slots: 3 s, 1 s, 3 s, 2 s, 1 s
        for (d, id) in [(3_100, 1), (1_200, 2), (3_900, 3), (2_000, 4), (1_999, 5)] {
            t.add(base + d, id).unwrap();
        }
        assert_eq!(t.pending(), 5);
        assert_eq!(t.slots(), 3);
        assert_eq!(t.next_slot_ms(), Some(base + 1_000));
        assert!(t.take_started(base + 999).unwrap().is_empty());
        let mut got = t.take_started(base + 1_000).unwrap();
        got.sort_unstable();
        assert_eq!(got, vec![(base + 1_200, 2), (base + 1_999, 5)]);
        assert_eq!(t.pending(), 3);
        let mut got = t.take_started(base + 3_000).unwrap();
        got.sort_unstable();
        assert_eq!(
            got,
            vec![(base + 2_000, 4), (base + 3_100, 1), (base + 3_900, 3)]
        );
        assert_eq!(t.pending(), 0);
        assert_eq!(t.next_slot_ms(), None);
        assert_eq!(std::fs::metadata(&t.path).unwrap().len(), 0);
        // reusable after emptying
        t.add(base + 10_000, 9).unwrap();
        assert_eq!(
            t.take_started(base + 10_000).unwrap(),
            vec![(base + 10_000, 9)]
        );
    }

    #[test]
    fn a_batch_add_is_the_same_wheel_as_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut one = TimerLog::create(&dir.path().join("one.log")).unwrap();
        let mut all = TimerLog::create(&dir.path().join("all.log")).unwrap();
        let base = 7_000_000u64;
        let items: Vec<(u64, u64)> = (0..500u64)
            .map(|i| (base + (i % 7) * 1_000 + i % 13, i))
            .collect();
        // a slot with a record before the batch too
        one.add(base + 500, 999).unwrap();
        all.add(base + 500, 999).unwrap();
        for &(d, id) in &items {
            one.add(d, id).unwrap();
        }
        all.add_all(&items).unwrap();
        assert_eq!(one.pending(), all.pending());
        assert_eq!(one.slots(), all.slots());
        assert_eq!(one.end, all.end);
        for t in [base, base + 3_000, base + 10_000] {
            let mut a = one.take_started(t).unwrap();
            let mut b = all.take_started(t).unwrap();
            a.sort_unstable();
            b.sort_unstable();
            assert_eq!(a, b);
        }
        assert_eq!(all.pending(), 0);
    }

    #[test]
    fn pending_messages_cost_memory_per_second_not_per_message() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = TimerLog::create(&dir.path().join("t.log")).unwrap();
        let base = 5_000_000u64;
        for i in 0..100_000u64 {
            // 100 in each of 1,000 seconds, interleaved
            t.add(base + (i % 1_000) * 1_000 + i / 1_000, i).unwrap();
        }
        assert_eq!(t.pending(), 100_000);
        assert_eq!(t.slots(), 1_000);
        let first = t.take_started(base).unwrap();
        assert_eq!(first.len(), 100);
        assert!(first.iter().all(|(d, _)| (base..base + 1_000).contains(d)));
    }
}

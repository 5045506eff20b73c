//! Per-message delivery counts: how many times a message was returned to its queue
//! (nacked or rejected with requeue, or left unacked by a consumer that went away).
//!
//! A message that is never returned costs nothing here: neither its commitlog record
//! nor its consume-queue entry carries a count. Each return of a message in a durable
//! queue whose count matters (the core writes it for queues with a delivery limit or a
//! retry back-off; elsewhere the count stays in memory) writes one small
//! metadata-journal record, key `R` + big-endian queue id +
//! big-endian queue offset, value the count (u32 little-endian), followed for a message
//! waiting out an `x-retry-backoff` step by the time it is ready again (u64 ms since the
//! epoch, little-endian; the same record, so the wait costs no further write); the
//! message's ack (or
//! its dead-lettering, expiry, purge) deletes the key, and deleting the queue deletes
//! every key under its id. So the disk cost is about 30 bytes per message currently
//! returned, until the journal's next compaction folds the deleted ones away.
//!
//! At start the store reads every count once from the journal (whose state is in
//! memory then) and holds them per queue until the queue's owner takes them with
//! [`Store::take_delivery_counts`]; a queue created later has none and pays nothing.
//! A count is a write(2) to the journal when it changes, group-committed with the next
//! fsync: it survives a kill -9 of the broker at once, and a power loss once that fsync
//! ran (a count lost that way is one return too few, never a message lost).

use std::collections::HashMap;

use crate::error::Result;
use crate::flush::Durable;
use crate::journal::MetaOp;
use crate::store::{QueueId, Store};

/// Journal key tag of a returned message's delivery count.
pub(crate) const TAG_RETURNS: u8 = b'R';

/// The key prefix of every count of `queue`.
pub(crate) fn queue_prefix(queue: QueueId) -> Vec<u8> {
    let mut k = Vec::with_capacity(13);
    k.push(TAG_RETURNS);
    k.extend_from_slice(&queue.to_be_bytes());
    k
}

fn key(queue: QueueId, offset: u64) -> Vec<u8> {
    let mut k = queue_prefix(queue);
    k.extend_from_slice(&offset.to_be_bytes());
    k
}

/// A returned message's stored state: its queue offset, its delivery count and, while
/// it waits out a retry back-off step, when it is ready again (ms since the epoch; 0 =
/// not waiting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Returned {
    /// The entry's queue offset.
    pub offset: u64,
    /// Times it was returned.
    pub count: u32,
    /// Ready again at (ms since the epoch), or 0.
    pub ready_at_ms: u64,
}

fn value(r: &Returned) -> Vec<u8> {
    let mut v = r.count.to_le_bytes().to_vec();
    if r.ready_at_ms != 0 {
        v.extend_from_slice(&r.ready_at_ms.to_le_bytes());
    }
    v
}

/// Decodes one count record: `(queue, returned)`; `None` if malformed.
fn decode(k: &[u8], v: &[u8]) -> Option<(QueueId, Returned)> {
    let rest = k.strip_prefix(&[TAG_RETURNS])?;
    let (q, off) = rest.split_first_chunk::<4>()?;
    let off: [u8; 8] = off.try_into().ok()?;
    let (n, at) = v.split_first_chunk::<4>()?;
    let ready_at_ms = match at.len() {
        0 => 0,
        _ => u64::from_le_bytes(at.try_into().ok()?),
    };
    Some((
        QueueId::from_be_bytes(*q),
        Returned {
            offset: u64::from_be_bytes(off),
            count: u32::from_le_bytes(*n),
            ready_at_ms,
        },
    ))
}

/// Every stored count, by queue (read once while the store opens).
pub(crate) type Loaded = HashMap<QueueId, Vec<Returned>>;

/// Reads every count from the journal; malformed records are skipped with a warning
/// (a lost count is one return too few, not a reason to refuse to start).
pub(crate) fn load(journal: &crate::journal::MetaJournal) -> Result<Loaded> {
    let mut out: Loaded = HashMap::new();
    let mut bad = 0usize;
    journal.visit(&[TAG_RETURNS], &mut |k, v| match decode(k, v) {
        Some((q, r)) => out.entry(q).or_default().push(r),
        None => bad += 1,
    })?;
    if bad > 0 {
        tracing::warn!(
            records = bad,
            "store: skipped malformed delivery-count records"
        );
    }
    Ok(out)
}

impl Store {
    /// Records that entries of `queue` have been returned, as `(offset, count)`, in one
    /// journal record. Durable queues only (a transient queue's counts live as long as
    /// the process, in its owner's memory): the handle completes once the record is
    /// fsynced.
    pub fn put_delivery_counts(&self, queue: QueueId, counts: &[(u64, u32)]) -> Result<Durable> {
        let r: Vec<Returned> = counts
            .iter()
            .map(|&(offset, count)| Returned {
                offset,
                count,
                ready_at_ms: 0,
            })
            .collect();
        self.put_returns(queue, &r)
    }

    /// As [`Store::put_delivery_counts`], each with the time it is ready again when it
    /// waits out a retry back-off step (one record for the lot, whatever it holds).
    pub fn put_returns(&self, queue: QueueId, returned: &[Returned]) -> Result<Durable> {
        if returned.is_empty() || !self.is_durable_queue(queue) {
            return Ok(Durable::ready());
        }
        self.journal().append(
            returned
                .iter()
                .map(|r| MetaOp::put(key(queue, r.offset), value(r)))
                .collect(),
        )
    }

    /// Forgets the counts of entries that left `queue` (acked, dead-lettered, dropped).
    pub fn drop_delivery_counts(&self, queue: QueueId, offsets: &[u64]) -> Result<Durable> {
        if offsets.is_empty() || !self.is_durable_queue(queue) {
            return Ok(Durable::ready());
        }
        self.journal().append(
            offsets
                .iter()
                .map(|o| MetaOp::delete(key(queue, *o)))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreConfig;

    #[test]
    fn keys_round_trip() {
        let k = key(7, 1 << 40);
        let r = |count, ready_at_ms| Returned {
            offset: 1 << 40,
            count,
            ready_at_ms,
        };
        assert_eq!(decode(&k, &3u32.to_le_bytes()), Some((7, r(3, 0))));
        assert_eq!(decode(&k, &value(&r(3, 0))), Some((7, r(3, 0))));
        assert_eq!(decode(&k, &value(&r(4, 99))), Some((7, r(4, 99))));
        assert_eq!(decode(&k, &[1, 0, 0, 0, 5]), None);
        assert!(k.starts_with(&queue_prefix(7)));
        assert!(!k.starts_with(&queue_prefix(8)));
        assert_eq!(decode(&k[..10], &3u32.to_le_bytes()), None);
        assert_eq!(decode(&k, &[1, 2]), None);
    }

    #[test]
    fn counts_survive_reopen_and_go_with_acks_and_queue_deletes() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = StoreConfig::new(dir.path());
        {
            let s = Store::open(cfg.clone()).unwrap();
            let a = s.create_queue("/", "a", true).unwrap();
            let b = s.create_queue("/", "b", true).unwrap();
            let t = s.create_queue("/", "t", false).unwrap();
            s.put_delivery_counts(a, &[(5, 1)]).unwrap().wait().unwrap();
            s.put_delivery_counts(a, &[(5, 2)]).unwrap().wait().unwrap();
            s.put_delivery_counts(a, &[(9, 1)]).unwrap().wait().unwrap();
            s.put_returns(
                a,
                &[Returned {
                    offset: 11,
                    count: 4,
                    ready_at_ms: 1234,
                }],
            )
            .unwrap()
            .wait()
            .unwrap();
            s.drop_delivery_counts(a, &[9]).unwrap().wait().unwrap();
            s.put_delivery_counts(b, &[(1, 1)]).unwrap().wait().unwrap();
            // transient: nothing written
            s.put_delivery_counts(t, &[(1, 1)]).unwrap().wait().unwrap();
            s.delete_queue(b).unwrap();
            // abandoned, as a kill -9 leaves it
            s.abandon();
        }
        let s = Store::open(cfg).unwrap();
        let a = s.find_queue("/", "a").unwrap();
        let mut got = s.take_returns(a);
        got.sort_unstable();
        assert_eq!(
            got,
            vec![
                Returned {
                    offset: 5,
                    count: 2,
                    ready_at_ms: 0
                },
                Returned {
                    offset: 11,
                    count: 4,
                    ready_at_ms: 1234
                }
            ]
        );
        assert!(s.take_returns(a).is_empty(), "taken once");
        let b2 = s.create_queue("/", "b", true).unwrap();
        assert!(s.take_delivery_counts(b2).is_empty());
    }
}

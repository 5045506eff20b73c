//! Checkpoints: the `checkpoint` file (the commitlog offset below which consume queues,
//! index and ack states are flushed; its codec, which earlier versions also used for
//! every durable queue's ack state) and the ack states journaled under `A` keys;
//! [`Inner::checkpoint`] writes both, [`load_checkpoint`] reads them at open.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{lock, now_ms, Inner, QueueId, QueueState};
use crate::ack::AckState;
use crate::error::{Result, StoreError};
use crate::file::write_atomic;
use crate::journal::{MetaJournal, MetaOp};

/// Journal key tag of a durable queue's ack state as of the last checkpoint (`A` +
/// big-endian id); the value is `u64 delivered` then the encoded [`AckState`].
const TAG_ACK: u8 = b'A';
/// Ack states are journaled in records of about this size at most.
const ACK_RECORD_BYTES: usize = 4 << 20;

pub(super) fn ack_key(id: QueueId) -> Vec<u8> {
    let mut k = vec![TAG_ACK];
    k.extend_from_slice(&id.to_be_bytes());
    k
}

fn decode_ack_value(v: &[u8]) -> Option<(u64, AckState)> {
    let (delivered, ack) = v.split_first_chunk::<8>()?;
    Some((u64::from_le_bytes(*delivered), AckState::decode(ack).ok()?))
}

/// The checkpoint as [`Store::open`](super::Store::open) finds it.
pub(super) struct Checkpointed {
    /// The commitlog offset the replay starts from.
    pub(super) offset: u64,
    /// Each durable queue's `(delivered, ack state)` as of the checkpoint.
    pub(super) acks: Snapshot,
    /// The checkpoint file held ack states (an earlier version's): the first checkpoint
    /// moves them into the journal.
    pub(super) legacy: bool,
}

/// Reads the checkpoint file in `dir` and the ack states journaled since.
pub(super) fn load_checkpoint(
    dir: &Path,
    repair: bool,
    journal: &MetaJournal,
) -> Result<Checkpointed> {
    let (offset, mut snapshot) = read_checkpoint(&dir.join("checkpoint"), repair)?;
    let legacy = !snapshot.is_empty();
    for (k, v) in journal.scan(&[TAG_ACK])? {
        let id = k
            .get(1..5)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_be_bytes);
        match (id, decode_ack_value(&v)) {
            (Some(id), Some(state)) => {
                snapshot.insert(id, state);
            }
            _ => {
                return Err(StoreError::Corrupt {
                    path: dir.join("meta"),
                    offset: 0,
                    reason: format!("bad ack state record {k:?}"),
                })
            }
        }
    }
    Ok(Checkpointed {
        offset,
        acks: snapshot,
        legacy,
    })
}

impl Inner {
    /// Flushes consume queues and index up to the log's end, journals the ack state of
    /// every queue whose state changed since the last checkpoint (one record for all of
    /// them, not a rewrite of every queue's), then records the offset.
    pub(super) fn checkpoint(&self) -> Result<()> {
        let mut last = lock(&self.checkpoint);
        let (end, snaps) = {
            let w = self.writer();
            let qs = self.queues.read().unwrap_or_else(|e| e.into_inner());
            let snaps: Vec<(QueueId, u64, Vec<u8>)> = qs
                .values()
                .filter(|q| q.rec.durable && q.dirty.swap(false, Ordering::Relaxed))
                .map(|q| {
                    (
                        q.rec.id,
                        q.delivered.load(Ordering::Relaxed),
                        q.ack().encode(),
                    )
                })
                .collect();
            (w.pos(), snaps)
        };
        let res = self.checkpoint_to(end, &snaps);
        if res.is_err() {
            // journal them again next time
            let qs = self.queues.read().unwrap_or_else(|e| e.into_inner());
            for (id, _, _) in &snaps {
                if let Some(q) = qs.get(id) {
                    q.dirty.store(true, Ordering::Relaxed);
                }
            }
        }
        res?;
        *last = end;
        Ok(())
    }

    fn checkpoint_to(&self, end: u64, snaps: &[(QueueId, u64, Vec<u8>)]) -> Result<()> {
        self.flush_to(end)?;
        let qs: Vec<Arc<QueueState>> = self
            .queues
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|q| q.rec.durable)
            .cloned()
            .collect();
        for q in qs {
            q.cq.flush()?;
        }
        if let Some(sh) = &self.shared {
            sh.flush()?;
        }
        self.index.flush()?;
        // The ack states go in bounded records; each is a whole queue's state, so a crash
        // between two leaves every queue at its old or its new state, both of which the
        // replay from the old offset brings up to date (acks are idempotent).
        let mut ops = Vec::new();
        let mut bytes = 0usize;
        for (id, delivered, ack) in snaps {
            let mut v = Vec::with_capacity(8 + ack.len());
            v.extend_from_slice(&delivered.to_le_bytes());
            v.extend_from_slice(ack);
            bytes += v.len() + 16;
            ops.push(MetaOp::put(ack_key(*id), v));
            if bytes >= ACK_RECORD_BYTES {
                self.journal.commit(std::mem::take(&mut ops))?;
                bytes = 0;
            }
        }
        self.journal.commit(ops)?;
        write_atomic(
            &self.cfg.dir.join("checkpoint"),
            &encode_checkpoint(end, &[]),
        )?;
        Ok(())
    }
}

const CKPT_MAGIC: &[u8; 4] = b"TCKP";

fn encode_checkpoint(offset: u64, snaps: &[(QueueId, u64, Vec<u8>)]) -> Vec<u8> {
    let mut b = Vec::with_capacity(32 + snaps.iter().map(|s| 16 + s.2.len()).sum::<usize>());
    b.extend_from_slice(CKPT_MAGIC);
    b.push(1);
    b.extend_from_slice(&offset.to_le_bytes());
    b.extend_from_slice(&now_ms().to_le_bytes());
    b.extend_from_slice(&(snaps.len() as u32).to_le_bytes());
    for (id, delivered, ack) in snaps {
        b.extend_from_slice(&id.to_le_bytes());
        b.extend_from_slice(&delivered.to_le_bytes());
        b.extend_from_slice(&(ack.len() as u32).to_le_bytes());
        b.extend_from_slice(ack);
    }
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

type Snapshot = HashMap<QueueId, (u64, AckState)>;

fn decode_checkpoint(b: &[u8]) -> Option<(u64, Snapshot)> {
    let (body, crc) = b.split_at_checked(b.len().checked_sub(4)?)?;
    if crc32c::crc32c(body).to_le_bytes() != crc {
        return None;
    }
    let mut p = body;
    let mut take = |n: usize| -> Option<&[u8]> {
        let (a, rest) = p.split_at_checked(n)?;
        p = rest;
        Some(a)
    };
    if take(4)? != CKPT_MAGIC || take(1)? != [1] {
        return None;
    }
    let offset = u64::from_le_bytes(take(8)?.try_into().ok()?);
    let _ts = take(8)?;
    let n = u32::from_le_bytes(take(4)?.try_into().ok()?);
    let mut snap = HashMap::new();
    for _ in 0..n {
        let id = u32::from_le_bytes(take(4)?.try_into().ok()?);
        let delivered = u64::from_le_bytes(take(8)?.try_into().ok()?);
        let len = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
        let ack = AckState::decode(take(len)?).ok()?;
        snap.insert(id, (delivered, ack));
    }
    Some((offset, snap))
}

fn read_checkpoint(path: &Path, repair: bool) -> Result<(u64, Snapshot)> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((0, HashMap::new())),
        Err(e) => return Err(StoreError::io(path, e)),
    };
    match decode_checkpoint(&bytes) {
        Some(c) => Ok(c),
        None if repair => {
            tracing::error!(path = %path.display(), "repair: ignoring a damaged checkpoint; replaying the whole log");
            Ok((0, HashMap::new()))
        }
        None => Err(StoreError::Corrupt {
            path: path.to_path_buf(),
            offset: 0,
            reason: "damaged checkpoint; start with --repair to replay the whole log".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_round_trip_and_damage() {
        let mut a = AckState::new(3);
        a.ack(5);
        let b = encode_checkpoint(99, &[(1, 7, a.encode())]);
        let (off, snap) = decode_checkpoint(&b).unwrap();
        assert_eq!(off, 99);
        assert_eq!(snap.get(&1), Some(&(7, a)));
        for i in 0..b.len() {
            let mut bad = b.clone();
            bad[i] ^= 0x40;
            assert!(decode_checkpoint(&bad).is_none());
            assert!(decode_checkpoint(&b[..i]).is_none());
        }
    }
}

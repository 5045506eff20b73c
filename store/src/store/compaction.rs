//! Retention passes (see the module notes of `store`): how many live bytes each sealed
//! segment below the checkpoint holds, deletion of the segments nothing needs, and
//! compaction: a segment's live records copied to the end of the log and their entries
//! repointed.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{lock, Inner, QueueId, QueueState};
use crate::commitlog::{StoredRecord, Writer};
use crate::consumequeue::CqEntry;
use crate::error::{Result, StoreError};
use crate::record::{self, Decoded, NewMessage};

impl Inner {
    /// Deletes what no queue needs any more and compacts the log (see the module notes):
    /// every sealed commitlog segment below the checkpoint that holds nothing live, and,
    /// for those whose live share is below [`COMPACT_LIVE_PERCENT`], copies the live
    /// records to the end of the log, repoints their entries and deletes the segment once
    /// the copies are on disk; then consume-queue files below each ack head and
    /// shared-index segments. Returns the segments deleted.
    pub(super) fn retention(&self) -> Result<usize> {
        let _pass = lock(&self.pass);
        let ckpt = *lock(&self.checkpoint);
        let qs: Vec<Arc<QueueState>> = self
            .queues
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        // Only sealed segments the checkpoint covers (recovery never replays them) and
        // that every connected follower holds (replication ships from this log).
        let floor = self
            .cfg
            .replica
            .as_ref()
            .map_or(u64::MAX, |g| g.retention_floor());
        let sealed: Vec<(u64, u64)> = self
            .log
            .sealed_segments()
            .iter()
            .map(|s| (s.start(), s.end()))
            .filter(|(_, end)| *end <= ckpt.min(floor))
            .collect();
        let walk = std::time::Instant::now();
        let live = live_bytes(&qs, &sealed);
        let walk = u64::try_from(walk.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.live_walk_ns.store(walk, Ordering::Relaxed);
        let deleted = self.delete_or_compact(&sealed, &live)?;
        // Then the queues' own files (after the log: a sealed segment is what the pass
        // is most often woken for).
        self.trim_queue_files(&qs)?;
        drop(qs);
        self.index.delete_files_below(self.log.min_offset())?;
        self.segments_deleted
            .fetch_add(deleted as u64, Ordering::Relaxed);
        if deleted > 0 {
            tracing::debug!(segments = deleted, "store: retention deleted segments");
        }
        Ok(deleted)
    }

    /// A retention pass's work on the log: deletes each of the `sealed` segments that
    /// holds no `live` bytes, compacts those whose live share is low; returns the
    /// segments deleted.
    fn delete_or_compact(&self, sealed: &[(u64, u64)], live: &[u64]) -> Result<usize> {
        // Segments left dead by an earlier pass's copies go only once those are on disk
        // (always so, unless that pass's flush failed).
        let copies_durable = self.flush.flushed() >= self.copied_to.load(Ordering::Acquire);
        let mut deleted = 0;
        let mut compacted = Vec::new();
        // live bytes in the segments this pass keeps
        let mut kept = 0u64;
        // a bound on one pass's copying (a log left pinned by an earlier version can hold
        // many candidates at once); the next pass goes on where this one stopped
        let mut budget = self
            .cfg
            .segment_size
            .saturating_mul(COMPACT_SEGMENTS_PER_PASS);
        for ((start, end), live) in sealed.iter().zip(live) {
            if *live == 0 {
                if copies_durable {
                    deleted += usize::from(self.log.delete_segment(*start)?);
                }
            } else if budget > 0 && live * 100 < (end - start) * COMPACT_LIVE_PERCENT {
                let copied = self.compact_segment(*start)?;
                budget = budget.saturating_sub(copied.max(1));
                compacted.push((*start, *live, copied));
            } else {
                kept += live;
            }
        }
        self.kept_live.store(kept, Ordering::Relaxed);
        if !compacted.is_empty() {
            // The copies are on disk before the originals go: a flush up to the last copy,
            // which group commit (or the async flusher) has mostly done already. A crash
            // after this replays them from the checkpoint (which is below them) and repoints
            // the entries again.
            self.flush_to(self.copied_to.load(Ordering::Acquire))?;
            for (start, live, copied) in compacted {
                let gone = self.log.delete_segment(start)?;
                deleted += usize::from(gone);
                if gone {
                    self.compactions.fetch_add(1, Ordering::Relaxed);
                    self.compacted_reclaimed.fetch_add(
                        self.cfg.segment_size.saturating_sub(copied),
                        Ordering::Relaxed,
                    );
                }
                tracing::debug!(
                    segment = start,
                    live,
                    copied,
                    deleted = gone,
                    "store: compacted a commitlog segment"
                );
            }
        }
        Ok(deleted)
    }

    /// A retention pass's work on the queues' own files: consume-queue files below each
    /// ack head, and shared-index segments with few live entries left (their queues move
    /// those entries on first).
    fn trim_queue_files(&self, qs: &[Arc<QueueState>]) -> Result<()> {
        let victims = self
            .shared
            .as_ref()
            .map(|s| s.victims())
            .unwrap_or_default();
        for q in qs {
            let head = q.ack().head();
            q.cq.delete_files_below(head)?;
            q.cq.relocate(&victims)?;
        }
        if let Some(sh) = &self.shared {
            sh.retire()?;
        }
        Ok(())
    }

    /// Copies the live records of the sealed segment at `start` to the end of the log
    /// (a record keeps its timestamps, keys, properties and body, and lists only the
    /// queue entries still live, at their logical offsets) and points those entries at
    /// the copies. Returns the bytes written.
    fn compact_segment(&self, start: u64) -> Result<u64> {
        Ok(self.copy_live(start, usize::MAX)?.0)
    }

    /// Copies forward up to `max` live records of the sealed segment at `start`; returns
    /// the bytes and records written. The scan picks the records that may be live without
    /// any lock; they are then checked again and copied in batches, one writer lock each.
    pub(super) fn copy_live(&self, start: u64, max: usize) -> Result<(u64, usize)> {
        // Each queue's ack head as the scan first meets it: an entry below it is acked for
        // good, so most dead records are told apart without a lock.
        let mut heads: HashMap<QueueId, Option<u64>> = HashMap::new();
        // At most one batch of candidates is held: memory does not grow with the segment.
        let mut batch: Vec<u64> = Vec::with_capacity(COPY_BATCH);
        let (mut bytes, mut records) = (0u64, 0usize);
        let mut copy = |batch: &mut Vec<u64>| -> Result<()> {
            // read (and checksum-verified) outside the lock
            let recs: Vec<StoredRecord> = batch
                .drain(..)
                .map(|off| self.log.read(off))
                .collect::<Result<_>>()?;
            let mut w = self.writer();
            for rec in recs.iter().take(max.saturating_sub(records)) {
                let n = self.copy_forward(&mut w, rec)?;
                bytes += n;
                records += usize::from(n > 0);
            }
            let end = w.pos();
            self.copied_to.fetch_max(end, Ordering::AcqRel);
            drop(w);
            drop(self.after_append(end));
            Ok(())
        };
        self.log.scan_segment(start, |off, _, d| {
            let Decoded::Message { view, .. } = d else {
                return Ok(());
            };
            let maybe_live = view.queues().any(|(id, l)| {
                let head = heads.entry(id).or_insert_with(|| {
                    let map = self.queues.read().unwrap_or_else(|e| e.into_inner());
                    map.get(&id).map(|q| q.ack().head())
                });
                head.is_some_and(|h| l >= h)
            });
            if maybe_live {
                batch.push(off);
                if batch.len() == COPY_BATCH {
                    copy(&mut batch)?;
                }
            }
            Ok(())
        })?;
        if !batch.is_empty() {
            copy(&mut batch)?;
        }
        Ok((bytes, records))
    }

    /// One record of [`Inner::copy_live`], under the writer lock: acks of durable queues
    /// take it too, so the entries found live here stay live until repointed.
    fn copy_forward(&self, w: &mut Writer, rec: &StoredRecord) -> Result<u64> {
        let off = rec.commit_offset;
        let Decoded::Message { view, .. } = record::decode_unverified(&rec.raw) else {
            return Ok(0);
        };
        let live: Vec<(Arc<QueueState>, u64)> = {
            let map = self.queues.read().unwrap_or_else(|e| e.into_inner());
            view.queues()
                .filter_map(|(id, l)| {
                    let q = map.get(&id)?;
                    let here = q.cq.get(l).is_some_and(|e| e.commit_offset == off);
                    (here && !q.ack().is_acked(l)).then(|| (q.clone(), l))
                })
                .collect()
        };
        if live.is_empty() {
            return Ok(0);
        }
        let ids: Vec<QueueId> = live.iter().map(|(q, _)| q.rec.id).collect();
        let offs: Vec<u64> = live.iter().map(|(_, l)| *l).collect();
        let keys: Vec<&[u8]> = view.keys().collect();
        let msg = NewMessage {
            queues: &ids,
            flags: view.flags,
            born_ts_ms: view.born_ts_ms,
            tag_hash: view.tag_hash,
            keys: &keys,
            properties: &rec.properties,
            body: &rec.body,
        };
        let len = record::message_len(&msg)? as u64;
        let size = u32::try_from(len).map_err(|_| StoreError::TooLarge {
            size: len,
            max: u32::MAX as u64,
        })?;
        let before = w.pos();
        let commit_offset = self.note_disk_full(self.log.append(w, len, |buf| {
            record::encode_message(buf, &msg, view.store_ts_ms, &offs)
        }))?;
        self.log.publish(w);
        if commit_offset != before {
            // a copy sealed the writer's segment: it gets a pass of its own (never waited
            // for here: this is the pass)
            self.note_sealed();
        }
        let entry = CqEntry {
            commit_offset,
            size,
            tag_hash: view.tag_hash,
        };
        for (q, l) in &live {
            if let Err(e) = q.cq.put(*l, entry) {
                let why = format!("consume queue write failed during compaction: {e}");
                self.flush.fail(why.clone());
                return Err(StoreError::Fatal(why));
            }
        }
        for key in &keys {
            if let Err(e) = self.index.put(key, commit_offset, view.store_ts_ms) {
                tracing::warn!(error = %e, "store: index write failed; lookups by key may miss");
            }
        }
        Ok(len)
    }
}

/// A sealed segment whose live bytes are below this share of its size is compacted, so
/// the log holds at most about twice the live data plus the segments the checkpoint has
/// not reached yet.
const COMPACT_LIVE_PERCENT: u64 = 50;
/// One retention pass copies at most this many segments' worth of live records.
const COMPACT_SEGMENTS_PER_PASS: u64 = 4;
/// Compaction copies live records in batches of this many per writer lock.
const COPY_BATCH: usize = 64;
/// Unacked entries are walked in batches of this many (bounded memory per queue).
const LIVE_BATCH: usize = 4096;

/// Bytes of entries still needed (unacked, in a queue that exists) in each of the
/// `sealed` segments (sorted, disjoint `(start, end)`), in the same order. An entry is
/// counted once per queue that holds it, so a message stored for several queues may count
/// more than once: the estimate errs towards keeping a segment.
fn live_bytes(qs: &[Arc<QueueState>], sealed: &[(u64, u64)]) -> Vec<u64> {
    let mut live = vec![0u64; sealed.len()];
    let Some(&(_, below)) = sealed.last() else {
        return live;
    };
    for q in qs {
        let next = q.cq.next_offset();
        let mut from = 0;
        loop {
            let batch = q.ack().unacked_from(from, next, LIVE_BATCH);
            for l in &batch {
                let Some(e) = q.cq.get(*l).filter(|e| e.commit_offset < below) else {
                    continue;
                };
                let i = sealed.partition_point(|(_, end)| *end <= e.commit_offset);
                if let Some(((start, _), n)) = sealed.get(i).zip(live.get_mut(i)) {
                    if *start <= e.commit_offset {
                        *n += u64::from(e.size);
                    }
                }
            }
            match batch.last() {
                Some(last) if batch.len() == LIVE_BATCH => from = last + 1,
                _ => break,
            }
        }
    }
    live
}

//! The writer path: appends and acks under the one writer lock, the queue lookups
//! they share, and flushes up to an offset.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use super::threads::{async_wait, COPY_ROOM_SHARE, PASS_WAIT_MAX};
use super::{lock, now_ms, Appended, Inner, QueueId, QueueState};
use crate::commitlog::Writer;
use crate::consumequeue::CqEntry;
use crate::error::{Result, StoreError};
use crate::flush::{Durable, FlushMode};
use crate::record::{self, NewMessage};

impl Inner {
    pub(super) fn queue(&self, id: QueueId) -> Result<Arc<QueueState>> {
        self.queues
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
            .ok_or_else(|| StoreError::NotFound(format!("queue {id}")))
    }

    pub(super) fn writer(&self) -> MutexGuard<'_, Writer> {
        lock(&self.writer)
    }

    /// The writer lock for an append (a message or an ack) of `len` bytes. While a sealed
    /// segment awaits its retention pass, the writer keeps the second half of its own
    /// segment for that pass's copies (a segment is compacted only when less than half of
    /// it is live): an append that would reach into it gives up the lock while
    /// [`Self::wait_for_pass`] waits for the pass. The copies then land in the writer's
    /// segment and the sealed one is deleted before a third segment is made.
    /// Compaction's copies take the plain [`Self::writer`]: the pass never waits for itself.
    fn writer_for(&self, len: u64) -> MutexGuard<'_, Writer> {
        let w = self.writer();
        if !self.log.holds_next_segment()
            || self.log.room(&w) >= len + self.cfg.segment_size / COPY_ROOM_SHARE
        {
            return w;
        }
        drop(w);
        self.wait_for_pass();
        self.writer()
    }

    /// Waits (at most [`PASS_WAIT_MAX`]) until the retention pass after the last seal
    /// has finished; called without the writer lock (the pass copies live records
    /// forward under it). This is what keeps the log within 2 × live + 2 segments when
    /// appends outrun the passes (async flushing at disk speed): the writer does not fill
    /// its segment, nor start a third, while a sealed one may still be compacted away.
    fn wait_for_pass(&self) {
        self.pass_waits.fetch_add(1, Ordering::Relaxed);
        let deadline = std::time::Instant::now() + PASS_WAIT_MAX;
        let mut seals = lock(&self.seals);
        while seals.passed < seals.sealed {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() || self.flush.check().is_err() {
                self.pass_wait_timeouts.fetch_add(1, Ordering::Relaxed);
                return;
            }
            seals = self
                .passed_cv
                .wait_timeout(seals, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Called by the maintenance thread when a retention pass that started after
    /// `sealed` seals has finished: lets appends and the warming thread go on.
    pub(super) fn note_passed(&self, sealed: u64) {
        let mut seals = lock(&self.seals);
        seals.passed = seals.passed.max(sealed);
        if seals.passed >= seals.sealed {
            self.log.hold_next_segment(false);
        }
        drop(seals);
        self.passed_cv.notify_all();
    }

    /// Segments sealed since open.
    pub(super) fn seals(&self) -> u64 {
        lock(&self.seals).sealed
    }

    /// Tells the flusher about new bytes and returns what to wait on.
    pub(super) fn after_append(&self, end: u64) -> Durable {
        match self.cfg.flush {
            FlushMode::Sync => {
                // no wake-up here: the flusher runs once somebody waits (Durable)
                self.flush.appended(end, u64::MAX);
                Durable::new(end, self.flush.clone())
            }
            FlushMode::Async { dirty_bytes, .. } => {
                let flushed = self.flush.appended(end, dirty_bytes);
                // Appends are durable at once, unless they outrun the disk: past
                // ASYNC_BACKLOG_FLUSHES flushes' worth of unflushed bytes, an append's
                // Durable waits until the flusher has brought the backlog back to that.
                // The append itself returns now: this slows the publishers that wait for
                // their confirms (receipts, PUBACKs), not those that wait for none. It
                // bounds the backlog (and the log the checkpoint cannot pass) for the
                // former only.
                match async_wait(end, flushed, dirty_bytes) {
                    Some(offset) => Durable::new(offset, self.flush.clone()),
                    None => Durable::ready(),
                }
            }
        }
    }

    pub(super) fn append(&self, msg: &NewMessage<'_>) -> Result<Appended> {
        self.flush.check()?;
        if msg.queues.is_empty() {
            return Err(StoreError::Invalid(
                "a message needs at least one queue".into(),
            ));
        }
        let len = record::message_len(msg)? as u64;
        let size = u32::try_from(len).map_err(|_| StoreError::TooLarge {
            size: len,
            max: u32::MAX as u64,
        })?;
        let qs: Vec<Arc<QueueState>> = {
            let map = self.queues.read().unwrap_or_else(|e| e.into_inner());
            msg.queues
                .iter()
                .map(|id| {
                    map.get(id)
                        .cloned()
                        .ok_or_else(|| StoreError::NotFound(format!("queue {id}")))
                })
                .collect::<Result<_>>()?
        };
        for (i, q) in msg.queues.iter().enumerate() {
            if msg.queues.get(..i).is_some_and(|before| before.contains(q)) {
                return Err(StoreError::Invalid(format!("queue {q} given twice")));
            }
        }
        let store_ts = now_ms();
        let mut w = self.writer_for(len);
        let offs: Vec<u64> = qs.iter().map(|q| q.cq.next_offset()).collect();
        let before = w.pos();
        let commit_offset = self.note_disk_full(self.log.append(&mut w, len, |buf| {
            record::encode_message(buf, msg, store_ts, &offs)
        }))?;
        self.log.publish(&w);
        if commit_offset != before {
            // the record did not fit: the segment it would have ended is sealed
            self.note_sealed();
        }
        let body = w.record_tail(commit_offset, len, msg.body.len() as u64);
        let entry = CqEntry {
            commit_offset,
            size,
            tag_hash: msg.tag_hash,
        };
        for (q, qoff) in qs.iter().zip(&offs) {
            if let Err(e) = q.cq.put(*qoff, entry) {
                // The record is in the log but not in the queue: only recovery can make
                // them agree again, so stop taking writes.
                let why = format!("consume queue write failed: {e}");
                self.flush.fail(why.clone());
                return Err(StoreError::Fatal(why));
            }
        }
        for key in msg.keys {
            if let Err(e) = self.index.put(key, commit_offset, store_ts) {
                tracing::warn!(error = %e, "store: index write failed; lookups by key may miss");
            }
        }
        let end = w.pos();
        drop(w);
        Ok(Appended {
            commit_offset,
            size,
            queue_offsets: msg.queues.iter().copied().zip(offs).collect(),
            durable: self.after_append(end),
            body,
        })
    }

    /// Wakes the maintenance thread for a sealed segment (once per segment: a mutex
    /// and a notify per segment, nothing per record).
    pub(super) fn note_sealed(&self) {
        lock(&self.seals).sealed += 1;
        self.log.hold_next_segment(true);
        self.sealed.store(true, Ordering::Release);
        let _stop = lock(&self.stop);
        self.stop_cv.notify_all();
    }

    /// Remembers a write refused for want of space (see [`Store::disk_full`]).
    pub(super) fn note_disk_full<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e @ StoreError::DiskFull { .. }) = &r {
            if !self.disk_full.swap(true, Ordering::AcqRel) {
                tracing::warn!(error = %e, "store: out of disk space; writes refused");
            }
        }
        r
    }

    pub(super) fn ack_ranges(&self, queue: QueueId, ranges: &[(u64, u64)]) -> Result<Durable> {
        self.flush.check()?;
        let q = self.queue(queue)?;
        let next = q.cq.next_offset();
        if let Some((s, e)) = ranges.iter().find(|(s, e)| s >= e || *e > next) {
            return Err(StoreError::Invalid(format!(
                "ack of {s}..{e} on queue {queue} with {next} entries"
            )));
        }
        if !q.rec.durable {
            // transient queues do not outlive the process: no record needed
            let mut a = q.ack();
            for (s, e) in ranges {
                a.ack_range(*s, *e);
            }
            return Ok(Durable::ready());
        }
        let len = record::ack_len(ranges.len()) as u64;
        let mut w = self.writer_for(len);
        let ts = now_ms();
        let before = w.pos();
        let at = self.note_disk_full(self.log.append(&mut w, len, |buf| {
            record::encode_ack(buf, ts, queue, ranges)
        }))?;
        self.log.publish(&w);
        if at != before {
            self.note_sealed();
        }
        {
            let mut a = q.ack();
            for (s, e) in ranges {
                a.ack_range(*s, *e);
            }
            // a small queue drops consumed entries at once (heap only), so it stays small
            q.cq.trim_below(a.head());
        }
        q.dirty.store(true, Ordering::Relaxed);
        let end = w.pos();
        drop(w);
        Ok(self.after_append(end))
    }

    /// Makes the log durable up to `end`, whoever is flushing.
    pub(super) fn flush_to(&self, end: u64) -> Result<()> {
        self.flush_from(end).map(|_| ())
    }

    /// [`Self::flush_to`], returning where the flush started (`None`: nothing to do).
    pub(super) fn flush_from(&self, end: u64) -> Result<Option<u64>> {
        self.flush.check()?;
        let from = self.flush.flushed();
        if from >= end {
            return Ok(None);
        }
        if let Err(e) = self.log.flush(from, end) {
            self.flush.fail(e.to_string());
            return Err(e);
        }
        self.flush.complete(end);
        Ok(Some(from))
    }
}

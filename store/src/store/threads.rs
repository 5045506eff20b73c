//! The store's threads: the flusher (group commit in `sync` mode, an interval in
//! `async` mode), the maintenance thread (checkpoints, and retention passes paced by
//! their cost; see `compaction`) and the segment warmer.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::{lock, Inner};
use crate::error::{Result, StoreError};
use crate::flush::FlushMode;

impl Inner {
    /// Starts the flusher, the maintenance thread and the segment warmer.
    pub(super) fn start_threads(self: &Arc<Self>, dir: &Path) -> Result<Vec<JoinHandle<()>>> {
        let spawn = |name: &str, run: fn(&Inner)| {
            let i = self.clone();
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || run(&i))
                .map_err(StoreError::at(dir))
        };
        Ok(vec![
            spawn("store-flush", Inner::flusher)?,
            spawn("store-maint", Inner::maintenance)?,
            spawn("store-warm", |i| i.log.warm_ahead())?,
        ])
    }

    /// The flusher thread's flush (group commit, or async mode's interval): timed and
    /// sized for `/metrics`. Checkpoint and compaction flushes are not group commits and
    /// are not counted.
    fn group_commit(&self, end: u64) -> Result<()> {
        let started = std::time::Instant::now();
        if let Some(from) = self.flush_from(end)? {
            let st = &self.flush.stats;
            st.sync_us
                .record(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX));
            st.batch_bytes.record(end - from);
        }
        Ok(())
    }

    fn flusher(&self) {
        match self.cfg.flush {
            FlushMode::Sync => {
                while let Some(target) = self.flush.next_target() {
                    if self.group_commit(target).is_err() {
                        break;
                    }
                }
            }
            FlushMode::Async {
                interval,
                dirty_bytes,
            } => loop {
                match self.flush.next_target_async(interval, dirty_bytes) {
                    Some(target) if self.group_commit(target).is_err() => break,
                    Some(_) => {}
                    None if self.flush.is_shutdown() || self.flush.check().is_err() => break,
                    None => {}
                }
            },
        }
        if let Err(e) = self.flush.check() {
            tracing::error!(error = %e, "store: flusher stopped; the store accepts no more writes");
        }
    }

    fn maintenance(&self) {
        let mut last_retention = std::time::Instant::now();
        loop {
            {
                let stop = lock(&self.stop);
                if *stop {
                    return;
                }
                if !self.sealed.load(Ordering::Acquire) {
                    let (stop, _) = self
                        .stop_cv
                        .wait_timeout(stop, self.cfg.checkpoint_interval)
                        .unwrap_or_else(|e| e.into_inner());
                    if *stop {
                        return;
                    }
                }
            }
            if self.flush.check().is_err() {
                return;
            }
            let sealed = self.sealed.swap(false, Ordering::AcqRel);
            // every seal so far is covered by this round's checkpoint and pass
            let seals = self.seals();
            let changed = *lock(&self.checkpoint) != self.log.end();
            if changed {
                if let Err(e) = self.checkpoint() {
                    tracing::error!(error = %e, "store: checkpoint failed");
                    if matches!(e, StoreError::Fatal(_)) {
                        return;
                    }
                }
            }
            // A pass walks every pending entry (O(backlog)): with a backlog of hundreds of
            // millions that takes seconds, so passes are spaced to keep the walks under a
            // tenth of this thread's time, whatever `retention_interval` says or however
            // fast segments seal. A sealed segment otherwise gets its pass at once: the
            // checkpoint above now covers it, so it can be compacted or deleted.
            let walk = Duration::from_nanos(self.live_walk_ns.load(Ordering::Relaxed));
            let since = last_retention.elapsed();
            let due = sealed || since >= self.cfg.retention_interval;
            if due && since >= walk * RETENTION_PACE {
                last_retention = std::time::Instant::now();
                if let Err(e) = self.retention() {
                    tracing::warn!(error = %e, "store: retention failed");
                }
                self.note_passed(seals);
            } else if sealed {
                // paced: keep it for the next wake-up. Appends wait for it (at most
                // PASS_WAIT_MAX) unless the bound has room for the sealed segments
                // without that pass (see `pacing_leaves_room`).
                self.sealed.store(true, Ordering::Release);
                if self.pacing_leaves_room() {
                    self.note_passed(seals);
                }
                let stop = lock(&self.stop);
                if !*stop {
                    let pause = (walk * RETENTION_PACE).saturating_sub(since);
                    let _ = self
                        .stop_cv
                        .wait_timeout(stop, pause.min(self.cfg.checkpoint_interval))
                        .unwrap_or_else(|e| e.into_inner());
                }
            }
        }
    }
}

impl Inner {
    /// Whether a retention pass held back by its pacing may leave the sealed segments
    /// there and let the writer go on (a next segment made ahead, then sealed in turn)
    /// within the disk bound of 2 × live + 2 segments. The segments the last pass kept
    /// were each at least half live; the sealed segments since count as holding nothing.
    /// The writer's segment and the one made ahead are the bound's 2 segments, and the
    /// sealed ones, one more among them after the next roll, must fit in twice the live
    /// bytes: `2 × kept live ≥ (sealed + 1) × segment`. A large backlog (the case pacing
    /// is for: a walk of seconds) passes this; a few dense segments of copies with a
    /// slow queue's handful of messages do not, and their appends wait for the pass,
    /// which the pacing brings within milliseconds for so small a walk.
    fn pacing_leaves_room(&self) -> bool {
        let sealed = self.log.sealed_segments().len() as u128;
        let live = u128::from(self.kept_live.load(Ordering::Relaxed));
        2 * live >= (sealed + 1) * u128::from(self.cfg.segment_size)
    }
}

/// In `async` flush mode, appends' [`Durable`]s (the confirms) wait once the unflushed
/// bytes exceed this many times the flusher's `dirty_bytes` (64 MiB with the defaults).
const ASYNC_BACKLOG_FLUSHES: u64 = 4;
/// What an `async`-mode append that ends at `end` waits for: nothing while at most
/// [`ASYNC_BACKLOG_FLUSHES`] × `dirty_bytes` are unflushed, else the offset that brings
/// the backlog back to that.
pub(super) fn async_wait(end: u64, flushed: u64, dirty_bytes: u64) -> Option<u64> {
    let limit = dirty_bytes.saturating_mul(ASYNC_BACKLOG_FLUSHES);
    (end.saturating_sub(flushed) > limit).then(|| end - limit)
}

/// The longest an append waits for the retention pass after a seal before it seals
/// the next segment anyway (a pass held back by its pacing, or a slow disk): the disk
/// bound then gives way before the publishers stall for longer.
pub(super) const PASS_WAIT_MAX: Duration = Duration::from_secs(2);

/// While a sealed segment awaits its pass, appends leave the last
/// `segment_size / COPY_ROOM_SHARE` bytes of the writer's segment to that pass's copies:
/// half, as a segment is compacted only when less than half of it is live, so the copies
/// of one segment fit without a roll (a roll would make a third segment).
pub(super) const COPY_ROOM_SHARE: u64 = 2;

/// Retention passes start at least this many times their last liveness walk apart.
const RETENTION_PACE: u32 = 10;
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn async_appends_wait_only_past_the_backlog_limit() {
        let mib = 1 << 20;
        assert_eq!(async_wait(10 * mib, 0, 16 * mib), None);
        assert_eq!(async_wait(64 * mib, 0, 16 * mib), None);
        assert_eq!(async_wait(100 * mib, 0, 16 * mib), Some(36 * mib));
        assert_eq!(async_wait(100 * mib, 90 * mib, 16 * mib), None);
        assert_eq!(async_wait(5, 9, 16 * mib), None, "flushed past the end");
    }
}

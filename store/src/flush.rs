//! Durability tracking: which commitlog offset is known to be on disk, and the handles
//! ([`Durable`]) that appends return and confirms wait on.
//!
//! In `sync` mode one flusher thread performs group commit: once somebody waits for an
//! offset that is not durable yet, it takes everything appended so far, makes it durable
//! with one `msync`, then completes every waiter at or below that offset; appends that
//! arrive meanwhile share the next flush. Appends nobody waits for (transient messages,
//! acks) do not wake it: they ride along with the next flush or the next checkpoint. In `async` mode the
//! flusher runs on an interval or once enough bytes are dirty, and appends complete at
//! once (after the page-cache write), unless writes outrun the disk: past four flushes'
//! worth of unflushed bytes an append's [`Durable`] waits for the flusher. The append
//! itself does not wait: this slows only publishers that wait for their confirms
//! (receipts, PUBACKs), not those that never ask for one. A failed flush is fatal:
//! every waiter, present and future, gets `StoreError::Fatal`, because retrying `fsync`
//! can report success for data the kernel already dropped.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::error::{Result, StoreError};
use crate::replica::ReplicaGate;

/// How appends are made durable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlushMode {
    /// Group commit: an append completes once its bytes are on disk.
    #[default]
    Sync,
    /// Flush every `interval` or once `dirty_bytes` are unflushed; appends complete at once.
    Async {
        interval: Duration,
        dirty_bytes: u64,
    },
}

impl FlushMode {
    /// RocketMQ-like async defaults: 200 ms, 16 MiB.
    pub fn async_default() -> FlushMode {
        FlushMode::Async {
            interval: Duration::from_millis(200),
            dirty_bytes: 16 << 20,
        }
    }
}

#[derive(Default)]
struct State {
    /// Highest offset appended.
    written: u64,
    /// Highest offset somebody waits for (sync mode flushes only for these).
    wanted: u64,
    /// Everything below this offset is durable.
    flushed: u64,
    failed: Option<String>,
    shutdown: bool,
    wakers: Vec<(u64, Waker)>,
}

/// A histogram with fixed upper bounds (Prometheus' cumulative buckets are made when
/// read). Written by the flusher thread only (its group commits; checkpoint and
/// compaction flushes are not counted), with relaxed atomic adds, once per flush, never
/// per message; read when scraped.
#[derive(Debug)]
pub struct Histogram<const N: usize> {
    bounds: [u64; N],
    /// Samples at or below each bound (and above the one before), then above the last.
    counts: [AtomicU64; N],
    over: AtomicU64,
    sum: AtomicU64,
}

/// What a [`Histogram`] holds at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistogramSnapshot {
    /// Each bucket's upper bound and the samples at or below it (cumulative).
    pub buckets: Vec<(u64, u64)>,
    /// All samples.
    pub count: u64,
    /// Their sum.
    pub sum: u64,
}

impl<const N: usize> Histogram<N> {
    /// A histogram with these upper bounds (ascending).
    pub fn new(bounds: [u64; N]) -> Histogram<N> {
        Histogram {
            bounds,
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            over: AtomicU64::new(0),
            sum: AtomicU64::new(0),
        }
    }

    /// Records one sample.
    pub fn record(&self, v: u64) {
        let slot = self
            .bounds
            .iter()
            .position(|b| v <= *b)
            .and_then(|i| self.counts.get(i))
            .unwrap_or(&self.over);
        slot.fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(v, Ordering::Relaxed);
    }

    /// The cumulative buckets, count and sum.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut acc = 0u64;
        let buckets = self
            .bounds
            .iter()
            .zip(&self.counts)
            .map(|(b, c)| {
                acc = acc.wrapping_add(c.load(Ordering::Relaxed));
                (*b, acc)
            })
            .collect();
        HistogramSnapshot {
            buckets,
            count: acc.wrapping_add(self.over.load(Ordering::Relaxed)),
            sum: self.sum.load(Ordering::Relaxed),
        }
    }
}

/// Upper bounds of [`FlushStats::sync_us`], in µs: 100 µs to 1 s.
pub const SYNC_US_BOUNDS: [u64; 12] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
];
/// Upper bounds of [`FlushStats::batch_bytes`]: 512 B to 256 MiB.
pub const BATCH_BYTES_BOUNDS: [u64; 10] = [
    512,
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
    256 << 20,
];

/// The flusher thread's commitlog flushes: how long each `msync` took and how many bytes it made
/// durable (a group commit's batch).
#[derive(Debug)]
pub struct FlushStats {
    /// Duration of each commitlog flush, µs.
    pub sync_us: Histogram<12>,
    /// Bytes each flush made durable.
    pub batch_bytes: Histogram<10>,
}

impl Default for FlushStats {
    fn default() -> FlushStats {
        FlushStats {
            sync_us: Histogram::new(SYNC_US_BOUNDS),
            batch_bytes: Histogram::new(BATCH_BYTES_BOUNDS),
        }
    }
}

/// Shared between appenders, waiters and the flusher thread.
#[derive(Default)]
pub struct FlushShared {
    state: Mutex<State>,
    /// The flusher waits here for work.
    work: Condvar,
    /// Blocking waiters wait here for progress.
    done: Condvar,
    /// The flushes' durations and sizes.
    pub stats: FlushStats,
    /// Replication (issue 18): told of every append; in sync mode a durability also
    /// waits for it. Unset without `[cluster]`.
    gate: std::sync::OnceLock<Arc<ReplicaGate>>,
}

impl FlushShared {
    pub fn new(start: u64) -> Arc<FlushShared> {
        let s = FlushShared::default();
        {
            let mut st = s.lock();
            st.written = start;
            st.flushed = start;
        }
        Arc::new(s)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means another thread panicked while holding it; the state
        // (two counters and a list) is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that bytes up to `end` were appended and wakes the flusher once at least
    /// `kick_at` bytes are unflushed (0: always, for group commit). Returns the offset
    /// flushed so far.
    pub fn appended(&self, end: u64, kick_at: u64) -> u64 {
        if let Some(g) = self.gate.get() {
            g.appended(end);
        }
        let mut st = self.lock();
        if end > st.written {
            st.written = end;
        }
        let (dirty, flushed) = (st.written - st.flushed, st.flushed);
        drop(st);
        if dirty >= kick_at {
            self.work.notify_one();
        }
        flushed
    }

    /// Wakes the flusher even if it is waiting for an interval (dirty threshold crossed).
    pub fn kick(&self) {
        self.work.notify_one();
    }

    /// The durable offset.
    pub fn flushed(&self) -> u64 {
        self.lock().flushed
    }

    /// The highest appended offset.
    pub fn written(&self) -> u64 {
        self.lock().written
    }

    /// `Err(Fatal)` once a flush failed.
    pub fn check(&self) -> Result<()> {
        match &self.lock().failed {
            Some(why) => Err(StoreError::Fatal(why.clone())),
            None => Ok(()),
        }
    }

    /// For the sync flusher: waits until there is something to flush and returns the
    /// target offset, or `None` on shutdown with nothing left (or after a failure).
    pub fn next_target(&self) -> Option<u64> {
        let mut st = self.lock();
        loop {
            if st.failed.is_some() {
                return None;
            }
            if st.wanted > st.flushed || (st.shutdown && st.written > st.flushed) {
                return Some(st.written);
            }
            if st.shutdown {
                return None;
            }
            st = self.work.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// For the async flusher: waits up to `interval` (less once `dirty_bytes` are unflushed
    /// and the flusher is kicked, or on shutdown) and returns the offset to flush to, or
    /// `None` when nothing is dirty (`Some(flushed)`-like no-ops are not returned).
    pub fn next_target_async(&self, interval: Duration, dirty_bytes: u64) -> Option<u64> {
        let mut st = self.lock();
        let deadline = std::time::Instant::now() + interval;
        loop {
            if st.failed.is_some() {
                return None;
            }
            let dirty = st.written - st.flushed;
            if st.shutdown || dirty >= dirty_bytes {
                break;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                break;
            }
            st = self
                .work
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        (st.written > st.flushed).then_some(st.written)
    }

    /// Whether shutdown was asked for.
    pub fn is_shutdown(&self) -> bool {
        self.lock().shutdown
    }

    /// For the flusher: everything below `offset` is durable now. It is also written:
    /// a flush to the log's end (the checkpoint's) can pass appends whose writers have
    /// not called [`Self::appended`] yet, and `written ≥ flushed` must hold.
    pub fn complete(&self, offset: u64) {
        let mut st = self.lock();
        if offset > st.flushed {
            st.flushed = offset;
        }
        st.written = st.written.max(offset);
        let flushed = st.flushed;
        let mut ready = Vec::new();
        st.wakers.retain(|(t, w)| {
            if *t <= flushed {
                ready.push(w.clone());
                false
            } else {
                true
            }
        });
        drop(st);
        self.done.notify_all();
        for w in ready {
            w.wake();
        }
    }

    /// For the flusher: the flush failed; nothing will ever be durable again.
    pub fn fail(&self, why: String) {
        let mut st = self.lock();
        if st.failed.is_none() {
            st.failed = Some(why);
        }
        let wakers = std::mem::take(&mut st.wakers);
        drop(st);
        self.done.notify_all();
        self.work.notify_all();
        for (_, w) in wakers {
            w.wake();
        }
    }

    /// Asks the flusher to flush what is left and stop.
    pub fn shutdown(&self) {
        self.lock().shutdown = true;
        self.work.notify_all();
    }

    /// Makes durabilities also wait for `gate` (replication; set once, at open).
    pub fn set_gate(&self, gate: Arc<ReplicaGate>) {
        let _ = self.gate.set(gate);
    }

    /// Replication's part of a durability: `Ok` at once without a gate.
    fn poll_gate(&self, offset: u64, cx: &mut Context<'_>) -> Poll<Result<()>> {
        match self.gate.get() {
            Some(g) => g.poll(offset, cx),
            None => Poll::Ready(Ok(())),
        }
    }

    /// Asks the flusher for `offset` (under the state lock).
    fn want(&self, st: &mut State, offset: u64) {
        if offset > st.wanted && offset > st.flushed {
            st.wanted = offset;
            self.work.notify_one();
        }
    }

    /// Blocks until everything below `offset` is durable.
    pub fn wait(&self, offset: u64) -> Result<()> {
        let mut st = self.lock();
        self.want(&mut st, offset);
        loop {
            if let Some(why) = &st.failed {
                return Err(StoreError::Fatal(why.clone()));
            }
            if st.flushed >= offset {
                return Ok(());
            }
            if st.shutdown && st.written <= st.flushed {
                return Err(StoreError::Fatal("store closed before the flush".into()));
            }
            st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn poll_offset(&self, offset: u64, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let mut st = self.lock();
        if let Some(why) = &st.failed {
            return Poll::Ready(Err(StoreError::Fatal(why.clone())));
        }
        if st.flushed >= offset {
            return Poll::Ready(Ok(()));
        }
        self.want(&mut st, offset);
        if let Some(slot) = st
            .wakers
            .iter_mut()
            .find(|(t, w)| *t == offset && w.will_wake(cx.waker()))
        {
            slot.1 = cx.waker().clone();
        } else {
            st.wakers.push((offset, cx.waker().clone()));
        }
        Poll::Pending
    }
}

/// Completes when an append (or ack) is durable: a future for async callers, `wait` for
/// blocking ones. Dropping it does not cancel anything.
#[must_use = "a Durable does nothing unless awaited or waited on"]
pub struct Durable {
    offset: u64,
    shared: Option<Arc<FlushShared>>,
}

impl Durable {
    pub(crate) fn new(offset: u64, shared: Arc<FlushShared>) -> Durable {
        Durable {
            offset,
            shared: Some(shared),
        }
    }

    /// Already durable (async mode, or nothing to wait for).
    pub fn ready() -> Durable {
        Durable {
            offset: 0,
            shared: None,
        }
    }

    /// The commitlog offset this waits for.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Blocks the calling thread until durable.
    pub fn wait(self) -> Result<()> {
        match &self.shared {
            Some(s) => {
                s.wait(self.offset)?;
                match s.gate.get() {
                    Some(g) => g.wait(self.offset),
                    None => Ok(()),
                }
            }
            None => Ok(()),
        }
    }

    /// Whether it is durable already (never blocks).
    pub fn is_durable(&self) -> bool {
        match &self.shared {
            Some(s) => {
                s.flushed() >= self.offset && s.gate.get().is_none_or(|g| g.reached(self.offset))
            }
            None => true,
        }
    }
}

impl Future for Durable {
    type Output = Result<()>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        match &self.shared {
            Some(s) => match s.poll_offset(self.offset, cx) {
                Poll::Ready(Ok(())) => s.poll_gate(self.offset, cx),
                other => other,
            },
            None => Poll::Ready(Ok(())),
        }
    }
}

impl std::fmt::Debug for Durable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Durable")
            .field("offset", &self.offset)
            .field("durable", &self.is_durable())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Wake;

    struct Flag(std::sync::atomic::AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn waiters_complete_in_order_and_fail_together() {
        let s = FlushShared::new(10);
        assert!(Durable::new(10, s.clone()).is_durable());
        s.appended(20, 0);
        let flag = Arc::new(Flag(Default::default()));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        let mut d = Durable::new(20, s.clone());
        // nobody waits yet: nothing to flush; the first poll asks for it
        assert!(Pin::new(&mut d).poll(&mut cx).is_pending());
        assert_eq!(s.next_target(), Some(20));
        s.complete(15);
        assert!(!flag.0.load(std::sync::atomic::Ordering::SeqCst));
        s.complete(20);
        assert!(flag.0.load(std::sync::atomic::Ordering::SeqCst));
        assert!(matches!(
            Pin::new(&mut d).poll(&mut cx),
            Poll::Ready(Ok(()))
        ));

        s.appended(30, 0);
        let t = {
            let s = s.clone();
            std::thread::spawn(move || s.wait(30))
        };
        s.fail("disk on fire".into());
        assert!(matches!(t.join().unwrap(), Err(StoreError::Fatal(_))));
        assert!(Durable::new(30, s.clone()).wait().is_err());
        assert!(s.check().is_err());
        assert_eq!(s.next_target(), None);
    }

    #[test]
    fn a_flush_past_what_was_reported_appended_is_not_an_underflow() {
        // The checkpoint flushes to the log's end, which may hold appends whose writers
        // have not told the flusher yet (they dropped the writer lock and were preempted):
        // their late `appended` calls come in below the flushed offset.
        let s = FlushShared::new(0);
        s.appended(50, u64::MAX);
        s.complete(200);
        assert_eq!(s.appended(100, 0), 200);
        assert_eq!(s.written(), 200);
        assert_eq!(s.next_target_async(Duration::from_millis(1), 1), None);
        s.appended(250, u64::MAX);
        assert_eq!(s.next_target_async(Duration::from_millis(1), 1), Some(250));
    }

    #[test]
    fn interval_timeout_returns_pending_work() {
        let s = FlushShared::new(0);
        let ms = Duration::from_millis(1);
        assert_eq!(s.next_target_async(ms, 100), None);
        s.appended(5, 1000);
        assert_eq!(s.next_target_async(ms, 100), Some(5));
        // past the dirty threshold it does not wait for the interval
        s.appended(500, 1000);
        assert_eq!(
            s.next_target_async(Duration::from_secs(3600), 100),
            Some(500)
        );
        s.shutdown();
        s.complete(500);
        assert_eq!(s.next_target(), None);
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new([10, 100]);
        for v in [1, 10, 11, 100, 1000] {
            h.record(v);
        }
        assert_eq!(
            h.snapshot(),
            HistogramSnapshot {
                buckets: vec![(10, 2), (100, 4)],
                count: 5,
                sum: 1122,
            }
        );
    }
}

//! The broker's clock: what the core's expiry decisions read (message TTL, `x-expires`,
//! the retry back-off, delayed delivery, half-message check-backs, stream retention by
//! age), and MQTT's persistent session expiry. [`Clock::system`] is the default and reads the system clock, as before.
//! [`Clock::manual`] is for tests: it stands at the system time of its making and moves
//! only when a test [`advance`](Clock::advance)s it, so a test of a one-minute TTL
//! advances a minute instead of waiting one, and "not yet" holds until it does.
//! Timestamps the store writes (`store_ts_ms`, `born_ts_ms`) stay system time, so a
//! message stored a moment after the clock was made expires a moment after its TTL by
//! the manual clock: tests advance past a deadline with a margin.
//!
//! Reading it costs what reading the system clock costs, plus one branch on a pointer
//! that is null for the system clock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, by the system clock.
pub(crate) fn system_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A callback run after each [`Clock::advance`] (a scheduler that sleeps until a due
/// time wakes to look again).
type Waker = Box<dyn Fn() + Send + Sync>;

/// The state of a manual clock.
struct Manual {
    /// The system time when it was made, ms since the Unix epoch.
    start_ms: u64,
    /// The monotonic time when it was made.
    start: Instant,
    /// How far the clock has been advanced, ms.
    ahead_ms: AtomicU64,
    /// Woken on each advance; bounded by the vhosts with a delay queue, plus one for
    /// MQTT session expiry.
    wakers: Mutex<Vec<Waker>>,
}

/// The clock the core decides expiry by. Cheap to clone (a pointer, null for the
/// system clock).
#[derive(Clone, Default)]
pub struct Clock {
    manual: Option<Arc<Manual>>,
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.manual {
            None => f.write_str("Clock::system"),
            Some(m) => write!(
                f,
                "Clock::manual(+{} ms)",
                m.ahead_ms.load(Ordering::Relaxed)
            ),
        }
    }
}

impl Clock {
    /// The system clock (the default).
    pub fn system() -> Clock {
        Clock { manual: None }
    }

    /// A clock for tests: the system time now, moved only by [`Clock::advance`].
    pub fn manual() -> Clock {
        Clock {
            manual: Some(Arc::new(Manual {
                start_ms: system_now_ms(),
                start: Instant::now(),
                ahead_ms: AtomicU64::new(0),
                wakers: Mutex::new(Vec::new()),
            })),
        }
    }

    /// Whether this is a manual clock.
    pub fn is_manual(&self) -> bool {
        self.manual.is_some()
    }

    /// Milliseconds since the Unix epoch.
    #[inline]
    pub fn now_ms(&self) -> u64 {
        match &self.manual {
            None => system_now_ms(),
            Some(m) => m
                .start_ms
                .saturating_add(m.ahead_ms.load(Ordering::Relaxed)),
        }
    }

    /// A monotonic instant (for "unused for this long").
    #[inline]
    pub fn instant(&self) -> Instant {
        match &self.manual {
            None => Instant::now(),
            Some(m) => {
                let ahead = Duration::from_millis(m.ahead_ms.load(Ordering::Relaxed));
                m.start.checked_add(ahead).unwrap_or(m.start)
            }
        }
    }

    /// Moves a manual clock forward by `by` (whole milliseconds) and wakes the
    /// schedulers that sleep by it. Panics on the system clock, which no one can move.
    pub fn advance(&self, by: Duration) {
        let m = self
            .manual
            .as_ref()
            .expect("Clock::advance on the system clock (use Clock::manual)");
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        m.ahead_ms.fetch_add(ms, Ordering::Relaxed);
        for w in m.wakers.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            w();
        }
    }

    /// Runs `wake` after each [`Clock::advance`] (nothing for the system clock): a task
    /// that sleeps until a due time by this clock registers once, at its start.
    pub fn on_advance(&self, wake: impl Fn() + Send + Sync + 'static) {
        if let Some(m) = &self.manual {
            m.wakers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Box::new(wake));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_advanced() {
        let before = system_now_ms();
        let c = Clock::manual();
        let (t0, i0) = (c.now_ms(), c.instant());
        assert!(t0 >= before && t0 <= system_now_ms());
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!((c.now_ms(), c.instant()), (t0, i0), "stands still");
        c.advance(Duration::from_secs(3600));
        assert_eq!(c.now_ms(), t0 + 3_600_000);
        assert_eq!(c.instant(), i0 + Duration::from_secs(3600));
        let woken = Arc::new(AtomicU64::new(0));
        let w = woken.clone();
        c.on_advance(move || {
            w.fetch_add(1, Ordering::Relaxed);
        });
        c.clone().advance(Duration::from_millis(1));
        assert_eq!(woken.load(Ordering::Relaxed), 1);
        // the system clock is not moved by anyone
        let s = Clock::system();
        assert!(!s.is_manual());
        assert!(s.now_ms() >= before && s.now_ms() < before + 3_600_000);
    }
}

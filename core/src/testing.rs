//! Helpers for tests of this crate and of the crates above it: waits that poll a
//! condition until a deadline, in place of sleeping a fixed time and then asserting
//! (which is slow when the wait is long enough and flaky when it is not).
//!
//! A condition returns a [`Ready`] value: `bool` (holds or not), `Option<T>` (the value
//! once there) or `Result<T, E>` (the value, or why not yet: the last reason is in the
//! failure's message). The waits return what the condition gave once ready.
//! - [`eventually`]: a plain condition, polled from async code (the task sleeps between
//!   looks).
//! - [`eventually_async`]: a condition that is itself async (a request to the broker);
//!   each attempt is bounded by what is left of the deadline.
//! - [`eventually_blocking`]: a plain condition from a test without a runtime.
//!
//! [`open_broker`] and [`open_clocked`] open a broker over a fresh store in a test's
//! directory; [`CountingAlloc`] is a global allocator that keeps a count of the bytes live, for
//! tests that measure what an entity holds on the heap.
//!
//! The deadline is wall-clock time (`std::time::Instant`), so a wait on work done by
//! other threads cannot time out early on a paused tokio clock.

use std::alloc::{GlobalAlloc, Layout, System};
use std::fmt::Display;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use triad_store::store::{Store, StoreConfig};

use crate::{Broker, Clock, CoreConfig};

/// How often the waits look again.
pub const POLL: Duration = Duration::from_millis(10);

/// What a polled condition returns: ready with a value, or not yet (with a reason, empty
/// when there is none to tell).
pub trait Ready {
    /// What the wait returns once the condition is ready.
    type Output;
    /// `Ok` when ready; `Err(reason)` when not yet.
    fn ready(self) -> Result<Self::Output, String>;
}

impl Ready for bool {
    type Output = ();
    fn ready(self) -> Result<(), String> {
        if self {
            Ok(())
        } else {
            Err(String::new())
        }
    }
}

impl<T> Ready for Option<T> {
    type Output = T;
    fn ready(self) -> Result<T, String> {
        self.ok_or_else(String::new)
    }
}

impl<T, E: Display> Ready for Result<T, E> {
    type Output = T;
    fn ready(self) -> Result<T, String> {
        self.map_err(|e| e.to_string())
    }
}

#[allow(clippy::panic)]
fn timed_out(what: &str, timeout: Duration, last: &str) -> ! {
    if last.is_empty() {
        panic!("timed out after {timeout:?} waiting for {what}");
    }
    panic!("timed out after {timeout:?} waiting for {what}; last: {last}");
}

/// Polls `cond` every [`POLL`] until it is ready and returns its value; panics naming
/// `what` (and the last reason, if any) once `timeout` has passed without it (the panic
/// is the test's failure).
pub async fn eventually<R: Ready>(
    what: &str,
    timeout: Duration,
    mut cond: impl FnMut() -> R,
) -> R::Output {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match cond().ready() {
            Ok(v) => return v,
            Err(last) => last,
        };
        if Instant::now() >= deadline {
            timed_out(what, timeout, &last);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] for a condition that is itself async (for example a `basic.get` or a
/// login attempt). An attempt still running at the deadline is abandoned and the wait
/// fails.
pub async fn eventually_async<R: Ready>(
    what: &str,
    timeout: Duration,
    mut cond: impl AsyncFnMut() -> R,
) -> R::Output {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let last = match tokio::time::timeout(left, cond()).await {
            Ok(r) => match r.ready() {
                Ok(v) => return v,
                Err(last) => last,
            },
            Err(_) => "an attempt still running at the deadline".to_owned(),
        };
        if Instant::now() >= deadline {
            timed_out(what, timeout, &last);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] for a test without a runtime: the thread sleeps between looks.
pub fn eventually_blocking<R: Ready>(
    what: &str,
    timeout: Duration,
    mut cond: impl FnMut() -> R,
) -> R::Output {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match cond().ready() {
            Ok(v) => return v,
            Err(last) => last,
        };
        if Instant::now() >= deadline {
            timed_out(what, timeout, &last);
        }
        std::thread::sleep(POLL);
    }
}

/// Opens the store `store` and a broker over it configured by `core`; panics (the test's
/// failure) if either does not open.
pub fn open_broker(store: StoreConfig, core: CoreConfig) -> Arc<Broker> {
    let store = Arc::new(Store::open(store).expect("the store opens"));
    Broker::open(store, core).expect("the broker opens")
}

/// [`open_broker`] with the default configuration but for the clock its expiry
/// decisions read (a [`Clock::manual`] lets a test step past a deadline).
pub fn open_clocked(store: StoreConfig, clock: Clock) -> Arc<Broker> {
    open_broker(
        store,
        CoreConfig {
            clock,
            ..CoreConfig::default()
        },
    )
}

/// The system allocator, counting the bytes live. A test binary that measures heap
/// declares it as its allocator and reads [`CountingAlloc::live`] before and after:
///
/// ```ignore
/// #[global_allocator]
/// static A: CountingAlloc = CountingAlloc::new();
/// ```
pub struct CountingAlloc {
    live: AtomicIsize,
}

impl CountingAlloc {
    /// A counter at zero.
    pub const fn new() -> Self {
        Self {
            live: AtomicIsize::new(0),
        }
    }

    /// Bytes allocated and not yet freed through this allocator.
    pub fn live(&self) -> isize {
        self.live.load(Ordering::Relaxed)
    }
}

impl Default for CountingAlloc {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every call is passed on unchanged to `System`; only a counter is updated
// besides.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        self.live.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        self.live.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: `p` came from `System` with layout `l` (every allocation goes there).
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        self.live
            .fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        // SAFETY: as for `dealloc`; the caller's contract for `new`.
        unsafe { System.realloc(p, l, new) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_the_value_once_ready() {
        let mut n = 0;
        let got = eventually_blocking("n to reach 3", Duration::from_secs(5), || {
            n += 1;
            (n >= 3).then_some(n)
        });
        assert_eq!(got, 3);
    }

    #[test]
    fn times_out_with_the_last_reason() {
        let r = std::panic::catch_unwind(|| {
            eventually_blocking("never", Duration::from_millis(30), || {
                Err::<(), _>("still 7")
            })
        });
        let msg = r.expect_err("must time out");
        let msg = msg
            .downcast_ref::<String>()
            .expect("a formatted panic message");
        assert!(msg.contains("waiting for never"), "{msg}");
        assert!(msg.contains("last: still 7"), "{msg}");
    }

    #[tokio::test]
    async fn async_condition_polls_and_a_hung_attempt_times_out() {
        let mut n = 0;
        let got = eventually_async("n to reach 2", Duration::from_secs(5), async || {
            n += 1;
            tokio::task::yield_now().await;
            if n >= 2 {
                Ok(n)
            } else {
                Err("not yet")
            }
        })
        .await;
        assert_eq!(got, 2);
        let hung = tokio::spawn(async {
            eventually_async("a hung attempt", Duration::from_millis(30), async || {
                std::future::pending::<bool>().await
            })
            .await
        });
        let e = hung.await.expect_err("the wait fails");
        assert!(e.is_panic());
    }
}

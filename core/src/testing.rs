//! Helpers for tests of this crate and of the crates above it: waits that poll a
//! condition until a deadline, in place of sleeping a fixed time and then asserting
//! (which is slow when the wait is long enough and flaky when it is not).

use std::time::{Duration, Instant};

/// How often [`eventually`] and [`eventually_blocking`] look again.
pub const POLL: Duration = Duration::from_millis(10);

/// Polls `cond` every [`POLL`] until it holds; panics naming `what` once `timeout` has
/// passed without it (the panic is the test's failure).
#[allow(clippy::panic)]
pub async fn eventually(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] for a test without a runtime: the thread sleeps between looks.
#[allow(clippy::panic)]
pub fn eventually_blocking(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(POLL);
    }
}

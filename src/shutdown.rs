//! The store's last step at shutdown, and what the log says about it: "stopped cleanly"
//! only when the store was really closed (final checkpoint written, `abort` marker
//! removed), never when some part of the broker still held it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use triad_store::store::Store;

/// How [`close_store`] ended.
#[derive(Debug)]
pub enum StoreClose {
    /// Closed: the next start is a clean one.
    Closed,
    /// Closing failed (e.g. the final flush): the next start recovers.
    Failed(triad_store::StoreError),
    /// Still referenced after the wait (`holders` other handles): not closed; the next
    /// start finds the `abort` marker and recovers.
    StillReferenced {
        /// Handles other than the one given.
        holders: usize,
    },
}

/// Closes the store once `store` is its last handle, waiting up to `wait` for other
/// holders (tasks the runtime is still letting go of) to drop theirs.
pub fn close_store(mut store: Arc<Store>, wait: Duration) -> StoreClose {
    let deadline = Instant::now() + wait;
    loop {
        match Arc::try_unwrap(store) {
            Ok(s) => {
                return match s.close() {
                    Ok(()) => StoreClose::Closed,
                    Err(e) => StoreClose::Failed(e),
                }
            }
            Err(shared) if Instant::now() < deadline => {
                store = shared;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(shared) => {
                return StoreClose::StillReferenced {
                    holders: Arc::strong_count(&shared) - 1,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use triad_store::store::StoreConfig;

    fn open(dir: &std::path::Path) -> Arc<Store> {
        let mut cfg = StoreConfig::new(dir);
        cfg.segment_size = 1 << 20;
        Arc::new(Store::open(cfg).expect("open"))
    }

    #[test]
    fn a_store_still_held_is_reported_not_closed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let holder = Arc::clone(&store);
        match close_store(store, Duration::from_millis(50)) {
            StoreClose::StillReferenced { holders: 1 } => {}
            other => panic!("expected StillReferenced, got {other:?}"),
        }
        assert!(
            dir.path().join("abort").exists(),
            "not closed: marker stays"
        );
        drop(holder);
    }

    #[test]
    fn a_holder_that_lets_go_within_the_wait_lets_the_store_close() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let holder = Arc::clone(&store);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            drop(holder);
        });
        assert!(matches!(
            close_store(store, Duration::from_secs(5)),
            StoreClose::Closed
        ));
        t.join().expect("join");
        assert!(!dir.path().join("abort").exists(), "closed: marker removed");
    }
}

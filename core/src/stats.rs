//! Message counters and rates for the management API and `/metrics`.
//!
//! - [`Counter`]: a counter written on message paths from many threads, split over
//!   cache-line-padded shards (a thread keeps to one shard), summed when read: no cache
//!   line is shared by publishers on different cores. Used for what has no owner lock
//!   (publishes into a vhost).
//! - [`Counts`]: a queue's deliver / get / ack / redeliver counters, plain integers
//!   kept under the queue's own lock, which every one of those paths already holds
//!   (48 bytes per queue).
//! - [`RateSample`]: the previous reading of a set of counters and the rates derived
//!   from it, made when a reader first asks (a queue nobody looks at carries none) and
//!   refreshed when at least [`RATE_INTERVAL`] has passed, as RabbitMQ's
//!   `*_details.rate` (per second over its last sampling interval).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Shards of a [`Counter`].
const SHARDS: usize = 16;

/// Shortest interval a rate is computed over; readers in between see the last rate.
pub const RATE_INTERVAL: Duration = Duration::from_secs(2);

#[repr(align(64))]
#[derive(Debug, Default)]
struct Shard(AtomicU64);

/// A sharded counter (see the module docs). 1 KiB.
#[derive(Debug, Default)]
pub struct Counter {
    shards: [Shard; SHARDS],
}

fn shard_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    SHARD.with(|s| *s)
}

impl Counter {
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        if let Some(s) = self.shards.get(shard_index()) {
            s.0.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The sum of every shard.
    pub fn get(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .fold(0u64, u64::wrapping_add)
    }
}

/// A queue's message counters since it was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Delivered to consumers that ack.
    pub deliver: u64,
    /// Delivered to consumers that do not ack.
    pub deliver_no_ack: u64,
    /// Taken by `basic.get` (and the API's get) to be acked.
    pub get: u64,
    /// Taken by a get without ack.
    pub get_no_ack: u64,
    /// Delivered or got with the redelivered flag.
    pub redeliver: u64,
    /// Acked by a client.
    pub ack: u64,
}

impl Counts {
    /// Adds `o`.
    pub fn add(&mut self, o: &Counts) {
        self.deliver += o.deliver;
        self.deliver_no_ack += o.deliver_no_ack;
        self.get += o.get;
        self.get_no_ack += o.get_no_ack;
        self.redeliver += o.redeliver;
        self.ack += o.ack;
    }
}

/// Named counter values: what a [`RateSample`] differentiates.
pub type Values = [u64; 8];

/// The previous reading of a set of counters and the rates from it.
#[derive(Debug, Clone)]
pub struct RateSample {
    at: Instant,
    values: Values,
    rates: [f64; 8],
}

impl RateSample {
    /// The first reading: rates are 0 until the next one.
    pub fn new(values: Values, now: Instant) -> RateSample {
        RateSample {
            at: now,
            values,
            rates: [0.0; 8],
        }
    }

    /// Per-second rates of `values`, recomputed when [`RATE_INTERVAL`] has passed since
    /// the last reading (else the last rates). A counter that went down (a queue
    /// re-created) rates 0.
    pub fn rates(&mut self, values: Values, now: Instant) -> [f64; 8] {
        let dt = now.saturating_duration_since(self.at);
        if dt >= RATE_INTERVAL {
            let secs = dt.as_secs_f64();
            for ((r, new), old) in self.rates.iter_mut().zip(values).zip(self.values) {
                *r = new.saturating_sub(old) as f64 / secs;
            }
            self.values = values;
            self.at = now;
        }
        self.rates
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sharded_counter_sums_every_thread() {
        let c = std::sync::Arc::new(Counter::default());
        let hs: Vec<_> = (0..8)
            .map(|_| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        c.add(1);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(c.get(), 8000);
    }

    #[test]
    fn rates_are_per_second_over_at_least_the_interval() {
        let t0 = Instant::now();
        let mut s = RateSample::new([0, 10, 0, 0, 0, 0, 0, 0], t0);
        // too soon: the last rates (none yet)
        assert_eq!(
            s.rates([5, 10, 0, 0, 0, 0, 0, 0], t0 + Duration::from_secs(1))[0],
            0.0
        );
        let r = s.rates([40, 4, 0, 0, 0, 0, 0, 0], t0 + Duration::from_secs(4));
        assert_eq!((r[0], r[1]), (10.0, 0.0));
        // kept until the next interval
        let r2 = s.rates([1000, 4, 0, 0, 0, 0, 0, 0], t0 + Duration::from_secs(5));
        assert_eq!(r2[0], 10.0);
    }
}

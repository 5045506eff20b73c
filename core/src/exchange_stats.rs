//! Per-exchange publish counters, RabbitMQ's exchange `message_stats`: `publish_in`
//! (messages published to the exchange) and `publish_out` (the queue entries it routed
//! them to: one per queue, as RabbitMQ counts them), each with `*_details.rate`.
//!
//! Kept off the message path as RabbitMQ keeps them (per channel, aggregated when
//! read): each connection ([`crate::Link`]) counts into its own [`ConnCounts`], plain
//! integers behind a mutex only that connection takes per publish (uncontended, on its
//! own cache line; a reader takes it once per listing). A vhost's [`ExchangeStats`]
//! knows the live connections' counts and keeps what closed connections counted; a
//! listing sums them, O(connections + exchanges), never on a message path.
//!
//! Bounds: a connection that never publishes has none (its `Link` holds a 16-byte empty
//! handle); at its first publish it gets its counts (about 80 bytes and an entry in the
//! vhost's map) and counts at most [`MAX_PER_CONN`] exchanges itself (about 40 bytes
//! each); a publish to one more is added to the vhost's
//! totals under the vhost's lock (correct, slower: only a connection publishing to
//! that many exchanges pays it). The vhost keeps one entry per exchange that was
//! published to (and a rate sample per exchange a listing asked about), dropped when
//! the exchange is deleted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use crate::stats::RATE_INTERVAL;

/// Exchanges one connection counts itself (see the module docs).
pub const MAX_PER_CONN: usize = 16;

/// `publish_in` and `publish_out` of one exchange.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Messages published to the exchange.
    pub publish_in: u64,
    /// Queue entries it routed them to.
    pub publish_out: u64,
}

impl Counts {
    fn add(&mut self, o: Counts) {
        self.publish_in = self.publish_in.wrapping_add(o.publish_in);
        self.publish_out = self.publish_out.wrapping_add(o.publish_out);
    }
}

/// An exchange's counts and their per-second rates (`publish_in`, `publish_out`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WithRates {
    /// The counts.
    pub counts: Counts,
    /// Per second, since the previous reading.
    pub rates: [f64; 2],
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One connection's counts, by exchange name.
#[derive(Debug, Default)]
pub struct ConnCounts {
    inner: Mutex<ConnInner>,
}

#[derive(Debug, Default)]
struct ConnInner {
    entries: Vec<(Box<str>, Counts)>,
    /// The entry of the publish under way ([`ExchangeStats::begin`]).
    last: Option<usize>,
}

/// A publish being counted: between [`ExchangeStats::begin`] and
/// [`ExchangeStats::end`].
#[derive(Debug)]
pub enum Begun {
    /// In the connection's own counts.
    Conn,
    /// Past [`MAX_PER_CONN`]: in the vhost's.
    Vhost(Box<str>),
}

#[derive(Default)]
struct Registry {
    /// The open connections' counts, by connection id.
    live: HashMap<u64, Weak<ConnCounts>>,
    /// What closed connections (and publishes past [`MAX_PER_CONN`]) counted.
    settled: HashMap<Box<str>, Counts>,
    /// The last reading of each exchange a listing asked about.
    rates: HashMap<Box<str>, Sample>,
}

/// A vhost's exchange counters (see the module docs).
#[derive(Default)]
pub struct ExchangeStats {
    reg: Mutex<Registry>,
}

impl std::fmt::Debug for ExchangeStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExchangeStats").finish_non_exhaustive()
    }
}

impl ExchangeStats {
    /// A connection's counts, known to this vhost until [`ExchangeStats::close`].
    pub fn open(&self, conn: u64) -> Arc<ConnCounts> {
        let c = Arc::new(ConnCounts::default());
        lock(&self.reg).live.insert(conn, Arc::downgrade(&c));
        c
    }

    /// Moves what `conn` counted into the vhost's totals.
    pub fn close(&self, conn: u64, counts: &ConnCounts) {
        let mut reg = lock(&self.reg);
        reg.live.remove(&conn);
        let taken = std::mem::take(&mut lock(&counts.inner).entries);
        for (name, c) in taken {
            reg.settled.entry(name).or_default().add(c);
        }
    }

    /// Before a publish to `exchange` by the connection with `counts` (no allocation
    /// once the connection has published to it); [`ExchangeStats::end`] counts it.
    pub fn begin(&self, counts: &ConnCounts, exchange: &str) -> Begun {
        let mut c = lock(&counts.inner);
        let i = match c.entries.iter().position(|(n, _)| &**n == exchange) {
            Some(i) => i,
            None if c.entries.len() < MAX_PER_CONN => {
                c.entries.push((exchange.into(), Counts::default()));
                c.entries.len() - 1
            }
            None => return Begun::Vhost(exchange.into()),
        };
        c.last = Some(i);
        Begun::Conn
    }

    /// After the publish: `Some(queues)` when it was done (routed to that many queues),
    /// `None` when it was refused (then it counts nothing, and an entry made for it
    /// goes).
    pub fn end(&self, counts: &ConnCounts, begun: Begun, done: Option<u64>) {
        match (begun, done) {
            (Begun::Conn, done) => {
                let mut c = lock(&counts.inner);
                let Some(i) = c.last.take() else { return };
                match done {
                    Some(queues) => {
                        if let Some((_, n)) = c.entries.get_mut(i) {
                            n.add(Counts {
                                publish_in: 1,
                                publish_out: queues,
                            });
                        }
                    }
                    None => {
                        if c.entries.get(i).is_some_and(|(_, n)| n.publish_in == 0) {
                            c.entries.remove(i);
                        }
                    }
                }
            }
            (Begun::Vhost(name), Some(queues)) => {
                lock(&self.reg)
                    .settled
                    .entry(name)
                    .or_default()
                    .add(Counts {
                        publish_in: 1,
                        publish_out: queues,
                    });
            }
            (Begun::Vhost(_), None) => {}
        }
    }

    /// Forgets a deleted exchange's counts (a new one of that name starts at 0).
    pub fn forget(&self, exchange: &str) {
        let mut reg = lock(&self.reg);
        reg.settled.remove(exchange);
        reg.rates.remove(exchange);
        for c in reg.live.values().filter_map(Weak::upgrade) {
            let mut c = lock(&c.inner);
            c.entries.retain(|(n, _)| &**n != exchange);
            // a publish under way to it counts nowhere
            c.last = None;
        }
    }

    /// The counts and rates of the exchanges `names` (those never published to count
    /// 0), in one pass over the open connections. Each exchange read gets a rate
    /// sample (48 bytes, until it is deleted): its rates are 0 at its first reading.
    pub fn read<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> HashMap<Box<str>, WithRates> {
        let now = Instant::now();
        let mut reg = lock(&self.reg);
        let mut sums: HashMap<Box<str>, Counts> = reg.settled.clone();
        for c in reg.live.values().filter_map(Weak::upgrade) {
            for (name, n) in lock(&c.inner).entries.iter() {
                match sums.get_mut(name) {
                    Some(s) => s.add(*n),
                    None => {
                        sums.insert(name.clone(), *n);
                    }
                }
            }
        }
        let mut out = HashMap::new();
        for name in names {
            let counts = sums.get(name).copied().unwrap_or_default();
            let rates = match reg.rates.get_mut(name) {
                Some(s) => s.rates(counts, now),
                None => {
                    reg.rates.insert(name.into(), Sample::new(counts, now));
                    [0.0; 2]
                }
            };
            out.insert(name.into(), WithRates { counts, rates });
        }
        out
    }
}

/// The previous reading of an exchange's counts and the rates from it (as
/// [`crate::stats::RateSample`], for two counters).
#[derive(Debug, Clone)]
struct Sample {
    at: Instant,
    values: Counts,
    rates: [f64; 2],
}

impl Sample {
    fn new(values: Counts, at: Instant) -> Sample {
        Sample {
            at,
            values,
            rates: [0.0; 2],
        }
    }

    fn rates(&mut self, values: Counts, now: Instant) -> [f64; 2] {
        let dt = now.saturating_duration_since(self.at);
        if dt >= RATE_INTERVAL {
            let secs = dt.as_secs_f64();
            self.rates = [
                values.publish_in.saturating_sub(self.values.publish_in) as f64 / secs,
                values.publish_out.saturating_sub(self.values.publish_out) as f64 / secs,
            ];
            self.values = values;
            self.at = now;
        }
        self.rates
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(s: &ExchangeStats, c: &ConnCounts, x: &str, queues: u64) {
        let b = s.begin(c, x);
        s.end(c, b, Some(queues));
    }

    fn counts(s: &ExchangeStats, x: &str) -> Option<Counts> {
        s.read([x])
            .get(x)
            .map(|w| w.counts)
            .filter(|c| *c != Counts::default())
    }

    #[test]
    fn open_and_closed_connections_sum() {
        let s = ExchangeStats::default();
        let a = s.open(1);
        let b = s.open(2);
        add(&s, &a, "x", 2);
        add(&s, &a, "x", 0);
        add(&s, &b, "x", 1);
        add(&s, &b, "", 1);
        let x = Counts {
            publish_in: 3,
            publish_out: 3,
        };
        assert_eq!(counts(&s, "x"), Some(x));
        // a closed connection's counts stay, once
        s.close(1, &a);
        drop(a);
        assert_eq!(counts(&s, "x"), Some(x));
        assert_eq!(
            counts(&s, ""),
            Some(Counts {
                publish_in: 1,
                publish_out: 1
            })
        );
        assert_eq!(counts(&s, "never"), None);
    }

    #[test]
    fn past_the_bound_a_connection_counts_into_the_vhost() {
        let s = ExchangeStats::default();
        let a = s.open(1);
        for i in 0..MAX_PER_CONN + 4 {
            add(&s, &a, &format!("x{i}"), 1);
            add(&s, &a, &format!("x{i}"), 1);
        }
        assert_eq!(lock(&a.inner).entries.len(), MAX_PER_CONN);
        let names: Vec<String> = (0..MAX_PER_CONN + 4).map(|i| format!("x{i}")).collect();
        let all = s.read(names.iter().map(String::as_str));
        assert_eq!(all.len(), MAX_PER_CONN + 4);
        assert!(all.values().all(|w| w.counts.publish_in == 2));
    }

    #[test]
    fn a_refused_publish_counts_nothing_and_leaves_no_entry() {
        let s = ExchangeStats::default();
        let a = s.open(1);
        let b = s.begin(&a, "missing");
        s.end(&a, b, None);
        assert!(lock(&a.inner).entries.is_empty());
        add(&s, &a, "x", 1);
        let b = s.begin(&a, "x");
        s.end(&a, b, None);
        assert_eq!(counts(&s, "x").map(|c| c.publish_in), Some(1));
        assert_eq!(counts(&s, "missing"), None);
    }

    #[test]
    fn a_deleted_exchange_starts_again_at_zero() {
        let s = ExchangeStats::default();
        let a = s.open(1);
        let b = s.open(2);
        add(&s, &a, "x", 1);
        add(&s, &b, "x", 1);
        s.close(2, &b);
        s.forget("x");
        assert_eq!(counts(&s, "x"), None);
        add(&s, &a, "x", 1);
        assert_eq!(counts(&s, "x").map(|c| c.publish_in), Some(1));
    }
}

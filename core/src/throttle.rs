//! Failed-login throttling shared by every connection of a broker, per source address
//! and per user name, so that parallel connections do not multiply an attacker's
//! guesses (a delay per connection alone let 1,000 connections try 1,000 passwords a
//! second).
//!
//! Each failure reserves the next free slot of its address and of its user name, one
//! per `failed_login_delay` each, and its refusal is answered at the later of the two
//! ([`LoginThrottle::failed`]). While either key has more than [`BURST`] failures
//! waiting to be answered, further attempts with it are refused without the password
//! being checked ([`LoginThrottle::admits`]): so at most one password per delay is
//! tried from one address, or against one user name, once a burst of [`BURST`] is used
//! up. Entries are kept only while a refusal may still be pending, and the table is
//! pruned as it grows; memory is bounded by the failures of the last
//! `BURST × delay`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Failures a source address or user name may have waiting for their answer before
/// its further attempts are refused unchecked.
pub const BURST: u32 = 10;

/// Past this many keys, expired ones are dropped before adding one.
const PRUNE_AT: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Addr(IpAddr),
    User(Box<str>),
}

#[derive(Debug, Default)]
struct Inner {
    /// When each key's next failure may be answered.
    next: HashMap<Key, Instant>,
    /// The delay of the last failure (the configured `failed_login_delay`).
    delay: Duration,
}

/// See the module's documentation.
#[derive(Debug, Default)]
pub struct LoginThrottle {
    inner: Mutex<Inner>,
}

impl LoginThrottle {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a login attempt from `addr` as `user` may be checked now: neither has
    /// more than [`BURST`] failures waiting for their answer.
    pub fn admits(&self, addr: IpAddr, user: &str) -> bool {
        let g = self.lock();
        if g.delay.is_zero() {
            return true;
        }
        let now = Instant::now();
        let limit = g.delay.saturating_mul(BURST);
        [Key::Addr(addr), Key::User(Box::from(user))]
            .iter()
            .all(|k| {
                g.next
                    .get(k)
                    .is_none_or(|t| t.saturating_duration_since(now) <= limit)
            })
    }

    /// Records a failed login from `addr` as `user`; returns how long to wait before
    /// answering it (at least `delay`). An attempt refused unchecked (past the burst)
    /// takes no slot: it is answered after `delay`.
    pub fn failed(&self, addr: IpAddr, user: &str, delay: Duration) -> Duration {
        if delay.is_zero() {
            return Duration::ZERO;
        }
        let mut g = self.lock();
        g.delay = delay;
        let now = Instant::now();
        if g.next.len() >= PRUNE_AT {
            g.next.retain(|_, t| *t > now);
        }
        let limit = delay.saturating_mul(BURST);
        let keys = [Key::Addr(addr), Key::User(Box::from(user))];
        let over = keys.iter().any(|k| {
            g.next
                .get(k)
                .is_some_and(|t| t.saturating_duration_since(now) > limit)
        });
        if over {
            // refused unchecked (`admits`): no guess was made, no slot is taken
            return delay;
        }
        let mut hold = Duration::ZERO;
        for k in keys {
            let t = g.next.entry(k).or_insert(now);
            *t = (*t).max(now) + delay;
            hold = hold.max(t.saturating_duration_since(now));
        }
        hold
    }

    /// Keys held (tests, metrics).
    pub fn len(&self) -> usize {
        self.lock().next.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Duration = Duration::from_secs(1);

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn failures_are_answered_one_per_delay_per_address_and_per_user() {
        let t = LoginThrottle::default();
        let a = ip("192.0.2.1");
        // parallel failures from one address: each answered one delay after the last
        let holds: Vec<Duration> = (0..3).map(|i| t.failed(a, &format!("u{i}"), D)).collect();
        assert!(holds[0] <= D && holds[0] > D / 2);
        assert!(holds[1] > D && holds[1] <= 2 * D);
        assert!(holds[2] > 2 * D && holds[2] <= 3 * D);
        // one user from many addresses likewise
        let holds: Vec<Duration> = (0..3)
            .map(|i| t.failed(ip(&format!("198.51.100.{i}")), "alice", D))
            .collect();
        assert!(holds[2] > 2 * D && holds[2] <= 3 * D);
        // a fresh address and user: just the delay
        assert!(t.failed(ip("203.0.113.9"), "bob", D) <= D);
    }

    #[test]
    fn past_the_burst_attempts_are_refused_unchecked() {
        let t = LoginThrottle::default();
        let a = ip("192.0.2.1");
        for i in 0..=BURST {
            assert!(t.admits(a, &format!("u{i}")), "attempt {i}");
            t.failed(a, &format!("u{i}"), D);
        }
        assert!(!t.admits(a, "anyone"), "the address is over its burst");
        let backlog = t.failed(a, "anyone", D);
        assert_eq!(backlog, D, "an unchecked refusal takes no slot");
        assert!(
            t.admits(ip("192.0.2.2"), "someone"),
            "other addresses are not"
        );
        for i in 0..=BURST {
            t.failed(ip(&format!("10.0.0.{i}")), "carol", D);
        }
        assert!(
            !t.admits(ip("10.1.1.1"), "carol"),
            "the user name is over its burst"
        );
        // no delay configured: no throttling
        let t = LoginThrottle::default();
        for _ in 0..100 {
            assert_eq!(t.failed(a, "x", Duration::ZERO), Duration::ZERO);
        }
        assert!(t.admits(a, "x"));
        assert!(t.is_empty());
    }
}

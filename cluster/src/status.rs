//! What a leader knows of its replication group, for `GET /api/cluster`,
//! `triadctl cluster_status` and `/metrics` ([`crate::leader::Leader::status`]), and the
//! samples its lag in seconds is read from.
//!
//! Lag in seconds: how long ago the leader's commitlog end was at or below what a replica
//! acknowledged (Kafka's "time since the follower was last caught up"). The leader keeps
//! a bounded ring of (log end, time) samples ([`EndSamples`]): a sample is taken by each
//! sender's loop (at least every 20 ms while it runs), on every ack and on every status
//! read; a sample whose end equals the newest one only moves that one's time (so an idle
//! leader keeps one sample), and a new end is recorded at most every
//! [`SAMPLE_SPACING`]. For an acknowledged offset `a`, the newest sample whose end is
//! `<= a` tells when the log was last there: the answer is late by at most the spacing.
//! When no sample is that old (a replica further behind than the ring reaches, [`SAMPLES`]
//! × [`SAMPLE_SPACING`] of busy appends), the age of the oldest sample is given: a lower
//! bound. Cost: 16 KiB-odd fixed per leader, O(ring) per status read, nothing on the
//! append path.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The ring's length.
pub const SAMPLES: usize = 1024;
/// The least time between two samples with different ends.
pub const SAMPLE_SPACING: Duration = Duration::from_millis(10);

/// One follower as the leader sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaStatus {
    pub node: String,
    /// The follower's address as the leader saw its connection.
    pub peer: SocketAddr,
    /// Connected now (a follower that disconnected is remembered, out of sync, with its
    /// last acknowledged positions, until it comes back or is forgotten).
    pub connected: bool,
    /// Its durable commitlog end, as last acknowledged.
    pub log_durable: u64,
    /// Its durable metadata-journal position, as last acknowledged.
    pub journal_durable: u64,
    pub in_sync: bool,
    /// The leader's commitlog end minus `log_durable`.
    pub lag_bytes: u64,
    /// How long ago the leader's commitlog end was at or below `log_durable`.
    pub lag_seconds: f64,
}

/// The leader's view of its group.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaderStatus {
    pub node_id: String,
    /// The replication listener's address.
    pub address: SocketAddr,
    pub epoch: u64,
    /// `replication.mode = sync`: confirms wait for `min_insync` replicas.
    pub sync: bool,
    pub min_insync: usize,
    pub replica_lag_max: u64,
    /// The leader's commitlog end and metadata-journal position.
    pub log_end: u64,
    pub journal_pos: u64,
    /// Every commitlog byte below this is on `min_insync` replicas' disks.
    pub replicated: u64,
    /// Set while too few replicas are in sync (in sync mode, confirms are refused).
    pub refusing: Option<String>,
    /// By node id.
    pub replicas: Vec<ReplicaStatus>,
}

impl LeaderStatus {
    /// Replicas in sync, the leader included.
    pub fn in_sync(&self) -> usize {
        1 + self.replicas.iter().filter(|r| r.in_sync).count()
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct EndSamples {
    ring: VecDeque<(u64, Instant)>,
}

impl EndSamples {
    /// A ring that starts with the log's end now.
    pub fn new(end: u64, now: Instant) -> EndSamples {
        let mut ring = VecDeque::with_capacity(SAMPLES);
        ring.push_back((end, now));
        EndSamples { ring }
    }

    /// The log ended at `end` at `now`.
    pub fn record(&mut self, end: u64, now: Instant) {
        match self.ring.back_mut() {
            Some((e, t)) if *e >= end => {
                // unchanged: it was still there now
                *t = (*t).max(now);
                return;
            }
            Some((_, t)) if now.saturating_duration_since(*t) < SAMPLE_SPACING => return,
            _ => {}
        }
        if self.ring.len() >= SAMPLES {
            self.ring.pop_front();
        }
        self.ring.push_back((end, now));
    }

    /// The lag in seconds of a replica that holds everything below `acked`, the log's
    /// end being `end` at `now`.
    pub fn lag_seconds(&self, acked: u64, end: u64, now: Instant) -> f64 {
        if acked >= end {
            return 0.0;
        }
        let at = self
            .ring
            .iter()
            .rev()
            .find(|(e, _)| *e <= acked)
            .or(self.ring.front())
            .map(|(_, t)| *t)
            .unwrap_or(now);
        now.saturating_duration_since(at).as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_is_the_age_of_the_last_time_the_log_was_at_the_acked_offset() {
        let t0 = Instant::now();
        let s = |ms: u64| t0 + Duration::from_millis(ms);
        let mut r = EndSamples::new(100, t0);
        // idle: one sample, its time moving
        r.record(100, s(1000));
        assert_eq!(r.ring.len(), 1);
        r.record(200, s(1000));
        assert_eq!(r.ring.len(), 1, "too soon after the last");
        r.record(200, s(1050));
        r.record(300, s(2000));
        r.record(400, s(3000));
        // caught up
        assert_eq!(r.lag_seconds(400, 400, s(3500)), 0.0);
        // at 300: the log was last at or below 300 at 2 s
        assert_eq!(r.lag_seconds(300, 400, s(3500)), 1.5);
        assert_eq!(r.lag_seconds(350, 400, s(3500)), 1.5);
        // at 150: at or below it last at 1 s (the sample at 100)
        assert_eq!(r.lag_seconds(150, 400, s(3500)), 2.5);
        // below every sample: the oldest's age, a lower bound
        assert_eq!(r.lag_seconds(0, 400, s(3500)), 2.5);
    }

    #[test]
    fn the_ring_is_bounded() {
        let t0 = Instant::now();
        let mut r = EndSamples::new(0, t0);
        for i in 1..(3 * SAMPLES as u64) {
            r.record(i, t0 + SAMPLE_SPACING * i as u32);
        }
        assert_eq!(r.ring.len(), SAMPLES);
        let now = t0 + SAMPLE_SPACING * (3 * SAMPLES as u32);
        // older than the ring: the oldest sample's age
        let oldest = t0 + SAMPLE_SPACING * (2 * SAMPLES as u32);
        let got = r.lag_seconds(5, 3 * SAMPLES as u64, now);
        assert!((got - (now - oldest).as_secs_f64()).abs() < 1e-3, "{got}");
    }
}

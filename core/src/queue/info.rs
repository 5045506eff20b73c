//! What the management API reads of a queue: counts and consumers, each taken under the
//! queue's lock for a moment (never on a message path).

use std::sync::Arc;

use super::{lock, Queue};
use crate::stats::{Counts, RateSample, Values};
use crate::ConnectionId;

/// A queue's counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Ready messages.
    pub ready: u64,
    /// Body bytes of the ready messages.
    pub ready_bytes: u64,
    /// Delivered, not yet acked.
    pub unacked: u64,
    /// Consumers.
    pub consumers: u32,
    /// Whether its publishers are held back (consumers fall behind).
    pub flow: bool,
    /// Messages ever enqueued (its consume-queue's next offset): a counter since the
    /// queue was created, kept by the store, not a rate.
    pub enqueued: u64,
    /// Deliver / get / ack / redeliver counters since the queue was opened.
    pub counts: Counts,
}

/// RabbitMQ's `message_stats` counters, in [`Values`] order.
pub const RATE_NAMES: [&str; 8] = [
    "publish",
    "deliver",
    "deliver_no_ack",
    "get",
    "get_no_ack",
    "redeliver",
    "ack",
    "deliver_get",
];

impl QueueStats {
    /// The counters in [`RATE_NAMES`] order.
    pub fn values(&self) -> Values {
        let c = &self.counts;
        [
            self.enqueued,
            c.deliver,
            c.deliver_no_ack,
            c.get,
            c.get_no_ack,
            c.redeliver,
            c.ack,
            c.deliver + c.deliver_no_ack + c.get + c.get_no_ack,
        ]
    }
}

/// One consumer of a queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerInfo {
    /// Consumer tag.
    pub tag: Arc<str>,
    /// The consuming connection (core id).
    pub conn: ConnectionId,
    /// Deliveries need no ack.
    pub no_ack: bool,
    /// Exclusive consumer.
    pub exclusive: bool,
    /// Unacked deliveries it may hold (0 = unlimited).
    pub prefetch: u32,
    /// Unacked deliveries it holds.
    pub unacked: u32,
    /// `x-priority`.
    pub priority: i32,
}

impl Queue {
    /// The queue's counters (`ready` after expiring what is past its TTL at the head).
    pub fn stats(&self) -> QueueStats {
        let ready = u64::from(self.message_count());
        // a stream: its retained entries, its own consumers and counters
        let (unacked, consumers, stream_counts) = match self.stream() {
            Some(s) => {
                let (deliver, ack) = s.counts();
                let c = Counts {
                    deliver,
                    ack,
                    ..Counts::default()
                };
                (u64::from(s.unacked_count()), s.consumer_count(), Some(c))
            }
            None => (0, 0, None),
        };
        let st = lock(&self.state);
        QueueStats {
            ready,
            ready_bytes: st.ready_bytes,
            unacked: unacked + st.unacked.len() as u64,
            consumers: consumers + st.consumers.len() as u32,
            flow: st.throttled,
            enqueued: st.cq_next,
            counts: stream_counts.unwrap_or(st.counts),
        }
    }

    /// The counters and their per-second rates (RabbitMQ's `message_stats` with
    /// `*_details.rate`): the first call starts sampling, so its rates are 0.
    pub fn stats_with_rates(&self) -> (QueueStats, [f64; 8]) {
        let s = self.stats();
        let now = std::time::Instant::now();
        let mut st = lock(&self.state);
        let rates = match &mut st.rate {
            Some(r) => r.rates(s.values(), now),
            None => {
                st.rate = Some(Box::new(RateSample::new(s.values(), now)));
                [0.0; 8]
            }
        };
        (s, rates)
    }

    /// The queue's consumers.
    pub fn consumers(&self) -> Vec<ConsumerInfo> {
        if let Some(s) = self.stream() {
            return s.consumers();
        }
        lock(&self.state)
            .consumers
            .iter()
            .map(|c| ConsumerInfo {
                tag: Arc::clone(&c.tag),
                conn: c.conn,
                no_ack: c.no_ack,
                exclusive: c.exclusive,
                prefetch: c.prefetch,
                unacked: c.unacked,
                priority: c.priority,
            })
            .collect()
    }
}

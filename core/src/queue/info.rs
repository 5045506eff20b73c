//! What the management API reads of a queue: counts and consumers, each taken under the
//! queue's lock for a moment (never on a message path).

use std::sync::Arc;

use super::{lock, Queue};
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
        let st = lock(&self.state);
        QueueStats {
            ready,
            ready_bytes: st.ready_bytes,
            unacked: st.unacked.len() as u64,
            consumers: st.consumers.len() as u32,
            flow: st.throttled,
            enqueued: st.cq_next,
        }
    }

    /// The queue's consumers.
    pub fn consumers(&self) -> Vec<ConsumerInfo> {
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

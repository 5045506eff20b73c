//! Publisher flow control: a queue whose backlog outgrows its consumers' credit asks
//! its publishers to wait.

use std::sync::Arc;

use super::{lock, After, Queue, State};

/// Publisher flow control (RabbitMQ's credit flow, applied to consumer backlog): once a
/// queue with consumers holds more than this many messages (ready + unacked) beyond its
/// consumers' credit (the sum of their prefetch limits, the in-memory window for a
/// consumer without one), a publish routed to it carries
/// a [`Backpressure`](crate::outbox::Backpressure) that the adapter waits on before
/// acknowledging it or reading more from that publisher. Small on purpose: at 30k
/// deliveries/s per queue, 64 messages are 2 ms of queueing. An MQTT QoS 1 run
/// (`mqtt-qos1-64`, 4 publishers with 100 in flight each) kept its throughput with 64,
/// 128, 256 or 1,024; p99 was 5-11 ms with 64 against 11-22 ms with 128 (alternated),
/// and 19-26, 28-30 and 98-130 ms with 128, 256 and 1,024 in an earlier, busier session.
pub const FLOW_HIGH: u64 = 64;
/// The backlog (beyond the consumers' credit) at which a throttled queue lets its
/// publishers go again.
pub const FLOW_LOW: u64 = FLOW_HIGH / 2;

impl Queue {
    /// Leaves the throttled state once the backlog is at [`FLOW_LOW`] or the queue has
    /// no consumers (or is deleted).
    pub(super) fn flow_check(&self, st: &mut State, after: &mut After) {
        if st.throttled
            && (st.deleted
                || st.consumers.is_empty()
                || st.ready_count + st.unacked.len() as u64 <= FLOW_LOW + st.credit)
        {
            st.throttled = false;
            after.flow_clear = st.flow.is_some();
        }
    }

    /// What a consumer may hold unacked, for flow control: its prefetch, or the
    /// in-memory window when it has no limit (it acks in its own time, e.g. in batches).
    pub(super) fn credit_of(&self, prefetch: u32) -> u64 {
        if prefetch == 0 {
            self.window as u64
        } else {
            u64::from(prefetch)
        }
    }

    /// Whether publishers may go on (the queue is not throttled).
    pub(crate) fn flow_clear(&self) -> bool {
        !lock(&self.state).throttled
    }

    pub(super) fn wake_flow(&self) {
        let flow = lock(&self.state).flow.clone();
        if let Some(n) = flow {
            n.notify_waiters();
        }
    }

    /// Completes once the queue no longer throttles its publishers (cancel-safe).
    pub(crate) async fn wait_flow(&self) {
        let flow = lock(&self.state)
            .flow
            .get_or_insert_with(|| Arc::new(tokio::sync::Notify::new()))
            .clone();
        loop {
            let mut n = std::pin::pin!(flow.notified());
            n.as_mut().enable();
            if self.flow_clear() {
                return;
            }
            n.await;
        }
    }
}

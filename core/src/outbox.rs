//! Where queues hand deliveries to a connection, and how the connection pushes back.
//!
//! A connection owns one [`Outbox`]. Queues push [`OutEvent`]s into it under their own
//! lock (a short push, never a wait); the connection task wakes on [`Outbox::notified`],
//! drains a batch, encodes it and writes it. The outbox is bounded: a queue that finds it
//! full stops delivering to that consumer and registers itself; when the connection has
//! drained below half, it wakes the registered queues, which resume. So a peer that does
//! not read its socket stops its deliveries instead of growing the broker's memory.
//!
//! The other direction, publisher flow control: a publish routed to a queue whose
//! consumers fall behind (see [`FLOW_HIGH`](crate::queue::FLOW_HIGH)) comes back with a
//! [`Backpressure`]; the publishing connection holds its acks (or stops reading) until
//! it clears, so a fast publisher cannot run arbitrarily far ahead of its consumers.
//!
//! A [`CreditGate`] is a channel-wide unacked limit (AMQP `basic.qos` with
//! `global = true`) shared by all consumers of a channel, with the same wake-up scheme.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use bytes::Bytes;

use crate::message::Properties;
use crate::queue::Queue;

/// One message handed to a consumer (or returned by `get`).
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The consumer's tag; empty for `get`.
    pub tag: Arc<str>,
    /// The queue to ack or nack on.
    pub queue: Arc<Queue>,
    /// The message's offset in the queue: the handle for ack / nack.
    pub offset: u64,
    /// Whether it may have been delivered before.
    pub redelivered: bool,
    /// Exchange it was published to.
    pub exchange: Arc<str>,
    /// Routing key it was published with.
    pub routing_key: Arc<str>,
    /// Its properties (shared by every copy of a message delivered as it is published).
    pub properties: Arc<Properties>,
    /// Its body (shares the store's mapping).
    pub body: Bytes,
    /// For `get`: messages left in the queue after this one.
    pub message_count: u32,
    /// Whether the consumer must ack it (false for no-ack consumers and no-ack gets).
    pub needs_ack: bool,
}

/// What a connection receives from queues.
// Deliveries are nearly every event; boxing them would cost an allocation each.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum OutEvent {
    /// A message for one of the connection's consumers.
    Deliver(Delivery),
    /// A direct reply-to reply for the connection's reply consumer
    /// ([`crate::direct_reply`]); only AMQP connections register one.
    Reply(crate::direct_reply::DirectReply),
    /// The server cancelled a consumer (its queue was deleted).
    Cancelled {
        /// The cancelled consumer's tag.
        tag: Arc<str>,
    },
}

#[derive(Default)]
struct Inner {
    events: VecDeque<OutEvent>,
    waiters: Vec<Weak<Queue>>,
    closed: bool,
}

/// A connection's bounded inbox of deliveries.
pub struct Outbox {
    inner: Mutex<Inner>,
    notify: tokio::sync::Notify,
    capacity: usize,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox").field("len", &self.len()).finish()
    }
}

impl Outbox {
    /// An outbox holding at most `capacity` deliveries (at least 1).
    pub fn new(capacity: usize) -> Arc<Outbox> {
        Arc::new(Outbox {
            inner: Mutex::new(Inner::default()),
            notify: tokio::sync::Notify::new(),
            capacity: capacity.max(1),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Events waiting.
    pub fn len(&self) -> usize {
        self.lock().events.len()
    }

    /// Whether nothing is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a delivery would fit now.
    pub(crate) fn has_room(&self) -> bool {
        let g = self.lock();
        !g.closed && g.events.len() < self.capacity
    }

    /// Adds a delivery if there is room; `false` means full (or closed): the caller
    /// should `wait_for_room`.
    pub(crate) fn push(&self, ev: OutEvent) -> bool {
        let mut g = self.lock();
        if g.closed || g.events.len() >= self.capacity {
            return false;
        }
        g.events.push_back(ev);
        drop(g);
        self.notify.notify_one();
        true
    }

    /// Adds a control event regardless of capacity (cancel notifications are few).
    pub(crate) fn push_control(&self, ev: OutEvent) {
        let mut g = self.lock();
        if g.closed {
            return;
        }
        g.events.push_back(ev);
        drop(g);
        self.notify.notify_one();
    }

    /// Registers `queue` to be kicked once the connection has drained.
    pub(crate) fn wait_for_room(&self, queue: &Arc<Queue>) {
        let mut g = self.lock();
        if !g
            .waiters
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(queue)))
        {
            g.waiters.push(Arc::downgrade(queue));
        }
    }

    /// Moves up to `max` events into `out`; wakes queues that were waiting for room once
    /// less than half the capacity is in use.
    pub fn drain(&self, out: &mut Vec<OutEvent>, max: usize) {
        let mut g = self.lock();
        let n = max.min(g.events.len());
        out.extend(g.events.drain(..n));
        let wake = if g.events.len() <= self.capacity / 2 {
            std::mem::take(&mut g.waiters)
        } else {
            Vec::new()
        };
        drop(g);
        for q in wake.into_iter().filter_map(|w| w.upgrade()) {
            q.kick();
        }
    }

    /// Completes when events may be waiting (cancel-safe; a wake-up is never lost).
    pub async fn notified(&self) {
        self.notify.notified().await
    }

    /// Stops accepting deliveries (the connection is closing); drops what is queued.
    pub fn close(&self) -> Vec<OutEvent> {
        let mut g = self.lock();
        g.closed = true;
        g.waiters.clear();
        g.events.drain(..).collect()
    }
}

/// A channel-wide limit of unacked deliveries, shared by the channel's consumers.
#[derive(Debug)]
pub struct CreditGate {
    limit: AtomicU32,
    used: AtomicU32,
    waiters: Mutex<Vec<Weak<Queue>>>,
}

impl CreditGate {
    /// A gate allowing `limit` unacked deliveries (0 = unlimited).
    pub fn new(limit: u32) -> Arc<CreditGate> {
        Arc::new(CreditGate {
            limit: AtomicU32::new(limit),
            used: AtomicU32::new(0),
            waiters: Mutex::new(Vec::new()),
        })
    }

    /// Changes the limit (a new `basic.qos`); raising it wakes waiting queues.
    pub fn set_limit(&self, limit: u32) {
        self.limit.store(limit, Ordering::Release);
        self.wake();
    }

    /// Current limit (0 = unlimited).
    pub fn limit(&self) -> u32 {
        self.limit.load(Ordering::Acquire)
    }

    /// Unacked deliveries counted against the gate.
    pub fn used(&self) -> u32 {
        self.used.load(Ordering::Acquire)
    }

    pub(crate) fn has_room(&self) -> bool {
        let l = self.limit();
        l == 0 || self.used() < l
    }

    pub(crate) fn take(&self) {
        self.used.fetch_add(1, Ordering::AcqRel);
    }

    /// Returns `n` credits; the caller must call `wake` afterwards, outside any queue lock.
    pub(crate) fn release(&self, n: u32) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                Some(u.saturating_sub(n))
            });
    }

    pub(crate) fn wait_for_room(&self, queue: &Arc<Queue>) {
        let mut g = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        if !g
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(queue)))
        {
            g.push(Arc::downgrade(queue));
        }
    }

    /// Kicks the queues that were waiting for credit.
    pub(crate) fn wake(&self) {
        if !self.has_room() {
            return;
        }
        let ws = std::mem::take(&mut *self.waiters.lock().unwrap_or_else(|e| e.into_inner()));
        for q in ws.into_iter().filter_map(|w| w.upgrade()) {
            q.kick();
        }
    }
}

/// The throttled queues a publish went to: wait for [`Backpressure::wait`] (or check
/// [`Backpressure::is_clear`]) before acknowledging the publish or reading more from its
/// publisher. Adapters should bound the wait (a consumer that never acks would otherwise
/// stop its publishers for good).
#[derive(Debug, Clone)]
pub struct Backpressure {
    queues: Vec<Arc<Queue>>,
}

impl Backpressure {
    pub(crate) fn new(queues: Vec<Arc<Queue>>) -> Backpressure {
        Backpressure { queues }
    }

    /// Whether every queue has drained back below its low-water mark.
    pub fn is_clear(&self) -> bool {
        self.queues.iter().all(|q| q.flow_clear())
    }

    /// Completes once [`Backpressure::is_clear`] (cancel-safe).
    pub async fn wait(&self) {
        for q in &self.queues {
            q.wait_flow().await;
        }
    }
}

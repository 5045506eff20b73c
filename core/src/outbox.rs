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
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

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
    /// Where the connection stands with the idle sweep: [`QUIET`], [`LISTED`] or
    /// [`ASKED`] (see [`Outbox::note_idle`]).
    sweep: AtomicU8,
}

/// Nothing to let go, or not known yet: not in the sweep's list.
const QUIET: u8 = 0;
/// In the sweep's list, since the connection went idle after some traffic.
const LISTED: u8 = 1;
/// The sweep asked the connection to let go of what it keeps for traffic.
const ASKED: u8 = 2;
/// How often the sweep asks: a connection lets go of its traffic's memory between one
/// and two periods after it went quiet, and a busy one about once per period.
const SWEEP_PERIOD: Duration = Duration::from_secs(1);

/// The outboxes of connections that went idle since the last sweep.
static SWEEP: Mutex<Vec<Weak<Outbox>>> = Mutex::new(Vec::new());
static SWEEPER: OnceLock<()> = OnceLock::new();

/// The sweep: once per [`SWEEP_PERIOD`], asks each connection listed since the last one
/// to let go of its traffic's memory, through its outbox's wake-up. One thread for the
/// process, started by the first connection that goes idle.
fn start_sweeper() {
    SWEEPER.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("triad-idle-sweep".into())
            .spawn(|| loop {
                std::thread::sleep(SWEEP_PERIOD);
                let listed = std::mem::take(&mut *SWEEP.lock().unwrap_or_else(|e| e.into_inner()));
                for o in listed.iter().filter_map(Weak::upgrade) {
                    if o.sweep
                        .compare_exchange(LISTED, ASKED, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        o.notify.notify_one();
                    }
                }
            });
        if let Err(e) = spawned {
            // connections then keep what their traffic left, as they did before the sweep
            tracing::warn!(error = %e, "could not start the idle sweep thread");
        }
    });
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
            sweep: AtomicU8::new(QUIET),
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

    /// The connection has gone idle (nothing more to write): it is listed for the next
    /// sweep, which wakes it through [`Outbox::notified`] with
    /// [`Outbox::take_release_request`] true, between one and two [`SWEEP_PERIOD`]s
    /// later. Per message this costs one atomic load: a connection is listed once per
    /// period at most.
    pub fn note_idle(self: &Arc<Self>) {
        if self.sweep.load(Ordering::Acquire) != QUIET
            || self
                .sweep
                .compare_exchange(QUIET, LISTED, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return;
        }
        start_sweeper();
        SWEEP
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::downgrade(self));
    }

    /// Whether the sweep asked this connection to let go of its traffic's memory (and
    /// takes the request: the next [`Outbox::note_idle`] lists it again).
    pub fn take_release_request(&self) -> bool {
        self.sweep.load(Ordering::Acquire) == ASKED
            && self
                .sweep
                .compare_exchange(ASKED, QUIET, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// Lets go of the event queue's memory if nothing is waiting (the connection is
    /// idle): one delivery leaves room for four behind, about 0.5 KiB that an idle
    /// connection would otherwise keep.
    pub fn release_idle(&self) {
        let mut g = self.lock();
        if g.events.is_empty() && g.events.capacity() > 0 {
            g.events = VecDeque::new();
        }
        if g.waiters.is_empty() && g.waiters.capacity() > 0 {
            g.waiters = Vec::new();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An outbox noted idle is asked, by the sweep, within two periods, through its
    /// wake-up; taking the request lets the next `note_idle` list it again.
    #[tokio::test]
    async fn the_sweep_asks_an_idle_connection_to_let_go() {
        let o = Outbox::new(4);
        assert!(!o.take_release_request(), "not before it went idle");
        o.note_idle();
        o.note_idle(); // listed once
        tokio::time::timeout(SWEEP_PERIOD * 3, o.notified())
            .await
            .expect("the sweep wakes the connection");
        assert!(o.take_release_request());
        assert!(!o.take_release_request(), "taken once");
        o.note_idle();
        tokio::time::timeout(SWEEP_PERIOD * 3, o.notified())
            .await
            .expect("listed again after a request was taken");
        assert!(o.take_release_request());
    }

    #[test]
    fn release_idle_lets_go_of_an_empty_queue_only() {
        let o = Outbox::new(4);
        o.push_control(OutEvent::Cancelled { tag: "a".into() });
        o.push_control(OutEvent::Cancelled { tag: "b".into() });
        let mut got = Vec::new();
        o.drain(&mut got, 1);
        o.release_idle();
        assert!(o.lock().events.capacity() > 0, "one event still waits");
        o.drain(&mut got, 1);
        o.release_idle();
        assert_eq!(o.lock().events.capacity(), 0);
    }
}

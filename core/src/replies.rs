//! [`ReplyQueue`]: a connection's one ordered queue of replies that wait — a publisher
//! confirm, a STOMP RECEIPT, a `tx.commit-ok`, an MQTT PUBACK — each leaving once the
//! durability it depends on is reached ([`Durability`]: the message or metadata record
//! is on disk) and, for a publish to a throttled queue, once its
//! [`Backpressure`] clears or [`FLOW_MAX_WAIT`] passes.
//!
//! Replies leave strictly in the order they were pushed (a protocol answers in order),
//! so only the front entry is ever waited on; the store completes durability in append
//! order, so that costs nothing. A *hold* ([`ReplyQueue::hold`]) is an entry with
//! nothing to send: a throttled publish that needs no reply (AMQP without confirms,
//! STOMP without a receipt, MQTT QoS 0) still holds what follows it, and a driver
//! stops reading its socket while [`MAX_HOLDS`] holds wait.
//!
//! Cost: an entry is the reply plus one [`Durability`] (two words) inline; more
//! durabilities (a transaction's messages) and the flow wait (a timer, made only for a
//! throttled publish) are allocated only when present. An idle queue holds nothing.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::durability::Durability;
use crate::error::CoreError;
use crate::outbox::Backpressure;

/// Longest a publish is held back by a throttled queue. Bounded so that a consumer that
/// never acks (or a cycle of clients that publish to each other) slows its publishers
/// down to their in-flight window per this period instead of stopping them.
pub const FLOW_MAX_WAIT: Duration = Duration::from_secs(1);

/// Holds waiting before a driver stops reading the connection's socket.
pub const MAX_HOLDS: usize = 1024;

/// A bounded wait for a throttled queue: [`flow_wait`].
pub type FlowWait = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Completes once `b` is clear or [`FLOW_MAX_WAIT`] has passed since this call (not
/// since its first poll: holds queued behind each other expire together).
pub fn flow_wait(b: Backpressure) -> FlowWait {
    let until = tokio::time::Instant::now() + FLOW_MAX_WAIT;
    Box::pin(async move {
        let deadline = tokio::time::sleep_until(until);
        let clear = b.wait();
        let mut deadline = std::pin::pin!(deadline);
        let mut clear = std::pin::pin!(clear);
        std::future::poll_fn(|cx| {
            if clear.as_mut().poll(cx).is_ready() || deadline.as_mut().poll(cx).is_ready() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    })
}

struct Entry<T> {
    /// `None`: a hold.
    reply: Option<T>,
    durable: Option<Durability>,
    /// Further durabilities (a transaction's messages, an MQTT SUBACK's records).
    more: Vec<Durability>,
    flow: Option<FlowWait>,
    /// A durability failed: the reply leaves with the error.
    failed: Option<CoreError>,
}

impl<T> Entry<T> {
    /// Whether everything it waits for is done (registers `cx` otherwise).
    fn poll_done(&mut self, cx: &mut Context<'_>) -> bool {
        for d in self.durable.iter_mut().chain(self.more.iter_mut()) {
            match Pin::new(&mut *d).poll(cx) {
                Poll::Pending => return false,
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => {
                    self.failed.get_or_insert(e);
                }
            }
        }
        // done durabilities are not polled again
        self.durable = None;
        self.more = Vec::new();
        if let Some(f) = self.flow.as_mut() {
            if f.as_mut().poll(cx).is_pending() {
                return false;
            }
        }
        self.flow = None;
        true
    }
}

/// See the module's documentation.
pub struct ReplyQueue<T> {
    entries: VecDeque<Entry<T>>,
    /// Holds among `entries`.
    holds: usize,
}

impl<T> Default for ReplyQueue<T> {
    fn default() -> Self {
        ReplyQueue {
            entries: VecDeque::new(),
            holds: 0,
        }
    }
}

impl<T> std::fmt::Debug for ReplyQueue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplyQueue")
            .field("len", &self.entries.len())
            .field("holds", &self.holds)
            .finish()
    }
}

impl<T> ReplyQueue<T> {
    /// Queues `reply`, to leave once every one of `durable` is reached and `flow` (a
    /// throttled publish's [`Backpressure`]) clears or [`FLOW_MAX_WAIT`] passes.
    pub fn push(
        &mut self,
        reply: T,
        durable: impl IntoIterator<Item = Durability>,
        flow: Option<Backpressure>,
    ) {
        self.push_entry(Some(reply), durable, flow);
    }

    /// Holds the replies behind it until `flow` clears or [`FLOW_MAX_WAIT`] passes,
    /// sending nothing itself.
    pub fn hold(&mut self, flow: Backpressure) {
        self.holds += 1;
        self.push_entry(None, None, Some(flow));
    }

    fn push_entry(
        &mut self,
        reply: Option<T>,
        durable: impl IntoIterator<Item = Durability>,
        flow: Option<Backpressure>,
    ) {
        let mut it = durable.into_iter().filter(|d| !d.is_durable());
        let first = it.next();
        let more = it.collect();
        self.entries.push_back(Entry {
            reply,
            durable: first,
            more,
            flow: flow.map(flow_wait),
            failed: None,
        });
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Lets go of the queue's memory if nothing waits (the connection is going idle).
    pub fn release_idle(&mut self) {
        if self.entries.is_empty() && self.entries.capacity() > 0 {
            self.entries = VecDeque::new();
        }
    }

    /// Entries waiting (holds included).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Holds waiting (a driver stops reading at [`MAX_HOLDS`]).
    pub fn holds(&self) -> usize {
        self.holds
    }

    /// Whether the socket should be read no more for now ([`MAX_HOLDS`]).
    pub fn is_holding(&self) -> bool {
        self.holds >= MAX_HOLDS
    }

    /// Drops the entries whose reply `keep` refuses (holds stay).
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        self.entries
            .retain(|e| e.reply.as_ref().is_none_or(&mut keep));
    }

    /// Moves every finished entry at the front into `out`, in order, with its result
    /// (`Err`: a durability failed, the message may be lost). Returns whether any
    /// entry left (a hold leaves nothing in `out`). With `cx`, the front entry that is
    /// not finished wakes it.
    pub fn take_ready(
        &mut self,
        out: &mut Vec<(T, Result<(), CoreError>)>,
        cx: Option<&mut Context<'_>>,
    ) -> bool {
        let mut fallback = Context::from_waker(std::task::Waker::noop());
        let cx = match cx {
            Some(cx) => cx,
            None => &mut fallback,
        };
        let mut left = false;
        while let Some(front) = self.entries.front_mut() {
            if !front.poll_done(cx) {
                break;
            }
            left = true;
            let Some(e) = self.entries.pop_front() else {
                break;
            };
            match e.reply {
                Some(r) => out.push((r, e.failed.map_or(Ok(()), Err))),
                None => self.holds = self.holds.saturating_sub(1),
            }
        }
        left
    }

    /// Completes once at least one entry has left (cancel-safe: entries stay queued
    /// until they leave); pending forever while empty.
    pub async fn ready(&mut self) -> Vec<(T, Result<(), CoreError>)> {
        std::future::poll_fn(|cx| {
            let mut out = Vec::new();
            if self.take_ready(&mut out, Some(cx)) {
                Poll::Ready(out)
            } else {
                Poll::Pending
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_leave_in_order_and_holds_leave_nothing() {
        let mut q: ReplyQueue<u32> = ReplyQueue::default();
        assert!(q.is_empty());
        q.push(1, None, None);
        q.push(2, [Durability::ready(), Durability::ready()], None);
        let mut out = Vec::new();
        assert!(q.take_ready(&mut out, None));
        assert_eq!(
            out.iter()
                .map(|(r, ok)| (*r, ok.is_ok()))
                .collect::<Vec<_>>(),
            vec![(1, true), (2, true)]
        );
        assert!(q.is_empty());
        assert!(!q.take_ready(&mut out, None), "nothing left");
    }

    /// A throttled queue's backpressure (a consumer with prefetch 1 that never acks,
    /// a publisher on another connection).
    fn throttled() -> (tempfile::TempDir, crate::ConsumerHandle, Backpressure) {
        let dir = tempfile::tempdir().unwrap();
        let mut sc = triad_store::store::StoreConfig::new(dir.path());
        sc.segment_size = 1 << 20;
        let store = std::sync::Arc::new(triad_store::store::Store::open(sc).unwrap());
        let b = crate::Broker::open(store, crate::CoreConfig::default()).unwrap();
        let v = b.vhost("/").unwrap();
        v.declare_queue(crate::QueueDeclare {
            name: "q".into(),
            ..Default::default()
        })
        .unwrap();
        let c = v
            .consume(
                "q",
                crate::ConsumeRequest {
                    tag: "c".into(),
                    no_ack: false,
                    exclusive: false,
                    prefetch: 1,
                    priority: 0,
                    conn: 1,
                    outbox: crate::Outbox::new(16),
                    gate: None,
                    filter: None,
                },
            )
            .unwrap();
        for _ in 0..crate::queue::FLOW_HIGH * 2 {
            let p = v
                .publish(crate::Publish {
                    routing_key: "q".into(),
                    conn: 2,
                    ..Default::default()
                })
                .unwrap();
            if let Some(bp) = p.backpressure {
                return (dir, c, bp);
            }
        }
        panic!("the queue never throttled");
    }

    #[tokio::test(start_paused = true)]
    async fn a_hold_waits_for_its_queue_at_most_flow_max_wait() {
        let (_dir, consumer, bp) = throttled();
        let mut q: ReplyQueue<u32> = ReplyQueue::default();
        q.hold(bp.clone());
        q.push(7, None, None);
        assert_eq!((q.holds(), q.len()), (1, 2));
        let mut out = Vec::new();
        assert!(!q.take_ready(&mut out, None), "held by the throttled queue");
        assert!(out.is_empty(), "the reply behind the hold waits too");
        tokio::time::sleep(FLOW_MAX_WAIT / 2).await;
        // a second hold, queued later, expires with it when its own time is up
        q.hold(bp.clone());
        q.push(8, None, None);
        assert!(!q.take_ready(&mut out, None));
        // the consumer never acks: the hold lets go after FLOW_MAX_WAIT
        let ready = tokio::time::timeout(FLOW_MAX_WAIT, q.ready())
            .await
            .unwrap();
        assert_eq!(
            ready.into_iter().map(|(r, _)| r).collect::<Vec<_>>(),
            vec![7]
        );
        let start = tokio::time::Instant::now();
        let ready = tokio::time::timeout(FLOW_MAX_WAIT, q.ready())
            .await
            .unwrap();
        assert_eq!(
            ready.into_iter().map(|(r, _)| r).collect::<Vec<_>>(),
            vec![8]
        );
        assert!(
            start.elapsed() <= FLOW_MAX_WAIT / 2,
            "its deadline ran from when it was queued"
        );
        assert_eq!((q.holds(), q.len()), (0, 0));
        // a queue that clears lets its holds go at once
        q.hold(bp.clone());
        consumer.cancel();
        assert!(bp.is_clear(), "a queue without consumers holds nobody");
        assert!(q.take_ready(&mut out, None));
        assert_eq!(q.holds(), 0);
    }
}

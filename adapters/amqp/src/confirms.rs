//! Publisher confirms waiting for the store.
//!
//! Every publish on a channel in confirm mode gets a sequence number and an entry in
//! one connection-wide FIFO: either already settled (transient message, or a nack) or
//! waiting on the core's durability future ([`Durable`]) (persistent message in a durable queue). Entries
//! leave the FIFO strictly in order, so confirms on each channel go out in increasing
//! delivery-tag order and a run of acks can be sent as one `basic.ack multiple=true`.
//! The store completes group commits in offset order, so waiting on the front entry
//! costs nothing.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// The core's durability future, boxed so this crate need not name the store's type
/// (adapters do not depend on the store). `true` = flushed.
pub type Durable = Pin<Box<dyn Future<Output = bool> + Send>>;

/// One confirm as it leaves the FIFO.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// Channel.
    pub channel: u16,
    /// Publish sequence number (the confirm's delivery tag).
    pub seq: u64,
    /// `true` → basic.ack, `false` → basic.nack.
    pub ack: bool,
}

struct Entry {
    settled: Settled,
    durable: Option<Durable>,
}

/// The FIFO.
#[derive(Default)]
pub struct ConfirmQueue {
    entries: VecDeque<Entry>,
}

impl std::fmt::Debug for ConfirmQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfirmQueue")
            .field("len", &self.entries.len())
            .finish()
    }
}

impl ConfirmQueue {
    /// Adds a confirm; `durable` delays it until the store has flushed.
    pub fn push(&mut self, channel: u16, seq: u64, ack: bool, durable: Option<Durable>) {
        self.entries.push_back(Entry {
            settled: Settled { channel, seq, ack },
            durable,
        });
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops every pending confirm of `channel` (it closed).
    pub fn forget_channel(&mut self, channel: u16) {
        self.entries.retain(|e| e.settled.channel != channel);
    }

    /// Moves every settled entry at the front into `out`, without waiting.
    pub fn take_ready(&mut self, out: &mut Vec<Settled>, cx: Option<&mut Context<'_>>) {
        let noop = std::task::Waker::noop();
        let mut fallback = Context::from_waker(noop);
        let cx = match cx {
            Some(cx) => cx,
            None => &mut fallback,
        };
        while let Some(front) = self.entries.front_mut() {
            let ok = match front.durable.as_mut() {
                None => true,
                Some(d) => match d.as_mut().poll(cx) {
                    Poll::Ready(ok) => ok,
                    Poll::Pending => break,
                },
            };
            let mut s = front.settled;
            // A store failure turns the ack into a nack (the message may be lost).
            s.ack &= ok;
            out.push(s);
            self.entries.pop_front();
        }
    }

    /// Completes when at least one entry has settled (cancel-safe: entries stay in the
    /// queue until taken).
    pub async fn ready(&mut self) -> Vec<Settled> {
        std::future::poll_fn(|cx| {
            let mut out = Vec::new();
            self.take_ready(&mut out, Some(cx));
            if out.is_empty() {
                Poll::Pending
            } else {
                Poll::Ready(out)
            }
        })
        .await
    }
}

//! Publisher confirms waiting for the store.
//!
//! Every publish on a channel in confirm mode gets a sequence number and an entry in
//! one connection-wide FIFO: either already settled (transient message, or a nack) or
//! waiting on the core's durability future ([`Durable`]) (persistent message in a durable queue). Entries
//! leave the FIFO strictly in order, so confirms on each channel go out in increasing
//! delivery-tag order and a run of acks can be sent as one `basic.ack multiple=true`.
//! The store completes group commits in offset order, so waiting on the front entry
//! costs nothing.
//!
//! A `tx.commit-ok` waits in the same FIFO ([`ConfirmQueue::push_commit`]) on every
//! persistent message of its transaction, so it too is sent only once they are on disk.
//!
//! Publisher flow control: a publish that went to a queue whose consumers fall behind
//! (the core's `Published::backpressure`) holds its confirm until the backlog drains or
//! [`FLOW_MAX_WAIT`] passes ([`flow_wait`]); without confirms it leaves a silent entry
//! ([`ConfirmQueue::push_hold`]) that holds the confirms behind it the same way. The
//! driver stops reading the socket while [`MAX_HOLDS`] silent entries wait, so a
//! publisher without confirms is held too (as MQTT's QoS 0 publishers are).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use triad_core::Backpressure;

/// Longest a publish is held back by a throttled queue. Bounded so that a consumer
/// that never acks (or a cycle of clients that publish to each other) slows its
/// publishers down instead of stopping them.
pub const FLOW_MAX_WAIT: Duration = Duration::from_secs(1);

/// Silent flow-control entries waiting before the socket is no longer read.
pub const MAX_HOLDS: usize = 1024;

/// Completes (`true`) once `b` is clear or [`FLOW_MAX_WAIT`] has passed. Boxed: made
/// only for a publish that was throttled.
pub fn flow_wait(b: Backpressure) -> Durable {
    Box::pin(async move {
        tokio::select! {
            _ = b.wait() => {}
            _ = tokio::time::sleep(FLOW_MAX_WAIT) => {}
        }
        true
    })
}

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
    /// `true` → basic.ack, `false` → basic.nack; for a commit: its messages are durable.
    pub ack: bool,
    /// A `tx.commit` (`seq` unused): `ack` → `tx.commit-ok`, otherwise the store failed.
    pub commit: bool,
}

struct Entry {
    settled: Settled,
    durable: Option<Durable>,
    /// A flow-control hold: nothing to send when it completes.
    silent: bool,
}

/// The FIFO.
#[derive(Default)]
pub struct ConfirmQueue {
    entries: VecDeque<Entry>,
    /// Silent entries in `entries`.
    holds: usize,
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
            settled: Settled {
                channel,
                seq,
                ack,
                commit: false,
            },
            durable,
            silent: false,
        });
    }

    /// Holds the confirms behind it until `wait` completes ([`flow_wait`]), sending
    /// nothing itself: a throttled publish on a channel without confirms.
    pub fn push_hold(&mut self, channel: u16, wait: Durable) {
        self.holds += 1;
        self.entries.push_back(Entry {
            settled: Settled {
                channel,
                seq: 0,
                ack: true,
                commit: false,
            },
            durable: Some(wait),
            silent: true,
        });
    }

    /// Flow-control holds waiting (the driver stops reading at [`MAX_HOLDS`]).
    pub fn holds(&self) -> usize {
        self.holds
    }

    /// Adds a `tx.commit-ok` that waits for every one of `durable` (the transaction's
    /// persistent messages in durable queues).
    pub fn push_commit(&mut self, channel: u16, durable: Vec<Durable>) {
        let durable: Option<Durable> = (!durable.is_empty()).then(|| {
            Box::pin(async move {
                let mut ok = true;
                for d in durable {
                    ok &= d.await;
                }
                ok
            }) as Durable
        });
        self.entries.push_back(Entry {
            settled: Settled {
                channel,
                seq: 0,
                ack: true,
                commit: true,
            },
            durable,
            silent: false,
        });
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops every pending confirm of `channel` (it closed).
    pub fn forget_channel(&mut self, channel: u16) {
        self.entries.retain(|e| e.settled.channel != channel);
        self.holds = self.entries.iter().filter(|e| e.silent).count();
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
            if front.silent {
                self.holds -= 1;
            } else {
                out.push(s);
            }
            self.entries.pop_front();
        }
    }

    /// Completes when at least one entry has settled (cancel-safe: entries stay in the
    /// queue until taken).
    pub async fn ready(&mut self) -> Vec<Settled> {
        std::future::poll_fn(|cx| {
            let mut out = Vec::new();
            let before = self.entries.len();
            self.take_ready(&mut out, Some(cx));
            // silent entries leave nothing in `out`, but the driver must look again
            // (it may read the socket again)
            if self.entries.len() == before {
                Poll::Pending
            } else {
                Poll::Ready(out)
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_waits_for_every_durable_of_its_transaction() {
        let (tx1, rx1) = tokio::sync::oneshot::channel::<()>();
        let (tx2, rx2) = tokio::sync::oneshot::channel::<()>();
        let mut q = ConfirmQueue::default();
        q.push_commit(
            1,
            vec![
                Box::pin(async move { rx1.await.is_ok() }),
                Box::pin(async move { rx2.await.is_ok() }),
            ],
        );
        let mut out = Vec::new();
        q.take_ready(&mut out, None);
        assert!(out.is_empty());
        tx2.send(()).unwrap();
        q.take_ready(&mut out, None);
        assert!(
            out.is_empty(),
            "one message of the commit is not durable yet"
        );
        tx1.send(()).unwrap();
        q.take_ready(&mut out, None);
        assert_eq!(
            out,
            vec![Settled {
                channel: 1,
                seq: 0,
                ack: true,
                commit: true
            }]
        );
    }
}

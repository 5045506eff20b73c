//! Publisher confirms waiting for the store.
//!
//! Every publish on a channel in confirm mode gets a sequence number and an entry in
//! one connection-wide FIFO, the core's [`ReplyQueue`]: either already settled
//! (transient message, or a nack) or waiting on the core's [`Durability`] (persistent
//! message in a durable queue). Entries
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
//! `FLOW_MAX_WAIT` passes; without confirms it leaves a hold
//! ([`ConfirmQueue::push_hold`]) that holds the confirms behind it the same way. The
//! driver stops reading the socket while `MAX_HOLDS` holds wait
//! ([`ConfirmQueue::is_holding`]), so a publisher without confirms is held too (as
//! MQTT's QoS 0 publishers are).

use std::future::Future;
use std::pin::Pin;
use std::task::Context;

use triad_core::{Backpressure, CoreError, Durability, ReplyQueue};

/// A wait given as a plain future (`true` = flushed), for `tx.commit-ok`.
pub type CommitWait = Pin<Box<dyn Future<Output = bool> + Send>>;

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

/// The FIFO.
#[derive(Debug, Default)]
pub struct ConfirmQueue {
    replies: ReplyQueue<Settled>,
}

impl ConfirmQueue {
    /// Adds a confirm; `durable` delays it until the store has flushed, `flow` (a
    /// throttled queue) until it drains or `FLOW_MAX_WAIT` passes.
    pub fn push(
        &mut self,
        channel: u16,
        seq: u64,
        ack: bool,
        durable: Option<Durability>,
        flow: Option<Backpressure>,
    ) {
        let s = Settled {
            channel,
            seq,
            ack,
            commit: false,
        };
        self.replies.push(s, durable, flow);
    }

    /// Holds the confirms behind it until `flow` clears (a throttled publish on a
    /// channel without confirms); sends nothing itself.
    pub fn push_hold(&mut self, flow: Backpressure) {
        self.replies.hold(flow);
    }

    /// Adds a `tx.commit-ok` that waits for every one of `durable` (the transaction's
    /// persistent messages in durable queues).
    pub fn push_commit(&mut self, channel: u16, durable: Vec<CommitWait>) {
        let s = Settled {
            channel,
            seq: 0,
            ack: true,
            commit: true,
        };
        let joined = (!durable.is_empty()).then(|| {
            Durability::from_future(async move {
                let mut ok = true;
                for d in durable {
                    ok &= d.await;
                }
                if ok {
                    Ok(())
                } else {
                    Err(CoreError::Internal("a message was not stored".into()))
                }
            })
        });
        self.replies.push(s, joined, None);
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.replies.is_empty()
    }

    /// Whether so many throttled publishes wait that the socket is read no more.
    pub fn is_holding(&self) -> bool {
        self.replies.is_holding()
    }

    /// The reply queue itself (the core's connection driver waits on it).
    pub fn queue(&mut self) -> &mut ReplyQueue<Settled> {
        &mut self.replies
    }

    /// Drops every pending confirm of `channel` (it closed).
    pub fn forget_channel(&mut self, channel: u16) {
        self.replies.retain(|s| s.channel != channel);
    }

    /// Moves every settled entry at the front into `out`, without waiting; whether
    /// any entry left (a hold leaves nothing in `out`).
    pub fn take_ready(&mut self, out: &mut Vec<Settled>, cx: Option<&mut Context<'_>>) -> bool {
        let mut done = Vec::new();
        let left = self.replies.take_ready(&mut done, cx);
        out.extend(done.into_iter().map(settle));
        left
    }

    /// Completes when at least one entry has left (cancel-safe: entries stay in the
    /// queue until taken).
    pub async fn ready(&mut self) -> Vec<Settled> {
        self.replies.ready().await.into_iter().map(settle).collect()
    }
}

/// A store failure turns the ack into a nack (the message may be lost).
pub fn settle((mut s, r): (Settled, Result<(), CoreError>)) -> Settled {
    s.ack &= r.is_ok();
    s
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

//! The ready window: entries loaded from the consume queue, new entries as they are
//! enqueued, and the oldest taken out.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::tag::{tag_len, tag_priority, TAG_HAS_TTL};
use super::{lock, After, Entry, Hot, Queue, State, FLOW_HIGH};
use crate::ConnectionId;

impl Queue {
    /// Loads ready entries from the consume queue into the window.
    pub(super) fn fill(&self, st: &mut State) {
        if st.ready.len() >= self.window / 2 {
            return;
        }
        // every append reaches `enqueue` (which raises `cq_next`) after it is in the
        // consume queue, so this bound saves a store lookup per dispatch
        let next = st.cq_next;
        while st.ready.len() < self.window && st.loaded_upto < next {
            let off = st.loaded_upto;
            st.loaded_upto += 1;
            if st.unacked.contains_key(&off) || self.store.is_acked(self.id, off).unwrap_or(true) {
                continue;
            }
            let Some(e) = self.store.entry(self.id, off) else {
                continue;
            };
            if !self.replicated_enough(st, e.commit_offset + u64::from(e.size)) {
                // not loaded yet: the gate kicks this queue once it is replicated
                st.loaded_upto = off;
                break;
            }
            let redelivered = off < st.recovered_next
                && self
                    .store
                    .may_have_been_delivered(self.id, off)
                    .unwrap_or(false);
            let (returns, parked_at_open) = match st.restored.as_mut() {
                Some(r) => {
                    let n = r.remove(&off).unwrap_or((0, false));
                    if r.is_empty() {
                        st.restored = None;
                    }
                    n
                }
                None => (0, false),
            };
            if parked_at_open {
                // it has been in `parked` (and maybe since in `ready` or unacked) from
                // the start
                continue;
            }
            self.note_tag(e.tag_hash);
            st.ready.insert(
                (255 - self.priority_of(e.tag_hash), off),
                Entry {
                    commit_offset: e.commit_offset,
                    tag: e.tag_hash,
                    redelivered: redelivered || returns > 0,
                    returns,
                    // restored counts come from the store
                    count_stored: returns > 0,
                    unmatched: 0,
                },
            );
        }
    }

    /// In `replication.mode = sync`, whether the record ending at `end` is on
    /// `min_insync` replicas, so that it may be delivered (RabbitMQ's quorum queues, and
    /// Kafka's high watermark, deliver only what is committed: a consumer never sees a
    /// message that a failover then loses). If not, the replica gate kicks this queue
    /// once it is (one registration at a time). Always true otherwise.
    fn replicated_enough(&self, st: &mut State, end: u64) -> bool {
        let Some(gate) = self.store.delivery_gate() else {
            return true;
        };
        // the common case, replicated already: one atomic load, no waker built
        if gate.reached_or_wake(end, None) {
            return true;
        }
        if st.replication_wait {
            return false;
        }
        let Some(me) = self.me() else {
            return false;
        };
        // registered under the gate's lock, which looks again: replicated meanwhile, go on
        if gate.reached_or_wake(end, Some(replicated_waker(&me))) {
            return true;
        }
        st.replication_wait = true;
        false
    }

    pub(super) fn priority_of(&self, tag: u64) -> u8 {
        match self.declared.max_priority {
            Some(max) => tag_priority(tag).min(max),
            None => 0,
        }
    }

    /// Notes an entry going into the ready set (TTL messages make the tick needed).
    pub(super) fn note_tag(&self, tag: u64) {
        if tag & TAG_HAS_TTL != 0 && !self.tick_wanted.load(Ordering::Relaxed) {
            self.tick_wanted.store(true, Ordering::Relaxed);
        }
    }

    /// A message was appended for this queue at `offset` by `publisher` (`None`: by the
    /// broker itself, e.g. dead-lettering). Returns whether the publisher should wait
    /// for [`Queue::wait_flow`] (the queue is throttled, see [`FLOW_HIGH`]).
    ///
    /// A queue throttles only while it has consumers (a queue nobody consumes from is
    /// bounded by its length limits and the broker's alarms instead; blocking on it would
    /// stop publishers for good), and never a publisher that consumes from it itself (it
    /// has to keep reading its socket for the acks that drain the queue).
    pub(crate) fn enqueue(
        &self,
        offset: u64,
        commit_offset: u64,
        tag: u64,
        publisher: Option<ConnectionId>,
        hot: Option<&Hot>,
    ) -> bool {
        if let Some(s) = &self.stream {
            if let Some(me) = self.me() {
                s.enqueue(&me, offset, tag, hot);
            }
            return false;
        }
        let mut after = After::default();
        let wait;
        {
            let mut st = lock(&self.state);
            if st.deleted {
                return false;
            }
            st.ready_count += 1;
            st.ready_bytes += tag_len(tag);
            st.cq_next = st.cq_next.max(offset + 1);
            // in sync replication `fill` loads it, once replicated (it knows the size)
            if st.loaded_upto == offset
                && st.ready.len() < self.window
                && self.store.delivery_gate().is_none()
            {
                st.loaded_upto += 1;
                self.note_tag(tag);
                st.ready.insert(
                    (255 - self.priority_of(tag), offset),
                    Entry {
                        commit_offset,
                        tag,
                        redelivered: false,
                        returns: 0,
                        count_stored: false,
                        unmatched: 0,
                    },
                );
            }
            self.enforce_limits(&mut st, &mut after);
            self.dispatch_hot(&mut st, &mut after, hot.map(|h| (offset, h)));
            self.flow_check(&mut st, &mut after);
            if !st.throttled
                && st.ready_count + st.unacked.len() as u64 > FLOW_HIGH + st.credit
                && !st.consumers.is_empty()
            {
                st.throttled = true;
                self.tick_wanted.store(true, Ordering::Relaxed);
            }
            wait =
                st.throttled && publisher.is_some_and(|p| st.consumers.iter().all(|c| c.conn != p));
        }
        self.finish(after);
        wait
    }

    /// Takes the oldest ready entry out (for drop-head, purge-like removal).
    pub(super) fn pop_oldest(&self, st: &mut State) -> Option<(u64, Entry)> {
        self.fill(st);
        // the oldest is the lowest offset, whatever its priority
        let key = *st.ready.keys().min_by_key(|(_, off)| *off)?;
        let e = st.ready.remove(&key)?;
        st.ready_count = st.ready_count.saturating_sub(1);
        st.ready_bytes = st.ready_bytes.saturating_sub(tag_len(e.tag));
        Some((key.1, e))
    }
}

/// The waker a queue leaves with the replica gate when its deliveries wait for
/// replication (sync mode).
pub(crate) fn replicated_waker(q: &Arc<Queue>) -> std::task::Waker {
    std::task::Waker::from(Arc::new(KickOnReplicated(Arc::downgrade(q))))
}

/// The replica gate's wake-up of a queue whose deliveries wait for replication: the
/// queue (or stream) dispatches again, and registers again if it still has to wait.
struct KickOnReplicated(std::sync::Weak<Queue>);

impl std::task::Wake for KickOnReplicated {
    fn wake(self: Arc<Self>) {
        let Some(q) = self.0.upgrade() else {
            return;
        };
        match &q.stream {
            Some(s) => s.on_replicated(&q),
            None => {
                lock(&q.state).replication_wait = false;
                q.kick();
            }
        }
    }
}

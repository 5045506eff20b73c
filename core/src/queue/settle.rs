//! Acks, nacks and requeues of delivered messages.

use std::sync::Arc;

use super::tag::tag_len;
use super::{lock, After, Queue, State, Unacked};

impl Queue {
    /// Acks deliveries (by queue offset); unknown offsets are ignored.
    pub fn ack(&self, offsets: &[u64]) {
        if let (Some(s), Some(me)) = (&self.stream, self.me()) {
            return s.settle(&me, offsets, true);
        }
        let mut after = After::default();
        {
            let mut st = lock(&self.state);
            for off in offsets {
                if let Some(u) = st.unacked.remove(off) {
                    release(&mut st, &u, &mut after);
                    self.gone(*off, &u.entry, &mut after);
                    st.counts.ack += 1;
                }
            }
            if !st.deleted {
                self.dispatch(&mut st, &mut after);
            }
            self.flow_check(&mut st, &mut after);
        }
        self.finish(after);
    }

    /// Rejects deliveries: back to the queue (marked redelivered, their delivery count
    /// one up) or, without requeue, dead-lettered when the queue has a dead-letter
    /// exchange, else dropped. A return past `x-delivery-limit` dead-letters (reason
    /// `delivery_limit`) or drops the message instead.
    pub fn nack(&self, offsets: &[u64], requeue: bool) {
        self.put_back(offsets, requeue, true);
    }

    /// Puts back deliveries that never reached the client (still in a closed
    /// connection's outbox): as a requeueing nack, without counting a return.
    pub fn requeue_unsent(&self, offsets: &[u64]) {
        self.put_back(offsets, true, false);
    }

    pub(super) fn put_back(&self, offsets: &[u64], requeue: bool, count: bool) {
        // a stream redelivers nothing: a nack (or a requeue) only returns credit
        if let (Some(s), Some(me)) = (&self.stream, self.me()) {
            return s.settle(&me, offsets, false);
        }
        let mut after = After::default();
        {
            let mut st = lock(&self.state);
            for off in offsets {
                let Some(u) = st.unacked.remove(off) else {
                    continue;
                };
                release(&mut st, &u, &mut after);
                if st.deleted {
                    continue;
                }
                if requeue {
                    let mut e = u.entry;
                    e.redelivered = true;
                    e.unmatched = 0;
                    if count && !self.count_return(&mut st, *off, u.entry, &mut e, &mut after) {
                        continue;
                    }
                    st.ready_count += 1;
                    st.ready_bytes += tag_len(e.tag);
                    self.note_tag(e.tag);
                    st.ready.insert((255 - self.priority_of(e.tag), *off), e);
                } else {
                    self.drop_entry(*off, u.entry, "rejected", &mut after);
                }
            }
            if !st.deleted {
                self.dispatch(&mut st, &mut after);
            }
            self.flow_check(&mut st, &mut after);
        }
        self.finish(after);
    }
}

fn release(st: &mut State, u: &Unacked, after: &mut After) {
    if st.sac_handover > 0 && u.consumer == st.sac_old {
        st.sac_handover -= 1;
    }
    if let Some(c) = st.consumers.iter_mut().find(|c| c.id == u.consumer) {
        c.unacked = c.unacked.saturating_sub(1);
    }
    if let Some(g) = &u.gate {
        g.release(1);
        if !after.gates.iter().any(|x| Arc::ptr_eq(x, g)) {
            after.gates.push(g.clone());
        }
    }
}

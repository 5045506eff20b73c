//! Dispatch: ready messages handed to consumers with credit (the plain path and the
//! filtered one), read from the store or from the message just published.

use std::sync::Arc;

use bytes::Bytes;
use triad_store::commitlog::StoredRecord;

use super::returns::with_delivery_count;
use super::tag::{tag_len, TAG_HAS_TTL, TAG_PERSISTENT};
use super::{lock, After, Consumer, Entry, Queue, State, Unacked};
use crate::envelope;
use crate::message::Properties;
use crate::outbox::{Delivery, OutEvent};

/// A ready message taken out of the window, about to be delivered.
pub(super) struct Ready {
    pub(super) offset: u64,
    pub(super) entry: Entry,
    pub(super) body: Bytes,
    pub(super) exchange: Arc<str>,
    pub(super) routing_key: Arc<str>,
    pub(super) properties: Arc<Properties>,
}

/// A message as it was just published, decoded once for all the queues it went to: a
/// copy dispatched while it is being enqueued is built from this (reference counts)
/// instead of a store read, a checksum and an envelope decode per queue.
#[derive(Debug, Clone)]
pub(crate) struct Hot {
    pub exchange: Arc<str>,
    pub routing_key: Arc<str>,
    pub properties: Arc<Properties>,
    pub body: Bytes,
}

impl Ready {
    pub(super) fn into_delivery(
        self,
        tag: Arc<str>,
        queue: Arc<Queue>,
        message_count: u32,
        needs_ack: bool,
    ) -> Delivery {
        Delivery {
            tag,
            queue,
            offset: self.offset,
            redelivered: self.entry.redelivered,
            exchange: self.exchange,
            routing_key: self.routing_key,
            properties: if self.entry.returns > 0 {
                with_delivery_count(&self.properties, self.entry.returns)
            } else {
                self.properties
            },
            body: self.body,
            message_count,
            needs_ack,
        }
    }
}

impl Queue {
    /// Resumes deliveries after an outbox or credit gate had no room.
    pub(crate) fn kick(&self) {
        if let (Some(s), Some(me)) = (&self.stream, self.me()) {
            return s.kick(&me);
        }
        let mut after = After::default();
        {
            let mut st = lock(&self.state);
            if st.deleted {
                return;
            }
            self.dispatch(&mut st, &mut after);
            self.flow_check(&mut st, &mut after);
        }
        self.finish(after);
    }

    /// Hands ready messages to consumers with credit, round robin within the highest
    /// consumer priority.
    pub(super) fn dispatch(&self, st: &mut State, after: &mut After) {
        self.dispatch_hot(st, after, None);
    }

    /// [`Queue::dispatch`], with the message at queue offset `hot.0` already decoded.
    pub(super) fn dispatch_hot(&self, st: &mut State, after: &mut After, hot: Option<(u64, &Hot)>) {
        if st.sac_handover > 0 {
            return;
        }
        if st.filtered > 0 {
            return self.dispatch_filtered(st, after, hot);
        }
        let Some(me) = self.me() else {
            return;
        };
        loop {
            if st.consumers.is_empty() {
                return;
            }
            self.fill(st);
            if st.ready.is_empty() {
                return;
            }
            let Some(ci) = self.pick_consumer(st) else {
                return;
            };
            let Some(m) = self.take_next(st, after, hot) else {
                continue;
            };
            if !self.hand_over(st, after, ci, m, &me) {
                return;
            }
        }
    }

    /// Delivers `m` (already out of the window) to consumer `ci`; `false` when its
    /// outbox filled up meanwhile (`m` is back in the window).
    pub(super) fn hand_over(
        &self,
        st: &mut State,
        after: &mut After,
        ci: usize,
        m: Ready,
        me: &Arc<Queue>,
    ) -> bool {
        let (key, e) = ((255 - self.priority_of(m.entry.tag), m.offset), m.entry);
        let off = m.offset;
        {
            let Some(c) = st.consumers.get_mut(ci) else {
                return false;
            };
            let no_ack = c.no_ack || (c.ack_transient && e.tag & TAG_PERSISTENT == 0);
            let delivery = m.into_delivery(c.tag.clone(), me.clone(), 0, !no_ack);
            if !c.outbox.push(OutEvent::Deliver(delivery)) {
                // filled up since pick_consumer looked: put it back, wait for room
                c.outbox.wait_for_room(me);
                self.note_tag(e.tag);
                st.ready.insert(key, e);
                st.ready_count += 1;
                st.ready_bytes += tag_len(e.tag);
                return false;
            }
            if no_ack {
                st.counts.deliver_no_ack += 1;
            } else {
                st.counts.deliver += 1;
            }
            st.counts.redeliver += u64::from(e.redelivered);
            let _ = self.store.mark_delivered(self.id, off);
            if no_ack {
                self.gone(off, &e, after);
            } else {
                c.unacked += 1;
                if let Some(g) = &c.gate {
                    g.take();
                }
                let (consumer, gate) = (c.id, c.gate.clone());
                st.unacked.insert(
                    off,
                    Unacked {
                        entry: e,
                        consumer,
                        gate,
                    },
                );
            }
            st.rr = ci + 1;
        }
        true
    }

    /// [`Queue::dispatch_hot`] while some consumer has a filter: walks the window in
    /// order (passing over at most a window of entries) and hands each entry to the best
    /// consumer with credit that accepts it; entries nobody accepts stay (see the
    /// module's notes). An entry's record is read only when a consumer with credit may
    /// take it by its tag.
    pub(super) fn dispatch_filtered(
        &self,
        st: &mut State,
        after: &mut After,
        hot: Option<(u64, &Hot)>,
    ) {
        use std::ops::Bound::{Excluded, Unbounded};
        let Some(me) = self.me() else {
            return;
        };
        self.fill(st);
        let epoch = st.filter_epoch;
        // single active consumer: only the active one's filter counts
        let judged = if self.declared.single_active_consumer {
            1
        } else {
            usize::MAX
        };
        // credit changes only with a delivery (checked again after each)
        if st.consumers.is_empty() || self.pick_consumer(st).is_none() {
            return;
        }
        let mut cursor: Option<(u8, u64)> = None;
        let mut walked = 0usize;
        while walked < self.window {
            let next = match cursor {
                None => st.ready.iter().next(),
                Some(k) => st.ready.range((Excluded(k), Unbounded)).next(),
            };
            let Some((&key, &e)) = next else {
                return;
            };
            cursor = Some(key);
            walked += 1;
            if e.unmatched == epoch {
                continue;
            }
            let off = key.1;
            let may = |c: &Consumer| c.filter.as_ref().is_none_or(|f| f.may_match(e.tag));
            if !st.consumers.iter().take(judged).any(may) {
                // the tag hash alone rules it out for everyone: no record read
                if let Some(x) = st.ready.get_mut(&key) {
                    x.unmatched = epoch;
                }
                continue;
            }
            if self.pick_consumer_where(st, |_, c| may(c)).is_none() {
                // those that may take it have no credit now: it waits, unread
                continue;
            }
            let Some(m) = self.ready_message(st, off, e, hot, after) else {
                // unreadable (acked by `load`) or expired (dropped): it leaves the queue
                st.ready.remove(&key);
                st.ready_count = st.ready_count.saturating_sub(1);
                st.ready_bytes = st.ready_bytes.saturating_sub(tag_len(e.tag));
                continue;
            };
            // each consumer's filter judged once
            let accepted: Vec<bool> = st
                .consumers
                .iter()
                .take(judged)
                .map(|c| {
                    c.filter
                        .as_ref()
                        .is_none_or(|f| f.may_match(e.tag) && f.matches(&m.properties))
                })
                .collect();
            if !accepted.contains(&true) {
                if let Some(x) = st.ready.get_mut(&key) {
                    x.unmatched = epoch;
                }
                continue;
            }
            let Some(ci) =
                self.pick_consumer_where(st, |i, _| accepted.get(i).copied().unwrap_or(false))
            else {
                // those that take it have no credit now: it waits for them
                continue;
            };
            st.ready.remove(&key);
            st.ready_count = st.ready_count.saturating_sub(1);
            st.ready_bytes = st.ready_bytes.saturating_sub(tag_len(e.tag));
            if !self.hand_over(st, after, ci, m, &me) {
                return;
            }
            if st.consumers.is_empty() || self.pick_consumer(st).is_none() {
                return;
            }
            // the bound is on entries passed over; a delivery is progress
            walked -= 1;
            self.fill(st);
        }
    }

    /// Takes the next ready message out of the window, loaded and not expired (expired
    /// and unreadable ones on the way are dropped or dead-lettered). `None`: empty.
    pub(super) fn take_next(
        &self,
        st: &mut State,
        after: &mut After,
        hot: Option<(u64, &Hot)>,
    ) -> Option<Ready> {
        loop {
            self.fill(st);
            let (key, e) = st.ready.pop_first()?;
            st.ready_count = st.ready_count.saturating_sub(1);
            st.ready_bytes = st.ready_bytes.saturating_sub(tag_len(e.tag));
            if let Some(m) = self.ready_message(st, key.1, e, hot, after) {
                return Some(m);
            }
        }
    }

    /// Ready entry `e` (queue offset `off`) as a message to deliver: from `hot` when it
    /// was just published (no need to read it back; TTL checks need the record), else
    /// read from the store. `None`: it leaves the queue, unreadable (acked by
    /// [`Queue::load`]) or expired (dropped or dead-lettered here); the caller takes it
    /// out of the window.
    pub(super) fn ready_message(
        &self,
        st: &State,
        off: u64,
        e: Entry,
        hot: Option<(u64, &Hot)>,
        after: &mut After,
    ) -> Option<Ready> {
        if let Some((_, h)) = hot.filter(|(o, _)| *o == off) {
            if e.tag & TAG_HAS_TTL == 0 && st.args.message_ttl.is_none() {
                return Some(Ready {
                    offset: off,
                    entry: e,
                    body: h.body.clone(),
                    exchange: h.exchange.clone(),
                    routing_key: h.routing_key.clone(),
                    properties: h.properties.clone(),
                });
            }
        }
        let (rec, exchange, routing_key, properties) = self.load(off, &e, after)?;
        if self
            .expiry(st.args.message_ttl, e.tag, &rec, &properties)
            .is_some_and(|t| t <= self.clock.now_ms())
        {
            self.drop_entry(off, e, "expired", after);
            return None;
        }
        Some(Ready {
            offset: off,
            entry: e,
            body: rec.body,
            exchange,
            routing_key,
            properties: Arc::new(properties),
        })
    }

    /// Reads and decodes an entry's record; an unreadable one is dropped (acked) with a
    /// warning rather than wedging the queue.
    pub(super) fn load(
        &self,
        off: u64,
        e: &Entry,
        after: &mut After,
    ) -> Option<(StoredRecord, Arc<str>, Arc<str>, Properties)> {
        let rec = match self.store.read_entry(self.id, off, e.commit_offset) {
            Ok(r) => r,
            Err(err) => {
                tracing::warn!(queue = %self.name, offset = off, error = %err, "dropping an unreadable message");
                self.gone(off, e, after);
                return None;
            }
        };
        match envelope::decode_shared(&rec.properties) {
            Ok((x, rk, p)) => Some((rec, x, rk, p)),
            Err(err) => {
                tracing::warn!(queue = %self.name, offset = off, error = %err, "dropping a message with undecodable properties");
                self.gone(off, e, after);
                None
            }
        }
    }
}

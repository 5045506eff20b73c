//! Consumers: registering and cancelling them, single active consumer, and picking the
//! one that gets the next message.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::{lock, After, Consumer, ConsumerId, Queue, State};
use crate::error::CoreError;
use crate::outbox::{CreditGate, Outbox};
use crate::ConnectionId;

/// What a consumer asks for.
#[derive(Debug, Clone)]
pub struct ConsumeRequest {
    /// Consumer tag (unique per channel; the adapter generates one when empty).
    pub tag: String,
    /// Deliveries need no ack.
    pub no_ack: bool,
    /// No other consumer may use the queue meanwhile.
    pub exclusive: bool,
    /// Most unacked deliveries (0 = unlimited).
    pub prefetch: u32,
    /// Consumer priority (`x-priority`): higher gets messages first.
    pub priority: i32,
    /// The consuming connection.
    pub conn: ConnectionId,
    /// Where deliveries go.
    pub outbox: Arc<Outbox>,
    /// Channel-wide unacked limit, if any.
    pub gate: Option<Arc<CreditGate>>,
    /// Only messages this accepts (selector, tag filter); `None`: all.
    pub filter: Option<Arc<crate::filter::MessageFilter>>,
}

/// A registered consumer. Cancel it explicitly; dropping it does not.
#[derive(Debug, Clone)]
pub struct ConsumerHandle {
    queue: Arc<Queue>,
    id: ConsumerId,
    tag: Arc<str>,
}

impl ConsumerHandle {
    /// The consumer tag.
    pub fn tag(&self) -> &Arc<str> {
        &self.tag
    }
    /// The consumer's connection has gone idle ([`crate::outbox::Outbox::note_idle`]):
    /// if its queue holds nothing ready or unacked, the queue lets go of its maps'
    /// memory. A taken and acked message leaves a `BTreeMap` leaf (about 0.5 KiB) and a
    /// `HashMap` table for three more behind, which the many idle queues of a device
    /// fleet would otherwise keep.
    pub fn release_idle(&self) {
        let mut st = lock(&self.queue.state);
        if st.unacked.is_empty() && st.ready.is_empty() {
            if st.unacked.capacity() > 0 {
                st.unacked = HashMap::new();
            }
            st.ready = BTreeMap::new();
        }
    }
    /// The queue consumed from.
    pub fn queue(&self) -> &Arc<Queue> {
        &self.queue
    }
    /// Stops deliveries. Unacked deliveries stay unacked until acked or nacked.
    pub fn cancel(&self) {
        self.queue.cancel(self.id);
    }

    /// From now on, transient (non-persistent) messages are acked as they are handed to
    /// this consumer (`Delivery::needs_ack` false), persistent ones still need an ack.
    /// For MQTT, where a transient message is QoS 0 and so delivered at most once: the
    /// ack round trip per copy is saved.
    pub fn ack_transient_on_delivery(&self) {
        self.queue.set_ack_transient(self.id);
    }
}

impl Queue {
    pub(super) fn pick_consumer(&self, st: &State) -> Option<usize> {
        self.pick_consumer_where(st, |_, _| true)
    }

    /// [`Queue::pick_consumer`] among the consumers `accept` takes (given their index in
    /// `st.consumers`).
    pub(super) fn pick_consumer_where(
        &self,
        st: &State,
        accept: impl Fn(usize, &Consumer) -> bool,
    ) -> Option<usize> {
        // single active consumer: the earliest registered one only (consumers are kept
        // in registration order), whatever the others' priorities
        let n = if self.declared.single_active_consumer {
            st.consumers.len().min(1)
        } else {
            st.consumers.len()
        };
        let me = self.me();
        let mut best: Option<(i32, usize)> = None;
        for k in 0..n {
            let i = if n == 1 { 0 } else { (st.rr + k) % n };
            let Some(c) = st.consumers.get(i) else {
                continue;
            };
            if c.prefetch != 0 && c.unacked >= c.prefetch {
                continue;
            }
            if best.is_some_and(|(p, _)| p >= c.priority) || !accept(i, c) {
                continue;
            }
            if let Some(g) = &c.gate {
                if !g.has_room() {
                    if let Some(me) = &me {
                        g.wait_for_room(me);
                    }
                    continue;
                }
            }
            if !c.outbox.has_room() {
                if let Some(me) = &me {
                    c.outbox.wait_for_room(me);
                }
                continue;
            }
            best = Some((c.priority, i));
        }
        best.map(|(_, i)| i)
    }

    pub(crate) fn consume(&self, req: ConsumeRequest) -> Result<ConsumerHandle, CoreError> {
        self.consume_with(req, crate::stream::StreamConsume::default())
    }

    /// [`Queue::consume`] with a stream consumer's start position and name, which only a
    /// stream queue accepts.
    pub(crate) fn consume_with(
        &self,
        req: ConsumeRequest,
        opts: crate::stream::StreamConsume,
    ) -> Result<ConsumerHandle, CoreError> {
        let me = self
            .me()
            .ok_or_else(|| CoreError::queue_not_found(&self.name))?;
        if let Some(s) = &self.stream {
            if req.filter.is_some() {
                return Err(CoreError::NotImplemented(format!(
                    "selectors and tag filters on stream queue '{}' (only on classic queues)",
                    self.name
                )));
            }
            let (id, tag) = s.consume(&me, req, opts)?;
            return Ok(ConsumerHandle { queue: me, id, tag });
        }
        if !opts.is_empty() {
            let arg = if opts.offset.is_some() {
                "x-stream-offset"
            } else {
                "x-stream-consumer-name"
            };
            return Err(CoreError::PreconditionFailed(format!(
                "invalid arg '{arg}' for queue '{}' in vhost '{}' of queue type classic (it is for stream queues)",
                self.name, self.vhost_name
            )));
        }
        let mut after = After::default();
        let handle;
        {
            let mut st = lock(&self.state);
            if st.deleted {
                return Err(CoreError::queue_not_found(&self.name));
            }
            if st.consumers.iter().any(|c| c.exclusive)
                || (req.exclusive && !st.consumers.is_empty())
            {
                return Err(CoreError::AccessRefused(format!(
                    "queue '{}' in vhost '{}' in exclusive use",
                    self.name, self.vhost_name
                )));
            }
            let id = st.next_consumer;
            st.next_consumer += 1;
            let tag: Arc<str> = Arc::from(req.tag.as_str());
            if !self.declared.single_active_consumer || st.consumers.is_empty() {
                st.credit += self.credit_of(req.prefetch);
            }
            // most queues have one consumer: room for exactly one, not Vec's first four
            st.consumers.reserve_exact(1);
            st.consumers.push(Consumer {
                id,
                conn: req.conn,
                ack_transient: false,
                tag: tag.clone(),
                no_ack: req.no_ack,
                exclusive: req.exclusive,
                prefetch: req.prefetch,
                unacked: 0,
                priority: req.priority,
                outbox: req.outbox,
                gate: req.gate,
                filter: req.filter.clone(),
            });
            st.filtered += usize::from(req.filter.is_some());
            st.filter_epoch = st.filter_epoch.wrapping_add(1).max(1);
            st.had_consumers = true;
            st.last_used = self.clock.instant();
            handle = ConsumerHandle { queue: me, id, tag };
            self.dispatch(&mut st, &mut after);
            self.flow_check(&mut st, &mut after);
        }
        self.finish(after);
        Ok(handle)
    }

    pub(super) fn set_ack_transient(&self, id: ConsumerId) {
        if let Some(c) = lock(&self.state).consumers.iter_mut().find(|c| c.id == id) {
            c.ack_transient = true;
        }
    }

    pub(super) fn cancel(&self, id: ConsumerId) {
        if let Some(s) = &self.stream {
            return s.cancel(id);
        }
        let mut after = After::default();
        {
            let mut st = lock(&self.state);
            let sac = self.declared.single_active_consumer;
            let was_active = st.consumers.first().map(|c| (c.id, c.unacked));
            let before = st.consumers.len();
            st.consumers.retain(|c| c.id != id);
            st.filtered = st.consumers.iter().filter(|c| c.filter.is_some()).count();
            st.filter_epoch = st.filter_epoch.wrapping_add(1).max(1);
            let active = if sac { 1 } else { usize::MAX };
            st.credit = st
                .consumers
                .iter()
                .take(active)
                .map(|c| self.credit_of(c.prefetch))
                .sum();
            if st.consumers.len() != before {
                st.last_used = self.clock.instant();
                after.cancelled_all = st.consumers.is_empty() && st.had_consumers && !st.deleted;
            }
            // Single active consumer: the active one went, the next registered takes
            // over. Handed messages now only if the old one held none unacked: those go
            // back to the queue first when its channel closes (the adapter requeues them
            // right after cancelling), and the next ack, nack or publish hands on.
            if sac && !st.deleted && was_active == Some((id, 0)) {
                self.dispatch(&mut st, &mut after);
            }
            // It held some: the next one gets nothing until every one of them is back
            // (acked, or requeued by the adapter: those in the connection's outbox are
            // requeued after the channel's unacked ones, and must not be overtaken).
            if let Some((old, n)) = was_active.filter(|(old, n)| sac && *old == id && *n > 0) {
                st.sac_old = old;
                st.sac_handover = n;
            }
            self.flow_check(&mut st, &mut after);
        }
        self.finish(after);
    }
}

//! Deliveries from the core (the session's queue, shared and stream subscriptions'
//! queues) into PUBLISH packets, within the outbound window.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use triad_core::queue::Queue;
use triad_core::{Delivery, OutEvent};

use super::{out, Session, QOS_HEADER};
use crate::codec;
use crate::topic::{filter_matches, parse_shared, routing_key_to_topic};
use crate::MqttError;

impl Session {
    /// Turns deliveries from the subscription queue (and shared subscriptions' queues)
    /// into PUBLISH packets.
    pub(super) fn deliver_events(&mut self, evs: &mut Vec<OutEvent>) -> Result<(), MqttError> {
        let mut acks = Acks::default();
        let mut result = Ok(());
        for ev in evs.drain(..) {
            let d = match ev {
                OutEvent::Deliver(d) => d,
                // direct reply-to consumers are AMQP's only
                OutEvent::Reply(_) => continue,
                OutEvent::Cancelled { tag } => {
                    if let Some(i) = self.shared.iter().position(|(t, _)| *t == tag) {
                        // a shared subscription's queue was deleted (by an operator):
                        // that subscription ends, the connection goes on
                        tracing::info!(filter = %tag, "shared subscription queue deleted");
                        self.shared.swap_remove(i);
                        self.streams.retain(|s| s.tag != tag);
                        self.packets.subs.remove(&*tag);
                        self.leave_shared(&tag);
                        continue;
                    }
                    result = Err(MqttError::Protocol("subscription queue deleted"));
                    continue;
                }
            };
            if d.queue.name() != self.qname {
                // from a shared subscription's queue: the QoS its filter was granted,
                // if the MQTT rules match it (see `topic`'s doc on `*` and `$`)
                let topic = routing_key_to_topic(&d.routing_key);
                let granted = if crate::stream::is_stream(&d.tag) {
                    self.stream_granted(&d.tag, &topic)
                } else {
                    self.packets.subs.get(&*d.tag).copied().filter(|_| {
                        parse_shared(&d.tag)
                            .and_then(Result::ok)
                            .is_some_and(|sh| filter_matches(sh.filter, &topic))
                    })
                };
                self.deliver_one(d, &topic, granted, &mut acks);
                continue;
            }
            let cached = self
                .topic_cache
                .as_deref()
                .is_some_and(|(rk, _, _)| **rk == *d.routing_key);
            if !cached {
                let topic = routing_key_to_topic(&d.routing_key);
                let granted = self.packets.granted_for(&topic);
                self.topic_cache = Some(Box::new((d.routing_key.clone(), topic, granted)));
            }
            let cache = self.topic_cache.take();
            if let Some((_, topic, granted)) = cache.as_deref() {
                self.deliver_one(d, topic, *granted, &mut acks);
            }
            self.topic_cache = cache;
        }
        acks.flush();
        result
    }

    /// Encodes one delivery as a PUBLISH on `topic` with QoS at most `granted` (`None`:
    /// no filter matches it under the MQTT rules: acked, not sent).
    fn deliver_one(&mut self, d: Delivery, topic: &str, granted: Option<u8>, acks: &mut Acks) {
        let Some(granted) = granted else {
            // routed by the topic exchange but not matched by MQTT rules
            if d.needs_ack {
                acks.push(&d.queue, d.offset);
            }
            return;
        };
        let msg_qos = d
            .properties
            .headers
            .as_ref()
            .and_then(|h| h.get_i64(QOS_HEADER))
            .map(|q| q.clamp(0, 2) as u8)
            .unwrap_or(if d.properties.is_persistent() { 1 } else { 0 });
        let qos = msg_qos.min(granted);
        let pkid = if qos == 0 {
            if d.needs_ack {
                acks.push(&d.queue, d.offset);
            }
            0
        } else {
            match self.packets.alloc_id() {
                Some(id) => {
                    // a transient message was acked on delivery: nothing to ack
                    let target = d.needs_ack.then(|| (d.queue.clone(), d.offset));
                    self.packets.sent(id, qos, target);
                    id
                }
                None => {
                    if d.needs_ack {
                        d.queue.requeue_unsent(&[d.offset]);
                    }
                    return;
                }
            }
        };
        codec::encode_publish(
            qos > 0 && d.redelivered,
            qos,
            false,
            topic,
            pkid,
            &d.body,
            out(&mut self.wbuf),
        );
        self.state.stats.sent.fetch_add(1, Ordering::Relaxed);
    }
}

/// Acks collected while delivering a batch: one `ack` call per run of deliveries from
/// the same queue.
#[derive(Default)]
struct Acks {
    queue: Option<Arc<Queue>>,
    offsets: Vec<u64>,
}

impl Acks {
    fn push(&mut self, q: &Arc<Queue>, offset: u64) {
        if !self.queue.as_ref().is_some_and(|cur| Arc::ptr_eq(cur, q)) {
            self.flush();
            self.queue = Some(q.clone());
        }
        self.offsets.push(offset);
    }

    fn flush(&mut self) {
        if let Some(q) = self.queue.take() {
            q.ack(&self.offsets);
        }
        self.offsets.clear();
    }
}

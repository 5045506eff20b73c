//! SUBSCRIBE and UNSUBSCRIBE: plain filters (bindings of the session's queue to
//! `amq.topic`), shared subscriptions (`$share/<group>/<filter>`: a queue per group) and
//! stream subscriptions (`$stream/<start>/<filter>`, see [`crate::stream`]), with the
//! permissions each needs.

use std::sync::Arc;

use triad_core::{ConsumeRequest, CoreError, Durability, FieldTable, QueueDeclare};

use super::{Session, StreamSub, MAX_TOPIC_LEN};
use crate::codec::{self, Packet, SubAck};
use crate::state::shared_queue_name;
use crate::topic::{
    filter_matches, is_shared, parse_shared, topic_to_routing_key, valid_filter, SharedFilter,
};
use crate::MqttError;

impl Session {
    /// Drops the restored subscriptions the user may no longer make (permissions are
    /// checked as for a SUBSCRIBE), with their bindings; what was queued for them is
    /// not delivered (no filter matches it any more).
    pub(super) fn revoke_unpermitted(&mut self) -> Result<(), MqttError> {
        let refused: Vec<String> = self
            .packets
            .subs
            .keys()
            .filter(|f| self.check_filter(f).is_err())
            .cloned()
            .collect();
        if refused.is_empty() {
            return Ok(());
        }
        for f in &refused {
            tracing::info!(filter = %f, "restored subscription no longer permitted: dropped");
            self.packets.subs.remove(f);
        }
        for f in &refused {
            if is_shared(f) {
                // not consumed yet (restored after this check): only the membership
                self.leave_shared(f);
                continue;
            }
            let key = topic_to_routing_key(f);
            if !self
                .packets
                .subs
                .keys()
                .any(|k| topic_to_routing_key(k) == key)
            {
                // revoked: the check that would guard the unbind is the one that failed
                if let Err(e) = self.link.vhost().unbind_queue(
                    &self.qname,
                    "amq.topic",
                    &key,
                    &FieldTable::default(),
                    self.link.id(),
                ) {
                    tracing::debug!(key, error = %e, "unbinding a revoked subscription");
                }
            }
        }
        // the check is made again at each connect: no need to wait for the disk
        drop(self.save_session()?);
        Ok(())
    }

    /// The permissions a subscription with binding key `key` needs (RabbitMQ's MQTT
    /// plugin): configure and read on the subscription queue, write on it and read on
    /// amq.topic (with its topic permission) for the binding.
    pub(super) fn check_subscribe(&self, key: &str) -> Result<(), CoreError> {
        self.check_subscribe_to(&self.qname, key)
    }

    /// [`Session::check_subscribe`] for the queue `qname` (a shared subscription's).
    pub(super) fn check_subscribe_to(&self, qname: &str, key: &str) -> Result<(), CoreError> {
        let access = self.link.access();
        access
            .queue_declare(qname, &FieldTable::default())
            .and_then(|()| access.consume(qname))
            .and_then(|()| access.queue_bind_key(self.link.vhost(), qname, "amq.topic", key))
    }

    /// The permission check for a stored filter, plain or shared.
    pub(super) fn check_filter(&self, f: &str) -> Result<(), CoreError> {
        match parse_shared(f) {
            None => self.check_subscribe(&topic_to_routing_key(f)),
            Some(Ok(sh)) => {
                self.check_subscribe_to(&shared_queue_name(sh), &topic_to_routing_key(sh.filter))
            }
            Some(Err(())) => Err(CoreError::AccessRefused(format!(
                "invalid shared subscription '{f}'"
            ))),
        }
    }

    /// Joins the shared subscription `full` (`$share/<group>/<filter>`, parsed as `sh`)
    /// and consumes its group's queue (unless already consuming it): permissions as for
    /// a plain subscription, on the group's queue. Returns the binding's durability.
    pub(super) fn join_shared(
        &mut self,
        full: &str,
        sh: SharedFilter<'_>,
    ) -> Result<Durability, CoreError> {
        let qname = shared_queue_name(sh);
        if qname.len() > MAX_TOPIC_LEN {
            return Err(CoreError::PreconditionFailed(format!(
                "shared subscription queue name longer than {MAX_TOPIC_LEN} bytes"
            )));
        }
        let key = topic_to_routing_key(sh.filter);
        self.check_subscribe_to(&qname, &key)?;
        let vhost = self.link.vhost().clone();
        let durable = self
            .state
            .join_shared(&vhost, &qname, &key, &self.client_id, !self.clean)?;
        if self.shared.iter().any(|(t, _)| **t == *full) {
            return Ok(durable);
        }
        let consumed = vhost.consume(
            &qname,
            ConsumeRequest {
                tag: full.to_string(),
                no_ack: false,
                exclusive: false,
                prefetch: self.prefetch,
                priority: 0,
                conn: self.link.id(),
                outbox: self.outbox.clone(),
                gate: None,
                filter: None,
            },
        );
        match consumed {
            Ok(consumer) => {
                consumer.ack_transient_on_delivery();
                self.shared.push((Arc::from(full), consumer));
                Ok(durable)
            }
            Err(e) => {
                self.state.leave_shared(&vhost, &qname, &self.client_id);
                Err(e)
            }
        }
    }

    /// Leaves the group of the shared filter `full` (its consumer already cancelled).
    pub(super) fn leave_shared(&self, full: &str) {
        if let Some(Ok(sh)) = parse_shared(full) {
            self.state
                .leave_shared(self.link.vhost(), &shared_queue_name(sh), &self.client_id);
        }
    }

    /// Consumes the subscription queue if not yet done, declaring it first when `declare`
    /// (a clean session's queue, exclusive to this connection).
    pub(super) fn subscription_queue(&mut self, declare: bool) -> Result<(), CoreError> {
        if self.consumer.is_some() {
            return Ok(());
        }
        // The session's own queue: what a SUBSCRIBE needs on it is checked per filter
        // (`check_subscribe`); a persistent session's queue is consumed at CONNECT
        // whatever its user may subscribe to now (its revoked filters were dropped).
        let vhost = self.link.vhost();
        if declare {
            vhost.declare_queue(QueueDeclare {
                name: self.qname.clone(),
                exclusive: true,
                conn: self.link.id(),
                ..Default::default()
            })?;
        }
        let consumer = vhost.consume(
            &self.qname,
            ConsumeRequest {
                tag: self.client_id.clone(),
                no_ack: false,
                exclusive: true,
                prefetch: self.prefetch,
                priority: 0,
                conn: self.link.id(),
                outbox: self.outbox.clone(),
                gate: None,
                filter: None,
            },
        )?;
        // a transient message is QoS 0 here: delivered at most once, no ack per copy
        consumer.ack_transient_on_delivery();
        self.consumer = Some(consumer);
        Ok(())
    }

    /// One `$stream/...` filter of a SUBSCRIBE ([`crate::stream`]): the return code
    /// (0x80 for an invalid one, one past the limit, or one refused).
    pub(super) fn subscribe_stream(
        &mut self,
        full: &str,
        parsed: Result<crate::stream::StreamFilter<'_>, ()>,
        requested: u8,
        bound: &mut Option<Durability>,
    ) -> u8 {
        let Ok(sf) = parsed else {
            tracing::debug!(filter = full, "invalid stream subscription refused");
            return 0x80;
        };
        let qos = requested.min(2);
        if let Some(e) = self.streams.iter_mut().find(|s| *s.tag == *full) {
            // subscribed already: the new QoS applies, the position stays
            e.qos = qos;
            return qos;
        }
        if self.packets.subs.len() + self.streams.len() >= self.max_subscriptions {
            tracing::info!(
                client_id = %self.client_id,
                filter = full,
                max = self.max_subscriptions,
                "subscription refused: the session holds mqtt.max_subscriptions already"
            );
            return 0x80;
        }
        match self.join_stream(full, &sf, false) {
            Ok(d) => {
                *bound = Some(d);
                self.streams.push(StreamSub {
                    tag: Arc::from(full),
                    qos,
                    // `<filter>` ends the subscription's filter
                    filter_at: full.len() - sf.filter.len(),
                });
                qos
            }
            Err(e) => {
                tracing::debug!(filter = full, error = %e, "stream subscription refused");
                0x80
            }
        }
    }

    /// Declares the filter's stream queue when missing (with the retention of
    /// [`crate::MqttLimits::stream_max_age`] and `stream_max_bytes`) and binds it, then
    /// consumes it from the subscription's start. Returns the binding's durability (not
    /// waited for here: the SUBACK waits for it).
    pub(super) fn join_stream(
        &mut self,
        full: &str,
        sf: &crate::stream::StreamFilter<'_>,
        restored: bool,
    ) -> Result<Durability, CoreError> {
        let qname = crate::stream::stream_queue_name(sf.filter);
        if qname.len() > MAX_TOPIC_LEN {
            return Err(CoreError::PreconditionFailed(format!(
                "stream queue name longer than {MAX_TOPIC_LEN} bytes"
            )));
        }
        let key = topic_to_routing_key(sf.filter);
        self.check_subscribe_to(&qname, &key)?;
        let vhost = self.link.vhost().clone();
        match vhost.queue(&qname) {
            Some(q) if !q.is_stream() => {
                return Err(CoreError::PreconditionFailed(format!(
                    "queue '{qname}' exists and is not a stream queue"
                )))
            }
            Some(_) => {}
            None => {
                // the binding's journal record, after this one, covers both
                drop(vhost.declare_queue_deferred(QueueDeclare {
                    name: qname.clone(),
                    durable: true,
                    arguments: crate::stream::auto_declare_arguments(
                        self.stream_max_age,
                        self.stream_max_bytes,
                    ),
                    conn: self.link.id(),
                    ..Default::default()
                })?);
            }
        }
        // a persistent session's position (stored before the binding, whose record
        // then covers it)
        let name = (!self.clean).then(|| crate::stream::consumer_name(&self.client_id, full));
        let q = vhost.queue(&qname);
        let opts = crate::stream::consume_options(
            sf,
            name,
            q.as_ref().and_then(|q| q.stream()),
            restored,
        )?;
        // bound already: the result covers what was journaled before (the records of
        // the queue and the binding among it)
        let bound = vhost.bind_queue_deferred(
            &qname,
            "amq.topic",
            &key,
            &FieldTable::default(),
            self.link.id(),
        )?;
        let consumer = vhost.consume_stream(
            &qname,
            ConsumeRequest {
                tag: full.to_string(),
                no_ack: false,
                exclusive: false,
                prefetch: self.prefetch.max(1),
                priority: 0,
                conn: self.link.id(),
                outbox: self.outbox.clone(),
                gate: None,
                filter: None,
            },
            opts,
        )?;
        self.shared.push((Arc::from(full), consumer));
        Ok(bound)
    }

    /// Ends the stream subscription `f`, if there is one.
    pub(super) fn unsubscribe_stream(&mut self, f: &str) {
        self.streams.retain(|s| *s.tag != *f);
        if let Some(i) = self.shared.iter().position(|(t, _)| **t == *f) {
            let (_, consumer) = self.shared.swap_remove(i);
            consumer.cancel();
            if !self.clean {
                crate::stream::forget_position(self.link.vhost(), &self.client_id, f);
            }
        }
    }

    /// Restores a persistent session's stream subscriptions at CONNECT, each from its
    /// stored position. One that cannot be restored (no longer permitted, say) is
    /// dropped with a warning, and the session is stored without it at its next change.
    pub(crate) fn restore_streams(&mut self) {
        let now = triad_core::stream::now_ms();
        for (f, qos) in self.vs.sessions.streams(&self.client_id) {
            let joined = match crate::stream::parse_stream(&f, now) {
                Some(Ok(sf)) => self.join_stream(&f, &sf, true).map(|_| sf.filter.len()),
                _ => Err(CoreError::Internal(format!(
                    "stored stream filter '{f}' is invalid"
                ))),
            };
            match joined {
                Ok(filter_len) => self.streams.push(StreamSub {
                    filter_at: f.len() - filter_len,
                    tag: Arc::from(f.as_str()),
                    qos,
                }),
                Err(e) => {
                    tracing::warn!(filter = %f, error = %e, "cannot restore a stream subscription: dropped");
                }
            }
        }
    }

    /// The QoS a delivery of stream subscription `tag` on `topic` goes out with (`None`:
    /// the MQTT rules do not match it, or the subscription has ended).
    pub(super) fn stream_granted(&self, tag: &str, topic: &str) -> Option<u8> {
        self.streams
            .iter()
            .find(|s| *s.tag == *tag)
            .filter(|s| filter_matches(s.filter(), topic))
            .map(|s| s.qos)
    }

    /// One `$share/...` filter of a SUBSCRIBE: the return code (0x80 for an invalid
    /// shared filter, one past the limit, or one refused).
    pub(super) fn subscribe_shared(
        &mut self,
        full: &str,
        parsed: Result<SharedFilter<'_>, ()>,
        requested: u8,
        bound: &mut Option<Durability>,
    ) -> u8 {
        let Ok(sh) = parsed else {
            tracing::debug!(filter = full, "invalid shared subscription refused");
            return 0x80;
        };
        if sh.filter.len() > MAX_TOPIC_LEN {
            return 0x80;
        }
        let qos = requested.min(2);
        if let Some(q) = self.packets.subs.get_mut(full) {
            // already a member: the new QoS applies from now on
            *q = qos;
            return qos;
        }
        if self.packets.subs.len() >= self.max_subscriptions {
            tracing::info!(
                client_id = %self.client_id,
                filter = full,
                max = self.max_subscriptions,
                "subscription refused: the session holds mqtt.max_subscriptions already"
            );
            return 0x80;
        }
        match self.join_shared(full, sh) {
            Ok(d) => {
                *bound = Some(d);
                self.packets.subs.insert(full.to_string(), qos);
                qos
            }
            Err(e) => {
                tracing::debug!(filter = full, error = %e, "shared subscription refused");
                0x80
            }
        }
    }

    pub(super) fn subscribe(&mut self, s: codec::Subscribe) -> Result<(), MqttError> {
        let mut codes = Vec::with_capacity(s.filters.len());
        // filters granted by this SUBSCRIBE, in order, each once (with the QoS granted
        // last): a filter listed twice is one subscription, and its retained messages
        // go out once
        let mut granted: Vec<(String, u8)> = Vec::new();
        let mut seen: std::collections::HashMap<String, Option<usize>> =
            std::collections::HashMap::new();
        let mut bound = None;
        for (filter, requested) in s.filters {
            if let Some(earlier) = seen.get(&filter) {
                // already checked and bound (or refused) in this packet
                match earlier {
                    Some(i) => {
                        let qos = requested.min(2);
                        if crate::stream::is_stream(&filter) {
                            // a stream subscription is not in the session: its QoS is
                            if let Some(e) = self.streams.iter_mut().find(|s| *s.tag == *filter) {
                                e.qos = qos;
                            }
                        } else {
                            self.packets.subs.insert(filter, qos);
                        }
                        if let Some(g) = granted.get_mut(*i) {
                            g.1 = qos;
                        }
                        codes.push(qos);
                    }
                    None => codes.push(0x80),
                }
                continue;
            }
            if let Some(parsed) = crate::stream::parse_stream(&filter, triad_core::stream::now_ms())
            {
                let code = self.subscribe_stream(&filter, parsed, requested, &mut bound);
                // a stream subscription replays the stream itself: no retained messages
                seen.insert(filter, (code != 0x80).then_some(usize::MAX));
                codes.push(code);
                continue;
            }
            if let Some(parsed) = parse_shared(&filter) {
                let code = self.subscribe_shared(&filter, parsed, requested, &mut bound);
                // a shared subscription gets no retained messages (MQTT 5 [MQTT-3.3.1-9]
                // as EMQX; Mosquitto 2.0 sends them): no entry in `granted`
                seen.insert(filter, (code != 0x80).then_some(usize::MAX));
                codes.push(code);
                continue;
            }
            let code = self.subscribe_plain(&filter, requested, &mut bound);
            if code == 0x80 {
                seen.insert(filter, None);
                codes.push(0x80);
                continue;
            }
            codes.push(code);
            seen.insert(filter.clone(), Some(granted.len()));
            granted.push((filter, code));
        }
        let mut durables = self.save_session()?;
        durables.extend(bound);
        // retained messages on every subscribe [MQTT-3.3.1-6], after the SUBACK and
        // through the outbound window (`feed_retained`)
        self.respond_after(
            vec![Packet::SubAck(SubAck {
                pkid: s.pkid,
                codes,
            })],
            durables,
            None,
            granted,
        );
        Ok(())
    }

    /// One plain filter of a SUBSCRIBE: checked, bound to the session's queue; the
    /// return code (0x80 for an invalid filter, one past the limit, or one refused).
    pub(super) fn subscribe_plain(
        &mut self,
        filter: &str,
        requested: u8,
        bound: &mut Option<Durability>,
    ) -> u8 {
        if !valid_filter(filter) || filter.len() > MAX_TOPIC_LEN {
            return 0x80;
        }
        if !self.packets.subs.contains_key(filter)
            && self.packets.subs.len() >= self.max_subscriptions
        {
            tracing::info!(
                client_id = %self.client_id,
                filter,
                max = self.max_subscriptions,
                "subscription refused: the session holds mqtt.max_subscriptions already"
            );
            return 0x80;
        }
        let key = topic_to_routing_key(filter);
        let allowed = self.check_subscribe(&key);
        if let Err(e) = allowed.and_then(|()| self.subscription_queue(self.clean)) {
            tracing::debug!(filter, error = %e, "subscription refused");
            return 0x80;
        }
        match self
            .link
            .bind_queue_deferred(&self.qname, "amq.topic", &key, &FieldTable::default())
        {
            // the journal is ordered: the last binding's record covers the others
            Ok(durable) => *bound = Some(durable),
            Err(e) => {
                tracing::debug!(filter, error = %e, "subscription refused");
                return 0x80;
            }
        }
        let qos = requested.min(2);
        self.packets.subs.insert(filter.to_string(), qos);
        qos
    }

    /// UNSUBSCRIBE: each filter's subscription ends (its binding when no other filter
    /// maps to the same key); UNSUBACK waits for the session's record.
    pub(super) fn unsubscribe(&mut self, u: codec::Unsubscribe) -> Result<(), MqttError> {
        for f in &u.filters {
            self.retained.remove(f);
            if crate::stream::is_stream(f) {
                self.unsubscribe_stream(f);
                continue;
            }
            if is_shared(f) {
                if self.packets.subs.remove(f).is_some() {
                    if let Some(i) = self.shared.iter().position(|(t, _)| **t == **f) {
                        let (_, consumer) = self.shared.swap_remove(i);
                        consumer.cancel();
                    }
                    self.leave_shared(f);
                }
                continue;
            }
            if self.packets.subs.remove(f).is_some() {
                let key = topic_to_routing_key(f);
                // another filter may map to the same binding key
                let shared = self
                    .packets
                    .subs
                    .keys()
                    .any(|k| topic_to_routing_key(k) == key);
                if !shared {
                    // the session's own binding: no permission needed to drop it
                    self.link.vhost().unbind_queue(
                        &self.qname,
                        "amq.topic",
                        &key,
                        &FieldTable::default(),
                        self.link.id(),
                    )?;
                }
            }
        }
        let durables = self.save_session()?;
        self.respond(vec![Packet::UnsubAck(u.pkid)], durables);
        Ok(())
    }
}

//! One MQTT session without I/O: packets in, [`Link`] calls, packets out. It turns the
//! client's packets into core calls, the core's deliveries into PUBLISH packets, and
//! implements the core's [`Protocol`], so the core's one connection driver does the
//! socket work. The CONNECT phase is [`crate::connect`]'s.
//!
//! - [`packets`]: packet identifiers, in-flight messages and subscriptions (generic,
//!   testable without a broker);
//! - `subscribe`: SUBSCRIBE / UNSUBSCRIBE, shared (`$share/...`) and stream
//!   (`$stream/...`) subscriptions, permission checks;
//! - `deliver`: deliveries from the core into PUBLISH packets.
//!
//! Acks that promise durability (PUBACK, PUBREC for a persistent message; SUBACK and
//! UNSUBACK of a persistent session) wait for the store's [`Durability`]; every response
//! goes through one ordered queue, so they leave in the order the requests came
//! [MQTT-4.6.0-2].
//!
//! Publisher flow control: a publish that went to a queue whose consumers fall behind
//! comes back from the core with a [`Backpressure`]; its PUBACK / PUBREC (or, at QoS 0,
//! a hold) waits in the same ordered queue until the backlog drains or
//! [`triad_core::replies::FLOW_MAX_WAIT`] passes. The socket is still read meanwhile
//! (acks of this client's own deliveries must get through, or two clients feeding each
//! other would deadlock) until [`MAX_PENDING`] responses wait; a client's in-flight
//! window stops it sooner.

mod deliver;
pub mod packets;
mod subscribe;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use triad_core::driver::{Out, Protocol, Status, Timing};
use triad_core::queue::Queue;
use triad_core::{
    Backpressure, ConsumerHandle, CoreError, Durability, FieldTable, FieldValue, Link, OutEvent,
    Outbox, Properties, ReplyQueue,
};

use crate::codec::{self, Limits, Packet, Will};
use crate::retained::RetainedFeed;
use crate::state::{MqttState, VhostState};
use crate::topic::{is_shared, parse_shared, topic_to_routing_key};
use crate::MqttError;

pub use packets::{Carry, Outbound, Packets, PubRec};

/// Header carrying the MQTT QoS of a message through the core (RabbitMQ's name).
pub(crate) const QOS_HEADER: &str = "x-mqtt-publish-qos";

/// What acks an outbound message in the core: its queue and offset.
pub(crate) type Target = (Arc<Queue>, u64);

/// Responses waiting for the store before the socket is no longer read.
const MAX_PENDING: usize = 1024;

/// Retained messages are encoded into the write buffer until it holds this much, then
/// written: a client that does not read holds one such batch, not every match of its
/// filters (a 1 MiB message retained on a topic that 300 of its filters match was 300
/// MiB of write buffer).
const RETAINED_BATCH: usize = 64 << 10;

/// Longest topic name or filter accepted, in bytes: AMQP's short string, which the
/// routing key it maps to must fit in (as RabbitMQ's MQTT plugin and the STOMP adapter);
/// also what one subscription's binding key may cost.
pub const MAX_TOPIC_LEN: usize = 255;

/// A routing key, its MQTT topic and the QoS granted for it (`None`: no filter matches).
type TopicCache = (Arc<str>, String, Option<u8>);

/// A response waiting in the connection's [`ReplyQueue`] for the store or for
/// publisher flow control.
pub(crate) struct Reply {
    packets: Vec<Packet>,
    /// Filters (with their granted QoS) whose retained messages follow the packets.
    retained: Vec<(String, u8)>,
}

/// One connected MQTT session, without I/O: packets in, [`Link`] calls, packets out
/// (encoded into its write buffer, which the core's driver writes).
pub(crate) struct Session {
    /// The user, vhost, permissions and connection slot; dropped (the connection torn
    /// down in the core) with the connection, after its deliveries were given back.
    link: Link,
    state: Arc<MqttState>,
    vs: Arc<VhostState>,
    client_id: String,
    qname: String,
    clean: bool,
    /// Packet identifiers, in-flight messages and subscriptions.
    packets: Packets<Target>,
    /// The last routing key delivered, its MQTT topic and the QoS granted for it
    /// (cleared when the subscriptions change): fan-out delivers one key many times.
    /// Boxed: an idle connection keeps a pointer, not the entry.
    topic_cache: Option<Box<TopicCache>>,
    /// Responses in order (the core's one ordered reply queue).
    pending: ReplyQueue<Reply>,
    /// Where the subscription queue delivers.
    outbox: Arc<Outbox>,
    /// Consuming the subscription queue: from CONNECT for a persistent session, from the
    /// first SUBSCRIBE for a clean one.
    consumer: Option<ConsumerHandle>,
    /// Outbound QoS 1/2 messages in flight, from the subscription queue and the
    /// retained store together (the consumer's prefetch is the same number).
    prefetch: u32,
    /// Retained messages owed for SUBSCRIBEs, sent as the window allows.
    retained: RetainedFeed,
    /// Encoded packets, handed to the driver's write buffer ([`Protocol::encode`]).
    wbuf: BytesMut,
    limits: Limits,
    /// Subscriptions the session may hold ([`crate::MqttLimits::max_subscriptions`]).
    max_subscriptions: usize,
    /// Retention of an auto-declared `$stream` queue ([`crate::MqttLimits`]).
    stream_max_age: Duration,
    stream_max_bytes: u64,
    /// [`crate::MqttLimits::index_topics`].
    index_topics: bool,
    /// Shared subscriptions consumed: the `$share/...` filter (the consumer's tag) and
    /// the consumer of its group's queue. Empty (no allocation) for most clients.
    shared: Vec<(Arc<str>, ConsumerHandle)>,
    /// Stream subscriptions (`$stream/...`, see [`crate::stream`]) and the QoS granted
    /// to each; their consumers are in `shared`, under the same filter.
    streams: Vec<StreamSub>,
    /// The client sent a PUBLISH: resource alarms hold this connection.
    published: bool,
    /// Why the session ended, once it has.
    closed: Option<Closed>,
    /// One and a half times the keep-alive [MQTT-3.1.2-24].
    keep_alive: Option<Duration>,
}

/// Why a session closed itself.
pub(crate) enum Closed {
    /// The client said DISCONNECT.
    Disconnect,
    /// The broker shuts down.
    Shutdown,
    /// A protocol violation, a refused publish or a store failure.
    Error(MqttError),
}

/// What a session is made of at CONNECT.
pub(crate) struct SessionSetup {
    pub link: Link,
    pub state: Arc<MqttState>,
    pub vs: Arc<VhostState>,
    pub client_id: String,
    pub qname: String,
    pub clean: bool,
    pub packets: Packets<Target>,
    pub keep_alive: u16,
}

/// A stream subscription (`$stream/<start>/<filter>`).
struct StreamSub {
    /// The whole filter (the consumer's tag).
    tag: Arc<str>,
    /// The QoS granted.
    qos: u8,
    /// Where `<filter>` starts in `tag` (parsed once, not per delivery).
    filter_at: usize,
}

impl StreamSub {
    fn filter(&self) -> &str {
        self.tag.get(self.filter_at..).unwrap_or("")
    }
}

/// The connection's write buffer, taken (4 KiB) if it was let go while idle.
fn out(wbuf: &mut BytesMut) -> &mut BytesMut {
    if wbuf.capacity() == 0 {
        wbuf.reserve(4096);
    }
    wbuf
}

impl Session {
    /// A session for a CONNECT just accepted, with the connection's limits.
    pub(crate) fn new(s: SessionSetup, limits: &crate::MqttLimits) -> Session {
        // Every outbound packet identifier, whoever takes it, counts against this window;
        // 0 would be the core's "no limit", and there are only 65,535 identifiers.
        let window = limits.max_inflight.clamp(1, u32::from(u16::MAX));
        Session {
            link: s.link,
            state: s.state,
            vs: s.vs,
            client_id: s.client_id,
            qname: s.qname,
            clean: s.clean,
            packets: s.packets,
            topic_cache: None,
            pending: ReplyQueue::default(),
            outbox: Outbox::new((limits.max_inflight as usize).max(64)),
            consumer: None,
            prefetch: window,
            retained: RetainedFeed::default(),
            wbuf: BytesMut::with_capacity(4096),
            limits: Limits {
                max_packet_size: limits.max_packet_size,
                max_filters: limits.max_filters,
            },
            max_subscriptions: limits.max_subscriptions,
            stream_max_age: limits.stream_max_age,
            stream_max_bytes: limits.stream_max_bytes,
            index_topics: limits.index_topics,
            shared: Vec::new(),
            streams: Vec::new(),
            published: false,
            closed: None,
            keep_alive: (s.keep_alive > 0)
                .then(|| Duration::from_millis(u64::from(s.keep_alive) * 1500)),
        }
    }

    /// Encodes CONNACK, and PUBREL again for every outbound QoS 2 message released but
    /// not completed [MQTT-4.4.0-1].
    pub(crate) fn connack(&mut self, session_present: bool) {
        // [MQTT-3.2.2-1]..[MQTT-3.2.2-3]
        codec::encode(
            &Packet::ConnAck {
                session_present,
                code: crate::connect::ACCEPTED,
            },
            out(&mut self.wbuf),
        );
        let resend: Vec<u16> = self.packets.pending_pubrel().collect();
        for id in resend {
            codec::encode(&Packet::PubRel(id), out(&mut self.wbuf));
        }
    }

    /// A persistent session resumed: drops the subscriptions no longer permitted,
    /// consumes its queue and its shared subscriptions' queues again, and its stream
    /// subscriptions from their stored positions.
    pub(crate) fn resume(&mut self) -> Result<(), MqttError> {
        self.revoke_unpermitted()?;
        self.subscription_queue(false)?;
        let shared: Vec<String> = self
            .packets
            .subs
            .keys()
            .filter(|f| is_shared(f))
            .cloned()
            .collect();
        for f in shared {
            match parse_shared(&f) {
                Some(Ok(sh)) => drop(self.join_shared(&f, sh)?),
                _ => {
                    return Err(MqttError::Core(CoreError::Internal(format!(
                        "stored shared filter '{f}' is invalid"
                    ))))
                }
            }
        }
        self.restore_streams();
        Ok(())
    }

    /// Why the session closed itself, taken.
    pub(crate) fn take_closed(&mut self) -> Option<Closed> {
        self.closed.take()
    }

    /// Ends the session: what the client did not ack goes back to its queues (and comes
    /// back redelivered, DUP); a clean session's shared subscriptions end; a persistent
    /// session keeps its QoS 2 state; the will goes out unless the client said
    /// DISCONNECT [MQTT-3.1.2-8], [MQTT-3.1.2-10] (`abnormal`).
    pub(crate) fn finish(&mut self, abnormal: bool, will: Option<Will>) {
        if let Some(consumer) = &self.consumer {
            consumer.cancel();
        }
        for (_, consumer) in &self.shared {
            consumer.cancel();
        }
        for ev in self.outbox.close() {
            if let OutEvent::Deliver(d) = ev {
                d.queue.requeue_unsent(&[d.offset]);
            }
        }
        // a clean session's shared subscriptions end with it (after its consumers
        // stopped, so the last member's delete cancels nobody)
        if self.clean {
            for (tag, _) in std::mem::take(&mut self.shared) {
                self.leave_shared(&tag);
            }
        }
        let (targets, carry) = std::mem::take(&mut self.packets).finish();
        // unacked messages of a shared subscription go back to its queue: another
        // member of the group gets them
        for (q, off) in targets {
            q.nack(&[off], true);
        }
        if !self.clean {
            let vhost = self.vs.vhost.clone();
            self.state.put_carry(vhost.name(), &self.client_id, carry);
            // before the registration is dropped, so a takeover's connect comes after it
            self.state.session_disconnected(&self.vs, &self.client_id);
        }
        self.state.stats.connected.fetch_sub(1, Ordering::Relaxed);
        if let (true, Some(w)) = (abnormal, will) {
            tracing::debug!(topic = w.topic, "publishing the will");
            if let Err(e) = self.publish_in(&w.topic, w.payload, w.qos, w.retain) {
                tracing::debug!(error = %e, "will not published");
            }
        }
    }

    /// Records why the session closed (the first reason stands).
    fn close(&mut self, why: Closed) {
        if self.closed.is_none() {
            self.closed = Some(why);
        }
    }

    /// Queues responses behind any that wait for the store.
    fn respond(&mut self, packets: Vec<Packet>, durables: Vec<Durability>) {
        self.respond_after(packets, durables, None, Vec::new());
    }

    /// Queues responses behind any that wait, also held by `throttle` (flow control);
    /// the retained messages of `retained` (filter, granted QoS) are owed after them.
    fn respond_after(
        &mut self,
        packets: Vec<Packet>,
        durables: Vec<Durability>,
        throttle: Option<Backpressure>,
        retained: Vec<(String, u8)>,
    ) {
        let throttle = throttle.filter(|b| !b.is_clear());
        let on_disk = durables.iter().all(|d| d.is_durable());
        match throttle {
            None if on_disk && packets.is_empty() => {}
            None if on_disk && self.pending.is_empty() => {
                for p in &packets {
                    codec::encode(p, out(&mut self.wbuf));
                }
                for (f, q) in &retained {
                    self.retained.push(f, *q);
                }
            }
            // nothing to answer (QoS 0): the throttled queue holds what follows
            Some(b) if packets.is_empty() && retained.is_empty() => self.pending.hold(b),
            throttle => self
                .pending
                .push(Reply { packets, retained }, durables, throttle),
        }
    }

    /// Room in the outbound window: packet identifiers that may still be taken.
    fn window_room(&self) -> usize {
        (self.prefetch as usize).saturating_sub(self.packets.inflight())
    }

    /// Encodes owed retained messages while the window has room and the write buffer
    /// is below [`RETAINED_BATCH`].
    fn feed_retained(&mut self) {
        while self.wbuf.len() < RETAINED_BATCH {
            let vs = &self.vs;
            let room = self.window_room() > 0;
            let Some(r) = self.retained.next(|f| vs.retained.matching(f), room) else {
                return;
            };
            let pkid = if r.qos > 0 {
                let Some(id) = self.packets.alloc_id() else {
                    return;
                };
                self.packets.sent(id, r.qos, None);
                id
            } else {
                0
            };
            codec::encode_publish(
                false,
                r.qos,
                true,
                &r.topic,
                pkid,
                &r.payload,
                out(&mut self.wbuf),
            );
            self.state.stats.sent.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Encodes responses that left the reply queue, in order.
    fn write_replies(
        &mut self,
        ready: Vec<(Reply, Result<(), CoreError>)>,
    ) -> Result<(), MqttError> {
        for (p, stored) in ready {
            stored.map_err(|e| MqttError::Store(e.to_string()))?;
            for pk in &p.packets {
                codec::encode(pk, out(&mut self.wbuf));
            }
            for (f, q) in &p.retained {
                self.retained.push(f, *q);
            }
        }
        Ok(())
    }

    /// Handles one packet; `true` on DISCONNECT.
    fn handle(&mut self, p: Packet) -> Result<bool, MqttError> {
        match p {
            Packet::Publish(p) => {
                if p.qos == 2 && !self.packets.inbound_qos2(p.pkid) {
                    // a resend of a message already taken: exactly once [MQTT-4.3.3-2]
                    self.respond(vec![Packet::PubRec(p.pkid)], Vec::new());
                    return Ok(false);
                }
                let (durables, throttle) = self.publish_in(&p.topic, p.payload, p.qos, p.retain)?;
                let (ack, durables) = match p.qos {
                    1 => (vec![Packet::PubAck(p.pkid)], durables),
                    2 => (vec![Packet::PubRec(p.pkid)], durables),
                    // nothing to hold back but the reading of more publishes
                    _ => (Vec::new(), Vec::new()),
                };
                self.respond_after(ack, durables, throttle, Vec::new());
            }
            Packet::PubAck(id) => {
                if let Some(Some((q, off))) = self.packets.on_puback(id) {
                    q.ack(&[off]);
                }
            }
            Packet::PubRec(id) => match self.packets.on_pubrec(id) {
                PubRec::Released(t) => {
                    if let Some((q, off)) = t {
                        q.ack(&[off]);
                    }
                    self.respond(vec![Packet::PubRel(id)], Vec::new());
                }
                PubRec::Again => self.respond(vec![Packet::PubRel(id)], Vec::new()),
                PubRec::Unknown => {}
            },
            Packet::PubRel(id) => {
                self.packets.on_pubrel(id);
                self.respond(vec![Packet::PubComp(id)], Vec::new());
            }
            Packet::PubComp(id) => {
                self.packets.on_pubcomp(id);
            }
            Packet::Subscribe(s) => {
                self.topic_cache = None;
                self.subscribe(s)?
            }
            Packet::Unsubscribe(u) => {
                self.topic_cache = None;
                self.unsubscribe(u)?
            }
            Packet::PingReq => self.respond(vec![Packet::PingResp], Vec::new()),
            Packet::Disconnect => return Ok(true),
            Packet::Connect(_) => return Err(MqttError::Protocol("second CONNECT")),
            Packet::ConnAck { .. } | Packet::SubAck(_) | Packet::UnsubAck(_) | Packet::PingResp => {
                return Err(MqttError::Protocol("server-to-client packet from a client"))
            }
        }
        Ok(false)
    }

    /// Stores a persistent session's subscriptions; what the reply waits for.
    fn save_session(&mut self) -> Result<Vec<Durability>, MqttError> {
        if self.clean {
            return Ok(Vec::new());
        }
        Ok(self
            .vs
            .sessions
            .save(
                &self.client_id,
                self.link.user(),
                &self.packets.subs,
                self.streams
                    .iter()
                    .map(|s| (s.tag.to_string(), s.qos))
                    .collect(),
            )?
            .into_iter()
            .collect())
    }

    /// Publishes into the core (client PUBLISH and wills).
    fn publish_in(
        &mut self,
        topic: &str,
        payload: Bytes,
        qos: u8,
        retain: bool,
    ) -> Result<(Vec<Durability>, Option<Backpressure>), MqttError> {
        // A refused publish ends the connection, as RabbitMQ's MQTT plugin does
        // (MQTT 3.1.1 has no way to refuse one message).
        if topic.len() > MAX_TOPIC_LEN {
            return Err(MqttError::Protocol("topic name longer than 255 bytes"));
        }
        // EMQX's delayed publish: `$delayed/<seconds>/<topic>`
        let (topic, delay_secs) = match crate::topic::parse_delayed(topic) {
            None => (topic, None),
            Some(Ok((secs, t))) => (t, Some(secs)),
            Some(Err(why)) => return Err(MqttError::Protocol(why)),
        };
        if delay_secs.is_some() && retain {
            return Err(MqttError::Protocol(
                "retained $delayed publish: not supported",
            ));
        }
        let routing_key = topic_to_routing_key(topic);
        if triad_core::reserved::is_reserved_topic("amq.topic", &routing_key) {
            // `$SYS` is the broker's: acknowledged and dropped, as Mosquitto does
            tracing::debug!(topic, "PUBLISH to a $SYS topic dropped");
            return Ok((Vec::new(), None));
        }
        // checked before the retained message is set, and once
        let to = self.link.check_publish("amq.topic".into(), routing_key)?;
        let mut durables = Vec::new();
        if retain {
            // [MQTT-3.3.1-5], an empty payload clears [MQTT-3.3.1-10]
            if let Some(d) = self.vs.retained.set(topic, payload.clone(), qos, true)? {
                durables.push(d);
            }
        }
        let mut headers = FieldTable::default();
        headers.insert(QOS_HEADER, FieldValue::U8(qos));
        if let Some(secs) = delay_secs {
            headers.insert("x-delay", FieldValue::I64((secs * 1000) as i64));
        }
        let properties = Properties {
            delivery_mode: Some(if qos > 0 { 2 } else { 1 }),
            headers: Some(headers),
            ..Default::default()
        };
        // indexed by vhost and topic when configured: the management API's query by
        // topic and time
        let published = if self.index_topics {
            self.link.publish_checked_indexed(to, properties, payload)?
        } else {
            self.link.publish_checked(to, false, properties, payload)?
        };
        durables.extend(published.durable);
        self.state.stats.received.fetch_add(1, Ordering::Relaxed);
        Ok((durables, published.backpressure))
    }
}

impl Protocol for Session {
    type Frame = Packet;
    type Reply = Reply;
    type Error = MqttError;

    fn decode(&mut self, buf: &mut BytesMut) -> Option<Packet> {
        match codec::decode(buf, &self.limits) {
            Ok(p) => p,
            Err(e) => {
                self.close(Closed::Error(e.into()));
                None
            }
        }
    }

    fn step(&mut self, p: Packet, _out: &mut Out) -> Result<(), MqttError> {
        self.published |= matches!(p, Packet::Publish(_));
        match self.handle(p) {
            Ok(false) => {}
            Ok(true) => self.close(Closed::Disconnect),
            Err(e) => self.close(Closed::Error(e)),
        }
        Ok(())
    }

    /// Owed retained messages (as the window allows), then what is encoded so far,
    /// moved into the driver's buffer (the two buffers trade places: no copy).
    fn encode(&mut self, out: &mut Out) -> Result<(), MqttError> {
        if self.closed.is_none() {
            self.feed_retained();
        }
        out.take_from(&mut self.wbuf);
        Ok(())
    }

    fn outbox(&self) -> &Arc<Outbox> {
        &self.outbox
    }

    /// Each delivery takes at most one packet identifier: no more than the window has
    /// room for. The rest wait in the outbox (bounded; the core's prefetch is the same
    /// window) until an ack frees room.
    fn delivery_room(&self) -> usize {
        self.window_room()
    }

    fn deliver(&mut self, events: &mut Vec<OutEvent>, _out: &mut Out) -> Result<(), MqttError> {
        if let Err(e) = self.deliver_events(events) {
            self.close(Closed::Error(e));
        }
        Ok(())
    }

    fn replies(&mut self) -> &mut ReplyQueue<Reply> {
        &mut self.pending
    }

    fn replied(
        &mut self,
        ready: Vec<(Reply, Result<(), CoreError>)>,
        _out: &mut Out,
    ) -> Result<(), MqttError> {
        if let Err(e) = self.write_replies(ready) {
            self.close(Closed::Error(e));
        }
        Ok(())
    }

    /// Stop reading while too many acks wait for the disk (back-pressure).
    fn max_replies(&self) -> usize {
        MAX_PENDING
    }

    fn status(&self) -> Status {
        if self.closed.is_some() {
            Status::Closed
        } else {
            Status::Open
        }
    }

    fn timing(&self) -> Timing {
        Timing {
            heartbeat: None,
            silence: self.keep_alive,
            deadline: None,
        }
    }

    fn heartbeat(&mut self, _out: &mut Out) -> Result<(), MqttError> {
        Ok(())
    }

    fn deadline(&mut self) {}

    fn shutdown(&mut self) {
        self.close(Closed::Shutdown);
    }

    fn has_published(&self) -> bool {
        self.published
    }

    fn more_ready(&self) -> bool {
        self.retained.ready(self.window_room() > 0)
    }

    /// Going idle (or after a burst that grew it past 1 MiB), the buffer is let go: an
    /// idle connection holds no write buffer, and `out` takes one again for the next
    /// write.
    fn release_buffers(&mut self) {
        if self.wbuf.is_empty() {
            self.wbuf = BytesMut::new();
        }
    }

    fn release_idle(&mut self) {
        self.packets.release_idle();
        self.topic_cache = None;
        if let Some(c) = &self.consumer {
            c.release_idle();
        }
        for (_, c) in &self.shared {
            c.release_idle();
        }
    }
}

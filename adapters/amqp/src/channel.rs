//! Channel state and the channel-level methods: channel, exchange, queue, basic, tx,
//! confirm. Content assembly (method + header + bodies) for basic.publish is here too.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use amq_protocol::frame::AMQPContentHeader;
use amq_protocol::protocol::{basic, channel, confirm, exchange, queue, tx, AMQPClass};
use bytes::{Bytes, BytesMut};
use triad_core::conns::{ChannelEntry, ChannelMode};
use triad_core::direct_reply::{REPLY_PREFIX, REPLY_TO};
use triad_core::{
    ChannelSlot, ConsumeRequest, ConsumerHandle, CoreError, CreditGate, Delivery, DirectReply,
    ExchangeDef, ExchangeKind, FieldTable, FieldValue, Link, MessageFilter, Properties, Publish,
    PublishTo, Queue, QueueDeclare, ReplyConsumer,
};

use crate::codec::{Frame, FRAME_OVERHEAD};
use crate::errors::{self, AmqpError, Scope};
use crate::mapping::{properties_from_wire, properties_to_wire, short, table_from_wire};
use crate::session::{Login, Session};

/// A delivery awaiting ack.
#[derive(Debug, Clone)]
pub(crate) struct Unacked {
    queue: Arc<Queue>,
    offset: u64,
}

#[derive(Debug)]
enum TxOp {
    Publish(Box<Publish>),
    Settle {
        entries: Vec<(u64, Unacked)>,
        ack: bool,
        requeue: bool,
    },
}

#[derive(Debug)]
enum Mode {
    Normal,
    Confirm { next_seq: u64 },
    Tx { ops: Vec<TxOp> },
}

#[derive(Debug)]
struct Content {
    /// Exchange and routing key, checked at `basic.publish`.
    to: PublishTo,
    mandatory: bool,
    properties: Option<Properties>,
    size: u64,
    body: BytesMut,
    first: Option<Bytes>,
}

/// Where a channel receives a message (`basic.publish`, then its header and body
/// frames): boxed, made by the first publish and kept for the next ones (no allocation
/// per message), let go when the connection goes idle ([`Channel::release_idle`]). A
/// `Content` is about 0.4 KiB, which every open channel carried inline, a consumer's
/// or an idle one's too.
#[derive(Debug, Default)]
struct Incoming(Option<Box<Option<Content>>>);

impl Incoming {
    fn is_some(&self) -> bool {
        self.0.as_ref().is_some_and(|b| b.is_some())
    }

    fn start(&mut self, c: Content) {
        match &mut self.0 {
            Some(b) => **b = Some(c),
            None => self.0 = Some(Box::new(Some(c))),
        }
    }

    fn as_mut(&mut self) -> Option<&mut Content> {
        self.0.as_deref_mut().and_then(Option::as_mut)
    }

    fn take(&mut self) -> Option<Content> {
        self.0.as_deref_mut().and_then(Option::take)
    }

    fn clear(&mut self) {
        if let Some(b) = &mut self.0 {
            **b = None;
        }
    }

    /// Lets go of the box unless a message is being received.
    fn release(&mut self) {
        if !self.is_some() {
            self.0 = None;
        }
    }
}

/// One open channel.
#[derive(Debug)]
pub struct Channel {
    closing: bool,
    /// The message being received (publish, header, body frames).
    content: Incoming,
    next_tag: u64,
    unacked: BTreeMap<u64, Unacked>,
    consumers: HashMap<Arc<str>, ConsumerHandle, crate::session::FastHash>,
    prefetch: u32,
    gate: Option<Arc<CreditGate>>,
    mode: Mode,
    last_queue: String,
    /// The channel's direct reply-to consumer (`amq.rabbitmq.reply-to`), at most one.
    reply: Option<ReplyConsumer>,
    /// Counted against the user's `max_channels` (`None`: the user has no such limit);
    /// given back when the channel goes.
    _slot: Option<ChannelSlot>,
    /// Its entry in the connection registry (`/api/channels`), when registered.
    entry: Option<ChannelEntry>,
}

impl Channel {
    /// Idle for a while: the consumed queues let go of what the last traffic left.
    pub(crate) fn release_idle(&mut self) {
        self.content.release();
        // an emptied BTreeMap keeps its root leaf (room for eleven unacked deliveries)
        if self.unacked.is_empty() {
            self.unacked = BTreeMap::new();
        }
        for c in self.consumers.values() {
            c.release_idle();
        }
    }

    fn new(slot: Option<ChannelSlot>, entry: Option<ChannelEntry>) -> Channel {
        Channel {
            closing: false,
            content: Incoming::default(),
            next_tag: 1,
            unacked: BTreeMap::new(),
            consumers: HashMap::default(),
            prefetch: 0,
            gate: None,
            mode: Mode::Normal,
            last_queue: String::new(),
            reply: None,
            _slot: slot,
            entry,
        }
    }

    /// Stores what `/api/channels` shows (relaxed stores, after each method).
    fn note_stats(&self) {
        let Some(e) = &self.entry else {
            return;
        };
        let s = e.stats();
        s.set_mode(match self.mode {
            Mode::Normal => ChannelMode::Normal,
            Mode::Confirm { .. } => ChannelMode::Confirm,
            Mode::Tx { .. } => ChannelMode::Tx,
        });
        s.set_prefetch(self.prefetch, false);
        s.set_prefetch(self.gate.as_ref().map_or(0, |g| g.limit()), true);
        s.set_consumers(self.consumers.len());
        s.set_unacked(self.unacked.len());
    }

    fn note_unacked(&self) {
        if let Some(e) = &self.entry {
            e.stats().set_unacked(self.unacked.len());
        }
    }

    /// Open and not waiting for close-ok.
    pub fn is_open(&self) -> bool {
        !self.closing
    }
}

/// A stream consumer's `x-stream-offset` and `x-stream-consumer-name` consume
/// arguments (RabbitMQ's); the core refuses them on a queue that is not a stream.
fn stream_consume(
    args: &triad_core::FieldTable,
) -> Result<triad_core::stream::StreamConsume, AmqpError> {
    let now = triad_core::stream::now_ms();
    let offset = args
        .get("x-stream-offset")
        .map(|v| triad_core::stream::StreamOffset::from_field(v, now))
        .transpose()?;
    let name = match args.get("x-stream-consumer-name") {
        None => None,
        Some(v) => Some(v.as_str().map(str::to_string).ok_or_else(|| {
            chan_err(
                errors::PRECONDITION_FAILED,
                "invalid arg 'x-stream-consumer-name': not a string",
            )
        })?),
    };
    Ok(triad_core::stream::StreamConsume { offset, name })
}

fn settle(entries: &[(u64, Unacked)], ack: bool, requeue: bool) {
    triad_core::link::settle(
        entries.iter().map(|(_, u)| (&u.queue, u.offset)),
        ack,
        requeue,
    );
}

fn chan_err(code: u16, detail: impl std::fmt::Display) -> AmqpError {
    AmqpError::channel(code, detail)
}

impl Session {
    /// The connection's link to the open vhost.
    fn open_link(&self) -> Result<&Link, AmqpError> {
        self.link()
            .ok_or_else(|| AmqpError::connection(errors::CHANNEL_ERROR, "no vhost"))
    }

    fn chan(&mut self, id: u16) -> Result<&mut Channel, AmqpError> {
        self.channels.get_mut(&id).map(|c| &mut **c).ok_or_else(|| {
            AmqpError::connection(errors::CHANNEL_ERROR, format!("channel {id} not open"))
        })
    }

    /// A method on channel `id` (≠ 0).
    pub(crate) fn channel_method(&mut self, id: u16, class: AMQPClass) -> Result<(), AmqpError> {
        let (cid, mid) = (class.get_amqp_class_id(), class.get_amqp_method_id());
        match &class {
            AMQPClass::Channel(channel::AMQPMethod::Open(_)) => {
                if id > self.channel_max {
                    return Err(AmqpError::connection(
                        errors::NOT_ALLOWED,
                        format!("channel {id} exceeds channel_max {}", self.channel_max),
                    )
                    .on(cid, mid));
                }
                if self.channels.contains_key(&id) {
                    return Err(AmqpError::connection(
                        errors::CHANNEL_ERROR,
                        format!("channel {id} already open"),
                    )
                    .on(cid, mid));
                }
                // the user's channel limit, checked before the channel is made
                let slot = self
                    .open_link()
                    .and_then(|l| l.open_channel().map_err(AmqpError::from))
                    .map_err(|e| e.on(cid, mid))?;
                let entry = triad_core::conns::open_channel(id);
                self.channels
                    .insert(id, Box::new(Channel::new(slot, entry)));
                self.send(
                    id,
                    AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
                );
                return Ok(());
            }
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                if self.channels.get(&id).is_some_and(|c| c.closing) {
                    self.channels.remove(&id);
                }
                return Ok(());
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(_)) => {
                if self.channels.contains_key(&id) {
                    self.release_channel(id);
                    self.channels.remove(&id);
                    self.send(
                        id,
                        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                    );
                    return Ok(());
                }
                return Err(AmqpError::connection(
                    errors::CHANNEL_ERROR,
                    format!("channel {id} not open"),
                )
                .on(cid, mid));
            }
            _ => {}
        }
        let ch = self.chan(id).map_err(|e| e.on(cid, mid))?;
        if ch.closing {
            // Dropped until close-ok, as the spec asks.
            return Ok(());
        }
        if ch.content.is_some() {
            return Err(AmqpError::connection(
                errors::UNEXPECTED_FRAME,
                "method frame while content was expected",
            )
            .on(cid, mid));
        }
        // A publish changes none of the figures the management API shows.
        let refresh = !matches!(&class, AMQPClass::Basic(basic::AMQPMethod::Publish(_)));
        let r = self.channel_method_inner(id, class);
        if refresh {
            if let Some(ch) = self.channels.get(&id) {
                ch.note_stats();
            }
        }
        match r {
            Ok(()) => Ok(()),
            Err(e) => {
                let e = e.on(cid, mid);
                match e.scope {
                    Scope::Connection => Err(e),
                    Scope::Channel => {
                        self.close_channel(id, e);
                        Ok(())
                    }
                }
            }
        }
    }

    /// Sends channel.close and releases the channel's core resources.
    fn close_channel(&mut self, id: u16, e: AmqpError) {
        tracing::debug!(conn = self.conn, channel = id, code = e.code, text = %e.text, "closing channel");
        self.release_channel(id);
        if let Some(ch) = self.channels.get_mut(&id) {
            ch.closing = true;
        }
        self.send(
            id,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: e.code,
                reply_text: short(&e.text),
                class_id: e.class_id,
                method_id: e.method_id,
            })),
        );
    }

    /// Cancels the channel's consumers and requeues its unacked deliveries.
    pub(crate) fn release_channel(&mut self, id: u16) {
        self.confirms.forget_channel(id);
        let Some(ch) = self.channels.get_mut(&id) else {
            return;
        };
        ch.content.clear();
        let reply = ch.reply.take();
        let consumers: Vec<_> = ch.consumers.drain().collect();
        let unacked: Vec<_> = std::mem::take(&mut ch.unacked).into_iter().collect();
        let tx_settles: Vec<_> = match std::mem::replace(&mut ch.mode, Mode::Normal) {
            Mode::Tx { ops } => ops
                .into_iter()
                .filter_map(|op| match op {
                    TxOp::Settle { entries, .. } => Some(entries),
                    TxOp::Publish(_) => None,
                })
                .flatten()
                .collect(),
            _ => Vec::new(),
        };
        ch.note_stats();
        if let Some(r) = reply {
            // dropped: its name is retired
            self.consumer_channels.remove(r.tag());
        }
        for (tag, handle) in consumers {
            handle.cancel();
            self.consumer_channels.remove(&tag);
        }
        settle(&unacked, false, true);
        settle(&tx_settles, false, true);
    }

    fn channel_method_inner(&mut self, id: u16, class: AMQPClass) -> Result<(), AmqpError> {
        match class {
            // RabbitMQ (since 3.3) does not let clients stop deliveries with channel.flow:
            // active=false is a NOT_IMPLEMENTED connection error, never a silent flow-ok
            AMQPClass::Channel(channel::AMQPMethod::Flow(f)) if !f.active => {
                Err(AmqpError::connection(errors::NOT_IMPLEMENTED, "active=false").on(20, 20))
            }
            AMQPClass::Channel(channel::AMQPMethod::Flow(f)) => {
                self.send(
                    id,
                    AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
                        active: f.active,
                    })),
                );
                Ok(())
            }
            AMQPClass::Exchange(m) => self.exchange_method(id, m),
            AMQPClass::Queue(m) => self.queue_method(id, m),
            AMQPClass::Basic(m) => self.basic_method(id, m),
            AMQPClass::Confirm(confirm::AMQPMethod::Select(s)) => {
                let ch = self.chan(id)?;
                match ch.mode {
                    Mode::Tx { .. } => {
                        return Err(chan_err(
                            errors::PRECONDITION_FAILED,
                            "cannot switch from tx to confirm mode",
                        ))
                    }
                    Mode::Normal => ch.mode = Mode::Confirm { next_seq: 1 },
                    Mode::Confirm { .. } => {}
                }
                if !s.nowait {
                    self.send(
                        id,
                        AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
                    );
                }
                Ok(())
            }
            AMQPClass::Tx(m) => self.tx_method(id, m),
            AMQPClass::Access(_) => Err(AmqpError::connection(
                errors::COMMAND_INVALID,
                "access class is not supported",
            )),
            _ => Err(AmqpError::connection(
                errors::COMMAND_INVALID,
                "unexpected method",
            )),
        }
    }

    fn exchange_method(&mut self, id: u16, m: exchange::AMQPMethod) -> Result<(), AmqpError> {
        let link = self.open_link()?;
        let (reply, nowait) = match m {
            exchange::AMQPMethod::Declare(d) => {
                let kind = if d.passive {
                    d.kind.as_str().parse().unwrap_or(ExchangeKind::Direct)
                } else {
                    triad_core::delayed::exchange_kind(
                        d.kind.as_str(),
                        &table_from_wire(&d.arguments),
                    )?
                };
                let def = ExchangeDef {
                    name: d.exchange.as_str().to_owned(),
                    kind,
                    durable: d.durable,
                    auto_delete: d.auto_delete,
                    internal: d.internal,
                    arguments: table_from_wire(&d.arguments),
                };
                link.declare_exchange(def, d.passive)?;
                (
                    exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {}),
                    d.nowait,
                )
            }
            exchange::AMQPMethod::Delete(d) => {
                link.delete_exchange(d.exchange.as_str(), d.if_unused)?;
                (
                    exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {}),
                    d.nowait,
                )
            }
            exchange::AMQPMethod::Bind(b) => {
                link.bind_exchange(
                    b.destination.as_str(),
                    b.source.as_str(),
                    b.routing_key.as_str(),
                    &table_from_wire(&b.arguments),
                )?;
                (exchange::AMQPMethod::BindOk(exchange::BindOk {}), b.nowait)
            }
            exchange::AMQPMethod::Unbind(b) => {
                link.unbind_exchange(
                    b.destination.as_str(),
                    b.source.as_str(),
                    b.routing_key.as_str(),
                    &table_from_wire(&b.arguments),
                )?;
                (
                    exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {}),
                    b.nowait,
                )
            }
            _ => {
                return Err(AmqpError::connection(
                    errors::COMMAND_INVALID,
                    "unexpected exchange method",
                ))
            }
        };
        if !nowait {
            self.send(id, AMQPClass::Exchange(reply));
        }
        Ok(())
    }

    fn queue_name(&mut self, id: u16, given: &str) -> Result<String, AmqpError> {
        if !given.is_empty() {
            return Ok(given.to_owned());
        }
        let last = self.chan(id)?.last_queue.clone();
        if last.is_empty() {
            return Err(chan_err(errors::NOT_FOUND, "no previously declared queue"));
        }
        Ok(last)
    }

    fn queue_method(&mut self, id: u16, m: queue::AMQPMethod) -> Result<(), AmqpError> {
        let (reply, nowait) = match m {
            // as RabbitMQ: the reply pseudo-queue, and a live channel's reply name, are
            // there (0 messages, 1 consumer) for a passive or active declare
            queue::AMQPMethod::Declare(d)
                if d.queue.as_str() == REPLY_TO
                    || (d.queue.as_str().starts_with(REPLY_PREFIX)
                        && self
                            .open_link()?
                            .vhost()
                            .direct_replies()
                            .contains(d.queue.as_str())) =>
            {
                (
                    queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                        queue: d.queue.clone(),
                        message_count: 0,
                        consumer_count: 1,
                    }),
                    d.nowait,
                )
            }
            queue::AMQPMethod::Declare(d) => {
                let name = if d.passive && d.queue.as_str().is_empty() {
                    self.queue_name(id, "")?
                } else {
                    d.queue.as_str().to_owned()
                };
                let ok = self.open_link()?.declare_queue(QueueDeclare {
                    name,
                    passive: d.passive,
                    durable: d.durable,
                    exclusive: d.exclusive,
                    auto_delete: d.auto_delete,
                    arguments: table_from_wire(&d.arguments),
                    ..Default::default()
                })?;
                self.chan(id)?.last_queue = ok.name.clone();
                (
                    queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                        queue: short(&ok.name),
                        message_count: ok.message_count,
                        consumer_count: ok.consumer_count,
                    }),
                    d.nowait,
                )
            }
            queue::AMQPMethod::Bind(b) => {
                let q = self.queue_name(id, b.queue.as_str())?;
                self.open_link()?.bind_queue(
                    &q,
                    b.exchange.as_str(),
                    b.routing_key.as_str(),
                    &table_from_wire(&b.arguments),
                )?;
                (queue::AMQPMethod::BindOk(queue::BindOk {}), b.nowait)
            }
            queue::AMQPMethod::Unbind(b) => {
                let q = self.queue_name(id, b.queue.as_str())?;
                self.open_link()?.unbind_queue(
                    &q,
                    b.exchange.as_str(),
                    b.routing_key.as_str(),
                    &table_from_wire(&b.arguments),
                )?;
                (queue::AMQPMethod::UnbindOk(queue::UnbindOk {}), false)
            }
            queue::AMQPMethod::Purge(p) => {
                let q = self.queue_name(id, p.queue.as_str())?;
                let n = self.open_link()?.purge_queue(&q)?;
                (
                    queue::AMQPMethod::PurgeOk(queue::PurgeOk { message_count: n }),
                    p.nowait,
                )
            }
            queue::AMQPMethod::Delete(d) => {
                let q = self.queue_name(id, d.queue.as_str())?;
                let n = self
                    .open_link()?
                    .delete_queue(&q, d.if_unused, d.if_empty)?;
                (
                    queue::AMQPMethod::DeleteOk(queue::DeleteOk { message_count: n }),
                    d.nowait,
                )
            }
            _ => {
                return Err(AmqpError::connection(
                    errors::COMMAND_INVALID,
                    "unexpected queue method",
                ))
            }
        };
        if !nowait {
            self.send(id, AMQPClass::Queue(reply));
        }
        Ok(())
    }

    fn basic_method(&mut self, id: u16, m: basic::AMQPMethod) -> Result<(), AmqpError> {
        match m {
            basic::AMQPMethod::Qos(q) => self.basic_qos(id, q),
            basic::AMQPMethod::Consume(c) => self.consume(id, c),
            basic::AMQPMethod::Cancel(c) => self.basic_cancel(id, c),
            // as RabbitMQ (since 3.0): immediate delivery is not offered, and saying so
            // closes the connection (540 NOT_IMPLEMENTED - immediate=true)
            basic::AMQPMethod::Publish(p) if p.immediate => {
                Err(AmqpError::connection(errors::NOT_IMPLEMENTED, "immediate=true").on(60, 40))
            }
            basic::AMQPMethod::Publish(p) => {
                // Refused here, the channel closes and the content frames that follow
                // are dropped.
                let to = self.open_link()?.check_publish(
                    p.exchange.as_str().to_owned(),
                    p.routing_key.as_str().to_owned(),
                )?;
                let ch = self.chan(id)?;
                ch.content.start(Content {
                    to,
                    mandatory: p.mandatory,
                    properties: None,
                    size: 0,
                    body: BytesMut::new(),
                    first: None,
                });
                Ok(())
            }
            basic::AMQPMethod::Get(g) => self.basic_get(id, g),
            basic::AMQPMethod::Ack(a) => {
                self.settle_tags(id, a.delivery_tag, a.multiple, true, false)
            }
            basic::AMQPMethod::Nack(n) => {
                self.settle_tags(id, n.delivery_tag, n.multiple, false, n.requeue)
            }
            basic::AMQPMethod::Reject(r) => {
                self.settle_tags(id, r.delivery_tag, false, false, r.requeue)
            }
            // as RabbitMQ: redelivery to the same consumer (requeue=false) is not offered
            basic::AMQPMethod::Recover(r) if !r.requeue => {
                Err(AmqpError::connection(errors::NOT_IMPLEMENTED, "requeue=false").on(60, 110))
            }
            basic::AMQPMethod::RecoverAsync(r) if !r.requeue => {
                Err(AmqpError::connection(errors::NOT_IMPLEMENTED, "requeue=false").on(60, 100))
            }
            basic::AMQPMethod::Recover(_) => self.basic_recover(id, true),
            basic::AMQPMethod::RecoverAsync(_) => self.basic_recover(id, false),
            _ => Err(AmqpError::connection(
                errors::COMMAND_INVALID,
                "unexpected basic method",
            )),
        }
    }

    /// `basic.qos`: the channel's prefetch (per consumer) or, `global`, its shared gate.
    fn basic_qos(&mut self, id: u16, q: basic::Qos) -> Result<(), AmqpError> {
        let ch = self.chan(id)?;
        let n = u32::from(q.prefetch_count);
        if q.global {
            match &ch.gate {
                Some(g) => g.set_limit(n),
                None => ch.gate = Some(CreditGate::new(n)),
            }
        } else {
            ch.prefetch = n;
        }
        self.send(
            id,
            AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
        );
        Ok(())
    }

    /// `basic.cancel`: ends the consumer (or the direct reply-to one) with that tag.
    fn basic_cancel(&mut self, id: u16, c: basic::Cancel) -> Result<(), AmqpError> {
        let tag: Arc<str> = Arc::from(c.consumer_tag.as_str());
        let ch = self.chan(id)?;
        if let Some(h) = ch.consumers.remove(&tag) {
            h.cancel();
            self.consumer_channels.remove(&tag);
        } else if ch.reply.as_ref().is_some_and(|r| *r.tag() == tag) {
            ch.reply = None;
            self.consumer_channels.remove(&tag);
        }
        if !c.nowait {
            self.send(
                id,
                AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                    consumer_tag: c.consumer_tag,
                })),
            );
        }
        Ok(())
    }

    /// `basic.get`: one message (get-ok with its content) or get-empty.
    fn basic_get(&mut self, id: u16, g: basic::Get) -> Result<(), AmqpError> {
        let q = self.queue_name(id, g.queue.as_str())?;
        match self.open_link()?.get(&q, g.no_ack)? {
            None => self.send(
                id,
                AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
            ),
            Some(d) => {
                let ch = self.chan(id)?;
                let tag = ch.next_tag;
                ch.next_tag += 1;
                if d.needs_ack {
                    ch.unacked.insert(
                        tag,
                        Unacked {
                            queue: d.queue.clone(),
                            offset: d.offset,
                        },
                    );
                }
                let m = basic::AMQPMethod::GetOk(basic::GetOk {
                    delivery_tag: tag,
                    redelivered: d.redelivered,
                    exchange: short(&d.exchange),
                    routing_key: short(&d.routing_key),
                    message_count: d.message_count,
                });
                self.send_content(id, m, &d.properties, &d.body);
            }
        }
        Ok(())
    }

    /// `basic.recover` (`sync`, answered with recover-ok) or `basic.recover-async` with
    /// `requeue`: every unacked delivery of the channel goes back to its queue.
    fn basic_recover(&mut self, id: u16, sync: bool) -> Result<(), AmqpError> {
        let ch = self.chan(id)?;
        let all: Vec<_> = std::mem::take(&mut ch.unacked).into_iter().collect();
        settle(&all, false, true);
        if sync {
            self.send(
                id,
                AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
            );
        }
        Ok(())
    }

    fn consume(&mut self, id: u16, c: basic::Consume) -> Result<(), AmqpError> {
        let q = self.queue_name(id, c.queue.as_str())?;
        if q != REPLY_TO {
            self.open_link()?.access().consume(&q)?;
        }
        let tag = if c.consumer_tag.as_str().is_empty() {
            self.ctag_seq += 1;
            format!("amq.ctag-{}-{}", self.conn, self.ctag_seq)
        } else {
            c.consumer_tag.as_str().to_owned()
        };
        if self.consumer_channels.contains_key(tag.as_str()) {
            return Err(AmqpError::connection(
                errors::NOT_ALLOWED,
                format!("attempt to reuse consumer tag '{tag}'"),
            ));
        }
        if q == REPLY_TO {
            return self.consume_replies(id, tag, &c);
        }
        let args = table_from_wire(&c.arguments);
        let priority = args
            .get("x-priority")
            .and_then(FieldValue::as_i64)
            .map(|p| p.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32)
            .unwrap_or(0);
        let filter = consume_filter(&args)?;
        let (prefetch, gate) = {
            let ch = self.chan(id)?;
            (ch.prefetch, ch.gate.clone())
        };
        let stream = stream_consume(&args)?;
        let req = ConsumeRequest {
            tag: tag.clone(),
            no_ack: c.no_ack,
            exclusive: c.exclusive,
            prefetch,
            priority,
            conn: self.conn,
            outbox: self.outbox.clone(),
            gate,
            filter,
        };
        // Send consume-ok before the core can hand us a delivery for this consumer:
        // deliveries only reach the wire after this frame is handled.
        if !c.nowait {
            self.send(
                id,
                AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                    consumer_tag: short(&tag),
                })),
            );
        }
        let handle = match self.open_link()?.consume_stream(&q, req, stream) {
            Ok(h) => h,
            Err(e) => {
                if !c.nowait {
                    self.out.pop();
                }
                return Err(e.into());
            }
        };
        let key: Arc<str> = handle.tag().clone();
        self.consumer_channels.insert(key.clone(), id);
        self.chan(id)?.consumers.insert(key, handle);
        Ok(())
    }

    /// basic.consume from `amq.rabbitmq.reply-to` (direct reply-to), with RabbitMQ's
    /// refusals: an acking consumer, a second one on the channel (both 406).
    fn consume_replies(
        &mut self,
        id: u16,
        tag: String,
        c: &basic::Consume,
    ) -> Result<(), AmqpError> {
        if !c.no_ack {
            return Err(chan_err(
                errors::PRECONDITION_FAILED,
                "reply consumer cannot acknowledge",
            ));
        }
        if self.chan(id)?.reply.is_some() {
            return Err(chan_err(
                errors::PRECONDITION_FAILED,
                "reply consumer already set",
            ));
        }
        let tag: Arc<str> = Arc::from(tag);
        let reply = self
            .open_link()?
            .consume_direct_reply(tag.clone(), &self.outbox.clone())?;
        self.chan(id)?.reply = Some(reply);
        self.consumer_channels.insert(tag.clone(), id);
        if !c.nowait {
            self.send(
                id,
                AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                    consumer_tag: short(&tag),
                })),
            );
        }
        Ok(())
    }

    /// A direct reply-to reply for this connection's reply consumer; dropped when that
    /// consumer has gone meanwhile (as RabbitMQ, replies are at most once).
    pub(crate) fn deliver_reply(&mut self, r: DirectReply) {
        let Some(id) = self.consumer_channels.get(&r.tag).copied() else {
            return;
        };
        let Some(ch) = self.channels.get_mut(&id).map(|c| &mut **c) else {
            return;
        };
        if !ch.is_open() || ch.reply.as_ref().is_none_or(|c| *c.tag() != r.tag) {
            return;
        }
        let tag = ch.next_tag;
        ch.next_tag += 1;
        let m = basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: short(&r.tag),
            delivery_tag: tag,
            redelivered: false,
            exchange: short(""),
            routing_key: short(&r.routing_key),
        });
        self.send_content(id, m, &r.properties, &r.body);
    }

    fn settle_tags(
        &mut self,
        id: u16,
        tag: u64,
        multiple: bool,
        ack: bool,
        requeue: bool,
    ) -> Result<(), AmqpError> {
        let ch = self.chan(id)?;
        let entries: Vec<(u64, Unacked)> = if multiple {
            let upto = if tag == 0 { u64::MAX } else { tag };
            if tag != 0 && !ch.unacked.contains_key(&tag) {
                return Err(chan_err(
                    errors::PRECONDITION_FAILED,
                    format!("unknown delivery tag {tag}"),
                ));
            }
            let keys: Vec<u64> = ch.unacked.range(..=upto).map(|(k, _)| *k).collect();
            keys.into_iter()
                .filter_map(|k| ch.unacked.remove(&k).map(|u| (k, u)))
                .collect()
        } else {
            match ch.unacked.remove(&tag) {
                Some(u) => vec![(tag, u)],
                None => {
                    return Err(chan_err(
                        errors::PRECONDITION_FAILED,
                        format!("unknown delivery tag {tag}"),
                    ))
                }
            }
        };
        if let Mode::Tx { ops } = &mut ch.mode {
            ops.push(TxOp::Settle {
                entries,
                ack,
                requeue,
            });
        } else {
            settle(&entries, ack, requeue);
        }
        Ok(())
    }

    fn tx_method(&mut self, id: u16, m: tx::AMQPMethod) -> Result<(), AmqpError> {
        let ch = self.chan(id)?;
        let not_tx = || chan_err(errors::PRECONDITION_FAILED, "channel is not transactional");
        match m {
            tx::AMQPMethod::Select(_) => {
                match ch.mode {
                    Mode::Confirm { .. } => {
                        return Err(chan_err(
                            errors::PRECONDITION_FAILED,
                            "cannot switch from confirm to tx mode",
                        ))
                    }
                    Mode::Normal => ch.mode = Mode::Tx { ops: Vec::new() },
                    Mode::Tx { .. } => {}
                }
                self.send(id, AMQPClass::Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})));
            }
            tx::AMQPMethod::Commit(_) => {
                let Mode::Tx { ops } = &mut ch.mode else {
                    return Err(not_tx());
                };
                let ops = std::mem::take(ops);
                self.commit(id, ops)?;
            }
            tx::AMQPMethod::Rollback(_) => {
                let Mode::Tx { ops } = &mut ch.mode else {
                    return Err(not_tx());
                };
                for op in std::mem::take(ops) {
                    if let TxOp::Settle { entries, .. } = op {
                        ch.unacked.extend(entries);
                    }
                }
                self.send(
                    id,
                    AMQPClass::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {})),
                );
            }
            _ => {
                return Err(AmqpError::connection(
                    errors::COMMAND_INVALID,
                    "unexpected tx method",
                ))
            }
        }
        Ok(())
    }

    /// `tx.commit`: every publish is routed before any is stored and no ack is applied
    /// unless all of them were (on an error the acks go back to the channel's unacked
    /// set, to be requeued when it closes); `tx.commit-ok` waits, in the confirm FIFO,
    /// until the transaction's persistent messages are on disk, as confirms do.
    fn commit(&mut self, id: u16, ops: Vec<TxOp>) -> Result<(), AmqpError> {
        let mut publishes = Vec::new();
        let mut returns = Vec::new();
        let mut settles = Vec::new();
        for op in ops {
            match op {
                TxOp::Publish(p) => {
                    returns.push(p.mandatory.then(|| {
                        (
                            p.exchange.clone(),
                            p.routing_key.clone(),
                            p.properties.clone(),
                            p.body.clone(),
                        )
                    }));
                    publishes.push(*p);
                }
                TxOp::Settle {
                    entries,
                    ack,
                    requeue,
                } => settles.push((entries, ack, requeue)),
            }
        }
        let results = match self.open_link()?.publish_all(publishes) {
            Ok(r) => r,
            Err(e) => {
                let ch = self.chan(id)?;
                for (entries, ..) in settles {
                    ch.unacked.extend(entries);
                }
                return Err(e.into());
            }
        };
        let mut durable: Vec<crate::confirms::CommitWait> = Vec::new();
        for (res, ret) in results.into_iter().zip(returns) {
            if let (false, Some((ex, rk, props, body))) = (res.routed, ret) {
                self.send_return(id, &ex, &rk, &props, &body);
            }
            if let Some(d) = res.durable {
                durable.push(Box::pin(async move { d.await.is_ok() }));
            }
        }
        for (entries, ack, requeue) in settles {
            settle(&entries, ack, requeue);
        }
        if durable.is_empty() && self.confirms.is_empty() {
            self.send(id, AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})));
        } else {
            self.confirms.push_commit(id, durable);
        }
        Ok(())
    }

    /// The transaction committed on channel `id` is durable (`ok`), or the store failed.
    pub(crate) fn on_commit_durable(&mut self, id: u16, ok: bool) {
        if !self.channels.get(&id).is_some_and(|c| c.is_open()) {
            return;
        }
        if ok {
            self.send(id, AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})));
        } else {
            self.close_connection(AmqpError::connection(
                errors::INTERNAL_ERROR,
                "the store failed to make the transaction durable",
            ));
        }
    }

    /// A content header frame on channel `id`.
    pub(crate) fn content_header(
        &mut self,
        id: u16,
        h: AMQPContentHeader,
    ) -> Result<(), AmqpError> {
        let max = self.cfg.max_message_size;
        let ch = self.chan(id)?;
        if ch.closing {
            return Ok(());
        }
        let Some(c) = ch.content.as_mut() else {
            return Err(AmqpError::connection(
                errors::UNEXPECTED_FRAME,
                "content header without basic.publish",
            ));
        };
        if c.properties.is_some() {
            return Err(AmqpError::connection(
                errors::UNEXPECTED_FRAME,
                "second content header",
            ));
        }
        if h.class_id != 60 {
            return Err(AmqpError::connection(
                errors::UNEXPECTED_FRAME,
                "content header of a class other than basic",
            ));
        }
        if h.body_size > max {
            ch.content.clear();
            let e = chan_err(
                errors::PRECONDITION_FAILED,
                format!(
                    "message size {} is larger than configured max size {max}",
                    h.body_size
                ),
            )
            .on(60, 40);
            self.close_channel(id, e);
            // Its body frames will be dropped: the channel is closing.
            return Ok(());
        }
        c.properties = Some(properties_from_wire(&h.properties));
        c.size = h.body_size;
        if h.body_size == 0 {
            self.finish_publish(id);
        }
        Ok(())
    }

    /// A content body frame on channel `id`.
    pub(crate) fn content_body(&mut self, id: u16, body: Bytes) -> Result<(), AmqpError> {
        let ch = self.chan(id)?;
        if ch.closing {
            return Ok(());
        }
        let Some(c) = ch.content.as_mut().filter(|c| c.properties.is_some()) else {
            return Err(AmqpError::connection(
                errors::UNEXPECTED_FRAME,
                "content body without content header",
            ));
        };
        let have = c.first.as_ref().map_or(0, |b| b.len()) + c.body.len();
        let total = have as u64 + body.len() as u64;
        if total > c.size {
            return Err(AmqpError::connection(
                errors::UNEXPECTED_FRAME,
                "content body exceeds the declared size",
            ));
        }
        if have == 0 && total == c.size {
            c.first = Some(body);
        } else {
            if let Some(first) = c.first.take() {
                c.body
                    .reserve(usize::try_from(c.size).unwrap_or(0).min(1 << 20));
                c.body.extend_from_slice(&first);
            }
            if c.body.capacity() == 0 {
                c.body
                    .reserve(usize::try_from(c.size).unwrap_or(0).min(1 << 20));
            }
            c.body.extend_from_slice(&body);
        }
        if total == c.size {
            self.finish_publish(id);
        }
        Ok(())
    }

    fn finish_publish(&mut self, id: u16) {
        if let Err(e) = self.publish(id) {
            let e = e.on(60, 40);
            match e.scope {
                Scope::Channel => self.close_channel(id, e),
                Scope::Connection => self.close_connection(e),
            }
        }
    }

    fn publish(&mut self, id: u16) -> Result<(), AmqpError> {
        // the link and the channel are distinct fields: borrowed together
        let Login::Open(link) = &self.login else {
            return Err(AmqpError::connection(errors::CHANNEL_ERROR, "no vhost"));
        };
        let ch = self
            .channels
            .get_mut(&id)
            .map(|c| &mut **c)
            .ok_or_else(|| {
                AmqpError::connection(errors::CHANNEL_ERROR, format!("channel {id} not open"))
            })?;
        let Some(c) = ch.content.take() else {
            return Ok(());
        };
        let mut properties = c.properties.unwrap_or_default();
        if properties.reply_to.as_deref() == Some(REPLY_TO) {
            // direct reply-to: the channel's own reply name, if it consumes replies
            let Some(r) = &ch.reply else {
                return Err(chan_err(
                    errors::PRECONDITION_FAILED,
                    "fast reply consumer does not exist",
                ));
            };
            properties.reply_to = Some(r.name().to_string());
        }
        if let Some(uid) = &properties.user_id {
            let user = link.user();
            if uid != user {
                return Err(chan_err(
                    errors::PRECONDITION_FAILED,
                    format!("user_id property set to '{uid}' but authenticated user was '{user}'"),
                ));
            }
        }
        let body = match c.first {
            Some(b) => b,
            None => c.body.freeze(),
        };
        let seq = match &mut ch.mode {
            Mode::Tx { .. } => None,
            Mode::Confirm { next_seq } => {
                let seq = *next_seq;
                *next_seq += 1;
                Some(seq)
            }
            Mode::Normal => None,
        };
        let to = c.to;
        if let Mode::Tx { ops } = &mut ch.mode {
            if !link.vhost().has_exchange(to.exchange()) {
                return Err(triad_core::CoreError::exchange_not_found(to.exchange()).into());
            }
            ops.push(TxOp::Publish(Box::new(to.into_publish(
                c.mandatory,
                properties,
                body,
            ))));
            return Ok(());
        }
        let ret = c.mandatory.then(|| {
            (
                to.exchange().to_owned(),
                to.routing_key().to_owned(),
                properties.clone(),
                body.clone(),
            )
        });
        // checked at basic.publish: not again
        let res = link.publish_checked(to, c.mandatory, properties, body)?;
        if let (false, Some((ex, rk, props, body))) = (res.routed, ret) {
            self.send_return(id, &ex, &rk, &props, &body);
        }
        // a throttled queue holds the confirm (or, without confirms, what follows)
        match (seq, res.backpressure) {
            (Some(seq), flow) => self
                .confirms
                .push(id, seq, !res.rejected, res.durable, flow),
            (None, Some(flow)) => self.confirms.push_hold(flow),
            (None, None) => {}
        }
        Ok(())
    }

    fn send_return(&mut self, id: u16, ex: &str, rk: &str, props: &Properties, body: &Bytes) {
        let m = basic::AMQPMethod::Return(basic::Return {
            reply_code: errors::NO_ROUTE,
            reply_text: short("NO_ROUTE"),
            exchange: short(ex),
            routing_key: short(rk),
        });
        self.send_content(id, m, props, body);
    }

    /// Sends a content-bearing method, its header and its body split to frame_max.
    fn send_content(&mut self, id: u16, m: basic::AMQPMethod, props: &Properties, body: &Bytes) {
        self.send(id, AMQPClass::Basic(m));
        self.out.push(Frame::Header(
            id,
            Box::new(AMQPContentHeader {
                class_id: 60,
                body_size: body.len() as u64,
                properties: properties_to_wire(props),
            }),
        ));
        let chunk = (self.frame_max as usize)
            .saturating_sub(FRAME_OVERHEAD)
            .max(1);
        let mut rest = body.clone();
        while !rest.is_empty() {
            let part = rest.split_to(chunk.min(rest.len()));
            self.out.push(Frame::Body(id, part));
        }
    }

    /// A delivery from the core to one of our consumers.
    pub(crate) fn deliver(&mut self, d: Delivery) {
        let id = self.consumer_channels.get(&d.tag).copied();
        let ch = id.and_then(|id| self.channels.get_mut(&id).map(|c| (id, c)));
        let Some((id, ch)) = ch.filter(|(_, c)| c.is_open() && c.consumers.contains_key(&d.tag))
        else {
            // Consumer gone (cancelled, channel closed): give the message back.
            if d.needs_ack {
                d.queue.requeue_unsent(&[d.offset]);
            }
            return;
        };
        let tag = ch.next_tag;
        ch.next_tag += 1;
        if d.needs_ack {
            ch.unacked.insert(
                tag,
                Unacked {
                    queue: d.queue.clone(),
                    offset: d.offset,
                },
            );
            ch.note_unacked();
        }
        let m = basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: short(&d.tag),
            delivery_tag: tag,
            redelivered: d.redelivered,
            exchange: short(&d.exchange),
            routing_key: short(&d.routing_key),
        });
        self.send_content(id, m, &d.properties, &d.body);
    }

    /// The core cancelled a consumer (its queue was deleted): basic.cancel to the client.
    pub(crate) fn server_cancel(&mut self, tag: &Arc<str>) {
        let Some(id) = self.consumer_channels.remove(tag) else {
            return;
        };
        if let Some(ch) = self.channels.get_mut(&id) {
            ch.consumers.remove(tag);
            ch.note_stats();
            if ch.is_open() {
                self.send(
                    id,
                    AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                        consumer_tag: short(tag),
                        nowait: true,
                    })),
                );
            }
        }
    }
}

/// The consumer's message filter from `basic.consume` arguments `x-selector` (SQL92,
/// JMS syntax) and `x-tag-filter` (`a || b`): a malformed one, or one that is not a
/// string, is refused with 406 PRECONDITION_FAILED naming the problem (as RabbitMQ
/// refuses a bad `x-priority`), before consume-ok.
fn consume_filter(args: &FieldTable) -> Result<Option<Arc<MessageFilter>>, AmqpError> {
    let text = |name: &str| match args.get(name) {
        None => Ok(None),
        Some(v) => v.as_str().map(Some).ok_or_else(|| {
            CoreError::PreconditionFailed(format!(
                "invalid arg '{name}' for basic.consume: not a string"
            ))
        }),
    };
    Ok(MessageFilter::compile(
        text("x-selector")?,
        text("x-tag-filter")?,
    )?)
}

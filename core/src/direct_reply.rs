//! Direct reply-to (RabbitMQ's `amq.rabbitmq.reply-to`): RPC replies that go straight
//! to the requesting channel's consumer, without a queue and without being stored.
//!
//! A channel consumes from the pseudo-queue [`REPLY_TO`] (no-ack only) and gets a
//! [`ReplyConsumer`], which owns one name `amq.rabbitmq.reply-to.<conn>.<key>`: `conn`
//! is the connection's id and `key` 128 random bits (base64url), so a name cannot be
//! guessed or forged into another channel's. The adapter writes that name into the
//! `reply_to` of what the channel publishes with `reply_to = amq.rabbitmq.reply-to`.
//! A publish to the default exchange with that name as routing key is handed to the
//! consumer's connection as an [`OutEvent::Reply`]: at most once, never stored, never
//! acked (as RabbitMQ: the reply is lost if the requester has gone).
//!
//! Names live in their vhost's [`Registry`]: a name is unknown in every other vhost.
//! Cost: one entry (the name, the tag, a weak outbox pointer: about 120 bytes) per
//! channel that consumes replies, removed when the [`ReplyConsumer`] is dropped
//! (basic.cancel, channel or connection closed); nothing is kept per reply. A reply to a
//! connection whose outbox is full is dropped (unroutable: returned when mandatory), so
//! a requester that does not read cannot grow the broker's memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use base64::Engine as _;
use bytes::Bytes;
use ring::rand::{SecureRandom, SystemRandom};

use crate::message::Properties;
use crate::outbox::{OutEvent, Outbox};
use crate::ConnectionId;

/// The pseudo-queue a channel consumes replies from, and the `reply_to` value that the
/// broker rewrites to the channel's own name.
pub const REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// The prefix of every channel's reply name.
pub const REPLY_PREFIX: &str = "amq.rabbitmq.reply-to.";

/// A reply for a direct reply-to consumer.
#[derive(Debug, Clone)]
pub struct DirectReply {
    /// The consumer's tag.
    pub tag: Arc<str>,
    /// The name it was published to (routing key; exchange is the default one).
    pub routing_key: Arc<str>,
    /// Its properties.
    pub properties: Arc<Properties>,
    /// Its body.
    pub body: Bytes,
}

#[derive(Debug)]
struct Entry {
    conn: ConnectionId,
    tag: Arc<str>,
    outbox: Weak<Outbox>,
}

/// A vhost's reply names.
#[derive(Debug, Default)]
pub struct Registry {
    names: Mutex<HashMap<Arc<str>, Entry, foldhash::fast::RandomState>>,
}

impl Registry {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Entry, foldhash::fast::RandomState>> {
        self.names.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a consumer: its new, unguessable name.
    pub(crate) fn register(
        self: &Arc<Self>,
        conn: ConnectionId,
        tag: Arc<str>,
        outbox: &Arc<Outbox>,
    ) -> Result<ReplyConsumer, crate::CoreError> {
        let mut key = [0u8; 16];
        SystemRandom::new()
            .fill(&mut key)
            .map_err(|_| crate::CoreError::Internal("no random numbers".into()))?;
        let name: Arc<str> = Arc::from(format!(
            "{REPLY_PREFIX}{conn}.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key)
        ));
        self.lock().insert(
            name.clone(),
            Entry {
                conn,
                tag: tag.clone(),
                outbox: Arc::downgrade(outbox),
            },
        );
        Ok(ReplyConsumer {
            registry: self.clone(),
            name,
            tag,
        })
    }

    /// Whether `name` belongs to a live reply consumer.
    pub fn contains(&self, name: &str) -> bool {
        self.lock().contains_key(name)
    }

    /// Hands a reply to the consumer named `name`; `false`: no such consumer (gone,
    /// never was, another vhost's) or its connection's outbox is full.
    pub(crate) fn deliver(&self, name: &str, properties: Properties, body: &Bytes) -> bool {
        let (tag, routing_key, outbox) = {
            let g = self.lock();
            let Some((k, e)) = g.get_key_value(name) else {
                return false;
            };
            let Some(outbox) = e.outbox.upgrade() else {
                return false;
            };
            (e.tag.clone(), k.clone(), outbox)
        };
        outbox.push(OutEvent::Reply(DirectReply {
            tag,
            routing_key,
            properties: Arc::new(properties),
            body: body.clone(),
        }))
    }

    fn remove(&self, name: &str) {
        self.lock().remove(name);
    }

    /// Reply consumers registered (tests, metrics).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The connection a name belongs to, if it is live.
    pub fn owner(&self, name: &str) -> Option<ConnectionId> {
        self.lock().get(name).map(|e| e.conn)
    }
}

/// A channel's direct reply-to consumer; dropping it (basic.cancel, channel or
/// connection closed) retires its name.
#[derive(Debug)]
pub struct ReplyConsumer {
    registry: Arc<Registry>,
    name: Arc<str>,
    tag: Arc<str>,
}

impl ReplyConsumer {
    /// `amq.rabbitmq.reply-to.<conn>.<key>`: what `reply_to` is rewritten to.
    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// The consumer's tag.
    pub fn tag(&self) -> &Arc<str> {
        &self.tag
    }
}

impl Drop for ReplyConsumer {
    fn drop(&mut self) {
        self.registry.remove(&self.name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_routed_to_their_outbox_and_retired_on_drop() {
        let reg = Arc::new(Registry::default());
        let out = Outbox::new(1);
        let a = reg.register(7, Arc::from("a"), &out).unwrap();
        let b = reg.register(7, Arc::from("b"), &out).unwrap();
        assert_ne!(a.name(), b.name());
        assert!(a.name().starts_with("amq.rabbitmq.reply-to.7."));
        // 22 base64url characters: 128 random bits
        assert_eq!(a.name().len(), REPLY_PREFIX.len() + "7.".len() + 22);
        assert_eq!(reg.owner(a.name()), Some(7));
        let body = Bytes::from_static(b"r");
        assert!(reg.deliver(a.name(), Properties::default(), &body));
        // a full outbox drops the reply
        assert!(!reg.deliver(b.name(), Properties::default(), &body));
        let mut evs = Vec::new();
        out.drain(&mut evs, 10);
        assert!(
            matches!(&evs[..], [OutEvent::Reply(r)] if &*r.tag == "a" && r.routing_key == *a.name())
        );
        // a forged name (right prefix and connection, wrong key) is not a consumer
        let forged = format!("{REPLY_PREFIX}7.AAAAAAAAAAAAAAAAAAAAAA");
        assert!(!reg.deliver(&forged, Properties::default(), &body));
        let name = a.name().clone();
        drop(a);
        assert!(!reg.contains(&name));
        assert!(!reg.deliver(&name, Properties::default(), &body));
        drop(b);
        assert!(reg.is_empty());
    }

    #[test]
    fn a_closed_connection_gets_no_reply() {
        let reg = Arc::new(Registry::default());
        let out = Outbox::new(8);
        let a = reg.register(1, Arc::from("a"), &out).unwrap();
        drop(out);
        assert!(!reg.deliver(a.name(), Properties::default(), &Bytes::new()));
    }
}

//! Protocol-neutral broker core: vhosts, exchanges, queues, bindings, routing,
//! consumers, acks. It knows no wire format: adapters translate frames into calls on
//! these types and map [`CoreError`] to their protocol's errors.
//!
//! Modules:
//! - [`value`]: [`FieldValue`] and the ordered [`FieldTable`], AMQP 0-9-1's header and
//!   argument model as RabbitMQ uses it.
//! - [`message`]: a message's [`Properties`] (AMQP basic properties), with the compact,
//!   versioned encoding the store keeps in each commitlog record.
//! - [`routing`]: exchange kinds, binding tables, the topic trie, the headers match
//!   rule, and a vhost's [`Topology`], which resolves a publish to its set of queues.
//! - [`selector`]: SQL92 (JMS) message selectors, compiled once, bounded against
//!   hostile input.
//! - [`filter`]: a consumer's [`MessageFilter`]: selector and `x-tag-filter`, with the
//!   tag hash kept in the consume-queue entry.
//! - [`error`]: [`CoreError`], one variant per condition the adapters map.
//! - [`alarm`]: memory and disk [`Alarms`] that block publishers.
//! - [`broker`]: the [`Broker`]: users, vhosts, connections, timers.
//! - [`clock`]: the [`Clock`] expiry decisions read (system, or manual in tests).
//! - [`auth`]: users, permissions and topic permissions changed at run time, persisted
//!   in the metadata journal and seeded from the configuration.
//! - [`conns`]: the registry of open connections (listing, closing from outside).
//! - [`delayed`]: delayed delivery (`x-delay`, `x-delay-level`): the delay queue, its
//!   timer wheel and the scheduler that routes due messages.
//! - [`direct_reply`]: RabbitMQ's direct reply-to (`amq.rabbitmq.reply-to`): replies
//!   handed to the requesting channel's consumer, without a queue.
//! - [`access`]: permissions ([`VhostAccess`]): RabbitMQ's configure / write / read
//!   regexes per user and vhost, checked per operation by every adapter.
//! - [`password`]: [`PasswordHash`], RabbitMQ's salted SHA-256 password hashes.
//! - [`policy`]: RabbitMQ-style policies (pattern, apply-to, priority, definition) that
//!   set queue limits, TTLs and dead-lettering without redeclaring, persisted per change.
//! - [`stats`]: message counters (sharded where there is no owner lock) and rates.
//! - [`exchange_stats`]: per-exchange `publish_in` / `publish_out`, counted per
//!   connection and summed when read.
//! - [`throttle`]: failed-login throttling per source address and per user name.
//! - [`link`]: a connection's [`Link`], which login creates: user, vhost, permissions,
//!   connection slot; check-and-act methods; teardown on drop.
//! - [`durability`]: [`Durability`], what a reply promising durability waits for.
//! - [`replies`]: [`ReplyQueue`], a connection's ordered queue of replies waiting for
//!   durability and publisher flow control.
//! - [`vhost`]: a [`Vhost`]: topology plus queues; declare, bind, publish, consume, get.
//! - [`queue`]: a [`Queue`]: ready window over the store, consumers with credit, acks,
//!   requeue, TTL, length limits, dead-lettering.
//! - [`stream`]: stream queues (`x-queue-type=stream`): non-destructive logs read from
//!   per-consumer positions (offset, time, stored consumer offsets), with retention.
//! - [`outbox`]: how queues hand deliveries to connections, with back-pressure.
//! - [`reserved`]: the names the broker keeps for itself (its own state's queues,
//!   `$SYS` topics), which no client can address.
//! - [`txn`]: half-message (transactional) publishing with check-back, RocketMQ's model:
//!   `x-txn: half` stores a message durably but invisibly until a commit or rollback by
//!   message-id; unresolved ones get check messages, then are rolled back.
//! - [`user_limits`]: per-user `max-connections` / `max-channels` changed at run time,
//!   persisted in the metadata journal and seeded from the configuration.
//! - [`envelope`]: exchange, routing key and properties as stored with each message.
//! - [`testing`]: `eventually`, the polling wait tests use instead of sleeping; opening a
//!   broker over a fresh store; a counting allocator for heap measurements.
//! - [`driver`]: the one connection driver (socket loop, heartbeats, alarm gating,
//!   flow control, shutdown) behind the [`driver::Protocol`] trait each adapter implements.
//! - [`io`]: socket helpers the protocol drivers share (a read that holds no buffer while
//!   the peer is idle).
//! - `encoding` (private): the bounds-checked storage encoding of values.

#![deny(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
#![cfg_attr(
    test,
    allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)
)]
#![warn(missing_docs)]

pub mod access;
pub mod alarm;
pub mod auth;
pub mod broker;
pub mod clock;
pub mod conns;
pub mod delayed;
pub mod direct_reply;
pub mod driver;
pub mod durability;
mod encoding;
pub mod envelope;
pub mod error;
pub mod exchange_stats;
pub mod filter;
pub mod io;
pub mod link;
pub mod message;
pub mod outbox;
pub mod password;
pub mod policy;
pub mod queue;
pub mod replies;
pub mod reserved;
pub mod routing;
pub mod selector;
pub mod stats;
pub mod stream;
pub mod testing;
pub mod throttle;
pub mod txn;
pub mod user_limits;
pub mod value;
pub mod vhost;

pub use access::{Access, Pattern, PatternError, Permission, TopicPermission, VhostAccess};
pub use alarm::Alarms;
pub use broker::{
    Broker, ChannelSlot, ConnectionId, ConnectionSlot, CoreConfig, User, UserConfig, UserLimits,
};
pub use clock::Clock;
pub use direct_reply::{DirectReply, ReplyConsumer};
pub use durability::Durability;
pub use error::{CoreError, ResourceKind};
pub use filter::MessageFilter;
pub use link::{
    Authenticated, Credentials, Link, LoginRefused, LoginStage, Peer, Protocol, PublishTo,
};
pub use message::Properties;
pub use outbox::{Backpressure, CreditGate, Delivery, OutEvent, Outbox};
pub use password::{HashError, PasswordHash};
pub use queue::{ConsumeRequest, ConsumerHandle, Queue, QueueArgs};
pub use replies::ReplyQueue;
pub use routing::{Destination, ExchangeDef, ExchangeKind, Topology};
pub use value::{FieldTable, FieldValue};
pub use vhost::{Publish, Published, QueueDeclare, QueueDeclareOk, Vhost};

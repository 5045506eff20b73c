//! A client connection's hold on the broker: the [`Link`], which login creates.
//!
//! Every protocol adapter logs in through [`crate::Broker::login`] (or, for AMQP, whose
//! handshake names the vhost only after the credentials,
//! [`crate::Broker::check_credentials`] then [`crate::Broker::open_link`]). The `Link` it returns owns:
//! - the authenticated [`User`], the vhost and the user's rights there
//!   ([`VhostAccess`]);
//! - the user's connection-limit slot (`max_connections_per_user`);
//! - the connection's id, under which its exclusive queues are kept.
//!
//! Its methods check the permission and perform the action in one call (`publish`,
//! `consume`, `declare_*`, `bind_*`, `purge_queue`, `delete_queue`, `get`), so an adapter
//! cannot act on the vhost without the check RabbitMQ's table
//! ([`crate::access`]) asks for. Acks and nacks of deliveries go through [`settle`],
//! which groups them per queue.
//!
//! Dropping the `Link` tears the connection down in the core: its exclusive queues are
//! deleted and its connection slot is given back. The adapter drops it after it has
//! cancelled its consumers and requeued its unacked deliveries.
//!
//! A refused login ([`LoginRefused`]) has already been counted by the failed-login
//! throttle ([`crate::throttle`]): the adapter holds its answer for
//! [`LoginRefused::hold`].
//!
//! Size: a `Link` is 64 bytes (three pointers, the connection id, the protocol and the
//! connection slot, which holds the user's name); it allocates nothing per operation
//! and holds no buffer.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::access::VhostAccess;
use crate::broker::{ConnectionSlot, User};
use crate::error::CoreError;
use crate::message::Properties;
use crate::outbox::Delivery;
use crate::queue::{ConsumeRequest, ConsumerHandle, Queue};
use crate::routing::ExchangeDef;
use crate::value::FieldTable;
use crate::vhost::{Publish, Published, QueueDeclare, QueueDeclareOk, Vhost};
use crate::{ConnectionId, Durability};

/// The wire protocol a connection speaks (logs, the connection registry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// AMQP 0-9-1.
    Amqp,
    /// STOMP 1.0 to 1.2.
    Stomp,
    /// MQTT 3.1.1.
    Mqtt,
}

impl Protocol {
    /// Lower-case name: `amqp`, `stomp`, `mqtt`.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Amqp => "amqp",
            Protocol::Stomp => "stomp",
            Protocol::Mqtt => "mqtt",
        }
    }
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An exchange and routing key the connection's user may publish to, checked by
/// [`Link::check_publish`]; only a `Link` makes one.
#[derive(Debug)]
pub struct PublishTo {
    exchange: String,
    routing_key: String,
    conn: ConnectionId,
}

impl PublishTo {
    /// The exchange.
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The routing key.
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }

    /// The message, as the connection publishes it (a transaction's publishes are
    /// checked again when they commit, by [`Link::publish_all`]).
    pub fn into_publish(self, mandatory: bool, properties: Properties, body: Bytes) -> Publish {
        Publish {
            exchange: self.exchange,
            routing_key: self.routing_key,
            mandatory,
            properties,
            body,
            conn: self.conn,
        }
    }
}

/// What a client logs in with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credentials<'a> {
    /// A user name and password (SASL PLAIN / AMQPLAIN, STOMP `login` / `passcode`,
    /// MQTT user name / password).
    Password {
        /// User name.
        user: &'a str,
        /// Password.
        password: &'a str,
    },
    /// The user a verified TLS client certificate names (SASL EXTERNAL, STOMP / MQTT
    /// `ssl_cert_login`): the user must exist; no password.
    Certificate {
        /// The certificate's common name.
        user: &'a str,
    },
    /// No credentials: the default user the listener's `auth.anonymous` policy chose
    /// for this peer, or `None` when this peer may not log in anonymously.
    Anonymous {
        /// The default user.
        user: Option<&'a str>,
    },
}

impl Credentials<'_> {
    /// The user name the failed-login throttle counts a refusal against: the one
    /// given, or "" for an anonymous attempt (so anonymous refusals never use up the
    /// default user's own attempts).
    pub fn throttle_name(&self) -> &str {
        match self {
            Credentials::Password { user, .. } | Credentials::Certificate { user } => user,
            Credentials::Anonymous { .. } => "",
        }
    }
}

/// The connection asking to log in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its address (loopback-only users, the failed-login throttle).
    pub addr: IpAddr,
    /// Its connection id ([`crate::Broker::next_connection_id`]).
    pub conn: ConnectionId,
    /// `auth.failed_login_delay`: a refusal is answered this long after the previous
    /// one for the same address or user name.
    pub failed_login_delay: Duration,
}

/// Which step refused a login.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoginStage {
    /// Unknown user, wrong password, no anonymous login, a loopback-only user from
    /// elsewhere, or throttled.
    Credentials,
    /// The vhost does not exist or the user has no permissions in it.
    Vhost,
    /// The user is at `max_connections_per_user`.
    ConnectionLimit,
}

/// A refused login. It has been counted by the failed-login throttle: answer it
/// after [`LoginRefused::hold`]. `reason` is for the log: a refusal made once the
/// password was accepted must not tell the client that it was right.
#[derive(Debug)]
pub struct LoginRefused {
    /// Why (for the log).
    pub reason: CoreError,
    /// Which step refused it.
    pub stage: LoginStage,
    /// How long to hold the answer.
    pub hold: Duration,
}

/// A user whose credentials were accepted, before a vhost is opened (AMQP's
/// `connection.open` comes after `connection.start-ok`); only the broker makes one.
#[derive(Debug)]
pub struct Authenticated {
    pub(crate) user: User,
    pub(crate) conn: ConnectionId,
}

impl Authenticated {
    /// The user.
    pub fn user(&self) -> &User {
        &self.user
    }
}

/// See the module's documentation.
pub struct Link {
    vhost: Arc<Vhost>,
    access: Arc<VhostAccess>,
    conn: ConnectionId,
    proto: Protocol,
    /// Holds the user's name; given back on drop, after the exclusive queues went.
    slot: ConnectionSlot,
    /// This connection's per-exchange publish counters ([`crate::exchange_stats`]),
    /// made at its first publish (a connection that only consumes has none).
    xcounts: std::sync::OnceLock<Arc<crate::exchange_stats::ConnCounts>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("conn", &self.conn)
            .field("proto", &self.proto)
            .field("user", &self.user())
            .field("vhost", &self.vhost.name())
            .finish()
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Some(c) = self.xcounts.get() {
            self.vhost.exchange_stats().close(self.conn, c);
        }
        self.vhost.connection_closed(self.conn);
    }
}

impl Link {
    pub(crate) fn new(
        vhost: Arc<Vhost>,
        access: Arc<VhostAccess>,
        conn: ConnectionId,
        proto: Protocol,
        slot: ConnectionSlot,
    ) -> Link {
        Link {
            vhost,
            access,
            conn,
            proto,
            slot,
            xcounts: std::sync::OnceLock::new(),
        }
    }

    /// The connection's id.
    pub fn id(&self) -> ConnectionId {
        self.conn
    }

    /// The protocol.
    pub fn protocol(&self) -> Protocol {
        self.proto
    }

    /// The logged-in user's name.
    pub fn user(&self) -> &str {
        self.slot.user()
    }

    /// The vhost, for lookups (`queue`, `has_exchange`, ...). Changes go through the
    /// `Link`'s own methods, which check permissions.
    pub fn vhost(&self) -> &Arc<Vhost> {
        &self.vhost
    }

    /// The user's rights in the vhost.
    pub fn access(&self) -> &Arc<VhostAccess> {
        &self.access
    }

    /// Counts an AMQP channel against the user's `max_channels` before it is opened:
    /// hold the slot for the channel's life. `None`: the user has no channel limit.
    /// [`CoreError::NotAllowed`] (RabbitMQ's text) at the limit.
    pub fn open_channel(&self) -> Result<Option<crate::ChannelSlot>, CoreError> {
        self.slot.open_channel()
    }

    /// Names the connection's client (MQTT's client id): topic patterns with
    /// `{client_id}` are compiled for it ([`VhostAccess::for_client`]); without such
    /// patterns nothing changes (the user's shared rights stay in use).
    pub fn set_client_id(&mut self, client_id: &str) {
        if let Some(a) = self.access.for_client(client_id) {
            self.access = Arc::new(a);
        }
    }

    /// Checks that the user may publish to `exchange` with `routing_key` and returns
    /// the permission as a [`PublishTo`], for a message whose body comes later (AMQP's
    /// content frames) or that has work to do before it is published (MQTT's retained
    /// message): [`Link::publish_checked`] then publishes it without checking again,
    /// so a message is checked once.
    pub fn check_publish(
        &self,
        exchange: String,
        routing_key: String,
    ) -> Result<PublishTo, CoreError> {
        // a commit or rollback is checked against the half message's own exchange
        if exchange != crate::txn::TXN_EXCHANGE {
            self.access
                .publish_to(&self.vhost, &exchange, &routing_key)?;
        }
        Ok(PublishTo {
            exchange,
            routing_key,
            conn: self.conn,
        })
    }

    /// Publishes to what [`Link::check_publish`] allowed this connection.
    pub fn publish_checked(
        &self,
        to: PublishTo,
        mandatory: bool,
        properties: Properties,
        body: Bytes,
    ) -> Result<Published, CoreError> {
        if to.conn != self.conn {
            return Err(CoreError::Internal(
                "a publish checked by another connection".into(),
            ));
        }
        self.publish_now(to.into_publish(mandatory, properties, body))
    }

    /// [`Link::publish_checked`] (not mandatory), the stored message also indexed under
    /// its vhost and routing key ([`crate::vhost::topic_key`]): MQTT's publishes, which a
    /// query by topic and time then finds in the store's index.
    pub fn publish_checked_indexed(
        &self,
        to: PublishTo,
        properties: Properties,
        body: Bytes,
    ) -> Result<Published, CoreError> {
        if to.conn != self.conn {
            return Err(CoreError::Internal(
                "a publish checked by another connection".into(),
            ));
        }
        let p = to.into_publish(false, properties, body);
        if crate::txn::is_txn(&p) {
            return self.publish_now(p);
        }
        let stats = self.vhost.exchange_stats();
        let begun = stats.begin(self.xcounts(), &p.exchange);
        let r = self.vhost.publish_topic_indexed(p);
        self.count(begun, &r);
        r
    }

    /// This connection's exchange counters, made (and known to the vhost) at its first
    /// publish.
    fn xcounts(&self) -> &crate::exchange_stats::ConnCounts {
        self.xcounts
            .get_or_init(|| self.vhost.exchange_stats().open(self.conn))
    }

    /// Counts a publish in its exchange's `message_stats` ([`crate::exchange_stats`]).
    fn count(&self, begun: crate::exchange_stats::Begun, r: &Result<Published, CoreError>) {
        let done = r.as_ref().ok().map(|p| u64::from(p.queues));
        self.vhost.exchange_stats().end(self.xcounts(), begun, done);
    }

    /// A checked publish: half messages, commits and rollbacks to [`crate::txn`]
    /// (which checks the rights they need), the rest to the vhost.
    fn publish_now(&self, p: Publish) -> Result<Published, CoreError> {
        let begun = self
            .vhost
            .exchange_stats()
            .begin(self.xcounts(), &p.exchange);
        let r = crate::txn::publish(&self.vhost, &self.access, p);
        self.count(begun, &r);
        r
    }

    /// Publishes `p` as this connection, once the user may write to its exchange
    /// with its routing key.
    pub fn publish(&self, mut p: Publish) -> Result<Published, CoreError> {
        if p.exchange != crate::txn::TXN_EXCHANGE {
            self.access
                .publish_to(&self.vhost, &p.exchange, &p.routing_key)?;
        }
        p.conn = self.conn;
        self.publish_now(p)
    }

    /// Publishes a batch (a transaction) atomically: every message is checked and
    /// routed before any is stored ([`Vhost::publish_all`]).
    pub fn publish_all(&self, mut batch: Vec<Publish>) -> Result<Vec<Published>, CoreError> {
        crate::txn::refuse_in_batch(&batch)?;
        for p in &mut batch {
            self.access
                .publish_to(&self.vhost, &p.exchange, &p.routing_key)?;
            p.conn = self.conn;
        }
        // a transaction's commit: counted as each of its publishes (not a hot path)
        let exchanges: Vec<String> = batch.iter().map(|p| p.exchange.clone()).collect();
        let published = self.vhost.publish_all(batch)?;
        let stats = self.vhost.exchange_stats();
        for (x, p) in exchanges.iter().zip(&published) {
            let begun = stats.begin(self.xcounts(), x);
            stats.end(self.xcounts(), begun, Some(u64::from(p.queues)));
        }
        Ok(published)
    }

    /// A direct reply-to consumer for one channel ([`crate::direct_reply`]): deliveries
    /// come to `outbox` as [`crate::OutEvent::Reply`] with `tag`. As RabbitMQ, consuming
    /// replies needs no permission (only this channel's name reaches it).
    pub fn consume_direct_reply(
        &self,
        tag: Arc<str>,
        outbox: &Arc<crate::Outbox>,
    ) -> Result<crate::ReplyConsumer, CoreError> {
        self.vhost.direct_replies().register(self.conn, tag, outbox)
    }

    /// `exchange.declare`; a passive one needs no permission.
    pub fn declare_exchange(&self, def: ExchangeDef, passive: bool) -> Result<(), CoreError> {
        if !passive {
            self.access.exchange_declare(&def.name, &def.arguments)?;
        }
        self.vhost.declare_exchange(def, passive)
    }

    /// `exchange.delete`.
    pub fn delete_exchange(&self, name: &str, if_unused: bool) -> Result<(), CoreError> {
        self.access.exchange_delete(name)?;
        self.vhost.delete_exchange(name, if_unused)
    }

    /// `exchange.bind`.
    pub fn bind_exchange(
        &self,
        destination: &str,
        source: &str,
        key: &str,
        args: &FieldTable,
    ) -> Result<(), CoreError> {
        self.access
            .exchange_bind_key(&self.vhost, destination, source, key)?;
        self.vhost.bind_exchange(destination, source, key, args)
    }

    /// `exchange.unbind`.
    pub fn unbind_exchange(
        &self,
        destination: &str,
        source: &str,
        key: &str,
        args: &FieldTable,
    ) -> Result<(), CoreError> {
        self.access
            .exchange_bind_key(&self.vhost, destination, source, key)?;
        self.vhost.unbind_exchange(destination, source, key, args)
    }

    /// `queue.declare` as this connection (its exclusive queues are its own); the
    /// permission is checked once the name is known (a server-named queue's too).
    pub fn declare_queue(&self, d: QueueDeclare) -> Result<QueueDeclareOk, CoreError> {
        self.vhost.declare_queue(self.own(d))
    }

    /// [`Link::declare_queue`], returning what the reply waits for instead of waiting.
    pub fn declare_queue_deferred(
        &self,
        d: QueueDeclare,
    ) -> Result<(QueueDeclareOk, Durability), CoreError> {
        self.vhost.declare_queue_deferred(self.own(d))
    }

    fn own(&self, mut d: QueueDeclare) -> QueueDeclare {
        d.conn = self.conn;
        d.access = Some(self.access.clone());
        d
    }

    /// `queue.bind`.
    pub fn bind_queue(
        &self,
        queue: &str,
        exchange: &str,
        key: &str,
        args: &FieldTable,
    ) -> Result<(), CoreError> {
        self.access
            .queue_bind_key(&self.vhost, queue, exchange, key)?;
        self.vhost.bind_queue(queue, exchange, key, args, self.conn)
    }

    /// [`Link::bind_queue`], returning what the reply waits for instead of waiting.
    pub fn bind_queue_deferred(
        &self,
        queue: &str,
        exchange: &str,
        key: &str,
        args: &FieldTable,
    ) -> Result<Durability, CoreError> {
        self.access
            .queue_bind_key(&self.vhost, queue, exchange, key)?;
        self.vhost
            .bind_queue_deferred(queue, exchange, key, args, self.conn)
    }

    /// `queue.unbind`.
    pub fn unbind_queue(
        &self,
        queue: &str,
        exchange: &str,
        key: &str,
        args: &FieldTable,
    ) -> Result<(), CoreError> {
        self.access
            .queue_bind_key(&self.vhost, queue, exchange, key)?;
        self.vhost
            .unbind_queue(queue, exchange, key, args, self.conn)
    }

    /// `queue.purge` (read permission on the queue): how many messages went.
    pub fn purge_queue(&self, queue: &str) -> Result<u32, CoreError> {
        self.access.consume(queue)?;
        self.vhost.purge_queue(queue, self.conn)
    }

    /// `queue.delete`: how many messages it held.
    pub fn delete_queue(
        &self,
        queue: &str,
        if_unused: bool,
        if_empty: bool,
    ) -> Result<u32, CoreError> {
        self.access.queue_delete(queue)?;
        self.vhost
            .delete_queue(queue, if_unused, if_empty, self.conn)
    }

    /// `basic.consume` (STOMP SUBSCRIBE, an MQTT session's queue) as this connection.
    pub fn consume(
        &self,
        queue: &str,
        mut req: ConsumeRequest,
    ) -> Result<ConsumerHandle, CoreError> {
        self.access.consume(queue)?;
        req.conn = self.conn;
        self.vhost.consume(queue, req)
    }

    /// [`Link::consume`] with a stream consumer's start position and consumer name
    /// (`x-stream-offset`, `x-stream-consumer-name`); refused on a queue that is not a
    /// stream when either is set.
    pub fn consume_stream(
        &self,
        queue: &str,
        mut req: ConsumeRequest,
        opts: crate::stream::StreamConsume,
    ) -> Result<ConsumerHandle, CoreError> {
        self.access.consume(queue)?;
        req.conn = self.conn;
        self.vhost.consume_stream(queue, req, opts)
    }

    /// `basic.get`.
    pub fn get(&self, queue: &str, no_ack: bool) -> Result<Option<Delivery>, CoreError> {
        self.access.consume(queue)?;
        self.vhost.get(queue, no_ack, self.conn)
    }
}

/// Settles deliveries of this connection, grouped by queue: one call per queue for
/// the whole set (an ack of 1,000 deliveries from one queue takes its lock once).
/// `ack`: remove them; otherwise nack, putting them back when `requeue` (else they are
/// dead-lettered or dropped).
pub fn settle<'a, I>(items: I, ack: bool, requeue: bool)
where
    I: IntoIterator<Item = (&'a Arc<Queue>, u64)>,
{
    let apply = |q: &Queue, offs: &[u64]| {
        if ack {
            q.ack(offs);
        } else {
            q.nack(offs, requeue);
        }
    };
    let mut it = items.into_iter();
    let Some((mut q, first)) = it.next() else {
        return;
    };
    // One delivery (a single ack): no allocation.
    let Some(second) = it.next() else {
        apply(q, &[first]);
        return;
    };
    // The usual case is one queue: one pass, no sorting.
    let mut offs = vec![first];
    let mut rest: Vec<(&Arc<Queue>, u64)> = Vec::new();
    for (nq, off) in std::iter::once(second).chain(it) {
        if Arc::ptr_eq(nq, q) {
            offs.push(off);
        } else {
            rest.push((nq, off));
        }
    }
    loop {
        apply(q, &offs);
        let Some(&(nq, _)) = rest.first() else {
            return;
        };
        q = nq;
        offs.clear();
        rest.retain(|(rq, off)| {
            if Arc::ptr_eq(rq, q) {
                offs.push(*off);
                false
            } else {
                true
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::{Pattern, Permission};
    use crate::broker::{Broker, CoreConfig, UserConfig};

    fn broker(cfg: CoreConfig) -> (tempfile::TempDir, Arc<Broker>) {
        let dir = tempfile::tempdir().unwrap();
        let mut sc = triad_store::store::StoreConfig::new(dir.path());
        sc.segment_size = 1 << 20;
        let store = Arc::new(triad_store::store::Store::open(sc).unwrap());
        (dir, Broker::open(store, cfg).unwrap())
    }

    fn peer(conn: ConnectionId) -> Peer {
        Peer {
            addr: "127.0.0.1".parse().unwrap(),
            conn,
            failed_login_delay: Duration::from_millis(10),
        }
    }

    const GUEST: Credentials<'static> = Credentials::Password {
        user: "guest",
        password: "guest",
    };

    #[test]
    fn a_link_is_small() {
        // 64 bytes before the exchange counters' handle (made at the first publish)
        assert!(
            std::mem::size_of::<Link>() <= 80,
            "{}",
            std::mem::size_of::<Link>()
        );
    }

    #[test]
    fn login_refusals_name_their_stage_and_are_throttled() {
        let cfg = CoreConfig {
            max_connections_per_user: 1,
            ..CoreConfig::default()
        };
        let (_d, b) = broker(cfg);
        let bad = Credentials::Password {
            user: "guest",
            password: "nope",
        };
        let e = b.login(bad, peer(1), "/", Protocol::Stomp).unwrap_err();
        assert_eq!(e.stage, LoginStage::Credentials);
        assert!(e.hold > Duration::ZERO, "counted by the throttle");
        let e = b
            .login(
                Credentials::Anonymous { user: None },
                peer(2),
                "/",
                Protocol::Mqtt,
            )
            .unwrap_err();
        assert_eq!(e.stage, LoginStage::Credentials);
        let e = b
            .login(GUEST, peer(3), "nowhere", Protocol::Amqp)
            .unwrap_err();
        assert_eq!(e.stage, LoginStage::Vhost);
        let link = b.login(GUEST, peer(4), "/", Protocol::Amqp).unwrap();
        assert_eq!(
            (link.user(), link.id(), link.protocol()),
            ("guest", 4, Protocol::Amqp)
        );
        let e = b.login(GUEST, peer(5), "/", Protocol::Stomp).unwrap_err();
        assert_eq!(e.stage, LoginStage::ConnectionLimit);
        drop(link);
        // the slot came back with the link
        let again = b.login(GUEST, peer(6), "/", Protocol::Stomp).unwrap();
        // AMQP's two steps: a vhost refusal there is not a failed login
        drop(again);
        let auth = b.check_credentials(GUEST, peer(7)).unwrap();
        assert_eq!(auth.user().name, "guest");
        let e = b.open_link(auth, "nowhere", Protocol::Amqp).unwrap_err();
        assert!(matches!(e, CoreError::NotAllowed(_)), "{e}");
    }

    #[test]
    fn per_user_limits_override_the_global_one() {
        use crate::UserLimits;
        let mut cfg = CoreConfig {
            max_connections_per_user: 1,
            ..CoreConfig::default()
        };
        cfg.user_limits.insert(
            "guest".into(),
            UserLimits {
                max_connections: Some(2),
                max_channels: Some(3),
            },
        );
        let (_d, b) = broker(cfg);
        let a = b.login(GUEST, peer(1), "/", Protocol::Amqp).unwrap();
        // the user's own limit (2), not the global one (1)
        let m = b.login(GUEST, peer(2), "/", Protocol::Mqtt).unwrap();
        let e = b.login(GUEST, peer(3), "/", Protocol::Amqp).unwrap_err();
        assert_eq!(e.stage, LoginStage::ConnectionLimit);
        assert_eq!(
            e.reason.to_string(),
            "not allowed: connection refused for user 'guest': user connection limit (2) is reached"
        );
        // channels over all connections: the MQTT connection holds one
        let c1 = a.open_channel().unwrap().expect("counted");
        let c2 = a.open_channel().unwrap().expect("counted");
        let e = a.open_channel().unwrap_err();
        assert_eq!(
            e.to_string(),
            "not allowed: number of channels opened for user 'guest' has reached the maximum allowed user limit of (3)"
        );
        drop(m); // its channel and connection come back
        let c3 = a.open_channel().unwrap().expect("counted");
        drop((c1, c2));
        let s = b.login(GUEST, peer(4), "/", Protocol::Stomp).unwrap();
        let e = b.login(GUEST, peer(5), "/", Protocol::Stomp).unwrap_err();
        assert_eq!(e.stage, LoginStage::ConnectionLimit);
        drop((c3, s, a));

        // 0 refuses every connection (RabbitMQ); UNLIMITED lifts the global limit
        let mut cfg = CoreConfig {
            max_connections_per_user: 1,
            ..CoreConfig::default()
        };
        cfg.user_limits.insert(
            "guest".into(),
            UserLimits {
                max_connections: Some(UserLimits::UNLIMITED),
                max_channels: Some(0),
            },
        );
        let (_d, b) = broker(cfg);
        let a = b.login(GUEST, peer(1), "/", Protocol::Amqp).unwrap();
        let a2 = b.login(GUEST, peer(2), "/", Protocol::Amqp).unwrap();
        assert!(a.open_channel().is_err());
        let e = b.login(GUEST, peer(3), "/", Protocol::Mqtt).unwrap_err();
        assert_eq!(e.stage, LoginStage::ConnectionLimit);
        drop((a, a2));
        let mut cfg = CoreConfig::default();
        cfg.user_limits.insert(
            "guest".into(),
            UserLimits {
                max_connections: Some(0),
                max_channels: None,
            },
        );
        let (_d, b) = broker(cfg);
        assert!(b.login(GUEST, peer(1), "/", Protocol::Amqp).is_err());
        // no channel limit: nothing counted per channel
        let (_d, b) = broker(CoreConfig::default());
        let a = b.login(GUEST, peer(1), "/", Protocol::Amqp).unwrap();
        assert!(a.open_channel().unwrap().is_none());
    }

    #[test]
    fn dropping_the_link_deletes_its_exclusive_queues() {
        let (_d, b) = broker(CoreConfig::default());
        let link = b.login(GUEST, peer(9), "/", Protocol::Stomp).unwrap();
        let ok = link
            .declare_queue(QueueDeclare {
                exclusive: true,
                ..Default::default()
            })
            .unwrap();
        let vh = link.vhost().clone();
        assert!(vh.queue(&ok.name).is_some());
        drop(link);
        assert!(vh.queue(&ok.name).is_none());
    }

    #[test]
    fn every_action_checks_its_permission() {
        let cfg = CoreConfig {
            users: vec![UserConfig::with_password("alice", "pw")],
            loopback_users: Vec::new(),
            permissions: vec![Permission {
                user: "alice".into(),
                vhost: "/".into(),
                configure: Pattern::new("^alice-").unwrap(),
                write: Pattern::new("^alice-").unwrap(),
                read: Pattern::new("^alice-").unwrap(),
            }],
            ..CoreConfig::default()
        };
        let (_d, b) = broker(cfg);
        let alice = Credentials::Password {
            user: "alice",
            password: "pw",
        };
        let link = b.login(alice, peer(1), "/", Protocol::Amqp).unwrap();
        let refused = |r: Result<(), CoreError>| {
            assert!(matches!(r, Err(CoreError::AccessRefused(_))), "{r:?}");
        };
        let q = |name: &str| QueueDeclare {
            name: name.into(),
            ..Default::default()
        };
        link.declare_queue(q("alice-q")).unwrap();
        refused(link.declare_queue(q("bob-q")).map(drop));
        // bob-q exists (the broker's own declare), alice may not touch it
        link.vhost().declare_queue(q("bob-q")).unwrap();
        let none = FieldTable::new();
        refused(link.bind_queue("bob-q", "amq.topic", "k", &none));
        refused(link.unbind_queue("bob-q", "amq.topic", "k", &none));
        refused(link.bind_exchange("amq.fanout", "amq.topic", "k", &none));
        refused(link.unbind_exchange("amq.fanout", "amq.topic", "k", &none));
        refused(link.purge_queue("bob-q").map(drop));
        refused(link.delete_queue("bob-q", false, false).map(drop));
        refused(link.get("bob-q", true).map(drop));
        refused(link.delete_exchange("amq.topic", false));
        let publish = |exchange: &str| Publish {
            exchange: exchange.into(),
            routing_key: "alice-q".into(),
            ..Default::default()
        };
        refused(link.publish(publish("amq.topic")).map(drop));
        refused(
            link.publish_all(vec![publish("alice-x"), publish("amq.topic")])
                .map(drop),
        );
        refused(link.declare_exchange(
            ExchangeDef::new("bob-x", crate::ExchangeKind::Direct),
            false,
        ));
        assert_eq!(link.purge_queue("alice-q").unwrap(), 0);
        assert_eq!(link.delete_queue("alice-q", false, false).unwrap(), 0);
    }
}

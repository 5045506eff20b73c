//! MQTT 3.1.1 adapter: unmodified MQTT clients (paho, mosquitto_pub/sub, rumqttc,
//! devices) talk to the Triad core, with RabbitMQ's MQTT-plugin mapping and
//! Mosquitto's behaviour.
//!
//! Modules:
//! - [`codec`]: packets and the pure codec, `decode(&mut BytesMut, &Limits)` /
//!   `encode(&Packet, &mut BytesMut)` (its doc says why it replaces `mqttbytes`).
//! - [`topic`]: topic and filter rules, and the MQTT topic ⇄ AMQP routing-key mapping.
//! - [`session`]: one connected session without I/O: packets in, `Link` calls, packets
//!   out (subscriptions, shared and stream subscriptions, deliveries, the ordered
//!   replies); it implements the core's `driver::Protocol`. Its [`session::packets`]
//!   holds packet ids and in-flight QoS 1/2 both ways.
//! - [`retained`]: the retained-message trie and its durable store.
//! - [`durable`]: a durable key/value map over a core queue (retained messages and
//!   persistent sessions live in it).
//! - [`state`]: [`MqttState`], shared by all connections: takeover registry, per-vhost
//!   stores, `$SYS`.
//! - [`stream`]: stream subscriptions, `$stream/<start>/<filter>`: replay from an offset
//!   or a time out of a stream queue.
//! - `connect` (private): the CONNECT phase (login, client id, takeover, the session
//!   opened, CONNACK).
//! - `connection` (private): one task per connection, [`serve`]: CONNECT, then the
//!   session under the core's connection driver, then its end (the will).
//!
//! # Vhosts
//! A CONNECT opens the vhost its user name names (`vhost:user`, split at the last `:`,
//! as RabbitMQ's MQTT plugin), else the one its port maps to
//! ([`MqttLogin::port_vhost`]), else the default vhost. An unknown vhost is refused
//! like a bad password (CONNACK 4, as RabbitMQ 3.10); client ids, sessions and
//! retained messages are per vhost.
//!
//! # Mapping into the core
//! PUBLISH goes to `amq.topic` with the routing key of [`topic`]'s mapping; QoS ≥ 1 is
//! persistent (delivery mode 2) and the QoS travels in header `x-mqtt-publish-qos`.
//! Each client's subscriptions are one queue, `mqtt-subscription-<client id>`, bound to
//! `amq.topic` once per filter: exclusive and transient for clean session 1 (declared
//! by the client's first SUBSCRIBE: a connected client that never subscribes costs no
//! queue), durable for clean session 0 (declared at CONNECT; it then queues messages
//! while the client is away and survives restarts). Outbound QoS = min(message QoS, highest QoS granted by a matching
//! filter); an AMQP message without the header counts as QoS 1 when persistent, else
//! 0. Deliveries carry the body only.
//!
//! A shared subscription, `$share/<group>/<filter>`, is one queue per (vhost, group,
//! filter), `mqtt-shared-<group>/<filter>` ([`state::shared_queue_name`]), bound to
//! `amq.topic` with the filter's key; every member consumes it (the queue's round robin
//! makes the members take turns) and [`MqttState`] keeps the member set, deleting the
//! queue with its last member. Persistent sessions stay members while away.

#![deny(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
#![cfg_attr(
    test,
    allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)
)]
#![warn(missing_docs)]

pub mod codec;
mod connect;
mod connection;
pub mod durable;
pub mod retained;
pub mod session;
pub mod state;
pub mod stream;
pub mod topic;

use std::sync::Arc;
use std::time::Duration;

pub use codec::{DecodeError, Limits, Packet};
pub use connection::serve;
pub use state::MqttState;
use thiserror::Error;
use tokio_util::sync::CancellationToken;

/// Adapter limits and settings.
#[derive(Debug, Clone)]
pub struct MqttLimits {
    /// Largest packet (remaining length) once connected.
    pub max_packet_size: usize,
    /// Largest packet before CONNECT is accepted.
    pub max_packet_size_pre_connect: usize,
    /// Most topic filters in one SUBSCRIBE / UNSUBSCRIBE.
    pub max_filters: usize,
    /// Outbound QoS 1/2 messages in flight per client, queued and retained ones
    /// together, QoS 2 until PUBCOMP (the core consumer's prefetch is the same
    /// number); clamped to 1..=65,535.
    pub max_inflight: u32,
    /// Time allowed from TCP accept to CONNECT.
    pub connect_timeout: Duration,
    /// Longest client id accepted (it becomes part of a queue name).
    pub max_client_id_len: usize,
    /// Subscriptions one session may hold (each is a binding in memory and a journal
    /// record); a SUBSCRIBE past it gets return code 0x80 for each new filter.
    pub max_subscriptions: usize,
    /// `x-max-age` of a stream queue a `$stream/...` subscription declares (when the
    /// filter's `mqtt-stream/<filter>` queue does not exist yet).
    pub stream_max_age: Duration,
    /// `x-max-length-bytes` of such a stream queue.
    pub stream_max_bytes: u64,
    /// Index each stored PUBLISH in the store's IndexFile under its vhost and topic,
    /// for the management API's query by topic and time (`mqtt.index_topics`).
    pub index_topics: bool,
}

impl Default for MqttLimits {
    fn default() -> Self {
        MqttLimits {
            // the broker's default `limits.max_message_size` (128 MiB) plus room for
            // the topic
            max_packet_size: (128 << 20) + (64 << 10),
            max_packet_size_pre_connect: 64 << 10,
            max_filters: 1024,
            max_inflight: 32,
            connect_timeout: Duration::from_secs(10),
            max_client_id_len: 200,
            max_subscriptions: 10_000,
            stream_max_age: Duration::from_secs(7 * 24 * 3600),
            stream_max_bytes: 1 << 30,
            index_topics: false,
        }
    }
}

/// What a connection needs.
#[derive(Debug, Clone)]
pub struct MqttContext {
    /// The core.
    pub broker: Arc<triad_core::Broker>,
    /// Shared MQTT state (made with [`MqttState::new`] over the same broker).
    pub state: Arc<MqttState>,
    /// The user a CONNECT without a user name logs in as (no password); `None`: such a
    /// CONNECT gets CONNACK 5. The process decides per peer (`auth.anonymous`).
    pub anonymous_user: Option<String>,
    /// Limits.
    pub limits: MqttLimits,
    /// This connection's own shutdown token (a child of the broker's): cancelled at
    /// broker shutdown, by the management API's close, and by a takeover of its client
    /// id (the connection tells that one apart: its will goes out). Each connection
    /// needs its own: a takeover cancels it.
    pub shutdown: CancellationToken,
    /// Login settings of this connection.
    pub login: MqttLogin,
}

/// How a connection may log in, besides user name and password.
#[derive(Debug, Clone)]
pub struct MqttLogin {
    /// How long a refused CONNECT waits for its CONNACK (this connection only).
    pub failed_login_delay: Duration,
    /// CONNECT without a user name logs in as `peer_cert_cn` when there is one
    /// (RabbitMQ's `mqtt.ssl_cert_login`).
    pub ssl_cert_login: bool,
    /// This connection's verified TLS client certificate CN.
    pub peer_cert_cn: Option<String>,
    /// The vhost of the port this connection came in on (`mqtt.port_to_vhost`);
    /// `None`: the broker's default vhost.
    pub port_vhost: Option<String>,
    /// A user name `vhost:user` names the vhost (split at the last `:`, as RabbitMQ's
    /// MQTT plugin); `false` (`mqtt.ignore_colons_in_username`): the name is the user's.
    pub vhost_in_username: bool,
}

impl Default for MqttLogin {
    fn default() -> Self {
        MqttLogin {
            failed_login_delay: Duration::from_secs(1),
            ssl_cert_login: false,
            peer_cert_cn: None,
            port_vhost: None,
            vhost_in_username: true,
        }
    }
}

impl MqttLogin {
    /// The vhost and user name a CONNECT's user name stands for (RabbitMQ's order): the
    /// vhost named in `vhost:user`, else the port's vhost, else `default_vhost`.
    pub fn vhost_and_user<'a>(
        &'a self,
        username: Option<&'a str>,
        default_vhost: &'a str,
    ) -> (&'a str, Option<&'a str>) {
        let fallback = self.port_vhost.as_deref().unwrap_or(default_vhost);
        match username {
            Some(u) if self.vhost_in_username => match u.rsplit_once(':') {
                Some((vhost, user)) => (vhost, Some(user)),
                None => (fallback, Some(u)),
            },
            other => (fallback, other),
        }
    }
}

/// Why a connection ended other than by DISCONNECT or the peer closing.
#[derive(Debug, Error)]
pub enum MqttError {
    /// Socket error.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A malformed packet.
    #[error("decode: {0}")]
    Decode(#[from] DecodeError),
    /// A well-formed packet in the wrong place.
    #[error("protocol violation: {0}")]
    Protocol(&'static str),
    /// No CONNECT in time, or the keep-alive lapsed.
    #[error("timeout: {0}")]
    Timeout(&'static str),
    /// The core refused something the connection cannot go on without.
    #[error("core: {0}")]
    Core(#[from] triad_core::CoreError),
    /// The store failed to make a message durable.
    #[error("store: {0}")]
    Store(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vhost_from_user_name_then_port_then_default() {
        let mut l = MqttLogin::default();
        assert_eq!(l.vhost_and_user(Some("alice"), "/"), ("/", Some("alice")));
        assert_eq!(
            l.vhost_and_user(Some("dev:alice"), "/"),
            ("dev", Some("alice"))
        );
        // split at the last colon: the vhost may hold colons, the user not
        assert_eq!(
            l.vhost_and_user(Some("a:b:alice"), "/"),
            ("a:b", Some("alice"))
        );
        assert_eq!(l.vhost_and_user(None, "/"), ("/", None));
        l.port_vhost = Some("by-port".into());
        assert_eq!(
            l.vhost_and_user(Some("alice"), "/"),
            ("by-port", Some("alice"))
        );
        assert_eq!(
            l.vhost_and_user(Some("dev:alice"), "/"),
            ("dev", Some("alice"))
        );
        assert_eq!(l.vhost_and_user(None, "/"), ("by-port", None));
        l.vhost_in_username = false;
        assert_eq!(
            l.vhost_and_user(Some("dev:alice"), "/"),
            ("by-port", Some("dev:alice"))
        );
    }
}

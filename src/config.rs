//! The broker's configuration: one serde tree, every key defaulted, unknown keys refused.
//!
//! Loaded from TOML ([`Config::load`]) or taken as [`Config::default`] when no file is
//! given; command-line flags are applied on top (see [`crate::cli::Cli::apply`]), then
//! [`Config::validate`] checks the whole. `triad.example.toml` at the repository root
//! lists every key with its default; a unit test keeps the two in step.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use triad_store::flush::FlushMode;
use triad_store::store::StoreConfig;

use crate::listener::Proto;
use crate::units::{ByteSize, HumanDuration};

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Syntax errors, unknown keys, wrong types and bad units; `message` is the TOML
    /// parser's, with line, column and the offending text.
    #[error("invalid config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid `{key}` = {value:?}: {reason}")]
    Invalid {
        key: &'static str,
        value: String,
        reason: String,
    },
}

fn invalid(key: &'static str, value: impl ToString, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        value: value.to_string(),
        reason: reason.into(),
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub listeners: Listeners,
    pub store: StoreSection,
    pub auth: Auth,
    pub limits: Limits,
    pub tls: TlsSection,
    pub mqtt: MqttSection,
    pub http: HttpSection,
    pub stomp: StompSection,
    pub txn: TxnSection,
    /// `[[users]]`: accounts besides the default user, with hashed passwords.
    pub users: Vec<UserSection>,
    /// `[[permissions]]`: what each user may do in each vhost.
    pub permissions: Vec<PermissionSection>,
    /// `[[topic_permissions]]`: routing keys per user, vhost and topic exchange.
    pub topic_permissions: Vec<TopicPermissionSection>,
    /// `[[vhosts]]`: vhosts created at startup besides `auth.default_vhost`.
    pub vhosts: Vec<VhostSection>,
    /// `[cluster]`: this node's place in a replica group (absent: a standalone broker).
    pub cluster: Option<ClusterSection>,
    /// `[replication]`: the leader's replication settings (needs `[cluster]`).
    pub replication: Option<ReplicationSection>,
}

/// `[cluster]` (issue 18): this node's place in a replica group. Phase 1: a static
/// `role` (leader, or follower of `leader`). Phase 2: with `etcd`, the role comes from an
/// election on etcd (`role` absent or `"auto"`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    /// `leader` or `follower` (static), `auto` or absent (elected: needs `etcd`).
    pub role: Option<ClusterRole>,
    /// This node's name in the group (1 to 255 bytes).
    pub node_id: String,
    /// The replication listener, `HOST:PORT`: a static leader's, or every elected
    /// node's (any of them may lead).
    pub listen: Option<String>,
    /// A static follower's leader: its replication listener, `HOST:PORT`.
    pub leader: Option<String>,
    /// `[cluster.tls]`: mutual TLS between nodes (absent: plain TCP).
    pub tls: Option<ClusterTlsSection>,
    /// etcd's client URLs (`http://HOST:PORT`, or all `https://HOST:PORT` with
    /// `[cluster.etcd_tls]`; its JSON gateway): the election.
    #[serde(default)]
    pub etcd: Vec<String>,
    /// `[cluster.etcd_tls]`: TLS to etcd (its `https://` URLs need it).
    pub etcd_tls: Option<EtcdTlsSection>,
    /// The leader's lease in etcd (whole seconds, at least 2 s; default 2 s): a leader
    /// that cannot renew it stops confirming within this, and a follower takes over
    /// after it.
    pub lease_ttl: Option<HumanDuration>,
    /// This node's replication address as the others reach it (default: the bound
    /// `listen` address, which must then name a host).
    pub advertise: Option<String>,
    /// The group's name in etcd (`/triad/<name>/leader`; default `default`).
    pub name: Option<String>,
}

/// `[cluster.tls]`: the three files are all needed (a partial section is refused).
/// The leader presents `cert_file` and requires each follower's certificate to chain to
/// `ca_file`; a follower checks the leader's against `ca_file` for the host of
/// `cluster.leader` (elected: of the leader's `advertise` address) and presents its own
/// `cert_file`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterTlsSection {
    /// PEM chain, this node's certificate first.
    pub cert_file: Option<PathBuf>,
    /// PEM private key of that certificate.
    pub key_file: Option<PathBuf>,
    /// PEM bundle of the CAs the other nodes' certificates must chain to.
    pub ca_file: Option<PathBuf>,
}

/// `[cluster.etcd_tls]`: etcd's server certificate is verified against `ca_file` for the
/// host of each `https://` URL; `cert_file` and `key_file` (both or neither) are this
/// node's client certificate, for an etcd started with `--client-cert-auth`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdTlsSection {
    /// PEM bundle of the CAs etcd's certificate must chain to.
    pub ca_file: Option<PathBuf>,
    /// PEM chain of this node's client certificate.
    pub cert_file: Option<PathBuf>,
    /// PEM private key of that certificate.
    pub key_file: Option<PathBuf>,
}

impl EtcdTlsSection {
    /// The files, once [`Config::validate`] has checked them.
    pub fn files(&self) -> Option<triad_cluster::tls::EtcdTlsFiles> {
        Some(triad_cluster::tls::EtcdTlsFiles {
            ca: self.ca_file.clone()?,
            client: self.cert_file.clone().zip(self.key_file.clone()),
        })
    }
}

impl ClusterTlsSection {
    /// The files, once [`Config::validate`] has checked they are all there.
    pub fn files(&self) -> Option<triad_cluster::tls::TlsFiles> {
        Some(triad_cluster::tls::TlsFiles {
            cert: self.cert_file.clone()?,
            key: self.key_file.clone()?,
            ca: self.ca_file.clone()?,
        })
    }
}

impl ClusterSection {
    /// Whether the role comes from the election on etcd.
    pub fn elected(&self) -> bool {
        !self.etcd.is_empty()
    }

    /// The lease TTL in force.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
            .map(|d| d.get())
            .unwrap_or(Duration::from_secs(2))
    }

    /// The group's name in force.
    pub fn group_name(&self) -> &str {
        self.name.as_deref().unwrap_or("default")
    }
}

/// A node's role: fixed by configuration (phase 1) or elected (`auto`, with `etcd`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClusterRole {
    /// Serves clients and ships its commitlog and journal to followers.
    Leader,
    /// Keeps a copy of the leader's commitlog and journal; serves no client.
    Follower,
    /// Leader or follower as the election on etcd decides.
    Auto,
}

/// When a confirm may be sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReplicationMode {
    /// After the leader's local fsync (followers catch up behind).
    #[default]
    Async,
    /// After `min_insync` replicas, the leader included, have the record on disk.
    Sync,
}

/// `[replication]`: a leader's settings.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicationSection {
    pub mode: ReplicationMode,
    /// Replicas (the leader included) that must be in sync, and in sync mode hold a
    /// record on disk, before a publish is confirmed.
    pub min_insync: u32,
    /// A follower further behind than this leaves the in-sync set.
    pub replica_lag_max: ByteSize,
}

impl Default for ReplicationSection {
    fn default() -> Self {
        ReplicationSection {
            mode: ReplicationMode::Async,
            min_insync: 2,
            replica_lag_max: ByteSize::mib(64),
        }
    }
}

/// `[mqtt]`: MQTT settings beyond the listener and packet size.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MqttSection {
    /// A persistent session (clean session 0) whose client stays disconnected longer
    /// than this is removed with its queue and subscriptions (Mosquitto's
    /// `persistent_client_expiration`). Counted from the disconnect, across restarts.
    /// Off (`None`) by default: sessions are kept until a clean-session connect.
    pub session_expiry: Option<HumanDuration>,
    /// Subscriptions one session may hold (EMQX's `max_subscriptions`); a SUBSCRIBE
    /// past it gets return code 0x80 for each new filter. Each subscription is a
    /// binding in the broker's memory and a journal record.
    pub max_subscriptions: u32,
    /// The vhost a CONNECT opens by the port it came in on (RabbitMQ's
    /// `mqtt_port_to_vhost_mapping` global parameter, here in the file): listener port →
    /// vhost, e.g. `{ "1883" = "/", "8883" = "devices" }`. A user name `vhost:user` takes
    /// precedence; a port not listed opens `auth.default_vhost`. WebSocket MQTT counts
    /// as the HTTP listener's port.
    pub port_to_vhost: BTreeMap<String, String>,
    /// Take an MQTT user name as it is, colons included, instead of reading
    /// `vhost:user` from it (RabbitMQ's `mqtt.ignore_colons_in_username`).
    pub ignore_colons_in_username: bool,
    /// Retention (`x-max-age`) of the stream queue `mqtt-stream/<filter>` that a
    /// `$stream/<start>/<filter>` subscription declares when it does not exist (an
    /// operator-declared one keeps its own arguments). At least 1s.
    pub stream_max_age: HumanDuration,
    /// Retention (`x-max-length-bytes`) of such a stream queue. At least 1.
    pub stream_max_bytes: ByteSize,
    /// Index each stored PUBLISH in the store's IndexFile under its vhost and topic, so
    /// that `GET /api/messages/by-topic/...` (and `triadctl query_msg --topic`) finds
    /// it. Off by default: it costs about 2.5 % more instructions per message and 20
    /// bytes of index file per message (BENCHMARKS.md).
    pub index_topics: bool,
}

impl Default for MqttSection {
    fn default() -> Self {
        MqttSection {
            session_expiry: None,
            max_subscriptions: 10_000,
            port_to_vhost: BTreeMap::new(),
            ignore_colons_in_username: false,
            stream_max_age: HumanDuration::secs(7 * 24 * 3600),
            stream_max_bytes: ByteSize::gib(1),
            index_topics: false,
        }
    }
}

impl MqttSection {
    /// The vhost `port_to_vhost` maps `port` to.
    pub fn vhost_for_port(&self, port: u16) -> Option<&str> {
        self.port_to_vhost
            .iter()
            .find(|(p, _)| p.parse::<u16>() == Ok(port))
            .map(|(_, v)| v.as_str())
    }
}

/// `[http]`: the HTTP listener: `/health`, the management API (`/api/...`) and the
/// WebSocket endpoints.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpSection {
    /// Origins (`scheme://host[:port]`) whose pages may open a WebSocket; `"*"` = any.
    /// An upgrade without `Origin` (not a browser) is always allowed; one from the
    /// broker's own origin (`Origin` naming the `Host` it asked for) is allowed by
    /// default; any other gets 403. Defends against cross-site WebSocket hijacking.
    pub allowed_origins: Vec<String>,
    /// Open WebSocket connections (they also count toward `limits.max_connections`);
    /// past it an upgrade gets 503. Keeps WebSocket clients from taking every slot.
    pub max_websocket_connections: u32,
    /// HTTP connections open at once (health probes, API clients with keep-alive,
    /// upgrades before they complete); past it a connection gets 503 at once. Upgraded
    /// connections do not hold one, so `/health` always answers.
    pub max_requests: u32,
    /// Largest request body (management API: definitions, published messages); a
    /// larger one gets 413 before it is read. RabbitMQ's `management.http_max_body_size`.
    pub max_body_size: ByteSize,
}

impl Default for HttpSection {
    fn default() -> Self {
        HttpSection {
            allowed_origins: Vec::new(),
            max_websocket_connections: 1024,
            max_requests: 64,
            max_body_size: ByteSize(10_000_000),
        }
    }
}

/// `[stomp]`: per-connection caps on STOMP state, each an ERROR and close when exceeded.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StompSection {
    /// Open transactions (BEGIN without COMMIT / ABORT) per connection.
    pub max_transactions: u32,
    /// Frames (SEND, ACK, NACK) buffered in one transaction.
    pub max_transaction_frames: u32,
    /// Bytes of SEND bodies buffered in all of a connection's transactions.
    pub max_transaction_bytes: ByteSize,
    /// Subscriptions per connection.
    pub max_subscriptions: u32,
    /// Longest `transaction`, subscription `id` and destination, in bytes.
    pub max_id_length: u32,
}

impl Default for StompSection {
    fn default() -> Self {
        StompSection {
            max_transactions: 16,
            max_transaction_frames: 1024,
            max_transaction_bytes: ByteSize::mib(16),
            max_subscriptions: 256,
            max_id_length: 256,
        }
    }
}

/// `[txn]`: half messages (`x-txn: half`) and their check-back.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TxnSection {
    /// A half message unresolved this long gets a check message to its `reply-to`,
    /// and again after each further period (RocketMQ's `transactionTimeOut`).
    pub check_timeout: HumanDuration,
    /// Checks sent before an unresolved half message is rolled back
    /// (RocketMQ's `transactionCheckMax`).
    pub check_max: u32,
}

impl Default for TxnSection {
    /// The core's defaults (6 s, 15 checks).
    fn default() -> Self {
        let d = triad_core::txn::TxnConfig::default();
        TxnSection {
            check_timeout: HumanDuration(d.check_timeout),
            check_max: d.check_max,
        }
    }
}

/// One `[[users]]` entry. The password is stored only as RabbitMQ's salted SHA-256
/// hash (`triad hash-password` makes one; so does RabbitMQ).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserSection {
    pub name: String,
    /// base64(4-byte salt ++ SHA-256(salt ++ password)).
    pub password_hash: String,
    #[serde(default)]
    pub tags: Vec<String>,
    /// RabbitMQ's user limit `max-connections`: connections open at once over all
    /// protocols; overrides `limits.max_connections_per_user`. Negative: unlimited
    /// (RabbitMQ's -1); 0: no connection.
    #[serde(default)]
    pub max_connections: Option<i64>,
    /// RabbitMQ's user limit `max-channels`: channels open at once over all the user's
    /// connections (AMQP channels; a STOMP or MQTT connection counts one). Negative:
    /// unlimited; 0: none.
    #[serde(default)]
    pub max_channels: Option<i64>,
}

/// A user limit from the file: negative (or past `u32`) is unlimited.
fn user_limit(v: Option<i64>) -> Option<u32> {
    v.map(|n| u32::try_from(n).unwrap_or(triad_core::UserLimits::UNLIMITED))
}

/// One `[[permissions]]` entry: RabbitMQ's configure / write / read regexes.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PermissionSection {
    pub user: String,
    pub vhost: String,
    pub configure: String,
    pub write: String,
    pub read: String,
}

/// One `[[topic_permissions]]` entry: RabbitMQ's topic authorisation, regexes on the
/// routing keys `user` may publish with (`write`) and bind with (`read`) on the topic
/// exchange `exchange`. `{username}` and `{vhost}` are replaced before compiling.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopicPermissionSection {
    pub user: String,
    pub vhost: String,
    pub exchange: String,
    pub write: String,
    pub read: String,
}

/// One `[[vhosts]]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VhostSection {
    pub name: String,
}

/// `HOST:PORT` to listen on per protocol; port 0 binds an ephemeral port. The TLS
/// listeners (`amqps`, `stomps`, `mqtts`, `https`) are bound only when [`TlsSection`]
/// names a certificate and key.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Listeners {
    pub amqp: String,
    pub stomp: String,
    pub mqtt: String,
    pub http: String,
    pub amqps: String,
    pub stomps: String,
    pub mqtts: String,
    pub https: String,
    /// Expect a PROXY protocol (v1 or v2) header first on every AMQP, STOMP and MQTT
    /// listener, plain and TLS (before the handshake), as sent by HAProxy's
    /// `send-proxy` / `send-proxy-v2`: its source address is then the peer address for
    /// logs, the loopback rule and logins. A connection without a valid header within
    /// 5 s is closed. Off by default: a listener without it never parses one. Not for
    /// the HTTP listeners.
    pub proxy_protocol: bool,
}

impl Listeners {
    /// The configured `HOST:PORT` for `proto`.
    pub fn addr(&self, proto: Proto) -> &str {
        match proto {
            Proto::Amqp => &self.amqp,
            Proto::Stomp => &self.stomp,
            Proto::Mqtt => &self.mqtt,
            Proto::Http => &self.http,
            Proto::Amqps => &self.amqps,
            Proto::Stomps => &self.stomps,
            Proto::Mqtts => &self.mqtts,
            Proto::Https => &self.https,
        }
    }

    /// The config key of `proto`'s address, for errors.
    pub fn key(proto: Proto) -> &'static str {
        match proto {
            Proto::Amqp => "listeners.amqp",
            Proto::Stomp => "listeners.stomp",
            Proto::Mqtt => "listeners.mqtt",
            Proto::Http => "listeners.http",
            Proto::Amqps => "listeners.amqps",
            Proto::Stomps => "listeners.stomps",
            Proto::Mqtts => "listeners.mqtts",
            Proto::Https => "listeners.https",
        }
    }
}

impl Default for Listeners {
    fn default() -> Self {
        Listeners {
            amqp: "0.0.0.0:5672".into(),
            stomp: "0.0.0.0:61613".into(),
            mqtt: "0.0.0.0:1883".into(),
            http: "0.0.0.0:15672".into(),
            amqps: "0.0.0.0:5671".into(),
            stomps: "0.0.0.0:61614".into(),
            mqtts: "0.0.0.0:8883".into(),
            https: "0.0.0.0:15671".into(),
            proxy_protocol: false,
        }
    }
}

/// TLS for the `amqps`, `stomps`, `mqtts` and `https` listeners (rustls; TLS 1.2 and
/// 1.3 only). Key names follow RabbitMQ's `ssl_options`. No certificate by default, so
/// by default no TLS listener is bound. The files are read and checked at startup by
/// [`crate::tls::server_config`].
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsSection {
    /// PEM certificate chain, the server's certificate first.
    pub cert_file: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of that certificate.
    pub key_file: Option<PathBuf>,
    /// PEM bundle of the CAs that client certificates are verified against.
    pub ca_file: Option<PathBuf>,
    /// Ask clients for a certificate and verify it against `ca_file`; a client that
    /// presents an invalid one is refused.
    pub verify_peer: bool,
    /// With `verify_peer`: also refuse clients that present no certificate.
    pub fail_if_no_peer_cert: bool,
    /// How often the certificate, key and CA files are checked for changes (mtime, size,
    /// inode); a change reloads them as SIGHUP does. `"0s"` = only on SIGHUP.
    pub watch_interval: HumanDuration,
    /// Sessions remembered for resumption by session ID (TLS 1.2) and by stateful
    /// ticket (TLS 1.3), broker-wide, least recently used dropped first. 0 = none.
    pub session_cache_size: usize,
    /// Stateless session tickets (TLS 1.2 and 1.3), encrypted with a key that rotates
    /// every 6 hours; the broker then keeps no state per session. Off: resumption uses
    /// the session cache.
    pub session_tickets: bool,
    /// Tickets sent to a TLS 1.3 client after its handshake (each ticket resumes once).
    /// 0 = no TLS 1.3 resumption.
    pub tls13_tickets: usize,
    /// `[[tls.certificates]]`: further chains, each served to clients that ask for one
    /// of its `server_names` (SNI); `cert_file` / `key_file` serve everyone else.
    pub certificates: Vec<TlsCertificateSection>,
}

/// One `[[tls.certificates]]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsCertificateSection {
    /// PEM certificate chain, the server's certificate first.
    pub cert_file: PathBuf,
    /// PEM private key of that certificate.
    pub key_file: PathBuf,
    /// Host names (case-insensitive) this chain is for; `*.example.com` matches one
    /// label in front of `example.com`.
    pub server_names: Vec<String>,
}

impl Default for TlsSection {
    fn default() -> Self {
        TlsSection {
            cert_file: None,
            key_file: None,
            ca_file: None,
            verify_peer: false,
            fail_if_no_peer_cert: false,
            watch_interval: HumanDuration::secs(5),
            session_cache_size: 1024,
            session_tickets: false,
            tls13_tickets: 2,
            certificates: Vec::new(),
        }
    }
}

impl TlsSection {
    /// Whether the TLS listeners are to be started.
    pub fn enabled(&self) -> bool {
        self.cert_file.is_some() && self.key_file.is_some()
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlushKind {
    /// Group commit: a publish is confirmed once it is on disk.
    #[default]
    Sync,
    /// Flush every `flush_interval` or `flush_dirty_bytes`; confirm after the page-cache write.
    Async,
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreSection {
    pub data_dir: PathBuf,
    pub segment_size: ByteSize,
    pub flush: FlushKind,
    pub flush_interval: HumanDuration,
    pub flush_dirty_bytes: ByteSize,
    pub checkpoint_interval: HumanDuration,
    /// How often segments nothing needs are deleted and segments with little live data
    /// compacted.
    pub retention_interval: HumanDuration,
    /// The metadata journal is compacted into a snapshot once it is past this size (and
    /// twice the last snapshot).
    pub metadata_compact_size: ByteSize,
}

impl Default for StoreSection {
    fn default() -> Self {
        StoreSection {
            data_dir: PathBuf::from("./data"),
            segment_size: ByteSize::gib(1),
            flush: FlushKind::Sync,
            flush_interval: HumanDuration::millis(200),
            flush_dirty_bytes: ByteSize::mib(16),
            checkpoint_interval: HumanDuration::secs(1),
            retention_interval: HumanDuration::secs(10),
            metadata_compact_size: ByteSize::mib(8),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Auth {
    /// Used by STOMP CONNECT without `login` and MQTT CONNECT without a username.
    pub default_user: String,
    pub default_pass: String,
    /// Users that may only log in from a loopback address.
    pub loopback_users: Vec<String>,
    pub default_vhost: String,
    /// How long a refused login waits before its answer (inside that connection's
    /// task only): slows password guessing down.
    pub failed_login_delay: HumanDuration,
    /// STOMP CONNECT without `login` and MQTT CONNECT without a user name, over TLS
    /// with a verified client certificate, log in as the certificate's CN (RabbitMQ's
    /// `stomp.ssl_cert_login` / `mqtt.ssl_cert_login`). AMQP always offers EXTERNAL
    /// when a verified certificate was presented.
    pub ssl_cert_login: bool,
    /// Who may log in without credentials (STOMP CONNECT without `login`, MQTT CONNECT
    /// without a user name), as `anonymous_user`, with no password checked.
    pub anonymous: Anonymous,
    /// The user an anonymous login becomes; unset = `default_user`.
    pub anonymous_user: Option<String>,
    /// Whether anonymous logins are accepted over WebSocket too (off: any web page a
    /// browser on the broker's host opens could otherwise use them).
    pub anonymous_websocket: bool,
}

/// `auth.anonymous`: who may log in without credentials.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Anonymous {
    /// Nobody: every login needs credentials (or a client certificate).
    Off,
    /// Peers on a loopback address only (RabbitMQ's guest default).
    Loopback,
    /// Any peer.
    Any,
}

impl Auth {
    /// The user an anonymous login from `peer` becomes (`websocket`: it came through
    /// the HTTP listener's upgrade), or `None` when it is not allowed.
    pub fn anonymous_login(&self, peer: std::net::IpAddr, websocket: bool) -> Option<String> {
        if websocket && !self.anonymous_websocket {
            return None;
        }
        let allowed = match self.anonymous {
            Anonymous::Off => false,
            Anonymous::Loopback => peer.to_canonical().is_loopback(),
            Anonymous::Any => true,
        };
        allowed.then(|| {
            self.anonymous_user
                .clone()
                .unwrap_or_else(|| self.default_user.clone())
        })
    }
}

impl Default for Auth {
    fn default() -> Self {
        Auth {
            default_user: "guest".into(),
            default_pass: "guest".into(),
            loopback_users: vec!["guest".into()],
            default_vhost: "/".into(),
            failed_login_delay: HumanDuration::secs(1),
            ssl_cert_login: false,
            anonymous: Anonymous::Loopback,
            anonymous_user: None,
            anonymous_websocket: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest AMQP frame accepted after connection.tune (the `frame_max` offered).
    pub frame_max: ByteSize,
    /// Largest STOMP frame (command, headers, body) after CONNECTED (RabbitMQ's
    /// `stomp.max_frame_size`); before it, 64 KiB. Unset: `max_message_size` plus
    /// [`STOMP_HEAD_ROOM`] for the headers ([`Limits::stomp_frame_max`]).
    pub stomp_frame_max: Option<ByteSize>,
    /// Largest MQTT packet (remaining length) after CONNACK (RabbitMQ's
    /// `mqtt.max_packet_size_authenticated`); before it, 64 KiB. Unset:
    /// `max_message_size` plus [`MQTT_HEAD_ROOM`], below MQTT's own 256 MiB
    /// ([`Limits::mqtt_packet_max`]).
    pub mqtt_packet_max: Option<ByteSize>,
    /// Largest message body, in every protocol: AMQP bodies, STOMP SEND bodies and
    /// MQTT payloads (RabbitMQ's `max_message_size`, its default of 128 MiB). The
    /// STOMP frame and MQTT packet limits follow it unless set.
    pub max_message_size: ByteSize,
    /// Deadline for a connection to complete its protocol handshake and login.
    pub handshake_timeout: HumanDuration,
    /// Heartbeat the server proposes; `"0s"` disables it.
    pub heartbeat: HumanDuration,
    pub channel_max: u16,
    /// Open connections over all protocols; 0 = unlimited.
    pub max_connections: u32,
    /// Open connections per user over all protocols; 0 = unlimited.
    pub max_connections_per_user: u32,
    /// Queues per vhost (server-named and internal ones included); 0 = unlimited.
    pub max_queues_per_vhost: u32,
    /// Memory alarm: publishers are blocked while the broker's resident memory is above
    /// this fraction of the machine's RAM (RabbitMQ's `vm_memory_high_watermark`).
    pub memory_high_watermark: Ratio,
    /// Disk alarm: publishers are blocked while the data directory's file system has less
    /// free space than this (RabbitMQ's `disk_free_limit`).
    pub disk_free_limit: ByteSize,
}

/// A fraction between 0 and 1, as written in the file (`0.4`).
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(transparent)]
pub struct Ratio(pub f64);

impl PartialEq for Ratio {
    fn eq(&self, other: &Ratio) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}
impl Eq for Ratio {}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            frame_max: ByteSize::kib(128),
            stomp_frame_max: None,
            mqtt_packet_max: None,
            max_message_size: ByteSize::mib(128),
            handshake_timeout: HumanDuration::secs(10),
            heartbeat: HumanDuration::secs(60),
            channel_max: 2047,
            max_connections: 0,
            max_connections_per_user: 0,
            max_queues_per_vhost: 0,
            memory_high_watermark: Ratio(0.4),
            disk_free_limit: ByteSize::mib(50),
        }
    }
}

/// Room for a STOMP frame's command and headers above `limits.max_message_size`.
pub const STOMP_HEAD_ROOM: u64 = 1 << 20;
/// Room for an MQTT PUBLISH's topic and packet id above `limits.max_message_size`
/// (a topic is at most 255 bytes here).
pub const MQTT_HEAD_ROOM: u64 = 64 << 10;
/// MQTT 3.1.1's largest remaining length: 2^28 - 1.
const MQTT_REMAINING_MAX: u64 = (1 << 28) - 1;
/// RabbitMQ's ceiling for `max_message_size`.
const MESSAGE_SIZE_MAX: u64 = 512 << 20;

impl Limits {
    /// The STOMP frame limit in force: `stomp_frame_max` when set, else
    /// `max_message_size` plus [`STOMP_HEAD_ROOM`].
    pub fn stomp_frame_max(&self) -> u64 {
        self.stomp_frame_max.map_or_else(
            || {
                self.max_message_size
                    .bytes()
                    .saturating_add(STOMP_HEAD_ROOM)
            },
            |b| b.bytes(),
        )
    }

    /// The MQTT packet limit in force: `mqtt_packet_max` when set, else
    /// `max_message_size` plus [`MQTT_HEAD_ROOM`], at most MQTT's 2^28 - 1.
    pub fn mqtt_packet_max(&self) -> u64 {
        self.mqtt_packet_max.map_or_else(
            || {
                self.max_message_size
                    .bytes()
                    .saturating_add(MQTT_HEAD_ROOM)
                    .min(MQTT_REMAINING_MAX)
            },
            |b| b.bytes(),
        )
    }
}

/// AMQP 0-9-1's `frame-min-size`: no peer may be offered less.
const FRAME_MIN: u64 = 4096;
const SEGMENT_MIN: u64 = 64 << 10;

impl Config {
    /// Parses a TOML document; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &Path) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })
    }

    /// Reads and parses a TOML file (not yet validated).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Config::from_toml(&text, path)
    }

    /// Checks values that parse but make no sense together or for a protocol.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let w = self.limits.memory_high_watermark.0;
        if !(w > 0.0 && w <= 1.0) {
            return Err(invalid(
                "limits.memory_high_watermark",
                w.to_string(),
                "must be a fraction of RAM above 0 and at most 1",
            ));
        }
        for proto in Proto::ALL.into_iter().chain(Proto::TLS) {
            check_listen(Listeners::key(proto), self.listeners.addr(proto))?;
        }
        self.validate_tls()?;
        self.validate_cluster()?;

        self.validate_store()?;
        self.validate_mqtt()?;
        if self.txn.check_timeout.get() < std::time::Duration::from_millis(100) {
            return Err(invalid(
                "txn.check_timeout",
                self.txn.check_timeout,
                "must be at least 100ms",
            ));
        }
        self.validate_auth()?;
        self.validate_limits()
    }

    /// `[store]`.
    fn validate_store(&self) -> Result<(), ConfigError> {
        let s = &self.store;
        if s.data_dir.as_os_str().is_empty() {
            return Err(invalid("store.data_dir", "", "must not be empty"));
        }
        if s.segment_size.bytes() < SEGMENT_MIN {
            return Err(invalid(
                "store.segment_size",
                s.segment_size,
                format!("must be at least {}", ByteSize(SEGMENT_MIN)),
            ));
        }
        if s.segment_size <= self.limits.max_message_size {
            return Err(invalid(
                "store.segment_size",
                s.segment_size,
                format!(
                    "must be larger than limits.max_message_size ({})",
                    self.limits.max_message_size
                ),
            ));
        }
        if s.flush == FlushKind::Async {
            if s.flush_interval.get().is_zero() {
                return Err(invalid(
                    "store.flush_interval",
                    s.flush_interval,
                    "must be above zero",
                ));
            }
            if s.flush_dirty_bytes.bytes() == 0 {
                return Err(invalid(
                    "store.flush_dirty_bytes",
                    s.flush_dirty_bytes,
                    "must be above zero",
                ));
            }
        }
        if s.metadata_compact_size.bytes() < 4096 {
            return Err(invalid(
                "store.metadata_compact_size",
                s.metadata_compact_size,
                "must be at least 4 KiB",
            ));
        }
        if s.checkpoint_interval.get().is_zero() {
            return Err(invalid(
                "store.checkpoint_interval",
                s.checkpoint_interval,
                "must be above zero",
            ));
        }
        if s.retention_interval.get().is_zero() {
            return Err(invalid(
                "store.retention_interval",
                s.retention_interval,
                "must be above zero",
            ));
        }
        Ok(())
    }

    /// `[mqtt]`.
    fn validate_mqtt(&self) -> Result<(), ConfigError> {
        if self.mqtt.max_subscriptions == 0 {
            return Err(invalid(
                "mqtt.max_subscriptions",
                self.mqtt.max_subscriptions,
                "must be at least 1",
            ));
        }
        for (port, vhost) in &self.mqtt.port_to_vhost {
            if port.parse::<u16>().map_or(true, |p| p == 0) {
                return Err(invalid(
                    "mqtt.port_to_vhost",
                    port,
                    "keys are listener port numbers (1-65535)",
                ));
            }
            if vhost.is_empty() {
                return Err(invalid(
                    "mqtt.port_to_vhost",
                    port,
                    "the vhost must not be empty",
                ));
            }
        }
        if let Some(e) = self.mqtt.session_expiry {
            if e.get() < std::time::Duration::from_millis(100) {
                return Err(invalid(
                    "mqtt.session_expiry",
                    e,
                    "must be at least 100ms (leave the key out to keep sessions forever)",
                ));
            }
        }

        if self.mqtt.stream_max_age.get() < std::time::Duration::from_secs(1) {
            return Err(invalid(
                "mqtt.stream_max_age",
                self.mqtt.stream_max_age,
                "must be at least 1s",
            ));
        }
        if self.mqtt.stream_max_bytes.0 == 0 {
            return Err(invalid(
                "mqtt.stream_max_bytes",
                self.mqtt.stream_max_bytes,
                "must be at least 1",
            ));
        }
        Ok(())
    }

    /// `[auth]` (and the users and rights it names).
    fn validate_auth(&self) -> Result<(), ConfigError> {
        let a = &self.auth;
        if a.default_user.is_empty() {
            return Err(invalid("auth.default_user", "", "must not be empty"));
        }
        self.validate_anonymous()?;
        self.validate_http_stomp()?;
        if a.default_vhost.is_empty() {
            return Err(invalid("auth.default_vhost", "", "must not be empty"));
        }
        if a.failed_login_delay.get() > std::time::Duration::from_secs(60) {
            return Err(invalid(
                "auth.failed_login_delay",
                a.failed_login_delay,
                "must be at most 60s",
            ));
        }
        self.validate_users()?;
        Ok(())
    }

    /// `[limits]` other than the memory watermark (checked first).
    fn validate_limits(&self) -> Result<(), ConfigError> {
        let m = &self.limits;
        if m.frame_max.bytes() < FRAME_MIN || m.frame_max.bytes() > u64::from(u32::MAX) {
            return Err(invalid(
                "limits.frame_max",
                m.frame_max,
                format!("must be between {} and 4 GiB", ByteSize(FRAME_MIN)),
            ));
        }
        // Never below the pre-login limits; MQTT's remaining length is at most 2^28 - 1.
        if let Some(f) = m.stomp_frame_max {
            if f.bytes() < 64 << 10 || f.bytes() > 1 << 30 {
                return Err(invalid(
                    "limits.stomp_frame_max",
                    f,
                    "must be between 64 KiB and 1 GiB",
                ));
            }
        }
        if let Some(p) = m.mqtt_packet_max {
            if p.bytes() < 64 << 10 || p.bytes() > MQTT_REMAINING_MAX {
                return Err(invalid(
                    "limits.mqtt_packet_max",
                    p,
                    "must be at least 64 KiB and below 256 MiB (MQTT's largest remaining length)",
                ));
            }
        }
        if m.max_message_size.bytes() == 0 || m.max_message_size.bytes() > MESSAGE_SIZE_MAX {
            return Err(invalid(
                "limits.max_message_size",
                m.max_message_size,
                format!(
                    "must be above zero and at most {} (RabbitMQ's ceiling)",
                    ByteSize(MESSAGE_SIZE_MAX)
                ),
            ));
        }
        if m.handshake_timeout.get().is_zero() {
            return Err(invalid(
                "limits.handshake_timeout",
                m.handshake_timeout,
                "must be above zero",
            ));
        }
        if m.heartbeat.get().subsec_nanos() != 0 || m.heartbeat.get().as_secs() > 65535 {
            return Err(invalid(
                "limits.heartbeat",
                m.heartbeat,
                "must be whole seconds, at most 65535s (AMQP sends it as a 16-bit count of seconds)",
            ));
        }
        Ok(())
    }

    /// The `[tls]` keys that make no sense together; the files themselves are checked
    /// when they are loaded ([`crate::tls::server_config`]).
    /// `[cluster]` and `[replication]`: every key works or is refused here.
    fn validate_cluster(&self) -> Result<(), ConfigError> {
        let Some(c) = &self.cluster else {
            if self.replication.is_some() {
                return Err(invalid(
                    "replication",
                    "[replication]",
                    "needs a [cluster] section (role = \"leader\")",
                ));
            }
            return Ok(());
        };
        if c.node_id.is_empty() || c.node_id.len() > 255 {
            return Err(invalid(
                "cluster.node_id",
                &c.node_id,
                "must be 1 to 255 bytes",
            ));
        }
        if let Some(t) = &c.tls {
            validate_cluster_tls(t)?;
        }
        if c.elected() {
            return self.validate_elected(c);
        }
        for (key, set) in [
            ("cluster.lease_ttl", c.lease_ttl.is_some()),
            ("cluster.advertise", c.advertise.is_some()),
            ("cluster.name", c.name.is_some()),
            ("cluster.etcd_tls", c.etcd_tls.is_some()),
        ] {
            if set {
                return Err(invalid(
                    key,
                    "",
                    "belongs to an elected group: needs cluster.etcd",
                ));
            }
        }
        self.validate_static(c)
    }

    /// `[cluster]` with a static role (no `etcd`).
    fn validate_static(&self, c: &ClusterSection) -> Result<(), ConfigError> {
        match c.role {
            None | Some(ClusterRole::Auto) => Err(invalid(
                "cluster.role",
                "auto",
                "without cluster.etcd the role is static: \"leader\" or \"follower\"",
            )),
            Some(ClusterRole::Leader) => {
                let listen = c.listen.as_deref().ok_or_else(|| {
                    invalid(
                        "cluster.listen",
                        "",
                        "a leader needs its replication listener",
                    )
                })?;
                check_listen("cluster.listen", listen)?;
                if let Some(l) = &c.leader {
                    return Err(invalid(
                        "cluster.leader",
                        l,
                        "is a follower's setting (this node's role is leader)",
                    ));
                }
                self.validate_replication()
            }
            Some(ClusterRole::Follower) => {
                let leader = c.leader.as_deref().ok_or_else(|| {
                    invalid(
                        "cluster.leader",
                        "",
                        "a follower needs its leader's replication address",
                    )
                })?;
                check_listen("cluster.leader", leader)?;
                if let Some(l) = &c.listen {
                    return Err(invalid(
                        "cluster.listen",
                        l,
                        "is a leader's setting (this node's role is follower)",
                    ));
                }
                if self.replication.is_some() {
                    return Err(invalid(
                        "replication",
                        "[replication]",
                        "is the leader's setting; a follower copies whatever its leader ships",
                    ));
                }
                Ok(())
            }
        }
    }

    /// `[replication]` of a node that leads (static leader, or any elected node).
    fn validate_replication(&self) -> Result<(), ConfigError> {
        let r = self.replication.clone().unwrap_or_default();
        if r.min_insync == 0 {
            return Err(invalid(
                "replication.min_insync",
                r.min_insync,
                "must be at least 1 (the leader)",
            ));
        }
        if r.mode == ReplicationMode::Sync && self.store.flush == FlushKind::Async {
            return Err(invalid(
                "replication.mode",
                "sync",
                "needs store.flush = \"sync\" (a replica counts once the record is on its disk, the leader's included)",
            ));
        }
        Ok(())
    }

    /// `[cluster]` with `etcd`: the role is elected, so every node needs what a leader
    /// needs (a replication listener, `[replication]`) and no static leader.
    fn validate_elected(&self, c: &ClusterSection) -> Result<(), ConfigError> {
        if let Some(r) = c.role.filter(|r| *r != ClusterRole::Auto) {
            let r = format!("{r:?}").to_lowercase();
            return Err(invalid(
                "cluster.role",
                &r,
                "contradicts cluster.etcd: the election decides the role (leave role out, or \"auto\")",
            ));
        }
        if let Some(l) = &c.leader {
            return Err(invalid(
                "cluster.leader",
                l,
                "contradicts cluster.etcd: the leader is whoever holds the election key",
            ));
        }
        validate_etcd_urls(c)?;
        let ttl = c.lease_ttl();
        if ttl.subsec_nanos() != 0 || !(2..=60).contains(&ttl.as_secs()) {
            return Err(invalid(
                "cluster.lease_ttl",
                HumanDuration(ttl),
                "must be whole seconds from 2s to 60s (etcd grants leases in seconds, and \
                 at least 2 s with its default election timeout)",
            ));
        }
        let name = c.group_name();
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return Err(invalid(
                "cluster.name",
                name,
                "must be 1 to 64 letters, digits, '-', '_' or '.'",
            ));
        }
        let listen = c.listen.as_deref().ok_or_else(|| {
            invalid(
                "cluster.listen",
                "",
                "an elected node needs its replication listener (any node may lead)",
            )
        })?;
        check_listen("cluster.listen", listen)?;
        match &c.advertise {
            Some(a) => {
                check_listen("cluster.advertise", a)?;
                if a.ends_with(":0") {
                    return Err(invalid(
                        "cluster.advertise",
                        a,
                        "needs the port the others connect to",
                    ));
                }
            }
            None => {
                let host = listen.rsplit_once(':').map(|(h, _)| h).unwrap_or_default();
                if matches!(host, "0.0.0.0" | "[::]") {
                    return Err(invalid(
                        "cluster.advertise",
                        "",
                        "is needed when cluster.listen is on every interface: the address \
                         the other nodes reach this one at",
                    ));
                }
            }
        }
        self.validate_replication()
    }

    fn validate_tls(&self) -> Result<(), ConfigError> {
        let t = &self.tls;
        let shown = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
        for (key, path) in [
            ("tls.cert_file", &t.cert_file),
            ("tls.key_file", &t.key_file),
            ("tls.ca_file", &t.ca_file),
        ] {
            if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                return Err(invalid(key, "", "must not be empty (leave the key out)"));
            }
        }
        match (&t.cert_file, &t.key_file) {
            (Some(_), None) => {
                return Err(invalid(
                    "tls.cert_file",
                    shown(&t.cert_file).unwrap_or_default(),
                    "needs tls.key_file too",
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "tls.key_file",
                    shown(&t.key_file).unwrap_or_default(),
                    "needs tls.cert_file too",
                ))
            }
            _ => {}
        }
        let mut names = std::collections::HashSet::new();
        for c in &t.certificates {
            let key = "tls.certificates";
            if !t.enabled() {
                return Err(invalid(
                    key,
                    c.cert_file.display(),
                    "needs tls.cert_file and tls.key_file (the chain for other names)",
                ));
            }
            if c.server_names.is_empty() {
                return Err(invalid(
                    key,
                    c.cert_file.display(),
                    "server_names must name at least one host",
                ));
            }
            for name in &c.server_names {
                if name.is_empty() || !names.insert(name.to_ascii_lowercase()) {
                    return Err(invalid(
                        key,
                        name,
                        "server names must be non-empty and appear once",
                    ));
                }
            }
        }
        if t.verify_peer && t.ca_file.is_none() {
            return Err(invalid(
                "tls.verify_peer",
                true,
                "needs tls.ca_file (the CAs client certificates are checked against)",
            ));
        }
        if t.fail_if_no_peer_cert && !t.verify_peer {
            return Err(invalid(
                "tls.fail_if_no_peer_cert",
                true,
                "needs tls.verify_peer = true",
            ));
        }
        if !t.enabled() && (t.ca_file.is_some() || t.verify_peer) {
            return Err(invalid(
                if t.verify_peer {
                    "tls.verify_peer"
                } else {
                    "tls.ca_file"
                },
                if t.verify_peer {
                    "true".to_owned()
                } else {
                    shown(&t.ca_file).unwrap_or_default()
                },
                "needs tls.cert_file and tls.key_file (no TLS listener runs without them)",
            ));
        }
        Ok(())
    }

    /// `auth.anonymous_user` exists and can log in the way `auth.anonymous` allows.
    fn validate_anonymous(&self) -> Result<(), ConfigError> {
        let a = &self.auth;
        let Some(user) = a.anonymous_user.as_deref() else {
            return Ok(());
        };
        if user != a.default_user && !self.users.iter().any(|u| u.name == user) {
            return Err(invalid(
                "auth.anonymous_user",
                user,
                "no such user (add it under [[users]])",
            ));
        }
        if a.anonymous == Anonymous::Any && a.loopback_users.iter().any(|u| u == user) {
            return Err(invalid(
                "auth.anonymous_user",
                user,
                "is in auth.loopback_users, so auth.anonymous = \"any\" would be refused to every other peer",
            ));
        }
        Ok(())
    }

    /// `[http]` and `[stomp]` limits: none may be zero, origins must be origins.
    fn validate_http_stomp(&self) -> Result<(), ConfigError> {
        for o in &self.http.allowed_origins {
            let ok = o == "*"
                || o.split_once("://").is_some_and(|(scheme, host)| {
                    !scheme.is_empty() && !host.is_empty() && !host.contains('/')
                });
            if !ok {
                return Err(invalid(
                    "http.allowed_origins",
                    o,
                    "must be \"*\" or scheme://host[:port] (no path)",
                ));
            }
        }
        let h = &self.http;
        let st = &self.stomp;
        for (key, v) in [
            (
                "http.max_websocket_connections",
                u64::from(h.max_websocket_connections),
            ),
            ("http.max_requests", u64::from(h.max_requests)),
            ("http.max_body_size", h.max_body_size.bytes()),
            ("stomp.max_transactions", u64::from(st.max_transactions)),
            (
                "stomp.max_transaction_frames",
                u64::from(st.max_transaction_frames),
            ),
            (
                "stomp.max_transaction_bytes",
                st.max_transaction_bytes.bytes(),
            ),
            ("stomp.max_subscriptions", u64::from(st.max_subscriptions)),
            ("stomp.max_id_length", u64::from(st.max_id_length)),
        ] {
            if v == 0 {
                return Err(invalid(key, 0, "must be at least 1"));
            }
        }
        Ok(())
    }

    /// `[[users]]`, `[[permissions]]` and `[[vhosts]]`: names unique and known,
    /// hashes and patterns well-formed.
    fn validate_users(&self) -> Result<(), ConfigError> {
        let mut vhosts = vec![self.auth.default_vhost.as_str()];
        for v in &self.vhosts {
            if v.name.is_empty() {
                return Err(invalid("vhosts.name", "", "must not be empty"));
            }
            vhosts.push(&v.name);
        }
        let mut users = vec![self.auth.default_user.as_str()];
        for u in &self.users {
            if u.name.is_empty() {
                return Err(invalid("users.name", "", "must not be empty"));
            }
            if self.users.iter().filter(|o| o.name == u.name).count() > 1 {
                return Err(invalid("users.name", &u.name, "listed twice"));
            }
            triad_core::PasswordHash::parse(&u.password_hash).map_err(|e| {
                invalid(
                    "users.password_hash",
                    &u.name,
                    format!("{e} (make one with `triad hash-password`)"),
                )
            })?;
            users.push(&u.name);
        }
        for p in &self.permissions {
            if !users.contains(&p.user.as_str()) {
                return Err(invalid(
                    "permissions.user",
                    &p.user,
                    "no such user (add it under [[users]])",
                ));
            }
            if !vhosts.contains(&p.vhost.as_str()) {
                return Err(invalid(
                    "permissions.vhost",
                    &p.vhost,
                    "no such vhost (add it under [[vhosts]])",
                ));
            }
            let same = |o: &&PermissionSection| o.user == p.user && o.vhost == p.vhost;
            if self.permissions.iter().filter(same).count() > 1 {
                return Err(invalid(
                    "permissions",
                    format!("{}@{}", p.user, p.vhost),
                    "listed twice for the same user and vhost",
                ));
            }
            for (key, pattern) in [
                ("permissions.configure", &p.configure),
                ("permissions.write", &p.write),
                ("permissions.read", &p.read),
            ] {
                triad_core::Pattern::new(pattern).map_err(|e| invalid(key, pattern, e.reason))?;
            }
        }
        for t in &self.topic_permissions {
            if !users.contains(&t.user.as_str()) {
                return Err(invalid("topic_permissions.user", &t.user, "no such user"));
            }
            if !vhosts.contains(&t.vhost.as_str()) {
                return Err(invalid(
                    "topic_permissions.vhost",
                    &t.vhost,
                    "no such vhost",
                ));
            }
            let same = |o: &&TopicPermissionSection| {
                o.user == t.user && o.vhost == t.vhost && o.exchange == t.exchange
            };
            if self.topic_permissions.iter().filter(same).count() > 1 {
                return Err(invalid(
                    "topic_permissions",
                    format!("{}@{} on {}", t.user, t.vhost, t.exchange),
                    "listed twice for the same user, vhost and exchange",
                ));
            }
            for (key, pattern) in [
                ("topic_permissions.write", &t.write),
                ("topic_permissions.read", &t.read),
            ] {
                triad_core::TopicPermission::pattern(pattern, &t.user, &t.vhost)
                    .map_err(|e| invalid(key, pattern, e.reason))?;
            }
        }
        Ok(())
    }

    /// The core's settings: the `[[users]]` plus the default user (its password hashed
    /// here, in memory; a `[[users]]` entry of the same name wins), the permissions
    /// (the default user gets `.*` on the default vhost unless it has entries of its
    /// own), vhosts and per-user / per-vhost limits. Fails only on what
    /// [`Config::validate`] refuses.
    pub fn core_config(&self) -> Result<triad_core::CoreConfig, ConfigError> {
        let a = &self.auth;
        let mut users = Vec::with_capacity(self.users.len() + 1);
        let mut user_limits = std::collections::HashMap::new();
        for u in &self.users {
            if u.max_connections.is_some() || u.max_channels.is_some() {
                user_limits.insert(
                    u.name.clone(),
                    triad_core::UserLimits {
                        max_connections: user_limit(u.max_connections),
                        max_channels: user_limit(u.max_channels),
                    },
                );
            }
            let hash = triad_core::PasswordHash::parse(&u.password_hash)
                .map_err(|e| invalid("users.password_hash", &u.name, e.to_string()))?;
            users.push(triad_core::UserConfig {
                name: u.name.clone(),
                password_hash: hash,
                tags: u.tags.clone(),
            });
        }
        let mut default_password = None;
        if !users.iter().any(|u| u.name == a.default_user) {
            // RabbitMQ's default user is an administrator (management API included)
            let mut u = triad_core::UserConfig::with_password(&a.default_user, &a.default_pass);
            u.tags = vec!["administrator".into()];
            users.push(u);
            default_password = Some((a.default_user.clone(), a.default_pass.clone()));
        }
        let pattern = |key: &'static str, p: &str| {
            triad_core::Pattern::new(p).map_err(|e| invalid(key, p, e.reason))
        };
        let mut permissions = Vec::with_capacity(self.permissions.len() + 1);
        for p in &self.permissions {
            permissions.push(triad_core::Permission {
                user: p.user.clone(),
                vhost: p.vhost.clone(),
                configure: pattern("permissions.configure", &p.configure)?,
                write: pattern("permissions.write", &p.write)?,
                read: pattern("permissions.read", &p.read)?,
            });
        }
        let mut topic_permissions = Vec::with_capacity(self.topic_permissions.len());
        for t in &self.topic_permissions {
            let topic = |key: &'static str, p: &str| {
                triad_core::TopicPermission::pattern(p, &t.user, &t.vhost)
                    .map_err(|e| invalid(key, p, e.reason))
            };
            topic_permissions.push(triad_core::TopicPermission {
                user: t.user.clone(),
                vhost: t.vhost.clone(),
                exchange: t.exchange.clone(),
                write: topic("topic_permissions.write", &t.write)?,
                read: topic("topic_permissions.read", &t.read)?,
            });
        }
        if !self.permissions.iter().any(|p| p.user == a.default_user) {
            permissions.push(triad_core::Permission::full(
                &a.default_user,
                &a.default_vhost,
            ));
        }
        Ok(triad_core::CoreConfig {
            users,
            loopback_users: a.loopback_users.clone(),
            permissions,
            topic_permissions,
            default_vhost: a.default_vhost.clone(),
            vhosts: self.vhosts.iter().map(|v| v.name.clone()).collect(),
            max_connections_per_user: self.limits.max_connections_per_user,
            user_limits,
            max_queues_per_vhost: self.limits.max_queues_per_vhost as usize,
            max_message_size: usize::try_from(self.limits.max_message_size.bytes())
                .unwrap_or(usize::MAX),
            default_password,
            txn: triad_core::txn::TxnConfig {
                check_timeout: self.txn.check_timeout.get(),
                check_max: self.txn.check_max,
            },
            ..triad_core::CoreConfig::default()
        })
    }

    /// The store settings this configuration asks for.
    pub fn store_config(&self, repair: bool) -> StoreConfig {
        let s = &self.store;
        let mut cfg = StoreConfig::new(&s.data_dir);
        cfg.segment_size = s.segment_size.bytes();
        cfg.flush = match s.flush {
            FlushKind::Sync => FlushMode::Sync,
            FlushKind::Async => FlushMode::Async {
                interval: s.flush_interval.get(),
                dirty_bytes: s.flush_dirty_bytes.bytes(),
            },
        };
        cfg.checkpoint_interval = s.checkpoint_interval.get();
        cfg.retention_interval = s.retention_interval.get();
        cfg.meta_compact_bytes = s.metadata_compact_size.bytes();
        cfg.repair = repair;
        cfg
    }
}

/// `HOST:PORT`, with `[v6]:PORT` for IPv6 literals; the host is resolved at bind time.
fn check_listen(key: &'static str, value: &str) -> Result<(), ConfigError> {
    let bad = |reason: &str| invalid(key, value, reason);
    let (host, port) = value
        .rsplit_once(':')
        .ok_or_else(|| bad("expected HOST:PORT"))?;
    if host.is_empty() {
        return Err(bad("missing host (use 0.0.0.0 for all interfaces)"));
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err(bad("an IPv6 address must be in brackets, as [::1]:5672"));
    }
    port.parse::<u16>()
        .map_err(|_| bad("port must be a number from 0 to 65535"))?;
    Ok(())
}

/// `cluster.etcd`: every URL `http://HOST:PORT`, or every one `https://HOST:PORT` with
/// `[cluster.etcd_tls]` and its `ca_file` (a client certificate is both files or none).
fn validate_etcd_urls(c: &ClusterSection) -> Result<(), ConfigError> {
    let tls = c.etcd_tls.is_some();
    let (scheme, why) = if tls {
        (
            "https://",
            "expected https://HOST:PORT: with [cluster.etcd_tls] every etcd URL is TLS",
        )
    } else {
        (
            "http://",
            "expected http://HOST:PORT (https:// needs [cluster.etcd_tls] with etcd's ca_file)",
        )
    };
    for url in &c.etcd {
        let Some(hostport) = url.strip_prefix(scheme) else {
            return Err(invalid("cluster.etcd", url, why));
        };
        check_listen("cluster.etcd", hostport.trim_end_matches('/'))?;
    }
    let Some(t) = &c.etcd_tls else {
        return Ok(());
    };
    for (key, path) in [
        ("cluster.etcd_tls.ca_file", &t.ca_file),
        ("cluster.etcd_tls.cert_file", &t.cert_file),
        ("cluster.etcd_tls.key_file", &t.key_file),
    ] {
        if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(invalid(key, "", "must not be empty"));
        }
    }
    if t.ca_file.is_none() {
        return Err(invalid(
            "cluster.etcd_tls.ca_file",
            "",
            "[cluster.etcd_tls] needs ca_file: the CA etcd's certificate is checked against",
        ));
    }
    if t.cert_file.is_some() != t.key_file.is_some() {
        return Err(invalid(
            "cluster.etcd_tls",
            "",
            "a client certificate needs both cert_file and key_file",
        ));
    }
    Ok(())
}

/// `[cluster.tls]`: all three files, none empty.
fn validate_cluster_tls(t: &ClusterTlsSection) -> Result<(), ConfigError> {
    for (key, path) in [
        ("cluster.tls.cert_file", &t.cert_file),
        ("cluster.tls.key_file", &t.key_file),
        ("cluster.tls.ca_file", &t.ca_file),
    ] {
        match path {
            None => {
                return Err(invalid(
                    key,
                    "",
                    "[cluster.tls] needs cert_file, key_file and ca_file (mutual TLS)",
                ))
            }
            Some(p) if p.as_os_str().is_empty() => {
                return Err(invalid(key, "", "must not be empty"))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(text, Path::new("test.toml"))
    }

    /// One key, `limits.max_message_size`, sizes all three protocols unless the STOMP
    /// frame or MQTT packet limit is set on its own; MQTT stays below its 256 MiB.
    #[test]
    fn max_message_size_sizes_every_protocol() {
        let l = Config::default().limits;
        assert_eq!(l.max_message_size.bytes(), 128 << 20);
        assert_eq!(l.stomp_frame_max(), (128 << 20) + STOMP_HEAD_ROOM);
        assert_eq!(l.mqtt_packet_max(), (128 << 20) + MQTT_HEAD_ROOM);
        let l = parse("[limits]\nmax_message_size = \"512 MiB\"\n")
            .unwrap()
            .limits;
        assert_eq!(l.stomp_frame_max(), (512 << 20) + STOMP_HEAD_ROOM);
        assert_eq!(l.mqtt_packet_max(), (1 << 28) - 1);
        let l = parse(
            "[limits]\nmax_message_size = \"1 MiB\"\nstomp_frame_max = \"4 MiB\"\nmqtt_packet_max = \"128 KiB\"\n",
        )
        .unwrap()
        .limits;
        assert_eq!(l.stomp_frame_max(), 4 << 20);
        assert_eq!(l.mqtt_packet_max(), 128 << 10);
    }

    #[test]
    fn cluster_keys_work_or_are_refused_by_name() {
        let leader = "[cluster]\nrole = \"leader\"\nnode_id = \"a\"\nlisten = \"127.0.0.1:0\"\n";
        let follower =
            "[cluster]\nrole = \"follower\"\nnode_id = \"b\"\nleader = \"127.0.0.1:5680\"\n";
        let ok = |t: &str| parse(t).expect("parses").validate().expect("valid");
        ok(leader);
        ok(follower);
        ok(&format!(
            "{leader}[replication]\nmode = \"sync\"\nmin_insync = 3\nreplica_lag_max = \"1 MiB\"\n"
        ));
        let refused = |t: &str, key: &str| {
            let err = match parse(t) {
                Err(e) => e.to_string(),
                Ok(c) => c.validate().expect_err(t).to_string(),
            };
            assert!(err.contains(key), "{t}: {err}");
        };
        refused("[replication]\nmode = \"sync\"\n", "replication");
        refused(&format!("{leader}etcd = \"x\"\n"), "etcd");
        refused(
            &format!("{leader}lease_ttl = \"2s\"\n"),
            "cluster.lease_ttl",
        );
        refused(
            &format!("{leader}advertise = \"h:1\"\n"),
            "cluster.advertise",
        );
        refused(
            "[cluster]\nnode_id = \"a\"\nlisten = \"h:1\"\n",
            "cluster.role",
        );
        refused(
            "[cluster]\nrole = \"auto\"\nnode_id = \"a\"\nlisten = \"h:1\"\n",
            "cluster.role",
        );
        refused(
            "[cluster]\nrole = \"leader\"\nnode_id = \"a\"\n",
            "cluster.listen",
        );
        refused(
            "[cluster]\nrole = \"follower\"\nnode_id = \"a\"\n",
            "cluster.leader",
        );
        refused(&format!("{leader}leader = \"h:1\"\n"), "cluster.leader");
        refused(&format!("{follower}listen = \"h:1\"\n"), "cluster.listen");
        refused(
            &format!("{follower}[replication]\nmode = \"sync\"\n"),
            "replication",
        );
        refused(
            &format!("{leader}[replication]\nmin_insync = 0\n"),
            "replication.min_insync",
        );
        refused(
            &format!("{leader}[replication]\nmode = \"sync\"\n[store]\nflush = \"async\"\n"),
            "replication.mode",
        );
        refused(
            &format!("{leader}[replication]\nmode = \"quorum\"\n"),
            "quorum",
        );
        refused(
            "[cluster]\nrole = \"leader\"\nnode_id = \"\"\nlisten = \"h:1\"\n",
            "cluster.node_id",
        );
        // listener TLS and a cluster go together now
        ok(&format!(
            "{leader}[tls]\ncert_file = \"c.pem\"\nkey_file = \"k.pem\"\n"
        ));
        let tls =
            "[cluster.tls]\ncert_file = \"c.pem\"\nkey_file = \"k.pem\"\nca_file = \"ca.pem\"\n";
        ok(&format!("{leader}{tls}"));
        ok(&format!("{follower}{tls}"));
        // a partial section is refused, naming what is missing
        refused(
            &format!("{leader}[cluster.tls]\ncert_file = \"c.pem\"\nkey_file = \"k.pem\"\n"),
            "cluster.tls.ca_file",
        );
        refused(
            &format!("{follower}[cluster.tls]\nca_file = \"ca.pem\"\n"),
            "cluster.tls.cert_file",
        );
        refused(
            &format!(
                "{leader}[cluster.tls]\ncert_file = \"\"\nkey_file = \"k\"\nca_file = \"c\"\n"
            ),
            "cluster.tls.cert_file",
        );
        refused(
            &format!("{leader}[cluster.tls]\ncert = \"c.pem\"\n"),
            "cert",
        );
    }

    #[test]
    fn an_elected_cluster_takes_its_role_from_etcd_and_refuses_contradictions() {
        let base = "[cluster]\nnode_id = \"a\"\nlisten = \"127.0.0.1:5680\"\n\
                    etcd = [\"http://127.0.0.1:2379\", \"http://10.0.0.2:2379/\"]\n";
        let c = parse(base).expect("parses");
        c.validate().expect("valid");
        let cl = c.cluster.expect("cluster");
        assert!(cl.elected());
        assert_eq!(cl.lease_ttl(), Duration::from_secs(2));
        assert_eq!(cl.group_name(), "default");
        let c = parse(&format!(
            "{base}role = \"auto\"\nlease_ttl = \"5s\"\nname = \"eu-1\"\n\
             advertise = \"10.0.0.1:5680\"\n[replication]\nmode = \"sync\"\n"
        ))
        .expect("parses");
        c.validate().expect("valid");
        assert_eq!(
            c.cluster.as_ref().map(|c| c.lease_ttl()),
            Some(Duration::from_secs(5))
        );
        let refused = |t: &str, key: &str| {
            let err = match parse(t) {
                Err(e) => e.to_string(),
                Ok(c) => c.validate().expect_err(t).to_string(),
            };
            assert!(err.contains(key), "{t}: {err}");
        };
        refused(&format!("{base}role = \"leader\"\n"), "cluster.role");
        refused(&format!("{base}role = \"follower\"\n"), "cluster.role");
        refused(&format!("{base}leader = \"h:1\"\n"), "cluster.leader");
        refused(&format!("{base}lease_ttl = \"1s\"\n"), "cluster.lease_ttl");
        refused(
            &format!("{base}lease_ttl = \"2500ms\"\n"),
            "cluster.lease_ttl",
        );
        refused(&format!("{base}name = \"a/b\"\n"), "cluster.name");
        refused(&format!("{base}advertise = \"h:0\"\n"), "cluster.advertise");
        refused(
            "[cluster]\nnode_id = \"a\"\netcd = [\"http://e:2379\"]\n",
            "cluster.listen",
        );
        refused(
            "[cluster]\nnode_id = \"a\"\nlisten = \"0.0.0.0:5680\"\netcd = [\"http://e:2379\"]\n",
            "cluster.advertise",
        );
        refused(
            "[cluster]\nnode_id = \"a\"\nlisten = \"h:1\"\netcd = [\"https://e:2379\"]\n",
            "cluster.etcd",
        );
        refused(
            "[cluster]\nnode_id = \"a\"\nlisten = \"h:1\"\netcd = [\"http://e\"]\n",
            "cluster.etcd",
        );
        // TLS to etcd: https:// URLs with [cluster.etcd_tls] and its CA, all or none
        let https = "[cluster]\nnode_id = \"a\"\nlisten = \"127.0.0.1:5680\"\n\
                     etcd = [\"https://e:2379\", \"https://10.0.0.2:2379\"]\n";
        let c = parse(&format!(
            "{https}[cluster.etcd_tls]\nca_file = \"ca.pem\"\ncert_file = \"c.pem\"\n\
             key_file = \"k.pem\"\n"
        ))
        .expect("parses");
        c.validate().expect("valid");
        let files = c.cluster.and_then(|c| c.etcd_tls?.files()).expect("files");
        assert_eq!(files.ca, PathBuf::from("ca.pem"));
        assert_eq!(
            files.client,
            Some((PathBuf::from("c.pem"), PathBuf::from("k.pem")))
        );
        parse(&format!(
            "{https}[cluster.etcd_tls]\nca_file = \"ca.pem\"\n"
        ))
        .expect("parses")
        .validate()
        .expect("a client certificate is optional");
        refused(
            &format!("{https}[cluster.etcd_tls]\ncert_file = \"c.pem\"\nkey_file = \"k.pem\"\n"),
            "cluster.etcd_tls.ca_file",
        );
        refused(
            &format!("{https}[cluster.etcd_tls]\nca_file = \"ca.pem\"\ncert_file = \"c.pem\"\n"),
            "cluster.etcd_tls",
        );
        refused(
            &format!("{https}[cluster.etcd_tls]\nca_file = \"\"\n"),
            "cluster.etcd_tls.ca_file",
        );
        refused(
            &format!("{base}[cluster.etcd_tls]\nca_file = \"ca.pem\"\n"),
            "cluster.etcd",
        );
        refused(
            "[cluster]\nnode_id = \"a\"\nlisten = \"h:1\"\n\
             etcd = [\"https://e:2379\", \"http://f:2379\"]\n[cluster.etcd_tls]\nca_file = \"ca.pem\"\n",
            "cluster.etcd",
        );
        refused(
            "[cluster]\nrole = \"leader\"\nnode_id = \"a\"\nlisten = \"h:1\"\n\
             [cluster.etcd_tls]\nca_file = \"ca.pem\"\n",
            "cluster.etcd_tls",
        );
        refused(
            &format!("{base}[replication]\nmode = \"sync\"\n[store]\nflush = \"async\"\n"),
            "replication.mode",
        );
    }

    #[test]
    fn example_file_is_the_defaults() {
        let text = include_str!("../triad.example.toml");
        assert_eq!(parse(text).expect("example parses"), Config::default());
        // Every key is present in the example, commented out: uncommenting them all
        // must still give the defaults.
        let uncommented: String = text
            .lines()
            .map(|l| {
                // `#   key = value` (indented) is an example, not a default.
                l.strip_prefix("# ")
                    .filter(|r| r.contains(" = ") && !r.starts_with(' '))
                    .unwrap_or(l)
            })
            .collect::<Vec<_>>()
            .join("\n");
        assert!(uncommented.contains("max_connections = 0"));
        assert_eq!(
            parse(&uncommented).expect("uncommented example parses"),
            Config::default()
        );
        Config::default().validate().expect("defaults are valid");
    }

    #[test]
    fn tls_sni_certificates_are_checked() {
        let base = "[tls]\ncert_file = \"c.pem\"\nkey_file = \"k.pem\"\n";
        let entry = |names: &str| {
            format!("[[tls.certificates]]\ncert_file = \"a.pem\"\nkey_file = \"ak.pem\"\nserver_names = {names}\n")
        };
        let ok = parse(&format!("{base}{}", entry("[\"a.example\"]"))).expect("parses");
        ok.validate().expect("valid");
        assert_eq!(ok.tls.certificates[0].server_names, ["a.example"]);
        for bad in [
            format!("{base}{}", entry("[]")),
            format!(
                "{base}{}{}",
                entry("[\"a.example\"]"),
                entry("[\"A.example\"]")
            ),
            entry("[\"a.example\"]"),
        ] {
            let c = parse(&bad).expect("parses");
            assert!(c.validate().is_err(), "{bad}");
        }
    }

    #[test]
    fn anonymous_http_and_stomp_sections() {
        use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
        let c = Config::default();
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let far = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
        let mapped = IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped());
        assert_eq!(c.auth.anonymous_login(lo, false).as_deref(), Some("guest"));
        assert_eq!(
            c.auth.anonymous_login(mapped, false).as_deref(),
            Some("guest")
        );
        assert_eq!(
            c.auth
                .anonymous_login(IpAddr::V6(Ipv6Addr::LOCALHOST), true),
            None
        );
        assert_eq!(c.auth.anonymous_login(far, false), None);
        let c = parse("[auth]\nanonymous = \"off\"\n").expect("off");
        assert_eq!(c.auth.anonymous_login(lo, false), None);
        let c = parse(
            "[auth]\nanonymous = \"any\"\nanonymous_user = \"web\"\nanonymous_websocket = true\n\
             [[users]]\nname = \"web\"\npassword_hash = \"kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR\"\n",
        )
        .expect("any");
        c.validate().expect("valid");
        assert_eq!(c.auth.anonymous_login(far, true).as_deref(), Some("web"));
        for bad in [
            "[auth]\nanonymous_user = \"nobody\"\n",
            "[auth]\nanonymous = \"any\"\nanonymous_user = \"guest\"\n",
            "[auth]\nanonymous = \"sometimes\"\n",
            "[http]\nallowed_origins = [\"example.com\"]\n",
            "[http]\nallowed_origins = [\"https://a.example/path\"]\n",
            "[http]\nmax_websocket_connections = 0\n",
            "[stomp]\nmax_transactions = 0\n",
            "[stomp]\nmax_id_length = 0\n",
            "[mqtt]\nmax_subscriptions = 0\n",
        ] {
            assert!(
                parse(bad).and_then(|c| c.validate()).is_err(),
                "accepted: {bad}"
            );
        }
        let c = parse(
            "[http]\nallowed_origins = [\"https://app.example:8443\", \"*\"]\n\
             [stomp]\nmax_transactions = 3\nmax_transaction_bytes = \"1 MiB\"\n",
        )
        .expect("http and stomp");
        c.validate().expect("valid");
        assert_eq!(c.http.allowed_origins.len(), 2);
        assert_eq!(c.stomp.max_transactions, 3);
        assert_eq!(c.stomp.max_transaction_bytes.bytes(), 1 << 20);
    }

    #[test]
    fn user_limits() {
        let h = "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR";
        let c = parse(&format!(
            "[[users]]\nname = \"a\"\npassword_hash = \"{h}\"\nmax_connections = 2\nmax_channels = -1\n\n\
             [[users]]\nname = \"b\"\npassword_hash = \"{h}\"\n"
        ))
        .expect("parses");
        let core = c.core_config().expect("core config");
        let a = core.user_limits.get("a").expect("a's limits");
        assert_eq!(a.max_connections, Some(2));
        assert_eq!(a.max_channels, Some(triad_core::UserLimits::UNLIMITED));
        assert!(!core.user_limits.contains_key("b"));
    }

    #[test]
    fn mqtt_port_to_vhost() {
        let c = parse("[mqtt]\nport_to_vhost = { \"1884\" = \"devices\" }\n").expect("parses");
        assert_eq!(c.mqtt.vhost_for_port(1884), Some("devices"));
        assert_eq!(c.mqtt.vhost_for_port(1883), None);
        assert!(!c.mqtt.ignore_colons_in_username);
    }

    #[test]
    fn mqtt_session_expiry() {
        assert_eq!(Config::default().mqtt.session_expiry, None);
        let c = parse("[mqtt]\nsession_expiry = \"1h\"\n").expect("parses");
        assert_eq!(c.mqtt.session_expiry, Some(HumanDuration::secs(3600)));
        c.validate().expect("valid");
        assert!(parse("[mqtt]\nsession_expiry = 3600\n").is_err());
        assert!(parse("[mqtt]\nexpiry = \"1h\"\n").is_err());
    }

    const ALICE: &str = "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR";

    #[test]
    fn users_permissions_and_vhosts() {
        let c = parse(&format!(
            r#"
            [auth]
            failed_login_delay = "0s"
            ssl_cert_login = true
            [limits]
            max_connections_per_user = 3
            max_queues_per_vhost = 100
            [[users]]
            name = "alice"
            password_hash = "{ALICE}"
            tags = ["administrator"]
            [[vhosts]]
            name = "staging"
            [[permissions]]
            user = "alice"
            vhost = "staging"
            configure = "^alice-.*"
            write = ".*"
            read = ".*"
            "#
        ))
        .expect("parses");
        c.validate().expect("valid");
        assert!(c.auth.ssl_cert_login);
        assert_eq!(c.limits.max_connections_per_user, 3);
        let core = c.core_config().expect("core config");
        assert_eq!(core.max_connections_per_user, 3);
        assert_eq!(core.max_queues_per_vhost, 100);
        assert_eq!(core.vhosts, vec!["staging".to_string()]);
        let alice = core
            .users
            .iter()
            .find(|u| u.name == "alice")
            .expect("alice");
        assert!(alice.password_hash.verify("test12"));
        assert_eq!(alice.tags, vec!["administrator".to_string()]);
        // the default user is still there, its password hashed in memory
        let guest = core
            .users
            .iter()
            .find(|u| u.name == "guest")
            .expect("guest");
        assert!(guest.password_hash.verify("guest"));
        // alice: only what was configured; guest: everything on the default vhost
        let p: Vec<_> = core
            .permissions
            .iter()
            .map(|p| (p.user.as_str(), p.vhost.as_str(), p.configure.as_str()))
            .collect();
        assert_eq!(
            p,
            vec![("alice", "staging", "^alice-.*"), ("guest", "/", ".*")]
        );

        // topic permissions: {username} expanded, checked against known users
        let c = parse(&format!(
            "[[users]]\nname = \"alice\"\npassword_hash = \"{ALICE}\"\n\
             [[topic_permissions]]\nuser = \"alice\"\nvhost = \"/\"\nexchange = \"amq.topic\"\n\
             write = \"^{{username}}\\\\.\"\nread = \"\"\n"
        ))
        .expect("parses");
        c.validate().expect("valid");
        let core = c.core_config().expect("core");
        let t = &core.topic_permissions[0];
        assert_eq!(t.write.as_str(), "^alice\\.");
        assert_eq!(t.read.as_str(), "^$");
        let bad = parse(
            "[[topic_permissions]]\nuser = \"zed\"\nvhost = \"/\"\nexchange = \"x\"\nwrite = \"\"\nread = \"\"\n",
        )
        .expect("parses")
        .validate()
        .unwrap_err();
        assert!(
            matches!(&bad, ConfigError::Invalid { key, .. } if *key == "topic_permissions.user"),
            "{bad}"
        );

        // a [[users]] entry named like the default user replaces it
        let c = parse(&format!(
            "[[users]]\nname = \"guest\"\npassword_hash = \"{ALICE}\"\n"
        ))
        .expect("parses");
        let core = c.core_config().expect("core");
        assert_eq!(core.users.len(), 1);
        assert!(core.users[0].password_hash.verify("test12"));
        assert!(!core.users[0].password_hash.verify("guest"));
    }

    #[test]
    fn bad_users_and_permissions_are_refused() {
        let check = |text: &str, key: &str| {
            let e = parse(text).expect("parses").validate().unwrap_err();
            assert!(
                matches!(&e, ConfigError::Invalid { key: k, .. } if *k == key),
                "{e}"
            );
        };
        check(
            "[[users]]\nname = \"bob\"\npassword_hash = \"secret\"\n",
            "users.password_hash",
        );
        let bob = format!("[[users]]\nname = \"bob\"\npassword_hash = \"{ALICE}\"\n");
        check(&format!("{bob}{bob}"), "users.name");
        let perm = |user: &str, vhost: &str, configure: &str| {
            format!(
                "[[permissions]]\nuser = \"{user}\"\nvhost = \"{vhost}\"\nconfigure = \"{configure}\"\nwrite = \"\"\nread = \"\"\n"
            )
        };
        check(&perm("carol", "/", ".*"), "permissions.user");
        check(
            &format!("{bob}{}", perm("bob", "other", ".*")),
            "permissions.vhost",
        );
        check(
            &format!("{bob}{}", perm("bob", "/", "(")),
            "permissions.configure",
        );
        check(
            &format!("{bob}{}{}", perm("bob", "/", ".*"), perm("bob", "/", "x")),
            "permissions",
        );
        // a missing required key is a parse error naming it
        let e = parse("[[users]]\nname = \"bob\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("password_hash"), "{e}");
        let e = parse("[[users]]\nname = \"bob\"\npassword = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `password`"), "{e}");
    }

    #[test]
    fn empty_file_is_the_defaults() {
        assert_eq!(parse("").expect("parses"), Config::default());
    }

    #[test]
    fn values_are_read() {
        let c = parse(
            r#"
            [listeners]
            amqp = "127.0.0.1:0"
            [store]
            segment_size = 1048576
            flush = "async"
            flush_interval = "50ms"
            [limits]
            frame_max = "64 KiB"
            max_connections = 10
            "#,
        )
        .expect("parses");
        assert_eq!(c.listeners.amqp, "127.0.0.1:0");
        assert_eq!(c.listeners.stomp, Listeners::default().stomp);
        assert_eq!(c.store.segment_size, ByteSize::mib(1));
        assert_eq!(c.limits.frame_max, ByteSize::kib(64));
        assert_eq!(c.limits.max_connections, 10);
        let sc = c.store_config(true);
        assert_eq!(sc.segment_size, 1 << 20);
        assert!(sc.repair);
        assert_eq!(
            sc.flush,
            FlushMode::Async {
                interval: std::time::Duration::from_millis(50),
                dirty_bytes: 16 << 20
            }
        );
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e = parse("[store]\nsegment_sise = \"1 GiB\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("test.toml"), "{e}");
        assert!(e.contains("unknown field `segment_sise`"), "{e}");
        assert!(e.contains("line 2"), "{e}");
        let e = parse("[storage]\n").unwrap_err().to_string();
        assert!(e.contains("unknown field `storage`"), "{e}");
    }

    #[test]
    fn bad_units_are_refused() {
        let e = parse("[store]\nsegment_size = \"1 GB/s\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("invalid size \"1 GB/s\""), "{e}");
        assert!(e.contains("unknown unit"), "{e}");
        let e = parse("[limits]\nheartbeat = 60\n").unwrap_err().to_string();
        assert!(e.contains("a duration with a unit"), "{e}");
        let e = parse("[limits]\nhandshake_timeout = \"10 parsecs\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("invalid duration \"10 parsecs\""), "{e}");
        let e = parse("[store]\nflush = \"sometimes\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown variant `sometimes`"), "{e}");
    }

    #[test]
    fn validate_catches_nonsense() {
        let check = |text: &str, key: &str| {
            let e = parse(text).expect("parses").validate().unwrap_err();
            assert!(
                matches!(&e, ConfigError::Invalid { key: k, .. } if *k == key),
                "{e}"
            );
        };
        check("[listeners]\namqp = \"5672\"\n", "listeners.amqp");
        check("[mqtt]\nsession_expiry = \"0s\"\n", "mqtt.session_expiry");
        check("[mqtt]\nstream_max_age = \"0s\"\n", "mqtt.stream_max_age");
        check("[mqtt]\nstream_max_bytes = 0\n", "mqtt.stream_max_bytes");
        check(
            "[mqtt]\nport_to_vhost = { x = \"v\" }\n",
            "mqtt.port_to_vhost",
        );
        check(
            "[mqtt]\nport_to_vhost = { \"1884\" = \"\" }\n",
            "mqtt.port_to_vhost",
        );
        check("[listeners]\nmqtt = \"host:99999\"\n", "listeners.mqtt");
        check("[listeners]\nhttp = \"::1:80\"\n", "listeners.http");
        check("[store]\nsegment_size = \"1 KiB\"\n", "store.segment_size");
        check(
            "[store]\nsegment_size = \"1 MiB\"\n[limits]\nmax_message_size = \"2 MiB\"\n",
            "store.segment_size",
        );
        check(
            "[store]\nflush = \"async\"\nflush_interval = \"0s\"\n",
            "store.flush_interval",
        );
        check("[limits]\nframe_max = 100\n", "limits.frame_max");
        check(
            "[limits]\nstomp_frame_max = \"1 KiB\"\n",
            "limits.stomp_frame_max",
        );
        check(
            "[limits]\nmqtt_packet_max = \"256 MiB\"\n",
            "limits.mqtt_packet_max",
        );
        check(
            "[limits]\nmax_message_size = \"513 MiB\"\n",
            "limits.max_message_size",
        );
        check("[limits]\nheartbeat = \"1500ms\"\n", "limits.heartbeat");
        check("[auth]\ndefault_vhost = \"\"\n", "auth.default_vhost");
        check("[listeners]\namqps = \"5671\"\n", "listeners.amqps");
        check("[tls]\ncert_file = \"c.pem\"\n", "tls.cert_file");
        check("[tls]\nkey_file = \"k.pem\"\n", "tls.key_file");
        check(
            "[tls]\ncert_file = \"\"\nkey_file = \"k\"\n",
            "tls.cert_file",
        );
        let tls = "[tls]\ncert_file = \"c.pem\"\nkey_file = \"k.pem\"\n";
        check(&format!("{tls}verify_peer = true\n"), "tls.verify_peer");
        check(
            &format!("{tls}ca_file = \"ca.pem\"\nfail_if_no_peer_cert = true\n"),
            "tls.fail_if_no_peer_cert",
        );
        check("[tls]\nca_file = \"ca.pem\"\n", "tls.ca_file");
        let ok = parse(&format!(
            "{tls}ca_file = \"ca.pem\"\nverify_peer = true\nfail_if_no_peer_cert = true\n"
        ))
        .expect("parses");
        ok.validate().expect("valid");
        assert!(ok.tls.enabled());
        assert!(!Config::default().tls.enabled());
        let ok =
            parse("[listeners]\namqp = \"[::1]:0\"\nhttp = \"localhost:8080\"\n").expect("parses");
        ok.validate().expect("valid");
    }
}

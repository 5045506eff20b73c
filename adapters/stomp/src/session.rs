//! The STOMP session, sans-IO: frames and core deliveries in, [`Action`]s out.
//!
//! It owns the connection's protocol state (version, user, vhost, subscriptions,
//! unacked deliveries, transactions, temp queues) and talks to the core directly (the
//! core's calls are short and never block on I/O). The driver does the socket, the
//! timers and the waiting on durability.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use triad_core::{
    Backpressure, Broker, ConnectionId, ConsumeRequest, ConsumerHandle, CoreError, Credentials,
    Delivery, Durability, FieldTable, FieldValue, Link, MessageFilter, OutEvent, Outbox, Peer,
    Protocol, Publish, Queue, QueueDeclare,
};

use crate::codec::{DecodeError, Dialect, Limits};
use crate::destination::Destination;
use crate::frame::{Command, Frame};
use crate::mapping::{self, bool_header, MessageMeta};
use crate::queue_name;

/// What the driver must do.
pub enum Action {
    /// Write this frame now.
    Send(Frame),
    /// Write this RECEIPT once `durable` (if any) completes, `flow` (a throttled
    /// queue, if any) clears or `FLOW_MAX_WAIT` passes, and every earlier receipt has
    /// been written: receipts keep the order of the frames they answer (the core's
    /// [`triad_core::ReplyQueue`]).
    Receipt {
        /// What to wait for first: the message (or the transaction) on disk.
        durable: Option<Durability>,
        /// Publisher flow control: the queues that throttle this SEND.
        flow: Option<Backpressure>,
        /// The RECEIPT frame.
        frame: Frame,
    },
    /// Publisher flow control: a SEND without a receipt went to a queue whose
    /// consumers fall behind. Later receipts wait behind this until it clears (or
    /// `FLOW_MAX_WAIT` passes); while `MAX_HOLDS` of these wait, the socket is not read.
    Hold(Backpressure),
    /// DISCONNECT: close once the pending receipts are written.
    Disconnect,
    /// Close now, after writing what is already queued (follows an ERROR).
    Close,
}

impl std::fmt::Debug for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Action::Send(fr) => write!(f, "Send({})", fr.command),
            Action::Receipt {
                durable,
                flow,
                frame,
            } => write!(
                f,
                "Receipt({:?}, waits: {}, held: {})",
                frame.header("receipt-id"),
                durable.is_some(),
                flow.is_some()
            ),
            Action::Hold(_) => f.write_str("Hold"),
            Action::Disconnect => f.write_str("Disconnect"),
            Action::Close => f.write_str("Close"),
        }
    }
}

/// The negotiated protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Version {
    /// STOMP 1.0.
    V10,
    /// STOMP 1.1.
    V11,
    /// STOMP 1.2.
    V12,
}

impl Version {
    /// As in `accept-version` / `version`.
    pub fn as_str(self) -> &'static str {
        match self {
            Version::V10 => "1.0",
            Version::V11 => "1.1",
            Version::V12 => "1.2",
        }
    }
    fn dialect(self) -> Dialect {
        match self {
            Version::V10 => Dialect::V10,
            Version::V11 => Dialect::V11,
            Version::V12 => Dialect::V12,
        }
    }
}

/// Per-connection settings.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// The user a CONNECT without `login` logs in as; `None`: refused.
    pub anonymous_user: Option<String>,
    /// Smallest interval at which the server offers to send heart-beats, ms (0 = never).
    pub heartbeat_send_ms: u32,
    /// Smallest interval at which the server wants heart-beats, ms (0 = never).
    pub heartbeat_recv_ms: u32,
    /// Frame limits after CONNECT is accepted.
    pub limits: Limits,
    /// Frame limits before.
    pub unauthenticated_limits: Limits,
    /// Deliveries buffered for the socket before queues are told to wait.
    pub outbox_capacity: usize,
    /// CONNECT without `login` logs in as `peer_cert_cn` when there is one
    /// (RabbitMQ's `stomp.ssl_cert_login`).
    pub ssl_cert_login: bool,
    /// This connection's verified TLS client certificate CN.
    pub peer_cert_cn: Option<String>,
    /// Caps on per-connection state.
    pub caps: Caps,
    /// `auth.failed_login_delay`: a refused CONNECT is answered this long after the
    /// previous refusal for the same address or user name.
    pub failed_login_delay: Duration,
}

/// Caps on what one connection may make the broker hold; each is checked before the
/// state is added, and exceeding one is an ERROR and close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Open transactions (BEGIN without COMMIT / ABORT).
    pub max_transactions: usize,
    /// SEND, ACK and NACK frames buffered in one transaction.
    pub max_transaction_frames: usize,
    /// SEND body bytes buffered in all open transactions together.
    pub max_transaction_bytes: usize,
    /// Subscriptions.
    pub max_subscriptions: usize,
    /// Longest transaction or subscription id, in bytes.
    pub max_id_length: usize,
}

impl Default for Caps {
    fn default() -> Self {
        Caps {
            max_transactions: 16,
            max_transaction_frames: 1024,
            max_transaction_bytes: 16 << 20,
            max_subscriptions: 256,
            max_id_length: 256,
        }
    }
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            anonymous_user: Some("guest".into()),
            heartbeat_send_ms: 10_000,
            heartbeat_recv_ms: 10_000,
            limits: Limits::AUTHENTICATED,
            unauthenticated_limits: Limits::UNAUTHENTICATED,
            outbox_capacity: 1024,
            ssl_cert_login: false,
            peer_cert_cn: None,
            caps: Caps::default(),
            failed_login_delay: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AckMode {
    Auto,
    /// Cumulative.
    Client,
    ClientIndividual,
}

struct Subscription {
    consumer: ConsumerHandle,
    /// Shown as the MESSAGE `destination` instead of the reconstructed one.
    destination_override: Option<String>,
    /// A durable topic subscription: UNSUBSCRIBE with `durable:true` deletes its queue.
    durable_queue: Option<String>,
}

/// A delivery awaiting ACK / NACK (AMQP's `channel::Unacked` plus its message-id).
struct Unacked {
    queue: Arc<Queue>,
    offset: u64,
    message_id: String,
}

struct Ledger {
    mode: AckMode,
    pending: BTreeMap<u64, Unacked>,
}

enum TxOp {
    Send(Frame),
    Ack(Frame),
    Nack(Frame),
}

/// A refusal: becomes an ERROR frame, then the connection closes.
#[derive(Debug)]
struct Fail {
    message: String,
    detail: String,
}

impl Fail {
    fn new(message: impl Into<String>, detail: impl Into<String>) -> Fail {
        Fail {
            message: message.into(),
            detail: detail.into(),
        }
    }
}

impl From<CoreError> for Fail {
    fn from(e: CoreError) -> Self {
        let (m, d) = mapping::core_error_text(&e);
        Fail::new(m, d)
    }
}

impl From<mapping::BadHeader> for Fail {
    fn from(e: mapping::BadHeader) -> Self {
        Fail::new(format!("invalid {} header", e.name), e.reason)
    }
}

#[derive(PartialEq, Eq)]
enum Phase {
    AwaitingConnect,
    Connected,
    Closed,
}

/// One STOMP connection's state.
pub struct Session {
    broker: Arc<Broker>,
    peer: SocketAddr,
    cfg: SessionConfig,
    conn: ConnectionId,
    outbox: Arc<Outbox>,
    phase: Phase,
    version: Version,
    /// The user, vhost, permissions and connection slot, once connected; dropped
    /// (the connection torn down in the core) last in [`Session::close`].
    link: Option<Link>,
    /// A login was just refused: how long the driver holds the ERROR (the failed-login
    /// throttle's answer).
    login_hold: Option<Duration>,
    heartbeat: (u64, u64),
    subs: HashMap<String, Subscription, foldhash::fast::RandomState>,
    ledgers: HashMap<String, Ledger, foldhash::fast::RandomState>,
    ids: HashMap<String, (String, u64), foldhash::fast::RandomState>,
    next_seq: u64,
    txs: HashMap<String, Vec<TxOp>>,
    /// SEND body bytes buffered in `txs`.
    tx_bytes: usize,
    temp_queues: HashMap<String, String>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("conn", &self.conn)
            .field("peer", &self.peer)
            .field("user", &self.user())
            .finish_non_exhaustive()
    }
}

type Res<T = ()> = Result<T, Fail>;

impl Session {
    /// A session for a new connection from `peer`.
    pub fn new(broker: Arc<Broker>, peer: SocketAddr, cfg: SessionConfig) -> Session {
        let conn = broker.next_connection_id();
        let outbox = Outbox::new(cfg.outbox_capacity);
        Session {
            broker,
            peer,
            cfg,
            conn,
            outbox,
            phase: Phase::AwaitingConnect,
            version: Version::V10,
            link: None,
            login_hold: None,
            heartbeat: (0, 0),
            subs: HashMap::default(),
            ledgers: HashMap::default(),
            ids: HashMap::default(),
            next_seq: 1,
            txs: HashMap::new(),
            tx_bytes: 0,
            temp_queues: HashMap::new(),
        }
    }

    /// The core connection id.
    pub fn connection_id(&self) -> ConnectionId {
        self.conn
    }

    /// Where the core puts this connection's deliveries.
    pub fn outbox(&self) -> &Arc<Outbox> {
        &self.outbox
    }

    /// Whether CONNECT has been accepted.
    pub fn is_connected(&self) -> bool {
        self.phase == Phase::Connected
    }

    /// The logged-in user ("" before CONNECT).
    pub fn user(&self) -> &str {
        self.link.as_ref().map_or("", |l| l.user())
    }

    /// The vhost's name, once connected.
    pub fn vhost_name(&self) -> Option<&str> {
        self.link.as_ref().map(|l| l.vhost().name())
    }

    /// The connection's link (user, vhost, permissions), once connected.
    pub fn link(&self) -> Option<&Link> {
        self.link.as_ref()
    }

    /// How long to hold the ERROR answering a login just refused, if one was; clears
    /// it.
    pub fn take_login_hold(&mut self) -> Option<Duration> {
        self.login_hold.take()
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Frame limits in force now.
    pub fn limits(&self) -> Limits {
        if self.phase == Phase::Connected {
            self.cfg.limits
        } else {
            self.cfg.unauthenticated_limits
        }
    }

    /// Escaping rules in force now.
    pub fn dialect(&self) -> Dialect {
        // before CONNECT, only CONNECT/STOMP (never escaped) are valid anyway
        match self.phase {
            Phase::AwaitingConnect => Dialect::V12,
            _ => self.version.dialect(),
        }
    }

    /// The negotiated version (1.0 before CONNECT).
    pub fn version(&self) -> Version {
        self.version
    }

    /// Negotiated heart-beat intervals: (server sends every, server expects within).
    pub fn heartbeat(&self) -> (Option<Duration>, Option<Duration>) {
        let d = |ms: u64| (ms > 0).then(|| Duration::from_millis(ms));
        (d(self.heartbeat.0), d(self.heartbeat.1))
    }

    /// A frame violation: ERROR, then close.
    pub fn decode_error(&mut self, e: &DecodeError, out: &mut Vec<Action>) {
        self.fail(
            Fail::new("malformed frame received", e.to_string()),
            None,
            out,
        );
    }

    /// An ERROR the driver decides on (shutdown, idle peer, ...), then close.
    pub fn error_and_close(&mut self, message: &str, detail: &str, out: &mut Vec<Action>) {
        self.fail(Fail::new(message, detail), None, out);
    }

    fn fail(&mut self, f: Fail, receipt: Option<&str>, out: &mut Vec<Action>) {
        tracing::debug!(conn = self.conn, message = %f.message, detail = %f.detail, "stomp error");
        out.push(Action::Send(mapping::error_frame(
            &f.message, &f.detail, receipt,
        )));
        out.push(Action::Close);
        self.phase = Phase::Closed;
    }

    /// Handles one client frame.
    pub fn handle(&mut self, frame: Frame, out: &mut Vec<Action>) {
        if self.phase == Phase::Closed {
            return;
        }
        let receipt = frame.header("receipt").map(str::to_string);
        let command = frame.command;
        let res = match (&self.phase, frame.command) {
            (Phase::AwaitingConnect, Command::Connect | Command::Stomp) => {
                self.connect(&frame, out)
            }
            (Phase::AwaitingConnect, c) => Err(Fail::new(
                "not connected",
                format!("the first frame must be CONNECT or STOMP, got {c}"),
            )),
            (_, Command::Connect | Command::Stomp) => Err(Fail::new(
                "already connected",
                "CONNECT received on a connected session",
            )),
            (_, Command::Send) => self.send(frame, out),
            (_, Command::Subscribe) => self.subscribe(&frame),
            (_, Command::Unsubscribe) => self.unsubscribe(&frame),
            (_, Command::Ack) => self.ack_frame(frame, true),
            (_, Command::Nack) => self.ack_frame(frame, false),
            (_, Command::Begin) => self.begin(&frame),
            (_, Command::Commit) => self.commit(&frame, out),
            (_, Command::Abort) => self.abort(&frame),
            (_, Command::Disconnect) => {
                if let Some(r) = &receipt {
                    out.push(Action::Receipt {
                        durable: None,
                        flow: None,
                        frame: receipt_frame(r),
                    });
                }
                out.push(Action::Disconnect);
                self.phase = Phase::Closed;
                return;
            }
            (_, c) => Err(Fail::new(
                "invalid command",
                format!("{c} is a server frame; clients may not send it"),
            )),
        };
        match res {
            Err(f) => self.fail(f, receipt.as_deref(), out),
            Ok(()) => {
                // CONNECT, SEND and COMMIT queue their own (possibly deferred) receipts
                if let (Some(r), false) = (
                    receipt,
                    matches!(
                        command,
                        Command::Connect | Command::Stomp | Command::Send | Command::Commit
                    ),
                ) {
                    out.push(Action::Receipt {
                        durable: None,
                        flow: None,
                        frame: receipt_frame(&r),
                    });
                }
            }
        }
    }

    fn connect(&mut self, f: &Frame, out: &mut Vec<Action>) -> Res {
        let version = match f.header("accept-version") {
            None => Version::V10,
            Some(list) => {
                let offered: Vec<&str> = list.split(',').map(str::trim).collect();
                [Version::V12, Version::V11, Version::V10]
                    .into_iter()
                    .find(|v| offered.contains(&v.as_str()))
                    .ok_or_else(|| {
                        Fail::new(
                            "Supported protocol versions are 1.0,1.1,1.2",
                            format!("none of the offered versions '{list}' is supported"),
                        )
                    })?
            }
        };
        let cert_cn = self
            .cfg
            .peer_cert_cn
            .as_deref()
            .filter(|_| self.cfg.ssl_cert_login);
        let credentials = match (f.header("login"), cert_cn) {
            (Some(user), _) => Credentials::Password {
                user,
                password: f.header("passcode").unwrap_or(""),
            },
            (None, Some(cn)) => Credentials::Certificate { user: cn },
            (None, None) => Credentials::Anonymous {
                user: self.cfg.anonymous_user.as_deref(),
            },
        };
        let vhost_name = match f.header("host") {
            Some(h) if self.broker.has_vhost(h) => h,
            _ => self.broker.default_vhost(),
        };
        let peer = Peer {
            addr: self.peer.ip(),
            conn: self.conn,
            failed_login_delay: self.cfg.failed_login_delay,
        };
        // Every refusal gets the answer (and the delay) of a bad password: one made only
        // once the password was accepted (no permissions on the vhost, over the
        // connection limit, a loopback-only user) must not tell that it is right. The
        // log says why.
        let link = match self
            .broker
            .login(credentials, peer, vhost_name, Protocol::Stomp)
        {
            Ok(link) => link,
            Err(e) => {
                let name = match credentials {
                    Credentials::Password { user, .. } | Credentials::Certificate { user } => user,
                    Credentials::Anonymous { user } => user.unwrap_or(""),
                };
                tracing::info!(peer = %self.peer, user = %name, reason = %e.reason, "STOMP login refused");
                self.login_hold = Some(e.hold);
                let shown = CoreError::AccessRefused(format!(
                    "login refused for user '{name}': invalid credentials"
                ));
                return Err(Fail::new("Bad CONNECT", format!("Access refused: {shown}")));
            }
        };
        if version >= Version::V11 {
            if let Some(hb) = f.header("heart-beat") {
                let (cx, cy) = parse_heartbeat(hb).ok_or_else(|| {
                    Fail::new("invalid heart-beat header", format!("'{hb}' is not 'x,y'"))
                })?;
                let (sx, sy) = (
                    u64::from(self.cfg.heartbeat_send_ms),
                    u64::from(self.cfg.heartbeat_recv_ms),
                );
                let send = if sx == 0 || cy == 0 { 0 } else { sx.max(cy) };
                let recv = if sy == 0 || cx == 0 { 0 } else { sy.max(cx) };
                self.heartbeat = (send, recv);
            }
        }
        self.version = version;
        self.link = Some(link);
        self.phase = Phase::Connected;
        let c = Frame::new(Command::Connected)
            .with("version", version.as_str())
            .with("server", concat!("Triad/", env!("CARGO_PKG_VERSION")))
            .with("session", format!("session-{}", self.conn))
            // always, `0,0` when none is agreed and for 1.0 too (as RabbitMQ): clients
            // that read it unconditionally (stompjs, some 1.0 ones) find it
            .with(
                "heart-beat",
                format!("{},{}", self.heartbeat.0, self.heartbeat.1),
            );
        out.push(Action::Send(c));
        if let Some(r) = f.header("receipt") {
            out.push(Action::Receipt {
                durable: None,
                flow: None,
                frame: receipt_frame(r),
            });
        }
        Ok(())
    }

    /// The connection's link to its vhost.
    fn linked(&self) -> Res<&Link> {
        self.link
            .as_ref()
            .ok_or_else(|| Fail::new("not connected", "no vhost"))
    }

    fn send(&mut self, f: Frame, out: &mut Vec<Action>) -> Res {
        let receipt = f.header("receipt").map(str::to_string);
        // validate now, even inside a transaction
        let dest = Destination::parse(required(&f, "destination")?)
            .map_err(|e| Fail::new("Unknown destination", e.to_string()))?;
        let props = mapping::properties_from_send(&f, self.user())?;
        queue_arguments(&f)?;
        if let Some(tx) = f.header("transaction") {
            let tx = tx.to_string();
            let caps = self.cfg.caps;
            let bytes = self.tx_bytes.saturating_add(f.body.len());
            let ops = self.txs.get_mut(&tx).ok_or_else(|| unknown_tx(&tx))?;
            tx_frame_room(ops, &caps, &tx)?;
            if bytes > caps.max_transaction_bytes {
                return Err(Fail::new(
                    "Transaction too large",
                    format!(
                        "open transactions would hold {bytes} bytes of messages, more than {}",
                        caps.max_transaction_bytes
                    ),
                ));
            }
            // its receipt (the frame keeps the header) goes out at COMMIT, once the
            // message is stored, as RabbitMQ does; never for an aborted one
            ops.push(TxOp::Send(f));
            self.tx_bytes = bytes;
            return Ok(());
        }
        let (durable, flow) = self.publish(&f, dest, props)?;
        // a throttled queue holds the receipt (or, without one, what follows)
        match (receipt, flow) {
            (Some(r), flow) => out.push(Action::Receipt {
                durable,
                flow,
                frame: receipt_frame(&r),
            }),
            (None, Some(flow)) => out.push(Action::Hold(flow)),
            (None, None) => {}
        }
        Ok(())
    }

    /// Publishes a SEND: what its receipt waits for (`Some`: the disk), and the
    /// queues that throttle its publisher.
    fn publish(
        &mut self,
        f: &Frame,
        dest: Destination,
        mut props: triad_core::Properties,
    ) -> Res<(Option<Durability>, Option<Backpressure>)> {
        if let Some(rt) = props.reply_to.as_deref() {
            if let Some(t) = rt.strip_prefix("/temp-queue/") {
                let t = t.to_string();
                let q = self.temp_queue(&t)?;
                props.reply_to = Some(format!("/reply-queue/{q}"));
            }
        }
        // the declare of a `/queue/` with `x-` headers: the receipt waits for it too
        let mut declared = None;
        let (exchange, key) = match dest {
            // an AMQP requester's direct reply-to name: to its channel, nothing declared
            // (RabbitMQ takes `/queue/`, `/amq/queue/` and `/reply-queue/` alike)
            Destination::Queue(q) if q.starts_with(triad_core::direct_reply::REPLY_PREFIX) => {
                (String::new(), q)
            }
            Destination::Queue(q) => {
                declared = self.ensure_queue(&q, queue_arguments(f)?)?;
                (String::new(), q)
            }
            Destination::Topic(k) => ("amq.topic".to_string(), k),
            Destination::Exchange { exchange, key } => (exchange, key),
            Destination::AmqQueue(q) | Destination::ReplyQueue(q) => (String::new(), q),
            Destination::TempQueue(t) => (String::new(), self.temp_queue(&t)?),
        };
        let published = self.linked()?.publish(Publish {
            exchange,
            routing_key: key,
            mandatory: false,
            properties: props,
            body: f.body.clone(),
            conn: self.conn,
        })?;
        let durable = match (declared, published.durable) {
            (Some(d), Some(m)) if !d.is_durable() => Some(Durability::from_future(async move {
                d.await?;
                m.await
            })),
            (d, m) => m.or(d.filter(|d| !d.is_durable())),
        };
        Ok((durable, published.backpressure))
    }

    /// Declares durable queue `q` with `arguments` (the `x-` headers), through the
    /// core's `queue.declare`: a queue that exists with other arguments (or not
    /// durable) is a 406-style `precondition_failed`, as for an AMQP client declaring it.
    /// Without arguments an existing queue is used as it is (RabbitMQ would compare
    /// them with none and refuse). Configure permission on it is needed either way
    /// (RabbitMQ declares on every use of `/queue/`).
    /// Returns what the SEND's receipt must also wait for: the declaration's journal
    /// record (never waited for here, on the connection's task).
    fn ensure_queue(&self, q: &str, arguments: FieldTable) -> Res<Option<Durability>> {
        let link = self.linked()?;
        link.access().queue_declare(q, &arguments)?;
        if !arguments.is_empty() || link.vhost().queue(q).is_none() {
            let (_, done) = link.declare_queue_deferred(QueueDeclare {
                name: q.to_string(),
                durable: true,
                arguments,
                ..Default::default()
            })?;
            return Ok(Some(done));
        }
        Ok(None)
    }

    /// The connection's private queue for `/temp-queue/<t>`, created on first use
    /// together with an auto-ack subscription whose id is the temp-queue destination.
    fn temp_queue(&mut self, t: &str) -> Res<String> {
        if let Some(q) = self.temp_queues.get(t) {
            return Ok(q.clone());
        }
        let ok = self.linked()?.declare_queue(QueueDeclare {
            exclusive: true,
            auto_delete: true,
            ..Default::default()
        })?;
        let id = format!("/temp-queue/{t}");
        let consumer = self.linked()?.consume(
            &ok.name,
            self.consume_request(&id, AckMode::Auto, 0, false, 0),
        )?;
        self.subs.insert(
            id.clone(),
            Subscription {
                consumer,
                destination_override: Some(id.clone()),
                durable_queue: None,
            },
        );
        self.ledgers.insert(
            id,
            Ledger {
                mode: AckMode::Auto,
                pending: BTreeMap::new(),
            },
        );
        self.temp_queues.insert(t.to_string(), ok.name.clone());
        Ok(ok.name)
    }

    fn consume_request(
        &self,
        id: &str,
        mode: AckMode,
        prefetch: u32,
        exclusive: bool,
        priority: i32,
    ) -> ConsumeRequest {
        ConsumeRequest {
            tag: id.to_string(),
            no_ack: mode == AckMode::Auto,
            exclusive,
            prefetch,
            priority,
            conn: self.conn,
            outbox: self.outbox.clone(),
            gate: None,
            filter: None,
        }
    }

    fn subscribe(&mut self, f: &Frame) -> Res {
        let dest_s = required(f, "destination")?;
        let dest = Destination::parse(dest_s)
            .map_err(|e| Fail::new("Unknown destination", e.to_string()))?;
        let opts = SubscribeOptions::parse(f)?;
        let id = self.new_subscription_id(f, dest_s)?;
        // compiled before anything is declared, so a bad one leaves nothing behind
        let filter = subscription_filter(f)?;
        // the same for the stream headers (x-stream-offset)
        let stream = stream_consume(f)?;
        let mode = ack_mode(f)?;
        let prefetch = opt_number::<u32>(f, "prefetch-count")?.unwrap_or(0);
        let priority = opt_number::<i32>(f, "x-priority")?.unwrap_or(0);
        let exclusive = opts.exclusive;
        let args = queue_arguments(f)?;
        let SubscribedQueue {
            queue,
            destination_override,
            durable_queue,
        } = self.subscribed_queue(f, dest, dest_s, &opts, &id, args)?;
        let mut req = self.consume_request(&id, mode, prefetch, exclusive, priority);
        req.filter = filter;
        let consumer = self.linked()?.consume_stream(&queue, req, stream)?;
        self.subs.insert(
            id.clone(),
            Subscription {
                consumer,
                destination_override,
                durable_queue,
            },
        );
        self.ledgers
            .entry(id)
            .and_modify(|l| l.mode = mode)
            .or_insert(Ledger {
                mode,
                pending: BTreeMap::new(),
            });
        Ok(())
    }

    /// The id a SUBSCRIBE opens (its `id` header; STOMP 1.0 may leave it out and use the
    /// destination), refused when too long, already open, or one too many.
    fn new_subscription_id(&self, f: &Frame, dest_s: &str) -> Res<String> {
        let id = match (f.header("id"), self.version) {
            (Some(id), _) => id.to_string(),
            (None, Version::V10) => dest_s.to_string(),
            (None, _) => {
                return Err(Fail::new(
                    "Missing header",
                    "SUBSCRIBE needs an 'id' header",
                ))
            }
        };
        let caps = self.cfg.caps;
        check_id_length("subscription id", &id, &caps)?;
        if self.subs.len() >= caps.max_subscriptions && !self.subs.contains_key(&id) {
            return Err(Fail::new(
                "Too many subscriptions",
                format!(
                    "{} subscriptions are open on this connection, the most allowed",
                    caps.max_subscriptions
                ),
            ));
        }
        if self.subs.contains_key(&id) {
            return Err(Fail::new(
                "Duplicated subscription identifier",
                format!("a subscription with id '{id}' already exists on this connection"),
            ));
        }
        Ok(id)
    }

    /// The queue a SUBSCRIBE to `dest` consumes from, declared or bound as the
    /// destination asks.
    fn subscribed_queue(
        &mut self,
        f: &Frame,
        dest: Destination,
        dest_s: &str,
        opts: &SubscribeOptions,
        id: &str,
        args: FieldTable,
    ) -> Res<SubscribedQueue> {
        let mut durable_queue = None;
        let mut destination_override = None;
        let queue = match dest {
            Destination::Queue(q) => {
                if let Some(declared) = self.ensure_queue(&q, args)? {
                    declared.wait()?;
                }
                q
            }
            Destination::AmqQueue(_) | Destination::ReplyQueue(_) | Destination::TempQueue(_)
                if !args.is_empty() =>
            {
                return Err(Fail::new(
                    "invalid queue arguments",
                    format!(
                        "x- queue arguments declare a /queue/, /topic/ or /exchange/ \
                         subscription's queue; {dest_s} names a queue that is not declared \
                         by this SUBSCRIBE"
                    ),
                ));
            }
            Destination::AmqQueue(q) | Destination::ReplyQueue(q) => {
                if self.linked()?.vhost().queue(&q).is_none() {
                    return Err(CoreError::queue_not_found(&q).into());
                }
                q
            }
            Destination::TempQueue(t) => {
                if self.temp_queues.contains_key(&t) {
                    return Err(Fail::new(
                        "Duplicated subscription identifier",
                        format!("/temp-queue/{t} is already subscribed"),
                    ));
                }
                let ok = self.linked()?.declare_queue(QueueDeclare {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                })?;
                self.temp_queues.insert(t.clone(), ok.name.clone());
                destination_override = Some(format!("/temp-queue/{t}"));
                ok.name
            }
            Destination::Topic(key) => {
                let (q, d) = self.binding_queue(f, opts, id, "amq.topic", &key, args)?;
                durable_queue = d;
                q
            }
            Destination::Exchange { exchange, key } => {
                if !self.linked()?.vhost().has_exchange(&exchange) {
                    return Err(CoreError::exchange_not_found(&exchange).into());
                }
                let (q, d) = self.binding_queue(f, opts, id, &exchange, &key, args)?;
                durable_queue = d;
                q
            }
        };
        Ok(SubscribedQueue {
            queue,
            destination_override,
            durable_queue,
        })
    }

    /// The queue behind a topic or exchange subscription: a durable named one for
    /// `durable:true` + `auto-delete:false`, else a private server-named one.
    ///
    /// The durable one is named from the routing key and the id as RabbitMQ names it
    /// ([`queue_name::durable_subscription`]), unless `x-queue-name` names it. A queue
    /// under the name Triad used before (`stomp-subscription-<id>`) that is bound to
    /// this exchange with this key is still used when the new name does not exist yet,
    /// so a durable subscription made by an older version keeps its messages.
    fn binding_queue(
        &self,
        f: &Frame,
        opts: &SubscribeOptions,
        id: &str,
        exchange: &str,
        key: &str,
        arguments: FieldTable,
    ) -> Res<(String, Option<String>)> {
        let (decl, durable_name) = if opts.durable && !opts.auto_delete {
            let name = match f.header("x-queue-name") {
                Some(n) => n.to_string(),
                None => self.durable_subscription_queue(id, exchange, key)?,
            };
            (
                QueueDeclare {
                    name: name.clone(),
                    durable: true,
                    arguments,
                    ..Default::default()
                },
                Some(name),
            )
        } else {
            (
                QueueDeclare {
                    name: f.header("x-queue-name").unwrap_or("").to_string(),
                    exclusive: true,
                    auto_delete: true,
                    arguments,
                    ..Default::default()
                },
                None,
            )
        };
        let link = self.linked()?;
        let name = link.declare_queue(decl)?.name;
        link.bind_queue(&name, exchange, key, &FieldTable::new())?;
        Ok((name, durable_name))
    }

    /// The name of the durable subscription queue for `id` on `exchange` / `key`.
    fn durable_subscription_queue(&self, id: &str, exchange: &str, key: &str) -> Res<String> {
        let name = queue_name::durable_subscription(key, id);
        let vhost = self.linked()?.vhost();
        if vhost.queue(&name).is_none() {
            let legacy = queue_name::legacy(id);
            if vhost.queue(&legacy).is_some() && vhost.has_queue_binding(exchange, &legacy, key) {
                return Ok(legacy);
            }
        }
        Ok(name)
    }

    fn unsubscribe(&mut self, f: &Frame) -> Res {
        let durable = durable_header(f)?;
        if durable && !f.has("id") {
            return Err(missing_durable_id());
        }
        let id = match (f.header("id"), f.header("destination")) {
            (Some(id), _) => id,
            (None, Some(d)) if self.version == Version::V10 => d,
            _ => {
                return Err(Fail::new(
                    "Missing header",
                    "UNSUBSCRIBE needs an 'id' header",
                ))
            }
        };
        let sub = self.subs.remove(id).ok_or_else(|| {
            Fail::new(
                "Subscription not found",
                format!("no subscription with id '{id}' on this connection"),
            )
        })?;
        sub.consumer.cancel();
        if let (true, Some(q)) = (durable, sub.durable_queue) {
            self.linked()?.delete_queue(&q, false, false)?;
        }
        Ok(())
    }

    /// The header naming the message an ACK or NACK settles: `id` in 1.2 (a 1.2 frame
    /// with only `message-id` is refused, as RabbitMQ does, instead of being ignored and
    /// leaving the client waiting), `message-id` in 1.0 and 1.1.
    fn ack_id<'f>(&self, f: &'f Frame) -> Res<&'f str> {
        let name = if self.version == Version::V12 {
            "id"
        } else {
            "message-id"
        };
        f.header(name).ok_or_else(|| {
            Fail::new(
                "Missing header",
                format!("\"{}\" must include the \"{name}\" header", f.command),
            )
        })
    }

    fn ack_frame(&mut self, f: Frame, ack: bool) -> Res {
        let id = self.ack_id(&f)?;
        // checked now, also for a NACK held in a transaction
        bool_header(&f, "requeue")?;
        if !self.ids.contains_key(id) {
            return Err(Fail::new(
                "Unknown message id",
                format!("no unacknowledged message with id '{id}' on this connection"),
            ));
        }
        if let Some(tx) = f.header("transaction") {
            let tx = tx.to_string();
            let caps = self.cfg.caps;
            let ops = self.txs.get_mut(&tx).ok_or_else(|| unknown_tx(&tx))?;
            tx_frame_room(ops, &caps, &tx)?;
            ops.push(if ack { TxOp::Ack(f) } else { TxOp::Nack(f) });
            return Ok(());
        }
        self.settle(&f, ack);
        Ok(())
    }

    /// Applies an ACK or NACK (cumulative for `client` subscriptions).
    fn settle(&mut self, f: &Frame, ack: bool) {
        let Ok(id) = self.ack_id(f) else {
            return;
        };
        let Some((sub, seq)) = self.ids.get(id).cloned() else {
            return;
        };
        let Some(ledger) = self.ledgers.get_mut(&sub) else {
            return;
        };
        let taken: Vec<Unacked> = if ledger.mode == AckMode::Client {
            let rest = ledger.pending.split_off(&(seq + 1));
            std::mem::replace(&mut ledger.pending, rest)
                .into_values()
                .collect()
        } else {
            ledger.pending.remove(&seq).into_iter().collect()
        };
        for p in &taken {
            self.ids.remove(&p.message_id);
        }
        // checked in `ack_frame`
        let requeue = bool_header(f, "requeue").ok().flatten().unwrap_or(true);
        triad_core::link::settle(taken.iter().map(|p| (&p.queue, p.offset)), ack, requeue);
    }

    fn begin(&mut self, f: &Frame) -> Res {
        let tx = required(f, "transaction")?;
        let caps = self.cfg.caps;
        check_id_length("transaction", tx, &caps)?;
        if self.txs.contains_key(tx) {
            return Err(Fail::new(
                "Transaction already active",
                format!("transaction '{tx}' was already begun"),
            ));
        }
        if self.txs.len() >= caps.max_transactions {
            return Err(Fail::new(
                "Too many transactions",
                format!(
                    "{} transactions are open on this connection, the most allowed",
                    caps.max_transactions
                ),
            ));
        }
        self.txs.insert(tx.to_string(), Vec::new());
        Ok(())
    }

    fn commit(&mut self, f: &Frame, out: &mut Vec<Action>) -> Res {
        let tx = required(f, "transaction")?;
        let ops = self.take_tx(tx)?;
        let mut waits = Vec::new();
        // the first throttled publish of the transaction holds the first receipt that
        // follows it (and so every later one): one timer per COMMIT, not one per message
        let mut hold = None;
        let mut held = false;
        for op in ops {
            match op {
                TxOp::Send(s) => {
                    let dest = Destination::parse(s.header("destination").unwrap_or(""))
                        .map_err(|e| Fail::new("Unknown destination", e.to_string()))?;
                    let props = mapping::properties_from_send(&s, self.user())?;
                    let (durable, flow) = self.publish(&s, dest, props)?;
                    if !held && flow.is_some() {
                        held = true;
                        hold = flow;
                    }
                    // A SEND's own receipt waits for its message on disk; the reply
                    // queue releases receipts in order, so each also waits for the
                    // SENDs before it, and all of them come before COMMIT's.
                    match s.header("receipt") {
                        Some(r) => out.push(Action::Receipt {
                            durable,
                            flow: hold.take(),
                            frame: receipt_frame(r),
                        }),
                        None => waits.extend(durable),
                    }
                }
                TxOp::Ack(a) => self.settle(&a, true),
                TxOp::Nack(n) => self.settle(&n, false),
            }
        }
        if let Some(r) = f.header("receipt") {
            let durable = match waits.len() {
                0 => None,
                1 => waits.pop(),
                _ => Some(Durability::from_future(async move {
                    for w in waits {
                        w.await?;
                    }
                    Ok(())
                })),
            };
            out.push(Action::Receipt {
                durable,
                flow: hold,
                frame: receipt_frame(r),
            });
        } else if let Some(hold) = hold {
            out.push(Action::Hold(hold));
        }
        Ok(())
    }

    fn abort(&mut self, f: &Frame) -> Res {
        let tx = required(f, "transaction")?;
        self.take_tx(tx)?;
        Ok(())
    }

    /// Removes transaction `tx`, giving back its share of `tx_bytes`.
    fn take_tx(&mut self, tx: &str) -> Res<Vec<TxOp>> {
        let ops = self.txs.remove(tx).ok_or_else(|| unknown_tx(tx))?;
        let bytes: usize = ops
            .iter()
            .map(|op| match op {
                TxOp::Send(s) => s.body.len(),
                _ => 0,
            })
            .sum();
        self.tx_bytes = self.tx_bytes.saturating_sub(bytes);
        Ok(ops)
    }

    /// Turns a core event into frames.
    pub fn deliver(&mut self, ev: OutEvent, out: &mut Vec<Action>) {
        match ev {
            OutEvent::Deliver(d) => self.deliver_one(d, out),
            // direct reply-to consumers are AMQP's only
            OutEvent::Reply(_) => {}
            OutEvent::Cancelled { tag } => {
                if self.subs.remove(&*tag).is_some() && self.phase == Phase::Connected {
                    self.fail(
                        Fail::new(
                            "Subscription cancelled",
                            format!("the queue of subscription '{tag}' was deleted"),
                        ),
                        None,
                        out,
                    );
                }
            }
        }
    }

    fn deliver_one(&mut self, d: Delivery, out: &mut Vec<Action>) {
        let sub_id: &str = &d.tag;
        let (Some(sub), Some(ledger), true) = (
            self.subs.get(sub_id),
            self.ledgers.get_mut(sub_id),
            self.phase == Phase::Connected,
        ) else {
            // its subscription is gone: give it back
            if d.needs_ack {
                d.queue.requeue_unsent(&[d.offset]);
            }
            return;
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let message_id = format!("T_{sub_id}@@session-{}@@{seq}", self.conn);
        let frame = mapping::message_frame(
            &d,
            &MessageMeta {
                subscription: sub_id,
                message_id: &message_id,
                ack_header: self.version == Version::V12 && ledger.mode != AckMode::Auto,
                destination: sub.destination_override.as_deref(),
            },
        );
        if d.needs_ack {
            self.ids
                .insert(message_id.clone(), (sub_id.to_string(), seq));
            ledger.pending.insert(
                seq,
                Unacked {
                    queue: d.queue.clone(),
                    offset: d.offset,
                    message_id,
                },
            );
        }
        out.push(Action::Send(frame));
    }

    /// Idle for a while: the consumed queues let go of what the last traffic left.
    pub(crate) fn release_idle(&mut self) {
        for s in self.subs.values() {
            s.consumer.release_idle();
        }
        // an emptied BTreeMap keeps its root leaf (about 0.5 KiB of unacked entries)
        for l in self.ledgers.values_mut() {
            if l.pending.is_empty() {
                l.pending = BTreeMap::new();
            }
        }
    }

    /// The connection is gone: cancel consumers, requeue every unacked delivery (also
    /// those still in the outbox), drop exclusive queues. Idempotent.
    pub fn close(&mut self) {
        self.phase = Phase::Closed;
        for (_, s) in self.subs.drain() {
            s.consumer.cancel();
        }
        let mut back = Vec::new();
        for ev in self.outbox.close() {
            if let OutEvent::Deliver(d) = ev {
                if d.needs_ack {
                    back.push(Unacked {
                        queue: d.queue,
                        offset: d.offset,
                        message_id: String::new(),
                    });
                }
            }
        }
        for (_, l) in self.ledgers.drain() {
            back.extend(l.pending.into_values());
        }
        self.ids.clear();
        self.txs.clear();
        triad_core::link::settle(back.iter().map(|p| (&p.queue, p.offset)), false, true);
        // last: the exclusive queues and the connection slot go with the link
        self.link = None;
    }
}

/// The boolean SUBSCRIBE headers, read (and refused when not booleans) before anything
/// is declared.
struct SubscribeOptions {
    /// `durable` or `persistent` (RabbitMQ's older name for it).
    durable: bool,
    /// `auto-delete`, true unless given.
    auto_delete: bool,
    /// `exclusive`: an exclusive consumer.
    exclusive: bool,
}

impl SubscribeOptions {
    fn parse(f: &Frame) -> Res<SubscribeOptions> {
        let durable = durable_header(f)?;
        if durable && !f.has("id") {
            return Err(missing_durable_id());
        }
        Ok(SubscribeOptions {
            durable,
            auto_delete: bool_header(f, "auto-delete")?.unwrap_or(true),
            exclusive: bool_header(f, "exclusive")?.unwrap_or(false),
        })
    }
}

/// `durable:true` or `persistent:true` on SUBSCRIBE / UNSUBSCRIBE.
fn durable_header(f: &Frame) -> Res<bool> {
    let durable = bool_header(f, "durable")?.unwrap_or(false);
    let persistent = bool_header(f, "persistent")?.unwrap_or(false);
    Ok(durable || persistent)
}

/// RabbitMQ's refusal of a durable SUBSCRIBE or UNSUBSCRIBE without `id` (whatever the
/// version: the id names the durable queue).
fn missing_durable_id() -> Fail {
    Fail::new(
        "Missing Header",
        "Header 'id' is required for durable subscriptions",
    )
}

fn receipt_frame(r: &str) -> Frame {
    Frame::new(Command::Receipt).with("receipt-id", r)
}

fn required<'a>(f: &'a Frame, name: &str) -> Res<&'a str> {
    f.header(name).ok_or_else(|| {
        Fail::new(
            "Missing header",
            format!("{} needs a '{name}' header", f.command),
        )
    })
}

/// Whether transaction `tx` (holding `ops`) may buffer one more frame.
fn tx_frame_room(ops: &[TxOp], caps: &Caps, tx: &str) -> Res {
    if ops.len() >= caps.max_transaction_frames {
        return Err(Fail::new(
            "Transaction too large",
            format!(
                "transaction '{tx}' holds {} frames, the most allowed",
                caps.max_transaction_frames
            ),
        ));
    }
    Ok(())
}

fn check_id_length(what: &str, id: &str, caps: &Caps) -> Res {
    if id.len() > caps.max_id_length {
        return Err(Fail::new(
            "Header too long",
            format!(
                "a {what} of {} bytes is longer than the {} allowed",
                id.len(),
                caps.max_id_length
            ),
        ));
    }
    Ok(())
}

fn unknown_tx(tx: &str) -> Fail {
    Fail::new(
        "Bad transaction",
        format!("transaction '{tx}' was not begun (or is already committed or aborted)"),
    )
}

fn opt_number<T: std::str::FromStr>(f: &Frame, name: &str) -> Res<Option<T>> {
    match f.header(name) {
        None => Ok(None),
        Some(v) => v.trim().parse().map(Some).map_err(|_| {
            Fail::new(
                format!("invalid {name} header"),
                format!("'{v}' is not a valid {name}"),
            )
        }),
    }
}

fn parse_heartbeat(v: &str) -> Option<(u64, u64)> {
    let (a, b) = v.split_once(',')?;
    Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
}

/// The queue a SUBSCRIBE consumes from, and what its [`Subscription`] remembers of it.
struct SubscribedQueue {
    queue: String,
    destination_override: Option<String>,
    durable_queue: Option<String>,
}

/// A SUBSCRIBE's `selector` and `x-tag-filter`, compiled.
fn subscription_filter(f: &Frame) -> Res<Option<Arc<MessageFilter>>> {
    MessageFilter::compile(f.header("selector"), f.header("x-tag-filter")).map_err(|e| match e {
        CoreError::PreconditionFailed(m) if m.starts_with("invalid selector") => {
            Fail::new("invalid selector", m)
        }
        CoreError::PreconditionFailed(m) => Fail::new("invalid x-tag-filter header", m),
        other => other.into(),
    })
}

/// A SUBSCRIBE's `ack` header (`auto` when absent).
fn ack_mode(f: &Frame) -> Res<AckMode> {
    match f.header("ack").unwrap_or("auto") {
        "auto" => Ok(AckMode::Auto),
        "client" => Ok(AckMode::Client),
        "client-individual" => Ok(AckMode::ClientIndividual),
        other => Err(Fail::new(
            "invalid ack header",
            format!("ack mode '{other}' is not auto, client or client-individual"),
        )),
    }
}

/// A stream subscription's `x-stream-offset` (`first`, `last`, `next`, an offset, an
/// interval such as `1h`, or `time:<RFC 3339>`) and `x-stream-consumer-name` headers,
/// as RabbitMQ's STOMP plugin reads them; the core refuses them on a queue that is not
/// a stream.
fn stream_consume(f: &Frame) -> Res<triad_core::stream::StreamConsume> {
    let now = triad_core::stream::now_ms();
    let offset = match f.header("x-stream-offset") {
        None => None,
        Some(v) => Some(
            triad_core::stream::StreamOffset::parse_str(v.trim(), now).ok_or_else(|| {
                Fail::new(
                    "invalid x-stream-offset",
                    format!(
                        "x-stream-offset '{v}' is not first, last, next, an offset, an interval such as 1h or time:<RFC 3339>"
                    ),
                )
            })?,
        ),
    };
    let name = f.header("x-stream-consumer-name").map(str::to_string);
    Ok(triad_core::stream::StreamConsume { offset, name })
}

/// `x-` queue arguments given on SEND or SUBSCRIBE, typed as RabbitMQ's plugin types
/// them: integers (`long`) for the TTLs, lengths and priority, strings for the rest. A
/// value that does not parse is an ERROR naming the header; what the core does not
/// implement (an `x-queue-type` other than `classic`, say) it refuses when the queue is
/// declared.
fn queue_arguments(f: &Frame) -> Res<FieldTable> {
    const INTS: &[&str] = &[
        "x-message-ttl",
        "x-expires",
        "x-max-length",
        "x-max-length-bytes",
        "x-max-priority",
        "x-delivery-limit",
    ];
    const STRINGS: &[&str] = &[
        "x-dead-letter-exchange",
        "x-dead-letter-routing-key",
        "x-overflow",
        "x-queue-type",
        "x-retry-backoff",
        "x-max-age",
    ];
    let mut t = FieldTable::new();
    for name in INTS {
        if let Some(n) = opt_number::<i64>(f, name)? {
            t.insert(*name, FieldValue::I64(n));
        }
    }
    for name in STRINGS {
        if let Some(v) = f.header(name) {
            // RabbitMQ strips the value
            t.insert(
                *name,
                FieldValue::LongString(Bytes::from(v.trim().to_string())),
            );
        }
    }
    Ok(t)
}

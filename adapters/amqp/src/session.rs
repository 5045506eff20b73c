//! The connection state machine (sans-IO): decoded frames and core events in, frames
//! to send out. The handshake and connection class live here; channel, exchange,
//! queue, basic, tx and confirm methods in [`crate::channel`].
//!
//! Errors: a handler returns [`AmqpError`]; channel-scoped ones close that channel
//! (channel.close, further frames on it are dropped until channel.close-ok),
//! connection-scoped ones send connection.close and then only wait for close-ok.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use amq_protocol::protocol::{connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable as WireTable, LongString};
use bytes::BytesMut;
use triad_core::{
    Authenticated, Broker, ConnectionId, CoreError, Credentials, Link, LoginRefused, OutEvent,
    Outbox, Peer, Protocol,
};

use crate::channel::Channel;
use crate::codec::{self, EncodeError, Frame, FrameError, Limits};
use crate::confirms::{ConfirmQueue, Settled};
use crate::errors::{self, AmqpError, Scope};
use crate::mapping::short;
use crate::AmqpConfig;

/// The hasher for the session's per-delivery lookups (channel ids, consumer tags): a
/// seeded foldhash, much cheaper than SipHash; keys come from this connection only.
pub(crate) type FastHash = foldhash::fast::RandomState;

/// Smallest frame-max a client may ask for (the spec's FRAME-MIN-SIZE).
pub const FRAME_MIN_SIZE: u32 = 4096;

/// Where the connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// connection.start sent; waiting for start-ok.
    AwaitStartOk,
    /// connection.tune sent; waiting for tune-ok.
    AwaitTuneOk,
    /// Waiting for connection.open.
    AwaitOpen,
    /// Open.
    Open,
    /// connection.close sent; waiting for close-ok (everything else is dropped).
    Closing,
    /// Done: flush output and close the socket.
    Closed,
}

/// Where the login is.
#[derive(Debug)]
pub(crate) enum Login {
    /// No credentials accepted yet.
    None,
    /// start-ok's credentials were accepted; waiting for connection.open.
    Authenticated(Authenticated),
    /// The vhost is open: the user, vhost, permissions and connection slot. Dropped
    /// (the connection torn down in the core) last in [`Session::teardown`].
    Open(Link),
}

/// One AMQP connection's protocol state.
pub struct Session {
    pub(crate) cfg: AmqpConfig,
    pub(crate) broker: Arc<Broker>,
    peer: IpAddr,
    pub(crate) conn: ConnectionId,
    state: State,
    limits: Limits,
    pub(crate) channel_max: u16,
    pub(crate) frame_max: u32,
    heartbeat: u16,
    pub(crate) login: Login,
    /// A login was refused: how long the driver waits before answering (the
    /// failed-login throttle's answer, [`LoginRefused::hold`]).
    login_hold: Option<Duration>,
    /// Boxed: a map allocates room for four entries at least, and a `Channel` is
    /// several hundred bytes (an idle connection with one channel held 2.4 KiB here).
    pub(crate) channels: HashMap<u16, Box<Channel>, FastHash>,
    /// Consumer tag → channel (tags are unique per connection here).
    pub(crate) consumer_channels: HashMap<Arc<str>, u16, FastHash>,
    pub(crate) outbox: Arc<Outbox>,
    pub(crate) confirms: ConfirmQueue,
    pub(crate) out: Vec<Frame>,
    encoder: codec::Encoder,
    pub(crate) ctag_seq: u64,
    blocked_capable: bool,
    published: bool,
    torn_down: bool,
    /// connection.close-ok was sent (the peer closed): the driver reads and discards
    /// until the peer closes its socket, as RabbitMQ does.
    sent_close_ok: bool,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("conn", &self.conn)
            .field("state", &self.state)
            .field("channels", &self.channels.len())
            .finish()
    }
}

fn method(channel: u16, class: AMQPClass) -> Frame {
    Frame::Method(channel, Box::new(class))
}

fn server_properties() -> WireTable {
    let s = |v: &str| AMQPValue::LongString(LongString::from(v));
    let mut caps = WireTable::default();
    for (cap, on) in [
        ("publisher_confirms", true),
        ("basic.nack", true),
        ("consumer_cancel_notify", true),
        ("exchange_exchange_bindings", true),
        ("connection.blocked", true),
        ("authentication_failure_close", true),
        ("per_consumer_qos", true),
        ("consumer_priorities", true),
        ("direct_reply_to", true),
    ] {
        caps.insert(cap.into(), AMQPValue::Boolean(on));
    }
    let mut t = WireTable::default();
    t.insert("product".into(), s("Triad"));
    t.insert("version".into(), s(env!("CARGO_PKG_VERSION")));
    t.insert("platform".into(), s("Rust"));
    t.insert("information".into(), s("Triad: AMQP 0-9-1, STOMP, MQTT"));
    t.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    t
}

/// Parses a SASL PLAIN response `authzid \0 authcid \0 password`.
pub fn parse_plain(response: &[u8]) -> Option<(String, String)> {
    let mut parts = response.split(|b| *b == 0);
    let _authzid = parts.next()?;
    let user = std::str::from_utf8(parts.next()?).ok()?;
    let pass = std::str::from_utf8(parts.next()?).ok()?;
    if parts.next().is_some() {
        return None;
    }
    Some((user.to_owned(), pass.to_owned()))
}

/// Parses an AMQPLAIN response: a field table without its length prefix, holding
/// `LOGIN` and `PASSWORD`.
pub fn parse_amqplain(response: &[u8]) -> Option<(String, String)> {
    let table = codec::parse_table_body(response)?;
    let get = |k: &str| match table.inner().get(k)? {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    };
    Some((get("LOGIN")?, get("PASSWORD")?))
}

impl Session {
    /// A new connection from `peer`. Call [`Session::start`] once the protocol header
    /// has been accepted.
    pub fn new(broker: Arc<Broker>, cfg: AmqpConfig, peer: IpAddr) -> Session {
        let conn = broker.next_connection_id();
        let outbox = Outbox::new(cfg.outbox_capacity);
        Session {
            channel_max: cfg.channel_max,
            frame_max: Limits::PRE_TUNE.frame_max,
            heartbeat: 0,
            cfg,
            broker,
            peer,
            conn,
            state: State::AwaitStartOk,
            limits: Limits::PRE_TUNE,
            login: Login::None,
            login_hold: None,
            channels: HashMap::default(),
            consumer_channels: HashMap::default(),
            outbox,
            confirms: ConfirmQueue::default(),
            out: Vec::new(),
            encoder: codec::Encoder::default(),
            ctag_seq: 0,
            blocked_capable: false,
            published: false,
            torn_down: false,
            sent_close_ok: false,
        }
    }

    /// The core's id for this connection.
    pub fn connection_id(&self) -> ConnectionId {
        self.conn
    }

    /// Current state.
    pub fn state(&self) -> State {
        self.state
    }

    /// Decode limits in force (8 KiB until tune-ok).
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Negotiated heartbeat in seconds (0 = none).
    pub fn heartbeat(&self) -> u16 {
        self.heartbeat
    }

    /// Whether the handshake has completed.
    pub fn is_open(&self) -> bool {
        self.state == State::Open
    }

    /// The outbox the connection's consumers deliver into.
    pub fn outbox(&self) -> &Arc<Outbox> {
        &self.outbox
    }

    /// Pending publisher confirms (the driver awaits [`ConfirmQueue::ready`]).
    pub fn confirms(&mut self) -> &mut ConfirmQueue {
        &mut self.confirms
    }

    /// Frames produced so far, taken.
    pub fn take_frames(&mut self) -> Vec<Frame> {
        std::mem::take(&mut self.out)
    }

    /// Encodes every pending frame into `buf`.
    pub fn write_to(&mut self, buf: &mut BytesMut) -> Result<(), EncodeError> {
        for f in self.out.drain(..) {
            self.encoder.encode(&f, buf)?;
        }
        Ok(())
    }

    /// Lets go of the output vector and the encoder's scratch buffer kept between
    /// batches; the driver calls it when nothing is waiting, so that an idle connection
    /// holds neither.
    pub fn release_buffers(&mut self) {
        if self.out.is_empty() {
            self.out = Vec::new();
        }
        self.encoder = codec::Encoder::default();
    }

    /// Whether frames are waiting to be written.
    pub fn has_output(&self) -> bool {
        !self.out.is_empty()
    }

    pub(crate) fn send(&mut self, channel: u16, class: AMQPClass) {
        self.out.push(method(channel, class));
    }

    /// How long to hold the answer to a login just refused, if one was; clears it.
    pub fn take_login_hold(&mut self) -> Option<Duration> {
        self.login_hold.take()
    }

    /// The connection's link (user, vhost, permissions), once open.
    pub fn link(&self) -> Option<&Link> {
        match &self.login {
            Login::Open(l) => Some(l),
            _ => None,
        }
    }

    /// The peer's address.
    pub fn peer(&self) -> IpAddr {
        self.peer
    }

    /// Sends connection.start. EXTERNAL is offered when the TLS handshake verified a
    /// client certificate.
    pub fn start(&mut self) {
        let mechanisms = if self.cfg.peer_cert_cn.is_some() {
            "PLAIN AMQPLAIN EXTERNAL"
        } else {
            "PLAIN AMQPLAIN"
        };
        self.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: server_properties(),
                mechanisms: LongString::from(mechanisms),
                locales: LongString::from("en_US"),
            })),
        );
    }

    /// A framing violation: connection.close with its code.
    pub fn frame_error(&mut self, e: &FrameError) {
        self.close_connection(AmqpError::connection(e.reply_code(), e));
    }

    /// The handshake deadline passed or the peer went silent: just close.
    pub fn abort(&mut self) {
        self.state = State::Closed;
    }

    /// Sends connection.blocked (`Some(reason)`) or connection.unblocked (`None`) if
    /// the client said it understands them. The hook for memory and disk alarms.
    pub fn set_blocked(&mut self, reason: Option<&str>) {
        if !self.blocked_capable || self.state != State::Open {
            return;
        }
        let m = match reason {
            Some(r) => connection::AMQPMethod::Blocked(connection::Blocked { reason: short(r) }),
            None => connection::AMQPMethod::Unblocked(connection::Unblocked {}),
        };
        self.send(0, AMQPClass::Connection(m));
    }

    /// Whether connection.close-ok was sent to the peer: it closed the connection, and
    /// frames it sent before it saw close-ok (amqplib writes connection.close ahead of
    /// the publishes it still has buffered) are to be read and dropped until it closes
    /// the socket, so that it sees a clean close and not a reset.
    pub fn sent_close_ok(&self) -> bool {
        self.sent_close_ok
    }

    /// Whether this connection has published (alarms block reading from publishers).
    pub fn has_published(&self) -> bool {
        self.published
    }

    /// Handles one decoded frame.
    pub fn handle(&mut self, frame: Frame) {
        if matches!(self.state, State::Closed) {
            return;
        }
        if let Frame::Method(_, m) = &frame {
            if matches!(
                **m,
                AMQPClass::Basic(amq_protocol::protocol::basic::AMQPMethod::Publish(_))
            ) {
                self.published = true;
            }
        }
        if let Err(e) = self.dispatch(frame) {
            self.fail(e);
        }
    }

    pub(crate) fn fail(&mut self, e: AmqpError) {
        match e.scope {
            Scope::Connection => self.close_connection(e),
            Scope::Channel => {
                // Channel errors before the connection is open cannot happen; be safe.
                self.close_connection(AmqpError {
                    scope: Scope::Connection,
                    ..e
                })
            }
        }
    }

    /// Sends connection.close and tears down every channel.
    pub fn close_connection(&mut self, e: AmqpError) {
        if matches!(self.state, State::Closing | State::Closed) {
            return;
        }
        tracing::debug!(conn = self.conn, code = e.code, text = %e.text, "closing connection");
        self.teardown_channels();
        self.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: e.code,
                reply_text: short(&e.text),
                class_id: e.class_id,
                method_id: e.method_id,
            })),
        );
        self.state = State::Closing;
    }

    /// Server shutdown: connection.close 320 CONNECTION_FORCED.
    pub fn shutdown(&mut self) {
        if self.state == State::Open {
            self.close_connection(AmqpError::connection(
                errors::CONNECTION_FORCED,
                "broker shutdown",
            ));
        } else {
            self.state = State::Closed;
        }
    }

    fn dispatch(&mut self, frame: Frame) -> Result<(), AmqpError> {
        let channel = frame.channel();
        if self.state == State::Closing {
            // Only close-ok (or a crossing close) matters now.
            if let Frame::Method(0, class) = &frame {
                match class.as_ref() {
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => {
                        self.state = State::Closed
                    }
                    AMQPClass::Connection(connection::AMQPMethod::Close(_)) => {
                        self.send(
                            0,
                            AMQPClass::Connection(connection::AMQPMethod::CloseOk(
                                connection::CloseOk {},
                            )),
                        );
                        self.sent_close_ok = true;
                        self.state = State::Closed;
                    }
                    _ => {}
                }
            }
            return Ok(());
        }
        match frame {
            Frame::Heartbeat(0) => Ok(()),
            Frame::Heartbeat(_) => Err(AmqpError::connection(
                errors::COMMAND_INVALID,
                "heartbeat frame on a non-zero channel",
            )),
            Frame::Method(0, class) => self.connection_method(*class),
            _ if self.state != State::Open => Err(AmqpError::connection(
                errors::CHANNEL_ERROR,
                "channel frame before the connection is open",
            )),
            Frame::Method(_, class) => self.channel_method(channel, *class),
            Frame::Header(_, header) => self.content_header(channel, *header),
            Frame::Body(_, body) => self.content_body(channel, body),
        }
    }

    fn connection_method(&mut self, class: AMQPClass) -> Result<(), AmqpError> {
        let (cid, mid) = (class.get_amqp_class_id(), class.get_amqp_method_id());
        let AMQPClass::Connection(m) = class else {
            return Err(AmqpError::connection(
                errors::COMMAND_INVALID,
                "non-connection method on channel 0",
            )
            .on(cid, mid));
        };
        let unexpected = || {
            AmqpError::connection(errors::COMMAND_INVALID, "unexpected connection method")
                .on(cid, mid)
        };
        match (self.state, m) {
            (State::AwaitStartOk, connection::AMQPMethod::StartOk(ok)) => {
                self.start_ok(ok).map_err(|e| e.on(cid, mid))
            }
            (State::AwaitTuneOk, connection::AMQPMethod::TuneOk(ok)) => {
                self.tune_ok(ok).map_err(|e| e.on(cid, mid))
            }
            (State::AwaitOpen, connection::AMQPMethod::Open(open)) => {
                let name = open.virtual_host.as_str();
                let link = self.open_vhost(name).map_err(|e| {
                    let detail = match e {
                        CoreError::NotAllowed(s) => s,
                        other => other.to_string(),
                    };
                    AmqpError::connection(errors::NOT_ALLOWED, detail).on(cid, mid)
                })?;
                // the connection's span (the listener's) gets who it is
                let span = tracing::Span::current();
                span.record("user", link.user());
                span.record("vhost", name);
                tracing::debug!(conn = self.conn, "connection open");
                self.login = Login::Open(link);
                self.state = State::Open;
                self.send(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
                );
                Ok(())
            }
            (_, connection::AMQPMethod::Close(_)) => {
                self.teardown_channels();
                self.send(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                self.sent_close_ok = true;
                self.state = State::Closed;
                Ok(())
            }
            (State::Open, connection::AMQPMethod::UpdateSecret(_)) => {
                self.send(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(
                        connection::UpdateSecretOk {},
                    )),
                );
                Ok(())
            }
            (
                State::Open,
                connection::AMQPMethod::Blocked(_) | connection::AMQPMethod::Unblocked(_),
            ) => Ok(()),
            _ => Err(unexpected()),
        }
    }

    /// connection.open: the vhost must exist, the user needs permissions in it and a
    /// free connection slot (all 530 NOT_ALLOWED, as RabbitMQ).
    fn open_vhost(&mut self, name: &str) -> Result<Link, CoreError> {
        let Login::Authenticated(auth) = std::mem::replace(&mut self.login, Login::None) else {
            return Err(CoreError::NotAllowed("not logged in".into()));
        };
        self.broker.open_link(auth, name, Protocol::Amqp)
    }

    /// A refused login: logged with the peer and user name, answered with 403
    /// ACCESS_REFUSED after `failed_login_delay` (RabbitMQ's text, which does not say
    /// whether the user name or the password was wrong).
    fn login_refused(&mut self, mechanism: &str, user: &str, why: LoginRefused) -> AmqpError {
        tracing::info!(peer = %self.peer, user, mechanism, reason = %why.reason, "AMQP login refused");
        self.login_hold = Some(why.hold);
        AmqpError::connection(
            errors::ACCESS_REFUSED,
            format!(
                "Login was refused using authentication mechanism {mechanism}. For details see the broker logfile."
            ),
        )
    }

    fn start_ok(&mut self, ok: connection::StartOk) -> Result<(), AmqpError> {
        if let Some(AMQPValue::FieldTable(caps)) = ok.client_properties.inner().get("capabilities")
        {
            self.blocked_capable = matches!(
                caps.inner().get("connection.blocked"),
                Some(AMQPValue::Boolean(true))
            );
        }
        let mechanism = ok.mechanism.as_str().to_owned();
        let login = match mechanism.as_str() {
            // without a verified certificate, no user: refused as an unknown one
            "EXTERNAL" => (self.cfg.peer_cert_cn.clone().unwrap_or_default(), None),
            "PLAIN" | "AMQPLAIN" => {
                let creds = if mechanism == "PLAIN" {
                    parse_plain(ok.response.as_bytes())
                } else {
                    parse_amqplain(ok.response.as_bytes())
                };
                let Some((user, pass)) = creds else {
                    return Err(AmqpError::connection(
                        errors::ACCESS_REFUSED,
                        "malformed authentication response",
                    ));
                };
                (user, Some(pass))
            }
            other => {
                return Err(AmqpError::connection(
                    errors::COMMAND_INVALID,
                    format!("unknown authentication mechanism '{other}'"),
                ))
            }
        };
        let (name, pass) = login;
        let credentials = match &pass {
            Some(password) => Credentials::Password {
                user: &name,
                password,
            },
            None => Credentials::Certificate { user: &name },
        };
        let peer = Peer {
            addr: self.peer,
            conn: self.conn,
            failed_login_delay: self.cfg.failed_login_delay,
        };
        let auth = match self.broker.check_credentials(credentials, peer) {
            Ok(a) => a,
            Err(e) => return Err(self.login_refused(&mechanism, &name, e)),
        };
        tracing::debug!(conn = self.conn, user = %auth.user().name, "authenticated");
        self.login = Login::Authenticated(auth);
        self.state = State::AwaitTuneOk;
        self.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
                channel_max: self.cfg.channel_max,
                frame_max: self.cfg.frame_max,
                heartbeat: u16::try_from(self.cfg.heartbeat.as_secs()).unwrap_or(u16::MAX),
            })),
        );
        Ok(())
    }

    fn tune_ok(&mut self, ok: connection::TuneOk) -> Result<(), AmqpError> {
        let ours = self.cfg.frame_max;
        let frame_max = if ok.frame_max == 0 {
            ours
        } else {
            ok.frame_max
        };
        if frame_max < FRAME_MIN_SIZE || frame_max > ours {
            return Err(AmqpError::connection(
                errors::NOT_ALLOWED,
                format!("frame_max={frame_max} outside {FRAME_MIN_SIZE}..={ours}"),
            ));
        }
        let ours_ch = self.cfg.channel_max;
        self.channel_max = match (ok.channel_max, ours_ch) {
            (0, o) => o,
            (c, 0) => c,
            (c, o) => c.min(o),
        };
        let ours_hb = u16::try_from(self.cfg.heartbeat.as_secs()).unwrap_or(u16::MAX);
        // The client's answer is final, as RabbitMQ takes it: 0 vetoes heartbeats (the
        // AMQP 0-9-1 spec: "zero means the client does not want a heartbeat").
        self.heartbeat = match (ok.heartbeat, ours_hb) {
            (0, _) => 0,
            (c, 0) => c,
            (c, o) => c.min(o),
        };
        self.frame_max = frame_max;
        self.limits = Limits { frame_max };
        self.state = State::AwaitOpen;
        Ok(())
    }

    /// Core events: deliveries and server-side consumer cancels.
    pub fn on_events(&mut self, events: impl IntoIterator<Item = OutEvent>) {
        for ev in events {
            match ev {
                OutEvent::Deliver(d) => self.deliver(d),
                OutEvent::Reply(r) => self.deliver_reply(r),
                OutEvent::Cancelled { tag } => self.server_cancel(&tag),
            }
        }
    }

    /// Publisher confirms that settled.
    pub fn on_confirms(&mut self, settled: Vec<Settled>) {
        let mut i = 0;
        while let Some(s) = settled.get(i).copied() {
            if s.commit {
                i += 1;
                self.on_commit_durable(s.channel, s.ack);
                continue;
            }
            // Coalesce a run of acks on one channel into one ack multiple=true.
            let mut last = s.seq;
            let mut j = i + 1;
            if s.ack {
                while let Some(n) = settled.get(j) {
                    if n.channel != s.channel || !n.ack || n.commit {
                        break;
                    }
                    last = n.seq;
                    j += 1;
                }
            }
            if self.channels.get(&s.channel).is_some_and(|c| c.is_open()) {
                let multiple = last != s.seq;
                let m = if s.ack {
                    amq_protocol::protocol::basic::AMQPMethod::Ack(
                        amq_protocol::protocol::basic::Ack {
                            delivery_tag: last,
                            multiple,
                        },
                    )
                } else {
                    amq_protocol::protocol::basic::AMQPMethod::Nack(
                        amq_protocol::protocol::basic::Nack {
                            delivery_tag: last,
                            multiple: false,
                            requeue: false,
                        },
                    )
                };
                self.send(s.channel, AMQPClass::Basic(m));
            }
            i = j;
        }
    }

    fn teardown_channels(&mut self) {
        let ids: Vec<u16> = self.channels.keys().copied().collect();
        for id in ids {
            self.release_channel(id);
        }
        self.channels.clear();
    }

    /// Releases everything the connection holds in the core: requeues unacked and
    /// queued deliveries, cancels consumers, deletes exclusive queues. Idempotent; the
    /// driver calls it when the connection ends for any reason.
    pub fn teardown(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        self.teardown_channels();
        for ev in self.outbox.close() {
            if let OutEvent::Deliver(d) = ev {
                if d.needs_ack {
                    d.queue.requeue_unsent(&[d.offset]);
                }
            }
        }
        // last: the exclusive queues and the connection slot go with the link
        self.login = Login::None;
        self.state = State::Closed;
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.teardown();
    }
}

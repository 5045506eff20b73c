//! The connection driver: one task per client. It reads and decodes packets, turns them
//! into core calls through the [`Session`] state, drains the core's [`Outbox`] into
//! PUBLISH packets, and writes each batch with one `write_all`.
//!
//! Acks that promise durability (PUBACK, PUBREC for a persistent message; SUBACK and
//! UNSUBACK of a persistent session) wait for the store's [`Durability`]; every response
//! goes through one ordered queue, so they leave in the order the requests came
//! [MQTT-4.6.0-2].
//!
//! Publisher flow control: a publish that went to a queue whose consumers fall behind
//! comes back from the core with a [`Backpressure`]; its PUBACK / PUBREC (or, at QoS 0,
//! a hold) waits in the same ordered queue until the backlog drains or
//! [`triad_core::replies::FLOW_MAX_WAIT`] passes. The socket is still read meanwhile (acks of this client's
//! own deliveries must get through, or two clients feeding each other would deadlock)
//! until [`MAX_PENDING`] responses wait; a client's in-flight window stops it sooner.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use triad_core::queue::Queue;
use triad_core::{
    Backpressure, ConnectionId, ConsumeRequest, ConsumerHandle, CoreError, Credentials, Delivery,
    Durability, FieldTable, FieldValue, Link, LoginRefused, OutEvent, Outbox, Peer, Properties,
    Protocol, QueueDeclare, ReplyQueue,
};

use crate::codec::{self, Connect, Limits, Packet, SubAck, Will};
use crate::retained::RetainedFeed;
use crate::session::{PubRec, Session};
use crate::state::{shared_queue_name, LiveClient, MqttState, VhostState};
use crate::topic::{
    filter_matches, is_shared, parse_shared, routing_key_to_topic, topic_to_routing_key,
    valid_filter, SharedFilter,
};
use crate::{MqttContext, MqttError};
use triad_core::io::read_some;

/// Header carrying the MQTT QoS of a message through the core (RabbitMQ's name).
pub(crate) const QOS_HEADER: &str = "x-mqtt-publish-qos";

type Target = (Arc<Queue>, u64);

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

/// CONNACK return codes.
const ACCEPTED: u8 = 0;
const BAD_PROTOCOL: u8 = 1;
const BAD_CLIENT_ID: u8 = 2;
const UNAVAILABLE: u8 = 3;
const BAD_LOGIN: u8 = 4;
const NOT_AUTHORIZED: u8 = 5;

/// How a connected session ended.
enum End {
    Disconnect,
    PeerClosed,
    Takeover,
    Shutdown,
    Error(MqttError),
}

/// Serves one MQTT connection until it closes. Errors are what the peer did wrong or
/// I/O failures; log them at `debug`. The client id, user and vhost are recorded as
/// `client`, `user` and `vhost` in the current span (the listener's `conn` span): a
/// span of its own cost each idle connection a second registry slot.
// Not an `async fn` on purpose (see the comment inside).
#[allow(clippy::manual_async_fn)]
pub fn serve<S>(
    mut stream: S,
    peer: SocketAddr,
    ctx: MqttContext,
) -> impl std::future::Future<Output = Result<(), MqttError>> + Send
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    // The login settings go with the CONNECT phase (boxed, freed once it is done): the
    // connection keeps only what it needs afterwards, for as long as it lives.
    let MqttContext {
        broker,
        state,
        anonymous_user,
        limits,
        shutdown,
        login,
    } = ctx;
    let ctx = Ctx {
        broker,
        state,
        limits,
        shutdown,
    };
    let hello = Box::new(Hello {
        anonymous_user,
        login,
    });
    // An async block using its captures in place: an async fn would keep its arguments
    // twice (as captured and as locals) for as long as the connection lives.
    async move { run(&mut stream, peer, &ctx, hello).await }
}

/// What a connection keeps of its [`MqttContext`] for as long as it lives.
struct Ctx {
    broker: Arc<triad_core::Broker>,
    state: Arc<MqttState>,
    limits: crate::MqttLimits,
    shutdown: CancellationToken,
}

/// What only the CONNECT phase needs of the [`MqttContext`].
struct Hello {
    anonymous_user: Option<String>,
    login: crate::MqttLogin,
}

async fn write_now<S: AsyncWrite + Unpin>(stream: &mut S, p: &Packet) -> Result<(), MqttError> {
    let mut b = BytesMut::new();
    codec::encode(p, &mut b);
    stream.write_all(&b).await?;
    stream.flush().await?;
    Ok(())
}

async fn refuse<S: AsyncWrite + Unpin>(stream: &mut S, code: u8) -> Result<(), MqttError> {
    write_now(
        stream,
        &Packet::ConnAck {
            session_present: false,
            code,
        },
    )
    .await
}

/// Reads the first packet, which must be CONNECT; `Ok(None)` when the peer left.
async fn read_connect<S: AsyncRead + Unpin>(
    stream: &mut S,
    rbuf: &mut BytesMut,
    limits: &Limits,
) -> Result<Option<Connect>, MqttError> {
    loop {
        match codec::decode(rbuf, limits)? {
            Some(Packet::Connect(c)) => return Ok(Some(c)),
            Some(_) => return Err(MqttError::Protocol("first packet is not CONNECT")),
            None => {}
        }
        if read_some(stream, rbuf, 4096).await? == 0 {
            return Ok(None);
        }
    }
}

/// Unregisters the client id and signals a waiting takeover, however the task ends.
struct Registration {
    state: Arc<MqttState>,
    vhost: String,
    client: String,
    conn: ConnectionId,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.state.unregister(&self.vhost, &self.client, self.conn);
        self.state.finish(self.conn);
    }
}

/// What a connection keeps once its CONNECT is accepted.
struct Connected {
    c: Conn,
    outbox: Arc<Outbox>,
    keep_alive: u16,
    will: Option<Will>,
    kick: CancellationToken,
    vhost_name: String,
    /// Dropped last: unregisters the client id.
    _registration: Registration,
}

async fn run<S>(
    stream: &mut S,
    peer: SocketAddr,
    ctx: &Ctx,
    hello: Box<Hello>,
) -> Result<(), MqttError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let mut rbuf = BytesMut::new();
    // Boxed: the CONNECT phase's state (the packet, login, takeover wait, refusals) is
    // larger than what a connected client keeps, and the task would be sized for it.
    let Some(mut k) = Box::pin(accept(stream, &mut rbuf, peer, ctx, hello)).await? else {
        return Ok(());
    };
    // `k` is used in place (moving its fields out would keep them twice in this future)
    let end =
        k.c.run(
            stream,
            &mut rbuf,
            &k.outbox,
            k.keep_alive,
            &k.kick,
            &ctx.shutdown,
            ctx.broker.alarms(),
        )
        .await;

    // give back what the client did not ack: it comes back redelivered (DUP)
    if let Some(consumer) = &k.c.consumer {
        consumer.cancel();
    }
    for (_, consumer) in &k.c.shared {
        consumer.cancel();
    }
    for ev in k.outbox.close() {
        if let OutEvent::Deliver(d) = ev {
            d.queue.requeue_unsent(&[d.offset]);
        }
    }
    let c = &mut k.c;
    // a clean session's shared subscriptions end with it (after its consumers stopped,
    // so the last member's delete cancels nobody)
    if c.clean {
        for (tag, _) in std::mem::take(&mut c.shared) {
            c.leave_shared(&tag);
        }
    }
    let (targets, carry) = std::mem::take(&mut c.session).finish();
    // unacked messages of a shared subscription go back to its queue: another member
    // of the group gets them
    for (q, off) in targets {
        q.nack(&[off], true);
    }
    if !c.clean {
        ctx.state.put_carry(&k.vhost_name, &c.client_id, carry);
        // before the registration is dropped, so a takeover's connect comes after it
        ctx.state.session_disconnected(&c.vs, &c.client_id);
    }
    ctx.state.stats.connected.fetch_sub(1, Ordering::Relaxed);
    // the will goes out unless the client said DISCONNECT [MQTT-3.1.2-8], [MQTT-3.1.2-10]
    let abnormal = matches!(end, End::PeerClosed | End::Takeover | End::Error(_));
    if let (true, Some(w)) = (abnormal, k.will.take()) {
        tracing::debug!(topic = w.topic, "publishing the will");
        if let Err(e) = c.publish_in(&w.topic, w.payload, w.qos, w.retain) {
            tracing::debug!(error = %e, "will not published");
        }
    }
    match end {
        End::Error(e) => {
            tracing::debug!(error = %e, "MQTT connection closed");
            Err(e)
        }
        _ => Ok(()),
    }
}

/// The CONNECT phase: reads CONNECT, logs in, registers the client id (taking over a
/// connected session), opens the session and its queue, consumes from it, and encodes
/// CONNACK. `None`: refused (the refusal is sent) or the peer left.
async fn accept<S>(
    stream: &mut S,
    rbuf: &mut BytesMut,
    peer: SocketAddr,
    ctx: &Ctx,
    hello: Box<Hello>,
) -> Result<Option<Connected>, MqttError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let pre = Limits {
        max_packet_size: ctx.limits.max_packet_size_pre_connect,
        max_filters: ctx.limits.max_filters,
    };
    let first = tokio::select! {
        _ = ctx.shutdown.cancelled() => return Ok(None),
        r = tokio::time::timeout(ctx.limits.connect_timeout, read_connect(stream, rbuf, &pre)) => r,
    };
    let connect = match first {
        Err(_) => return Err(MqttError::Timeout("no CONNECT")),
        Ok(Ok(Some(c))) => c,
        Ok(Ok(None)) => return Ok(None),
        Ok(Err(MqttError::Decode(codec::DecodeError::UnacceptableProtocol { name, level }))) => {
            tracing::debug!(name, level, "unacceptable protocol");
            refuse(stream, BAD_PROTOCOL).await?;
            return Ok(None);
        }
        Ok(Err(e)) => return Err(e),
    };

    // authentication and the vhost: `vhost:user`, the port's, or the default one
    let broker = ctx.broker.clone();
    let (vhost, user) = hello
        .login
        .vhost_and_user(connect.username.as_deref(), broker.default_vhost());
    let vhost_name = vhost.to_string();
    let user = user.map(str::to_string);
    let conn = broker.next_connection_id();
    let mut link = match login(
        ctx,
        &hello,
        peer,
        conn,
        &connect,
        user.as_deref(),
        &vhost_name,
    ) {
        Ok(l) => l,
        Err((code, why)) => {
            let user = user.as_deref().unwrap_or("");
            tracing::info!(%peer, user, vhost = %vhost_name, code, reason = %why.reason, "MQTT login refused");
            // Slows password guessing down: one refusal per delay per source address
            // and per user name, however many connections ask at once.
            let hold = why.hold;
            if !hold.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(hold) => {}
                    _ = ctx.shutdown.cancelled() => {}
                }
            }
            refuse(stream, code).await?;
            return Ok(None);
        }
    };
    let span = tracing::Span::current();
    span.record("user", link.user());
    span.record("vhost", vhost_name.as_str());

    // client id [MQTT-3.1.3-6], [MQTT-3.1.3-8]
    let mut client_id = connect.client_id.clone();
    if client_id.is_empty() {
        if !connect.clean_session {
            refuse(stream, BAD_CLIENT_ID).await?;
            return Ok(None);
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        client_id = format!("triad-{conn:x}-{nanos:x}");
    }
    if client_id.len() > ctx.limits.max_client_id_len {
        refuse(stream, BAD_CLIENT_ID).await?;
        return Ok(None);
    }
    tracing::Span::current().record("client", client_id.as_str());
    triad_core::conns::note_client(&client_id);
    // topic permissions with `{client_id}` apply from here on
    link.set_client_id(&client_id);

    let vs = match ctx.state.vhost_state(&vhost_name) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(error = %e, "MQTT state unavailable");
            refuse(stream, UNAVAILABLE).await?;
            return Ok(None);
        }
    };

    // A session belongs to the user who created it: another user's CONNECT with its
    // client id, persistent or clean, neither resumes, discards nor takes it over.
    let owner: Arc<str> = Arc::from(link.user());
    if !vs.sessions.may_use(&client_id, link.user()) {
        tracing::info!(%peer, user = %link.user(), "MQTT session of another user refused");
        refuse(stream, NOT_AUTHORIZED).await?;
        return Ok(None);
    }

    // takeover [MQTT-3.1.4-2]
    let kick = CancellationToken::new();
    let registered = ctx.state.register(
        &vhost_name,
        &client_id,
        LiveClient {
            conn,
            user: Some(owner),
            kick: kick.clone(),
        },
    );
    let Ok(prev) = registered else {
        tracing::info!(%peer, user = %link.user(), "MQTT client id connected as another user");
        refuse(stream, NOT_AUTHORIZED).await?;
        return Ok(None);
    };
    let _registration = Registration {
        state: ctx.state.clone(),
        vhost: vhost_name.clone(),
        client: client_id.clone(),
        conn,
    };
    if let Some(p) = prev {
        tracing::debug!("taking over a connected session");
        p.kick.cancel();
        if tokio::time::timeout(Duration::from_secs(5), ctx.state.finished(p.conn))
            .await
            .is_err()
        {
            tracing::warn!("the session taken over did not close in time");
        }
    }

    let qname = format!("mqtt-subscription-{client_id}");
    let setup = open_session(
        &ctx.state,
        &vs,
        &vhost_name,
        &client_id,
        &qname,
        &connect,
        link.user(),
        conn,
    );
    let (session_present, session) = match setup {
        Ok((present, session, durables)) => {
            let mut stored = Ok(());
            for d in durables {
                stored = stored.and(d.await);
            }
            match stored {
                Ok(()) => (present, session),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot store the MQTT session");
                    refuse(stream, UNAVAILABLE).await?;
                    return Ok(None);
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot open the MQTT session");
            refuse(stream, UNAVAILABLE).await?;
            return Ok(None);
        }
    };

    // Every outbound packet identifier, whoever takes it, counts against this window;
    // 0 would be the core's "no limit", and there are only 65,535 identifiers.
    let window = ctx.limits.max_inflight.clamp(1, u32::from(u16::MAX));
    let mut c = Conn {
        link,
        state: ctx.state.clone(),
        vs: vs.clone(),
        client_id: client_id.clone(),
        qname,
        clean: connect.clean_session,
        session,
        topic_cache: None,
        pending: ReplyQueue::default(),
        outbox: Outbox::new((ctx.limits.max_inflight as usize).max(64)),
        consumer: None,
        prefetch: window,
        retained: RetainedFeed::default(),
        wbuf: BytesMut::with_capacity(4096),
        limits: Limits {
            max_packet_size: ctx.limits.max_packet_size,
            max_filters: ctx.limits.max_filters,
        },
        max_subscriptions: ctx.limits.max_subscriptions,
        stream_max_age: ctx.limits.stream_max_age,
        stream_max_bytes: ctx.limits.stream_max_bytes,
        index_topics: ctx.limits.index_topics,
        shared: Vec::new(),
        streams: Vec::new(),
    };
    // [MQTT-3.2.2-1]..[MQTT-3.2.2-3]
    codec::encode(
        &Packet::ConnAck {
            session_present,
            code: ACCEPTED,
        },
        &mut c.wbuf,
    );
    let resend: Vec<u16> = c.session.pending_pubrel().collect();
    for id in resend {
        codec::encode(&Packet::PubRel(id), &mut c.wbuf);
    }
    // A clean session's queue waits for the first SUBSCRIBE: a client that only
    // publishes (or has not subscribed yet) costs no queue, no consumer, no store entry.
    if !c.clean {
        if let Err(e) = c.revoke_unpermitted() {
            tracing::warn!(error = %e, "cannot check the MQTT session's subscriptions");
            refuse(stream, UNAVAILABLE).await?;
            return Ok(None);
        }
        if let Err(e) = c.subscription_queue(false) {
            tracing::warn!(error = %e, "cannot consume the MQTT subscription queue");
            refuse(stream, UNAVAILABLE).await?;
            return Ok(None);
        }
        // the session's shared subscriptions: consume their groups' queues again
        let shared: Vec<String> = c
            .session
            .subs
            .keys()
            .filter(|f| is_shared(f))
            .cloned()
            .collect();
        for f in shared {
            let joined = match parse_shared(&f) {
                Some(Ok(sh)) => c.join_shared(&f, sh).map(drop),
                _ => Err(CoreError::Internal(format!(
                    "stored shared filter '{f}' is invalid"
                ))),
            };
            if let Err(e) = joined {
                tracing::warn!(filter = %f, error = %e, "cannot restore a shared subscription");
                refuse(stream, UNAVAILABLE).await?;
                return Ok(None);
            }
        }
        c.restore_streams();
    }
    let outbox = c.outbox.clone();
    ctx.state.stats.connected.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(
        clean = connect.clean_session,
        session_present,
        "MQTT client connected"
    );
    Ok(Some(Connected {
        c,
        outbox,
        keep_alive: connect.keep_alive,
        will: connect.will,
        kick,
        vhost_name,
        _registration,
    }))
}

/// Logs a CONNECT in to `vhost`: user name (without the vhost part) and password; no user name: the certificate's CN
/// (with `ssl_cert_login`) or, from loopback peers, the default user. Then the vhost's
/// permissions and the user's connection limit. Refusals carry their CONNACK code:
/// with a user name and password, always 4 (bad user name or password): a refusal
/// made only once the password was accepted (a loopback-only user, no permissions on
/// the vhost, over the connection limit) must not tell that the password is right.
/// Without a password, 5 (not authorised).
#[allow(clippy::too_many_arguments)]
fn login(
    ctx: &Ctx,
    hello: &Hello,
    peer: SocketAddr,
    conn: ConnectionId,
    connect: &Connect,
    username: Option<&str>,
    vhost: &str,
) -> Result<Link, (u8, LoginRefused)> {
    let refusal = if username.is_some() {
        BAD_LOGIN
    } else {
        NOT_AUTHORIZED
    };
    let cert_cn = hello
        .login
        .peer_cert_cn
        .as_deref()
        .filter(|_| hello.login.ssl_cert_login);
    let pass = connect
        .password
        .as_ref()
        .map(|p| String::from_utf8_lossy(p))
        .unwrap_or_default();
    let credentials = match (username, cert_cn) {
        (Some(user), _) => Credentials::Password {
            user,
            password: &pass,
        },
        (None, Some(cn)) => Credentials::Certificate { user: cn },
        (None, None) => Credentials::Anonymous {
            user: hello.anonymous_user.as_deref(),
        },
    };
    let peer = Peer {
        addr: peer.ip(),
        conn,
        failed_login_delay: hello.login.failed_login_delay,
    };
    ctx.broker
        .login(credentials, peer, vhost, Protocol::Mqtt)
        .map_err(|e| (refusal, e))
}

/// Declares the session's queue (a persistent one owned by `user`); returns (session
/// present, session state, what CONNACK waits for).
#[allow(clippy::too_many_arguments)]
fn open_session(
    state: &MqttState,
    vs: &VhostState,
    vhost_name: &str,
    client_id: &str,
    qname: &str,
    connect: &Connect,
    user: &str,
    conn: ConnectionId,
) -> Result<(bool, Session<Target>, Vec<Durability>), MqttError> {
    let vhost = &vs.vhost;
    let existing = vhost.queue(qname);
    if connect.clean_session {
        // discard any previous session [MQTT-3.1.2-6]
        if existing.is_some() {
            vhost.delete_queue(qname, false, false, conn)?;
        }
        state.leave_all_shared(vs, client_id);
        vs.sessions.remove(client_id);
        state.take_carry(vhost_name, client_id);
        // the queue is declared by the first SUBSCRIBE (`Conn::subscription_queue`)
        Ok((false, Session::default(), Vec::new()))
    } else {
        if existing.as_ref().is_some_and(|q| !q.durable()) {
            vhost.delete_queue(qname, false, false, conn)?;
        }
        let stored = vs.sessions.get(client_id);
        let present = existing.is_some_and(|q| q.durable()) || stored.is_some();
        // CONNACK waits for the session queue's record (the task awaits, the worker
        // thread does not block), so concurrent connects share one journal flush
        let (_, durable) = vhost.declare_queue_deferred(QueueDeclare {
            name: qname.to_string(),
            durable: true,
            conn,
            ..Default::default()
        })?;
        let claimed = vs.sessions.claim(client_id, user)?;
        let carry = state.take_carry(vhost_name, client_id);
        state.session_connected(vs, client_id);
        Ok((
            present,
            Session::resume(stored.unwrap_or_default(), carry),
            std::iter::once(durable).chain(claimed).collect(),
        ))
    }
}

/// A routing key, its MQTT topic and the QoS granted for it (`None`: no filter matches).
type TopicCache = (Arc<str>, String, Option<u8>);

/// A response waiting in the connection's [`ReplyQueue`] for the store or for
/// publisher flow control.
struct Reply {
    packets: Vec<Packet>,
    /// Filters (with their granted QoS) whose retained messages follow the packets.
    retained: Vec<(String, u8)>,
}

struct Conn {
    /// The user, vhost, permissions and connection slot; dropped (the connection torn
    /// down in the core) with the connection, after its deliveries were given back.
    link: Link,
    state: Arc<MqttState>,
    vs: Arc<VhostState>,
    client_id: String,
    qname: String,
    clean: bool,
    session: Session<Target>,
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

impl Conn {
    #[allow(clippy::too_many_arguments)]
    async fn run<S>(
        &mut self,
        stream: &mut S,
        rbuf: &mut BytesMut,
        outbox: &Outbox,
        keep_alive: u16,
        kick: &CancellationToken,
        shutdown: &CancellationToken,
        mut alarms: tokio::sync::watch::Receiver<triad_core::Alarms>,
    ) -> End
    where
        S: AsyncRead + AsyncWrite + Unpin + Send,
    {
        let mut blocked = alarms.borrow_and_update().any();
        let mut published = false;
        // [MQTT-3.1.2-24]: one and a half times the keep alive
        let ka = (keep_alive > 0).then(|| Duration::from_millis(u64::from(keep_alive) * 1500));
        let far = Duration::from_secs(365 * 24 * 3600);
        let sleep = tokio::time::sleep(ka.unwrap_or(far));
        tokio::pin!(sleep);
        let mut evs = Vec::new();
        'outer: loop {
            loop {
                match codec::decode(rbuf, &self.limits) {
                    Ok(Some(p)) => {
                        if let Some(ka) = ka {
                            sleep.as_mut().reset(tokio::time::Instant::now() + ka);
                        }
                        published |= matches!(p, Packet::Publish(_));
                        match self.handle(p) {
                            Ok(false) => {}
                            Ok(true) => break 'outer End::Disconnect,
                            Err(e) => break 'outer End::Error(e),
                        }
                    }
                    Ok(None) => break,
                    Err(e) => break 'outer End::Error(e.into()),
                }
            }
            if let Err(e) = self.flush_pending() {
                break 'outer End::Error(e);
            }
            self.feed_retained();
            // Each delivery takes at most one packet identifier: take no more than the
            // window has room for. The rest wait in the outbox (bounded; the core's
            // prefetch is the same window) until an ack frees room.
            let room = self.window_room();
            if room > 0 {
                outbox.drain(&mut evs, room);
                if !evs.is_empty() {
                    if let Err(e) = self.deliver(&mut evs) {
                        break End::Error(e);
                    }
                }
            }
            if !self.wbuf.is_empty() {
                let r = tokio::select! {
                    r = stream.write_all(&self.wbuf) => r,
                    _ = kick.cancelled() => break End::Takeover,
                    _ = shutdown.cancelled() => break End::Shutdown,
                };
                if let Err(e) = r {
                    break End::Error(e.into());
                }
                self.wbuf.clear();
            }
            // Going idle (or after a burst that grew it past 1 MiB), the buffer is let go:
            // an idle connection holds no write buffer (its 4 KiB were a quarter of an idle
            // connection's memory), and `out` takes one again for the next write.
            if (self.pending.is_empty() && outbox.is_empty()) || self.wbuf.capacity() > 1 << 20 {
                self.wbuf = BytesMut::new();
            }
            // Go round again only while there is something that can go out now; otherwise
            // wait below for the socket, an ack or a new delivery (never spin).
            let room = self.window_room() > 0;
            if (room && !outbox.is_empty()) || self.retained.ready(room) {
                continue;
            }
            if evs.capacity() > 0 {
                evs = Vec::new();
            }
            // While a resource alarm is raised, a client that publishes is not read from
            // (subscribers keep draining); its keep-alive clock stops meanwhile.
            let alarm_blocked = blocked && published;
            if alarm_blocked {
                if let Some(ka) = ka {
                    sleep.as_mut().reset(tokio::time::Instant::now() + ka);
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => break End::Shutdown,
                _ = kick.cancelled() => break End::Takeover,
                r = alarms.changed() => {
                    if r.is_ok() {
                        blocked = alarms.borrow_and_update().any();
                    }
                }
                // stop reading while too many acks wait for the disk (back-pressure)
                r = read_some(stream, rbuf, 4096), if self.pending.len() < MAX_PENDING && !alarm_blocked => match r {
                    Ok(0) => break End::PeerClosed,
                    Ok(_) => {}
                    Err(e) => break End::Error(e.into()),
                },
                _ = outbox.notified(), if self.window_room() > 0 => {}
                done = self.pending.ready(), if !self.pending.is_empty() => {
                    if let Err(e) = self.write_replies(done) {
                        break End::Error(e);
                    }
                }
                _ = &mut sleep, if ka.is_some() && !alarm_blocked => break End::Error(MqttError::Timeout("keep alive")),
            }
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
        (self.prefetch as usize).saturating_sub(self.session.inflight())
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
                let Some(id) = self.session.alloc_id() else {
                    return;
                };
                self.session.sent(id, r.qos, None);
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

    /// Encodes the responses whose messages are now on disk (and not held by flow
    /// control), in order.
    fn flush_pending(&mut self) -> Result<(), MqttError> {
        let mut ready = Vec::new();
        self.pending.take_ready(&mut ready, None);
        self.write_replies(ready)
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
                if p.qos == 2 && !self.session.inbound_qos2(p.pkid) {
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
                if let Some(Some((q, off))) = self.session.on_puback(id) {
                    q.ack(&[off]);
                }
            }
            Packet::PubRec(id) => match self.session.on_pubrec(id) {
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
                self.session.on_pubrel(id);
                self.respond(vec![Packet::PubComp(id)], Vec::new());
            }
            Packet::PubComp(id) => {
                self.session.on_pubcomp(id);
            }
            Packet::Subscribe(s) => {
                self.topic_cache = None;
                self.subscribe(s)?
            }
            Packet::Unsubscribe(u) => {
                self.topic_cache = None;
                for f in &u.filters {
                    self.retained.remove(f);
                    if crate::stream::is_stream(f) {
                        self.unsubscribe_stream(f);
                        continue;
                    }
                    if is_shared(f) {
                        if self.session.subs.remove(f).is_some() {
                            if let Some(i) = self.shared.iter().position(|(t, _)| **t == **f) {
                                let (_, consumer) = self.shared.swap_remove(i);
                                consumer.cancel();
                            }
                            self.leave_shared(f);
                        }
                        continue;
                    }
                    if self.session.subs.remove(f).is_some() {
                        let key = topic_to_routing_key(f);
                        // another filter may map to the same binding key
                        let shared = self
                            .session
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

    /// Drops the restored subscriptions the user may no longer make (permissions are
    /// checked as for a SUBSCRIBE), with their bindings; what was queued for them is
    /// not delivered (no filter matches it any more).
    fn revoke_unpermitted(&mut self) -> Result<(), MqttError> {
        let refused: Vec<String> = self
            .session
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
            self.session.subs.remove(f);
        }
        for f in &refused {
            if is_shared(f) {
                // not consumed yet (restored after this check): only the membership
                self.leave_shared(f);
                continue;
            }
            let key = topic_to_routing_key(f);
            if !self
                .session
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
    fn check_subscribe(&self, key: &str) -> Result<(), CoreError> {
        self.check_subscribe_to(&self.qname, key)
    }

    /// [`Conn::check_subscribe`] for the queue `qname` (a shared subscription's).
    fn check_subscribe_to(&self, qname: &str, key: &str) -> Result<(), CoreError> {
        let access = self.link.access();
        access
            .queue_declare(qname, &FieldTable::default())
            .and_then(|()| access.consume(qname))
            .and_then(|()| access.queue_bind_key(self.link.vhost(), qname, "amq.topic", key))
    }

    /// The permission check for a stored filter, plain or shared.
    fn check_filter(&self, f: &str) -> Result<(), CoreError> {
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
    fn join_shared(&mut self, full: &str, sh: SharedFilter<'_>) -> Result<Durability, CoreError> {
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
    fn leave_shared(&self, full: &str) {
        if let Some(Ok(sh)) = parse_shared(full) {
            self.state
                .leave_shared(self.link.vhost(), &shared_queue_name(sh), &self.client_id);
        }
    }

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
                &self.session.subs,
                self.streams
                    .iter()
                    .map(|s| (s.tag.to_string(), s.qos))
                    .collect(),
            )?
            .into_iter()
            .collect())
    }

    /// Consumes the subscription queue if not yet done, declaring it first when `declare`
    /// (a clean session's queue, exclusive to this connection).
    fn subscription_queue(&mut self, declare: bool) -> Result<(), CoreError> {
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
    fn subscribe_stream(
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
        if self.session.subs.len() + self.streams.len() >= self.max_subscriptions {
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
    fn join_stream(
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
    fn unsubscribe_stream(&mut self, f: &str) {
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
    fn restore_streams(&mut self) {
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
    fn stream_granted(&self, tag: &str, topic: &str) -> Option<u8> {
        self.streams
            .iter()
            .find(|s| *s.tag == *tag)
            .filter(|s| filter_matches(s.filter(), topic))
            .map(|s| s.qos)
    }

    /// One `$share/...` filter of a SUBSCRIBE: the return code (0x80 for an invalid
    /// shared filter, one past the limit, or one refused).
    fn subscribe_shared(
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
        if let Some(q) = self.session.subs.get_mut(full) {
            // already a member: the new QoS applies from now on
            *q = qos;
            return qos;
        }
        if self.session.subs.len() >= self.max_subscriptions {
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
                self.session.subs.insert(full.to_string(), qos);
                qos
            }
            Err(e) => {
                tracing::debug!(filter = full, error = %e, "shared subscription refused");
                0x80
            }
        }
    }

    fn subscribe(&mut self, s: codec::Subscribe) -> Result<(), MqttError> {
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
                            self.session.subs.insert(filter, qos);
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
            if !valid_filter(&filter) || filter.len() > MAX_TOPIC_LEN {
                seen.insert(filter, None);
                codes.push(0x80);
                continue;
            }
            if !self.session.subs.contains_key(&filter)
                && self.session.subs.len() >= self.max_subscriptions
            {
                tracing::info!(
                    client_id = %self.client_id,
                    filter,
                    max = self.max_subscriptions,
                    "subscription refused: the session holds mqtt.max_subscriptions already"
                );
                seen.insert(filter, None);
                codes.push(0x80);
                continue;
            }
            let key = topic_to_routing_key(&filter);
            let allowed = self.check_subscribe(&key);
            if let Err(e) = allowed.and_then(|()| self.subscription_queue(self.clean)) {
                tracing::debug!(filter, error = %e, "subscription refused");
                seen.insert(filter, None);
                codes.push(0x80);
                continue;
            }
            match self.link.bind_queue_deferred(
                &self.qname,
                "amq.topic",
                &key,
                &FieldTable::default(),
            ) {
                // the journal is ordered: the last binding's record covers the others
                Ok(durable) => bound = Some(durable),
                Err(e) => {
                    tracing::debug!(filter, error = %e, "subscription refused");
                    seen.insert(filter, None);
                    codes.push(0x80);
                    continue;
                }
            }
            let qos = requested.min(2);
            self.session.subs.insert(filter.clone(), qos);
            codes.push(qos);
            seen.insert(filter.clone(), Some(granted.len()));
            granted.push((filter, qos));
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

    /// Turns deliveries from the subscription queue (and shared subscriptions' queues)
    /// into PUBLISH packets.
    fn deliver(&mut self, evs: &mut Vec<OutEvent>) -> Result<(), MqttError> {
        let mut acks = Acks::default();
        let mut result = Ok(());
        for ev in evs.drain(..) {
            let d = match ev {
                OutEvent::Deliver(d) => d,
                // direct reply-to consumers are AMQP's only
                OutEvent::Reply(_) => continue,
                OutEvent::Cancelled { tag } => {
                    if let Some(i) = self.shared.iter().position(|(t, _)| *t == tag) {
                        // a shared subscription's queue was deleted (by an operator):
                        // that subscription ends, the connection goes on
                        tracing::info!(filter = %tag, "shared subscription queue deleted");
                        self.shared.swap_remove(i);
                        self.streams.retain(|s| s.tag != tag);
                        self.session.subs.remove(&*tag);
                        self.leave_shared(&tag);
                        continue;
                    }
                    result = Err(MqttError::Protocol("subscription queue deleted"));
                    continue;
                }
            };
            if d.queue.name() != self.qname {
                // from a shared subscription's queue: the QoS its filter was granted,
                // if the MQTT rules match it (see `topic`'s doc on `*` and `$`)
                let topic = routing_key_to_topic(&d.routing_key);
                let granted = if crate::stream::is_stream(&d.tag) {
                    self.stream_granted(&d.tag, &topic)
                } else {
                    self.session.subs.get(&*d.tag).copied().filter(|_| {
                        parse_shared(&d.tag)
                            .and_then(Result::ok)
                            .is_some_and(|sh| filter_matches(sh.filter, &topic))
                    })
                };
                self.deliver_one(d, &topic, granted, &mut acks);
                continue;
            }
            let cached = self
                .topic_cache
                .as_deref()
                .is_some_and(|(rk, _, _)| **rk == *d.routing_key);
            if !cached {
                let topic = routing_key_to_topic(&d.routing_key);
                let granted = self.session.granted_for(&topic);
                self.topic_cache = Some(Box::new((d.routing_key.clone(), topic, granted)));
            }
            let cache = self.topic_cache.take();
            if let Some((_, topic, granted)) = cache.as_deref() {
                self.deliver_one(d, topic, *granted, &mut acks);
            }
            self.topic_cache = cache;
        }
        acks.flush();
        result
    }

    /// Encodes one delivery as a PUBLISH on `topic` with QoS at most `granted` (`None`:
    /// no filter matches it under the MQTT rules: acked, not sent).
    fn deliver_one(&mut self, d: Delivery, topic: &str, granted: Option<u8>, acks: &mut Acks) {
        let Some(granted) = granted else {
            // routed by the topic exchange but not matched by MQTT rules
            if d.needs_ack {
                acks.push(&d.queue, d.offset);
            }
            return;
        };
        let msg_qos = d
            .properties
            .headers
            .as_ref()
            .and_then(|h| h.get_i64(QOS_HEADER))
            .map(|q| q.clamp(0, 2) as u8)
            .unwrap_or(if d.properties.is_persistent() { 1 } else { 0 });
        let qos = msg_qos.min(granted);
        let pkid = if qos == 0 {
            if d.needs_ack {
                acks.push(&d.queue, d.offset);
            }
            0
        } else {
            match self.session.alloc_id() {
                Some(id) => {
                    // a transient message was acked on delivery: nothing to ack
                    let target = d.needs_ack.then(|| (d.queue.clone(), d.offset));
                    self.session.sent(id, qos, target);
                    id
                }
                None => {
                    if d.needs_ack {
                        d.queue.requeue_unsent(&[d.offset]);
                    }
                    return;
                }
            }
        };
        codec::encode_publish(
            qos > 0 && d.redelivered,
            qos,
            false,
            topic,
            pkid,
            &d.body,
            out(&mut self.wbuf),
        );
        self.state.stats.sent.fetch_add(1, Ordering::Relaxed);
    }
}

/// Acks collected while delivering a batch: one `ack` call per run of deliveries from
/// the same queue.
#[derive(Default)]
struct Acks {
    queue: Option<Arc<Queue>>,
    offsets: Vec<u64>,
}

impl Acks {
    fn push(&mut self, q: &Arc<Queue>, offset: u64) {
        if !self.queue.as_ref().is_some_and(|cur| Arc::ptr_eq(cur, q)) {
            self.flush();
            self.queue = Some(q.clone());
        }
        self.offsets.push(offset);
    }

    fn flush(&mut self) {
        if let Some(q) = self.queue.take() {
            q.ack(&self.offsets);
        }
        self.offsets.clear();
    }
}

//! The CONNECT phase of an MQTT connection: the first packet under its deadline, login
//! (with the failed-login delay), the client id, its registration (taking over a
//! connected session), and the session opened (its queue, stored state, CONNACK).
//! From then on the [`Session`] runs under the core's driver (`connection.rs`).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use triad_core::io::read_some;
use triad_core::{
    ConnectionId, Credentials, Durability, Link, LoginRefused, Peer, Protocol, QueueDeclare,
};

use crate::codec::{self, Connect, Limits, Packet, Will};
use crate::session::{Packets, Session, SessionSetup, Target};
use crate::state::{ClientKey, LiveClient, MqttState, VhostState};
use crate::MqttError;

/// CONNACK return codes.
pub(crate) const ACCEPTED: u8 = 0;
const BAD_PROTOCOL: u8 = 1;
const BAD_CLIENT_ID: u8 = 2;
const UNAVAILABLE: u8 = 3;
const BAD_LOGIN: u8 = 4;
const NOT_AUTHORIZED: u8 = 5;

/// What a connection keeps of its [`MqttContext`] for as long as it lives.
pub(crate) struct Ctx {
    pub(crate) broker: Arc<triad_core::Broker>,
    pub(crate) state: Arc<MqttState>,
    pub(crate) limits: crate::MqttLimits,
    pub(crate) shutdown: CancellationToken,
}

/// What only the CONNECT phase needs of the [`MqttContext`].
pub(crate) struct Hello {
    pub(crate) anonymous_user: Option<String>,
    pub(crate) login: crate::MqttLogin,
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
pub(crate) struct Registration {
    state: Arc<MqttState>,
    /// The vhost and client id (one allocation).
    key: ClientKey,
    conn: ConnectionId,
}

impl Registration {
    /// Whether another connection took the client id over (it waits for this one to
    /// finish): the connection's shutdown token was cancelled for that, not for the
    /// broker's shutdown or by the management API, and the will goes out.
    pub(crate) fn taken_over(&self) -> bool {
        self.state.being_taken_over(self.conn)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.state.unregister_key(&self.key, self.conn);
        self.state.finish(self.conn);
    }
}

/// What a connection keeps once its CONNECT is accepted.
pub(crate) struct Connected {
    pub(crate) session: Session,
    pub(crate) will: Option<Will>,
    /// Dropped last: unregisters the client id.
    pub(crate) registration: Registration,
}

/// The CONNECT phase: reads CONNECT, logs in, registers the client id (taking over a
/// connected session), opens the session and its queue, consumes from it, and encodes
/// CONNACK. `None`: refused (the refusal is sent) or the peer left.
pub(crate) async fn accept<S>(
    stream: &mut S,
    rbuf: &mut BytesMut,
    peer: SocketAddr,
    ctx: &Ctx,
    hello: Box<Hello>,
) -> Result<Option<Connected>, MqttError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let Some(connect) = first_packet(stream, rbuf, ctx).await? else {
        return Ok(None);
    };
    // authentication and the vhost: `vhost:user`, the port's, or the default one
    let (vhost, user) = hello
        .login
        .vhost_and_user(connect.username.as_deref(), ctx.broker.default_vhost());
    let vhost_name = vhost.to_string();
    let user = user.map(str::to_string);
    let conn = ctx.broker.next_connection_id();
    let login = login(
        ctx,
        &hello,
        peer,
        conn,
        &connect,
        user.as_deref(),
        &vhost_name,
    );
    drop(hello);
    let mut link = match login {
        Ok(l) => l,
        Err((code, why)) => {
            let user = user.as_deref().unwrap_or("");
            tracing::info!(%peer, user, vhost = %vhost_name, code, reason = %why.reason, "MQTT login refused");
            // Slows password guessing down: one refusal per delay per source address
            // and per user name, however many connections ask at once.
            if !why.hold.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(why.hold) => {}
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
    let client_id = match client_id(&connect, conn, ctx) {
        Ok(id) => id,
        Err(code) => {
            refuse(stream, code).await?;
            return Ok(None);
        }
    };
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
    let registration = match register(ctx, &vs, &vhost_name, &client_id, &link, peer).await {
        Ok(r) => r,
        Err(code) => {
            refuse(stream, code).await?;
            return Ok(None);
        }
    };
    let opened = open(ctx, vs, &vhost_name, client_id, &connect, link).await;
    let Some(session) = opened else {
        refuse(stream, UNAVAILABLE).await?;
        return Ok(None);
    };
    ctx.state.stats.connected.fetch_add(1, Ordering::Relaxed);
    Ok(Some(Connected {
        session,
        will: connect.will,
        registration,
    }))
}

/// Reads CONNECT within the connect timeout; `None`: the peer left, shutdown, or an
/// unacceptable protocol level (refused here).
async fn first_packet<S>(
    stream: &mut S,
    rbuf: &mut BytesMut,
    ctx: &Ctx,
) -> Result<Option<Connect>, MqttError>
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
    match first {
        Err(_) => Err(MqttError::Timeout("no CONNECT")),
        Ok(Ok(c)) => Ok(c),
        Ok(Err(MqttError::Decode(codec::DecodeError::UnacceptableProtocol { name, level }))) => {
            tracing::debug!(name, level, "unacceptable protocol");
            refuse(stream, BAD_PROTOCOL).await?;
            Ok(None)
        }
        Ok(Err(e)) => Err(e),
    }
}

/// The client id [MQTT-3.1.3-6], [MQTT-3.1.3-8]: the client's, or one made up for a
/// clean session that sent none. `Err`: the CONNACK code refusing it.
fn client_id(connect: &Connect, conn: ConnectionId, ctx: &Ctx) -> Result<String, u8> {
    let mut client_id = connect.client_id.clone();
    if client_id.is_empty() {
        if !connect.clean_session {
            return Err(BAD_CLIENT_ID);
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        client_id = format!("triad-{conn:x}-{nanos:x}");
    }
    if client_id.len() > ctx.limits.max_client_id_len {
        return Err(BAD_CLIENT_ID);
    }
    Ok(client_id)
}

/// Registers the client id for this connection, taking over a connected session
/// [MQTT-3.1.4-2] (waiting up to 5 s for it to close). A session belongs to the user
/// who created it: another user's CONNECT with its client id, persistent or clean,
/// neither resumes, discards nor takes it over. `Err`: the CONNACK code refusing it.
async fn register(
    ctx: &Ctx,
    vs: &VhostState,
    vhost_name: &str,
    client_id: &str,
    link: &Link,
    peer: SocketAddr,
) -> Result<Registration, u8> {
    let owner: Arc<str> = Arc::from(link.user());
    if !vs.sessions.may_use(client_id, link.user()) {
        tracing::info!(%peer, user = %link.user(), "MQTT session of another user refused");
        return Err(NOT_AUTHORIZED);
    }
    // the connection's own shutdown token: a takeover cancels it, and the connection
    // knows it was taken over from `MqttState::being_taken_over` (no second token)
    let conn = link.id();
    let live = LiveClient {
        conn,
        user: Some(owner),
        kick: ctx.shutdown.clone(),
    };
    let Ok(prev) = ctx.state.register(vhost_name, client_id, live) else {
        tracing::info!(%peer, user = %link.user(), "MQTT client id connected as another user");
        return Err(NOT_AUTHORIZED);
    };
    let registration = Registration {
        state: ctx.state.clone(),
        key: ClientKey::new(vhost_name, client_id),
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
    Ok(registration)
}

/// Opens the session: its queue and stored state (CONNACK waits for their records),
/// then, for a persistent session, its subscriptions again. Encodes CONNACK. `None`:
/// the store or the core failed (logged); the client gets "server unavailable".
async fn open(
    ctx: &Ctx,
    vs: Arc<VhostState>,
    vhost_name: &str,
    client_id: String,
    connect: &Connect,
    link: Link,
) -> Option<Session> {
    let qname = format!("mqtt-subscription-{client_id}");
    let setup = open_session(
        &ctx.state,
        &vs,
        vhost_name,
        &client_id,
        &qname,
        connect,
        link.user(),
        link.id(),
    );
    let (session_present, packets) = match setup {
        Ok((present, packets, durables)) => {
            let mut stored = Ok(());
            for d in durables {
                stored = stored.and(d.await);
            }
            if let Err(e) = stored {
                tracing::warn!(error = %e, "cannot store the MQTT session");
                return None;
            }
            (present, packets)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot open the MQTT session");
            return None;
        }
    };
    let setup = SessionSetup {
        link,
        state: ctx.state.clone(),
        vs,
        client_id,
        qname,
        clean: connect.clean_session,
        packets,
        keep_alive: connect.keep_alive,
    };
    let mut session = Session::new(setup, &ctx.limits);
    session.connack(session_present);
    // A clean session's queue waits for the first SUBSCRIBE: a client that only
    // publishes (or has not subscribed yet) costs no queue, no consumer, no store entry.
    if !connect.clean_session {
        if let Err(e) = session.resume() {
            tracing::warn!(error = %e, "cannot resume the MQTT session");
            return None;
        }
    }
    tracing::debug!(
        clean = connect.clean_session,
        session_present,
        "MQTT client connected"
    );
    Some(session)
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
) -> Result<(bool, Packets<Target>, Vec<Durability>), MqttError> {
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
        // the queue is declared by the first SUBSCRIBE (`Session::subscription_queue`)
        Ok((false, Packets::default(), Vec::new()))
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
            Packets::resume(stored.unwrap_or_default(), carry),
            std::iter::once(durable).chain(claimed).collect(),
        ))
    }
}

//! The connection task: one `select!` over the socket, the core's outbox, pending
//! durability waits, heart-beat timers and shutdown. All protocol decisions are the
//! [`Session`]'s; this file only moves bytes and keeps time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;
use triad_core::{Broker, CoreError, ReplyQueue};

use crate::codec::{self, Dialect, Limits, HEARTBEAT};
use crate::frame::Frame;
use crate::session::{Action, Caps, Session, SessionConfig};
use triad_core::io::read_some;

/// The most a declared `content-length` reserves before the body's bytes arrive.
const RESERVE_AHEAD: usize = 1 << 20;

/// Everything a STOMP connection needs from the process.
#[derive(Debug, Clone)]
pub struct StompContext {
    /// The broker core.
    pub broker: Arc<Broker>,
    /// The user a CONNECT without `login` logs in as (no password); `None`: such a
    /// CONNECT is refused. The process decides per peer (`auth.anonymous`).
    pub anonymous_user: Option<String>,
    /// Frame limits after login.
    pub limits: Limits,
    /// Frame limits before login.
    pub unauthenticated_limits: Limits,
    /// Smallest interval at which the server sends heart-beats (0 = never).
    pub heartbeat_send: Duration,
    /// Smallest interval at which the server wants heart-beats (0 = never). A peer
    /// silent for twice the negotiated interval is disconnected.
    pub heartbeat_recv: Duration,
    /// CONNECT must be accepted within this long.
    pub handshake_timeout: Duration,
    /// Deliveries buffered per connection before queues wait.
    pub outbox_capacity: usize,
    /// Cancelled at broker shutdown.
    pub shutdown: CancellationToken,
    /// How long a refused CONNECT waits for its ERROR (this connection only).
    pub failed_login_delay: Duration,
    /// CONNECT without `login` logs in as the certificate's CN (`ssl_cert_login`).
    pub ssl_cert_login: bool,
    /// This connection's verified TLS client certificate CN.
    pub peer_cert_cn: Option<String>,
    /// Caps on per-connection state.
    pub caps: Caps,
}

impl StompContext {
    /// Defaults: anonymous login as guest, RabbitMQ's frame limits, 10 s heart-beats, 10 s handshake.
    pub fn new(broker: Arc<Broker>, shutdown: CancellationToken) -> StompContext {
        StompContext {
            broker,
            anonymous_user: Some("guest".into()),
            limits: Limits::AUTHENTICATED,
            unauthenticated_limits: Limits::UNAUTHENTICATED,
            heartbeat_send: Duration::from_secs(10),
            heartbeat_recv: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            outbox_capacity: 1024,
            shutdown,
            failed_login_delay: Duration::from_secs(1),
            ssl_cert_login: false,
            peer_cert_cn: None,
            caps: Caps::default(),
        }
    }

    fn session_config(&self) -> SessionConfig {
        let ms = |d: Duration| u32::try_from(d.as_millis()).unwrap_or(u32::MAX);
        SessionConfig {
            anonymous_user: self.anonymous_user.clone(),
            heartbeat_send_ms: ms(self.heartbeat_send),
            heartbeat_recv_ms: ms(self.heartbeat_recv),
            limits: self.limits,
            unauthenticated_limits: self.unauthenticated_limits,
            outbox_capacity: self.outbox_capacity,
            ssl_cert_login: self.ssl_cert_login,
            peer_cert_cn: self.peer_cert_cn.clone(),
            caps: self.caps,
            failed_login_delay: self.failed_login_delay,
        }
    }
}

/// Why a connection ended abnormally.
#[derive(Debug, Error)]
pub enum ServeError {
    /// The socket failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// Deliveries turned into frames per wake-up.
const BATCH: usize = 256;
/// Receipts waiting on durability before the socket stops being read.
const MAX_PENDING_RECEIPTS: usize = 4096;
/// The write buffer taken for a batch of frames (it grows for larger batches).
const WBUF: usize = 8 << 10;

/// Serves one STOMP connection until the peer leaves, an error closes it, or shutdown.
/// The user and vhost are recorded as `user` and `vhost` in the current span (the
/// listener's `conn` span): a span of its own cost each idle connection a second
/// registry slot.
// Not an `async fn` on purpose (see the comment inside).
#[allow(clippy::manual_async_fn)]
pub fn serve<S>(
    mut stream: S,
    peer: SocketAddr,
    ctx: StompContext,
) -> impl std::future::Future<Output = Result<(), ServeError>> + Send
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    // An async block using its captures in place: an async fn would keep its arguments
    // twice (as captured and as locals) for as long as the connection lives.
    async move {
        let mut session = Session::new(ctx.broker.clone(), peer, ctx.session_config());
        let res = run(&mut stream, &mut session, &ctx).await;
        session.close();
        let _ = stream.shutdown().await;
        match &res {
            Ok(()) => tracing::debug!("connection closed"),
            Err(e) => tracing::debug!(error = %e, "connection failed"),
        }
        res
    }
}

/// A body at least this large is written from the `Bytes` it came in (for a MESSAGE,
/// the store's, shared by every subscriber) instead of being copied after its head.
const SHARED_BODY: usize = 32 << 10;

/// What the connection writes next, in order: encoded frames, except that large bodies
/// stay the shared `Bytes` they are (a 64 MiB message to 10 subscribers is not copied
/// into 10 write buffers).
#[derive(Default)]
struct Out {
    /// Encoded bytes and large bodies; `buf` follows the last of them.
    chunks: Vec<Bytes>,
    buf: BytesMut,
}

impl Out {
    fn frame(&mut self, f: &Frame, dialect: Dialect) {
        if f.body.len() < SHARED_BODY {
            codec::encode_with(f, &mut self.buf, dialect);
            return;
        }
        codec::encode_head_with(f, &mut self.buf, dialect);
        self.chunks.push(self.buf.split().freeze());
        self.chunks.push(f.body.clone());
        self.buf.put_u8(0);
    }

    fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.buf.is_empty()
    }

    /// Writes everything, in order, and empties `self` (its buffer keeps its room).
    async fn write_to<S: AsyncWrite + Unpin>(&mut self, stream: &mut S) -> std::io::Result<()> {
        for c in self.chunks.drain(..) {
            stream.write_all(&c).await?;
        }
        stream.write_all(&self.buf).await?;
        self.buf.clear();
        Ok(())
    }
}

/// Encodes RECEIPTs that left the reply queue, in order; on a store failure, an ERROR
/// and close instead (`true`: `actions` holds them).
fn write_receipts(
    ready: Vec<(Frame, Result<(), CoreError>)>,
    session: &mut Session,
    out: &mut Out,
    actions: &mut Vec<Action>,
) -> bool {
    let dialect = session.dialect();
    for (frame, stored) in ready {
        if let Err(e) = stored {
            tracing::warn!(error = %e, "store failed to make a message durable");
            session.error_and_close(
                "internal error",
                &format!("the message could not be stored: {e}"),
                actions,
            );
            return true;
        }
        out.frame(&frame, dialect);
    }
    false
}

async fn run<S>(stream: &mut S, session: &mut Session, ctx: &StompContext) -> Result<(), ServeError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let outbox = session.outbox().clone();
    // Both buffers are let go while the connection waits (see `read_some`; `wbuf` when
    // nothing more is to be sent), so an idle connection holds neither.
    let mut rbuf = BytesMut::new();
    // the frame at the front of rbuf, parsed as far as it has arrived
    let mut decoder = codec::Decoder::default();
    let mut wbuf = Out::default();
    let mut actions: Vec<Action> = Vec::new();
    let mut events = Vec::new();
    // RECEIPTs waiting for the disk or for a throttled queue, in order, and flow-control
    // holds (the core's one ordered reply queue)
    let mut receipts: ReplyQueue<Frame> = ReplyQueue::default();

    let mut disconnecting = false;
    let mut closing = false;
    let handshake_deadline = Instant::now() + ctx.handshake_timeout;
    let mut last_read = Instant::now();
    let mut last_write = Instant::now();
    let mut was_connected = false;
    let mut alarms = ctx.broker.alarms();
    let mut blocked = alarms.borrow_and_update().any();
    let mut published = false;

    loop {
        let more_events = if !closing && session.is_connected() {
            if !was_connected {
                was_connected = true;
                let span = tracing::Span::current();
                span.record("user", session.user());
                span.record("vhost", session.vhost_name().unwrap_or(""));
                tracing::debug!(version = session.version().as_str(), "connected");
            }
            events.clear();
            outbox.drain(&mut events, BATCH);
            for ev in events.drain(..) {
                session.deliver(ev, &mut actions);
            }
            !outbox.is_empty()
        } else {
            false
        };
        let dialect = session.dialect();
        if wbuf.buf.capacity() == 0 && !actions.is_empty() {
            wbuf.buf.reserve(WBUF);
        }
        for a in actions.drain(..) {
            match a {
                Action::Send(f) => wbuf.frame(&f, dialect),
                // keep order with what is already written unless a durable wait is ahead
                Action::Receipt {
                    durable: None,
                    flow: None,
                    frame,
                } if receipts.is_empty() => wbuf.frame(&frame, dialect),
                Action::Receipt {
                    durable,
                    flow,
                    frame,
                } => receipts.push(frame, durable, flow),
                Action::Hold(flow) => receipts.hold(flow),
                Action::Disconnect => disconnecting = true,
                Action::Close => closing = true,
            }
        }
        if !closing && !receipts.is_empty() {
            let mut ready = Vec::new();
            receipts.take_ready(&mut ready, None);
            if write_receipts(ready, session, &mut wbuf, &mut actions) {
                continue;
            }
        }
        if let Some(hold) = session.take_login_hold() {
            // Slows password guessing down: one refusal per delay per source address
            // and per user name, however many connections ask at once.
            if !hold.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(hold) => {}
                    _ = ctx.shutdown.cancelled() => {}
                }
            }
        }
        if !wbuf.is_empty() {
            if ctx.shutdown.is_cancelled() {
                // last words (the shutdown ERROR): bounded, best effort
                let _ = tokio::time::timeout(Duration::from_secs(1), wbuf.write_to(stream)).await;
            } else {
                tokio::select! {
                    r = wbuf.write_to(stream) => r?,
                    _ = ctx.shutdown.cancelled() => return Ok(()),
                }
            }
            last_write = Instant::now();
        }
        if !more_events {
            // going idle: let go of what a burst left allocated
            wbuf = Out::default();
            actions = Vec::new();
            events = Vec::new();
        }
        if closing || (disconnecting && receipts.is_empty()) {
            let _ = stream.flush().await;
            return Ok(());
        }

        let (send_iv, recv_iv) = session.heartbeat();
        let far = Instant::now() + Duration::from_secs(86_400);
        let send_at = send_iv.map(|d| last_write + d).unwrap_or(far);
        let silent_at = recv_iv.map(|d| last_read + d * 2).unwrap_or(far);
        // While a resource alarm is raised, connections that publish are not read from
        // (consumers keep draining); their silence then is ours, not a dead peer.
        let alarm_blocked = blocked && published;
        if alarm_blocked {
            last_read = Instant::now();
        }
        let reading = !disconnecting
            && receipts.len() < MAX_PENDING_RECEIPTS
            && !receipts.is_holding()
            && !alarm_blocked;
        let connected = session.is_connected();
        // One timer for the three deadlines (each `Sleep` in the `select!` below is
        // 112 bytes of every connection's task, waiting or not).
        let watch_silence = recv_iv.is_some() && !alarm_blocked;
        let timer = [
            send_iv.map(|_| send_at),
            watch_silence.then_some(silent_at),
            (!connected).then_some(handshake_deadline),
        ]
        .into_iter()
        .flatten()
        .min();

        tokio::select! {
            _ = ctx.shutdown.cancelled() => {
                session.error_and_close("Server shutdown", "the broker is shutting down", &mut actions);
            }
            r = read_some(stream, &mut rbuf, WBUF), if reading => {
                if r? == 0 {
                    return Ok(());
                }
                last_read = Instant::now();
                loop {
                    let limits = session.limits();
                    match decoder.decode(&mut rbuf, &limits, session.dialect()) {
                        Ok(Some(frame)) => {
                            tracing::trace!(command = %frame.command, "frame");
                            // BEGIN too: a transaction buffers what it will publish
                            published |= matches!(
                                frame.command,
                                crate::frame::Command::Send | crate::frame::Command::Begin
                            );
                            session.handle(frame, &mut actions);
                            if actions.iter().any(|a| matches!(a, Action::Close | Action::Disconnect)) {
                                break;
                            }
                        }
                        Ok(None) => {
                            // a declared body: room for the frame at once (within the
                            // limits, checked), not doubled read by read; at most
                            // `RESERVE_AHEAD` before its bytes arrive, so a head alone
                            // cannot make the broker allocate a whole large frame
                            if let Some(n) = decoder.pending_len() {
                                rbuf.reserve(n.saturating_sub(rbuf.len()).min(RESERVE_AHEAD));
                            }
                            break;
                        }
                        Err(e) => {
                            session.decode_error(&e, &mut actions);
                            break;
                        }
                    }
                }
                if rbuf.is_empty() {
                    // An empty buffer split from a frame that filled its allocation
                    // still holds that allocation (a whole 64 MiB SEND, until the next
                    // frame): let it go with the frame.
                    rbuf = BytesMut::new();
                }
            }
            r = alarms.changed() => {
                if r.is_ok() {
                    blocked = alarms.borrow_and_update().any();
                }
            }
            _ = outbox.notified(), if connected && !more_events => {}
            _ = std::future::ready(()), if connected && more_events => {}
            done = receipts.ready(), if !receipts.is_empty() && !closing => {
                write_receipts(done, session, &mut wbuf, &mut actions);
            }
            _ = sleep_until(timer.unwrap_or(far)), if timer.is_some() => {
                let now = Instant::now();
                if !connected && now >= handshake_deadline {
                    tracing::debug!("no CONNECT within the handshake timeout; closing");
                    return Ok(());
                }
                if watch_silence && now >= silent_at {
                    tracing::debug!("no heart-beat from the peer within twice the interval; closing");
                    return Ok(());
                }
                if send_iv.is_some() && now >= send_at {
                    wbuf.buf.put_slice(HEARTBEAT);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::Command;

    /// A large body is written from the delivery's own `Bytes` (the same memory), not
    /// copied behind its head; the bytes on the wire are what `encode_with` makes.
    #[tokio::test]
    async fn a_large_body_is_shared_not_copied() {
        let body = Bytes::from(vec![7u8; SHARED_BODY]);
        let small = Frame::new(Command::Message)
            .with("subscription", "s")
            .with_body("hi");
        let large = Frame::new(Command::Message)
            .with("subscription", "s")
            .with_body(body.clone());
        let mut out = Out::default();
        out.frame(&small, Dialect::V12);
        out.frame(&large, Dialect::V12);
        out.frame(&small, Dialect::V12);
        assert_eq!(out.chunks.len(), 2, "head bytes, then the body itself");
        assert_eq!(out.chunks[1].as_ptr(), body.as_ptr(), "the same memory");
        let mut want = BytesMut::new();
        for f in [&small, &large, &small] {
            codec::encode_with(f, &mut want, Dialect::V12);
        }
        let mut wire = Vec::new();
        out.write_to(&mut wire).await.unwrap();
        assert_eq!(wire, want.to_vec());
        assert!(out.is_empty());
    }
}

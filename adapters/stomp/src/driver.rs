//! The connection task: the core's one connection driver ([`triad_core::driver`])
//! around a [`Session`]. All protocol decisions are the session's; this file only
//! plugs the codec and the session into the driver ([`Protocol`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use triad_core::driver::{drive, End, Out, Protocol, Status, Stop, Timing, BATCH};
use triad_core::{Broker, CoreError, OutEvent, Outbox, ReplyQueue};

use crate::codec::{self, Dialect, Limits, HEARTBEAT};
use crate::frame::{Command, Frame};
use crate::session::{Action, Caps, Session, SessionConfig};

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

/// Receipts waiting on durability before the socket stops being read.
const MAX_PENDING_RECEIPTS: usize = 4096;

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
        let session = Session::new(ctx.broker.clone(), peer, ctx.session_config());
        let mut conn = Conn::new(session, Instant::now() + ctx.handshake_timeout);
        let mut rbuf = BytesMut::new();
        let res = drive(
            &mut stream,
            &mut conn,
            &mut rbuf,
            Stop::shutdown(&ctx.shutdown),
            ctx.broker.alarms(),
        )
        .await;
        conn.session.close();
        let res = match res {
            Ok(End::Closed) => {
                let _ = stream.flush().await;
                Ok(())
            }
            Ok(End::Silent) => {
                tracing::debug!("no heart-beat from the peer within twice the interval; closing");
                Ok(())
            }
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        };
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

/// Encodes `f`; a large body stays the shared `Bytes` it is (a 64 MiB message to 10
/// subscribers is not copied into 10 write buffers).
fn encode_frame(out: &mut Out, f: &Frame, dialect: Dialect) {
    if f.body.len() < SHARED_BODY {
        codec::encode_with(f, out.buf(), dialect);
        return;
    }
    codec::encode_head_with(f, out.buf(), dialect);
    out.share(f.body.clone());
    out.buf().put_u8(0);
}

/// A STOMP connection as the core's driver sees it: the codec's decoder, the session,
/// and the RECEIPTs waiting in order for the disk or a throttled queue.
struct Conn {
    session: Session,
    /// The frame at the front of the read buffer, parsed as far as it has arrived.
    decoder: codec::Decoder,
    actions: Vec<Action>,
    /// RECEIPTs waiting for the disk or for a throttled queue, in order, and
    /// flow-control holds (the core's one ordered reply queue).
    receipts: ReplyQueue<Frame>,
    handshake_deadline: Instant,
    /// A SEND or BEGIN was seen: alarms hold this connection.
    published: bool,
    disconnecting: bool,
    closing: bool,
    was_connected: bool,
}

impl Conn {
    fn new(session: Session, handshake_deadline: Instant) -> Conn {
        Conn {
            session,
            decoder: codec::Decoder::default(),
            actions: Vec::new(),
            receipts: ReplyQueue::default(),
            handshake_deadline,
            published: false,
            disconnecting: false,
            closing: false,
            was_connected: false,
        }
    }

    /// Encodes what the session asked for; receipts keep their order behind any that
    /// wait.
    fn flush_actions(&mut self, out: &mut Out) {
        let dialect = self.session.dialect();
        for a in self.actions.drain(..) {
            match a {
                Action::Send(f) => encode_frame(out, &f, dialect),
                // keep order with what is already written unless a wait is ahead
                Action::Receipt {
                    durable: None,
                    flow: None,
                    frame,
                } if self.receipts.is_empty() => encode_frame(out, &frame, dialect),
                Action::Receipt {
                    durable,
                    flow,
                    frame,
                } => self.receipts.push(frame, durable, flow),
                Action::Hold(flow) => self.receipts.hold(flow),
                Action::Disconnect => self.disconnecting = true,
                Action::Close => self.closing = true,
            }
        }
    }

    /// Records the user and vhost in the connection's span once CONNECT is accepted.
    fn note_connected(&mut self) {
        if self.was_connected || !self.session.is_connected() {
            return;
        }
        self.was_connected = true;
        let span = tracing::Span::current();
        span.record("user", self.session.user());
        span.record("vhost", self.session.vhost_name().unwrap_or(""));
        tracing::debug!(version = self.session.version().as_str(), "connected");
    }
}

impl Protocol for Conn {
    type Frame = Frame;
    type Reply = Frame;
    type Error = ServeError;

    fn decode(&mut self, buf: &mut BytesMut) -> Option<Frame> {
        let limits = self.session.limits();
        match self.decoder.decode(buf, &limits, self.session.dialect()) {
            Ok(Some(frame)) => Some(frame),
            Ok(None) => {
                // a declared body: room for the frame at once (within the limits,
                // checked), not doubled read by read; at most `RESERVE_AHEAD` before
                // its bytes arrive, so a head alone cannot make the broker allocate a
                // whole large frame
                if let Some(n) = self.decoder.pending_len() {
                    buf.reserve(n.saturating_sub(buf.len()).min(RESERVE_AHEAD));
                }
                None
            }
            Err(e) => {
                self.session.decode_error(&e, &mut self.actions);
                self.closing = true;
                None
            }
        }
    }

    fn step(&mut self, frame: Frame, out: &mut Out) -> Result<(), ServeError> {
        tracing::trace!(command = %frame.command, "frame");
        // BEGIN too: a transaction buffers what it will publish
        self.published |= matches!(frame.command, Command::Send | Command::Begin);
        self.session.handle(frame, &mut self.actions);
        self.flush_actions(out);
        self.note_connected();
        Ok(())
    }

    fn encode(&mut self, out: &mut Out) -> Result<(), ServeError> {
        self.flush_actions(out);
        Ok(())
    }

    fn outbox(&self) -> &Arc<Outbox> {
        self.session.outbox()
    }

    fn delivery_room(&self) -> usize {
        if self.session.is_connected() && !self.closing {
            BATCH
        } else {
            0
        }
    }

    fn deliver(&mut self, events: &mut Vec<OutEvent>, out: &mut Out) -> Result<(), ServeError> {
        for ev in events.drain(..) {
            self.session.deliver(ev, &mut self.actions);
        }
        self.flush_actions(out);
        Ok(())
    }

    fn replies(&mut self) -> &mut ReplyQueue<Frame> {
        &mut self.receipts
    }

    /// Encodes RECEIPTs that left the reply queue, in order; on a store failure, an
    /// ERROR and close instead.
    fn replied(
        &mut self,
        ready: Vec<(Frame, Result<(), CoreError>)>,
        out: &mut Out,
    ) -> Result<(), ServeError> {
        let dialect = self.session.dialect();
        for (frame, stored) in ready {
            if let Err(e) = stored {
                tracing::warn!(error = %e, "store failed to make a message durable");
                self.session.error_and_close(
                    "internal error",
                    &format!("the message could not be stored: {e}"),
                    &mut self.actions,
                );
                break;
            }
            encode_frame(out, &frame, dialect);
        }
        self.flush_actions(out);
        Ok(())
    }

    fn max_replies(&self) -> usize {
        MAX_PENDING_RECEIPTS
    }

    fn status(&self) -> Status {
        if self.closing {
            Status::Closed
        } else if self.disconnecting {
            Status::Draining
        } else {
            Status::Open
        }
    }

    fn timing(&self) -> Timing {
        let (send, recv) = self.session.heartbeat();
        Timing {
            heartbeat: send,
            silence: recv.map(|d| d * 2),
            deadline: (!self.session.is_connected()).then_some(self.handshake_deadline),
        }
    }

    fn heartbeat(&mut self, out: &mut Out) -> Result<(), ServeError> {
        out.buf().put_slice(HEARTBEAT);
        Ok(())
    }

    fn deadline(&mut self) {
        if !self.session.is_connected() && Instant::now() >= self.handshake_deadline {
            tracing::debug!("no CONNECT within the handshake timeout; closing");
            self.actions.clear();
            self.closing = true;
        }
    }

    fn shutdown(&mut self) {
        self.session.error_and_close(
            "Server shutdown",
            "the broker is shutting down",
            &mut self.actions,
        );
        self.closing = true;
    }

    fn has_published(&self) -> bool {
        self.published
    }

    fn take_login_hold(&mut self) -> Option<Duration> {
        self.session.take_login_hold()
    }

    fn release_buffers(&mut self) {
        self.actions = Vec::new();
    }

    fn release_idle(&mut self) {
        self.session.release_idle();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

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
        encode_frame(&mut out, &small, Dialect::V12);
        encode_frame(&mut out, &large, Dialect::V12);
        encode_frame(&mut out, &small, Dialect::V12);
        assert_eq!(out.chunks().len(), 2, "head bytes, then the body itself");
        assert_eq!(out.chunks()[1].as_ptr(), body.as_ptr(), "the same memory");
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

//! The connection task: the protocol header, then the core's one connection driver
//! ([`triad_core::driver`]) around a [`Session`], then the close.
//!
//! The driver's one `select!` covers the shutdown token, the socket read, the core's
//! outbox, settled publisher confirms, and one timer (handshake deadline, heartbeats,
//! close-ok wait). Output is encoded as a batch and written out before anything more
//! is read, so a peer that does not read stops being read from; one that takes no
//! bytes for twice the heartbeat is closed, as one that sends none is (also while a
//! resource alarm holds it). After connection.close-ok the socket is read and dropped
//! until the peer closes it (at most `close_timeout`), so a client with frames still
//! in flight sees a clean close.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{sleep_until, timeout_at, Instant};
use tokio_util::sync::CancellationToken;
use triad_core::driver::{
    drive, End, Out, Protocol, Status, Stop, Timing, BATCH, LAST_WORDS, WBUF,
};
use triad_core::io::read_some;
use triad_core::{Broker, CoreError, OutEvent, Outbox, ReplyQueue};

use crate::codec::{self, HeaderCheck, PROTOCOL_HEADER};
use crate::confirms::{self, Settled};
use crate::session::{Session, State};
use crate::AmqpConfig;

/// How much a connection held by a resource alarm may have read and not processed.
const HELD_READ_MAX: usize = 8 << 10;

/// What a connection task needs.
#[derive(Clone, Debug)]
pub struct AmqpContext {
    /// The broker.
    pub broker: Arc<Broker>,
    /// Limits and timeouts.
    pub config: AmqpConfig,
    /// Cancelled at broker shutdown: connections get 320 CONNECTION_FORCED.
    pub shutdown: CancellationToken,
}

/// Why a connection task ended abnormally. Peers causing errors is normal and is
/// reported to the peer, not here.
#[derive(Debug, Error)]
pub enum ServeError {
    /// Socket error.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A frame could not be encoded.
    #[error(transparent)]
    Encode(#[from] codec::EncodeError),
}

/// Serves one AMQP connection until it closes.
pub fn serve<S>(
    stream: S,
    peer: SocketAddr,
    ctx: AmqpContext,
) -> impl std::future::Future<Output = Result<(), ServeError>> + Send
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    // An async block using its captures in place: an async fn would keep its arguments
    // twice (as captured and as locals) for as long as the connection lives. No span
    // of its own: the user and vhost are recorded in the current one (the listener's
    // `conn` span), as STOMP and MQTT do; a second span would cost each connection a
    // registry slot.
    let mut stream = stream;
    async move { run(&mut stream, peer, &ctx).await }
}

async fn run<S>(stream: &mut S, peer: SocketAddr, ctx: &AmqpContext) -> Result<(), ServeError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let cfg = &ctx.config;
    let handshake_deadline = Instant::now() + cfg.handshake_timeout;
    // Let go while the connection waits (see `read_some`): an idle connection holds no
    // read buffer.
    let mut rbuf = BytesMut::new();

    // Protocol header, under the handshake deadline.
    loop {
        match codec::decode_protocol_header(&mut rbuf) {
            HeaderCheck::Accepted => break,
            HeaderCheck::Rejected => {
                tracing::debug!("bad protocol header");
                stream.write_all(PROTOCOL_HEADER).await?;
                let _ = stream.shutdown().await;
                return Ok(());
            }
            HeaderCheck::Incomplete => {}
        }
        match timeout_at(handshake_deadline, read_some(stream, &mut rbuf, WBUF)).await {
            Ok(Ok(0)) | Err(_) => return Ok(()),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e.into()),
        }
    }

    let mut session = Session::new(ctx.broker.clone(), cfg.clone(), peer.ip());
    let result = connection_loop(stream, &mut rbuf, &mut session, ctx, handshake_deadline).await;
    let drain = result.is_ok() && session.sent_close_ok();
    session.teardown();
    drop(rbuf);
    if drain {
        // boxed: its 8 KiB buffer is held only while it runs, not in every connection's
        // task for its whole life (a task is sized for its largest state)
        Box::pin(drain_until_closed(stream, cfg.close_timeout, &ctx.shutdown)).await;
    }
    // bounded: a TLS close_notify cannot be written to a peer that does not read
    let _ = tokio::time::timeout(LAST_WORDS, stream.shutdown()).await;
    result
}

/// After connection.close-ok: reads and drops whatever the peer still sends until it
/// closes its side, for at most `limit` (`close_timeout`, 3 s by default) or until the
/// broker shuts down. A client may have written frames after its connection.close
/// (amqplib queues its publishes behind it); closing the socket with them unread would
/// reset the connection, and the client would see `EPIPE`/`ECONNRESET` instead of the
/// close it asked for. RabbitMQ does the same (its reader drops frames in the `closed`
/// state until the socket closes, for at most 30 s). The connection's core resources
/// are already released; this holds an 8 KiB buffer (in its own boxed future) and
/// nothing else.
async fn drain_until_closed<S>(stream: &mut S, limit: Duration, shutdown: &CancellationToken)
where
    S: AsyncRead + Unpin,
{
    let deadline = Instant::now() + limit;
    let mut scratch = [0u8; WBUF];
    loop {
        tokio::select! {
            r = stream.read(&mut scratch) => match r {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            },
            _ = sleep_until(deadline) => return,
            _ = shutdown.cancelled() => return,
        }
    }
}

/// How long a write may take no bytes before the peer counts as gone: twice the
/// negotiated heartbeat, none without heartbeats.
fn write_stall(session: &Session) -> Option<Duration> {
    let hb = u64::from(session.heartbeat());
    (hb > 0 && session.is_open()).then(|| Duration::from_secs(hb * 2))
}

async fn connection_loop<S>(
    stream: &mut S,
    rbuf: &mut BytesMut,
    session: &mut Session,
    ctx: &AmqpContext,
    handshake_deadline: Instant,
) -> Result<(), ServeError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    session.start();
    let mut conn = Conn {
        session,
        handshake_deadline,
        close_timeout: ctx.config.close_timeout,
        closing_since: None,
        fatal: false,
    };
    let end = drive(
        stream,
        &mut conn,
        rbuf,
        Stop::shutdown(&ctx.shutdown),
        ctx.broker.alarms(),
    )
    .await?;
    if end == End::Silent {
        tracing::debug!("missed heartbeats");
        conn.session.abort();
    }
    Ok(())
}

/// An AMQP connection as the core's driver sees it: the session, and the clocks of
/// its handshake and of its close.
struct Conn<'a> {
    session: &'a mut Session,
    handshake_deadline: Instant,
    close_timeout: Duration,
    /// When connection.close was sent (or received): close-ok is awaited until then
    /// plus `close_timeout`.
    closing_since: Option<Instant>,
    /// A frame error: the connection.close is written, then the socket closed.
    fatal: bool,
}

impl Protocol for Conn<'_> {
    type Frame = codec::Frame;
    type Reply = Settled;
    type Error = ServeError;

    fn decode(&mut self, buf: &mut BytesMut) -> Option<codec::Frame> {
        if matches!(self.session.state(), State::Closed) || self.fatal {
            return None;
        }
        match codec::decode(buf, &self.session.limits()) {
            Ok(frame) => frame,
            Err(e) => {
                tracing::debug!(error = %e, "frame error");
                self.session.frame_error(&e);
                buf.clear();
                self.fatal = true;
                None
            }
        }
    }

    fn step(&mut self, frame: codec::Frame, _out: &mut Out) -> Result<(), ServeError> {
        self.session.handle(frame);
        Ok(())
    }

    fn encode(&mut self, out: &mut Out) -> Result<(), ServeError> {
        if matches!(self.session.state(), State::Closing) && self.closing_since.is_none() {
            self.closing_since = Some(Instant::now());
        }
        if self.session.has_output() {
            self.session.write_to(out.buf())?;
        }
        Ok(())
    }

    fn outbox(&self) -> &Arc<Outbox> {
        self.session.outbox()
    }

    fn delivery_room(&self) -> usize {
        if self.session.is_open() {
            BATCH
        } else {
            0
        }
    }

    fn deliver(&mut self, events: &mut Vec<OutEvent>, _out: &mut Out) -> Result<(), ServeError> {
        self.session.on_events(events.drain(..));
        Ok(())
    }

    fn replies(&mut self) -> &mut ReplyQueue<Settled> {
        self.session.confirms().queue()
    }

    fn replied(
        &mut self,
        ready: Vec<(Settled, Result<(), CoreError>)>,
        _out: &mut Out,
    ) -> Result<(), ServeError> {
        self.session
            .on_confirms(ready.into_iter().map(confirms::settle).collect());
        Ok(())
    }

    fn status(&self) -> Status {
        if matches!(self.session.state(), State::Closed) || self.fatal {
            Status::Closed
        } else {
            Status::Open
        }
    }

    fn timing(&self) -> Timing {
        let hb = Duration::from_secs(u64::from(self.session.heartbeat()));
        let beat = !hb.is_zero() && self.session.is_open();
        let handshake = (!self.session.is_open() && self.closing_since.is_none())
            .then_some(self.handshake_deadline);
        let closing = self.closing_since.map(|t| t + self.close_timeout);
        Timing {
            heartbeat: beat.then_some(hb / 2),
            silence: beat.then_some(hb * 2),
            deadline: [handshake, closing].into_iter().flatten().min(),
        }
    }

    fn heartbeat(&mut self, out: &mut Out) -> Result<(), ServeError> {
        codec::encode(&codec::Frame::Heartbeat(0), out.buf())?;
        Ok(())
    }

    fn deadline(&mut self) {
        let now = Instant::now();
        if self
            .closing_since
            .is_some_and(|t| now >= t + self.close_timeout)
        {
            self.session.abort();
            return;
        }
        if !self.session.is_open() && self.closing_since.is_none() && now >= self.handshake_deadline
        {
            tracing::debug!("handshake timeout");
            self.session.abort();
        }
    }

    fn shutdown(&mut self) {
        self.session.shutdown();
    }

    /// As RabbitMQ: only a connection that publishes is blocked and told so; one that
    /// only consumes is neither (lapin, for one, sends nothing while told blocked, so
    /// telling a consumer would stall its basic.consume).
    fn has_published(&self) -> bool {
        self.session.has_published()
    }

    /// While an alarm is raised, a connection that publishes is read only until this
    /// much of its frames wait (its client sees connection.blocked). What it sends is
    /// still read, so a peer that goes silent meets the heartbeat timeout like any
    /// other; once the held bytes fill the buffer the stall is ours, and the peer is
    /// not blamed for it.
    fn held_read_max(&self) -> usize {
        HELD_READ_MAX
    }

    /// Of what a held publisher sends, only heartbeat frames are taken (they prove it
    /// alive); the rest waits in its buffer until the alarm clears.
    fn decode_held(&self, buf: &[u8]) -> bool {
        codec::starts_with_heartbeat(buf)
    }

    fn blocked(&mut self, reason: Option<&'static str>) -> bool {
        if !self.session.is_open() {
            return false;
        }
        self.session.set_blocked(reason);
        true
    }

    fn take_login_hold(&mut self) -> Option<Duration> {
        self.session.take_login_hold()
    }

    fn write_stall(&self) -> Option<Duration> {
        write_stall(self.session)
    }

    /// Going idle: no encoder scratch, no output vector.
    fn release_buffers(&mut self) {
        self.session.release_buffers();
    }

    fn release_idle(&mut self) {
        for ch in self.session.channels.values_mut() {
            ch.release_idle();
        }
    }
}

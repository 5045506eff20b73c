//! The connection task: socket I/O around a [`Session`].
//!
//! One `select!` over: the shutdown token, `read_buf` into the connection's buffer,
//! the core's outbox, settled publisher confirms, and one timer (handshake deadline,
//! heartbeats, close-ok wait). Every branch is cancel-safe. Output is encoded as a
//! batch and written out before anything more is read, so a peer that does not read
//! stops being read from; one that takes no bytes for twice the heartbeat is closed,
//! as one that sends none is (also while a resource alarm holds it). After
//! connection.close-ok the socket is read and dropped until the peer closes it
//! (at most `close_timeout`), so a client with frames still in flight sees a clean close.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{sleep_until, timeout_at, Instant};
use tokio_util::sync::CancellationToken;
use triad_core::Broker;

use crate::codec::{self, HeaderCheck, PROTOCOL_HEADER};
use crate::session::{Session, State};
use crate::AmqpConfig;
use triad_core::io::read_some;

/// The write buffer taken for a batch of frames (it grows for larger batches).
const WBUF: usize = 8 << 10;

/// How much a connection held by a resource alarm may have read and not processed.
const HELD_READ_MAX: usize = 8 << 10;

/// How long the last bytes to a peer (connection.close at shutdown, TLS close_notify)
/// may take before the connection is dropped without them.
const LAST_WORDS: Duration = Duration::from_secs(1);

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

/// Writes `buf`. Once shutdown is requested the write gets [`LAST_WORDS`] more to
/// finish (so the connection.close 320 still follows a frame in progress), but a peer
/// that does not read cannot hold up the broker's shutdown. With `stall` (twice the
/// heartbeat), a peer that takes no bytes for that long has stopped reading and is
/// given up on, as one that stops sending is. `Ok(false)`: gave up.
async fn write_bounded<S>(
    stream: &mut S,
    buf: &[u8],
    shutdown: &CancellationToken,
    stall: Option<Duration>,
) -> std::io::Result<bool>
where
    S: AsyncWrite + Unpin,
{
    let mut off = 0;
    let mut last_words = shutdown.is_cancelled().then(|| Instant::now() + LAST_WORDS);
    while let Some(rest) = buf.get(off..).filter(|r| !r.is_empty()) {
        let progress_by = stall.map(|d| Instant::now() + d);
        let give_up = match (progress_by, last_words) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        tokio::select! {
            r = stream.write(rest) => match r? {
                0 => return Err(std::io::ErrorKind::WriteZero.into()),
                n => off += n,
            },
            _ = shutdown.cancelled(), if last_words.is_none() => {
                last_words = Some(Instant::now() + LAST_WORDS);
            }
            _ = sleep_until(give_up.unwrap_or_else(Instant::now)), if give_up.is_some() => {
                if last_words.is_none_or(|t| Instant::now() < t) {
                    tracing::info!(stall = ?stall, "peer stopped reading: no bytes taken for twice the heartbeat; closing");
                }
                return Ok(false);
            }
        }
    }
    Ok(true)
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
    let cfg = &ctx.config;
    let outbox = session.outbox().clone();
    // Taken for each batch of output and let go when nothing more is waiting.
    let mut wbuf = BytesMut::new();
    let mut events = Vec::new();
    let mut last_read = Instant::now();
    let mut last_write = Instant::now();
    let mut closing_since: Option<Instant> = None;
    let mut fatal = false;
    let mut shutdown_seen = false;
    let mut alarms = ctx.broker.alarms();
    // an alarm raised before this connection came is in force for it too
    let mut blocked = alarms.borrow_and_update().any();
    let mut told_blocked = false;
    session.start();

    loop {
        // While an alarm is raised, a connection that publishes is held: of what it
        // sends, only heartbeat frames are taken (they prove it alive); the rest waits in
        // its buffer, at most HELD_READ_MAX of it, until the alarm clears.
        let holding = blocked && session.has_published();
        // Frames already buffered (a read may carry many).
        if !fatal {
            loop {
                if matches!(session.state(), State::Closed) {
                    break;
                }
                if holding && !codec::starts_with_heartbeat(rbuf) {
                    break;
                }
                match codec::decode(rbuf, &session.limits()) {
                    Ok(Some(frame)) => session.handle(frame),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!(error = %e, "frame error");
                        session.frame_error(&e);
                        rbuf.clear();
                        fatal = true;
                        break;
                    }
                }
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
        if session.has_output() {
            if wbuf.capacity() == 0 {
                wbuf.reserve(WBUF);
            }
            session.write_to(&mut wbuf)?;
            if !write_bounded(stream, &wbuf, &ctx.shutdown, write_stall(session)).await? {
                return Ok(());
            }
            wbuf.clear();
            last_write = Instant::now();
        }
        if outbox.is_empty() && wbuf.capacity() > 0 {
            // going idle: no write buffer, no event buffer, no encoder scratch
            wbuf = BytesMut::new();
            events = Vec::new();
            session.release_buffers();
        }
        if matches!(session.state(), State::Closed) || fatal {
            return Ok(());
        }
        if matches!(session.state(), State::Closing) && closing_since.is_none() {
            closing_since = Some(Instant::now());
        }

        // The one timer.
        let hb = Duration::from_secs(u64::from(session.heartbeat()));
        let mut next = Instant::now() + Duration::from_secs(3600);
        if !session.is_open() && closing_since.is_none() {
            next = next.min(handshake_deadline);
        }
        if !hb.is_zero() && session.is_open() {
            next = next.min(last_read + hb * 2).min(last_write + hb / 2);
        }
        if let Some(t) = closing_since {
            next = next.min(t + cfg.close_timeout);
        }
        let open = session.is_open();
        // As RabbitMQ: only a connection that publishes is blocked and told so; one that
        // only consumes is neither (lapin, for one, sends nothing while told blocked, so
        // telling a consumer would stall its basic.consume).
        let tell_blocked = blocked && session.has_published();
        if open && tell_blocked != told_blocked {
            session.set_blocked(if tell_blocked {
                ctx.broker.current_alarms().reason()
            } else {
                None
            });
            told_blocked = tell_blocked;
            continue;
        }
        // While an alarm is raised, a connection that publishes is read only until
        // HELD_READ_MAX bytes of frames wait (its client sees connection.blocked);
        // consumers keep draining. What it sends is still read, so a peer that goes
        // silent meets the heartbeat timeout like any other; once the held bytes fill
        // the buffer the stall is ours, and the peer is not blamed for it.
        let holding = blocked && session.has_published();
        // Publisher flow control (`confirms`): throttled publishes past MAX_HOLDS.
        let flow_held = session.confirms().is_holding();
        let reading = (!holding || rbuf.len() < HELD_READ_MAX) && !flow_held;
        if !reading {
            last_read = Instant::now();
        }

        tokio::select! {
            _ = ctx.shutdown.cancelled(), if !shutdown_seen => {
                shutdown_seen = true;
                session.shutdown();
            }
            r = alarms.changed() => {
                if r.is_ok() {
                    blocked = alarms.borrow_and_update().any();
                }
            }
            r = read_some(stream, rbuf, WBUF), if reading => {
                if r? == 0 {
                    return Ok(());
                }
                last_read = Instant::now();
            }
            _ = async {
                if outbox.is_empty() {
                    outbox.notified().await;
                }
            }, if open => {
                outbox.drain(&mut events, 256);
                session.on_events(std::mem::take(&mut events));
            }
            settled = session.confirms().ready(), if !session.confirms().is_empty() => {
                session.on_confirms(settled);
            }
            _ = sleep_until(next) => {
                let now = Instant::now();
                if let Some(t) = closing_since {
                    if now >= t + cfg.close_timeout {
                        return Ok(());
                    }
                }
                if !session.is_open() && closing_since.is_none() && now >= handshake_deadline {
                    tracing::debug!("handshake timeout");
                    session.abort();
                    return Ok(());
                }
                if !hb.is_zero() && session.is_open() {
                    if reading && now >= last_read + hb * 2 {
                        tracing::debug!("missed heartbeats");
                        session.abort();
                        return Ok(());
                    }
                    if now >= last_write + hb / 2 {
                        codec::encode(&codec::Frame::Heartbeat(0), &mut wbuf)?;
                        if !write_bounded(stream, &wbuf, &ctx.shutdown, write_stall(session)).await? {
                            return Ok(());
                        }
                        wbuf.clear();
                        last_write = now;
                    }
                }
            }
        }
    }
}

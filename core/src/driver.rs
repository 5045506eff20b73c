//! The one connection driver: the socket loop every protocol shares.
//!
//! An adapter is a codec plus a sans-IO session; it implements [`Protocol`] (decode,
//! session step, encode) and [`drive`] does the rest, once for AMQP, STOMP and MQTT:
//!
//! - one `select!` over shutdown, the socket read, the core's [`Outbox`], the
//!   connection's [`ReplyQueue`], alarm changes and one timer (every branch
//!   cancel-safe);
//! - buffers: the read buffer is let go while the peer is idle ([`read_some`]), the
//!   write buffer and the event vector whenever nothing more is waiting, so an idle
//!   connection holds neither;
//! - heartbeats: one is sent after the protocol's interval without a write, and a peer
//!   silent for the protocol's limit is closed (not while the driver itself is not
//!   reading: that silence is ours);
//! - resource alarms: a connection that has published is read from no more (beyond
//!   what [`Protocol::held_read_max`] allows) while an alarm is raised, and told so if
//!   its protocol can ([`Protocol::blocked`]); consumers keep draining;
//! - publisher flow control: the socket is not read while the reply queue is full or
//!   holds [`crate::replies::MAX_HOLDS`] throttled publishes;
//! - shutdown: the protocol's last words get [`LAST_WORDS`] to leave; a peer that takes
//!   no bytes for [`Protocol::write_stall`] is given up on.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;

use crate::io::read_some;
use crate::{Alarms, CoreError, OutEvent, Outbox, ReplyQueue};

/// Deliveries taken from the outbox per wake-up, at most.
pub const BATCH: usize = 256;
/// The write buffer taken for a batch of output (it grows for larger batches), and
/// the step by which a read buffer holding part of a frame grows.
pub const WBUF: usize = 8 << 10;
/// How long the last bytes to a peer (a goodbye at shutdown) may take before the
/// connection is dropped without them.
pub const LAST_WORDS: Duration = Duration::from_secs(1);
/// A write buffer that grew past this during a burst is let go afterwards.
const WBUF_KEEP_MAX: usize = 1 << 20;

/// Where a session is in its life, as the driver needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Reading, decoding, delivering.
    Open,
    /// No more reading: the connection ends once the reply queue is empty and what is
    /// encoded is written (STOMP's DISCONNECT with receipts pending).
    Draining,
    /// The connection ends once what is encoded is written.
    Closed,
}

/// Why [`drive`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The session closed the connection ([`Status::Closed`] or [`Status::Draining`]).
    Closed,
    /// The peer closed its side.
    PeerClosed,
    /// Nothing came from the peer for [`Timing::silence`].
    Silent,
    /// The peer took no bytes for [`Protocol::write_stall`], or the last words after
    /// shutdown did not leave in time.
    WriteStalled,
    /// The `kick` token given to [`drive`] was cancelled, not by shutdown (MQTT
    /// session takeover).
    Kicked,
    /// Shutdown was requested while a write was in progress (nothing more is written).
    Shutdown,
}

/// The session's clocks, asked for before each wait.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timing {
    /// Send a heartbeat ([`Protocol::heartbeat`]) after this long without a write.
    pub heartbeat: Option<Duration>,
    /// Close after this long without a read.
    pub silence: Option<Duration>,
    /// The session's own deadline (handshake, close wait): [`Protocol::deadline`]
    /// is called once it passes.
    pub deadline: Option<Instant>,
}

/// What the connection writes next, in order: encoded bytes, except that large bodies
/// stay the shared `Bytes` they are (a large message to many subscribers is not copied
/// into each one's write buffer).
#[derive(Default, Debug)]
pub struct Out {
    /// Encoded bytes and large bodies; `buf` follows the last of them.
    chunks: Vec<Bytes>,
    buf: BytesMut,
}

impl Out {
    /// The buffer to encode into, taken ([`WBUF`]) if it was let go.
    pub fn buf(&mut self) -> &mut BytesMut {
        if self.buf.capacity() == 0 {
            self.buf.reserve(WBUF);
        }
        &mut self.buf
    }

    /// Appends what `encoded` holds and leaves it empty: when nothing is waiting here
    /// the two buffers trade places (no copy, no allocation), else the bytes are copied.
    pub fn take_from(&mut self, encoded: &mut BytesMut) {
        if encoded.is_empty() {
            return;
        }
        if self.buf.is_empty() {
            std::mem::swap(&mut self.buf, encoded);
        } else {
            self.buf.extend_from_slice(encoded);
        }
        encoded.clear();
    }

    /// Appends `body` without copying it (after what `buf` holds so far).
    pub fn share(&mut self, body: Bytes) {
        if !self.buf.is_empty() {
            self.chunks.push(self.buf.split().freeze());
        }
        self.chunks.push(body);
    }

    /// Whether nothing is waiting to be written.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.buf.is_empty()
    }

    /// Bytes waiting to be written.
    pub fn len(&self) -> usize {
        self.chunks.iter().map(Bytes::len).sum::<usize>() + self.buf.len()
    }

    fn clear(&mut self) {
        self.chunks.clear();
        self.buf.clear();
    }

    /// The chunks in order (the write buffer last).
    fn parts(&self) -> impl Iterator<Item = &[u8]> {
        self.chunks
            .iter()
            .map(|c| &c[..])
            .chain(std::iter::once(&self.buf[..]))
    }

    /// The parts split off so far (encoded bytes and shared bodies), before `buf`.
    pub fn chunks(&self) -> &[Bytes] {
        &self.chunks
    }

    /// Writes everything, in order, and empties `self` (its buffer keeps its room).
    /// For tests and one-off writes; [`drive`] writes with its own bounds.
    pub async fn write_to<S: AsyncWrite + Unpin>(&mut self, stream: &mut S) -> std::io::Result<()> {
        for c in self.chunks.drain(..) {
            stream.write_all(&c).await?;
        }
        stream.write_all(&self.buf).await?;
        self.buf.clear();
        Ok(())
    }
}

/// A protocol as the driver sees it: a codec plus a sans-IO session. Every method is
/// synchronous; the driver owns the socket, the buffers and the clocks.
pub trait Protocol {
    /// One decoded frame (packet) from the peer.
    type Frame;
    /// A reply that waits in the connection's [`ReplyQueue`].
    type Reply;
    /// The error a connection ends with (I/O, or the protocol's own).
    type Error: From<std::io::Error>;

    /// Decodes one frame from the front of `buf`. `None`: more bytes are needed, or
    /// the bytes are a violation, which the session has answered (its status says so).
    fn decode(&mut self, buf: &mut BytesMut) -> Option<Self::Frame>;
    /// The session step for one frame: core calls, replies encoded into `out` or
    /// queued in the reply queue.
    fn step(&mut self, frame: Self::Frame, out: &mut Out) -> Result<(), Self::Error>;
    /// Encodes whatever else the session owes (queued frames, retained messages).
    fn encode(&mut self, out: &mut Out) -> Result<(), Self::Error>;

    /// Where the core hands this connection its deliveries.
    fn outbox(&self) -> &Arc<Outbox>;
    /// How many outbox events the session takes now (0: none, e.g. before login, or
    /// while MQTT's in-flight window is full).
    fn delivery_room(&self) -> usize;
    /// Turns events from the outbox into frames (`events` is left empty).
    fn deliver(&mut self, events: &mut Vec<OutEvent>, out: &mut Out) -> Result<(), Self::Error>;

    /// The connection's ordered replies (waiting for durability and flow control).
    fn replies(&mut self) -> &mut ReplyQueue<Self::Reply>;
    /// Replies that left the queue, in order (`Err`: the store failed).
    fn replied(
        &mut self,
        ready: Vec<(Self::Reply, Result<(), CoreError>)>,
        out: &mut Out,
    ) -> Result<(), Self::Error>;
    /// Replies waiting before the socket is read no more.
    fn max_replies(&self) -> usize {
        usize::MAX
    }

    /// Where the session is.
    fn status(&self) -> Status;
    /// The session's clocks.
    fn timing(&self) -> Timing;
    /// Encodes a heartbeat.
    fn heartbeat(&mut self, out: &mut Out) -> Result<(), Self::Error>;
    /// [`Timing::deadline`] passed.
    fn deadline(&mut self);
    /// Shutdown: queue the protocol's goodbye (or close).
    fn shutdown(&mut self);

    /// Whether this connection has published (alarms hold only publishers).
    fn has_published(&self) -> bool;
    /// Bytes a publisher held by an alarm may still have read and not processed (0:
    /// it is not read at all).
    fn held_read_max(&self) -> usize {
        0
    }
    /// Whether the next frame in `buf` may be decoded while an alarm holds this
    /// connection (AMQP: heartbeats only).
    fn decode_held(&self, _buf: &[u8]) -> bool {
        true
    }
    /// Tells the peer it is blocked by an alarm (`Some(reason)`) or no longer
    /// (`None`); `false`: not now (before the handshake), ask again later.
    fn blocked(&mut self, _reason: Option<&'static str>) -> bool {
        true
    }
    /// A refused login's delay before its answer is written, if one was just made.
    fn take_login_hold(&mut self) -> Option<Duration> {
        None
    }
    /// Whether output is owed beyond the outbox (the driver goes round again).
    fn more_ready(&self) -> bool {
        false
    }
    /// A write that takes no bytes for this long gives the peer up.
    fn write_stall(&self) -> Option<Duration> {
        None
    }
    /// Going idle: let go of buffers kept between batches.
    fn release_buffers(&mut self) {}
    /// Idle for a while ([`Outbox::note_idle`]): let go of the memory the last traffic
    /// left for more of it (in-flight tables, the consumed queues' maps).
    fn release_idle(&mut self) {}
}

/// What the driver keeps between wake-ups (buffers and clocks).
struct Loop {
    rbuf: BytesMut,
    out: Out,
    events: Vec<OutEvent>,
    last_read: Instant,
    last_write: Instant,
    blocked: bool,
    told_blocked: bool,
    shutdown_seen: bool,
    /// The alarm sender is gone (the broker is going away): not waited on again.
    alarms_gone: bool,
}

/// How a connection is stopped from outside.
#[derive(Clone, Copy)]
pub struct Stop<'a> {
    /// Cancelled at shutdown (of the broker, or of this connection from the
    /// management API): the protocol says goodbye ([`Protocol::shutdown`]).
    pub shutdown: &'a CancellationToken,
    /// A child token of `shutdown`, cancelled on its own to end the connection at
    /// once ([`End::Kicked`]); one token to wait for, not two.
    pub kick: Option<&'a CancellationToken>,
}

impl<'a> Stop<'a> {
    /// Stopped by shutdown only.
    pub fn shutdown(shutdown: &'a CancellationToken) -> Stop<'a> {
        Stop {
            shutdown,
            kick: None,
        }
    }

    /// The token to wait for: `kick` when there is one (shutdown cancels it too).
    fn token(&self) -> &'a CancellationToken {
        self.kick.unwrap_or(self.shutdown)
    }

    /// Whether a cancelled [`Stop::token`] means the connection was kicked.
    fn kicked(&self) -> bool {
        self.kick.is_some_and(|k| k.is_cancelled()) && !self.shutdown.is_cancelled()
    }
}

/// Serves one connection with `proto` until it ends. `rbuf` may hold bytes already
/// read (the protocol header, a first packet); it is left empty or let go.
pub async fn drive<S, P>(
    stream: &mut S,
    proto: &mut P,
    rbuf: &mut BytesMut,
    stop: Stop<'_>,
    mut alarms: tokio::sync::watch::Receiver<Alarms>,
) -> Result<End, P::Error>
where
    S: AsyncRead + AsyncWrite + Unpin,
    P: Protocol,
{
    let outbox = proto.outbox().clone();
    let mut l = Loop {
        rbuf: std::mem::take(rbuf),
        out: Out::default(),
        events: Vec::new(),
        last_read: Instant::now(),
        last_write: Instant::now(),
        // an alarm raised before this connection came is in force for it too
        blocked: alarms.borrow_and_update().any(),
        told_blocked: false,
        shutdown_seen: false,
        alarms_gone: false,
    };
    loop {
        let more = produce(proto, &outbox, &mut l)?;
        if let Some(hold) = proto.take_login_hold() {
            // Slows password guessing down: one refusal per delay per source address
            // and per user name, however many connections ask at once.
            if !hold.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(hold) => {}
                    _ = stop.token().cancelled() => {}
                }
            }
        }
        if !l.out.is_empty() {
            if let Some(end) = write(stream, &l.out, stop, proto.write_stall()).await? {
                return Ok(end);
            }
            l.out.clear();
            l.last_write = Instant::now();
        }
        if !more || l.out.buf.capacity() > WBUF_KEEP_MAX {
            // going idle: let go of what a burst left allocated
            l.out = Out::default();
            l.events = Vec::new();
            proto.release_buffers();
            if outbox.take_release_request() {
                // idle since the sweep asked (see `Outbox::note_idle`): let go of what
                // the last traffic left allocated for more of it
                outbox.release_idle();
                proto.replies().release_idle();
                proto.release_idle();
            } else {
                outbox.note_idle();
            }
        }
        match proto.status() {
            Status::Closed => return Ok(End::Closed),
            Status::Draining if proto.replies().is_empty() => return Ok(End::Closed),
            _ => {}
        }
        let holding = l.blocked && proto.has_published();
        if proto.status() == Status::Open && holding != l.told_blocked {
            let reason = if holding {
                alarms.borrow().reason()
            } else {
                None
            };
            if proto.blocked(reason) {
                l.told_blocked = holding;
                continue;
            }
        }
        if let Some(end) = wait(stream, proto, &outbox, &mut l, stop, &mut alarms, more).await? {
            return Ok(end);
        }
    }
}

/// Decodes and steps the buffered frames, hands over ready replies and deliveries, and
/// encodes what the session owes. Returns whether more is ready to go out at once.
fn produce<P: Protocol>(proto: &mut P, outbox: &Outbox, l: &mut Loop) -> Result<bool, P::Error> {
    let holding = l.blocked && proto.has_published();
    while proto.status() == Status::Open && (!holding || proto.decode_held(&l.rbuf)) {
        match proto.decode(&mut l.rbuf) {
            Some(frame) => proto.step(frame, &mut l.out)?,
            None => break,
        }
    }
    if l.rbuf.is_empty() && l.rbuf.capacity() > 0 {
        // An empty buffer split from a frame that filled its allocation still holds
        // that allocation (a whole large frame, until the next one): let it go with it.
        l.rbuf = BytesMut::new();
    }
    if proto.status() != Status::Closed && !proto.replies().is_empty() {
        let mut ready = Vec::new();
        proto.replies().take_ready(&mut ready, None);
        if !ready.is_empty() {
            proto.replied(ready, &mut l.out)?;
        }
    }
    proto.encode(&mut l.out)?;
    let room = proto.delivery_room().min(BATCH);
    if room > 0 && proto.status() == Status::Open {
        outbox.drain(&mut l.events, room);
        if !l.events.is_empty() {
            proto.deliver(&mut l.events, &mut l.out)?;
            proto.encode(&mut l.out)?;
        }
    }
    let room = proto.delivery_room() > 0 && proto.status() == Status::Open;
    Ok((room && !outbox.is_empty()) || proto.more_ready())
}

/// Writes `out`. Once shutdown is requested (or was before) the write gets
/// [`LAST_WORDS`] more to finish, but a peer that does not read cannot hold up the
/// broker's shutdown; with `stall`, a peer that takes no bytes for that long is given
/// up on. `Some`: the connection ends.
async fn write<S: AsyncWrite + Unpin>(
    stream: &mut S,
    out: &Out,
    stop: Stop<'_>,
    stall: Option<Duration>,
) -> std::io::Result<Option<End>> {
    if stop.kicked() {
        return Ok(Some(End::Kicked));
    }
    let mut last_words = stop
        .shutdown
        .is_cancelled()
        .then(|| Instant::now() + LAST_WORDS);
    for part in out.parts() {
        let mut off = 0;
        while let Some(rest) = part.get(off..).filter(|r| !r.is_empty()) {
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
                _ = stop.token().cancelled(), if last_words.is_none() => {
                    if stop.kicked() {
                        return Ok(Some(End::Kicked));
                    }
                    last_words = Some(Instant::now() + LAST_WORDS);
                }
                _ = sleep_until(give_up.unwrap_or_else(Instant::now)), if give_up.is_some() => {
                    if last_words.is_none_or(|t| Instant::now() < t) {
                        tracing::info!(stall = ?stall, "peer stopped reading: no bytes taken for twice the heartbeat; closing");
                        return Ok(Some(End::WriteStalled));
                    }
                    return Ok(Some(End::Shutdown));
                }
            }
        }
    }
    Ok(None)
}

/// Waits for the next thing to do: a read, a delivery, a reply, an alarm change, the
/// timer or shutdown. `Some`: the connection ends.
async fn wait<S, P>(
    stream: &mut S,
    proto: &mut P,
    outbox: &Outbox,
    l: &mut Loop,
    stop: Stop<'_>,
    alarms: &mut tokio::sync::watch::Receiver<Alarms>,
    more: bool,
) -> Result<Option<End>, P::Error>
where
    S: AsyncRead + AsyncWrite + Unpin,
    P: Protocol,
{
    let status = proto.status();
    let holding = l.blocked && proto.has_published();
    let reading = status == Status::Open
        && (!holding || l.rbuf.len() < proto.held_read_max())
        && proto.replies().len() < proto.max_replies()
        && !proto.replies().is_holding();
    if !reading {
        // the silence while not reading is ours, not the peer's
        l.last_read = Instant::now();
    }
    let timer = l.timers(&proto.timing(), reading).next();
    let deliveries = status == Status::Open && proto.delivery_room() > 0;
    let replies = status != Status::Closed && !proto.replies().is_empty();
    tokio::select! {
        _ = stop.token().cancelled(), if !l.shutdown_seen => {
            if stop.kicked() {
                return Ok(Some(End::Kicked));
            }
            l.shutdown_seen = true;
            proto.shutdown();
        }
        r = alarms.changed(), if !l.alarms_gone => {
            match r {
                Ok(()) => l.blocked = alarms.borrow_and_update().any(),
                // a closed channel is ready at once: waiting on it again would spin
                Err(_) => l.alarms_gone = true,
            }
        }
        r = read_some(stream, &mut l.rbuf, WBUF), if reading => {
            if r? == 0 {
                return Ok(Some(End::PeerClosed));
            }
            l.last_read = Instant::now();
        }
        _ = outbox.notified(), if deliveries && !more => {}
        _ = std::future::ready(()), if more => {}
        done = proto.replies().ready(), if replies => {
            proto.replied(done, &mut l.out)?;
        }
        _ = sleep_until(timer.unwrap_or_else(Instant::now)), if timer.is_some() => {
            // the clocks again (not kept across the wait: the task stays small)
            let t = proto.timing();
            let now = Instant::now();
            if t.deadline.is_some_and(|d| now >= d) {
                proto.deadline();
            }
            if t.silence.filter(|_| reading).is_some_and(|d| now >= l.last_read + d) {
                return Ok(Some(End::Silent));
            }
            if t.heartbeat.is_some_and(|d| now >= l.last_write + d) {
                proto.heartbeat(&mut l.out)?;
                // counted as written now: the heartbeat leaves with the next write
                l.last_write = now;
            }
        }
    }
    Ok(None)
}

impl Loop {
    /// The earliest of the session's clocks (`Some` at most once).
    fn timers(&self, t: &Timing, reading: bool) -> impl Iterator<Item = Instant> {
        let send_at = t.heartbeat.map(|d| self.last_write + d);
        let silent_at = t.silence.filter(|_| reading).map(|d| self.last_read + d);
        [send_at, silent_at, t.deadline]
            .into_iter()
            .flatten()
            .min()
            .into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn shared_bodies_keep_their_place_and_memory() {
        let body = Bytes::from(vec![7u8; 100]);
        let mut out = Out::default();
        out.buf().extend_from_slice(b"head1");
        out.share(body.clone());
        out.buf().extend_from_slice(b"tail");
        assert_eq!(out.chunks().len(), 2);
        assert_eq!(out.chunks()[1].as_ptr(), body.as_ptr(), "the same memory");
        assert_eq!(out.len(), 5 + 100 + 4);
        let mut wire = Vec::new();
        out.write_to(&mut wire).await.unwrap();
        let mut want = b"head1".to_vec();
        want.extend_from_slice(&body);
        want.extend_from_slice(b"tail");
        assert_eq!(wire, want);
        assert!(out.is_empty());
    }

    /// A line protocol: each line is echoed, `quit` closes, shutdown says `bye`.
    struct Lines {
        outbox: Arc<Outbox>,
        replies: ReplyQueue<()>,
        closed: bool,
        bye: bool,
        silence: Option<Duration>,
    }

    impl Lines {
        fn new(silence: Option<Duration>) -> Lines {
            Lines {
                outbox: Outbox::new(4),
                replies: ReplyQueue::default(),
                closed: false,
                bye: false,
                silence,
            }
        }
    }

    impl Protocol for Lines {
        type Frame = BytesMut;
        type Reply = ();
        type Error = std::io::Error;

        fn decode(&mut self, buf: &mut BytesMut) -> Option<BytesMut> {
            let end = buf.iter().position(|b| *b == b'\n')?;
            Some(buf.split_to(end + 1))
        }
        fn step(&mut self, line: BytesMut, out: &mut Out) -> std::io::Result<()> {
            if &line[..] == b"quit\n" {
                self.closed = true;
            } else {
                out.buf().extend_from_slice(&line);
            }
            Ok(())
        }
        fn encode(&mut self, out: &mut Out) -> std::io::Result<()> {
            if std::mem::take(&mut self.bye) {
                out.buf().extend_from_slice(b"bye\n");
            }
            Ok(())
        }
        fn outbox(&self) -> &Arc<Outbox> {
            &self.outbox
        }
        fn delivery_room(&self) -> usize {
            BATCH
        }
        fn deliver(&mut self, events: &mut Vec<OutEvent>, _: &mut Out) -> std::io::Result<()> {
            events.clear();
            Ok(())
        }
        fn replies(&mut self) -> &mut ReplyQueue<()> {
            &mut self.replies
        }
        fn replied(
            &mut self,
            _: Vec<((), Result<(), CoreError>)>,
            _: &mut Out,
        ) -> std::io::Result<()> {
            Ok(())
        }
        fn status(&self) -> Status {
            if self.closed {
                Status::Closed
            } else {
                Status::Open
            }
        }
        fn timing(&self) -> Timing {
            Timing {
                silence: self.silence,
                ..Timing::default()
            }
        }
        fn heartbeat(&mut self, _: &mut Out) -> std::io::Result<()> {
            Ok(())
        }
        fn deadline(&mut self) {}
        fn shutdown(&mut self) {
            self.bye = true;
            self.closed = true;
        }
        fn has_published(&self) -> bool {
            false
        }
    }

    fn alarms() -> tokio::sync::watch::Receiver<Alarms> {
        tokio::sync::watch::channel(Alarms::default()).1
    }

    async fn read_until(peer: &mut tokio::io::DuplexStream, want: &[u8]) -> Vec<u8> {
        use tokio::io::AsyncReadExt;
        let mut got = Vec::new();
        while !got.ends_with(want) {
            let mut b = [0u8; 64];
            let n = peer.read(&mut b).await.unwrap();
            assert!(n > 0, "closed before {want:?}: {got:?}");
            got.extend_from_slice(&b[..n]);
        }
        got
    }

    #[tokio::test]
    async fn frames_are_stepped_and_answered_until_the_session_closes() {
        let (mut peer, mut sock) = tokio::io::duplex(1024);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(async move {
            let mut p = Lines::new(None);
            let mut rbuf = BytesMut::new();
            drive(
                &mut sock,
                &mut p,
                &mut rbuf,
                Stop::shutdown(&shutdown),
                alarms(),
            )
            .await
        });
        peer.write_all(b"one\ntw").await.unwrap();
        assert_eq!(read_until(&mut peer, b"one\n").await, b"one\n");
        peer.write_all(b"o\nquit\nnever\n").await.unwrap();
        assert_eq!(read_until(&mut peer, b"two\n").await, b"two\n");
        assert_eq!(task.await.unwrap().unwrap(), End::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_is_closed_and_shutdown_says_goodbye() {
        let (_peer, mut sock) = tokio::io::duplex(1024);
        let shutdown = CancellationToken::new();
        let mut p = Lines::new(Some(Duration::from_secs(3)));
        let mut rbuf = BytesMut::new();
        let started = Instant::now();
        let end = drive(
            &mut sock,
            &mut p,
            &mut rbuf,
            Stop::shutdown(&shutdown),
            alarms(),
        )
        .await;
        assert_eq!(end.unwrap(), End::Silent);
        assert!(started.elapsed() >= Duration::from_secs(3));

        let (mut peer, mut sock) = tokio::io::duplex(1024);
        let stop = shutdown.clone();
        let task = tokio::spawn(async move {
            let mut p = Lines::new(None);
            let mut rbuf = BytesMut::new();
            drive(
                &mut sock,
                &mut p,
                &mut rbuf,
                Stop::shutdown(&stop),
                alarms(),
            )
            .await
        });
        shutdown.cancel();
        assert_eq!(read_until(&mut peer, b"bye\n").await, b"bye\n");
        assert_eq!(task.await.unwrap().unwrap(), End::Closed);
    }

    #[tokio::test]
    async fn a_kick_ends_the_connection_and_the_peer_closing_too() {
        let (_peer, mut sock) = tokio::io::duplex(1024);
        let shutdown = CancellationToken::new();
        let kick = shutdown.child_token();
        kick.cancel();
        let mut p = Lines::new(None);
        let mut rbuf = BytesMut::new();
        let stop = Stop {
            shutdown: &shutdown,
            kick: Some(&kick),
        };
        let end = drive(&mut sock, &mut p, &mut rbuf, stop, alarms()).await;
        assert_eq!(end.unwrap(), End::Kicked);

        let (peer, mut sock) = tokio::io::duplex(1024);
        drop(peer);
        let mut p = Lines::new(None);
        let end = drive(
            &mut sock,
            &mut p,
            &mut rbuf,
            Stop::shutdown(&shutdown),
            alarms(),
        )
        .await;
        assert_eq!(end.unwrap(), End::PeerClosed);
    }
}

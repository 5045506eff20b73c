//! The accept loop shared by every protocol, after mini-redis's `Listener`.
//!
//! - A connection permit is taken *before* `accept`, so past `limits.max_connections`
//!   new peers wait in the kernel's backlog instead of costing a task and a buffer.
//! - Accept errors (`EMFILE`, `ENFILE`, `ENOBUFS`, ...) back off exponentially, from
//!   10 ms up to 1 s, and never end the loop: a broker must outlive a file-descriptor
//!   storm. The backoff resets after the next successful accept.
//! - Each connection runs in its own task, tracked by the broker's [`TaskTracker`]
//!   so that shutdown can wait for it. A protocol connection (not HTTP) is registered
//!   in the broker's connection registry ([`triad_core::conns`]) as it is accepted,
//!   with a shutdown token of its own (a child of the broker's: cancelling it is how
//!   the management API closes one connection); its one INFO line, at its close, names
//!   `proto`, `peer` (and `via`), `user`, `vhost` and MQTT's `client` from there.
//! - The task runs inside a `conn` span (the same fields, filled in by the adapter) only
//!   while `debug` is enabled: a span is a registry slot, an extension map and a
//!   formatted field string (about 450 bytes) held as long as the connection, idle or
//!   not, and creating and closing it was the largest share of a plain connect's user
//!   CPU. At `info`, the lines a connection logs name their peer or client themselves.
//! - The accept loop never awaits per-peer work: deadlines (handshake, TLS) belong to
//!   the handler, inside the spawned task.
//! - With `listeners.proxy_protocol` (not on HTTP), the task first reads the PROXY
//!   header ([`crate::proxy_protocol`]) and the address in it is the `peer` from then
//!   on: the span's `peer` (the balancer's address is `via`), the open and close log
//!   lines, and the handler's `peer` (loopback rule, logins).
//!
//! A protocol plugs in as a [`Handler`]: any
//! `async fn(TcpStream, SocketAddr, ConnContext) -> ConnResult`. A protocol that can
//! also run over TLS implements [`Service`] (generic over the byte stream), and
//! [`crate::tls::TlsHandler`] turns it into the `Handler` of its TLS listener.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::Either;
use futures_util::FutureExt;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, debug_span, info, warn, Instrument};
use triad_core::conns::{ConnInfo, NewConn, Registration};

use crate::config::Config;

/// The listeners the broker can run: each protocol over plain TCP and over TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proto {
    Amqp,
    Stomp,
    Mqtt,
    Http,
    /// AMQP over TLS (5671).
    Amqps,
    /// STOMP over TLS (61614).
    Stomps,
    /// MQTT over TLS (8883).
    Mqtts,
    /// The HTTP endpoints over TLS (15671).
    Https,
}

impl Proto {
    /// The plain-TCP listeners, always bound.
    pub const ALL: [Proto; 4] = [Proto::Amqp, Proto::Stomp, Proto::Mqtt, Proto::Http];
    /// The TLS listeners, bound only when `tls.cert_file` and `tls.key_file` are set.
    pub const TLS: [Proto; 4] = [Proto::Amqps, Proto::Stomps, Proto::Mqtts, Proto::Https];

    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Amqp => "amqp",
            Proto::Stomp => "stomp",
            Proto::Mqtt => "mqtt",
            Proto::Http => "http",
            Proto::Amqps => "amqps",
            Proto::Stomps => "stomps",
            Proto::Mqtts => "mqtts",
            Proto::Https => "https",
        }
    }

    pub fn is_tls(self) -> bool {
        Proto::TLS.contains(&self)
    }

    /// The protocol spoken inside the transport: `Amqps` -> `Amqp`.
    pub fn plain(self) -> Proto {
        match self {
            Proto::Amqps => Proto::Amqp,
            Proto::Stomps => Proto::Stomp,
            Proto::Mqtts => Proto::Mqtt,
            Proto::Https => Proto::Http,
            p => p,
        }
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Any error a connection ends with; the listener only logs it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How a connection ended: `Ok(reason)` for an orderly close (the reason is logged),
/// `Err(e)` for a protocol violation or I/O error (logged too: what a peer causes is
/// never an `error`-level event).
pub type ConnResult = Result<Cow<'static, str>, BoxError>;

/// What a connection handler gets besides its socket. Cheap to clone.
#[derive(Clone)]
pub struct ConnContext {
    pub proto: Proto,
    pub config: Arc<Config>,
    /// Cancelled when the broker shuts down: close the connection politely (AMQP
    /// `connection.close` 320, STOMP ERROR, MQTT: just close) and return.
    pub shutdown: CancellationToken,
    /// The broker core every adapter talks to.
    pub broker: Arc<triad_core::Broker>,
    /// MQTT's broker-wide state: client-id registry, retained messages, `$SYS`.
    pub mqtt: Arc<triad_mqtt::MqttState>,
    /// The connection's entry in the broker's registry (`None` in a listener's own
    /// context and over HTTP, whose WebSockets register when they upgrade).
    pub conn: Option<Arc<ConnInfo>>,
    /// The subject CN of the client certificate the TLS handshake verified (`None` over
    /// plain TCP, without `tls.verify_peer`, or when the client sent no certificate).
    /// AMQP offers SASL EXTERNAL with it; STOMP and MQTT log in as it with
    /// `auth.ssl_cert_login` (RabbitMQ's `ssl_cert_login_from = common_name`).
    pub peer_cert_cn: Option<String>,
    /// The HTTP listener's request, WebSocket and connection slots.
    pub http: Arc<crate::websocket::Slots>,
    /// A replication leader's status (`None`: a standalone broker), for `/api/cluster`
    /// and `/metrics`.
    pub cluster: Option<triad_cluster::leader::StatusHandle>,
}

/// A protocol's connection driver. Implemented for every
/// `Fn(TcpStream, SocketAddr, ConnContext) -> impl Future<Output = ConnResult>`,
/// so an `async fn serve(stream, peer, ctx) -> ConnResult` plugs in directly.
pub trait Handler: Send + Sync + 'static {
    fn serve(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        ctx: ConnContext,
    ) -> impl Future<Output = ConnResult> + Send + 'static + use<Self>;
}

impl<F, Fut> Handler for F
where
    F: Fn(TcpStream, SocketAddr, ConnContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ConnResult> + Send + 'static,
{
    fn serve(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        ctx: ConnContext,
    ) -> impl Future<Output = ConnResult> + Send + 'static + use<F, Fut> {
        self(stream, peer, ctx)
    }
}

/// A byte stream a protocol can be served over: a `TcpStream` or a TLS stream.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

/// A protocol served over any [`Stream`], so that the same code runs on the plain and
/// the TLS listener. Cheap to clone (the TLS handler clones it into each connection).
pub trait Service: Clone + Send + Sync + 'static {
    fn serve<S: Stream>(
        &self,
        stream: S,
        peer: SocketAddr,
        ctx: ConnContext,
    ) -> impl Future<Output = ConnResult> + Send + 'static + use<Self, S>;
}

/// A handler that closes at once (tests of the listener itself).
#[cfg(test)]
pub async fn not_implemented(
    _stream: TcpStream,
    _peer: SocketAddr,
    _ctx: ConnContext,
) -> ConnResult {
    Ok(Cow::Borrowed("protocol not implemented yet"))
}

const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// One bound socket and what to do with its connections.
pub struct Listener<H> {
    listener: TcpListener,
    handler: Arc<H>,
    ctx: ConnContext,
    /// Shared by the listeners that count toward `limits.max_connections`; `None` =
    /// unlimited.
    limit: Option<Arc<Semaphore>>,
    tracker: TaskTracker,
    /// Read a PROXY protocol header before anything else.
    proxy_protocol: bool,
}

impl<H: Handler> Listener<H> {
    pub fn new(
        listener: TcpListener,
        handler: H,
        ctx: ConnContext,
        limit: Option<Arc<Semaphore>>,
        tracker: TaskTracker,
    ) -> Listener<H> {
        let proxy_protocol =
            ctx.config.listeners.proxy_protocol && ctx.proto.plain() != Proto::Http;
        Listener {
            listener,
            handler: Arc::new(handler),
            ctx,
            limit,
            tracker,
            proxy_protocol,
        }
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts until `ctx.shutdown` is cancelled. Dropping the returned future (or its
    /// return) closes the listening socket; connection tasks go on until they finish.
    pub async fn run(self) {
        let shutdown = self.ctx.shutdown.clone();
        tokio::select! {
            () = shutdown.cancelled() => {}
            () = self.accept_loop() => {}
        }
        debug!(proto = %self.ctx.proto, "listener stopped");
    }

    async fn accept_loop(&self) {
        let proto = self.ctx.proto;
        loop {
            let permit = match &self.limit {
                Some(sem) => match sem.clone().acquire_owned().await {
                    Ok(p) => Some(p),
                    // Closed semaphore: only at shutdown.
                    Err(_) => return,
                },
                None => None,
            };
            let (stream, peer) = self.accept().await;
            // Small frames (heartbeats, acks) must not wait for Nagle.
            if let Err(e) = stream.set_nodelay(true) {
                debug!(%proto, %peer, error = %e, "set_nodelay failed");
            }
            if self.proxy_protocol {
                self.spawn_proxied(stream, peer, permit);
                continue;
            }
            let span = debug_span!(
                "conn",
                %proto,
                %peer,
                user = tracing::field::Empty,
                vhost = tracing::field::Empty,
                client = tracing::field::Empty
            );
            span.in_scope(|| debug!("connection opened"));
            let (ctx, reg) = connection(&self.ctx, peer, None);
            // The handler's future with `map`, not inside an async block: a future an
            // async block awaits is moved into a second slot beside the one it was
            // captured in, and the task is as large as both for the whole connection.
            let serve = self.handler.serve(stream, peer, ctx);
            spawn_conn(&self.tracker, span, reg, serve, move |result, info| {
                log_close(proto, info, result);
                drop::<Option<OwnedSemaphorePermit>>(permit);
            });
        }
    }

    /// A connection behind a PROXY protocol header: the header is read in the task,
    /// under its deadline, and its address is the peer from then on. A missing or
    /// malformed header closes the connection.
    fn spawn_proxied(
        &self,
        mut stream: TcpStream,
        via: SocketAddr,
        permit: Option<OwnedSemaphorePermit>,
    ) {
        let proto = self.ctx.proto;
        let span = debug_span!(
            "conn",
            %proto,
            peer = tracing::field::Empty,
            %via,
            user = tracing::field::Empty,
            vhost = tracing::field::Empty,
            client = tracing::field::Empty
        );
        let handler = Arc::clone(&self.handler);
        let ctx = self.ctx.clone();
        // Boxed: the header phase's buffer is not kept in the task for the connection's
        // life; `then` holds either the header future or the handler's, never both.
        let shutdown = self.ctx.shutdown.clone();
        let header = Box::pin(async move {
            let r = tokio::select! {
                () = shutdown.cancelled() => Err(crate::proxy_protocol::ProxyError::Shutdown),
                r = crate::proxy_protocol::read_header(&mut stream, via) => r,
            };
            (stream, r)
        });
        let serve = header.then(move |(stream, r)| match r {
            Ok(peer) => {
                tracing::Span::current().record("peer", tracing::field::display(peer));
                debug!("connection opened");
                let (ctx, reg) = connection(&ctx, peer, Some(via));
                let serve = handler.serve(stream, peer, ctx);
                Either::Left(registered(reg, serve).map(move |(result, reg)| {
                    log_close(proto, reg.as_ref().map(|r| &**r.info()), result);
                }))
            }
            Err(e) => {
                info!(%via, %proto, error = %e, "connection refused: PROXY protocol header");
                Either::Right(std::future::ready(()))
            }
        });
        let serve = serve.map(move |()| drop::<Option<OwnedSemaphorePermit>>(permit));
        if span.is_disabled() {
            self.tracker.spawn(serve);
        } else {
            self.tracker.spawn(serve.instrument(span));
        }
    }

    /// Accepts one connection, backing off on errors for as long as they last.
    async fn accept(&self) -> (TcpStream, SocketAddr) {
        let mut backoff = BACKOFF_MIN;
        loop {
            match self.listener.accept().await {
                // On a dual-stack `[::]` listener an IPv4 peer is `::ffff:a.b.c.d`: every
                // use of the address (loopback-only logins, logs, per-address limits)
                // sees the IPv4 address it is.
                Ok((stream, peer)) => {
                    return (
                        stream,
                        SocketAddr::new(peer.ip().to_canonical(), peer.port()),
                    )
                }
                Err(e) => {
                    warn!(
                        proto = %self.ctx.proto,
                        error = %e,
                        retry_in = ?backoff,
                        "accept failed"
                    );
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }
}

/// The context of one accepted connection, and its registration: a protocol
/// connection gets an entry in the broker's registry and a shutdown token of its own
/// (a child of the broker's); HTTP keeps the listener's (its WebSockets register when
/// they upgrade, see [`crate::websocket`]).
fn connection(
    ctx: &ConnContext,
    peer: SocketAddr,
    via: Option<SocketAddr>,
) -> (ConnContext, Option<Registration>) {
    let protocol = match ctx.proto.plain() {
        Proto::Amqp => "amqp",
        Proto::Stomp => "stomp",
        Proto::Mqtt => "mqtt",
        _ => return (ctx.clone(), None),
    };
    let (ctx, reg) = register(ctx, protocol, peer, via, false);
    (ctx, Some(reg))
}

/// Registers a connection speaking `protocol` (through a WebSocket with `websocket`):
/// its context gets a shutdown token of its own, a child of `ctx`'s.
pub(crate) fn register(
    ctx: &ConnContext,
    protocol: &'static str,
    peer: SocketAddr,
    via: Option<SocketAddr>,
    websocket: bool,
) -> (ConnContext, Registration) {
    let mut ctx = ctx.clone();
    ctx.shutdown = ctx.shutdown.child_token();
    let reg = ctx.broker.connections().register(NewConn {
        protocol,
        tls: ctx.proto.is_tls(),
        websocket,
        peer,
        via,
        close: ctx.shutdown.clone(),
    });
    ctx.conn = Some(Arc::clone(reg.info()));
    (ctx, reg)
}

/// `serve` run as the registered connection `reg` (if any), which it hands back with
/// the result; dropping it unregisters.
pub(crate) fn registered<F: Future>(
    reg: Option<Registration>,
    serve: F,
) -> impl Future<Output = (F::Output, Option<Registration>)> {
    match reg {
        Some(reg) => Either::Left(reg.scope(serve).map(move |r| (r, Some(reg)))),
        None => Either::Right(serve.map(|r| (r, None))),
    }
}

/// Spawns a connection's task: `serve` as the registered connection `reg`, in `span`
/// when it is enabled (the span is not kept at all otherwise), then `done` with the
/// result and the registration's entry.
fn spawn_conn<F>(
    tracker: &TaskTracker,
    span: tracing::Span,
    reg: Option<Registration>,
    serve: F,
    done: impl FnOnce(ConnResult, Option<&ConnInfo>) + Send + 'static,
) where
    F: Future<Output = ConnResult> + Send + 'static,
{
    let task = registered(reg, serve).map(move |(result, reg)| {
        done(result, reg.as_ref().map(|r| &**r.info()));
    });
    if span.is_disabled() {
        tracker.spawn(task);
    } else {
        tracker.spawn(task.instrument(span));
    }
}

/// Logs `connection closed` with `proto`, `peer`, `via` (behind a PROXY header), `user`,
/// `vhost`, MQTT's `client` and `reason`, from the registry's entry: the one INFO line a
/// connection writes (`connection opened` is `debug`; two INFO lines per connection were
/// about a fifth of the broker's CPU per plain MQTT connect). HTTP connections (not
/// registered) only at `debug`, inside their span (which names the peer), so that
/// health probes do not flood the log.
fn log_close(proto: Proto, info: Option<&ConnInfo>, result: ConnResult) {
    let reason: Cow<'_, str> = match &result {
        Ok(r) => Cow::Borrowed(r.as_ref()),
        Err(e) => Cow::Owned(e.to_string()),
    };
    let Some(info) = info else {
        debug!(%proto, reason = ?reason, "connection closed");
        return;
    };
    let peer = info.peer;
    let via = info.via().map(tracing::field::display);
    info.with_login(|user, vhost, client| {
        info!(%proto, %peer, via, user, vhost, client, reason = ?reason, "connection closed");
    });
}

/// A broker over a store in a fresh temporary directory (kept: tests are short-lived).
#[cfg(test)]
pub(crate) fn test_broker() -> Arc<triad_core::Broker> {
    let dir = tempfile::tempdir().expect("tempdir").keep();
    let mut cfg = triad_store::store::StoreConfig::new(dir);
    cfg.segment_size = 1 << 20;
    let store = Arc::new(triad_store::store::Store::open(cfg).expect("store"));
    triad_core::Broker::open(store, triad_core::CoreConfig::default()).expect("broker")
}

/// A context for tests.
#[cfg(test)]
pub(crate) fn test_ctx(proto: Proto, config: Config, shutdown: &CancellationToken) -> ConnContext {
    let broker = test_broker();
    ConnContext {
        proto,
        config: Arc::new(config),
        shutdown: shutdown.clone(),
        mqtt: triad_mqtt::MqttState::new(broker.clone()).expect("mqtt state"),
        broker,
        conn: None,
        peer_cert_cn: None,
        http: Arc::new(crate::websocket::Slots::new(&Config::default(), None)),
        cluster: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::AsyncReadExt;

    fn ctx(proto: Proto, shutdown: &CancellationToken) -> ConnContext {
        test_ctx(proto, Config::default(), shutdown)
    }

    #[tokio::test]
    async fn accepts_closes_and_stops_on_shutdown() {
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let sock = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let l = Listener::new(
            sock,
            not_implemented,
            ctx(Proto::Amqp, &shutdown),
            None,
            tracker.clone(),
        );
        let addr = l.local_addr().expect("addr");
        let task = tokio::spawn(l.run());

        let mut c = TcpStream::connect(addr).await.expect("connect");
        let mut buf = [0u8; 8];
        // The placeholder handler closes at once: EOF.
        assert_eq!(c.read(&mut buf).await.expect("read"), 0);

        shutdown.cancel();
        task.await.expect("listener task");
        tracker.close();
        tracker.wait().await;
        assert!(TcpStream::connect(addr).await.is_err(), "socket closed");
    }

    #[tokio::test]
    async fn connection_limit_holds_peers_in_the_backlog() {
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let sock = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        // A handler that counts its peers and holds each until it closes or shutdown.
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        let hold = move |mut s: TcpStream, _peer: SocketAddr, ctx: ConnContext| {
            counter.fetch_add(1, Ordering::SeqCst);
            async move {
                let mut buf = [0u8; 1];
                tokio::select! {
                    () = ctx.shutdown.cancelled() => {}
                    _ = s.read(&mut buf) => {}
                }
                Ok(Cow::Borrowed("done"))
            }
        };
        let limit = Arc::new(Semaphore::new(1));
        let l = Listener::new(
            sock,
            hold,
            ctx(Proto::Stomp, &shutdown),
            Some(Arc::clone(&limit)),
            tracker.clone(),
        );
        let addr = l.local_addr().expect("addr");
        let task = tokio::spawn(l.run());

        let first = TcpStream::connect(addr).await.expect("connect 1");
        let _second = TcpStream::connect(addr).await.expect("connect 2 (backlog)");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "second peer waits");
        drop(first);
        // The first task ends, its permit goes back, the second peer is accepted.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while accepted.load(Ordering::SeqCst) < 2 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "second peer accepted"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        shutdown.cancel();
        task.await.expect("listener task");
        tracker.close();
        tracker.wait().await;
        assert_eq!(limit.available_permits(), 1);
    }
}

/// A connection's task is as large as its future's largest state for as long as the
/// connection lives, idle or not (see BENCHMARKS.md, idle connections). These bounds
/// catch a buffer, a timer or a TLS stream added inline, or a future kept twice.
#[cfg(test)]
mod task_size {
    use super::*;

    const MAX_TASK_FUTURE: usize = 2 << 10;

    #[tokio::test]
    async fn connection_futures_stay_small() {
        let shutdown = CancellationToken::new();
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let ctx = test_ctx(Proto::Mqtt, Config::default(), &shutdown);
        let stream = || async { TcpStream::connect(addr).await.expect("connect") };
        let sizes = [
            (
                "mqtt",
                std::mem::size_of_val(&crate::adapters::mqtt(stream().await, addr, ctx.clone())),
            ),
            (
                "stomp",
                std::mem::size_of_val(&crate::adapters::stomp(stream().await, addr, ctx.clone())),
            ),
            (
                "amqp",
                std::mem::size_of_val(&crate::adapters::amqp(stream().await, addr, ctx.clone())),
            ),
        ];
        for (proto, size) in sizes {
            assert!(
                size <= MAX_TASK_FUTURE,
                "{proto} connection future is {size} bytes"
            );
        }
    }
}

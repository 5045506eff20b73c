//! The accept loop shared by every protocol, after mini-redis's `Listener`.
//!
//! - A connection permit is taken *before* `accept`, so past `limits.max_connections`
//!   new peers wait in the kernel's backlog instead of costing a task and a buffer.
//! - Accept errors (`EMFILE`, `ENFILE`, `ENOBUFS`, ...) back off exponentially, from
//!   10 ms up to 1 s, and never end the loop: a broker must outlive a file-descriptor
//!   storm. The backoff resets after the next successful accept.
//! - Each connection runs in its own task, tracked by the broker's [`TaskTracker`]
//!   so that shutdown can wait for it, inside a `conn` span carrying `proto`, `peer`,
//!   and (filled in by the adapter) `user`, `vhost` and MQTT's `client`. It is the
//!   connection's only span: each span is a registry slot and a formatted field string
//!   held as long as the connection, idle or not.
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
use tracing::{debug, info, info_span, warn, Instrument};

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
    /// The subject CN of the client certificate the TLS handshake verified (`None` over
    /// plain TCP, without `tls.verify_peer`, or when the client sent no certificate).
    /// AMQP offers SASL EXTERNAL with it; STOMP and MQTT log in as it with
    /// `auth.ssl_cert_login` (RabbitMQ's `ssl_cert_login_from = common_name`).
    pub peer_cert_cn: Option<String>,
    /// The HTTP listener's request, WebSocket and connection slots.
    pub http: Arc<crate::websocket::Slots>,
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
    ) -> impl Future<Output = ConnResult> + Send + 'static;
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
    ) -> impl Future<Output = ConnResult> + Send + 'static {
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
    ) -> impl Future<Output = ConnResult> + Send + 'static;
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
            let span = info_span!(
                "conn",
                %proto,
                %peer,
                user = tracing::field::Empty,
                vhost = tracing::field::Empty,
                client = tracing::field::Empty
            );
            // One INFO line per connection, at its close (see `log_close`).
            span.in_scope(|| debug!("connection opened"));
            // The handler's future with `map`, not inside an async block: a future an
            // async block awaits is moved into a second slot beside the one it was
            // captured in, and the task is as large as both for the whole connection.
            let serve = self.handler.serve(stream, peer, self.ctx.clone());
            self.tracker.spawn(
                serve
                    .map(move |result| {
                        log_close(proto, result);
                        drop::<Option<OwnedSemaphorePermit>>(permit);
                    })
                    .instrument(span),
            );
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
        let span = info_span!(
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
                // An async block owning the handler (the future `serve` returns may borrow
                // it); its captures cost a proxied connection about 150 bytes.
                Either::Left(async move {
                    let result = handler.serve(stream, peer, ctx).await;
                    log_close(proto, result);
                })
            }
            Err(e) => {
                info!(%via, %proto, error = %e, "connection refused: PROXY protocol header");
                Either::Right(std::future::ready(()))
            }
        });
        self.tracker.spawn(
            serve
                .map(move |()| drop::<Option<OwnedSemaphorePermit>>(permit))
                .instrument(span),
        );
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

/// Logs `connection closed reason="<why>"` inside the connection's span, which carries
/// `proto`, `peer` (and `via` behind a PROXY header), `user`, `vhost` and MQTT's
/// `client`: the one INFO line a connection writes (`connection opened` is `debug`;
/// two INFO lines per connection were about a fifth of the broker's CPU per plain MQTT
/// connect). HTTP requests only at `debug`, so that health probes do not flood the log.
fn log_close(proto: Proto, result: ConnResult) {
    let reason: Cow<'_, str> = match &result {
        Ok(r) => Cow::Borrowed(r.as_ref()),
        Err(e) => Cow::Owned(e.to_string()),
    };
    if proto.plain() == Proto::Http {
        debug!(reason = ?reason, "connection closed");
    } else {
        info!(reason = ?reason, "connection closed");
    }
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
        peer_cert_cn: None,
        http: Arc::new(crate::websocket::Slots::new(&Config::default(), None)),
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

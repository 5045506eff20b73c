//! The HTTP listener on hyper: `/health`, the management API ([`crate::mgmt`]) and the
//! WebSocket endpoints ([`crate::websocket`]), over plain TCP or TLS (the
//! [`crate::tls::TlsHandler`] hands this module the decrypted stream).
//!
//! - HTTP/1.1 with keep-alive. A connection takes one of `http.max_requests` slots
//!   while it is open (503 at once when none is free, so a flood costs its own sockets,
//!   never a wait for the next health probe); an upgraded WebSocket gives its slot back.
//! - Each request head must arrive within `limits.handshake_timeout` (measured from
//!   when the server starts waiting for it, so an idle keep-alive connection is closed
//!   after that long too); a head larger than [`MAX_HEAD`] gets 431.
//! - Request bodies: a declared `Content-Length` over `http.max_body_size` gets 413
//!   before anything is read; a chunked body is read up to that bound, then 413.
//!
//! | request | response |
//! |---|---|
//! | `GET /health`, `HEAD /health` | `200 {"status":"ok"}`; `503` with the reason while a resource alarm is raised or the store failed |
//! | other method on `/health` | `405`, with `Allow: GET, HEAD` |
//! | WebSocket upgrade on `/ws`, `/stomp` or `/mqtt` | `101`, then STOMP or MQTT ([`crate::websocket`]) |
//! | `/api/...` | the management API ([`crate::mgmt`]) |
//! | `GET /metrics`, `GET /metrics/per-object` | Prometheus text format, no login ([`crate::mgmt::metrics`]) |
//! | `GET /`, `/ui/...` | the web dashboard ([`crate::mgmt::ui`]) |
//! | other path | `404` |

use std::borrow::Cow;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, ALLOW, CACHE_CONTROL, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;

use crate::listener::{ConnContext, ConnResult, Service, Stream};
use crate::websocket::{Held, Refused, Upgrade};

/// Largest request head (request line and headers) read; hyper's smallest buffer.
pub const MAX_HEAD: usize = 8 << 10;

/// A response body: a whole buffer or a stream of chunks.
pub type Body = BoxBody<Bytes, Infallible>;

/// A response with a JSON body.
pub fn json_response(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// `{"error": error, "reason": reason}` (RabbitMQ's error body) with `status`.
pub fn error_response(status: StatusCode, error: &str, reason: &str) -> Response<Body> {
    let body = serde_json::json!({ "error": error, "reason": reason });
    json_response(status, body.to_string())
}

/// A body streamed from a channel of chunks (large listings are written as they are
/// produced, never built whole in memory).
pub struct ChannelBody(pub tokio::sync::mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|c| c.map(|b| Ok(Frame::data(b))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// Why a request body was not read.
#[derive(Debug, PartialEq, Eq)]
pub enum BodyError {
    /// Larger than `http.max_body_size`.
    TooLarge,
    /// The connection failed while it was read.
    Io,
}

/// Reads a request body of at most `max` bytes.
pub async fn read_body(req: Request<Incoming>, max: usize) -> Result<Bytes, BodyError> {
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(BodyError::TooLarge);
    }
    match Limited::new(req.into_body(), max).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(BodyError::TooLarge),
        Err(_) => Err(BodyError::Io),
    }
}

/// What a connection's requests share.
pub struct ConnState {
    pub ctx: ConnContext,
    pub peer: SocketAddr,
    /// A WebSocket upgrade answered with 101: served once hyper hands the stream over.
    upgrade: Mutex<Option<(hyper::upgrade::OnUpgrade, Upgrade, Held)>>,
}

/// The `/health` answer: 503 while an alarm is raised or the store failed.
fn health(st: &ConnState, method: &Method) -> Response<Body> {
    if method != Method::GET && method != Method::HEAD {
        let mut r = error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed",
            "GET or HEAD",
        );
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    let broker = &st.ctx.broker;
    let (status, body) = if let Err(e) = broker.store().health() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"status": "failed", "reason": format!("store failed: {e}")}),
        )
    } else if let Some(reason) = broker.current_alarms().reason() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"status": "alarm", "reason": reason}),
        )
    } else {
        (StatusCode::OK, serde_json::json!({"status": "ok"}))
    };
    json_response(status, body.to_string())
}

/// Answers a WebSocket upgrade (101, or 403 / 503) and keeps what serving it needs.
fn websocket(st: &ConnState, mut req: Request<Incoming>, u: Upgrade) -> Response<Body> {
    let allowed = &st.ctx.config.http.allowed_origins;
    let taken = if crate::websocket::origin_allowed(u.origin.as_deref(), u.host.as_deref(), allowed)
    {
        st.ctx.http.take()
    } else {
        Err(Refused::Origin)
    };
    match taken {
        Ok(held) => {
            let on = hyper::upgrade::on(&mut req);
            let resp = crate::websocket::accept_response(&u);
            *st.upgrade.lock().unwrap_or_else(|e| e.into_inner()) = Some((on, u, held));
            resp
        }
        Err(why) => {
            let (s, reason) = match why {
                Refused::Origin => (StatusCode::FORBIDDEN, "origin not allowed"),
                Refused::Full => (StatusCode::SERVICE_UNAVAILABLE, "too many connections"),
            };
            tracing::info!(peer = %st.peer, origin = ?u.origin, status = s.as_u16(), "WebSocket upgrade refused");
            error_response(s, reason, reason)
        }
    }
}

/// Routes one request.
async fn handle(req: Request<Incoming>, st: Arc<ConnState>) -> Response<Body> {
    let path = req.uri().path();
    if let Some(u) = crate::websocket::upgrade(&req) {
        return websocket(&st, req, u);
    }
    if path == "/health" {
        let mut r = health(&st, req.method());
        if req.method() == Method::HEAD {
            *r.body_mut() = Full::new(Bytes::new()).boxed();
        }
        return r;
    }
    if path == "/api" || path.starts_with("/api/") {
        return crate::mgmt::handle(req, &st.ctx, st.peer).await;
    }
    if let Some(r) = crate::mgmt::metrics::handle(path, req.method(), &st.ctx).await {
        return r;
    }
    if let Some(r) = crate::mgmt::ui::file(path, req.method()) {
        return r;
    }
    error_response(StatusCode::NOT_FOUND, "not_found", "Not Found")
}

/// [`serve`] as a [`Service`], for the HTTPS listener.
#[derive(Clone, Copy, Debug)]
pub struct Http;

impl Service for Http {
    fn serve<S: Stream>(
        &self,
        stream: S,
        peer: SocketAddr,
        ctx: ConnContext,
    ) -> impl std::future::Future<Output = ConnResult> + Send + 'static + use<S> {
        serve(stream, peer, ctx)
    }
}

/// Serves one HTTP connection on `stream` (plain TCP or TLS); a
/// [`crate::listener::Handler`] for the plain listener.
pub async fn serve<S: Stream>(mut stream: S, peer: SocketAddr, ctx: ConnContext) -> ConnResult {
    let Ok(slot) = ctx.http.requests.clone().try_acquire_owned() else {
        let body = r#"{"error":"service_unavailable","reason":"too many HTTP connections"}"#;
        let response = format!(
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = tokio::time::timeout(std::time::Duration::from_millis(500), async {
            stream.write_all(response.as_bytes()).await?;
            stream.shutdown().await
        })
        .await;
        return Ok(Cow::Borrowed("too many HTTP connections -> 503"));
    };
    let shutdown = ctx.shutdown.clone();
    let head_timeout = ctx.config.limits.handshake_timeout.get();
    let st = Arc::new(ConnState {
        ctx,
        peer,
        upgrade: Mutex::new(None),
    });
    let svc_state = Arc::clone(&st);
    let svc = service_fn(move |req| {
        let st = Arc::clone(&svc_state);
        async move { Ok::<_, Infallible>(handle(req, st).await) }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(head_timeout)
        .max_buf_size(MAX_HEAD);
    let conn = builder
        .serve_connection(TokioIo::new(stream), svc)
        .with_upgrades();
    tokio::pin!(conn);
    let served = tokio::select! {
        r = conn.as_mut() => r,
        () = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    let pending = st.upgrade.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some((on, u, held)) = pending {
        drop(slot);
        let io = match on.await {
            Ok(io) => io,
            Err(e) => return Err(e.into()),
        };
        let ctx = st.ctx.clone();
        drop(st);
        return crate::websocket::serve(TokioIo::new(io), u, peer, ctx, held).await;
    }
    match served {
        Ok(()) => Ok(Cow::Borrowed("closed")),
        Err(e) if e.is_timeout() => Ok(Cow::Borrowed("request head timeout")),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::AsyncReadExt;

    async fn exchange(request: &[u8], timeout: Duration) -> String {
        use crate::config::Config;
        use crate::listener::Proto;
        use crate::units::HumanDuration;
        use tokio_util::sync::CancellationToken;

        let mut config = Config::default();
        config.limits.handshake_timeout = HumanDuration(timeout);
        let ctx = crate::listener::test_ctx(Proto::Http, config, &CancellationToken::new());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(async move {
            let (s, peer) = listener.accept().await.expect("accept");
            serve(s, peer, ctx).await.map(|r| r.into_owned())
        });
        let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        // The server may answer (and close) before it has read all of a large request.
        let _ = client.write_all(request).await;
        let mut out = Vec::new();
        let _ = client.read_to_end(&mut out).await;
        let _ = server.await.expect("server task");
        String::from_utf8(out).expect("utf8")
    }

    #[tokio::test]
    async fn incomplete_head_is_closed_after_the_timeout() {
        let r = exchange(b"GET /health HTTP/1.1\r\n", Duration::from_millis(100)).await;
        assert_eq!(r, "", "closed without a response");
    }

    #[tokio::test]
    async fn oversized_head_gets_431() {
        let mut req = b"GET /health HTTP/1.1\r\n".to_vec();
        while req.len() <= MAX_HEAD {
            req.extend_from_slice(
                b"X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n",
            );
        }
        let r = exchange(&req, Duration::from_secs(5)).await;
        assert!(r.starts_with("HTTP/1.1 431 "), "{r}");
    }

    #[tokio::test]
    async fn serves_health_with_keep_alive() {
        let r = exchange(
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nHEAD /health HTTP/1.1\r\nHost: x\r\n\r\nPOST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            Duration::from_secs(5),
        )
        .await;
        let statuses: Vec<&str> = r
            .split("HTTP/1.1 ")
            .skip(1)
            .map(|s| s.get(..3).unwrap_or(""))
            .collect();
        assert_eq!(statuses, ["200", "200", "405", "404"], "{r}");
        assert!(r.contains("{\"status\":\"ok\"}"), "{r}");
        assert!(r.contains("allow: GET, HEAD\r\n"), "{r}");
    }

    #[tokio::test]
    async fn malformed_requests_get_400() {
        for bad in [
            &b"GET /health\r\n\r\n"[..],
            b"G(T /health HTTP/1.1\r\n\r\n",
            b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n",
        ] {
            let r = exchange(bad, Duration::from_secs(5)).await;
            assert!(r.starts_with("HTTP/1.1 400 "), "{r}");
        }
    }

    #[tokio::test]
    async fn health_is_503_while_an_alarm_is_raised() {
        use crate::config::Config;
        use crate::listener::Proto;
        use tokio_util::sync::CancellationToken;
        let ctx =
            crate::listener::test_ctx(Proto::Http, Config::default(), &CancellationToken::new());
        ctx.broker.set_alarms(triad_core::Alarms {
            memory: true,
            disk: false,
        });
        let st = ConnState {
            ctx,
            peer: "127.0.0.1:1".parse().expect("addr"),
            upgrade: Mutex::new(None),
        };
        let r = health(&st, &Method::GET);
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = r.into_body().collect().await.expect("body").to_bytes();
        assert!(String::from_utf8_lossy(&body).contains("alarm"));
        st.ctx.broker.set_alarms(triad_core::Alarms::default());
        assert_eq!(health(&st, &Method::GET).status(), StatusCode::OK);
    }
}

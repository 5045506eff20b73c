//! A minimal HTTP/1.1 server for the health endpoint, later the management API.
//!
//! One request per connection: the head is read with a deadline
//! (`limits.handshake_timeout`) and a bound ([`MAX_HEAD`]), answered, and the connection
//! closed (`Connection: close`). Routes:
//!
//! | request | response |
//! |---|---|
//! | `GET /health`, `HEAD /health` | `200 {"status":"ok"}` (`application/json`) |
//! | other method on `/health` | `405`, with `Allow: GET, HEAD` |
//! | WebSocket upgrade on `/ws` or `/mqtt` | `101`, then STOMP or MQTT ([`crate::websocket`]) |
//! | other path | `404` |
//! | malformed head | `400`; too large: `431`; not HTTP/1.x: `505` |
//!
//! Parsing is pure ([`parse_head`]) and tested without sockets.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use crate::listener::{ConnContext, ConnResult, Service, Stream};
use crate::websocket::Refused;

/// Largest request head (request line and headers) read.
pub const MAX_HEAD: usize = 8 << 10;
/// How long to drain what the peer still sends after the response, so that closing
/// does not reset the connection before the peer has read the response.
const LINGER: Duration = Duration::from_millis(500);
const LINGER_BYTES: usize = 64 << 10;

/// A parsed request head; the body, if any, is ignored.
#[derive(Debug, PartialEq, Eq)]
pub struct Request<'a> {
    pub method: &'a str,
    /// Path without the query string.
    pub path: &'a str,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok = 200,
    BadRequest = 400,
    Forbidden = 403,
    NotFound = 404,
    MethodNotAllowed = 405,
    RequestTimeout = 408,
    HeadTooLarge = 431,
    ServiceUnavailable = 503,
    VersionNotSupported = 505,
}

impl Status {
    pub fn code(self) -> u16 {
        self as u16
    }

    pub fn reason(self) -> &'static str {
        match self {
            Status::Ok => "OK",
            Status::BadRequest => "Bad Request",
            Status::Forbidden => "Forbidden",
            Status::NotFound => "Not Found",
            Status::MethodNotAllowed => "Method Not Allowed",
            Status::RequestTimeout => "Request Timeout",
            Status::HeadTooLarge => "Request Header Fields Too Large",
            Status::ServiceUnavailable => "Service Unavailable",
            Status::VersionNotSupported => "HTTP Version Not Supported",
        }
    }
}

/// Where the head ends (the index after its blank line), if it is complete. Bare `\n`
/// line ends are accepted, as RFC 9112 §2.2 allows.
pub fn head_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while let Some(off) = buf.get(i..)?.iter().position(|&b| b == b'\n') {
        let nl = i + off;
        let rest = buf.get(nl + 1..)?;
        if rest.starts_with(b"\n") {
            return Some(nl + 2);
        }
        if rest.starts_with(b"\r\n") {
            return Some(nl + 3);
        }
        i = nl + 1;
    }
    None
}

fn is_token(s: &str) -> bool {
    const SPECIAL: &[u8] = b"!#$%&'*+-.^_`|~";
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || SPECIAL.contains(&b))
}

/// Parses a complete head (as delimited by [`head_end`]).
pub fn parse_head(head: &[u8]) -> Result<Request<'_>, Status> {
    let text = std::str::from_utf8(head).map_err(|_| Status::BadRequest)?;
    let mut lines = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    let request_line = lines.next().ok_or(Status::BadRequest)?;
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Status::BadRequest);
    };
    if !is_token(method) {
        return Err(Status::BadRequest);
    }
    match version {
        "HTTP/1.1" | "HTTP/1.0" => {}
        v if v.starts_with("HTTP/") => return Err(Status::VersionNotSupported),
        _ => return Err(Status::BadRequest),
    }
    // Absolute form (`http://host/path`) is legal; keep its path.
    let target = match target.split_once("://") {
        Some((_, rest)) => rest.find('/').and_then(|i| rest.get(i..)).unwrap_or("/"),
        None => target,
    };
    if !target.starts_with('/') && target != "*" {
        return Err(Status::BadRequest);
    }
    let path = target.split(['?', '#']).next().unwrap_or(target);
    for line in lines {
        if line.is_empty() {
            break;
        }
        let (name, _value) = line.split_once(':').ok_or(Status::BadRequest)?;
        if !is_token(name) {
            return Err(Status::BadRequest);
        }
    }
    Ok(Request { method, path })
}

/// The response to a well-formed request: status, extra headers, JSON body.
pub fn route(req: &Request<'_>) -> (Status, &'static str, &'static str) {
    match req.path {
        "/health" => match req.method {
            "GET" | "HEAD" => (Status::Ok, "", r#"{"status":"ok"}"#),
            _ => (
                Status::MethodNotAllowed,
                "Allow: GET, HEAD\r\n",
                r#"{"error":"method not allowed"}"#,
            ),
        },
        _ => (Status::NotFound, "", r#"{"error":"not found"}"#),
    }
}

fn error_body(status: Status) -> &'static str {
    match status {
        Status::HeadTooLarge => r#"{"error":"request head too large"}"#,
        Status::RequestTimeout => r#"{"error":"request timeout"}"#,
        Status::VersionNotSupported => r#"{"error":"HTTP version not supported"}"#,
        Status::Forbidden => r#"{"error":"origin not allowed"}"#,
        Status::ServiceUnavailable => r#"{"error":"too many connections"}"#,
        _ => r#"{"error":"bad request"}"#,
    }
}

/// Writes the whole response for `status`; `with_body = false` for `HEAD`.
pub fn render(status: Status, extra_headers: &str, body: &str, with_body: bool) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Cache-Control: no-store\r\nConnection: close\r\n{}\r\n",
        status.code(),
        status.reason(),
        body.len(),
        extra_headers
    )
    .into_bytes();
    if with_body {
        out.extend_from_slice(body.as_bytes());
    }
    out
}

enum Head {
    Complete(usize),
    TooLarge,
    Eof,
}

async fn read_head<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut Vec<u8>,
) -> std::io::Result<Head> {
    let mut chunk = [0u8; 1024];
    loop {
        if let Some(end) = head_end(buf) {
            return Ok(Head::Complete(end));
        }
        if buf.len() >= MAX_HEAD {
            return Ok(Head::TooLarge);
        }
        let room = (MAX_HEAD - buf.len()).min(chunk.len());
        let n = stream.read(&mut chunk[..room]).await?;
        if n == 0 {
            return Ok(Head::Eof);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
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
    ) -> impl std::future::Future<Output = ConnResult> + Send + 'static {
        serve(stream, peer, ctx)
    }
}

/// Serves one request on `stream` (plain TCP or TLS); a [`crate::listener::Handler`]
/// for the plain listener.
pub async fn serve<S: Stream>(mut stream: S, peer: SocketAddr, ctx: ConnContext) -> ConnResult {
    // A request slot, or 503 at once: a flood of slow requests costs its own sockets,
    // never a wait for the next health probe.
    let Ok(request_slot) = ctx.http.requests.clone().try_acquire_owned() else {
        let s = Status::ServiceUnavailable;
        let _ = tokio::time::timeout(LINGER, async {
            stream
                .write_all(&render(s, "", error_body(s), true))
                .await?;
            stream.shutdown().await
        })
        .await;
        return Ok(Cow::Borrowed("too many HTTP requests -> 503"));
    };
    let deadline = ctx.config.limits.handshake_timeout.get();
    let mut buf = Vec::with_capacity(1024);
    let head = tokio::select! {
        () = ctx.shutdown.cancelled() => return Ok(Cow::Borrowed("shutdown")),
        r = tokio::time::timeout(deadline, read_head(&mut stream, &mut buf)) => r,
    };
    let (response, outcome) = match head {
        Err(_elapsed) => {
            let s = Status::RequestTimeout;
            (
                render(s, "", error_body(s), true),
                Cow::Borrowed("request head timeout"),
            )
        }
        Ok(Err(e)) => return Err(e.into()),
        Ok(Ok(Head::Eof)) => return Ok(Cow::Borrowed("closed before a request")),
        Ok(Ok(Head::TooLarge)) => {
            let s = Status::HeadTooLarge;
            (
                render(s, "", error_body(s), true),
                Cow::Borrowed("request head too large"),
            )
        }
        Ok(Ok(Head::Complete(end))) => match parse_head(buf.get(..end).unwrap_or(&[])) {
            Ok(req) => {
                let head = std::str::from_utf8(buf.get(..end).unwrap_or(&[])).unwrap_or("");
                if let Some(u) = crate::websocket::upgrade(req.method, req.path, head) {
                    let allowed = &ctx.config.http.allowed_origins;
                    let taken = if crate::websocket::origin_allowed(
                        u.origin.as_deref(),
                        u.host.as_deref(),
                        allowed,
                    ) {
                        ctx.http.take()
                    } else {
                        Err(Refused::Origin)
                    };
                    match taken {
                        Ok(held) => {
                            drop(request_slot);
                            let rest = buf.get(end..).unwrap_or(&[]).to_vec();
                            return crate::websocket::serve(stream, rest, u, peer, ctx, held).await;
                        }
                        Err(why) => {
                            let s = match why {
                                Refused::Origin => Status::Forbidden,
                                Refused::Full => Status::ServiceUnavailable,
                            };
                            tracing::info!(%peer, origin = ?u.origin, status = s.code(), "WebSocket upgrade refused");
                            stream
                                .write_all(&render(s, "", error_body(s), true))
                                .await?;
                            stream.shutdown().await?;
                            return Ok(Cow::Owned(format!("WebSocket upgrade -> {}", s.code())));
                        }
                    }
                }
                let (status, headers, body) = route(&req);
                let outcome = format!("{} {} -> {}", req.method, req.path, status.code());
                (
                    render(status, headers, body, req.method != "HEAD"),
                    Cow::Owned(outcome),
                )
            }
            Err(s) => (
                render(s, "", error_body(s), true),
                Cow::Owned(format!("malformed request -> {}", s.code())),
            ),
        },
    };
    stream.write_all(&response).await?;
    stream.shutdown().await?;
    // Lingering close: read what the peer still sends (a body we ignored) for a moment,
    // so the kernel does not answer it with a reset that could destroy the response.
    let drain = async {
        let mut sink = [0u8; 4096];
        let mut total = 0;
        while total < LINGER_BYTES {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Request<'_>, Status> {
        let end = head_end(s.as_bytes()).expect("complete head");
        parse_head(&s.as_bytes()[..end])
    }

    #[test]
    fn head_end_finds_the_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r\n"), Some(18));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\n"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nbody"), Some(27));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: x\r\n"), None);
        assert_eq!(head_end(b""), None);
        assert_eq!(head_end(b"\n"), None);
    }

    #[test]
    fn parses_and_routes() {
        let r = parse("GET /health HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n");
        assert_eq!(
            r,
            Ok(Request {
                method: "GET",
                path: "/health"
            })
        );
        let req = r.expect("ok");
        assert_eq!(route(&req).0, Status::Ok);
        assert_eq!(route(&req).2, r#"{"status":"ok"}"#);
        let q = parse("GET /health?verbose=1 HTTP/1.0\r\n\r\n").expect("ok");
        assert_eq!(q.path, "/health");
        let abs = parse("GET http://h:1/health HTTP/1.1\r\n\r\n").expect("ok");
        assert_eq!(abs.path, "/health");
        let post = parse("POST /health HTTP/1.1\r\n\r\n").expect("ok");
        assert_eq!(route(&post).0, Status::MethodNotAllowed);
        let other = parse("GET /metrics HTTP/1.1\r\n\r\n").expect("ok");
        assert_eq!(route(&other).0, Status::NotFound);
    }

    #[test]
    fn refuses_malformed_heads() {
        for bad in [
            "GET /health\r\n\r\n",
            "GET  /health HTTP/1.1\r\n\r\n",
            "GET /health HTTP/1.1 x\r\n\r\n",
            "G(T /health HTTP/1.1\r\n\r\n",
            "GET health HTTP/1.1\r\n\r\n",
            "GET /health FTP/1.1\r\n\r\n",
            "GET /health HTTP/1.1\r\nno colon here\r\n\r\n",
            "GET /health HTTP/1.1\r\n: empty name\r\n\r\n",
            "\r\n\r\n",
        ] {
            assert_eq!(parse(bad), Err(Status::BadRequest), "{bad:?}");
        }
        assert_eq!(
            parse("GET /health HTTP/2.0\r\n\r\n"),
            Err(Status::VersionNotSupported)
        );
        assert_eq!(
            parse_head(b"GET /\xff HTTP/1.1\r\n\r\n"),
            Err(Status::BadRequest)
        );
    }

    #[test]
    fn renders_head_without_body() {
        let r =
            String::from_utf8(render(Status::Ok, "", r#"{"status":"ok"}"#, false)).expect("utf8");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(r.contains("Content-Length: 15\r\n"));
        assert!(r.ends_with("\r\n\r\n"));
    }

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
        server.await.expect("server task").expect("served");
        String::from_utf8(out).expect("utf8")
    }

    #[tokio::test]
    async fn incomplete_head_times_out_with_408() {
        let r = exchange(b"GET /health HTTP/1.1\r\n", Duration::from_millis(100)).await;
        assert!(r.starts_with("HTTP/1.1 408 "), "{r}");
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
    async fn serves_health_over_a_socket() {
        let r = exchange(
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
            Duration::from_secs(5),
        )
        .await;
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.ends_with("{\"status\":\"ok\"}"), "{r}");
        let r = exchange(b"HEAD /health HTTP/1.1\r\n\r\n", Duration::from_secs(5)).await;
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.ends_with("\r\n\r\n"), "{r}");
    }
}

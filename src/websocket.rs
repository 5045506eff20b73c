//! STOMP and MQTT over WebSocket on the HTTP listener: `GET /ws` (subprotocols
//! `v12.stomp`, `v11.stomp`, `v10.stomp`, as RabbitMQ's Web-STOMP and stompjs use) and
//! `GET /mqtt` (subprotocol `mqtt`, as mqtt.js and paho use).
//!
//! hyper ([`crate::http`]) reads the request; this module recognises the upgrade and
//! answers it (101), and once hyper hands the connection over it bridges the WebSocket
//! to a byte stream (`tokio::io::duplex`) that the protocol adapter serves exactly as it
//! serves a TCP connection: message payloads in, writes out as messages (text for STOMP
//! when the bytes are UTF-8, else binary).

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;

use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper::header::{
    HeaderValue, CONNECTION, SEC_WEBSOCKET_ACCEPT, SEC_WEBSOCKET_PROTOCOL, UPGRADE,
};
use hyper::{HeaderMap, Method, Request, Response, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Message, Role, WebSocketConfig};
use tokio_tungstenite::WebSocketStream;

use crate::listener::{ConnContext, ConnResult, Stream};

/// Bytes a WebSocket message may hold beyond the protocol's own frame or packet limit
/// (an MQTT packet's fixed header).
const MESSAGE_SLACK: u64 = 16;
/// Bytes buffered between the WebSocket and the adapter in each direction.
const PIPE: usize = 64 << 10;

/// Which protocol an upgrade is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Stomp,
    Mqtt,
}

/// A WebSocket upgrade request: the key and the subprotocol chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upgrade {
    pub target: Target,
    pub key: String,
    pub protocol: Option<&'static str>,
    /// The `Origin` header (browsers send it), if any.
    pub origin: Option<String>,
    /// The `Host` header, if any.
    pub host: Option<String>,
}

/// The slots the HTTP listener's connections take, each checked with `try_acquire`
/// (an answer at once, never a wait).
#[derive(Debug)]
pub struct Slots {
    /// `http.max_requests`: requests being read or answered. An upgraded connection
    /// gives its slot back, so WebSocket clients never keep `/health` from answering.
    pub requests: Arc<Semaphore>,
    /// `http.max_websocket_connections`.
    pub websockets: Arc<Semaphore>,
    /// `limits.max_connections`, shared with the TCP listeners; `None` = unlimited.
    pub connections: Option<Arc<Semaphore>>,
    /// Every listener's protocol and bound address, once all are bound (the management
    /// API's `listeners` and port-listener health check).
    pub bound: std::sync::OnceLock<Vec<(crate::listener::Proto, SocketAddr)>>,
}

/// What an upgrade holds for as long as its connection lives.
#[derive(Debug)]
pub struct Held {
    _websocket: OwnedSemaphorePermit,
    _connection: Option<OwnedSemaphorePermit>,
}

/// Why an upgrade is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// 403: a browser page from an origin not in `http.allowed_origins`.
    Origin,
    /// 503: `http.max_websocket_connections` or `limits.max_connections` reached.
    Full,
}

impl Slots {
    /// The slots `[http]` configures; `connections` is the TCP listeners' semaphore.
    pub fn new(config: &crate::config::Config, connections: Option<Arc<Semaphore>>) -> Slots {
        let n = |v: u32| usize::try_from(v).unwrap_or(usize::MAX);
        Slots {
            requests: Arc::new(Semaphore::new(n(config.http.max_requests))),
            websockets: Arc::new(Semaphore::new(n(config.http.max_websocket_connections))),
            connections,
            bound: std::sync::OnceLock::new(),
        }
    }

    /// The bound listeners (empty until they are all bound).
    pub fn listeners(&self) -> &[(crate::listener::Proto, SocketAddr)] {
        self.bound.get().map_or(&[], Vec::as_slice)
    }

    /// Takes a WebSocket slot and a connection slot, or neither.
    pub fn take(&self) -> Result<Held, Refused> {
        let websocket = self
            .websockets
            .clone()
            .try_acquire_owned()
            .map_err(|_| Refused::Full)?;
        let connection = match &self.connections {
            Some(sem) => Some(sem.clone().try_acquire_owned().map_err(|_| Refused::Full)?),
            None => None,
        };
        Ok(Held {
            _websocket: websocket,
            _connection: connection,
        })
    }
}

/// Whether a page from `origin` may open a WebSocket here: no `Origin` (not a
/// browser), `"*"` or the origin listed in `allowed`, or the broker's own origin (its
/// host and port are the `Host` the request was sent to).
pub fn origin_allowed(origin: Option<&str>, host: Option<&str>, allowed: &[String]) -> bool {
    let Some(origin) = origin else {
        return true;
    };
    let origin = origin.trim_end_matches('/');
    if allowed
        .iter()
        .any(|a| a == "*" || a.trim_end_matches('/').eq_ignore_ascii_case(origin))
    {
        return true;
    }
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false; // "null" (sandboxed pages, file://) and anything malformed
    };
    let Some(host) = host else {
        return false;
    };
    let default_port = match scheme.to_ascii_lowercase().as_str() {
        "http" | "ws" => ":80",
        "https" | "wss" => ":443",
        _ => "",
    };
    let norm = |a: &str| {
        let a = a.to_ascii_lowercase();
        match a.strip_suffix(default_port) {
            Some(s) if !default_port.is_empty() => s.to_owned(),
            _ => a,
        }
    };
    norm(authority) == norm(host)
}

/// Recognises an upgrade to `/ws`, `/stomp` or `/mqtt`; `None` for anything else.
pub fn upgrade<B>(req: &Request<B>) -> Option<Upgrade> {
    upgrade_parts(req.method(), req.uri().path(), req.headers())
}

fn upgrade_parts(method: &Method, path: &str, headers: &HeaderMap) -> Option<Upgrade> {
    let target = match path {
        "/ws" | "/stomp" => Target::Stomp,
        "/mqtt" => Target::Mqtt,
        _ => return None,
    };
    if method != Method::GET {
        return None;
    }
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    if !header("upgrade")?.eq_ignore_ascii_case("websocket") {
        return None;
    }
    let key = header("sec-websocket-key")?.to_string();
    let offered: Vec<&str> = header("sec-websocket-protocol")
        .map(|v| v.split(',').map(str::trim).collect())
        .unwrap_or_default();
    let supported: &[&'static str] = match target {
        Target::Stomp => &["v12.stomp", "v11.stomp", "v10.stomp", "stomp"],
        Target::Mqtt => &["mqtt", "mqttv3.1"],
    };
    let protocol = supported.iter().copied().find(|p| offered.contains(p));
    Some(Upgrade {
        target,
        key,
        protocol,
        origin: header("origin").map(str::to_owned),
        host: header("host").map(str::to_owned),
    })
}

/// The `101 Switching Protocols` response.
pub fn accept_response(u: &Upgrade) -> Response<crate::http::Body> {
    let mut r = Response::new(Full::new(bytes::Bytes::new()).boxed());
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(CONNECTION, HeaderValue::from_static("Upgrade"));
    if let Ok(v) = HeaderValue::from_str(&derive_accept_key(u.key.as_bytes())) {
        h.insert(SEC_WEBSOCKET_ACCEPT, v);
    }
    if let Some(p) = u.protocol {
        h.insert(SEC_WEBSOCKET_PROTOCOL, HeaderValue::from_static(p));
    }
    r
}

/// Serves the protocol over the upgraded `stream` (hyper answered 101 and handed it
/// over) until either side closes, holding `held` (its connection slots) until then.
pub async fn serve<S: Stream>(
    stream: S,
    u: Upgrade,
    peer: SocketAddr,
    ctx: ConnContext,
    held: Held,
) -> ConnResult {
    // the largest message the protocol takes (`limits.max_message_size`, see the
    // STOMP frame and MQTT packet limits); the adapter bounds its frames within it
    let limits = &ctx.config.limits;
    let max = match u.target {
        Target::Stomp => limits.stomp_frame_max(),
        Target::Mqtt => limits.mqtt_packet_max(),
    }
    .saturating_add(MESSAGE_SLACK);
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    let mut config = WebSocketConfig::default();
    config.max_message_size = Some(max);
    config.max_frame_size = Some(max);
    let ws = WebSocketStream::from_raw_socket(stream, Role::Server, Some(config)).await;
    let (adapter_side, pump_side) = tokio::io::duplex(PIPE);
    let text = u.target == Target::Stomp;
    let pump = tokio::spawn(bridge(ws, pump_side, text));
    // registered as the protocol it speaks, with a shutdown token of its own
    let protocol = match u.target {
        Target::Stomp => "stomp",
        Target::Mqtt => "mqtt",
    };
    let (ctx, reg) = crate::listener::register(&ctx, protocol, peer, None, true);
    let served = match u.target {
        Target::Stomp => {
            reg.scope(crate::adapters::stomp(adapter_side, peer, ctx))
                .await
        }
        Target::Mqtt => {
            reg.scope(crate::adapters::mqtt(adapter_side, peer, ctx))
                .await
        }
    };
    drop(reg);
    // the adapter dropped its end: the bridge sees EOF, closes the WebSocket and ends
    let _ = pump.await;
    drop(held);
    served.map(|r| Cow::Owned(format!("websocket: {r}")))
}

/// Moves WebSocket message payloads into the pipe and pipe bytes out as messages.
async fn bridge<S: Stream>(
    mut ws: WebSocketStream<S>,
    mut pipe: tokio::io::DuplexStream,
    text: bool,
) {
    let mut buf = vec![0u8; 16 << 10];
    loop {
        tokio::select! {
            msg = ws.next() => match msg {
                Some(Ok(Message::Binary(b))) => {
                    if pipe.write_all(&b).await.is_err() { break; }
                }
                Some(Ok(Message::Text(t))) => {
                    if pipe.write_all(t.as_bytes()).await.is_err() { break; }
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                // pings are answered by tungstenite; pongs and raw frames need nothing
                Some(Ok(_)) => {}
            },
            n = pipe.read(&mut buf) => match n {
                Ok(0) | Err(_) => {
                    let _ = ws.close(None).await;
                    return;
                }
                Ok(n) => {
                    let chunk = buf.get(..n).unwrap_or(&[]);
                    let msg = match (text, std::str::from_utf8(chunk)) {
                        (true, Ok(s)) => Message::text(s.to_string()),
                        _ => Message::binary(chunk.to_vec()),
                    };
                    if ws.send(msg).await.is_err() { break; }
                }
            },
        }
    }
    // the peer went away: closing our end of the pipe ends the adapter's connection
    drop(pipe);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn recognises_upgrades_and_picks_a_subprotocol() {
        let h = headers(&[
            ("host", "x"),
            ("upgrade", "websocket"),
            ("connection", "Upgrade"),
            ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
            ("sec-websocket-protocol", "v10.stomp, v12.stomp"),
        ]);
        let u = upgrade_parts(&Method::GET, "/ws", &h).expect("upgrade");
        assert_eq!(u.target, Target::Stomp);
        assert_eq!(u.protocol, Some("v12.stomp"));
        // RFC 6455's example key and accept value
        let r = accept_response(&u);
        assert_eq!(r.status(), StatusCode::SWITCHING_PROTOCOLS);
        assert_eq!(
            r.headers()
                .get(SEC_WEBSOCKET_ACCEPT)
                .and_then(|v| v.to_str().ok()),
            Some("s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
        );
        assert!(upgrade_parts(&Method::GET, "/health", &h).is_none());
        assert!(upgrade_parts(&Method::POST, "/ws", &h).is_none());
        assert!(upgrade_parts(&Method::GET, "/ws", &headers(&[("host", "x")])).is_none());
        let m = upgrade_parts(
            &Method::GET,
            "/mqtt",
            &headers(&[
                ("upgrade", "WebSocket"),
                ("sec-websocket-key", "k"),
                ("sec-websocket-protocol", "mqtt"),
            ]),
        )
        .expect("mqtt");
        assert_eq!((m.target, m.protocol), (Target::Mqtt, Some("mqtt")));
    }

    #[test]
    fn origins_are_checked_against_the_host_and_the_allowed_list() {
        let none: &[String] = &[];
        assert!(origin_allowed(None, Some("b:15672"), none), "not a browser");
        assert!(origin_allowed(
            Some("http://b:15672"),
            Some("b:15672"),
            none
        ));
        assert!(origin_allowed(Some("http://B"), Some("b:80"), none));
        assert!(origin_allowed(Some("https://b"), Some("b:443"), none));
        assert!(!origin_allowed(
            Some("http://evil.example"),
            Some("b:15672"),
            none
        ));
        assert!(!origin_allowed(
            Some("http://b:8080"),
            Some("b:15672"),
            none
        ));
        assert!(!origin_allowed(Some("null"), Some("b:15672"), none));
        assert!(!origin_allowed(Some("http://b:15672"), None, none));
        let listed = ["https://app.example".to_owned()];
        assert!(origin_allowed(
            Some("https://app.example"),
            Some("b"),
            &listed
        ));
        assert!(!origin_allowed(
            Some("https://other.example"),
            Some("b"),
            &listed
        ));
        assert!(origin_allowed(
            Some("https://x"),
            Some("b"),
            &["*".to_owned()]
        ));
    }
}

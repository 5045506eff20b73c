//! STOMP and MQTT over WebSocket on the HTTP listener, with a real WebSocket client.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::raw::StompClient;
use common::{http_get, TestBroker, TEST_CONFIG};
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use triad_core::testing::eventually_blocking;

async fn open(
    addr: std::net::SocketAddr,
    path: &str,
    protocol: &str,
) -> tokio_tungstenite::WebSocketStream<tokio::net::TcpStream> {
    let mut req = format!("ws://{addr}{path}").into_client_request().unwrap();
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", protocol.parse().unwrap());
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (ws, resp) = tokio_tungstenite::client_async(req, tcp).await.unwrap();
    assert_eq!(
        resp.headers().get("Sec-WebSocket-Protocol").unwrap(),
        protocol
    );
    ws
}

async fn next_payload(
    ws: &mut tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>,
) -> Vec<u8> {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), ws.next())
            .await
            .expect("message timeout")
            .expect("stream ended")
            .expect("websocket error");
        match m {
            Message::Text(t) => return t.as_bytes().to_vec(),
            Message::Binary(b) => return b.to_vec(),
            _ => continue,
        }
    }
}

#[test]
fn stomp_over_websocket_subscribes_sends_and_receives() {
    let broker = TestBroker::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut ws = open(broker.http_addr(), "/ws", "v12.stomp").await;
        ws.send(Message::text(
            "CONNECT\naccept-version:1.2\nhost:localhost\nlogin:guest\npasscode:guest\nheart-beat:0,0\n\n\0",
        ))
        .await
        .unwrap();
        let connected = next_payload(&mut ws).await;
        assert!(connected.starts_with(b"CONNECTED\n"), "{connected:?}");
        ws.send(Message::text(
            "SUBSCRIBE\nid:0\ndestination:/queue/ws-q\nreceipt:r1\n\n\0",
        ))
        .await
        .unwrap();
        assert!(next_payload(&mut ws).await.starts_with(b"RECEIPT\n"));
        ws.send(Message::text(
            "SEND\ndestination:/queue/ws-q\n\nhello over ws\0",
        ))
        .await
        .unwrap();
        let msg = String::from_utf8(next_payload(&mut ws).await).unwrap();
        assert!(msg.starts_with("MESSAGE\n"), "{msg}");
        assert!(msg.ends_with("hello over ws\0"), "{msg}");
    });
}

#[test]
fn mqtt_over_websocket_connects_and_round_trips() {
    let broker = TestBroker::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut ws = open(broker.http_addr(), "/mqtt", "mqtt").await;
        // CONNECT 3.1.1, clean session, client id "w", guest/guest
        let connect = vec![
            0x10, 27, 0, 4, b'M', b'Q', b'T', b'T', 4, 0xC2, 0, 60, 0, 1, b'w', 0, 5, b'g', b'u',
            b'e', b's', b't', 0, 5, b'g', b'u', b'e', b's', b't',
        ];
        ws.send(Message::binary(connect)).await.unwrap();
        assert_eq!(next_payload(&mut ws).await, vec![0x20, 2, 0, 0]);
        // SUBSCRIBE id 1 to "w/t" QoS 0 → SUBACK
        let sub = vec![0x82, 8, 0, 1, 0, 3, b'w', b'/', b't', 0];
        ws.send(Message::binary(sub)).await.unwrap();
        assert_eq!(next_payload(&mut ws).await, vec![0x90, 3, 0, 1, 0]);
        // PUBLISH QoS 0 to "w/t" → delivered back
        let publish = vec![0x30, 7, 0, 3, b'w', b'/', b't', b'h', b'i'];
        ws.send(Message::binary(publish.clone())).await.unwrap();
        assert_eq!(next_payload(&mut ws).await, publish);
    });
}

/// A raw WebSocket upgrade to `path` with `Origin: origin` (if any); returns the socket
/// and the response's status code (the socket stays open after a 101).
fn raw_upgrade(addr: SocketAddr, path: &str, origin: Option<&str>) -> (TcpStream, u16) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let origin = origin
        .map(|o| format!("Origin: {o}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Protocol: v12.stomp\r\n{origin}\r\n"
    )
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {head:?}"));
    (s, code)
}

/// A STOMP CONNECT over a real WebSocket client, sending `Origin: origin`; the first
/// frame back.
async fn stomp_ws_connect(addr: SocketAddr, origin: &str, login: bool) -> String {
    let mut req = format!("ws://{addr}/ws").into_client_request().unwrap();
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", "v12.stomp".parse().unwrap());
    req.headers_mut().insert("Origin", origin.parse().unwrap());
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut ws, _) = tokio_tungstenite::client_async(req, tcp).await.unwrap();
    let creds = if login {
        "login:guest\npasscode:guest\n"
    } else {
        ""
    };
    ws.send(Message::text(format!(
        "CONNECT\naccept-version:1.2\nhost:localhost\n{creds}heart-beat:0,0\n\n\0"
    )))
    .await
    .unwrap();
    String::from_utf8(next_payload(&mut ws).await).unwrap()
}

/// Issue 14 item 8: a WebSocket upgrade from another site's page is refused (403),
/// the broker's own origin and listed ones are not; and the password-less login is
/// `[auth] anonymous`, off over WebSocket unless `anonymous_websocket` is set, so a
/// page that does get through still has to log in.
#[test]
fn websocket_origins_are_checked_and_anonymous_login_is_off_over_websocket() {
    let broker = TestBroker::start();
    let http = broker.http_addr();
    let (_s, code) = raw_upgrade(http, "/ws", Some("http://evil.example"));
    assert_eq!(code, 403, "an upgrade from a foreign origin");
    let (_s, code) = raw_upgrade(http, "/mqtt", Some("null"));
    assert_eq!(code, 403, "an upgrade from an opaque origin");
    let (_s, code) = raw_upgrade(http, "/ws", Some(&format!("http://{http}")));
    assert_eq!(code, 101, "the broker's own origin");
    let (_s, code) = raw_upgrade(http, "/ws", None);
    assert_eq!(code, 101, "no Origin: not a browser");

    let rt = tokio::runtime::Runtime::new().unwrap();
    let own = format!("http://{http}");
    let anon = rt.block_on(stomp_ws_connect(http, &own, false));
    assert!(
        anon.starts_with("ERROR\n"),
        "anonymous over WebSocket: {anon}"
    );
    let guest = rt.block_on(stomp_ws_connect(http, &own, true));
    assert!(guest.starts_with("CONNECTED\n"), "{guest}");
    // over TCP from loopback the anonymous login stays on by default
    StompClient::connect(broker.stomp_addr(), Duration::from_secs(10))
        .expect("anonymous STOMP over TCP from loopback");
    drop(broker);

    let broker = TestBroker::start_with_config(&format!(
        "{TEST_CONFIG}\n[http]\nallowed_origins = [\"https://app.example\"]\n\n\
         [auth]\nanonymous_websocket = true\n"
    ));
    let http = broker.http_addr();
    let (_s, code) = raw_upgrade(http, "/ws", Some("https://app.example"));
    assert_eq!(code, 101, "a listed origin");
    let (_s, code) = raw_upgrade(http, "/ws", Some("https://other.example"));
    assert_eq!(code, 403);
    let anon = rt.block_on(stomp_ws_connect(http, "https://app.example", false));
    assert!(
        anon.starts_with("CONNECTED\n"),
        "anonymous_websocket = true: {anon}"
    );
}

/// Issue 14 item 8: the anonymous login does not use `default_pass`: with guest's
/// password changed under `[[users]]`, a CONNECT without login from loopback still
/// logs in as guest, and with `anonymous = "off"` it is refused.
#[test]
fn anonymous_login_does_not_depend_on_default_pass() {
    let hash = triad_core::PasswordHash::new("changed")
        .unwrap()
        .to_base64();
    let users = format!(
        "\n[[users]]\nname = \"guest\"\npassword_hash = \"{hash}\"\ntags = [\"administrator\"]\n"
    );
    let broker = TestBroker::start_with_config(&format!("{TEST_CONFIG}{users}"));
    StompClient::connect(broker.stomp_addr(), Duration::from_secs(10))
        .expect("anonymous login while guest's password is not default_pass");
    drop(broker);
    let broker =
        TestBroker::start_with_config(&format!("{TEST_CONFIG}\n[auth]\nanonymous = \"off\"\n"));
    assert!(StompClient::connect(broker.stomp_addr(), Duration::from_secs(10)).is_err());
}

/// Issue 14 item 10: WebSocket clients count toward `limits.max_connections` and
/// `http.max_websocket_connections` (past either, an upgrade gets 503), and they do not
/// hold the HTTP request slots, so `/health` answers with 70 of them open (it used to
/// time out past 64).
#[test]
fn websocket_clients_are_counted_and_health_always_answers() {
    let broker = TestBroker::start();
    let http = broker.http_addr();
    let t = Instant::now();
    let mut open = Vec::new();
    for _ in 0..70 {
        let (s, code) = raw_upgrade(http, "/ws", None);
        assert_eq!(code, 101);
        open.push(s);
    }
    let (code, _) = http_get(http, "/health");
    assert_eq!(code, 200, "health with 70 WebSocket clients open");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    drop(open);
    drop(broker);

    // limits.max_connections = 4 (each idle TCP listener keeps one in reserve for its
    // next accept): WebSocket upgrades take the rest, then get 503
    let broker = TestBroker::start_with_config(&format!("{TEST_CONFIG}\nmax_connections = 4\n"));
    let http = broker.http_addr();
    let mut open = Vec::new();
    let refused = (0..5).any(|_| {
        let (s, code) = raw_upgrade(http, "/ws", None);
        open.push(s);
        code == 503
    });
    assert!(
        refused,
        "5 WebSocket clients under limits.max_connections = 4"
    );
    drop(open);
    // their slots come back once the broker sees them closed
    let _ws = eventually_blocking("the slots to come back", Duration::from_secs(10), || {
        let (s, code) = raw_upgrade(http, "/ws", None);
        (code == 101).then_some(s)
    });
    drop(broker);

    // http.max_websocket_connections = 1
    let broker = TestBroker::start_with_config(&format!(
        "{TEST_CONFIG}\n[http]\nmax_websocket_connections = 1\n"
    ));
    let http = broker.http_addr();
    let (_ws1, code) = raw_upgrade(http, "/ws", None);
    assert_eq!(code, 101);
    let (_ws2, code) = raw_upgrade(http, "/ws", None);
    assert_eq!(code, 503, "past http.max_websocket_connections");
    let (code, _) = http_get(http, "/health");
    assert_eq!(code, 200);
}

//! STOMP and MQTT over WebSocket on the HTTP listener, with a real WebSocket client.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::TestBroker;
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

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
            "CONNECT\naccept-version:1.2\nhost:localhost\nheart-beat:0,0\n\n\0",
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
        // CONNECT 3.1.1, clean session, client id "w"
        let connect = vec![
            0x10, 13, 0, 4, b'M', b'Q', b'T', b'T', 4, 2, 0, 60, 0, 1, b'w',
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

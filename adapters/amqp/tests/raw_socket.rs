//! Raw-socket tests: bytes no client library would send.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

mod common;

use std::time::Duration;

use amq_protocol::protocol::{connection, AMQPClass};
use bytes::BytesMut;
use common::Server;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use triad_amqp::codec::{decode, encode, Frame, Limits, PROTOCOL_HEADER};

const T: Duration = Duration::from_secs(10);

async fn read_frame(s: &mut TcpStream, buf: &mut BytesMut) -> Option<Frame> {
    let limits = Limits { frame_max: 1 << 20 };
    loop {
        if let Some(f) = decode(buf, &limits).unwrap() {
            return Some(f);
        }
        let n = tokio::time::timeout(T, s.read_buf(buf))
            .await
            .unwrap()
            .unwrap();
        if n == 0 {
            return None;
        }
    }
}

fn close_code(f: &Frame) -> Option<u16> {
    match f {
        Frame::Method(0, c) => match c.as_ref() {
            AMQPClass::Connection(connection::AMQPMethod::Close(c)) => Some(c.reply_code),
            _ => None,
        },
        _ => None,
    }
}

async fn send(s: &mut TcpStream, f: Frame) {
    let mut out = BytesMut::new();
    encode(&f, &mut out).unwrap();
    s.write_all(&out).await.unwrap();
}

fn conn_method(m: connection::AMQPMethod) -> Frame {
    Frame::Method(0, Box::new(AMQPClass::Connection(m)))
}

#[tokio::test]
async fn bad_protocol_header_gets_ours_and_a_close() {
    let s = Server::start().await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"AMQP\x01\x01\x00\x0a").await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(T, c.read_to_end(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, PROTOCOL_HEADER);
}

#[tokio::test]
async fn oversized_frame_before_tune_is_a_frame_error() {
    let s = Server::start().await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(PROTOCOL_HEADER).await.unwrap();
    let mut buf = BytesMut::new();
    let start = read_frame(&mut c, &mut buf).await.unwrap();
    assert!(matches!(start, Frame::Method(0, _)));
    // Only the header of a 1 GiB frame: refused without waiting for its payload.
    c.write_all(&[1, 0, 0, 0x40, 0, 0, 0]).await.unwrap();
    let close = read_frame(&mut c, &mut buf).await.unwrap();
    assert_eq!(close_code(&close), Some(501));
    assert!(read_frame(&mut c, &mut buf).await.is_none());
}

async fn login(s: &Server, user: &str, pass: &str, vhost: &str) -> Option<u16> {
    login_stream(s, user, pass, vhost).await.2
}

/// Logs in; the socket, its read buffer and the close code if the login was refused.
async fn login_stream(
    s: &Server,
    user: &str,
    pass: &str,
    vhost: &str,
) -> (TcpStream, BytesMut, Option<u16>) {
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(PROTOCOL_HEADER).await.unwrap();
    let mut buf = BytesMut::new();
    read_frame(&mut c, &mut buf).await.unwrap();
    send(
        &mut c,
        conn_method(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: Default::default(),
            mechanism: "PLAIN".into(),
            response: format!("\0{user}\0{pass}").into(),
            locale: "en_US".into(),
        })),
    )
    .await;
    let f = read_frame(&mut c, &mut buf).await.unwrap();
    if let Some(code) = close_code(&f) {
        return (c, buf, Some(code));
    }
    send(
        &mut c,
        conn_method(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 10,
            frame_max: 4096,
            heartbeat: 0,
        })),
    )
    .await;
    send(
        &mut c,
        conn_method(connection::AMQPMethod::Open(connection::Open {
            virtual_host: vhost.into(),
        })),
    )
    .await;
    let f = read_frame(&mut c, &mut buf).await.unwrap();
    let code = close_code(&f);
    (c, buf, code)
}

fn is_close_ok(f: &Frame) -> bool {
    matches!(f, Frame::Method(0, c) if matches!(c.as_ref(), AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))))
}

/// What amqplib does: connection.close written ahead of frames it still had buffered.
/// The broker answers close-ok and reads and drops what follows until the client closes,
/// so the client gets a clean end of stream, not a reset (EPIPE / ECONNRESET).
#[tokio::test]
async fn frames_after_connection_close_are_drained_until_the_peer_closes() {
    let s = Server::start().await;
    let (mut c, mut buf, refused) = login_stream(&s, "guest", "guest", "/").await;
    assert_eq!(refused, None);
    send(
        &mut c,
        conn_method(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
    .await;
    let f = read_frame(&mut c, &mut buf).await.unwrap();
    assert!(is_close_ok(&f), "{f:?}");
    // 8 MiB more: far beyond what the socket buffers hold, so every write below only
    // completes if the broker keeps reading (and a closed socket would reset us).
    let chunk = vec![0xCEu8; 64 << 10];
    for _ in 0..128 {
        tokio::time::timeout(T, c.write_all(&chunk))
            .await
            .unwrap()
            .unwrap();
    }
    c.shutdown().await.unwrap();
    let mut rest = Vec::new();
    let n = tokio::time::timeout(T, c.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, 0, "nothing after close-ok: {rest:?}");
}

/// The drain is bounded: a client that neither sends nor closes after close-ok has its
/// socket closed after `close_timeout`.
#[tokio::test]
async fn drain_after_close_ok_ends_at_close_timeout() {
    let cfg = triad_amqp::AmqpConfig {
        close_timeout: Duration::from_millis(200),
        ..Default::default()
    };
    let s = Server::with_config(cfg).await;
    let (mut c, mut buf, refused) = login_stream(&s, "guest", "guest", "/").await;
    assert_eq!(refused, None);
    send(
        &mut c,
        conn_method(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
    .await;
    assert!(is_close_ok(&read_frame(&mut c, &mut buf).await.unwrap()));
    // end of stream from the broker while we keep our side open
    assert!(read_frame(&mut c, &mut buf).await.is_none());
}

#[tokio::test]
async fn bad_credentials_and_unknown_vhost() {
    let s = Server::start().await;
    assert_eq!(login(&s, "guest", "wrong", "/").await, Some(403));
    assert_eq!(login(&s, "guest", "guest", "nope").await, Some(530));
    assert_eq!(login(&s, "guest", "guest", "/").await, None);
}

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
        return Some(code);
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
    close_code(&f)
}

#[tokio::test]
async fn bad_credentials_and_unknown_vhost() {
    let s = Server::start().await;
    assert_eq!(login(&s, "guest", "wrong", "/").await, Some(403));
    assert_eq!(login(&s, "guest", "guest", "nope").await, Some(530));
    assert_eq!(login(&s, "guest", "guest", "/").await, None);
}

//! The connection state machine without sockets: frames in, frames out.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
use bytes::Bytes;
use triad_amqp::codec::Frame;
use triad_amqp::session::{parse_amqplain, parse_plain, Session, State};
use triad_amqp::AmqpConfig;
use triad_core::{Broker, CoreConfig};
use triad_store::store::{Store, StoreConfig};

fn broker(dir: &std::path::Path) -> Arc<Broker> {
    let mut sc = StoreConfig::new(dir);
    sc.segment_size = 1 << 20;
    sc.cq_entries_per_file = 1024;
    Broker::open(Arc::new(Store::open(sc).unwrap()), CoreConfig::default()).unwrap()
}

fn m(ch: u16, c: AMQPClass) -> Frame {
    Frame::Method(ch, Box::new(c))
}

fn open_session(b: Arc<Broker>) -> Session {
    let s = open_session_hb(b, 30);
    assert_eq!(s.heartbeat(), 30);
    s
}

/// Opens a session whose client answers `connection.tune` with `heartbeat`.
fn open_session_hb(b: Arc<Broker>, heartbeat: u16) -> Session {
    let mut s = Session::new(b, AmqpConfig::default(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    s.start();
    assert!(matches!(
        s.take_frames().as_slice(),
        [Frame::Method(0, c)] if matches!(c.as_ref(), AMQPClass::Connection(connection::AMQPMethod::Start(_)))
    ));
    s.handle(m(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: Default::default(),
            mechanism: "PLAIN".into(),
            response: "\0guest\0guest".into(),
            locale: "en_US".into(),
        })),
    ));
    let tune = s.take_frames();
    match tune.as_slice() {
        [Frame::Method(0, c)] => match c.as_ref() {
            AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => {
                assert_eq!(
                    (t.channel_max, t.frame_max, t.heartbeat),
                    (2047, 131072, 60)
                );
            }
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
    s.handle(m(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 0,
            frame_max: 65536,
            heartbeat,
        })),
    ));
    assert_eq!(s.limits().frame_max, 65536);
    s.handle(m(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    ));
    assert!(s.is_open());
    s.take_frames();
    s
}

fn close_code(frames: &[Frame]) -> Option<(u16, u16)> {
    frames.iter().find_map(|f| match f {
        Frame::Method(ch, c) => match c.as_ref() {
            AMQPClass::Connection(connection::AMQPMethod::Close(c)) => Some((*ch, c.reply_code)),
            AMQPClass::Channel(channel::AMQPMethod::Close(c)) => Some((*ch, c.reply_code)),
            _ => None,
        },
        _ => None,
    })
}

/// The client's `tune-ok` has the last word, as RabbitMQ takes it: 0 vetoes heartbeats
/// (the server then sends none and expects none), a value above ours is cut to ours.
#[test]
fn tune_ok_heartbeat_zero_disables_heartbeats() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = broker(dir.path());
    assert_eq!(open_session_hb(b.clone(), 0).heartbeat(), 0);
    assert_eq!(open_session_hb(b.clone(), 10).heartbeat(), 10);
    assert_eq!(open_session_hb(b, 600).heartbeat(), 60);
}

#[test]
fn sasl_responses() {
    assert_eq!(parse_plain(b"\0u\0p"), Some(("u".into(), "p".into())));
    assert_eq!(parse_plain(b"u"), None);
    // AMQPLAIN: table body without its length: LOGIN S "u", PASSWORD S "p".
    let mut t = Vec::new();
    t.extend_from_slice(b"\x05LOGINS\x00\x00\x00\x01u");
    t.extend_from_slice(b"\x08PASSWORDS\x00\x00\x00\x01p");
    assert_eq!(parse_amqplain(&t), Some(("u".into(), "p".into())));
    assert_eq!(parse_amqplain(b"\x05LOG"), None);
}

#[test]
fn method_on_unopened_channel_is_504() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_session(broker(dir.path()));
    s.handle(m(
        3,
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: 1,
            global: false,
        })),
    ));
    assert_eq!(close_code(&s.take_frames()), Some((0, 504)));
    assert_eq!(s.state(), State::Closing);
    s.handle(m(
        0,
        AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
    ));
    assert_eq!(s.state(), State::Closed);
}

#[test]
fn content_out_of_order_is_505() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_session(broker(dir.path()));
    s.handle(m(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    s.take_frames();
    s.handle(Frame::Body(1, Bytes::from_static(b"x")));
    assert_eq!(close_code(&s.take_frames()), Some((0, 505)));
}

#[test]
fn channel_beyond_channel_max_and_unknown_ack() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(dir.path());
    let mut s = open_session(b.clone());
    s.handle(m(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    s.take_frames();
    s.handle(m(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 9,
            multiple: false,
        })),
    ));
    // A channel error: channel.close 406 on channel 1, the connection stays open.
    assert_eq!(close_code(&s.take_frames()), Some((1, 406)));
    assert!(s.is_open());
    s.handle(m(
        4000,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    assert_eq!(close_code(&s.take_frames()), Some((0, 530)));
}

#[test]
fn oversized_message_is_a_406_channel_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_session(broker(dir.path()));
    s.handle(m(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    s.handle(m(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "q".into(),
            mandatory: false,
            immediate: false,
        })),
    ));
    s.take_frames();
    s.handle(Frame::Header(
        1,
        Box::new(amq_protocol::frame::AMQPContentHeader {
            class_id: 60,
            body_size: 1 << 40,
            properties: Default::default(),
        }),
    ));
    assert_eq!(close_code(&s.take_frames()), Some((1, 406)));
    // Its body frames are dropped while the channel closes.
    s.handle(Frame::Body(1, Bytes::from_static(b"x")));
    assert!(s.take_frames().is_empty());
    assert!(s.is_open());
}

#[test]
fn publish_with_immediate_is_540_not_implemented() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_session(broker(dir.path()));
    s.handle(m(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    s.take_frames();
    s.handle(m(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "q".into(),
            mandatory: false,
            immediate: true,
        })),
    ));
    let frames = s.take_frames();
    let close = frames.iter().find_map(|f| match f {
        Frame::Method(0, c) => match c.as_ref() {
            AMQPClass::Connection(connection::AMQPMethod::Close(c)) => Some(c.clone()),
            _ => None,
        },
        _ => None,
    });
    let close = close.expect("connection.close");
    // RabbitMQ's exact reply: code, text and the offending method (basic.publish)
    assert_eq!(close.reply_code, 540);
    assert_eq!(
        close.reply_text.as_str(),
        "NOT_IMPLEMENTED - immediate=true"
    );
    assert_eq!((close.class_id, close.method_id), (60, 40));
    assert_eq!(s.state(), State::Closing);
}

#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
//! The sans-IO session without sockets: peers that are not on loopback.

mod common;

use std::net::SocketAddr;

use triad_stomp::{Action, Command, Frame, Session, SessionConfig};

fn first_frame(actions: &[Action]) -> &Frame {
    match actions.first() {
        Some(Action::Send(f)) => f,
        other => panic!("expected a frame, got {other:?}"),
    }
}

#[test]
fn remote_peers_need_a_login_and_guest_is_loopback_only() {
    let dir = tempfile::tempdir().unwrap();
    let broker = common::open_broker(dir.path());
    let remote: SocketAddr = "10.1.2.3:40000".parse().unwrap();
    for headers in [
        vec![("accept-version", "1.2")],
        vec![
            ("accept-version", "1.2"),
            ("login", "guest"),
            ("passcode", "guest"),
        ],
    ] {
        let mut s = Session::new(broker.clone(), remote, SessionConfig::default());
        let mut f = Frame::new(Command::Connect);
        for (k, v) in headers {
            f.push(k, v);
        }
        let mut out = Vec::new();
        s.handle(f, &mut out);
        let e = first_frame(&out);
        assert_eq!(e.command, Command::Error);
        assert!(matches!(out.last(), Some(Action::Close)));
        assert!(!s.is_connected());
        s.close();
    }
    // loopback without login: the default user
    let local: SocketAddr = "127.0.0.1:40000".parse().unwrap();
    let mut s = Session::new(broker.clone(), local, SessionConfig::default());
    let mut out = Vec::new();
    s.handle(
        Frame::new(Command::Connect).with("accept-version", "1.1,1.2"),
        &mut out,
    );
    assert_eq!(first_frame(&out).command, Command::Connected);
    assert_eq!(s.user(), "guest");
    assert_eq!(s.vhost_name(), Some("/"));
    s.close();
}

#[test]
fn host_names_a_vhost_when_it_exists() {
    let dir = tempfile::tempdir().unwrap();
    let broker = common::open_broker(dir.path());
    broker.add_vhost("tenant").unwrap();
    let local: SocketAddr = "127.0.0.1:1".parse().unwrap();
    for (host, want) in [("tenant", "tenant"), ("localhost", "/"), ("127.0.0.1", "/")] {
        let mut s = Session::new(broker.clone(), local, SessionConfig::default());
        let mut out = Vec::new();
        s.handle(
            Frame::new(Command::Connect)
                .with("accept-version", "1.2")
                .with("host", host),
            &mut out,
        );
        assert_eq!(s.vhost_name(), Some(want));
        s.close();
    }
}

//! `listeners.proxy_protocol`: the PROXY v1/v2 header's source address is the peer
//! address (the `guest` loopback rule judges it, the log shows it), on plain and TLS
//! listeners; a listener without the option treats a header as garbage; a missing or
//! malformed header closes the connection.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use common::TestBroker;

const PROXY_CONFIG: &str = r#"
[store]
segment_size = "4 MiB"

[limits]
max_message_size = "1 MiB"

[listeners]
proxy_protocol = true
"#;

const IO_TIMEOUT: Duration = Duration::from_secs(10);

fn v1(src: &str) -> Vec<u8> {
    format!("PROXY TCP4 {src} 127.0.0.1 40000 1883\r\n").into_bytes()
}

fn v2(src: [u8; 4]) -> Vec<u8> {
    let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    h.extend_from_slice(&[0x21, 0x11, 0, 12]);
    h.extend_from_slice(&src);
    h.extend_from_slice(&[127, 0, 0, 1]);
    h.extend_from_slice(&40000u16.to_be_bytes());
    h.extend_from_slice(&1883u16.to_be_bytes());
    h
}

fn mqtt_str(s: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// MQTT 3.1.1 CONNECT as guest/guest, clean session.
fn mqtt_connect_guest(client_id: &str) -> Vec<u8> {
    let mut body = Vec::new();
    mqtt_str("MQTT", &mut body);
    body.push(4);
    body.push(0x02 | 0x80 | 0x40);
    body.extend_from_slice(&60u16.to_be_bytes());
    mqtt_str(client_id, &mut body);
    mqtt_str("guest", &mut body);
    mqtt_str("guest", &mut body);
    let mut out = vec![0x10];
    common::raw::mqtt_remaining_length(body.len(), &mut out);
    out.extend_from_slice(&body);
    out
}

/// What the broker answers to `prefix` + a guest/guest MQTT CONNECT: `Some(return
/// code)` from CONNACK, `None` if it closed the connection without one.
fn mqtt_guest<S: Read + Write>(s: &mut S, prefix: &[u8]) -> Option<u8> {
    let mut out = prefix.to_vec();
    out.extend_from_slice(&mqtt_connect_guest("proxied"));
    s.write_all(&out).ok()?;
    let mut connack = [0u8; 4];
    s.read_exact(&mut connack).ok()?;
    assert_eq!(connack[0], 0x20, "CONNACK: {connack:?}");
    Some(connack[3])
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    s
}

/// STOMP CONNECT as guest/guest: `true` for CONNECTED.
fn stomp_guest(addr: SocketAddr, prefix: &[u8]) -> bool {
    let mut s = connect(addr);
    let mut out = prefix.to_vec();
    out.extend_from_slice(
        b"CONNECT\naccept-version:1.2\nhost:/\nlogin:guest\npasscode:guest\n\n\0",
    );
    s.write_all(&out).expect("write");
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    while !got.contains(&0) {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    got.starts_with(b"CONNECTED")
}

#[test]
fn proxy_header_address_is_the_peer_for_the_loopback_rule() {
    let broker = TestBroker::start_with_config(PROXY_CONFIG);
    let mqtt = broker.mqtt_addr();

    // A remote client behind the balancer: guest is refused (v1 and v2), with CONNACK 4
    // as for a bad password (a loopback-only refusal must not tell the password is right) ...
    assert_eq!(mqtt_guest(&mut connect(mqtt), &v1("203.0.113.7")), Some(4));
    assert_eq!(
        mqtt_guest(&mut connect(mqtt), &v2([198, 51, 100, 9])),
        Some(4)
    );
    // ... and a local one is accepted.
    assert_eq!(mqtt_guest(&mut connect(mqtt), &v1("127.0.0.1")), Some(0));
    assert_eq!(mqtt_guest(&mut connect(mqtt), &v2([127, 0, 0, 1])), Some(0));
    // STOMP the same way.
    assert!(!stomp_guest(broker.stomp_addr(), &v1("203.0.113.7")));
    assert!(stomp_guest(broker.stomp_addr(), &v2([127, 0, 0, 1])));

    // The log names the client, and the balancer as `via`.
    broker.wait_for_log("peer=203.0.113.7:40000", IO_TIMEOUT);
    broker.wait_for_log("peer=198.51.100.9:40000", IO_TIMEOUT);
    let log = broker.log();
    assert!(log.contains("via=127.0.0.1:"), "{log}");

    // No header, or a malformed one: closed without an answer.
    assert_eq!(mqtt_guest(&mut connect(mqtt), b""), None);
    assert_eq!(
        mqtt_guest(&mut connect(mqtt), b"PROXY TCP4 nonsense\r\n"),
        None
    );
    assert_eq!(
        mqtt_guest(&mut connect(mqtt), &v2([1, 2, 3, 4])[..20]),
        None
    );
    let mut bad_v2 = v2([127, 0, 0, 1]);
    bad_v2[12] = 0x31; // version 3
    assert_eq!(mqtt_guest(&mut connect(mqtt), &bad_v2), None);
    broker.wait_for_log("connection refused: PROXY protocol header", IO_TIMEOUT);
}

#[test]
fn a_listener_without_the_option_treats_a_header_as_garbage() {
    let broker = TestBroker::start();
    let mqtt = broker.mqtt_addr();
    // Without a header guest is accepted from loopback ...
    assert_eq!(mqtt_guest(&mut connect(mqtt), b""), Some(0));
    // ... and a header claiming loopback is not parsed: the MQTT codec refuses it.
    assert_eq!(mqtt_guest(&mut connect(mqtt), &v1("127.0.0.1")), None);
    assert_eq!(mqtt_guest(&mut connect(mqtt), &v2([127, 0, 0, 1])), None);
    let log = broker.log();
    assert!(!log.contains("via="), "{log}");
}

#[test]
fn a_header_that_never_ends_times_out() {
    let broker = TestBroker::start_with_config(PROXY_CONFIG);
    let mut s = connect(broker.mqtt_addr());
    s.write_all(b"PROXY TCP4 203.0.113.7").expect("write");
    let started = std::time::Instant::now();
    let mut buf = [0u8; 1];
    // The broker closes within its 5 s header deadline (read returns EOF or reset).
    let r = s.read(&mut buf);
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(4) && waited < IO_TIMEOUT,
        "{waited:?}"
    );
    broker.wait_for_log("no PROXY header within 5s", IO_TIMEOUT);
}

#[test]
fn tls_listener_reads_the_header_before_the_handshake() {
    let dir = tempfile::tempdir().expect("tempdir");
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
        .expect("params")
        .self_signed(&key)
        .expect("cert");
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.pem()).expect("cert");
    std::fs::write(&key_path, key.serialize_pem()).expect("key");
    let broker = TestBroker::start_with_tls(
        "[listeners]\nproxy_protocol = true\n",
        &cert_path,
        &key_path,
        None,
    );

    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der().clone()).expect("root");
    let config = Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth(),
    );
    let guest_over_tls = |header: &[u8]| {
        let mut tcp = connect(broker.mqtts_addr());
        tcp.write_all(header).expect("header");
        let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
        let conn = rustls::ClientConnection::new(Arc::clone(&config), name).expect("client");
        let mut tls = rustls::StreamOwned::new(conn, tcp);
        mqtt_guest(&mut tls, b"")
    };
    assert_eq!(guest_over_tls(&v2([192, 0, 2, 33])), Some(4));
    assert_eq!(guest_over_tls(&v1("127.0.0.1")), Some(0));
    broker.wait_for_log("peer=192.0.2.33:40000", IO_TIMEOUT);
    // No header: the ClientHello is not a header; closed before any TLS.
    assert_eq!(guest_over_tls(b""), None);
}

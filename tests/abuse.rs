//! Bad input over real sockets, against one running broker: random bytes, truncated
//! frames, oversized length fields, never-ending headers, trickled handshakes, thousands
//! of connect/drop cycles and peers that never read while deliveries pile up.
//!
//! Afterwards the broker must still be running with bounded memory, its file
//! descriptors back near where they started, and a fresh client on each protocol must
//! still publish and consume. Where a protocol has an error reply, the malformed
//! connection must get it before the close: AMQP `connection.close` with 501
//! FRAME_ERROR (or 502 / 505), a STOMP ERROR frame; MQTT has none and just closes.
//!
//! `TRIAD_ABUSE_SEED` replays a run (the seed is printed first).

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::amqp;
use common::raw::{
    mqtt_connect_packet, mqtt_publish_packet, rss_anon_kib, rss_kib, MqttClient, Rng, StompClient,
};
use common::TestBroker;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation};
use triad_core::testing::{eventually_async, eventually_blocking};

/// The broker's handshake deadline in this test (short, so that trickling peers are
/// cut off quickly).
const HANDSHAKE: Duration = Duration::from_secs(2);
/// How long a misbehaving connection may stay open after its last byte before the
/// broker is considered not to have closed it.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

const CONFIG: &str = r#"
[store]
segment_size = "16 MiB"

[limits]
max_message_size = "1 MiB"
handshake_timeout = "2s"
"#;

// ---------------------------------------------------------------------------------------
// raw socket helpers

fn tcp(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).expect("connect");
    s.set_nodelay(true).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Reads until the peer closes or `wait` passes with nothing more; returns what came
/// and whether the broker closed the connection.
fn read_until_close(s: &mut TcpStream, wait: Duration) -> (Vec<u8>, bool) {
    let deadline = Instant::now() + wait;
    let mut out = Vec::new();
    let mut chunk = [0u8; 64 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (out, false);
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut chunk) {
            Ok(0) => return (out, true),
            Ok(n) => out.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return (out, false)
            }
            Err(_) => return (out, true), // reset: closed
        }
    }
}

/// Writes, ignoring the errors a peer that already closed causes.
fn write_lossy(s: &mut TcpStream, b: &[u8]) -> bool {
    s.write_all(b).is_ok()
}

// --- AMQP

const AMQP_HEADER: &[u8] = b"AMQP\x00\x00\x09\x01";

fn amqp_frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![kind];
    f.extend_from_slice(&channel.to_be_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f.push(0xCE);
    f
}

fn amqp_method(channel: u16, class: u16, method: u16, args: &[u8]) -> Vec<u8> {
    let mut p = class.to_be_bytes().to_vec();
    p.extend_from_slice(&method.to_be_bytes());
    p.extend_from_slice(args);
    amqp_frame(1, channel, &p)
}

fn shortstr(s: &str, out: &mut Vec<u8>) {
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

/// Splits a byte stream into AMQP frames: (type, channel, payload); stops at the first
/// incomplete one.
fn amqp_frames(mut b: &[u8]) -> Vec<(u8, u16, Vec<u8>)> {
    let mut out = Vec::new();
    while b.len() >= 7 {
        let size = u32::from_be_bytes([b[3], b[4], b[5], b[6]]) as usize;
        if b.len() < 8 + size {
            break;
        }
        out.push((
            b[0],
            u16::from_be_bytes([b[1], b[2]]),
            b[7..7 + size].to_vec(),
        ));
        b = &b[8 + size..];
    }
    out
}

/// The (class, method) of a method frame payload.
fn method_id(p: &[u8]) -> Option<(u16, u16)> {
    Some((
        u16::from_be_bytes([*p.first()?, *p.get(1)?]),
        u16::from_be_bytes([*p.get(2)?, *p.get(3)?]),
    ))
}

/// The reply code of the first `connection.close` in `bytes`, if any.
fn amqp_close_code(bytes: &[u8]) -> Option<u16> {
    amqp_frames(bytes).iter().find_map(|(kind, _, p)| {
        (*kind == 1 && method_id(p) == Some((10, 50))).then(|| u16::from_be_bytes([p[4], p[5]]))
    })
}

/// Reads frames until one with method (class, method) arrives.
fn amqp_expect(s: &mut TcpStream, buf: &mut Vec<u8>, want: (u16, u16)) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let frames = amqp_frames(buf);
        let used: usize = frames.iter().map(|(_, _, p)| p.len() + 8).sum();
        let found = frames
            .into_iter()
            .find(|(k, _, p)| *k == 1 && method_id(p) == Some(want));
        buf.drain(..used);
        if let Some((_, _, p)) = found {
            return p;
        }
        assert!(Instant::now() < deadline, "no AMQP method {want:?}");
        let mut chunk = [0u8; 4096];
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let n = s.read(&mut chunk).expect("read AMQP handshake");
        assert!(n > 0, "broker closed during the AMQP handshake");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// A raw AMQP connection through `connection.open-ok` (PLAIN guest/guest, heartbeats
/// off) with channel 1 open.
fn amqp_open(addr: SocketAddr) -> TcpStream {
    amqp_open_hb(addr, 0)
}

/// [`amqp_open`] with a heartbeat of `heartbeat` seconds.
fn amqp_open_hb(addr: SocketAddr, heartbeat: u16) -> TcpStream {
    let mut s = tcp(addr);
    let mut buf = Vec::new();
    s.write_all(AMQP_HEADER).unwrap();
    amqp_expect(&mut s, &mut buf, (10, 10));
    // client-properties: capabilities = {connection.blocked: true}
    let mut caps = Vec::new();
    shortstr("connection.blocked", &mut caps);
    caps.extend_from_slice(&[b't', 1]);
    let mut props = Vec::new();
    shortstr("capabilities", &mut props);
    props.push(b'F');
    props.extend_from_slice(&(caps.len() as u32).to_be_bytes());
    props.extend_from_slice(&caps);
    let mut args = (props.len() as u32).to_be_bytes().to_vec();
    args.extend_from_slice(&props);
    shortstr("PLAIN", &mut args);
    let resp = b"\0guest\0guest";
    args.extend_from_slice(&(resp.len() as u32).to_be_bytes());
    args.extend_from_slice(resp);
    shortstr("en_US", &mut args);
    s.write_all(&amqp_method(0, 10, 11, &args)).unwrap();
    let tune = amqp_expect(&mut s, &mut buf, (10, 30));
    let mut args = tune[4..6].to_vec(); // channel-max as proposed
    args.extend_from_slice(&tune[6..10]); // frame-max as proposed
    args.extend_from_slice(&heartbeat.to_be_bytes());
    s.write_all(&amqp_method(0, 10, 31, &args)).unwrap();
    let mut args = Vec::new();
    shortstr("/", &mut args);
    shortstr("", &mut args);
    args.push(0);
    s.write_all(&amqp_method(0, 10, 40, &args)).unwrap();
    amqp_expect(&mut s, &mut buf, (10, 41));
    let mut args = Vec::new();
    shortstr("", &mut args);
    s.write_all(&amqp_method(1, 20, 10, &args)).unwrap();
    amqp_expect(&mut s, &mut buf, (20, 11));
    s
}

// --- STOMP / MQTT

const STOMP_CONNECT: &[u8] = b"CONNECT\naccept-version:1.2\nhost:/\nheart-beat:0,0\n\n\0";

fn stomp_open(addr: SocketAddr) -> TcpStream {
    let c = StompClient::connect(addr, Duration::from_secs(10)).expect("STOMP connect");
    c.stream
}

fn mqtt_open(addr: SocketAddr, id: &str) -> TcpStream {
    MqttClient::connect(addr, id, true, Duration::from_secs(10))
        .expect("MQTT connect")
        .stream
}

fn has_stomp_error(bytes: &[u8]) -> bool {
    bytes.windows(6).any(|w| w == b"ERROR\n")
}

/// Counts of how the broker reacted to a kind of abuse.
#[derive(Debug, Default)]
struct Outcome {
    /// Closed by the broker, with the protocol's error first where it has one.
    closed_with_error: u32,
    /// Closed without an error reply (fine for MQTT, and for garbage before a
    /// protocol header, which has no error reply).
    closed_silently: u32,
    /// Still open after `CLOSE_WAIT` (the broker waits for more bytes).
    left_open: u32,
}

// ---------------------------------------------------------------------------------------
// phases

/// Random bytes: before the handshake and after a completed login, per protocol.
fn random_bytes(b: &TestBroker, rng: &mut Rng) {
    let rounds = 20;
    for proto in ["amqp", "stomp", "mqtt"] {
        for after_login in [false, true] {
            let mut o = Outcome::default();
            let mut threads = Vec::new();
            for i in 0..rounds {
                let len = rng.range(1, 8192) as usize;
                let garbage = rng.bytes(len);
                let addr = b.addr(proto);
                threads.push(std::thread::spawn(move || {
                    let mut s = match (proto, after_login) {
                        (_, false) => tcp(addr),
                        ("amqp", true) => amqp_open(addr),
                        ("stomp", true) => stomp_open(addr),
                        _ => mqtt_open(addr, &format!("rnd{i}")),
                    };
                    write_lossy(&mut s, &garbage);
                    let (reply, closed) = read_until_close(&mut s, HANDSHAKE + CLOSE_WAIT);
                    (reply, closed)
                }));
            }
            for t in threads {
                let (reply, closed) = t.join().unwrap();
                let errored = match proto {
                    "amqp" => amqp_close_code(&reply)
                        .is_some_and(|c| [501, 502, 503, 504, 505].contains(&c)),
                    "stomp" => has_stomp_error(&reply),
                    _ => false,
                };
                match (closed, errored) {
                    (false, _) => o.left_open += 1,
                    (true, true) => o.closed_with_error += 1,
                    (true, false) => o.closed_silently += 1,
                }
                // After login, AMQP and STOMP must answer a violation with their error.
                if closed && after_login && proto != "mqtt" {
                    assert!(
                        errored,
                        "{proto}: closed after garbage without the protocol's error: {:?}",
                        String::from_utf8_lossy(&reply[..reply.len().min(300)])
                    );
                }
            }
            println!("random bytes {proto} after_login={after_login}: {o:?}");
            // Before login the handshake deadline closes every connection.
            if !after_login {
                assert_eq!(
                    o.left_open, 0,
                    "{proto}: garbage before login must not linger"
                );
            }
        }
    }
}

/// Valid frames cut at random points, then the client closes.
fn truncated(b: &TestBroker, rng: &mut Rng) {
    let stomp_send = b"SEND\ndestination:/queue/abuse-trunc\ncontent-length:5\n\nhello\0".to_vec();
    let mqtt_pub = mqtt_publish_packet("abuse/trunc", 1, 7, b"hello world");
    let amqp_open_frame = {
        let mut a = Vec::new();
        shortstr("/", &mut a);
        shortstr("", &mut a);
        a.push(0);
        amqp_method(0, 10, 40, &a)
    };
    for i in 0..60u32 {
        let (proto, before, frame): (&str, Vec<u8>, &[u8]) = match i % 3 {
            0 => ("amqp", AMQP_HEADER.to_vec(), &amqp_open_frame),
            1 => ("stomp", STOMP_CONNECT.to_vec(), &stomp_send),
            _ => (
                "mqtt",
                mqtt_connect_packet(&format!("trunc{i}"), true),
                &mqtt_pub,
            ),
        };
        let cut = rng.range(1, frame.len() as u64) as usize;
        let mut s = tcp(b.addr(proto));
        write_lossy(&mut s, &before);
        write_lossy(&mut s, &frame[..cut]);
        drop(s);
    }
    // and a complete frame with its last byte missing, left open: the broker waits
    // for the rest (it is a valid prefix); the handshake deadline ends the pre-login
    // ones
    let mut s = tcp(b.stomp_addr());
    write_lossy(&mut s, &STOMP_CONNECT[..STOMP_CONNECT.len() - 1]);
    let started = Instant::now();
    let (_, closed) = read_until_close(&mut s, HANDSHAKE + CLOSE_WAIT);
    assert!(
        closed,
        "STOMP: a CONNECT missing its NUL must hit the handshake deadline"
    );
    println!(
        "truncated: 60 cut frames sent and dropped; an unfinished CONNECT was closed after {:?}",
        started.elapsed()
    );
}

/// Length fields far beyond every limit: the broker refuses at once instead of
/// buffering towards them.
fn oversized(b: &TestBroker) {
    // AMQP: a 2^31-byte frame, before tune (8 KiB limit) and after open (frame_max)
    for after_open in [false, true] {
        let mut s = if after_open {
            amqp_open(b.amqp_addr())
        } else {
            let mut s = tcp(b.amqp_addr());
            s.write_all(AMQP_HEADER).unwrap();
            s
        };
        let mut f = vec![3u8, 0, 1];
        f.extend_from_slice(&(1u32 << 31).to_be_bytes());
        f.extend_from_slice(&[0u8; 1024]);
        write_lossy(&mut s, &f);
        let (reply, closed) = read_until_close(&mut s, CLOSE_WAIT);
        assert!(closed, "AMQP: a 2^31-byte frame must close the connection");
        assert_eq!(
            amqp_close_code(&reply),
            Some(501),
            "AMQP: a 2^31-byte frame (after_open={after_open}) must get 501 FRAME_ERROR"
        );
    }
    // AMQP: a bad frame-end octet and an unknown frame type after open
    for (name, frame) in [
        ("bad frame end", {
            let mut f = amqp_frame(3, 1, b"abc");
            *f.last_mut().unwrap() = 0;
            f
        }),
        ("unknown frame type", amqp_frame(9, 1, b"abc")),
    ] {
        let mut s = amqp_open(b.amqp_addr());
        write_lossy(&mut s, &frame);
        let (reply, closed) = read_until_close(&mut s, CLOSE_WAIT);
        assert!(closed, "AMQP {name}: not closed");
        assert_eq!(amqp_close_code(&reply), Some(501), "AMQP {name}");
    }
    // AMQP: a content body with no publish before it: 505 UNEXPECTED_FRAME
    let mut s = amqp_open(b.amqp_addr());
    write_lossy(&mut s, &amqp_frame(3, 1, b"stray body"));
    let (reply, closed) = read_until_close(&mut s, CLOSE_WAIT);
    assert!(closed, "AMQP stray body: not closed");
    assert_eq!(amqp_close_code(&reply), Some(505), "AMQP stray body");

    // MQTT: remaining length 268,435,455 (the protocol's maximum), before and after
    // CONNECT; and a five-byte remaining length
    for (name, connect_first, bytes) in [
        (
            "max remaining length before CONNECT",
            false,
            vec![0x10, 0xFF, 0xFF, 0xFF, 0x7F],
        ),
        ("max remaining length PUBLISH", true, {
            let mut p = vec![0x30, 0xFF, 0xFF, 0xFF, 0x7F, 0, 1, b'a'];
            p.extend_from_slice(&[0u8; 1024]);
            p
        }),
        (
            "five-byte remaining length",
            true,
            vec![0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x01],
        ),
    ] {
        let mut s = if connect_first {
            mqtt_open(b.mqtt_addr(), "oversized")
        } else {
            tcp(b.mqtt_addr())
        };
        write_lossy(&mut s, &bytes);
        let started = Instant::now();
        let (_, closed) = read_until_close(&mut s, CLOSE_WAIT);
        assert!(closed, "MQTT {name}: not closed");
        assert!(
            started.elapsed() < HANDSHAKE,
            "MQTT {name}: closed only by a timeout, not refused at once"
        );
    }

    // STOMP: a huge content-length, before and after CONNECT, and one that overflows
    for (name, connect_first, frame) in [
        (
            "content-length 2^40 before CONNECT",
            false,
            b"CONNECT\ncontent-length:1099511627776\n\n".to_vec(),
        ),
        (
            "content-length 2^40",
            true,
            b"SEND\ndestination:/queue/abuse\ncontent-length:1099511627776\n\nxx".to_vec(),
        ),
        (
            "content-length beyond u64",
            true,
            b"SEND\ndestination:/queue/abuse\ncontent-length:99999999999999999999999\n\nxx"
                .to_vec(),
        ),
    ] {
        let mut s = if connect_first {
            stomp_open(b.stomp_addr())
        } else {
            tcp(b.stomp_addr())
        };
        write_lossy(&mut s, &frame);
        let (reply, closed) = read_until_close(&mut s, CLOSE_WAIT);
        assert!(closed, "STOMP {name}: not closed");
        assert!(
            has_stomp_error(&reply),
            "STOMP {name}: no ERROR frame before the close: {:?}",
            String::from_utf8_lossy(&reply)
        );
    }
    println!("oversized: AMQP 501/505, STOMP ERROR, MQTT closed at once, as expected");
}

/// A STOMP header line that never ends, streamed well past the limit: the broker must
/// send ERROR and close once the line passes its limit, not buffer it.
fn endless_header(b: &TestBroker) {
    for after_connect in [false, true] {
        let mut s = if after_connect {
            stomp_open(b.stomp_addr())
        } else {
            tcp(b.stomp_addr())
        };
        let start = if after_connect {
            &b"SEND\ndestination:/queue/abuse\nx-endless:"[..]
        } else {
            &b"CONNECT\nx-endless:"[..]
        };
        write_lossy(&mut s, start);
        let chunk = vec![b'a'; 4096];
        let mut sent = 0usize;
        // 8 KiB (before CONNECT) and 64 KiB (after) are the header-line limits; stream
        // up to 16 MiB, giving the broker a moment to answer after each chunk so that
        // `sent` measures how far it read
        while sent < 16 << 20 {
            if !write_lossy(&mut s, &chunk) {
                break;
            }
            sent += chunk.len();
            s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            let mut peek = [0u8; 1];
            let answered = !matches!(s.peek(&mut peek), Err(ref e)
                if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut));
            if answered {
                break;
            }
        }
        let (reply, closed) = read_until_close(&mut s, CLOSE_WAIT);
        assert!(
            closed,
            "STOMP endless header (after_connect={after_connect}): not closed"
        );
        assert!(
            has_stomp_error(&reply),
            "STOMP endless header: no ERROR: {:?}",
            String::from_utf8_lossy(&reply)
        );
        // the limit plus what was in flight when the broker answered
        assert!(
            sent <= 1 << 20,
            "STOMP endless header: broker kept reading {sent} bytes of one header line"
        );
        println!(
            "endless STOMP header (after_connect={after_connect}): ERROR after {sent} bytes sent"
        );
    }
}

/// A SEND with 100,000 header lines: refused with ERROR once past the header count
/// limit (1,000), not buffered.
fn header_flood(b: &TestBroker) {
    let mut s = stomp_open(b.stomp_addr());
    let mut frame = b"SEND\ndestination:/queue/abuse\n".to_vec();
    for i in 0..100_000 {
        frame.extend_from_slice(format!("h{i}:v\n").as_bytes());
    }
    // the broker may close mid-write: that is the point
    let writer = {
        let mut s = s.try_clone().unwrap();
        std::thread::spawn(move || write_lossy(&mut s, &frame))
    };
    let (reply, closed) = read_until_close(&mut s, CLOSE_WAIT);
    drop(s);
    let _ = writer.join();
    assert!(closed, "STOMP header flood: not closed");
    assert!(
        has_stomp_error(&reply),
        "STOMP header flood: no ERROR: {:?}",
        String::from_utf8_lossy(&reply)
    );
    println!("STOMP header flood: ERROR and close");
}

/// Handshakes trickled a byte at a time: the handshake deadline is absolute, so the
/// broker closes them after `HANDSHAKE` however steadily bytes arrive.
fn trickle(b: &TestBroker) {
    let amqp = {
        let mut v = AMQP_HEADER.to_vec();
        v.extend_from_slice(&amqp_frame(1, 0, &[0u8; 512]));
        v
    };
    let stomp = {
        let mut v = b"CONNECT\naccept-version:1.2\n".to_vec();
        v.extend_from_slice(&[b'x'; 4096]);
        v
    };
    let mqtt = {
        let mut v = vec![0x10, 0x80, 0x04]; // 512-byte CONNECT
        v.extend_from_slice(&[0u8; 512]);
        v
    };
    let threads: Vec<_> = [("amqp", amqp), ("stomp", stomp), ("mqtt", mqtt)]
        .into_iter()
        .map(|(proto, bytes)| {
            let addr = b.addr(proto);
            std::thread::spawn(move || {
                let mut s = tcp(addr);
                let started = Instant::now();
                for byte in bytes.iter() {
                    if !write_lossy(&mut s, &[*byte]) {
                        break;
                    }
                    // closed by the broker yet?
                    s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
                    let mut one = [0u8; 256];
                    match s.read(&mut one) {
                        Ok(0) => break,
                        Ok(_) => {}
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                            ) => {}
                        Err(_) => break,
                    }
                    if started.elapsed() > HANDSHAKE + CLOSE_WAIT {
                        break;
                    }
                }
                let (_, closed) = read_until_close(&mut s, CLOSE_WAIT);
                (proto, closed, started.elapsed())
            })
        })
        .collect();
    for t in threads {
        let (proto, closed, took) = t.join().unwrap();
        assert!(closed, "{proto}: a trickled handshake was never closed");
        assert!(
            took < HANDSHAKE + CLOSE_WAIT,
            "{proto}: a trickled handshake stayed open {took:?}"
        );
        println!("trickled {proto} handshake closed after {took:?}");
    }
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// 2,000 connect/drop cycles across the protocols, some dropping mid-handshake and some
/// after a full login; afterwards the broker's descriptors return to their baseline.
fn connect_drop(b: &TestBroker, pid: u32) {
    let before = fd_count(pid);
    let started = Instant::now();
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let addrs = [b.amqp_addr(), b.stomp_addr(), b.mqtt_addr()];
            std::thread::spawn(move || {
                for i in 0..500u32 {
                    let proto = (i + t) % 3;
                    let mut s = tcp(addrs[proto as usize]);
                    match (proto, i % 4) {
                        (_, 0) => {} // connect and drop
                        (0, 1) => drop(s.write_all(&AMQP_HEADER[..4])),
                        (0, _) => {
                            let _ = s.write_all(AMQP_HEADER);
                            let mut b = [0u8; 16];
                            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                            let _ = s.read(&mut b);
                        }
                        (1, 1) => drop(s.write_all(b"CONN")),
                        (1, _) => {
                            let _ = s.write_all(STOMP_CONNECT);
                            let mut b = [0u8; 16];
                            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                            let _ = s.read(&mut b);
                        }
                        (_, 1) => drop(s.write_all(&[0x10, 20, 0, 4])),
                        (_, _) => {
                            let _ = s.write_all(&mqtt_connect_packet(&format!("cd{t}-{i}"), true));
                            let mut b = [0u8; 4];
                            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                            let _ = s.read(&mut b);
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let cycles_took = started.elapsed();
    // every dropped connection is noticed at once (EOF), or by the handshake deadline
    let now_fds = eventually_blocking(
        "the broker's descriptors back to what they were",
        HANDSHAKE + Duration::from_secs(20),
        || {
            let n = fd_count(pid);
            if n <= before + 8 {
                Ok(n)
            } else {
                Err(format!(
                    "{before} fds before 2000 connect/drop cycles, {n} now"
                ))
            }
        },
    );
    println!(
        "connect/drop: 2000 cycles in {cycles_took:?}; broker fds {before} before, {now_fds} after"
    );
    assert!(
        now_fds <= before + 8,
        "connections leaked: {before} fds before 2000 connect/drop cycles, {now_fds} after"
    );
}

/// Bytes received but not yet read on `s` (FIONREAD).
fn unread_bytes(s: &TcpStream) -> usize {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which is valid.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::FIONREAD, &mut n) };
    assert_eq!(r, 0, "ioctl(FIONREAD)");
    usize::try_from(n).unwrap_or(0)
}

/// Bytes of deliveries each non-reading consumer is offered.
const SLOW_MESSAGES: u64 = 2_000;
const SLOW_SIZE: usize = 64 * 1024;
/// Ceilings while three consumers that never read are offered
/// `SLOW_MESSAGES * SLOW_SIZE` bytes each (375 MiB in all; 125 MiB stored once):
/// the broker's heap (`RssAnon`) may grow by 64 MiB, and its whole resident set
/// (`VmRSS`, which also counts the pages of commitlog segments it wrote through its
/// mappings) by the stored bytes plus those 64 MiB.
const SLOW_ANON_GROWTH_CEILING_KIB: u64 = 64 * 1024;
const SLOW_RSS_GROWTH_CEILING_KIB: u64 =
    ((SLOW_MESSAGES * SLOW_SIZE as u64) >> 10) + SLOW_ANON_GROWTH_CEILING_KIB;

/// Consumers that never read their socket, one per protocol, while 125 MiB of
/// deliveries is published for each: the broker must stop delivering to them, not
/// buffer it all.
fn non_reading_consumers(b: &TestBroker, pid: u32, rt: &tokio::runtime::Runtime) -> Vec<TcpStream> {
    // AMQP: a queue bound to the topic, consumed with no-ack (no prefetch bound at all)
    rt.block_on(async {
        let conn = amqp::connect(b.amqp_addr()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        for q in ["abuse-slow-amqp", "abuse-slow-stomp"] {
            amqp::declare_durable(&ch, q).await.unwrap();
            ch.queue_bind(
                q.into(),
                "amq.topic".into(),
                "abuse.slow".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        }
        conn.close(200, "setup".into()).await.unwrap();
    });
    let mut amqp_c = amqp_open(b.amqp_addr());
    let mut args = 0u16.to_be_bytes().to_vec();
    shortstr("abuse-slow-amqp", &mut args);
    shortstr("slow", &mut args);
    args.push(0x02); // no-ack
    args.extend_from_slice(&0u32.to_be_bytes());
    amqp_c.write_all(&amqp_method(1, 60, 20, &args)).unwrap();
    let mut buf = Vec::new();
    amqp_expect(&mut amqp_c, &mut buf, (60, 21));
    // STOMP: auto-ack subscription
    let mut stomp_c = StompClient::connect(b.stomp_addr(), Duration::from_secs(10)).unwrap();
    stomp_c
        .send(
            "SUBSCRIBE",
            &[
                ("destination", "/amq/queue/abuse-slow-stomp"),
                ("id", "0"),
                ("ack", "auto"),
                ("receipt", "sub"),
            ],
            b"",
        )
        .unwrap();
    assert_eq!(stomp_c.read_frame().unwrap().command, "RECEIPT");
    // MQTT: QoS 0 subscription
    let mut mqtt_c =
        MqttClient::connect(b.mqtt_addr(), "slow", true, Duration::from_secs(10)).unwrap();
    assert_eq!(mqtt_c.subscribe(1, "abuse/slow", 0).unwrap(), 0);
    // None of the three reads from here on; the sockets stay open.

    let rss_before = rss_kib(pid).unwrap();
    let anon_before = rss_anon_kib(pid).unwrap_or(0);
    let mut rss_max = rss_before;
    let mut anon_max = anon_before;
    let started = Instant::now();
    rt.block_on(async {
        let conn = amqp::connect(b.amqp_addr()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let body = vec![b'z'; SLOW_SIZE];
        let mut pending = std::collections::VecDeque::new();
        for i in 0..SLOW_MESSAGES {
            let c = ch
                .basic_publish(
                    "amq.topic".into(),
                    "abuse.slow".into(),
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap();
            pending.push_back(c);
            // A wide confirm window: the MQTT subscriber's queue falls behind, so the
            // broker holds each confirm up to its flow deadline (1 s), as it holds back
            // every publisher to a queue far behind; with 32 in flight this phase took
            // a minute.
            if pending.len() > 512 {
                let c = pending.pop_front().unwrap();
                assert!(matches!(c.await.unwrap(), Confirmation::Ack(_)));
            }
            if i % 100 == 0 {
                rss_max = rss_max.max(rss_kib(pid).unwrap());
                anon_max = anon_max.max(rss_anon_kib(pid).unwrap_or(0));
            }
        }
        for c in pending {
            assert!(matches!(c.await.unwrap(), Confirmation::Ack(_)));
        }
        conn.close(200, "done".into()).await.unwrap();
    });
    // let deliveries settle into whatever the broker buffers: wait until RSS stops
    // moving (bounded)
    let mut last = rss_kib(pid).unwrap();
    let settle_deadline = Instant::now() + Duration::from_secs(10);
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let now = rss_kib(pid).unwrap();
        rss_max = rss_max.max(now);
        anon_max = anon_max.max(rss_anon_kib(pid).unwrap_or(0));
        if now.abs_diff(last) < 1024 || Instant::now() > settle_deadline {
            break;
        }
        last = now;
    }
    let rss_after = rss_kib(pid).unwrap();
    let anon_after = rss_anon_kib(pid).unwrap_or(0);
    let offered_mib = (SLOW_MESSAGES * SLOW_SIZE as u64 * 3) >> 20;
    println!(
        "non-reading consumers: {offered_mib} MiB offered in {:?}; broker VmRSS {} -> {} MiB \
         (max {} MiB), RssAnon {} -> {} MiB (max {} MiB); growth ceilings: VmRSS {} MiB, \
         RssAnon {} MiB",
        started.elapsed(),
        rss_before >> 10,
        rss_after >> 10,
        rss_max >> 10,
        anon_before >> 10,
        anon_after >> 10,
        anon_max >> 10,
        SLOW_RSS_GROWTH_CEILING_KIB >> 10,
        SLOW_ANON_GROWTH_CEILING_KIB >> 10
    );
    assert!(
        anon_max.saturating_sub(anon_before) < SLOW_ANON_GROWTH_CEILING_KIB,
        "broker heap grew by {} MiB while consumers did not read (ceiling {} MiB)",
        anon_max.saturating_sub(anon_before) >> 10,
        SLOW_ANON_GROWTH_CEILING_KIB >> 10
    );
    assert!(
        rss_max.saturating_sub(rss_before) < SLOW_RSS_GROWTH_CEILING_KIB,
        "broker RSS grew by {} MiB while consumers did not read (ceiling {} MiB)",
        rss_max.saturating_sub(rss_before) >> 10,
        SLOW_RSS_GROWTH_CEILING_KIB >> 10
    );
    // They were served until their sockets filled: deliveries wait in each receive
    // buffer (so the broker did try to push the backlog at them). A socket that is
    // never read keeps its initial receive buffer (128 KiB on Linux), so "more than
    // one message" is the bar.
    for (proto, s) in [
        ("amqp", &amqp_c),
        ("stomp", &stomp_c.stream),
        ("mqtt", &mqtt_c.stream),
    ] {
        let unread = unread_bytes(s);
        println!(
            "non-reading {proto} consumer: {} KiB unread in its socket",
            unread >> 10
        );
        assert!(
            unread > SLOW_SIZE,
            "{proto}: the non-reading consumer was barely sent anything ({unread} bytes)"
        );
    }
    vec![amqp_c, stomp_c.stream, mqtt_c.stream]
}

/// A fresh client of each protocol publishes and consumes.
fn still_serving(b: &TestBroker, rt: &tokio::runtime::Runtime) {
    // AMQP
    rt.block_on(async {
        let conn = amqp::connect(b.amqp_addr()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        amqp::declare_durable(&ch, "abuse-after").await.unwrap();
        ch.basic_publish(
            "".into(),
            "abuse-after".into(),
            BasicPublishOptions::default(),
            b"still here",
            BasicProperties::default(),
        )
        .await
        .unwrap();
        let got = eventually_async(
            "the AMQP message back",
            Duration::from_secs(10),
            async || {
                ch.basic_get("abuse-after".into(), BasicGetOptions { no_ack: true })
                    .await
                    .unwrap()
                    .map(|m| m.delivery.data)
            },
        )
        .await;
        assert_eq!(got, b"still here");
        conn.close(200, "ok".into()).await.unwrap();
    });
    // STOMP
    let mut c = StompClient::connect(b.stomp_addr(), Duration::from_secs(10)).unwrap();
    c.send(
        "SUBSCRIBE",
        &[
            ("destination", "/queue/abuse-after-stomp"),
            ("id", "1"),
            ("receipt", "s"),
        ],
        b"",
    )
    .unwrap();
    assert_eq!(c.read_frame().unwrap().command, "RECEIPT");
    c.send(
        "SEND",
        &[("destination", "/queue/abuse-after-stomp")],
        b"stomp ok",
    )
    .unwrap();
    let m = c.read_frame().unwrap();
    assert_eq!(
        (m.command.as_str(), m.body.as_slice()),
        ("MESSAGE", &b"stomp ok"[..])
    );
    // MQTT
    let mut m = MqttClient::connect(b.mqtt_addr(), "after", true, Duration::from_secs(10)).unwrap();
    assert_eq!(m.subscribe(1, "abuse/after", 1).unwrap(), 1);
    m.publish("abuse/after", 1, 2, b"mqtt ok").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = false;
    while !got && Instant::now() < deadline {
        let p = m.read_packet().unwrap();
        if let Some((topic, id, payload)) = (p.kind() == 3).then(|| p.publish()).flatten() {
            assert_eq!(
                (topic.as_str(), payload.as_slice()),
                ("abuse/after", &b"mqtt ok"[..])
            );
            if let Some(id) = id {
                m.puback(id).unwrap();
            }
            got = true;
        }
    }
    assert!(got, "MQTT message back within 10 s");
    println!("fresh AMQP, STOMP and MQTT clients publish and consume");
}

#[test]
fn abuse_leaves_the_broker_serving_with_bounded_memory() {
    let seed = Rng::seed_from_env("TRIAD_ABUSE_SEED");
    println!("abuse: seed {seed} (replay with TRIAD_ABUSE_SEED={seed})");
    let mut rng = Rng::new(seed);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut broker = TestBroker::start_with_config(CONFIG);
    let pid = broker.pid();
    let started = Instant::now();
    let rss_start = rss_kib(pid).unwrap();

    let mut phase = |name: &str, f: &mut dyn FnMut(&mut Rng)| {
        let t = Instant::now();
        f(&mut rng);
        println!(
            "phase {name}: {:?}, broker VmRSS {} MiB",
            t.elapsed(),
            rss_kib(pid).unwrap_or(0) >> 10
        );
    };
    phase("random bytes", &mut |r| random_bytes(&broker, r));
    phase("truncated", &mut |r| truncated(&broker, r));
    phase("oversized", &mut |_| oversized(&broker));
    phase("endless header", &mut |_| endless_header(&broker));
    phase("header flood", &mut |_| header_flood(&broker));
    phase("trickle", &mut |_| trickle(&broker));
    phase("connect/drop", &mut |_| connect_drop(&broker, pid));
    let mut stuck = Vec::new();
    phase("non-reading consumers", &mut |_| {
        stuck = non_reading_consumers(&broker, pid, &rt)
    });
    phase("still serving", &mut |_| still_serving(&broker, &rt));

    assert!(broker.is_running(), "the broker died");
    // A clean stop must not hang on connections whose writes are stuck.
    let rss_end = rss_kib(pid).unwrap_or(0);
    let t = Instant::now();
    let status = broker.terminate();
    println!(
        "SIGTERM with 3 non-reading consumers still connected: {status} after {:?}",
        t.elapsed()
    );
    assert!(
        status.success(),
        "unclean exit with stuck consumers: {status}"
    );
    // Regression: the AMQP connection task used to sit in `write_all` to the
    // non-reading peer without watching the shutdown token, so every SIGTERM waited out
    // the whole 5 s grace period.
    assert!(
        !broker
            .log()
            .contains("connections still open after the grace period"),
        "a connection stuck writing to a non-reading peer held up the shutdown"
    );
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "shutdown took {:?} with non-reading consumers",
        t.elapsed()
    );
    drop(stuck);
    println!(
        "abuse done in {:?}: broker VmRSS {} MiB at start, {} MiB at the end",
        started.elapsed(),
        rss_start >> 10,
        rss_end >> 10
    );
}

/// Issue 14 item 14: a publisher blocked by the memory alarm is not read from, but it is
/// still closed after the heartbeat timeout once it goes silent (it used to be exempt:
/// the broker took its own not reading for the peer's silence).
#[test]
fn blocked_publisher_that_goes_silent_is_closed_after_the_heartbeat_timeout() {
    // a mark far below any process's size: the memory alarm is up from the start
    let broker = TestBroker::start_with_config(
        "[store]\nsegment_size = \"4 MiB\"\n\n[limits]\nmax_message_size = \"1 MiB\"\nmemory_high_watermark = 0.000001\n",
    );
    broker.wait_for_log("resource alarm raised", Duration::from_secs(10));
    let mut s = amqp_open_hb(broker.amqp_addr(), 1);
    let mut publish = amqp_method(1, 60, 40, &[0, 0, 0, 2, b'h', b'b', 0]);
    let mut header = 60u16.to_be_bytes().to_vec();
    header.extend_from_slice(&0u16.to_be_bytes());
    header.extend_from_slice(&1u64.to_be_bytes());
    header.extend_from_slice(&0u16.to_be_bytes());
    publish.extend_from_slice(&amqp_frame(2, 1, &header));
    publish.extend_from_slice(&amqp_frame(3, 1, b"x"));
    s.write_all(&publish).unwrap();
    let mut buf = Vec::new();
    amqp_expect(&mut s, &mut buf, (10, 60)); // connection.blocked
                                             // silent from now on: no heartbeats, nothing else; 2 missed heartbeats close it
    let t = Instant::now();
    let (_, closed) = read_until_close(&mut s, Duration::from_secs(10));
    assert!(
        closed,
        "a silent, blocked publisher was still connected after {:?}",
        t.elapsed()
    );
    assert!(
        t.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );

    // while one that keeps sending heartbeats stays connected past the timeout
    let mut s = amqp_open_hb(broker.amqp_addr(), 1);
    s.write_all(&publish).unwrap();
    let mut buf = Vec::new();
    amqp_expect(&mut s, &mut buf, (10, 60));
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        s.write_all(&amqp_frame(8, 0, &[])).unwrap();
        let (_, closed) = read_until_close(&mut s, Duration::from_millis(400));
        assert!(!closed, "a blocked publisher sending heartbeats was closed");
    }
}

/// A STOMP frame to send: command, headers, body.
type RawFrame<'a> = (&'a str, Vec<(String, String)>, Vec<u8>);

/// Sends `frames` on a fresh STOMP connection (logged in); returns the first frame the
/// broker answers with, which must be an ERROR naming `needle`, and checks the close.
fn stomp_refused(b: &TestBroker, frames: &[RawFrame<'_>], needle: &str) {
    let mut c = StompClient::connect(b.stomp_addr(), Duration::from_secs(10)).unwrap();
    c.stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    for (command, headers, body) in frames {
        let h: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        if c.send(command, &h, body).is_err() {
            break; // closed mid-way: the ERROR is already waiting
        }
    }
    let f = c.read_frame().expect("an answer");
    assert_eq!(f.command, "ERROR", "{needle}: {f:?}");
    let text = format!("{:?} {}", f.headers, String::from_utf8_lossy(&f.body));
    assert!(text.contains(needle), "{needle}: {text}");
    let (_, closed) = read_until_close(&mut c.stream, CLOSE_WAIT);
    assert!(closed, "{needle}: not closed after the ERROR");
}

fn hdr(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Issue 14 item 11: a STOMP connection's transactions, transaction ids, buffered
/// frames and bytes, subscriptions and destination lengths are capped (defaults, then
/// configured values), each an ERROR and close when exceeded. They used to be
/// unbounded: 2,000 BEGINs with 60 KB ids took the broker from 24 to 139 MiB.
#[test]
fn stomp_per_connection_state_is_capped() {
    let b = TestBroker::start_with_config(CONFIG);
    let begin = |t: &str| ("BEGIN", hdr(&[("transaction", t)]), Vec::new());
    let names: Vec<String> = (0..17).map(|i| format!("t{i}")).collect();
    let frames: Vec<_> = names.iter().map(|t| begin(t)).collect();
    stomp_refused(&b, &frames, "Too many transactions");
    stomp_refused(
        &b,
        &[begin(&"x".repeat(60_000))],
        "longer than the 256 allowed",
    );
    let subs: Vec<_> = (0..257)
        .map(|i| {
            let id = i.to_string();
            let dest = format!("/topic/cap.{i}");
            (
                "SUBSCRIBE",
                hdr(&[("id", &id), ("destination", &dest)]),
                Vec::new(),
            )
        })
        .collect();
    stomp_refused(&b, &subs, "Too many subscriptions");
    let long_topic = format!("/topic/{}", "k".repeat(300));
    stomp_refused(
        &b,
        &[("SEND", hdr(&[("destination", &long_topic)]), b"x".to_vec())],
        "destination too long",
    );
    stomp_refused(
        &b,
        &[(
            "SUBSCRIBE",
            hdr(&[("id", "0"), ("destination", &long_topic)]),
            Vec::new(),
        )],
        "destination too long",
    );
    drop(b);

    let b = TestBroker::start_with_config(&format!(
        "{CONFIG}\n[stomp]\nmax_transactions = 2\nmax_transaction_frames = 3\n\
         max_transaction_bytes = \"64 KiB\"\nmax_subscriptions = 1\nmax_id_length = 8\n"
    ));
    stomp_refused(
        &b,
        &[begin("a"), begin("b"), begin("c")],
        "Too many transactions",
    );
    stomp_refused(&b, &[begin("123456789")], "longer than the 8 allowed");
    let send = |body: usize| {
        (
            "SEND",
            hdr(&[("destination", "/queue/cap"), ("transaction", "t")]),
            vec![b'x'; body],
        )
    };
    stomp_refused(
        &b,
        &[begin("t"), send(1), send(1), send(1), send(1)],
        "holds 3 frames",
    );
    stomp_refused(
        &b,
        &[begin("t"), send(40 << 10), send(40 << 10)],
        "Transaction too large",
    );
    stomp_refused(
        &b,
        &[
            (
                "SUBSCRIBE",
                hdr(&[("id", "1"), ("destination", "/queue/cap")]),
                Vec::new(),
            ),
            (
                "SUBSCRIBE",
                hdr(&[("id", "2"), ("destination", "/queue/cap")]),
                Vec::new(),
            ),
        ],
        "Too many subscriptions",
    );
    // within the caps all is well: a committed transaction is delivered
    let mut c = StompClient::connect(b.stomp_addr(), Duration::from_secs(10)).unwrap();
    c.send("BEGIN", &[("transaction", "t")], b"").unwrap();
    c.send(
        "SEND",
        &[("destination", "/queue/cap-ok"), ("transaction", "t")],
        b"in tx",
    )
    .unwrap();
    c.send("COMMIT", &[("transaction", "t"), ("receipt", "r")], b"")
        .unwrap();
    let f = c.read_frame().unwrap();
    assert_eq!(f.command, "RECEIPT", "{f:?}");
}

/// Issue 14 item 14, the other half: a peer that stops reading is closed after the
/// heartbeat timeout too. A consumer with a 1 s heartbeat that keeps its socket open but
/// reads nothing while 24 MiB are delivered to it used to hold the broker's write to it
/// forever (the heartbeat check does not run while a write is stuck).
#[test]
fn consumer_that_stops_reading_is_closed_after_the_heartbeat_timeout() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = TestBroker::start_with_config(CONFIG);
    rt.block_on(async {
        let conn = amqp::connect(b.amqp_addr()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        amqp::declare_durable(&ch, "stalled").await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let body = vec![b's'; 512 << 10];
        for _ in 0..48 {
            ch.basic_publish(
                "".into(),
                "stalled".into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
        conn.close(200, "setup".into()).await.unwrap();
    });
    let mut c = amqp_open_hb(b.amqp_addr(), 1);
    let mut args = 0u16.to_be_bytes().to_vec();
    shortstr("stalled", &mut args);
    shortstr("s", &mut args);
    args.push(0x02); // no-ack: nothing bounds the deliveries but the socket
    args.extend_from_slice(&0u32.to_be_bytes());
    c.write_all(&amqp_method(1, 60, 20, &args)).unwrap();
    // From here on nothing is read; the client's heartbeats keep going out, so only the
    // stuck write can tell the broker that this peer is gone.
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && !b.log().contains("peer stopped reading") {
        if !write_lossy(&mut c, &amqp_frame(8, 0, &[])) {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    b.wait_for_log("peer stopped reading", Duration::from_secs(1));
    let (_, closed) = read_until_close(&mut c, Duration::from_secs(30));
    assert!(
        closed,
        "the broker kept the connection of a peer that stopped reading"
    );
}

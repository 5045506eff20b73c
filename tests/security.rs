//! Users, permissions, limits and failed logins of the real broker, per protocol: AMQP
//! with lapin, STOMP and MQTT as raw frames over a socket.
//!
//! One configuration for all ([`CONFIG`]): `alice` may configure, write and read
//! resources named `alice-...` (and use MQTT), `bob` may only read, `carol` has no
//! permissions at all, and vhost `other` exists but only `guest` may open it.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::TestBroker;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use triad_core::testing::{eventually, eventually_async};
use triad_core::PasswordHash;

const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// `auth.failed_login_delay` of the test broker.
const DELAY: Duration = Duration::from_millis(600);

fn config(extra: &str) -> String {
    let hash = |p: &str| PasswordHash::new(p).expect("hash").to_base64();
    format!(
        r#"
[store]
segment_size = "4 MiB"

[auth]
failed_login_delay = "600ms"

[limits]
max_message_size = "1 MiB"
max_connections_per_user = 2
{extra}

[[users]]
name = "alice"
password_hash = "{alice}"
tags = ["management"]

[[users]]
name = "bob"
password_hash = "{bob}"

[[users]]
name = "carol"
password_hash = "{carol}"

[[vhosts]]
name = "other"

[[permissions]]
user = "guest"
vhost = "/"
configure = ".*"
write = ".*"
read = ".*"

[[permissions]]
user = "guest"
vhost = "other"
configure = ".*"
write = ".*"
read = ".*"

[[permissions]]
user = "alice"
vhost = "/"
configure = "^(alice-|mqtt-subscription-alice)"
write = "^(alice-|amq\\.default$|amq\\.topic$|mqtt-subscription-alice)"
read = "^(alice-|amq\\.topic$|mqtt-subscription-alice)"

[[permissions]]
user = "bob"
vhost = "/"
configure = ""
write = ""
read = ".*"
"#,
        alice = hash("alice-pw"),
        bob = hash("bob-pw"),
        carol = hash("carol-pw"),
    )
}

fn start() -> TestBroker {
    TestBroker::start_with_config(&config(""))
}

fn uri(broker: &TestBroker, user: &str, pass: &str, vhost: &str) -> String {
    let vhost = if vhost == "/" { "%2f" } else { vhost };
    format!("amqp://{user}:{pass}@{}/{vhost}", broker.amqp_addr())
}

async fn amqp(
    broker: &TestBroker,
    user: &str,
    pass: &str,
    vhost: &str,
) -> lapin::Result<Connection> {
    tokio::time::timeout(
        IO_TIMEOUT,
        Connection::connect(
            &uri(broker, user, pass, vhost),
            ConnectionProperties::default(),
        ),
    )
    .await
    .expect("AMQP connect answered in time")
}

fn assert_refused<T>(r: lapin::Result<T>, what: &str, needle: &str) {
    match r {
        Ok(_) => panic!("{what}: expected a refusal"),
        Err(e) => assert!(e.to_string().contains(needle), "{what}: {e}"),
    }
}

async fn declare(ch: &lapin::Channel, name: &str) -> lapin::Result<lapin::Queue> {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
}

#[tokio::test]
async fn amqp_permissions_are_enforced() {
    let broker = start();
    // guest owns a queue alice may not read
    let guest = amqp(&broker, "guest", "guest", "/").await.expect("guest");
    let gch = guest.create_channel().await.expect("channel");
    declare(&gch, "guest-q").await.expect("guest declares");

    let alice = amqp(&broker, "alice", "alice-pw", "/")
        .await
        .expect("alice logs in");
    let ch = alice.create_channel().await.expect("channel");
    // allowed: declare, publish through the default exchange, get
    declare(&ch, "alice-q").await.expect("alice-q is alice's");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    ch.basic_publish(
        "".into(),
        "alice-q".into(),
        BasicPublishOptions::default(),
        b"hi",
        BasicProperties::default(),
    )
    .await
    .expect("publish")
    .await
    .expect("confirmed");
    let got = ch
        .basic_get("alice-q".into(), BasicGetOptions { no_ack: true })
        .await
        .expect("get");
    assert_eq!(got.expect("a message").delivery.data, b"hi");

    // forbidden declare: 403 on the channel, the connection lives on
    let ch = alice.create_channel().await.expect("channel");
    assert_refused(
        declare(&ch, "bob-q").await,
        "declare bob-q",
        "ACCESS_REFUSED",
    );
    // a server-named queue is amq.gen-...: not alice's either (RabbitMQ does the same)
    let ch = alice.create_channel().await.expect("channel");
    assert_refused(declare(&ch, "").await, "server-named", "ACCESS_REFUSED");
    // forbidden consume and get: read on guest-q
    let ch = alice.create_channel().await.expect("channel");
    assert_refused(
        ch.basic_consume(
            "guest-q".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await,
        "consume guest-q",
        "ACCESS_REFUSED",
    );
    let ch = alice.create_channel().await.expect("channel");
    assert_refused(
        ch.basic_get("guest-q".into(), BasicGetOptions::default())
            .await,
        "get guest-q",
        "ACCESS_REFUSED",
    );
    // forbidden bind: read on amq.fanout
    let ch = alice.create_channel().await.expect("channel");
    assert_refused(
        ch.queue_bind(
            "alice-q".into(),
            "amq.fanout".into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await,
        "bind to amq.fanout",
        "ACCESS_REFUSED",
    );
    // forbidden publish: write on amq.fanout closes the channel with 403
    let ch = alice.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let published = match ch
        .basic_publish(
            "amq.fanout".into(),
            "".into(),
            BasicPublishOptions::default(),
            b"no",
            BasicProperties::default(),
        )
        .await
    {
        Ok(confirm) => confirm.await.map(|_| ()),
        Err(e) => Err(e),
    };
    let after = declare(&ch, "alice-q").await.map(|_| ());
    assert!(
        published.is_err() || after.is_err(),
        "the channel is closed after a forbidden publish"
    );
    // the connection itself still works
    let ch = alice.create_channel().await.expect("connection still open");
    declare(&ch, "alice-q2").await.expect("still allowed");

    // bob reads, but may configure nothing
    let bob = amqp(&broker, "bob", "bob-pw", "/").await.expect("bob");
    let ch = bob.create_channel().await.expect("channel");
    ch.basic_get("guest-q".into(), BasicGetOptions::default())
        .await
        .expect("bob may read guest-q");
    assert_refused(
        declare(&ch, "bob-q").await,
        "bob declares",
        "ACCESS_REFUSED",
    );
    let ch = bob.create_channel().await.expect("channel");
    // passive declares need no permission
    ch.queue_declare(
        "guest-q".into(),
        QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("passive declare");
}

#[tokio::test]
async fn amqp_vhost_access_and_connection_limits() {
    let broker = start();
    // a vhost without permissions: 530 on connection.open
    assert_refused(
        amqp(&broker, "alice", "alice-pw", "other").await,
        "alice opens other",
        "NOT_ALLOWED",
    );
    // a user without any permissions cannot open the default vhost
    assert_refused(
        amqp(&broker, "carol", "carol-pw", "/").await,
        "carol opens /",
        "NOT_ALLOWED",
    );
    // a vhost that does not exist
    assert_refused(
        amqp(&broker, "guest", "guest", "nope").await,
        "missing vhost",
        "NOT_ALLOWED",
    );
    amqp(&broker, "guest", "guest", "other")
        .await
        .expect("guest may open other");

    // max_connections_per_user = 2: the third of alice's is refused, another user
    // is not affected, and a closed connection gives its slot back
    let a1 = amqp(&broker, "alice", "alice-pw", "/").await.expect("a1");
    let a2 = amqp(&broker, "alice", "alice-pw", "/").await.expect("a2");
    assert_refused(
        amqp(&broker, "alice", "alice-pw", "/").await,
        "third connection",
        "NOT_ALLOWED",
    );
    let _b = amqp(&broker, "bob", "bob-pw", "/")
        .await
        .expect("bob unaffected");
    a1.close(200, "bye".into()).await.expect("close");
    eventually_async("alice's slot given back", IO_TIMEOUT, async || {
        amqp(&broker, "alice", "alice-pw", "/").await
    })
    .await;
    drop(a2);
}

#[tokio::test]
async fn amqp_failed_login_is_delayed_and_logged() {
    let broker = start();
    // a failed login waits DELAY; a good one meanwhile does not
    let bad = {
        let uri = uri(&broker, "alice", "wrong", "/");
        tokio::spawn(async move {
            let t = Instant::now();
            let r = Connection::connect(&uri, ConnectionProperties::default()).await;
            (t.elapsed(), r.map(|_| ()))
        })
    };
    // the refusal is logged as its delay begins: the good login below starts inside it
    eventually("the bad login refused", IO_TIMEOUT, || {
        broker.log().contains("AMQP login refused")
    })
    .await;
    let t = Instant::now();
    amqp(&broker, "guest", "guest", "/").await.expect("guest");
    let good = t.elapsed();
    let (elapsed, r) = bad.await.expect("task");
    assert_refused(r, "wrong password", "ACCESS_REFUSED");
    assert!(elapsed >= DELAY, "refusal after {elapsed:?}");
    assert!(
        good < DELAY,
        "a good login waited {good:?}: the delay must not block other connections"
    );
    // an unknown user: the same answer
    assert_refused(
        amqp(&broker, "mallory", "x", "/").await,
        "unknown user",
        "ACCESS_REFUSED",
    );
    let log = broker.log();
    // logged at info with the peer address and the user name
    assert!(
        log.lines().any(|l| l.contains("INFO")
            && l.contains("AMQP login refused")
            && l.contains("peer=127.0.0.1")
            && l.contains("alice")),
        "{log}"
    );
    assert!(!log.contains(" ERROR "), "refusals are not errors: {log}");
}

#[tokio::test]
async fn queue_limit_per_vhost() {
    let broker = TestBroker::start_with_config(&config("max_queues_per_vhost = 12"));
    let guest = amqp(&broker, "guest", "guest", "other")
        .await
        .expect("guest");
    let ch = guest.create_channel().await.expect("channel");
    for i in 0..12 {
        declare(&ch, &format!("q{i}"))
            .await
            .expect("under the limit");
    }
    // redeclaring an existing queue is fine
    declare(&ch, "q3").await.expect("redeclare");
    let e = declare(&ch, "q12").await.expect_err("over the limit");
    let e = e.to_string();
    assert!(e.contains("PRECONDITION_FAILED"), "{e}");
    assert!(
        e.contains("queue limit in vhost 'other' (12) is reached"),
        "{e}"
    );
}

// ---- STOMP ----------------------------------------------------------------------

fn stomp_connect(addr: SocketAddr, headers: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    let frame = format!("CONNECT\naccept-version:1.2\nhost:localhost\n{headers}\n\0");
    s.write_all(frame.as_bytes()).expect("write");
    s
}

/// Reads one frame (up to its NUL), skipping heart-beat newlines.
fn stomp_read(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match s.read(&mut b) {
            Ok(0) => break,
            Ok(_) if b[0] == 0 => break,
            Ok(_) if b[0] == b'\n' && out.is_empty() => {}
            Ok(_) => out.push(b[0]),
            Err(e) => panic!("STOMP read: {e} after {:?}", String::from_utf8_lossy(&out)),
        }
    }
    String::from_utf8(out).expect("UTF-8 frame")
}

fn stomp_send(s: &mut TcpStream, frame: &str) -> String {
    s.write_all(frame.as_bytes()).expect("write");
    s.write_all(b"\0").expect("write");
    stomp_read(s)
}

#[test]
fn stomp_permissions_and_logins() {
    let broker = start();
    let addr = broker.stomp_addr();

    let mut s = stomp_connect(addr, "login:alice\npasscode:alice-pw\n");
    assert!(stomp_read(&mut s).starts_with("CONNECTED"));
    let r = stomp_send(
        &mut s,
        "SEND\ndestination:/queue/alice-s\nreceipt:1\n\nhello",
    );
    assert!(r.starts_with("RECEIPT"), "{r}");
    // the RECEIPT and the MESSAGE, in either order
    let r = stomp_send(
        &mut s,
        "SUBSCRIBE\nid:0\ndestination:/queue/alice-s\nreceipt:2\n\n",
    );
    let r2 = stomp_read(&mut s);
    let mut got = [r, r2].map(|f| f.lines().next().unwrap_or("").to_owned());
    got.sort();
    assert_eq!(got, ["MESSAGE", "RECEIPT"]);
    // forbidden SEND: write on amq.fanout
    let r = stomp_send(
        &mut s,
        "SEND\ndestination:/exchange/amq.fanout/k\nreceipt:3\n\nno",
    );
    assert!(r.starts_with("ERROR"), "{r}");
    assert!(r.contains("message:access_refused"), "{r}");
    assert!(r.contains("exchange 'amq.fanout'"), "{r}");

    // forbidden SEND to a queue alice may not configure (/queue/ declares it)
    let mut s = stomp_connect(addr, "login:alice\npasscode:alice-pw\n");
    assert!(stomp_read(&mut s).starts_with("CONNECTED"));
    let r = stomp_send(&mut s, "SEND\ndestination:/queue/bob-s\n\nno");
    assert!(r.contains("message:access_refused"), "{r}");

    // forbidden SUBSCRIBE: read on a queue that is not alice's
    let mut s = stomp_connect(addr, "login:alice\npasscode:alice-pw\n");
    assert!(stomp_read(&mut s).starts_with("CONNECTED"));
    let r = stomp_send(&mut s, "SUBSCRIBE\nid:0\ndestination:/amq/queue/bob-s\n\n");
    assert!(
        r.contains("message:access_refused") || r.contains("not_found"),
        "{r}"
    );

    // bad password: ERROR after the delay
    let t = Instant::now();
    let mut s = stomp_connect(addr, "login:alice\npasscode:nope\n");
    let r = stomp_read(&mut s);
    assert!(r.starts_with("ERROR") && r.contains("Bad CONNECT"), "{r}");
    assert!(t.elapsed() >= DELAY, "answered after {:?}", t.elapsed());

    // a vhost alice has no permissions in: answered as a bad password (issue 14
    // item 9: the answer must not tell that the password is right), logged as it is
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    let r = stomp_send(
        &mut s,
        "CONNECT\naccept-version:1.2\nhost:other\nlogin:alice\npasscode:alice-pw\n\n",
    );
    assert!(r.starts_with("ERROR"), "{r}");
    assert!(r.contains("invalid credentials"), "{r}");
    assert!(!r.contains("vhost"), "{r}");
    assert!(
        broker
            .log()
            .contains("access to vhost 'other' refused for user 'alice'"),
        "{}",
        broker.log()
    );
    assert!(
        broker.log().contains("STOMP login refused"),
        "{}",
        broker.log()
    );
}

// ---- MQTT -----------------------------------------------------------------------

fn mqtt_str(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s);
}

fn mqtt_packet(first: u8, body: &[u8]) -> Vec<u8> {
    let mut p = vec![first];
    let mut n = body.len();
    loop {
        let digit = (n % 128) as u8;
        n /= 128;
        p.push(if n > 0 { digit | 0x80 } else { digit });
        if n == 0 {
            break;
        }
    }
    p.extend_from_slice(body);
    p
}

/// CONNECT with clean session; returns the socket and the CONNACK return code.
fn mqtt_connect(addr: SocketAddr, client: &str, login: Option<(&str, &str)>) -> (TcpStream, u8) {
    let mut body = Vec::new();
    mqtt_str(&mut body, b"MQTT");
    body.push(4);
    body.push(if login.is_some() { 0xC2 } else { 0x02 });
    body.extend_from_slice(&60u16.to_be_bytes());
    mqtt_str(&mut body, client.as_bytes());
    if let Some((u, p)) = login {
        mqtt_str(&mut body, u.as_bytes());
        mqtt_str(&mut body, p.as_bytes());
    }
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    s.write_all(&mqtt_packet(0x10, &body)).expect("write");
    let mut ack = [0u8; 4];
    s.read_exact(&mut ack).expect("CONNACK");
    assert_eq!(&ack[..2], &[0x20, 2]);
    (s, ack[3])
}

/// SUBSCRIBE to one filter at QoS 1; the SUBACK return code.
fn mqtt_subscribe(s: &mut TcpStream, filter: &str) -> u8 {
    let mut body = vec![0, 7];
    mqtt_str(&mut body, filter.as_bytes());
    body.push(1);
    s.write_all(&mqtt_packet(0x82, &body)).expect("write");
    let mut ack = [0u8; 5];
    s.read_exact(&mut ack).expect("SUBACK");
    assert_eq!(&ack[..4], &[0x90, 3, 0, 7]);
    ack[4]
}

/// PUBLISH at QoS 1; `Some(())` on PUBACK, `None` when the broker closed instead.
fn mqtt_publish(s: &mut TcpStream, topic: &str) -> Option<()> {
    mqtt_publish_payload(s, topic, b"payload")
}

fn mqtt_publish_payload(s: &mut TcpStream, topic: &str, payload: &[u8]) -> Option<()> {
    let mut body = Vec::new();
    mqtt_str(&mut body, topic.as_bytes());
    body.extend_from_slice(&[0, 9]);
    body.extend_from_slice(payload);
    s.write_all(&mqtt_packet(0x32, &body)).ok()?;
    let mut ack = [0u8; 4];
    s.read_exact(&mut ack).ok()?;
    assert_eq!(ack, [0x40, 2, 0, 9]);
    Some(())
}

#[test]
fn mqtt_permissions_and_logins() {
    let broker = start();
    let addr = broker.mqtt_addr();

    let (mut s, code) = mqtt_connect(addr, "alice", Some(("alice", "alice-pw")));
    assert_eq!(code, 0);
    assert_eq!(mqtt_subscribe(&mut s, "a/b"), 1, "granted QoS 1");
    assert_eq!(mqtt_publish(&mut s, "a/b"), Some(()));

    // bob may read but not configure his subscription queue: SUBACK 0x80
    let (mut s, code) = mqtt_connect(addr, "bob", Some(("bob", "bob-pw")));
    assert_eq!(code, 0);
    assert_eq!(mqtt_subscribe(&mut s, "a/b"), 0x80);
    // ... nor write to amq.topic: the connection is closed, as RabbitMQ does
    assert_eq!(mqtt_publish(&mut s, "a/b"), None);

    // bad password: 4, after the delay; no permissions on the vhost: also 4 (below)
    let t = Instant::now();
    let (_s, code) = mqtt_connect(addr, "x1", Some(("alice", "wrong")));
    assert_eq!(code, 4);
    assert!(t.elapsed() >= DELAY, "answered after {:?}", t.elapsed());
    let (_s, code) = mqtt_connect(addr, "x2", Some(("nobody", "x")));
    assert_eq!(code, 4);
    // a refusal after the password was accepted answers as a bad password (item 9)
    let (_s, code) = mqtt_connect(addr, "x3", Some(("carol", "carol-pw")));
    assert_eq!(code, 4);
    // anonymous from loopback: the default user, as before
    let (_s, code) = mqtt_connect(addr, "x4", None);
    assert_eq!(code, 0);
    // connection limit per user (alice has one open): the third is refused, as for a
    // bad password
    let (_a2, code) = mqtt_connect(addr, "alice2", Some(("alice", "alice-pw")));
    assert_eq!(code, 0);
    let (_a3, code) = mqtt_connect(addr, "alice3", Some(("alice", "alice-pw")));
    assert_eq!(code, 4);
    assert!(
        broker.log().contains("MQTT login refused"),
        "{}",
        broker.log()
    );
}

// ---- pre-authentication sizes ---------------------------------------------------

/// Reads until the peer closes; everything it sent.
fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            // a reset after the close also ends it
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return out,
            Err(e) => panic!("peer did not close: {e}; got {out:?}"),
        }
    }
}

#[test]
fn oversized_frames_before_login_are_refused_without_buffering() {
    let broker = start();
    // AMQP: before connection.tune-ok frames are limited to 8 KiB; the header of a
    // 1 MiB frame is enough for connection.close 501 FRAME_ERROR
    let mut s = TcpStream::connect(broker.amqp_addr()).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    s.write_all(b"AMQP\x00\x00\x09\x01").expect("header");
    s.write_all(&[1, 0, 0, 0, 0x10, 0, 0])
        .expect("frame header");
    let got = read_to_close(&mut s);
    let close = [0u8, 10, 0, 50, 0x01, 0xF5]; // connection.close, reply code 501
    assert!(
        got.windows(close.len()).any(|w| w == close),
        "connection.close 501 expected: {got:?}"
    );

    // STOMP: 64 KiB before CONNECT is accepted
    let mut s = TcpStream::connect(broker.stomp_addr()).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    let big = format!(
        "CONNECT\naccept-version:1.2\nx:{}\n\n",
        "a".repeat(70 << 10)
    );
    let _ = s.write_all(big.as_bytes());
    let got = String::from_utf8_lossy(&read_to_close(&mut s)).into_owned();
    assert!(got.starts_with("ERROR"), "{got}");

    // MQTT: a CONNECT announcing 1 MiB is refused on its fixed header alone
    let mut s = TcpStream::connect(broker.mqtt_addr()).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    s.write_all(&[0x10, 0x80, 0x80, 0x40])
        .expect("fixed header");
    let got = read_to_close(&mut s);
    assert!(
        got.is_empty(),
        "no CONNACK for an oversized CONNECT: {got:?}"
    );
}

// ---- topic permissions ------------------------------------------------------------

#[tokio::test]
async fn topic_permissions_per_protocol() {
    let toml = format!(
        "{}\n[[topic_permissions]]\nuser = \"alice\"\nvhost = \"/\"\nexchange = \"amq.topic\"\n\
         write = \"^{{username}}\\\\.\"\nread = \"^(public|{{username}})\\\\.\"\n",
        config("")
    );
    let broker = TestBroker::start_with_config(&toml);

    // AMQP: binding keys against read, routing keys against write
    let alice = amqp(&broker, "alice", "alice-pw", "/")
        .await
        .expect("alice");
    let ch = alice.create_channel().await.expect("channel");
    declare(&ch, "alice-t").await.expect("declare");
    let bind = |ch: lapin::Channel, key: &'static str| async move {
        ch.queue_bind(
            "alice-t".into(),
            "amq.topic".into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
    };
    bind(ch.clone(), "public.#")
        .await
        .expect("public.# is readable");
    bind(ch.clone(), "alice.*")
        .await
        .expect("alice.* is readable");
    assert_refused(bind(ch.clone(), "#").await, "bind #", "ACCESS_REFUSED");
    let ch = alice.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let publish = |ch: lapin::Channel, key: &'static str| async move {
        match ch
            .basic_publish(
                "amq.topic".into(),
                key.into(),
                BasicPublishOptions::default(),
                b"m",
                BasicProperties::default(),
            )
            .await
        {
            Ok(c) => c.await.map(|_| ()),
            Err(e) => Err(e),
        }
    };
    publish(ch.clone(), "alice.x")
        .await
        .expect("alice.x is writable");
    let refused = publish(ch.clone(), "bob.x").await;
    let after = declare(&ch, "alice-t").await.map(|_| ());
    assert!(refused.is_err() || after.is_err(), "bob.x refused");

    // STOMP: /topic/K publishes to amq.topic with key K
    let mut s = stomp_connect(broker.stomp_addr(), "login:alice\npasscode:alice-pw\n");
    assert!(stomp_read(&mut s).starts_with("CONNECTED"));
    let r = stomp_send(&mut s, "SEND\ndestination:/topic/alice.y\nreceipt:1\n\nok");
    assert!(r.starts_with("RECEIPT"), "{r}");
    let r = stomp_send(&mut s, "SEND\ndestination:/topic/bob.y\nreceipt:2\n\nno");
    assert!(r.contains("message:access_refused"), "{r}");
    assert!(r.contains("topic 'bob.y'"), "{r}");

    // MQTT: filters against read, topics against write (a/b is routing key a.b)
    let (mut m, code) = mqtt_connect(broker.mqtt_addr(), "alice", Some(("alice", "alice-pw")));
    assert_eq!(code, 0);
    assert_eq!(mqtt_subscribe(&mut m, "public/#"), 1);
    assert_eq!(mqtt_subscribe(&mut m, "#"), 0x80);
    assert_eq!(mqtt_publish(&mut m, "alice/z"), Some(()));
    assert_eq!(
        mqtt_publish(&mut m, "bob/z"),
        None,
        "closed on a forbidden topic"
    );
}

/// Issue 14 item 7: `exchange.bind` checks the source exchange's topic `read` pattern
/// on the binding key, as `queue.bind` does (RabbitMQ's `binding_action` checks both).
/// Without it, a user refused `queue.bind amq.topic #` could bind their own exchange to
/// `amq.topic` with `#` and a queue to that, and read everyone's messages.
#[tokio::test]
async fn exchange_bind_checks_topic_read_permission() {
    let toml = format!(
        "{}\n[[topic_permissions]]\nuser = \"alice\"\nvhost = \"/\"\nexchange = \"amq.topic\"\n\
         write = \"^{{username}}\\\\.\"\nread = \"^(public|{{username}})\\\\.\"\n",
        config("")
    );
    let broker = TestBroker::start_with_config(&toml);
    let alice = amqp(&broker, "alice", "alice-pw", "/")
        .await
        .expect("alice");
    let ch = alice.create_channel().await.expect("channel");
    ch.exchange_declare(
        "alice-x".into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("declare alice-x");
    let bind = |ch: lapin::Channel, key: &'static str| async move {
        ch.exchange_bind(
            "alice-x".into(),
            "amq.topic".into(),
            key.into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        )
        .await
    };
    bind(ch.clone(), "public.#")
        .await
        .expect("public.# is readable");
    assert_refused(
        bind(ch.clone(), "#").await,
        "exchange.bind #",
        "ACCESS_REFUSED",
    );
    let ch = alice.create_channel().await.expect("channel");
    assert_refused(
        ch.exchange_unbind(
            "alice-x".into(),
            "amq.topic".into(),
            "bob.#".into(),
            ExchangeUnbindOptions::default(),
            FieldTable::default(),
        )
        .await,
        "exchange.unbind bob.#",
        "ACCESS_REFUSED",
    );

    // nothing published under bob.* reaches alice through her exchange
    let ch = alice.create_channel().await.expect("channel");
    declare(&ch, "alice-q").await.expect("declare alice-q");
    ch.queue_bind(
        "alice-q".into(),
        "alice-x".into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("bind alice-q to her own exchange");
    let guest = amqp(&broker, "guest", "guest", "/").await.expect("guest");
    let gch = guest.create_channel().await.expect("channel");
    gch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    for key in ["bob.secret", "public.news"] {
        gch.basic_publish(
            "amq.topic".into(),
            key.into(),
            BasicPublishOptions::default(),
            key.as_bytes(),
            BasicProperties::default(),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    }
    let got = ch
        .basic_get("alice-q".into(), BasicGetOptions { no_ack: true })
        .await
        .expect("get")
        .expect("public.news arrived");
    assert_eq!(got.delivery.data, b"public.news");
    assert!(ch
        .basic_get("alice-q".into(), BasicGetOptions { no_ack: true })
        .await
        .expect("get")
        .is_none());
}

/// Issue 14 item 13: an `x-death` header a client publishes is not trusted for
/// dead-letter cycle detection (RabbitMQ 4 no longer interprets it). A forged record
/// saying the message already left `xd-q` for `maxlen` used to make the broker take
/// its real drop from `xd-q` for a cycle and discard it instead of dead-lettering it.
/// The broker's own record replaces the forged headers.
#[tokio::test]
async fn client_supplied_x_death_is_not_trusted() {
    use lapin::types::{AMQPValue, FieldArray, LongString, ShortString};
    let broker = start();
    let conn = amqp(&broker, "guest", "guest", "/").await.expect("guest");
    let ch = conn.create_channel().await.expect("channel");
    declare(&ch, "xd-dlq").await.expect("declare dlq");
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(1));
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(LongString::from("")),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(LongString::from("xd-dlq")),
    );
    ch.queue_declare("xd-q".into(), QueueDeclareOptions::default(), args)
        .await
        .expect("declare xd-q");
    let long = |s: &str| AMQPValue::LongString(LongString::from(s));
    let mut forged = FieldTable::default();
    forged.insert("queue".into(), long("xd-q"));
    forged.insert("reason".into(), long("maxlen"));
    forged.insert("count".into(), AMQPValue::LongLongInt(41));
    let mut headers = FieldTable::default();
    headers.insert(
        "x-death".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(forged)])),
    );
    headers.insert("x-first-death-queue".into(), long("elsewhere"));
    headers.insert("app".into(), long("kept"));
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    for (body, h) in [(&b"forged"[..], Some(headers)), (&b"next"[..], None)] {
        let mut props = BasicProperties::default();
        if let Some(h) = h {
            props = props.with_headers(h);
        }
        ch.basic_publish(
            "".into(),
            "xd-q".into(),
            BasicPublishOptions::default(),
            body,
            props,
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    }
    // the second publish pushed the first out of xd-q (max length 1): dead-lettered
    let got = eventually_async(
        "the message with a forged x-death (dropped as a dead-letter cycle?)",
        Duration::from_secs(10),
        async || {
            ch.basic_get("xd-dlq".into(), BasicGetOptions { no_ack: true })
                .await
                .expect("get")
        },
    )
    .await;
    assert_eq!(got.delivery.data, b"forged");
    let h = got.delivery.properties.headers().clone().expect("headers");
    let h = h.inner();
    let key = |k: &str| ShortString::from(k.to_owned());
    assert_eq!(h.get(&key("app")), Some(&long("kept")));
    assert_eq!(h.get(&key("x-first-death-queue")), Some(&long("xd-q")));
    let Some(AMQPValue::FieldArray(deaths)) = h.get(&key("x-death")) else {
        panic!("no x-death: {h:?}");
    };
    let deaths = deaths.as_slice();
    assert_eq!(deaths.len(), 1, "the forged record was kept: {deaths:?}");
    let Some(AMQPValue::FieldTable(d)) = deaths.first() else {
        panic!("{deaths:?}");
    };
    let count = d.inner().get(&key("count"));
    assert!(
        matches!(count, Some(AMQPValue::LongLongInt(1))),
        "count {count:?}"
    );
}

#[test]
fn frame_limits_after_login_are_configurable() {
    let broker = TestBroker::start_with_config(&config(
        "stomp_frame_max = \"128 KiB\"\nmqtt_packet_max = \"128 KiB\"",
    ));
    let small = "x".repeat(100 << 10);
    let big = "x".repeat(200 << 10);

    let mut s = stomp_connect(broker.stomp_addr(), "login:alice\npasscode:alice-pw\n");
    assert!(stomp_read(&mut s).starts_with("CONNECTED"));
    let r = stomp_send(
        &mut s,
        &format!("SEND\ndestination:/queue/alice-big\nreceipt:1\n\n{small}"),
    );
    assert!(r.starts_with("RECEIPT"), "{}", &r[..r.len().min(200)]);
    // refused on its declared content-length, before the body is sent or buffered
    let head = format!(
        "SEND\ndestination:/queue/alice-big\ncontent-length:{}\n\n",
        big.len()
    );
    s.write_all(head.as_bytes()).expect("write");
    let r = stomp_read(&mut s);
    assert!(r.starts_with("ERROR"), "{r}");

    let (mut m, code) = mqtt_connect(broker.mqtt_addr(), "alice", Some(("alice", "alice-pw")));
    assert_eq!(code, 0);
    assert_eq!(
        mqtt_publish_payload(&mut m, "t", small.as_bytes()),
        Some(())
    );
    assert_eq!(
        mqtt_publish_payload(&mut m, "t", big.as_bytes()),
        None,
        "closed on a packet over mqtt_packet_max"
    );
}

// ---- per-user limits ----------------------------------------------------------------

#[tokio::test]
async fn per_user_limits_override_the_global_ones_in_all_protocols() {
    let hash = PasswordHash::new("dave-pw").expect("hash").to_base64();
    // the global max_connections_per_user is 2; dave's own limit is 3 connections and
    // 2 channels over all of them
    let broker = TestBroker::start_with_config(&config(&format!(
        "\n[[users]]\nname = \"dave\"\npassword_hash = \"{hash}\"\nmax_connections = 3\nmax_channels = 2\n\n\
         [[permissions]]\nuser = \"dave\"\nvhost = \"/\"\nconfigure = \".*\"\nwrite = \".*\"\nread = \".*\"\n"
    )));
    // AMQP: the third channel over the user's limit closes the connection with
    // RabbitMQ's 530 and text
    let c = amqp(&broker, "dave", "dave-pw", "/").await.expect("dave");
    let _ch1 = c.create_channel().await.expect("channel 1");
    let _ch2 = c.create_channel().await.expect("channel 2");
    assert_refused(
        c.create_channel().await,
        "third channel",
        "NOT_ALLOWED - number of channels opened for user 'dave' has reached the maximum allowed user limit of (2)",
    );
    drop(c);
    // its connection and channels come back; a STOMP and an MQTT connection hold one
    // channel each
    let mut s1 = eventually("dave's slots given back", IO_TIMEOUT, || {
        let mut s = stomp_connect(broker.stomp_addr(), "login:dave\npasscode:dave-pw\n");
        let f = stomp_read(&mut s);
        if f.starts_with("CONNECTED") {
            Ok(s)
        } else {
            Err(f)
        }
    })
    .await;
    let (_m1, code) = mqtt_connect(broker.mqtt_addr(), "dave-1", Some(("dave", "dave-pw")));
    assert_eq!(code, 0);
    // a third channel-holding connection: STOMP ERROR, MQTT CONNACK 4 (as a bad password)
    let mut s2 = stomp_connect(broker.stomp_addr(), "login:dave\npasscode:dave-pw\n");
    let f = stomp_read(&mut s2);
    assert!(f.starts_with("ERROR"), "{f}");
    let (_m2, code) = mqtt_connect(broker.mqtt_addr(), "dave-2", Some(("dave", "dave-pw")));
    assert_eq!(code, 4);
    // an AMQP connection needs no channel to open: the third connection, past the
    // global limit of 2, is within dave's 3
    let a = amqp(&broker, "dave", "dave-pw", "/")
        .await
        .expect("third connection");
    assert_refused(
        amqp(&broker, "dave", "dave-pw", "/").await,
        "fourth connection",
        "NOT_ALLOWED - connection refused for user 'dave': user connection limit (3) is reached",
    );
    drop(a);
    let _ = stomp_send(&mut s1, "DISCONNECT\nreceipt:1\n\n\0");
    assert!(broker.log().contains("channel limit reached for user"));
}

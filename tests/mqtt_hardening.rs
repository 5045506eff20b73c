//! Regressions of issue 14's MQTT section, each over real sockets against the real
//! binary: a client that exhausts packet identifiers, another user's CONNECT taking a
//! persistent session, retained messages piling up for a client that does not read,
//! the broker's own MQTT state reachable as ordinary queues, `$SYS` written by clients,
//! and IPv4-mapped loopback peers on a dual-stack listener.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::raw::{rss_anon_kib, MqttClient, MqttPacket, StompClient};
use common::{TestBroker, TEST_CONFIG};
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use triad_core::password::PasswordHash;
use triad_core::testing::eventually_blocking;

const T: Duration = Duration::from_secs(10);

fn connect(addr: SocketAddr, id: &str, clean: bool) -> MqttClient {
    MqttClient::connect(addr, id, clean, T).expect("MQTT connect")
}

/// A QoS 1 PUBLISH that must be acknowledged.
fn publish_acked(c: &mut MqttClient, topic: &str, retain: bool, payload: &[u8]) {
    if retain {
        c.publish_retained(topic, 1, 7, payload).unwrap();
    } else {
        c.publish(topic, 1, 7, payload).unwrap();
    }
    let (ack, _) = c.read_until(4).expect("PUBACK");
    assert_eq!(ack.pkid(), Some(7));
}

fn is_retained(p: &MqttPacket) -> bool {
    p.kind() == 3 && p.first & 1 == 1
}

// ---- item 1 -----------------------------------------------------------------------

/// Issue 14 item 1: retained messages sent on SUBSCRIBE took packet ids past the
/// in-flight window until all 65,535 were gone; a delivery then failed, was requeued
/// and retried without awaiting anything, forever, even after the client closed.
#[test]
fn retained_on_subscribe_respects_max_inflight_and_a_closed_socket_ends_the_connection() {
    let mut b = TestBroker::start();
    let addr = b.mqtt_addr();
    let mut p = connect(addr, "spin-pub", true);
    publish_acked(&mut p, "spin/r", true, b"retained");

    let mut sub = connect(addr, "spin-sub", true);
    let mut writer = sub.stream.try_clone().unwrap();
    let local = sub.stream.local_addr().unwrap();
    let publishes = Arc::new(AtomicUsize::new(0));
    let subacks = Arc::new(AtomicUsize::new(0));
    let pingresps = Arc::new(AtomicUsize::new(0));
    let reader = {
        let (publishes, subacks, pingresps) =
            (publishes.clone(), subacks.clone(), pingresps.clone());
        std::thread::spawn(move || {
            // never acknowledges anything
            while let Ok(p) = sub.read_packet() {
                match p.kind() {
                    3 => publishes.fetch_add(1, Ordering::SeqCst),
                    9 => subacks.fetch_add(1, Ordering::SeqCst),
                    13 => pingresps.fetch_add(1, Ordering::SeqCst),
                    _ => 0,
                };
            }
        })
    };
    let filters = vec![("spin/#", 1u8); 1024];
    for i in 0..65u16 {
        let mut c = MqttClient::from_stream(writer.try_clone().unwrap());
        c.send_subscribe(i + 1, &filters).unwrap();
    }
    eventually_blocking("65 SUBACKs", Duration::from_secs(60), || {
        subacks.load(Ordering::SeqCst) == 65
    });
    // one more message for the subscriber, which has no packet id free for it
    publish_acked(&mut p, "spin/live", false, b"live");
    // a round trip through the subscriber's connection: it is still served
    writer.write_all(&[0xC0, 0]).unwrap();
    eventually_blocking("PINGRESP", T, || pingresps.load(Ordering::SeqCst) == 1);
    let got = publishes.load(Ordering::SeqCst);
    assert!(
        got <= 32,
        "{got} QoS 1 messages in flight to a client that acked none (max_inflight 32)"
    );
    assert!(got >= 1, "the retained message was not sent");

    // the client goes away: its connection ends
    writer.shutdown(Shutdown::Both).unwrap();
    reader.join().unwrap();
    let needle = format!("peer={local}");
    eventually_blocking("the connection to close", T, || {
        b.log()
            .lines()
            .any(|l| l.contains("connection closed") && l.contains(&needle))
    });
    assert!(b.terminate().success());
}

// ---- item 3 -----------------------------------------------------------------------

/// Issue 14 item 3: a filter listed 300 times in one SUBSCRIBE got the retained
/// messages 300 times.
#[test]
fn duplicate_filters_in_one_subscribe_get_retained_messages_once() {
    let b = TestBroker::start();
    let addr = b.mqtt_addr();
    let mut p = connect(addr, "dup-pub", true);
    publish_acked(&mut p, "dup/r", true, b"retained");

    let mut sub = connect(addr, "dup-sub", true);
    let mut filters = vec![("dup/#", 0u8); 299];
    filters.push(("dup/#", 1));
    sub.send_subscribe(1, &filters).unwrap();
    let (suback, _) = sub.read_until(9).unwrap();
    let mut codes = vec![0u8; 299];
    codes.push(1);
    assert_eq!(
        suback.body.get(2..),
        Some(&codes[..]),
        "one code per filter"
    );
    publish_acked(&mut p, "dup/marker", false, b"marker");
    let mut retained = 0;
    loop {
        let m = sub.read_packet().unwrap();
        if m.kind() != 3 {
            continue;
        }
        let (topic, pkid, _) = m.publish().unwrap();
        if let Some(id) = pkid {
            sub.puback(id).unwrap();
        }
        if topic == "dup/marker" {
            break;
        }
        assert!(is_retained(&m), "{m:?}");
        retained += 1;
    }
    assert_eq!(retained, 1, "one retained message per distinct filter");
}

/// Issue 14 item 3: one 1 MiB retained message and a SUBSCRIBE whose filters all
/// match it, from a client that reads nothing more: the broker encoded every copy at
/// once (300 MiB). Retained deliveries go through the bounded outbound window.
#[test]
fn retained_messages_to_a_client_that_does_not_read_are_bounded() {
    let b = TestBroker::start();
    let addr = b.mqtt_addr();
    let topic = "big/a/b/c/d/e/f/g/h";
    let mut p = connect(addr, "big-pub", true);
    publish_acked(&mut p, topic, true, &vec![b'x'; 1_000_000]);

    // 256 different filters, each matching the topic (every level literal or `+`)
    let levels: Vec<&str> = topic.split('/').skip(1).collect();
    let filters: Vec<String> = (0..256u32)
        .map(|mask| {
            let mut f = String::from("big");
            for (i, l) in levels.iter().enumerate() {
                f.push('/');
                f.push_str(if mask & (1 << i) != 0 { "+" } else { l });
            }
            f
        })
        .collect();
    let before = rss_anon_kib(b.pid()).unwrap();
    let mut sub = connect(addr, "big-sub", true);
    let list: Vec<(&str, u8)> = filters.iter().map(|f| (f.as_str(), 0)).collect();
    sub.send_subscribe(1, &list).unwrap();
    // read until the SUBACK, then nothing more
    let (suback, _) = sub.read_until(9).unwrap();
    assert_eq!(suback.body.len(), 2 + 256);
    // another client's round trip: the broker has moved on
    publish_acked(&mut p, "big/other", false, b"x");
    let after = rss_anon_kib(b.pid()).unwrap();
    let grown_mib = after.saturating_sub(before) / 1024;
    assert!(
        grown_mib < 64,
        "broker anonymous RSS grew by {grown_mib} MiB for one client that does not read"
    );
    drop(sub);
}

// ---- item 2 -----------------------------------------------------------------------

fn users_config(alice_topic_read: &str) -> String {
    let hash = |p: &str| PasswordHash::new(p).expect("hash").to_base64();
    format!(
        r#"{TEST_CONFIG}
[[users]]
name = "alice"
password_hash = "{alice}"

[[users]]
name = "bob"
password_hash = "{bob}"

[[users]]
name = "mallory"
password_hash = "{mallory}"

[[permissions]]
user = "guest"
vhost = "/"
configure = ".*"
write = ".*"
read = ".*"

[[permissions]]
user = "alice"
vhost = "/"
configure = ".*"
write = ".*"
read = ".*"

[[permissions]]
user = "bob"
vhost = "/"
configure = ".*"
write = ".*"
read = ".*"

[[permissions]]
user = "mallory"
vhost = "/"
configure = ".*"
write = ".*"
read = ".*"

[[topic_permissions]]
user = "alice"
vhost = "/"
exchange = "amq.topic"
write = ".*"
read = '{alice_topic_read}'

[[topic_permissions]]
user = "bob"
vhost = "/"
exchange = "amq.topic"
write = ".*"
read = '^bob\.'

[[topic_permissions]]
user = "mallory"
vhost = "/"
exchange = "amq.topic"
write = '^public\.'
read = ".*"
"#,
        alice = hash("alice-pw"),
        bob = hash("bob-pw"),
        mallory = hash("mallory-pw"),
    )
}

fn login(
    addr: SocketAddr,
    id: &str,
    clean: bool,
    user: &str,
    pass: &str,
) -> (MqttClient, bool, u8) {
    MqttClient::connect_login(addr, id, clean, Some((user, pass)), T).expect("CONNACK")
}

/// Reads PUBLISHes (acking them) until one on `topic`; the topics seen before it.
fn read_until_topic(c: &mut MqttClient, topic: &str) -> Vec<String> {
    let mut seen = Vec::new();
    loop {
        let m = c.read_packet().expect("PUBLISH");
        if m.kind() != 3 {
            continue;
        }
        let (t, pkid, _) = m.publish().unwrap();
        if let Some(id) = pkid {
            c.puback(id).unwrap();
        }
        if t == topic {
            return seen;
        }
        seen.push(t);
    }
}

/// Issue 14 item 2: bob connected with alice's client id and clean session 0 and got
/// alice's queued messages; his clean-session CONNECT deleted her session.
#[test]
fn another_user_cannot_take_over_or_discard_a_persistent_session() {
    let b = TestBroker::start_with_config(&users_config(".*"));
    let addr = b.mqtt_addr();
    let (mut a, present, code) = login(addr, "alice-dev", false, "alice", "alice-pw");
    assert_eq!((present, code), (false, 0));
    assert_eq!(a.subscribe(1, "secret/#", 1).unwrap(), 1);
    a.disconnect().unwrap();
    let mut g = connect(addr, "guest-pub", true);
    publish_acked(&mut g, "secret/x", false, b"for alice");

    // bob: persistent, then clean, with alice's client id: refused, 5
    let (_bob, present, code) = login(addr, "alice-dev", false, "bob", "bob-pw");
    assert_eq!((present, code), (false, 5), "bob resuming alice's session");
    let (_bob, present, code) = login(addr, "alice-dev", true, "bob", "bob-pw");
    assert_eq!(
        (present, code),
        (false, 5),
        "bob discarding alice's session"
    );

    // alice's session is untouched: present, with the message queued for her
    let (mut a, present, code) = login(addr, "alice-dev", false, "alice", "alice-pw");
    assert_eq!((present, code), (true, 0));
    publish_acked(&mut g, "secret/marker", false, b"m");
    assert_eq!(read_until_topic(&mut a, "secret/marker"), ["secret/x"]);
    // while alice is connected, bob cannot kick her off either
    let (_bob, _, code) = login(addr, "alice-dev", false, "bob", "bob-pw");
    assert_eq!(code, 5, "bob taking over alice's live connection");
    a.stream.write_all(&[0xC0, 0]).unwrap();
    let (pong, _) = a.read_until(13).expect("alice still connected");
    assert_eq!(pong.kind(), 13);
}

/// Issue 14 item 2: subscriptions restored from a session are checked against the
/// connecting user's read permissions (here narrowed while the broker was down).
#[test]
fn restored_subscriptions_are_checked_against_read_permissions() {
    let mut b = TestBroker::start_with_config(&users_config(".*"));
    let addr = b.mqtt_addr();
    let (mut a, _, code) = login(addr, "alice-dev", false, "alice", "alice-pw");
    assert_eq!(code, 0);
    assert_eq!(a.subscribe(1, "secret/#", 1).unwrap(), 1);
    assert_eq!(a.subscribe(2, "public/#", 1).unwrap(), 1);
    a.disconnect().unwrap();
    assert!(b.terminate().success());
    let config = b.data_dir().parent().unwrap().join("triad.toml");
    std::fs::write(&config, users_config("^public\\.")).unwrap();
    b.restart();
    let addr = b.mqtt_addr();
    let (mut a, present, code) = login(addr, "alice-dev", false, "alice", "alice-pw");
    assert_eq!((present, code), (true, 0));
    let mut g = connect(addr, "guest-pub", true);
    publish_acked(&mut g, "secret/x", false, b"no longer alice's");
    publish_acked(&mut g, "public/marker", false, b"m");
    assert_eq!(
        read_until_topic(&mut a, "public/marker"),
        Vec::<String>::new(),
        "a restored subscription outside alice's read permission delivered"
    );
}

// ---- item 4 -----------------------------------------------------------------------

fn stomp_login(addr: SocketAddr, user: &str, pass: &str) -> StompClient {
    let mut s = StompClient::from_stream(TcpStream::connect_timeout(&addr, T).unwrap(), Some(T));
    s.send(
        "CONNECT",
        &[
            ("accept-version", "1.2"),
            ("host", "/"),
            ("login", user),
            ("passcode", pass),
        ],
        b"",
    )
    .unwrap();
    let f = s.read_frame().unwrap();
    assert_eq!(f.command, "CONNECTED", "{f:?}");
    s
}

/// Issue 14 item 4: mallory, who may not publish on `alerts/critical`, wrote a
/// retained message for it straight into the queue that holds the retained store;
/// after a restart subscribers to `alerts/#` got it.
#[test]
fn mqtt_state_cannot_be_forged_through_a_queue() {
    let mut b = TestBroker::start_with_config(&users_config(".*"));
    let addr = b.mqtt_addr();
    // MQTT refuses it (the connection is closed, as RabbitMQ does)
    let (mut m, _, code) = login(addr, "mallory", true, "mallory", "mallory-pw");
    assert_eq!(code, 0);
    m.publish_retained("alerts/critical", 1, 1, b"forged")
        .unwrap();
    assert!(
        m.read_packet().is_err(),
        "mallory's MQTT publish was accepted"
    );

    // through STOMP, at the old and the new queue names
    for dest in [
        "/amq/queue/mqtt-retained",
        "/queue/mqtt-retained",
        "/amq/queue/amq.triad.mqtt.retained",
    ] {
        let mut s = stomp_login(b.stomp_addr(), "mallory", "mallory-pw");
        s.send(
            "SEND",
            &[
                ("destination", dest),
                ("x-triad-key", "alerts/critical"),
                ("x-triad-meta", "1"),
                ("persistent", "true"),
                ("receipt", "r1"),
            ],
            b"forged",
        )
        .unwrap();
        // a RECEIPT (stored nowhere that matters) or an ERROR: either way not retained
        let f = s.read_frame().unwrap();
        assert!(f.command == "RECEIPT" || f.command == "ERROR", "{f:?}");
    }
    assert!(b.terminate().success());
    b.restart();

    let addr = b.mqtt_addr();
    let mut g = connect(addr, "guest", true);
    publish_acked(&mut g, "alerts/info", true, b"genuine");
    let mut sub = connect(addr, "watcher", true);
    assert_eq!(sub.subscribe(1, "alerts/#", 1).unwrap(), 1);
    publish_acked(&mut g, "alerts/marker", false, b"m");
    assert_eq!(
        read_until_topic(&mut sub, "alerts/marker"),
        ["alerts/info"],
        "only the genuine retained message"
    );
}

fn amqp_code(e: &lapin::Error) -> String {
    e.to_string()
}

/// Issue 14 item 4: names the broker reserves for itself are refused on declare,
/// publish, bind, purge and delete in AMQP, and on SEND and SUBSCRIBE in STOMP.
#[tokio::test]
async fn reserved_queue_names_are_refused_in_every_protocol() {
    let b = TestBroker::start();
    let uri = format!("amqp://guest:guest@{}/%2f", b.amqp_addr());
    let conn = Connection::connect(&uri, ConnectionProperties::default())
        .await
        .unwrap();
    for name in ["amq.triad.mqtt.retained", "amq.triad.mqtt.sessions"] {
        let ch = conn.create_channel().await.unwrap();
        let e = ch
            .queue_declare(
                name.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap_err();
        assert!(
            amqp_code(&e).contains("ACCESS_REFUSED"),
            "passive declare: {e}"
        );

        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let r = ch
            .basic_publish(
                "".into(),
                name.into(),
                BasicPublishOptions::default(),
                b"forged",
                BasicProperties::default(),
            )
            .await;
        let r = match r {
            Ok(confirm) => confirm.await.map(|_| ()),
            Err(e) => Err(e),
        };
        // the channel is closed by then: a later call shows why
        let e = match r {
            Err(e) => e,
            Ok(()) => ch
                .basic_qos(1, BasicQosOptions::default())
                .await
                .expect_err("publish to a reserved queue was accepted"),
        };
        assert!(amqp_code(&e).contains("ACCESS_REFUSED"), "publish: {e}");

        let ch = conn.create_channel().await.unwrap();
        let e = ch
            .queue_bind(
                name.into(),
                "amq.topic".into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap_err();
        assert!(amqp_code(&e).contains("ACCESS_REFUSED"), "bind: {e}");

        let ch = conn.create_channel().await.unwrap();
        let e = ch
            .queue_purge(name.into(), QueuePurgeOptions::default())
            .await
            .unwrap_err();
        assert!(amqp_code(&e).contains("ACCESS_REFUSED"), "purge: {e}");

        let ch = conn.create_channel().await.unwrap();
        let e = ch
            .queue_delete(name.into(), QueueDeleteOptions::default())
            .await
            .unwrap_err();
        assert!(amqp_code(&e).contains("ACCESS_REFUSED"), "delete: {e}");

        let ch = conn.create_channel().await.unwrap();
        let e = ch
            .basic_get(name.into(), BasicGetOptions::default())
            .await
            .unwrap_err();
        assert!(amqp_code(&e).contains("ACCESS_REFUSED"), "get: {e}");
    }

    let stomp = b.stomp_addr();
    let dest = "/amq/queue/amq.triad.mqtt.retained";
    let mut s = StompClient::connect(stomp, T).unwrap();
    s.send("SEND", &[("destination", dest)], b"forged").unwrap();
    let f = s.read_frame().unwrap();
    assert_eq!(f.command, "ERROR", "{f:?}");
    let mut s = StompClient::connect(stomp, T).unwrap();
    s.send("SUBSCRIBE", &[("destination", dest), ("id", "0")], b"")
        .unwrap();
    let f = s.read_frame().unwrap();
    assert_eq!(f.command, "ERROR", "{f:?}");
}

// ---- item 5 -----------------------------------------------------------------------

/// Issue 14 item 5: clients could publish and retain `$SYS/...`. As Mosquitto does,
/// an MQTT client's PUBLISH there is acknowledged and dropped; AMQP and STOMP publishes
/// to the routing keys `$SYS.#` of amq.topic are refused.
#[tokio::test]
async fn sys_topics_cannot_be_written_by_clients() {
    let b = TestBroker::start();
    let addr = b.mqtt_addr();
    let mut sub = connect(addr, "sys-sub", true);
    assert_eq!(sub.subscribe(1, "$SYS/forged/#", 1).unwrap(), 1);

    let mut p = connect(addr, "sys-pub", true);
    publish_acked(&mut p, "$SYS/forged/retained", true, b"forged");
    publish_acked(&mut p, "$SYS/forged/live", false, b"forged");

    let uri = format!("amqp://guest:guest@{}/%2f", b.amqp_addr());
    let conn = Connection::connect(&uri, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let r = match ch
        .basic_publish(
            "amq.topic".into(),
            "$SYS.forged.amqp".into(),
            BasicPublishOptions::default(),
            b"forged",
            BasicProperties::default(),
        )
        .await
    {
        Ok(c) => c.await.map(|_| ()),
        Err(e) => Err(e),
    };
    let e = match r {
        Err(e) => e,
        Ok(()) => ch
            .basic_qos(1, BasicQosOptions::default())
            .await
            .expect_err("AMQP publish to $SYS accepted"),
    };
    assert!(e.to_string().contains("ACCESS_REFUSED"), "{e}");
    let mut s = StompClient::connect(b.stomp_addr(), T).unwrap();
    s.send(
        "SEND",
        &[("destination", "/topic/$SYS.forged.stomp")],
        b"forged",
    )
    .unwrap();
    let f = s.read_frame().unwrap();
    assert_eq!(f.command, "ERROR", "{f:?}");

    // nothing reached the subscriber, and nothing was retained
    assert_eq!(sub.subscribe(2, "after/#", 1).unwrap(), 1);
    publish_acked(&mut p, "after/marker", false, b"m");
    assert_eq!(
        read_until_topic(&mut sub, "after/marker"),
        Vec::<String>::new()
    );
    let mut late = connect(addr, "sys-late", true);
    late.send_subscribe(1, &[("$SYS/forged/#", 1), ("after/#", 1)])
        .unwrap();
    late.read_until(9).unwrap();
    publish_acked(&mut p, "after/marker", false, b"m");
    assert_eq!(
        read_until_topic(&mut late, "after/marker"),
        Vec::<String>::new()
    );
}

// ---- item 6 -----------------------------------------------------------------------

/// Issue 14 item 6: on a dual-stack `[::]` listener an IPv4 client is
/// `::ffff:127.0.0.1`, which was not taken for loopback: the password-less default
/// user (loopback only) was refused.
#[test]
fn ipv4_mapped_loopback_is_loopback_on_a_dual_stack_listener() {
    let b = TestBroker::start_with(
        Some(TEST_CONFIG),
        &["--mqtt-listen", "[::]:0", "--stomp-listen", "[::]:0"],
    );
    let port = b.mqtt_addr().port();
    let v4: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let (_c, _, code) = MqttClient::connect_login(v4, "mapped", true, None, T).unwrap();
    assert_eq!(code, 0, "anonymous MQTT from 127.0.0.1 via [::]");
    let port = b.stomp_addr().port();
    let v4: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    StompClient::connect(v4, T).expect("anonymous STOMP from 127.0.0.1 via [::]");
    // the connection's log line (one, at close) names its peer as plain IPv4
    eventually_blocking("a peer logged as plain IPv4", T, || {
        b.log().contains("proto=stomp peer=127.0.0.1:")
    });
    assert!(!b.log().contains("::ffff:"), "{}", b.log());
}

/// Issue 14 item 11: subscriptions per MQTT session are capped (`mqtt.max_subscriptions`):
/// past the cap each new filter gets return code 0x80, filters already held are still
/// granted, and the count includes what a persistent session brings back.
#[test]
fn subscriptions_per_session_are_capped() {
    let b =
        TestBroker::start_with_config(&format!("{TEST_CONFIG}\n[mqtt]\nmax_subscriptions = 3\n"));
    let addr = b.mqtt_addr();
    let mut c = connect(addr, "capped", false);
    c.send_subscribe(1, &[("cap/1", 1), ("cap/2", 1), ("cap/1", 0)])
        .unwrap();
    let (suback, _) = c.read_until(9).unwrap();
    assert_eq!(suback.body.get(2..), Some(&[1u8, 1, 0][..]));
    assert_eq!(c.subscribe(2, "cap/3", 1).unwrap(), 1, "the third");
    assert_eq!(c.subscribe(3, "cap/4", 1).unwrap(), 0x80, "past the cap");
    assert_eq!(c.subscribe(4, "cap/2", 0).unwrap(), 0, "one already held");
    // the refused filter routes nothing to the session
    let mut p = connect(addr, "cap-pub", true);
    publish_acked(&mut p, "cap/4", false, b"refused");
    publish_acked(&mut p, "cap/3", false, b"granted");
    loop {
        let m = c.read_packet().unwrap();
        if m.kind() != 3 {
            continue;
        }
        let (topic, pkid, _) = m.publish().unwrap();
        if let Some(id) = pkid {
            c.puback(id).unwrap();
        }
        assert_eq!(topic, "cap/3", "only the granted filter delivers");
        break;
    }
    c.disconnect().unwrap();
    // a persistent session comes back with its three subscriptions: still full
    let mut c = connect(addr, "capped", false);
    assert_eq!(c.subscribe(5, "cap/5", 1).unwrap(), 0x80);
    assert_eq!(c.subscribe(6, "cap/1", 1).unwrap(), 1);
}

/// Issue 14 item 11: topic names and filters are capped at 255 bytes (the routing key
/// they become is an AMQP short string): a longer filter gets 0x80, a PUBLISH to a
/// longer topic ends the connection (MQTT 3.1.1 cannot refuse one message).
#[test]
fn long_topics_and_filters_are_refused() {
    let b = TestBroker::start();
    let addr = b.mqtt_addr();
    let long = format!("t/{}", "x".repeat(300));
    let mut c = connect(addr, "long-topics", true);
    assert_eq!(c.subscribe(1, &long, 1).unwrap(), 0x80);
    let fits = format!("t/{}", "x".repeat(253));
    assert_eq!(c.subscribe(2, &fits, 1).unwrap(), 1, "255 bytes fit");
    c.publish(&long, 1, 3, b"too long").unwrap();
    // closed, not just silent (a read timeout would be WouldBlock / TimedOut)
    let e = c
        .read_packet()
        .expect_err("no PUBACK for a topic over 255 bytes");
    assert!(
        matches!(
            e.kind(),
            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
        ),
        "{e:?}"
    );
}

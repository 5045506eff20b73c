//! Issue 14 item 9: failed logins are throttled per source address and per user name
//! across parallel connections and protocols, and STOMP and MQTT answer a login that
//! is refused after the password was accepted exactly as a bad password.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::raw::{MqttClient, StompClient, StompFrame};
use common::{TestBroker, TEST_CONFIG};
use triad_core::password::PasswordHash;
use triad_core::testing::eventually_blocking;
use triad_core::throttle::BURST;

const T: Duration = Duration::from_secs(30);
/// `auth.failed_login_delay` of the test broker.
const DELAY: Duration = Duration::from_millis(300);

fn config() -> String {
    let hash = |p: &str| PasswordHash::new(p).expect("hash").to_base64();
    format!(
        r#"{TEST_CONFIG}
[auth]
failed_login_delay = "300ms"

[[users]]
name = "alice"
password_hash = "{alice}"

[[users]]
name = "carol"
password_hash = "{carol}"

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
"#,
        alice = hash("alice-pw"),
        carol = hash("carol-pw"),
    )
}

/// MQTT CONNECT with a login; the CONNACK code and how long it took.
fn mqtt_login(addr: SocketAddr, user: &str, pass: &str) -> (u8, Duration) {
    let t = Instant::now();
    let (_c, _, code) = MqttClient::connect_login(
        addr,
        &format!("c-{user}-{pass}"),
        true,
        Some((user, pass)),
        T,
    )
    .expect("CONNACK");
    (code, t.elapsed())
}

/// STOMP CONNECT with a login; the first frame back and how long it took.
fn stomp_login(addr: SocketAddr, user: &str, pass: &str) -> (StompFrame, Duration) {
    let t = Instant::now();
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
    let f = s.read_frame().expect("a frame");
    (f, t.elapsed())
}

/// Parallel connections from one address, over MQTT and STOMP, with different user
/// names: their refusals come one delay apart, not all after one delay.
#[test]
fn parallel_failed_logins_from_one_address_are_answered_one_per_delay() {
    let b = TestBroker::start_with_config(&config());
    let (mqtt, stomp) = (b.mqtt_addr(), b.stomp_addr());
    let n = 8u32;
    let threads: Vec<_> = (0..n)
        .map(|i| {
            std::thread::spawn(move || {
                let user = format!("nobody{i}");
                if i % 2 == 0 {
                    let (code, took) = mqtt_login(mqtt, &user, "guess");
                    assert_eq!(code, 4);
                    took
                } else {
                    let (f, took) = stomp_login(stomp, &user, "guess");
                    assert_eq!(f.command, "ERROR");
                    took
                }
            })
        })
        .collect();
    let mut took: Vec<Duration> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    took.sort();
    assert!(took[0] >= DELAY / 2, "{took:?}");
    let last = *took.last().unwrap();
    assert!(
        last >= DELAY * (n - 2),
        "{n} parallel failures from one address all answered within {last:?}: {took:?}"
    );
}

/// Past the burst, attempts from the address (or for the user name) are refused
/// without the password being checked: the right password too, until the backlog
/// has drained.
#[test]
fn past_the_burst_even_the_right_password_waits() {
    let b = TestBroker::start_with_config(&config());
    let mqtt = b.mqtt_addr();
    let n = BURST + 2;
    let threads: Vec<_> = (0..n)
        .map(|_| std::thread::spawn(move || mqtt_login(mqtt, "alice", "guess").0))
        .collect();
    eventually_blocking("the failures to be logged", T, || {
        b.log().matches("MQTT login refused").count() >= (BURST + 1) as usize
    });
    let (code, _) = mqtt_login(mqtt, "alice", "alice-pw");
    assert_eq!(code, 4, "the right password was checked past the burst");
    for t in threads {
        assert_eq!(t.join().unwrap(), 4);
    }
    // once the refusals have been answered, alice gets in
    eventually_blocking("alice to get in", T, || {
        mqtt_login(mqtt, "alice", "alice-pw").0 == 0
    });
}

/// carol's password is right but she has no permissions on the vhost: the answer is
/// that of a bad password, after the same delay.
#[test]
fn refusals_after_the_password_look_like_a_bad_password() {
    let b = TestBroker::start_with_config(&config());
    let (code, took) = mqtt_login(b.mqtt_addr(), "carol", "carol-pw");
    assert_eq!(code, 4, "MQTT: CONNACK as for a bad password");
    assert!(took >= DELAY / 2, "answered after {took:?}");
    let (wrong, _) = stomp_login(b.stomp_addr(), "carol", "wrong");
    let (right, took) = stomp_login(b.stomp_addr(), "carol", "carol-pw");
    assert_eq!(right.command, "ERROR");
    assert_eq!(
        (right.header("message"), right.body.clone()),
        (wrong.header("message"), wrong.body.clone()),
        "STOMP: the same ERROR as for a bad password"
    );
    assert!(took >= DELAY / 2, "answered after {took:?}");
    assert!(b
        .log()
        .contains("access to vhost '/' refused for user 'carol'"));
}

/// The same over AMQP: parallel connections with bad passwords from one address.
#[tokio::test]
async fn amqp_parallel_failed_logins_are_answered_one_per_delay() {
    let b = TestBroker::start_with_config(&config());
    let n = 6u32;
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let uri = format!("amqp://nobody{i}:guess@{}/%2f", b.amqp_addr());
            tokio::spawn(async move {
                let t = Instant::now();
                let r = tokio::time::timeout(
                    T,
                    lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
                )
                .await
                .expect("answered");
                assert!(r.is_err(), "logged in with a bad password");
                t.elapsed()
            })
        })
        .collect();
    let mut took = Vec::new();
    for t in tasks {
        took.push(t.await.unwrap());
    }
    took.sort();
    let last = *took.last().unwrap();
    assert!(
        last >= DELAY * (n - 2),
        "{n} parallel AMQP failures from one address all answered within {last:?}: {took:?}"
    );
}

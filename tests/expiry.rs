//! Expiry of forgotten state (issue 13, item 5), over real sockets against the real
//! binary: `[mqtt] session_expiry` removes a persistent MQTT session whose client stays
//! away, with its queue and subscriptions, counting from the disconnect also across a
//! restart; queue `x-expires` removes the queue's consume-queue files from disk.
//!
//! A session's existence is read through AMQP (a passive `queue.declare` of its queue
//! `mqtt-subscription-<client id>`), which does not touch the MQTT session. Every wait
//! polls a condition with a deadline.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::raw::{MqttClient, MqttPacket};
use common::{TestBroker, TEST_CONFIG};
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use triad_core::testing::eventually_blocking;

const T: Duration = Duration::from_secs(10);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Whether queue `name` exists: a passive declare on a fresh connection.
fn queue_exists(rt: &tokio::runtime::Runtime, amqp: SocketAddr, name: &str) -> bool {
    rt.block_on(async {
        let conn = common::amqp::connect(amqp).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        let r = ch
            .queue_declare(
                name.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await;
        let _ = conn.close(200, "bye".into()).await;
        r.is_ok()
    })
}

/// Polls until `queue` no longer exists; returns when that was seen. Panics at `deadline`.
fn wait_gone(
    rt: &tokio::runtime::Runtime,
    amqp: SocketAddr,
    queue: &str,
    deadline: Instant,
) -> Instant {
    eventually_blocking(
        &format!("{queue} to be gone"),
        deadline.saturating_duration_since(Instant::now()),
        || !queue_exists(rt, amqp, queue),
    );
    Instant::now()
}

/// A persistent session subscribed at QoS 1 to `dev/<name>/cmd`; session-present flag.
fn subscribe(addr: SocketAddr, name: &str) -> (MqttClient, bool) {
    let (mut c, present) =
        MqttClient::connect_session(addr, &format!("dev-{name}"), false, T).unwrap();
    assert_eq!(c.subscribe(1, &format!("dev/{name}/cmd"), 1).unwrap(), 1);
    (c, present)
}

/// Publishes at QoS 1 from a clean session and waits for the PUBACK.
fn publish(addr: SocketAddr, topic: &str, payload: &[u8]) {
    let mut p = MqttClient::connect(addr, "expiry-publisher", true, T).unwrap();
    p.publish(topic, 1, 7, payload).unwrap();
    loop {
        let a = p.read_packet().unwrap();
        if a.kind() == 4 {
            assert_eq!(a.pkid(), Some(7));
            break;
        }
    }
    p.disconnect().unwrap();
}

/// The next PUBLISH (acked if QoS 1).
fn next_publish(c: &mut MqttClient) -> (String, Vec<u8>) {
    loop {
        let p: MqttPacket = c.read_packet().unwrap();
        if let Some((topic, pkid, body)) = p.publish() {
            if let Some(id) = pkid {
                c.puback(id).unwrap();
            }
            return (topic, body);
        }
    }
}

/// Consume-queue directories (`consumequeue/<vhost>/<queue>`) under a data directory.
fn queue_dirs(data: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    let Ok(vhosts) = std::fs::read_dir(data.join("consumequeue")) else {
        return out;
    };
    for v in vhosts.flatten() {
        if let Ok(qs) = std::fs::read_dir(v.path()) {
            out.extend(qs.flatten().map(|q| q.path()));
        }
    }
    out
}

fn expiry_config(after: &str) -> String {
    format!("{TEST_CONFIG}\n[mqtt]\nsession_expiry = \"{after}\"\n")
}

#[test]
fn persistent_session_expires_after_its_client_left() {
    let b = TestBroker::start_with_config(&expiry_config("1s"));
    let (mqtt, amqp) = (b.mqtt_addr(), b.amqp_addr());
    let rt = rt();

    // dev-stay leaves and comes back before the expiry, then stays connected
    let (stay, present) = subscribe(mqtt, "stay");
    assert!(!present);
    stay.disconnect().unwrap();
    let (mut stay, present) = MqttClient::connect_session(mqtt, "dev-stay", false, T).unwrap();
    assert!(
        present,
        "reconnected before the expiry: the session is still there"
    );

    // dev-gone subscribes, leaves, and gets a message queued while away
    let dirs_before = queue_dirs(b.data_dir());
    let (gone, _) = subscribe(mqtt, "gone");
    gone.disconnect().unwrap();
    let left = Instant::now();
    publish(mqtt, "dev/gone/cmd", b"queued while away");
    let gone_dirs: Vec<PathBuf> = queue_dirs(b.data_dir())
        .difference(&dirs_before)
        .cloned()
        .collect();
    assert!(queue_exists(&rt, amqp, "mqtt-subscription-dev-gone"));

    let seen = wait_gone(
        &rt,
        amqp,
        "mqtt-subscription-dev-gone",
        left + Duration::from_secs(15),
    );
    assert!(
        seen.duration_since(left) >= Duration::from_millis(900),
        "removed {:?} after the disconnect, before the 1 s expiry",
        seen.duration_since(left)
    );
    for d in &gone_dirs {
        assert!(!d.exists(), "{} left on disk", d.display());
    }
    // dev-stay has been connected all along (since before dev-gone left): kept
    assert!(queue_exists(&rt, amqp, "mqtt-subscription-dev-stay"));

    // dev-gone comes back to nothing: no session, and not the old message
    let (mut back, present) = subscribe(mqtt, "gone");
    assert!(!present, "the expired session was reported present");
    publish(mqtt, "dev/gone/cmd", b"after expiry");
    assert_eq!(
        next_publish(&mut back),
        ("dev/gone/cmd".to_string(), b"after expiry".to_vec())
    );
    back.disconnect().unwrap();

    // dev-stay still gets what is sent to it, then leaves and expires in turn
    publish(mqtt, "dev/stay/cmd", b"for stay");
    assert_eq!(next_publish(&mut stay).1, b"for stay".to_vec());
    stay.disconnect().unwrap();
    wait_gone(
        &rt,
        amqp,
        "mqtt-subscription-dev-stay",
        Instant::now() + Duration::from_secs(15),
    );
}

#[test]
fn session_expiry_counts_from_the_disconnect_across_a_restart() {
    let expiry = Duration::from_secs(4);
    let mut b = TestBroker::start_with_config(&expiry_config("4s"));
    let rt = rt();
    let (c, _) = subscribe(b.mqtt_addr(), "restart");
    c.disconnect().unwrap();
    let left = Instant::now();
    // the disconnect is stored before the broker goes down
    assert!(b.terminate().success());
    // a restart well inside the expiry, late enough that counting from the restart
    // would be seen: expired by left + 4 s (+ polling), not left + 6 s
    let restart_at = left + Duration::from_secs(2);
    while Instant::now() < restart_at {
        std::thread::sleep(restart_at.saturating_duration_since(Instant::now()));
    }
    b.restart();
    let started = Instant::now();
    let amqp = b.amqp_addr();
    if started < left + expiry - Duration::from_millis(800) {
        assert!(
            queue_exists(&rt, amqp, "mqtt-subscription-dev-restart"),
            "expired early"
        );
    }
    let seen = wait_gone(
        &rt,
        amqp,
        "mqtt-subscription-dev-restart",
        left + Duration::from_secs(30),
    );
    let after = seen.duration_since(left);
    assert!(after >= expiry - Duration::from_millis(100), "{after:?}");
    assert!(
        seen < started + expiry - Duration::from_millis(500),
        "expired {after:?} after the disconnect, {:?} after the restart: counted from the restart",
        seen.duration_since(started)
    );
    let (c, present) = subscribe(b.mqtt_addr(), "restart");
    assert!(!present);
    c.disconnect().unwrap();
}

#[test]
fn sessions_are_kept_without_session_expiry() {
    let mut b = TestBroker::start();
    let (c, _) = subscribe(b.mqtt_addr(), "kept");
    c.disconnect().unwrap();
    b.restart();
    let (c, present) = subscribe(b.mqtt_addr(), "kept");
    assert!(present, "no session_expiry: the session must survive");
    c.disconnect().unwrap();
}

#[test]
fn queue_x_expires_frees_its_disk() {
    let b = TestBroker::start();
    let (amqp, data) = (b.amqp_addr(), b.data_dir().to_path_buf());
    let rt = rt();
    let before = queue_dirs(&data);
    let declared = rt.block_on(async {
        let conn = common::amqp::connect(amqp).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let mut args = FieldTable::default();
        args.insert("x-expires".into(), AMQPValue::LongInt(1500));
        common::amqp::declare_durable_with(&ch, "expiring", args)
            .await
            .unwrap();
        for i in 0..100u32 {
            ch.basic_publish(
                "".into(),
                "expiring".into(),
                BasicPublishOptions::default(),
                &i.to_be_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
        conn.close(200, "bye".into()).await.unwrap();
        Instant::now()
    });
    let dirs: Vec<PathBuf> = queue_dirs(&data).difference(&before).cloned().collect();
    assert_eq!(dirs.len(), 1, "one new consume-queue directory: {dirs:?}");
    let dir = &dirs[0];
    assert!(dir.exists());
    eventually_blocking(
        &format!(
            "{} off the disk within 20 s of x-expires of 1.5 s",
            dir.display()
        ),
        (declared + Duration::from_secs(20)).saturating_duration_since(Instant::now()),
        || !dir.exists(),
    );
    assert!(!queue_exists(&rt, amqp, "expiring"));
}

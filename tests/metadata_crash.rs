//! `kill -9` while the metadata journal is being written and compacted: rounds of
//! concurrent persistent MQTT sessions and durable AMQP queues being created (one journal
//! record per queue and per binding), with a journal compaction threshold so small that
//! compactions run all the time, then a kill at a random moment. After each restart every
//! session whose SUBACK came back is still there (session present, its subscription
//! routes), and every queue whose declare-ok and bind-ok came back is still there and
//! bound.
//!
//! `TRIAD_META_CRASH_ROUNDS` (default 4) sets the rounds, `TRIAD_CRASH_SEED` replays a run.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::amqp;
use common::raw::{env_u64, MqttClient, Rng};
use common::TestBroker;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;

const CONFIG: &str = r#"
[store]
segment_size = "4 MiB"
metadata_compact_size = "16 KiB"

[limits]
max_message_size = "1 MiB"
"#;

const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Sessions (or queues) each creator makes per round at most; the kill comes first.
const MAX_PER_CREATOR: u64 = 5_000;

/// Creates persistent MQTT sessions `meta-<round>-<creator>-<n>` one after the other until
/// the broker goes away; returns the ids whose SUBACK came back.
fn mqtt_creator(
    broker: std::net::SocketAddr,
    prefix: String,
    stop: Arc<AtomicBool>,
) -> Vec<String> {
    let mut confirmed = Vec::new();
    for n in 0..MAX_PER_CREATOR {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let id = format!("{prefix}-{n}");
        let Ok(mut c) = MqttClient::connect(broker, &id, false, IO_TIMEOUT) else {
            break;
        };
        match c.subscribe(1, &format!("meta/{id}"), 1) {
            Ok(1) => confirmed.push(id),
            Ok(code) => panic!("SUBACK {code} for {id}"),
            Err(_) => break,
        }
        let _ = c.disconnect();
    }
    confirmed
}

/// Declares durable queues bound to `amq.direct` until the broker goes away; returns the
/// names whose declare-ok and bind-ok came back.
async fn amqp_creator(
    broker: std::net::SocketAddr,
    prefix: String,
    stop: Arc<AtomicBool>,
) -> Vec<String> {
    let mut confirmed = Vec::new();
    let Ok(conn) = amqp::connect(broker).await else {
        return confirmed;
    };
    let Ok(ch) = conn.create_channel().await else {
        return confirmed;
    };
    for n in 0..MAX_PER_CREATOR {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let name = format!("{prefix}-{n}");
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        if ch
            .queue_declare(name.as_str().into(), durable, FieldTable::default())
            .await
            .is_err()
        {
            break;
        }
        if ch
            .queue_bind(
                name.as_str().into(),
                "amq.direct".into(),
                name.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .is_err()
        {
            break;
        }
        confirmed.push(name);
    }
    confirmed
}

#[test]
fn nothing_confirmed_is_lost_when_killed_during_journal_writes_and_compactions() {
    let rounds = env_u64("TRIAD_META_CRASH_ROUNDS", 4);
    let seed = Rng::seed_from_env("TRIAD_CRASH_SEED");
    let mut rng = Rng::new(seed);
    let mut broker = TestBroker::start_with_config(CONFIG);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut sessions: Vec<String> = Vec::new();
    let mut queues: Vec<String> = Vec::new();
    for round in 0..rounds {
        let stop = Arc::new(AtomicBool::new(false));
        let mqtt = broker.mqtt_addr();
        let amqp_addr = broker.amqp_addr();
        let mqtt_threads: Vec<_> = (0..3)
            .map(|c| {
                let stop = stop.clone();
                let prefix = format!("meta-{round}-{c}");
                std::thread::spawn(move || mqtt_creator(mqtt, prefix, stop))
            })
            .collect();
        let amqp_done: Arc<Mutex<Vec<String>>> = Arc::default();
        let amqp_task = {
            let stop = stop.clone();
            let out = amqp_done.clone();
            rt.spawn(async move {
                let got = amqp_creator(amqp_addr, format!("metaq-{round}"), stop).await;
                out.lock().unwrap().extend(got);
            })
        };
        // the kill comes at a random moment of the creation
        std::thread::sleep(Duration::from_millis(rng.range(300, 1500)));
        broker.kill9();
        stop.store(true, Ordering::Relaxed);
        for t in mqtt_threads {
            sessions.extend(t.join().unwrap());
        }
        rt.block_on(amqp_task).unwrap();
        queues.extend(amqp_done.lock().unwrap().drain(..));
        broker.restart();
        eprintln!(
            "round {round} (seed {seed}): {} sessions and {} queues confirmed so far",
            sessions.len(),
            queues.len()
        );
    }
    let meta = broker.data_dir().join("meta");
    let snapshots = std::fs::read_dir(&meta)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("snapshot-")
        })
        .count();
    assert!(snapshots > 0, "no compaction ran: the test did not test it");
    assert!(
        sessions.len() > 20 && queues.len() > 20,
        "too little was created"
    );

    // Every confirmed queue is there and bound: a message published to amq.direct with its
    // name as key reaches it.
    rt.block_on(async {
        let conn = amqp::connect(broker.amqp_addr()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        for q in &queues {
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            ch.queue_declare(q.as_str().into(), passive, FieldTable::default())
                .await
                .unwrap_or_else(|e| panic!("confirmed queue {q} lost: {e}"));
            let c = ch
                .basic_publish(
                    "amq.direct".into(),
                    q.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    b"x",
                    BasicProperties::default(),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            assert!(c.take_message().is_none(), "binding of {q} lost (returned)");
        }
    });

    // Every confirmed session is present and its subscription routes.
    let mqtt = broker.mqtt_addr();
    let mut publisher = MqttClient::connect(mqtt, "meta-publisher", true, IO_TIMEOUT).unwrap();
    for (i, id) in sessions.iter().enumerate() {
        let pkid = (i % 60_000) as u16 + 1;
        publisher
            .publish(&format!("meta/{id}"), 1, pkid, b"after the crash")
            .unwrap();
        loop {
            let p = publisher.read_packet().unwrap();
            if p.kind() == 4 {
                break;
            }
        }
    }
    for id in &sessions {
        let (mut c, present) = MqttClient::connect_session(mqtt, id, false, IO_TIMEOUT).unwrap();
        assert!(present, "confirmed session {id} lost");
        let p = c.read_packet().unwrap();
        let (topic, pkid, body) = p.publish().expect("a PUBLISH");
        assert_eq!(topic, format!("meta/{id}"));
        assert_eq!(body, b"after the crash");
        c.puback(pkid.unwrap()).unwrap();
        let _ = c.disconnect();
    }
}

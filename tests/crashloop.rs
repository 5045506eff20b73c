//! Crash loop: rounds of concurrent durable publishing from all three protocols, a
//! `kill -9` of the broker at a random moment, a restart on the same data directory and
//! a full drain of every queue. Each round checks that every message the broker
//! acknowledged as durable (AMQP publisher confirm, STOMP RECEIPT, MQTT PUBACK) is
//! there, and counts duplicates and the fate of messages still unacknowledged at the
//! kill.
//!
//! `TRIAD_CRASH_ROUNDS` (default 20) sets the rounds, `TRIAD_CRASH_SEED` replays a run
//! (the seed is printed first), `TRIAD_CRASH_MAX_KILL_MS` (default 1200) bounds the
//! random publishing time before each kill.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::amqp;
use common::raw::{env_u64, MqttClient, Rng, StompClient};
use common::TestBroker;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation};

const AMQP_QUEUE: &str = "crash-amqp";
const STOMP_QUEUE: &str = "crash-stomp";
const MQTT_QUEUE: &str = "crash-mqtt";
/// MQTT topic `crash/mqtt` is routing key `crash.mqtt` on `amq.topic`.
const MQTT_TOPIC: &str = "crash/mqtt";
const MQTT_KEY: &str = "crash.mqtt";
/// Producers per protocol.
const PRODUCERS: usize = 2;
/// Unacknowledged publishes each producer keeps in flight.
const WINDOW: usize = 64;
/// A bound on each producer per round (the kill comes first in practice).
const MAX_PER_PRODUCER: u64 = 200_000;
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// What one producer sent and what the broker acknowledged: sequences `0..sent` were
/// handed to the socket (or attempted), `acked` were confirmed durable.
#[derive(Debug, Default)]
struct Ledger {
    id: String,
    sent: u64,
    acked: BTreeSet<u64>,
    /// Protocol-level refusals (not I/O errors, which the kill causes).
    refusals: Vec<String>,
}

impl Ledger {
    fn new(id: String) -> Ledger {
        Ledger {
            id,
            ..Ledger::default()
        }
    }
}

/// `<producer id> <sequence> <filler>`: the filler gives each message a realistic size.
fn body(id: &str, seq: u64) -> Vec<u8> {
    format!("{id} {seq} {}", "x".repeat(100)).into_bytes()
}

fn parse_body(b: &[u8]) -> Option<(String, u64)> {
    let s = std::str::from_utf8(b).ok()?;
    let mut w = s.split(' ');
    let id = w.next()?.to_owned();
    let seq = w.next()?.parse().ok()?;
    Some((id, seq))
}

async fn amqp_producer(addr: SocketAddr, id: String, stop: Arc<AtomicBool>) -> Ledger {
    let mut l = Ledger::new(id);
    let Ok(conn) = amqp::connect(addr).await else {
        return l;
    };
    let Ok(ch) = conn.create_channel().await else {
        return l;
    };
    if ch
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .is_err()
    {
        return l;
    }
    let mut pending = VecDeque::new();
    let mut seq = 0;
    loop {
        let done = seq >= MAX_PER_PRODUCER || stop.load(Ordering::Relaxed);
        if !done {
            l.sent = seq + 1;
            let published = ch
                .basic_publish(
                    "".into(),
                    AMQP_QUEUE.into(),
                    BasicPublishOptions::default(),
                    &body(&l.id, seq),
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await;
            let Ok(confirm) = published else { return l };
            pending.push_back((seq, confirm));
            seq += 1;
        }
        while pending.len() > WINDOW || (done && !pending.is_empty()) {
            let Some((n, c)) = pending.pop_front() else {
                break;
            };
            match tokio::time::timeout(IO_TIMEOUT, c).await {
                Ok(Ok(Confirmation::Ack(_))) => {
                    l.acked.insert(n);
                }
                Ok(Ok(other)) => {
                    l.refusals.push(format!("{n}: {other:?}"));
                    return l;
                }
                _ => return l,
            }
        }
        if done {
            return l;
        }
    }
}

fn stomp_producer(addr: SocketAddr, id: String, stop: Arc<AtomicBool>) -> Ledger {
    let mut l = Ledger::new(id);
    let Ok(mut c) = StompClient::connect(addr, IO_TIMEOUT) else {
        return l;
    };
    let dest = format!("/queue/{STOMP_QUEUE}");
    let mut outstanding = VecDeque::new();
    let mut seq = 0;
    loop {
        let done = seq >= MAX_PER_PRODUCER || stop.load(Ordering::Relaxed);
        if !done {
            l.sent = seq + 1;
            let receipt = seq.to_string();
            let headers = [
                ("destination", dest.as_str()),
                ("persistent", "true"),
                ("receipt", receipt.as_str()),
            ];
            if c.send("SEND", &headers, &body(&l.id, seq)).is_err() {
                return l;
            }
            outstanding.push_back(seq);
            seq += 1;
        }
        while outstanding.len() > WINDOW || (done && !outstanding.is_empty()) {
            let Ok(f) = c.read_frame() else { return l };
            let Some(n) = outstanding.pop_front() else {
                break;
            };
            if f.command != "RECEIPT" || f.header("receipt-id") != Some(&n.to_string()) {
                l.refusals
                    .push(format!("{n}: {} {:?}", f.command, f.headers));
                return l;
            }
            l.acked.insert(n);
        }
        if done {
            return l;
        }
    }
}

fn mqtt_producer(addr: SocketAddr, id: String, stop: Arc<AtomicBool>) -> Ledger {
    let mut l = Ledger::new(id);
    let Ok(mut c) = MqttClient::connect(addr, &l.id, true, IO_TIMEOUT) else {
        return l;
    };
    let mut outstanding: HashMap<u16, u64> = HashMap::new();
    let mut seq = 0u64;
    loop {
        let done = seq >= MAX_PER_PRODUCER || stop.load(Ordering::Relaxed);
        if !done {
            l.sent = seq + 1;
            let pkid = (seq % 65_535) as u16 + 1;
            if c.publish(MQTT_TOPIC, 1, pkid, &body(&l.id, seq)).is_err() {
                return l;
            }
            outstanding.insert(pkid, seq);
            seq += 1;
        }
        while outstanding.len() > WINDOW || (done && !outstanding.is_empty()) {
            let Ok(p) = c.read_packet() else { return l };
            let acked = (p.kind() == 4)
                .then(|| p.pkid())
                .flatten()
                .and_then(|id| outstanding.remove(&id));
            match acked {
                Some(n) => {
                    l.acked.insert(n);
                }
                None => {
                    l.refusals.push(format!("unexpected packet {p:?}"));
                    return l;
                }
            }
        }
        if done {
            return l;
        }
    }
}

/// The outcome of one round (or of all rounds, summed).
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    sent: u64,
    acked: u64,
    seen: u64,
    /// Acknowledged but not found after the restart: must stay 0.
    lost: u64,
    /// Extra copies of acknowledged messages.
    dup_acked: u64,
    /// Extra copies of messages unacknowledged at the kill.
    dup_in_doubt: u64,
    /// Unacknowledged at the kill (sent - acked)...
    in_doubt: u64,
    /// ...and of those, found after the restart.
    in_doubt_present: u64,
    /// Messages of earlier rounds (drained and acked then) delivered again.
    stale: u64,
    /// Bodies no producer sent.
    bogus: u64,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.sent += o.sent;
        self.acked += o.acked;
        self.seen += o.seen;
        self.lost += o.lost;
        self.dup_acked += o.dup_acked;
        self.dup_in_doubt += o.dup_in_doubt;
        self.in_doubt += o.in_doubt;
        self.in_doubt_present += o.in_doubt_present;
        self.stale += o.stale;
        self.bogus += o.bogus;
    }

    fn line(&self) -> String {
        format!(
            "sent={} acked={} seen={} confirmed_lost={} dup_acked={} dup_in_doubt={} \
             in_doubt={} in_doubt_present={} stale_redelivered={} bogus={}",
            self.sent,
            self.acked,
            self.seen,
            self.lost,
            self.dup_acked,
            self.dup_in_doubt,
            self.in_doubt,
            self.in_doubt_present,
            self.stale,
            self.bogus
        )
    }
}

/// Compares what one queue held after the restart with its producers' ledgers.
fn check(
    ledgers: &[Ledger],
    seen: &[Vec<u8>],
    round: u64,
    lost_examples: &mut Vec<String>,
) -> Tally {
    let mut t = Tally::default();
    let by_id: HashMap<&str, &Ledger> = ledgers.iter().map(|l| (l.id.as_str(), l)).collect();
    let mut counts: HashMap<(String, u64), u64> = HashMap::new();
    for b in seen {
        t.seen += 1;
        match parse_body(b) {
            Some((id, seq)) if by_id.get(id.as_str()).is_some_and(|l| seq < l.sent) => {
                *counts.entry((id, seq)).or_default() += 1;
            }
            Some((id, _)) if round_of(&id).is_some_and(|r| r < round) => t.stale += 1,
            _ => t.bogus += 1,
        }
    }
    for l in ledgers {
        t.sent += l.sent;
        t.acked += l.acked.len() as u64;
        for seq in 0..l.sent {
            let n = counts.get(&(l.id.clone(), seq)).copied().unwrap_or(0);
            let acked = l.acked.contains(&seq);
            if acked {
                if n == 0 {
                    t.lost += 1;
                    if lost_examples.len() < 10 {
                        lost_examples.push(format!("{} {seq}", l.id));
                    }
                }
                t.dup_acked += n.saturating_sub(1);
            } else {
                t.in_doubt += 1;
                t.in_doubt_present += u64::from(n > 0);
                t.dup_in_doubt += n.saturating_sub(1);
            }
        }
    }
    t
}

/// Producer ids are `r<round>-<proto><n>`.
fn round_of(id: &str) -> Option<u64> {
    id.strip_prefix('r')?.split('-').next()?.parse().ok()
}

#[test]
fn crash_loop_loses_no_acknowledged_message() {
    let rounds = env_u64("TRIAD_CRASH_ROUNDS", 20);
    let max_kill_ms = env_u64("TRIAD_CRASH_MAX_KILL_MS", 1200);
    let seed = Rng::seed_from_env("TRIAD_CRASH_SEED");
    println!("crash loop: {rounds} rounds, seed {seed} (replay with TRIAD_CRASH_SEED={seed})");
    let mut rng = Rng::new(seed);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut broker = TestBroker::start();
    rt.block_on(async {
        let conn = amqp::connect(broker.amqp_addr()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        for q in [AMQP_QUEUE, STOMP_QUEUE, MQTT_QUEUE] {
            amqp::declare_durable(&ch, q).await.unwrap();
        }
        ch.queue_bind(
            MQTT_QUEUE.into(),
            "amq.topic".into(),
            MQTT_KEY.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        conn.close(200, "setup".into()).await.unwrap();
    });

    let started = Instant::now();
    let mut total = Tally::default();
    let mut per_proto_total: HashMap<&str, Tally> = HashMap::new();
    let mut refusals = Vec::new();
    let mut lost_examples = Vec::new();
    for round in 0..rounds {
        let kill_after = Duration::from_millis(rng.range(100, max_kill_ms.max(101)));
        let stop = Arc::new(AtomicBool::new(false));
        let (a, s, m) = (broker.amqp_addr(), broker.stomp_addr(), broker.mqtt_addr());
        let amqp_tasks: Vec<_> = (0..PRODUCERS)
            .map(|k| rt.spawn(amqp_producer(a, format!("r{round}-amqp{k}"), stop.clone())))
            .collect();
        let stomp_threads: Vec<_> = (0..PRODUCERS)
            .map(|k| {
                let (id, stop) = (format!("r{round}-stomp{k}"), stop.clone());
                std::thread::spawn(move || stomp_producer(s, id, stop))
            })
            .collect();
        let mqtt_threads: Vec<_> = (0..PRODUCERS)
            .map(|k| {
                let (id, stop) = (format!("r{round}-mqtt{k}"), stop.clone());
                std::thread::spawn(move || mqtt_producer(m, id, stop))
            })
            .collect();

        // The random moment: publishing is in full flow when the broker dies.
        std::thread::sleep(kill_after);
        broker.kill9();
        stop.store(true, Ordering::Relaxed);
        let amqp_ledgers: Vec<Ledger> = amqp_tasks
            .into_iter()
            .map(|t| rt.block_on(t).unwrap())
            .collect();
        let stomp_ledgers: Vec<Ledger> = stomp_threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        let mqtt_ledgers: Vec<Ledger> = mqtt_threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();

        broker.restart();
        let mut round_tally = Tally::default();
        let mut parts = Vec::new();
        for (proto, queue, ledgers) in [
            ("amqp", AMQP_QUEUE, &amqp_ledgers),
            ("stomp", STOMP_QUEUE, &stomp_ledgers),
            ("mqtt", MQTT_QUEUE, &mqtt_ledgers),
        ] {
            for l in ledgers.iter() {
                refusals.extend(l.refusals.iter().map(|r| format!("{}: {r}", l.id)));
            }
            let seen = rt.block_on(amqp::drain(
                broker.amqp_addr(),
                queue,
                Duration::from_secs(60),
            ));
            let t = check(ledgers, &seen, round, &mut lost_examples);
            parts.push(format!(
                "{proto} acked={}/{} lost={}",
                t.acked, t.sent, t.lost
            ));
            round_tally.add(&t);
            per_proto_total.entry(proto).or_default().add(&t);
        }
        total.add(&round_tally);
        println!(
            "round {}/{rounds} kill_after={}ms: {} | {}",
            round + 1,
            kill_after.as_millis(),
            parts.join(", "),
            round_tally.line()
        );
    }
    for proto in ["amqp", "stomp", "mqtt"] {
        println!("total {proto}: {}", per_proto_total[proto].line());
    }
    println!(
        "crash loop total ({rounds} rounds, seed {seed}, {:.1}s): {}",
        started.elapsed().as_secs_f64(),
        total.line()
    );

    assert!(
        refusals.is_empty(),
        "the broker refused publishes: {refusals:?}"
    );
    assert_eq!(
        total.lost, 0,
        "acknowledged messages lost across kill -9 (seed {seed}), e.g. {lost_examples:?}"
    );
    assert_eq!(
        total.dup_acked, 0,
        "acknowledged messages stored twice (seed {seed})"
    );
    assert_eq!(total.bogus, 0, "messages no producer sent (seed {seed})");
    assert_eq!(
        total.stale, 0,
        "messages drained and acked in an earlier round came back (seed {seed})"
    );
    for proto in ["amqp", "stomp", "mqtt"] {
        assert!(
            per_proto_total[proto].acked > 0,
            "no {proto} publish was acknowledged in any round: the test proved nothing"
        );
    }
}

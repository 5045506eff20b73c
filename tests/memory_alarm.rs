//! The memory alarm for real: a broker whose high-water mark is a few tens of MiB is
//! pushed past it by connections holding large unfinished STOMP frames in their read
//! buffers; a publisher is blocked (its SEND is not read, no receipt) while a consumer
//! could still drain; when those connections go, memory falls, the alarm clears, the
//! blocked SEND goes through and nothing receipted is lost.

mod common;

use std::io::Write;
use std::time::Duration;

use common::raw::{rss_anon_kib, StompClient};
use common::TestBroker;
use triad_core::testing::eventually_blocking;

/// The high-water mark, as an absolute figure turned into the configured fraction of RAM.
const MARK_MIB: u64 = 48;
/// Connections holding an unfinished frame, and how much of it each sends.
const HOLDERS: usize = 16;
const HELD_BYTES: usize = 3_800_000;

fn mem_total_kib() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").expect("meminfo");
    let line = text
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .expect("MemTotal");
    line.split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("MemTotal kB")
}

fn wait_log(broker: &TestBroker, needle: &str, after: usize, timeout: Duration) {
    eventually_blocking(&format!("`{needle}` in the log"), timeout, || {
        let log = broker.log();
        if log.get(after..).is_some_and(|l| l.contains(needle)) {
            return Ok(());
        }
        Err(format!(
            "RssAnon {} KiB, the log:\n{log}",
            rss_anon_kib(broker.pid()).unwrap_or(0)
        ))
    });
}

#[test]
fn publishers_are_blocked_past_the_memory_high_water_mark_and_released_below_it() {
    let fraction = (MARK_MIB * 1024) as f64 / mem_total_kib() as f64;
    let broker = TestBroker::start_with_config(&format!(
        "[store]\nsegment_size = \"32 MiB\"\n\n[limits]\nmax_message_size = \"16 MiB\"\n\
         memory_high_watermark = {fraction:.9}\n"
    ));
    let pid = broker.pid();
    let base = rss_anon_kib(pid).unwrap_or(0);
    assert!(
        base < MARK_MIB * 1024 / 2,
        "a fresh broker already holds {base} KiB of heap; the test needs headroom"
    );
    let t = Duration::from_secs(10);
    let dest = ("destination", "/queue/memory-alarm");

    // a publisher that has published (so it is the kind that gets blocked)
    let mut publisher = StompClient::connect(broker.stomp_addr(), t).expect("publisher");
    publisher
        .send(
            "SEND",
            &[dest, ("receipt", "r0"), ("persistent", "true")],
            b"before",
        )
        .expect("send");
    let f = publisher.read_frame().expect("receipt r0");
    assert_eq!(f.command, "RECEIPT", "{f:?}");

    // push the broker's heap past the mark: unfinished frames it must buffer
    let log_mark = broker.log().len();
    let mut holders = Vec::new();
    let content_length = (HELD_BYTES + 100_000).to_string();
    let chunk = vec![b'x'; HELD_BYTES];
    for _ in 0..HOLDERS {
        let mut h = StompClient::connect(broker.stomp_addr(), t).expect("holder");
        let head = format!(
            "SEND\ndestination:/queue/memory-alarm-held\ncontent-length:{content_length}\n\n"
        );
        h.stream.write_all(head.as_bytes()).expect("head");
        h.stream.write_all(&chunk).expect("held body");
        holders.push(h);
    }
    wait_log(
        &broker,
        "resource alarm raised",
        log_mark,
        Duration::from_secs(10),
    );
    let high = rss_anon_kib(pid).unwrap_or(0);
    assert!(high > MARK_MIB * 1024, "alarm raised at {high} KiB of heap");
    // health probes see it
    let (code, body) = common::http_get(broker.http_addr(), "/health");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("low on memory"), "{body}");
    let (code, _) = common::http_get(broker.http_addr(), "/api/health/checks/alarms");
    assert_eq!(code, 401, "the API's checks need credentials");

    // the publisher is not read from: its SEND gets no receipt
    publisher
        .send(
            "SEND",
            &[dest, ("receipt", "r1"), ("persistent", "true")],
            b"during",
        )
        .expect("send");
    publisher
        .stream
        .set_read_timeout(Some(Duration::from_millis(1500)))
        .expect("timeout");
    let early = publisher.read_frame();
    assert!(
        early.is_err(),
        "a receipt while the memory alarm is raised: {early:?}"
    );

    // memory falls once the unfinished frames go; the alarm clears, the SEND goes through
    let log_mark = broker.log().len();
    drop(holders);
    wait_log(
        &broker,
        "resource alarms cleared",
        log_mark,
        Duration::from_secs(10),
    );
    let low = rss_anon_kib(pid).unwrap_or(0);
    assert_eq!(common::http_get(broker.http_addr(), "/health").0, 200);
    publisher
        .stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let f = publisher.read_frame().expect("receipt r1 after the alarm");
    assert_eq!(
        (f.command.as_str(), f.header("receipt-id")),
        ("RECEIPT", Some("r1"))
    );
    println!("memory alarm: heap {base} KiB at start, {high} KiB with {HOLDERS} held frames, {low} KiB after; mark {} KiB", MARK_MIB * 1024);

    // both messages are there, in order
    let mut consumer = StompClient::connect(broker.stomp_addr(), t).expect("consumer");
    consumer
        .send("SUBSCRIBE", &[("id", "0"), dest, ("ack", "auto")], b"")
        .expect("subscribe");
    let mut bodies = Vec::new();
    for _ in 0..2 {
        let f = consumer.read_frame().expect("message");
        assert_eq!(f.command, "MESSAGE", "{f:?}");
        bodies.push(f.body.clone());
    }
    assert_eq!(bodies, vec![b"before".to_vec(), b"during".to_vec()]);
}

//! The broker as a process: readiness, the health endpoint, signals, the data-dir lock,
//! configuration errors, and restart after `kill -9`.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{
    ephemeral_listen_args, http_get, http_request, run_to_exit, triad_command, TestBroker,
};

#[test]
fn health_endpoint_answers_200_json() {
    let broker = TestBroker::start();
    let resp = http_request(
        broker.http_addr(),
        "GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    );
    assert!(resp.starts_with("HTTP/1.1 200 OK\r\n"), "{resp}");
    assert!(
        resp.to_ascii_lowercase()
            .contains("content-type: application/json\r\n"),
        "{resp}"
    );
    assert!(resp.ends_with("\r\n\r\n{\"status\":\"ok\"}"), "{resp}");

    assert_eq!(http_get(broker.http_addr(), "/nope").0, 404);
    let post = http_request(
        broker.http_addr(),
        "POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    );
    assert!(post.starts_with("HTTP/1.1 405 "), "{post}");
    let bad = http_request(broker.http_addr(), "hello there\r\n\r\n");
    assert!(bad.starts_with("HTTP/1.1 400 "), "{bad}");
}

#[test]
fn listeners_bind_distinct_ephemeral_ports() {
    let broker = TestBroker::start();
    let mut ports: Vec<u16> = ["amqp", "stomp", "mqtt", "http"]
        .iter()
        .map(|p| broker.addr(p).port())
        .collect();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(ports.len(), 4);
    assert!(ports.iter().all(|&p| p != 0));
}

#[test]
fn every_listener_speaks_its_protocol() {
    let broker = TestBroker::start();
    let talk = |addr, send: &[u8], want: usize| -> Vec<u8> {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(send).expect("write");
        let mut buf = vec![0u8; want];
        s.read_exact(&mut buf).expect("reply");
        buf
    };
    // AMQP: a wrong protocol header is answered with the one the server speaks
    assert_eq!(
        talk(broker.amqp_addr(), b"AMQP\x00\x00\x08\x00", 8),
        b"AMQP\x00\x00\x09\x01"
    );
    // STOMP: CONNECT gets CONNECTED
    let reply = talk(
        broker.stomp_addr(),
        b"CONNECT\naccept-version:1.2\nhost:localhost\n\n\x00",
        10,
    );
    assert_eq!(&reply, b"CONNECTED\n");
    // MQTT: CONNECT (3.1.1, clean session, client id "t") gets CONNACK accepted
    let connect = [
        0x10, 13, 0, 4, b'M', b'Q', b'T', b'T', 4, 2, 0, 60, 0, 1, b't',
    ];
    assert_eq!(talk(broker.mqtt_addr(), &connect, 4), [0x20, 2, 0, 0]);
}

#[test]
fn sigterm_exits_zero_and_removes_the_abort_marker() {
    let mut broker = TestBroker::start();
    let abort = broker.data_dir().join("abort");
    assert!(abort.exists(), "abort marker present while running");
    let status = broker.terminate();
    assert!(status.success(), "exit status {status}");
    assert!(!abort.exists(), "abort marker removed on clean shutdown");
    let log = broker.log();
    assert!(log.contains("shutdown requested signal=SIGTERM"), "{log}");
    assert!(log.contains("stopped cleanly"), "{log}");
}

#[test]
fn second_broker_on_the_same_data_dir_is_refused() {
    let broker = TestBroker::start();
    let out = run_to_exit(broker.command(), Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "second broker must fail: {stderr}");
    assert!(stderr.contains("triad: error: "), "{stderr}");
    assert!(
        stderr.contains("lock"),
        "message mentions the lock: {stderr}"
    );
    // The first broker is unaffected.
    assert_eq!(http_get(broker.http_addr(), "/health").0, 200);
}

#[test]
fn bad_config_files_are_rejected_clearly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cases = [
        (
            "[store]\nsegment_sise = \"1 GiB\"\n",
            "unknown field `segment_sise`",
        ),
        (
            "[limits]\nframe_max = \"12 parsecs\"\n",
            "unknown unit \"parsecs\"",
        ),
        ("[limits]\nframe_max = 100\n", "`limits.frame_max`"),
        ("not toml at all", "invalid config file"),
    ];
    for (i, (text, expected)) in cases.into_iter().enumerate() {
        let path = dir.path().join(format!("bad{i}.toml"));
        std::fs::write(&path, text).expect("write config");
        let mut cmd = triad_command();
        cmd.arg("--config")
            .arg(&path)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(ephemeral_listen_args());
        let out = run_to_exit(cmd, Duration::from_secs(30));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text:?}: {stderr}");
        assert!(stderr.contains("triad: error: "), "{stderr}");
        assert!(stderr.contains(expected), "{text:?}: {stderr}");
        assert!(
            !dir.path().join("data").exists(),
            "no store is opened with a bad config"
        );
    }
}

#[test]
fn restart_after_kill_9_on_the_same_data_dir() {
    let mut broker = TestBroker::start();
    broker.kill9();
    assert!(
        broker.data_dir().join("abort").exists(),
        "kill -9 leaves the abort marker"
    );
    broker.restart();
    assert_eq!(http_get(broker.http_addr(), "/health").0, 200);
    let status = broker.terminate();
    assert!(status.success(), "exit status {status}");
    assert!(!broker.data_dir().join("abort").exists());
}

/// Issue 14 item 15: "stopped cleanly" is logged only when the store was closed (its
/// `abort` marker removed); a stop with connections of every protocol still holding
/// state (subscriptions, unacked deliveries, a persistent MQTT session, a consumer that
/// does not read) says what happened.
#[test]
fn shutdown_log_says_whether_the_store_was_closed() {
    use common::raw::{MqttClient, StompClient};
    let t = Duration::from_secs(10);
    let mut broker = TestBroker::start();
    let abort = broker.data_dir().join("abort");
    let mut stomp = StompClient::connect(broker.stomp_addr(), t).expect("stomp");
    for i in 0..2000 {
        let body = vec![b'x'; 4096];
        stomp
            .send(
                "SEND",
                &[("destination", "/queue/held"), ("persistent", "true")],
                &body,
            )
            .expect("send");
        if i == 1999 {
            stomp
                .send(
                    "SEND",
                    &[("destination", "/queue/held"), ("receipt", "r")],
                    b"",
                )
                .expect("send");
        }
    }
    let f = stomp.read_frame().expect("receipt");
    assert_eq!(f.command, "RECEIPT", "{f:?}");
    // a subscriber that never reads: the broker's writes to it stall
    let mut stuck = StompClient::connect(broker.stomp_addr(), t).expect("stomp");
    stuck
        .send(
            "SUBSCRIBE",
            &[
                ("destination", "/queue/held"),
                ("id", "0"),
                ("ack", "client"),
            ],
            b"",
        )
        .expect("subscribe");
    let mut mqtt = MqttClient::connect(broker.mqtt_addr(), "keeper", false, t).expect("mqtt");
    assert_eq!(mqtt.subscribe(1, "a/#", 1).expect("suback"), 1);
    let status = broker.terminate();
    let log = broker.log();
    let clean = log.contains("stopped cleanly");
    assert_eq!(
        clean,
        !abort.exists(),
        "the log says stopped cleanly = {clean} but the abort marker exists = {}:\n{log}",
        abort.exists()
    );
    assert_eq!(status.success(), clean, "exit status {status}:\n{log}");
    drop((stomp, stuck, mqtt));
}

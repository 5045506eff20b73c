//! `triadctl` against a running broker: listings as tables and JSON, users and
//! permissions, policies, purge, message queries, and its exit codes.

mod common;

use std::net::SocketAddr;
use std::process::{Command, Output};

use serde_json::Value;

use common::{TestBroker, TEST_CONFIG};

fn ctl(http: SocketAddr, user: (&str, &str), args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_triadctl"))
        .args([
            "--host",
            &http.ip().to_string(),
            "--port",
            &http.port().to_string(),
        ])
        .args(["--user", user.0, "--password", user.1])
        .args(args)
        .output()
        .expect("run triadctl")
}

const GUEST: (&str, &str) = ("guest", "guest");

/// A management API call as guest; the status code.
fn api(http: SocketAddr, method: &str, path: &str, body: &Value) -> u16 {
    let body = body.to_string();
    let resp = common::http_request(
        http,
        &format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    );
    resp.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

fn ok(http: SocketAddr, args: &[&str]) -> String {
    let out = ctl(http, GUEST, args);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "triadctl {args:?}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn json(http: SocketAddr, args: &[&str]) -> Value {
    let mut a = vec!["--format", "json"];
    a.extend_from_slice(args);
    serde_json::from_str(&ok(http, &a)).expect("JSON output")
}

#[test]
fn administers_a_broker_through_the_api() {
    let broker = TestBroker::start_with_config(&format!(
        "{TEST_CONFIG}\n[auth]\nfailed_login_delay = \"10ms\"\n"
    ));
    let http = broker.http_addr();
    // a queue with messages, made through the API by triadctl's own calls
    ok(http, &["add_vhost", "ops"]);
    ok(http, &["add_user", "ops", "s3cret", "management"]);
    ok(
        http,
        &["--vhost", "ops", "set_permissions", "ops", ".*", ".*", ".*"],
    );
    let users = json(http, &["list_users"]);
    assert!(users.as_array().is_some_and(|u| u
        .iter()
        .any(|u| u["name"] == "ops" && u["tags"] == serde_json::json!(["management"]))));
    // the new user works: it lists its vhost's (empty) queues
    let out = ctl(http, ("ops", "s3cret"), &["--vhost", "ops", "list_queues"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("name"));

    let publish = |key: &str, id: &str| {
        let body = serde_json::json!({"routing_key": key, "payload": "hello", "payload_encoding": "string",
            "properties": {"message_id": id, "delivery_mode": 2}});
        assert_eq!(
            api(
                http,
                "POST",
                "/api/exchanges/%2F/amq.default/publish",
                &body
            ),
            200
        );
    };
    assert_eq!(
        api(
            http,
            "PUT",
            "/api/queues/%2F/work",
            &serde_json::json!({"durable": true})
        ),
        201
    );
    publish("work", "m-1");
    publish("work", "m-2");
    let table = ok(http, &["list_queues"]);
    let row = table
        .lines()
        .find(|l| l.starts_with("work "))
        .expect("work row");
    assert_eq!(row.split_whitespace().nth(1), Some("2"), "{table}");

    let found = json(http, &["query_msg", "--id", "m-2"]);
    assert_eq!(found[0]["properties"]["message_id"], "m-2");
    let by_off = json(
        http,
        &[
            "query_msg",
            "--queue",
            "work",
            "--offset",
            "0",
            "--count",
            "5",
        ],
    );
    assert_eq!(by_off.as_array().map(Vec::len), Some(2));

    ok(
        http,
        &[
            "set_policy",
            "cap",
            "^work$",
            "{\"max-length\": 1}",
            "1",
            "queues",
        ],
    );
    assert_eq!(json(http, &["list_queues"])[0]["messages"], 1);
    let out = ctl(
        http,
        GUEST,
        &["set_policy", "bad", ".*", "{\"ha-mode\": \"all\"}"],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ha-mode") && err.lines().count() == 1, "{err}");

    ok(http, &["purge_queue", "work"]);
    assert_eq!(json(http, &["list_queues"])[0]["messages"], 0);
    ok(http, &["delete_queue", "work"]);
    assert_eq!(json(http, &["list_queues"]), serde_json::json!([]));

    // exit codes: refused 1, usage 2, unreachable 3
    assert_eq!(
        ctl(http, ("guest", "wrong"), &["status"]).status.code(),
        Some(1)
    );
    assert_eq!(
        ctl(http, GUEST, &["no_such_command"]).status.code(),
        Some(2)
    );
    assert_eq!(ctl(http, GUEST, &["purge_queue"]).status.code(), Some(2));
    let closed: SocketAddr = "127.0.0.1:1".parse().expect("addr");
    assert_eq!(ctl(closed, GUEST, &["status"]).status.code(), Some(3));
    assert!(ok(http, &["status"]).contains("triad@"));
}

#[test]
fn query_msg_finds_mqtt_publishes_by_topic_and_time() {
    use common::raw::MqttClient;
    use serde_json::json;
    let broker =
        TestBroker::start_with_config(&format!("{TEST_CONFIG}\n[mqtt]\nindex_topics = true\n"));
    let http = broker.http_addr();
    assert_eq!(api(http, "PUT", "/api/queues/%2F/meters", &json!({})), 201);
    assert_eq!(
        api(
            http,
            "POST",
            "/api/bindings/%2F/e/amq.topic/q/meters",
            &json!({"routing_key": "m.#"})
        ),
        201
    );
    let t = std::time::Duration::from_secs(10);
    let mut c = MqttClient::connect(broker.mqtt_addr(), "meter", true, t).expect("mqtt");
    for (i, topic) in ["m/1", "m/2", "m/1"].iter().enumerate() {
        let pkid = i as u16 + 1;
        c.publish(topic, 1, pkid, format!("r{i}").as_bytes())
            .expect("publish");
        assert_eq!(c.read_until(4).expect("PUBACK").0.pkid(), Some(pkid));
        // the next publish is stored in a later millisecond
        let stored = now_ms();
        let deadline = std::time::Instant::now() + t;
        while now_ms() <= stored && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
    }
    let found = json(http, &["--vhost", "/", "query_msg", "--topic", "m/1"]);
    let payloads: Vec<&str> = found
        .as_array()
        .map(|a| a.iter().filter_map(|m| m["payload"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(payloads, ["r2", "r0"]);
    let t0 = found[1]["store_time"].as_u64().expect("store_time");
    let first = json(
        http,
        &["query_msg", "--topic", "m/1", "--to", &t0.to_string()],
    );
    assert_eq!(first.as_array().map(Vec::len), Some(1), "{first}");
    assert_eq!(first[0]["payload"], "r0");
    let table = ok(
        http,
        &["query_msg", "--topic", "m/2", "--from", &t0.to_string()],
    );
    assert!(table.contains("r1") && table.contains("m.2"), "{table}");
    // a filter is refused by the broker: exit code 1
    let out = ctl(http, GUEST, &["query_msg", "--topic", "m/+"]);
    assert_eq!(out.status.code(), Some(1));
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
}

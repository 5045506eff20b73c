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

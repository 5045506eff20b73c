//! `/api/user-limits` (issue 16 leftover), as RabbitMQ's: set, list and clear a user's
//! `max-connections` / `max-channels` through the management API; the limit applies to
//! new connections at once and survives a restart (metadata journal).

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use base64::Engine;
use common::raw::StompClient;
use common::TestBroker;
use serde_json::{json, Value};

fn call(addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let cred = base64::engine::general_purpose::STANDARD.encode("guest:guest");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nAuthorization: Basic {cred}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).unwrap().parse().unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return (status, body.to_string());
    }
    let (mut rest, mut whole) = (body, String::new());
    loop {
        let (size, tail) = rest.split_once("\r\n").unwrap();
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            return (status, whole);
        }
        whole.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
}

/// A STOMP login as `lim`: CONNECTED (`true`) or ERROR (`false`).
fn stomp_login(addr: SocketAddr) -> (bool, StompClient) {
    let mut c = StompClient::from_stream(
        TcpStream::connect(addr).unwrap(),
        Some(Duration::from_secs(10)),
    );
    c.send(
        "CONNECT",
        &[
            ("accept-version", "1.2"),
            ("host", "/"),
            ("login", "lim"),
            ("passcode", "pw"),
        ],
        b"",
    )
    .unwrap();
    let f = c.read_frame().unwrap();
    (f.command == "CONNECTED", c)
}

fn limits(addr: SocketAddr) -> Value {
    let (st, body) = call(addr, "GET", "/api/user-limits", None);
    assert_eq!(st, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

#[test]
fn user_limits_through_the_api_apply_and_survive_a_restart() {
    let cfg = format!(
        "{}\n[auth]\nfailed_login_delay = \"10ms\"\n",
        common::TEST_CONFIG
    );
    let mut b = TestBroker::start_with_config(&cfg);
    let http = b.http_addr();
    assert_eq!(
        call(
            http,
            "PUT",
            "/api/users/lim",
            Some(json!({"password": "pw", "tags": ""}))
        )
        .0,
        201
    );
    assert_eq!(
        call(
            http,
            "PUT",
            "/api/permissions/%2F/lim",
            Some(json!({"configure": ".*", "write": ".*", "read": ".*"}))
        )
        .0,
        201
    );
    assert_eq!(limits(http), json!([]));
    assert_eq!(
        call(
            http,
            "PUT",
            "/api/user-limits/lim/max-connections",
            Some(json!({"value": 1}))
        )
        .0,
        204
    );
    assert_eq!(
        limits(http),
        json!([{"user": "lim", "value": {"max-connections": 1}}])
    );
    let (st, body) = call(http, "GET", "/api/user-limits/lim", None);
    assert_eq!(
        (st, serde_json::from_str::<Value>(&body).unwrap()),
        (
            200,
            json!([{"user": "lim", "value": {"max-connections": 1}}])
        )
    );
    // refused: unknown limit name, unknown user, no value
    assert_eq!(
        call(
            http,
            "PUT",
            "/api/user-limits/lim/max-queues",
            Some(json!({"value": 1}))
        )
        .0,
        400
    );
    assert_eq!(
        call(
            http,
            "PUT",
            "/api/user-limits/nobody/max-channels",
            Some(json!({"value": 1}))
        )
        .0,
        400
    );
    assert_eq!(
        call(
            http,
            "PUT",
            "/api/user-limits/lim/max-channels",
            Some(json!({}))
        )
        .0,
        400
    );

    // definitions carry them in each user entry, as RabbitMQ's do, both ways
    let (st, body) = call(http, "GET", "/api/definitions", None);
    assert_eq!(st, 200);
    let defs: Value = serde_json::from_str(&body).unwrap();
    let lim = defs["users"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == "lim")
        .unwrap();
    assert_eq!(lim["limits"], json!({"max-connections": 1}));
    let (_, body) = call(http, "GET", "/api/users/lim", None);
    let u: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(u["limits"], json!({"max-connections": 1}));
    let imported = json!({"users": [{"name": "imp", "password": "x", "tags": "", "limits": {"max-channels": 2}}]});
    assert_eq!(
        call(http, "POST", "/api/definitions", Some(imported)).0,
        204
    );
    let (_, body) = call(http, "GET", "/api/user-limits/imp", None);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!([{"user": "imp", "value": {"max-channels": 2}}])
    );
    let bad = json!({"users": [{"name": "imp2", "password": "x", "tags": "", "limits": {"max-queues": 2}}]});
    assert_eq!(call(http, "POST", "/api/definitions", Some(bad)).0, 400);
    assert_eq!(
        call(http, "DELETE", "/api/user-limits/imp/max-channels", None).0,
        204
    );

    let stomp = b.stomp_addr();
    let (ok, _first) = stomp_login(stomp);
    assert!(ok);
    assert!(!stomp_login(stomp).0, "past max-connections");
    drop(_first);

    b.restart();
    let http = b.http_addr();
    let stomp = b.stomp_addr();
    assert_eq!(
        limits(http),
        json!([{"user": "lim", "value": {"max-connections": 1}}])
    );
    let (ok, first) = stomp_login(stomp);
    assert!(ok);
    assert!(!stomp_login(stomp).0, "the limit survived the restart");
    drop(first);

    assert_eq!(
        call(http, "DELETE", "/api/user-limits/lim/max-connections", None).0,
        204
    );
    assert_eq!(limits(http), json!([]));
    let (a, _a) = stomp_login(stomp);
    let (c, _c) = stomp_login(stomp);
    assert!(a && c, "no limit once cleared");

    // a user's limits go with the user: one made later under the name starts without
    assert_eq!(
        call(
            http,
            "PUT",
            "/api/user-limits/lim/max-channels",
            Some(json!({"value": 3}))
        )
        .0,
        204
    );
    assert_eq!(call(http, "DELETE", "/api/users/lim", None).0, 204);
    assert_eq!(limits(http), json!([]));
    let again = json!({"password": "x", "tags": ""});
    assert_eq!(call(http, "PUT", "/api/users/lim", Some(again)).0, 201);
    let (st, body) = call(http, "GET", "/api/user-limits/lim", None);
    assert_eq!((st, body.as_str()), (200, "[]"));
    b.restart();
    assert_eq!(
        limits(b.http_addr()),
        json!([]),
        "and stay gone after a restart"
    );
}

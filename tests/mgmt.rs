//! The management HTTP API against a running broker: auth and tags, queues and
//! bindings, publish / get / purge, connections listed and closed, runtime users,
//! vhosts and permissions surviving a restart, definitions round trip.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};

use common::{TestBroker, TEST_CONFIG};
use triad_core::testing::eventually_blocking;

/// A test config with a short failed-login delay (refusals are answered after it).
fn config() -> String {
    format!("{TEST_CONFIG}\n[auth]\nfailed_login_delay = \"10ms\"\n")
}

/// One request with basic auth (`user = None`: without); (status, headers, body).
fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    user: Option<(&str, &str)>,
    body: Option<&Value>,
) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some((u, p)) = user {
        let cred = base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"));
        req.push_str(&format!("Authorization: Basic {cred}\r\n"));
    }
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).expect("send");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read");
    let text = String::from_utf8(out).expect("utf8");
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let head = head.to_ascii_lowercase();
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_owned()
    };
    (status, head, body)
}

/// The body of a chunked response.
fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, tail) = rest.split_once("\r\n").expect("chunk size line");
        let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if n == 0 {
            return out;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
}

const GUEST: Option<(&str, &str)> = Some(("guest", "guest"));

fn get(addr: SocketAddr, path: &str, user: Option<(&str, &str)>) -> (u16, Value) {
    let (status, _, body) = call(addr, "GET", path, user, None);
    let v = serde_json::from_str(&body).unwrap_or(Value::Null);
    (status, v)
}

fn status(addr: SocketAddr, method: &str, path: &str, body: Value) -> u16 {
    call(addr, method, path, GUEST, Some(&body)).0
}

/// How long the waits below poll.
const WAIT: Duration = Duration::from_secs(10);

/// Polls `f` until it holds or [`WAIT`] passes; on failure prints `state`.
fn eventually_with(what: &str, state: impl Fn() -> String, mut f: impl FnMut() -> bool) {
    eventually_blocking(what, WAIT, || if f() { Ok(()) } else { Err(state()) });
}

/// Polls `f` until it holds or [`WAIT`] passes.
fn eventually(what: &str, f: impl FnMut() -> bool) {
    eventually_blocking(what, WAIT, f);
}

#[test]
fn auth_answers_401_as_rabbitmq_and_tags_limit_what_a_user_sees() {
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    let (code, head, _) = call(http, "GET", "/api/overview", None, None);
    assert_eq!(code, 401);
    assert!(head.contains("www-authenticate: basic realm="), "{head}");
    let (code, _, body) = call(http, "GET", "/api/overview", Some(("guest", "nope")), None);
    assert_eq!((code, body.contains("Login failed")), (401, true), "{body}");
    assert_eq!(
        get(http, "/api/whoami", GUEST),
        (200, json!({"name": "guest", "tags": ["administrator"]}))
    );

    // a user without a management tag, one with `management` and rights in one vhost
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/users/plain",
            json!({"password": "pw", "tags": ""})
        ),
        201
    );
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/users/mgr",
            json!({"password": "pw", "tags": "management"})
        ),
        201
    );
    assert_eq!(status(http, "PUT", "/api/vhosts/v2", json!({})), 201);
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/permissions/v2/mgr",
            json!({"configure": "^a", "write": ".*", "read": ".*"})
        ),
        201
    );
    assert_eq!(
        status(http, "PUT", "/api/queues/%2F/hidden", json!({})),
        201
    );
    let (code, _, body) = call(http, "GET", "/api/overview", Some(("plain", "pw")), None);
    assert_eq!(code, 401);
    assert!(body.contains("Not management user"), "{body}");
    let mgr = Some(("mgr", "pw"));
    let (code, v) = get(http, "/api/vhosts", mgr);
    assert_eq!(code, 200);
    let names: Vec<&str> = v
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|x| x["name"].as_str())
        .collect();
    assert_eq!(names, ["v2"], "a management user sees only its vhosts");
    assert_eq!(get(http, "/api/queues", mgr), (200, json!([])));
    assert_eq!(get(http, "/api/queues/%2F", mgr).0, 401);
    assert_eq!(
        get(http, "/api/users", mgr).0,
        401,
        "users are for administrators"
    );
    // declares need the configure permission, as over AMQP
    let put = |path: &str| call(http, "PUT", path, mgr, Some(&json!({}))).0;
    assert_eq!(put("/api/queues/v2/a1"), 201);
    assert_eq!(put("/api/queues/v2/b1"), 401);
    assert_eq!(put("/api/queues/%2F/a1"), 401, "no rights in /");
    assert_eq!(get(http, "/api/queues/nope", GUEST).0, 404);
}

#[test]
fn queues_bindings_publish_get_and_purge() {
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    let q = json!({"durable": "true", "arguments": {"x-max-length": 10}});
    assert_eq!(status(http, "PUT", "/api/queues/%2F/q1", q.clone()), 201);
    assert_eq!(status(http, "PUT", "/api/queues/%2F/q1", q), 204);
    let (code, _, body) = call(
        http,
        "PUT",
        "/api/queues/%2F/q1",
        GUEST,
        Some(&json!({"durable": true})),
    );
    assert_eq!(code, 400, "inequivalent redeclare");
    assert!(body.contains("x-max-length"), "{body}");
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/exchanges/%2F/ex",
            json!({"type": "topic"})
        ),
        201
    );
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/exchanges/%2F/ex2",
            json!({"type": "nonsense"})
        ),
        400
    );
    let (code, head, _) = call(
        http,
        "POST",
        "/api/bindings/%2F/e/ex/q/q1",
        GUEST,
        Some(&json!({"routing_key": "a.#"})),
    );
    assert_eq!(code, 201);
    assert!(
        head.contains("location: /api/bindings/%2f/e/ex/q/q1/a%2e%23"),
        "{head}"
    );
    let (_, b) = get(http, "/api/bindings/%2F/e/ex/q/q1", GUEST);
    assert_eq!(b[0]["properties_key"], "a.#");

    for i in 0..3 {
        let body = json!({"routing_key": "a.b", "payload": format!("m{i}"), "payload_encoding": "string",
                          "properties": {"delivery_mode": 2, "headers": {"n": i}}});
        let (code, _, r) = call(
            http,
            "POST",
            "/api/exchanges/%2F/ex/publish",
            GUEST,
            Some(&body),
        );
        assert_eq!((code, r.as_str()), (200, r#"{"routed":true}"#));
    }
    let (_, r) = {
        let body = json!({"routing_key": "x.y", "payload": "lost", "payload_encoding": "string", "properties": {}});
        let (c, _, r) = call(
            http,
            "POST",
            "/api/exchanges/%2F/ex/publish",
            GUEST,
            Some(&body),
        );
        (c, r)
    };
    assert_eq!(r, r#"{"routed":false}"#);
    let (_, queue) = get(http, "/api/queues/%2F/q1", GUEST);
    assert_eq!(
        (queue["messages"].as_u64(), queue["messages_ready"].as_u64()),
        (Some(3), Some(3))
    );
    assert_eq!(queue["arguments"], json!({"x-max-length": 10}));
    assert_eq!(queue["message_stats"]["publish"], 3);
    assert!(queue["message_stats"]["publish_details"]["rate"].is_number());
    assert_eq!(queue["message_stats"]["ack"], 0);

    // get with requeue leaves them; without removes one
    let got = |mode: &str, count: u32| {
        let (c, _, r) = call(
            http,
            "POST",
            "/api/queues/%2F/q1/get",
            GUEST,
            Some(&json!({"count": count.to_string(), "ackmode": mode, "encoding": "auto"})),
        );
        assert_eq!(c, 200, "{r}");
        serde_json::from_str::<Value>(&r).expect("json")
    };
    let two = got("ack_requeue_true", 2);
    assert_eq!(two[0]["payload"], "m0");
    assert_eq!(two[0]["properties"]["headers"], json!({"n": 0}));
    assert_eq!(two.as_array().map(Vec::len), Some(2));
    let one = got("ack_requeue_false", 1);
    assert_eq!(one[0]["payload"], "m0");
    assert_eq!(one[0]["redelivered"], true);
    eventually("2 messages left", || {
        get(http, "/api/queues/%2F/q1", GUEST).1["messages"] == 2
    });

    assert_eq!(
        call(http, "DELETE", "/api/queues/%2F/q1/contents", GUEST, None).0,
        204
    );
    eventually("purged", || {
        get(http, "/api/queues/%2F/q1", GUEST).1["messages"] == 0
    });
    assert_eq!(
        call(
            http,
            "DELETE",
            "/api/bindings/%2F/e/ex/q/q1/a.%23",
            GUEST,
            None
        )
        .0,
        204
    );
    assert_eq!(get(http, "/api/bindings/%2F/e/ex/q/q1", GUEST).1, json!([]));
    assert_eq!(
        call(http, "DELETE", "/api/exchanges/%2F/ex", GUEST, None).0,
        204
    );
    assert_eq!(
        call(http, "DELETE", "/api/queues/%2F/q1", GUEST, None).0,
        204
    );
    assert_eq!(get(http, "/api/queues/%2F/q1", GUEST).0, 404);
    // a policy key Triad does not implement is refused naming it, not ignored
    let (code, _, body) = call(
        http,
        "PUT",
        "/api/policies/%2F/p",
        GUEST,
        Some(&json!({"pattern": ".*", "definition": {"max-length": 1, "queue-mode": "lazy"}})),
    );
    assert_eq!(code, 400);
    assert!(body.contains("'queue-mode'"), "{body}");
    assert_eq!(get(http, "/api/policies/%2F/p", GUEST).0, 404);
}

#[test]
fn paginates_like_rabbitmq() {
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    for i in 0..12 {
        assert_eq!(
            status(http, "PUT", &format!("/api/queues/%2F/p{i:02}"), json!({})),
            201
        );
    }
    let (code, v) = get(
        http,
        "/api/queues/%2F?page=2&page_size=5&columns=name",
        GUEST,
    );
    assert_eq!(code, 200);
    assert_eq!(v["total_count"], 12);
    assert_eq!(v["page_count"], 3);
    assert_eq!(
        v["items"],
        json!([{"name": "p05"}, {"name": "p06"}, {"name": "p07"}, {"name": "p08"}, {"name": "p09"}])
    );
    assert_eq!(get(http, "/api/queues?page=9&page_size=5", GUEST).0, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_listed_with_their_login_and_closed_on_request() {
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    let conn = common::amqp::connect(broker.amqp_addr())
        .await
        .expect("amqp");
    let list = move || {
        let (c, v) = get(http, "/api/connections", GUEST);
        assert_eq!(c, 200);
        v.as_array().cloned().unwrap_or_default()
    };
    let mut listed = Vec::new();
    eventually("the AMQP connection listed with its vhost", || {
        listed = list();
        listed.len() == 1 && listed[0]["vhost"] == "/"
    });
    let c = &listed[0];
    assert_eq!(c["protocol"], "AMQP 0-9-1");
    assert_eq!(c["user"], "guest");
    assert_eq!(c["peer_host"], "127.0.0.1");
    assert_eq!(c["ssl"], false);
    let name = c["name"].as_str().expect("name").to_owned();

    // its consumer is listed with the connection's name
    let ch = conn.create_channel().await.expect("channel");
    common::amqp::declare_durable(&ch, "watched")
        .await
        .expect("declare");
    let _consumer = ch
        .basic_consume(
            "watched".into(),
            "tag-1".into(),
            lapin::options::BasicConsumeOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("consume");
    let (code, consumers) = get(http, "/api/consumers", GUEST);
    assert_eq!(code, 200);
    assert_eq!(consumers[0]["consumer_tag"], "tag-1");
    assert_eq!(
        consumers[0]["queue"],
        json!({"name": "watched", "vhost": "/"})
    );
    assert_eq!(
        consumers[0]["channel_details"]["connection_name"],
        json!(name)
    );
    assert_eq!(
        get(http, "/api/queues/%2F/watched", GUEST).1["consumers"],
        1
    );

    let path = format!(
        "/api/connections/{}",
        percent_encoding::utf8_percent_encode(&name, percent_encoding::NON_ALPHANUMERIC)
    );
    assert_eq!(get(http, &path, GUEST).0, 200);
    assert_eq!(call(http, "DELETE", &path, GUEST, None).0, 204);
    eventually("the client sees the close", || !conn.status().connected());
    eventually("the connection unlisted", || list().is_empty());
    assert_eq!(call(http, "DELETE", &path, GUEST, None).0, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_are_listed_as_rabbitmq_lists_them() {
    use lapin::options::{BasicConsumeOptions, BasicPublishOptions, BasicQosOptions};
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    let conn = common::amqp::connect(broker.amqp_addr())
        .await
        .expect("amqp");
    let one = conn.create_channel().await.expect("channel");
    one.basic_qos(5, BasicQosOptions::default())
        .await
        .expect("qos");
    one.confirm_select(Default::default())
        .await
        .expect("confirm");
    common::amqp::declare_durable(&one, "chq")
        .await
        .expect("declare");
    one.basic_publish(
        "".into(),
        "chq".into(),
        BasicPublishOptions::default(),
        b"m",
        Default::default(),
    )
    .await
    .expect("publish")
    .await
    .expect("confirm");
    let _consumer = one
        .basic_consume(
            "chq".into(),
            "c1".into(),
            BasicConsumeOptions::default(),
            Default::default(),
        )
        .await
        .expect("consume");
    let two = conn.create_channel().await.expect("channel");
    two.tx_select().await.expect("tx");
    // a STOMP connection is listed as one channel
    let mut stomp = TcpStream::connect(broker.stomp_addr()).expect("stomp");
    stomp
        .write_all(b"CONNECT\naccept-version:1.2\nhost:/\n\n\0")
        .expect("send");
    let mut buf = [0u8; 512];
    stomp
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let n = stomp.read(&mut buf).expect("CONNECTED");
    assert!(buf[..n].starts_with(b"CONNECTED"));

    let mut listed = Vec::new();
    eventually(
        "two AMQP channels and the STOMP one, the delivery unacked",
        || {
            let (c, v) = get(http, "/api/channels", GUEST);
            assert_eq!(c, 200);
            listed = v.as_array().cloned().unwrap_or_default();
            listed.len() == 3
                && listed
                    .iter()
                    .any(|c| c["messages_unacknowledged"] == 1 && c["consumer_count"] == 1)
        },
    );
    let amqp: Vec<&Value> = listed
        .iter()
        .filter(|c| c.get("confirm").is_some())
        .collect();
    assert_eq!(amqp.len(), 2, "{listed:?}");
    let (first, second) = (amqp[0], amqp[1]);
    let conn_name = first["connection_details"]["name"].as_str().expect("name");
    assert_eq!(first["name"], json!(format!("{conn_name} (1)")));
    assert_eq!(first["number"], 1);
    assert_eq!(first["user"], "guest");
    assert_eq!(first["vhost"], "/");
    assert_eq!(first["confirm"], true);
    assert_eq!(first["transactional"], false);
    assert_eq!(first["prefetch_count"], 5);
    assert_eq!(first["consumer_count"], 1);
    assert_eq!(second["number"], 2);
    assert_eq!(second["transactional"], true);
    assert_eq!(second["consumer_count"], 0);
    let stomp_ch = listed
        .iter()
        .find(|c| c.get("confirm").is_none())
        .expect("the STOMP channel");
    assert_eq!(stomp_ch["number"], 1);
    assert_eq!(stomp_ch["user"], "guest");

    let enc = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    let (c, of_conn) = get(
        http,
        &format!("/api/connections/{}/channels", enc(conn_name)),
        GUEST,
    );
    assert_eq!(c, 200);
    assert_eq!(of_conn.as_array().map(Vec::len), Some(2));
    let (c, conn_json) = get(http, &format!("/api/connections/{}", enc(conn_name)), GUEST);
    assert_eq!((c, &conn_json["channels"]), (200, &json!(2)));
    let (c, ch) = get(
        http,
        &format!("/api/channels/{}", enc(&format!("{conn_name} (2)"))),
        GUEST,
    );
    assert_eq!((c, &ch["transactional"]), (200, &json!(true)));
    assert_eq!(
        get(
            http,
            &format!("/api/channels/{}", enc(&format!("{conn_name} (9)"))),
            GUEST
        )
        .0,
        404
    );
    assert_eq!(get(http, "/api/channels/nonsense", GUEST).0, 404);
    let (c, of_vhost) = get(http, "/api/vhosts/%2F/channels", GUEST);
    assert_eq!((c, of_vhost.as_array().map(Vec::len)), (200, Some(3)));

    // a closed channel goes from the listing
    two.close(200, "bye".into()).await.expect("close");
    eventually("the closed channel unlisted", || {
        get(
            http,
            &format!("/api/connections/{}/channels", enc(conn_name)),
            GUEST,
        )
        .1
        .as_array()
        .map(Vec::len)
            == Some(1)
    });
    drop(stomp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_users_vhosts_and_permissions_survive_a_restart() {
    let mut broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    assert_eq!(status(http, "PUT", "/api/vhosts/prod", json!({})), 201);
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/users/alice",
            json!({"password": "s3cret", "tags": ["monitoring"]})
        ),
        201
    );
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/permissions/prod/alice",
            json!({"configure": ".*", "write": ".*", "read": ".*"})
        ),
        201
    );
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/users/bob",
            json!({"password": "x", "tags": ""})
        ),
        201
    );
    assert_eq!(call(http, "DELETE", "/api/users/bob", GUEST, None).0, 204);
    assert_eq!(status(http, "PUT", "/api/vhosts/gone", json!({})), 201);
    assert_eq!(
        status(http, "PUT", "/api/queues/gone/q", json!({"durable": true})),
        201
    );
    assert_eq!(call(http, "DELETE", "/api/vhosts/gone", GUEST, None).0, 204);
    // the configuration's default user changed through the API: kept over a restart
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/users/guest",
            json!({"password": "changed", "tags": "administrator"})
        ),
        204
    );

    broker.restart();
    let http = broker.http_addr();
    let guest = Some(("guest", "changed"));
    let (code, who) = get(http, "/api/whoami", Some(("alice", "s3cret")));
    assert_eq!((code, &who["tags"]), (200, &json!(["monitoring"])));
    assert_eq!(
        get(http, "/api/users/bob", guest).0,
        404,
        "a deleted user stays deleted"
    );
    assert_eq!(
        get(http, "/api/vhosts/gone", guest).0,
        404,
        "a deleted vhost stays deleted"
    );
    let (_, perms) = get(http, "/api/users/alice/permissions", guest);
    assert_eq!(
        perms,
        json!([{"user": "alice", "vhost": "prod", "configure": ".*", "write": ".*", "read": ".*"}])
    );
    // and the protocols use them: alice opens `prod` over AMQP
    let uri = format!("amqp://alice:s3cret@{}/prod", broker.amqp_addr());
    let conn = lapin::Connection::connect(&uri, lapin::ConnectionProperties::default())
        .await
        .expect("alice logs in to prod");
    conn.close(200, "bye".into()).await.expect("close");
    let uri = format!("amqp://guest:guest@{}/%2f", broker.amqp_addr());
    assert!(
        lapin::Connection::connect(&uri, lapin::ConnectionProperties::default())
            .await
            .is_err(),
        "guest's old password no longer works"
    );
}

#[test]
fn definitions_export_and_import_round_trip() {
    let a = TestBroker::start_with_config(&config());
    let http = a.http_addr();
    assert_eq!(status(http, "PUT", "/api/vhosts/app", json!({})), 201);
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/users/app",
            json!({"password": "pw", "tags": "management"})
        ),
        201
    );
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/permissions/app/app",
            json!({"configure": ".*", "write": ".*", "read": "^r"})
        ),
        201
    );
    // the creator of a vhost has full permissions in it already, as in RabbitMQ
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/permissions/app/guest",
            json!({"configure": ".*", "write": ".*", "read": ".*"})
        ),
        204
    );
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/exchanges/app/events",
            json!({"type": "fanout", "durable": true})
        ),
        201
    );
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/queues/app/inbox",
            json!({"durable": true, "arguments": {"x-message-ttl": 60000}})
        ),
        201
    );
    assert_eq!(
        call(
            http,
            "POST",
            "/api/bindings/app/e/events/q/inbox",
            GUEST,
            Some(&json!({}))
        )
        .0,
        201
    );
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/policies/app/cap",
            json!({"pattern": "^in", "apply-to": "queues", "priority": 1, "definition": {"max-length": 5}})
        ),
        201
    );
    let (code, defs) = get(http, "/api/definitions", GUEST);
    assert_eq!(code, 200);

    let b = TestBroker::start_with_config(&config());
    let http_b = b.http_addr();
    assert_eq!(
        call(http_b, "POST", "/api/definitions", GUEST, Some(&defs)).0,
        204
    );
    let (_, again) = get(http_b, "/api/definitions", GUEST);
    assert_eq!(
        defs["policies"],
        json!([{"vhost": "app", "name": "cap", "pattern": "^in", "apply-to": "queues",
            "definition": {"max-length": 5}, "priority": 1}])
    );
    for k in [
        "vhosts",
        "permissions",
        "policies",
        "queues",
        "exchanges",
        "bindings",
    ] {
        assert_eq!(again[k], defs[k], "{k}");
    }
    // password hashes are carried over: `app` logs in on the new broker
    assert_eq!(get(http_b, "/api/whoami", Some(("app", "pw"))).0, 200);
    // what is not implemented is refused before anything changes
    let mut with_policy = defs.clone();
    with_policy["policies"] = json!([{"vhost": "/", "name": "p", "pattern": ".*",
        "apply-to": "queues", "priority": 0, "definition": {"ha-mode": "all"}}]);
    with_policy["queues"] = json!([{"vhost": "/", "name": "never", "durable": true, "auto_delete": false, "arguments": {}}]);
    assert_eq!(
        call(
            http_b,
            "POST",
            "/api/definitions",
            GUEST,
            Some(&with_policy)
        )
        .0,
        400
    );
    assert_eq!(get(http_b, "/api/queues/%2F/never", GUEST).0, 404);
    let mut md5 = defs;
    md5["users"] = json!([{"name": "x", "password_hash": "abc", "hashing_algorithm": "rabbit_password_hashing_md5", "tags": ""}]);
    assert_eq!(
        call(http_b, "POST", "/api/definitions", GUEST, Some(&md5)).0,
        400
    );
}

#[test]
fn bodies_are_bounded_and_keep_alive_serves_several_requests() {
    let broker = TestBroker::start_with_config(&format!(
        "{}\n[http]\nmax_body_size = \"1 KiB\"\n",
        config()
    ));
    let http = broker.http_addr();
    let big =
        json!({"payload": "x".repeat(2000), "routing_key": "k", "payload_encoding": "string"});
    assert_eq!(
        status(http, "POST", "/api/exchanges/%2F/amq.default/publish", big),
        413
    );
    // two requests on one connection
    let mut s = TcpStream::connect(http).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    assert_eq!(out.matches("HTTP/1.1 200 OK").count(), 2, "{out}");
}

#[test]
fn health_checks_name_the_listeners() {
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    assert_eq!(
        get(http, "/api/health/checks/alarms", GUEST),
        (200, json!({"status": "ok"}))
    );
    let amqp = broker.amqp_addr().port();
    assert_eq!(
        get(
            http,
            &format!("/api/health/checks/port-listener/{amqp}"),
            GUEST
        ),
        (200, json!({"status": "ok", "port": amqp}))
    );
    let (code, v) = get(http, "/api/health/checks/port-listener/1", GUEST);
    assert_eq!((code, &v["status"]), (503, &json!("failed")));
    assert!(
        v["ports"]
            .as_array()
            .is_some_and(|p| p.contains(&json!(amqp))),
        "{v}"
    );
    let (_, overview) = get(http, "/api/overview", GUEST);
    let listeners = overview["listeners"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        listeners
            .iter()
            .any(|l| l["protocol"] == "amqp" && l["port"] == amqp),
        "{overview}"
    );
}

#[test]
fn policies_govern_queues_without_redeclaring_and_survive_a_restart() {
    let mut broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    for q in ["jobs.a", "other"] {
        assert_eq!(
            status(
                http,
                "PUT",
                &format!("/api/queues/%2F/{q}"),
                json!({"durable": true})
            ),
            201
        );
        for i in 0..4 {
            let (code, v) = {
                let (c, _, b) = call(
                    http,
                    "POST",
                    "/api/exchanges/%2F/amq.default/publish",
                    GUEST,
                    Some(&json!({"routing_key": q, "payload": format!("m{i}"),
                        "payload_encoding": "string", "properties": {"delivery_mode": 2}})),
                );
                (c, serde_json::from_str::<Value>(&b).unwrap_or(Value::Null))
            };
            assert_eq!((code, &v["routed"]), (200, &json!(true)));
        }
    }
    let pol = json!({"pattern": "^jobs\\.", "apply-to": "queues", "priority": 2,
        "definition": {"max-length": 2, "message-ttl": 60000}});
    assert_eq!(
        status(http, "PUT", "/api/policies/%2F/jobs", pol.clone()),
        201
    );
    assert_eq!(status(http, "PUT", "/api/policies/%2F/jobs", pol), 204);
    // applied to the existing queue: its backlog is cut to the new limit now (drop-head)
    let (_, q) = get(http, "/api/queues/%2F/jobs.a", GUEST);
    assert_eq!(q["policy"], "jobs");
    assert_eq!(q["messages"], 2, "{q}");
    assert_eq!(q["effective_policy_definition"]["max-length"], 2);
    let (_, other) = get(http, "/api/queues/%2F/other", GUEST);
    assert_eq!(
        (&other["policy"], &other["messages"]),
        (&Value::Null, &json!(4))
    );
    let (code, list) = get(http, "/api/policies", GUEST);
    assert_eq!(code, 200);
    assert_eq!(
        list,
        json!([{"vhost": "/", "name": "jobs", "pattern": "^jobs\\.", "apply-to": "queues",
            "definition": {"max-length": 2, "message-ttl": 60000},
            "priority": 2}])
    );
    // with overflow reject-publish (the policy replaced), a queue declared later is
    // governed too and refuses the third message
    let pol = json!({"pattern": "^jobs\\.", "apply-to": "queues", "priority": 2,
        "definition": {"max-length": 2, "overflow": "reject-publish", "message-ttl": 60000}});
    assert_eq!(status(http, "PUT", "/api/policies/%2F/jobs", pol), 204);
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/queues/%2F/jobs.b",
            json!({"durable": true})
        ),
        201
    );
    let routed: Vec<Value> = (0..3)
        .map(|i| {
            let (_, _, b) = call(
                http,
                "POST",
                "/api/exchanges/%2F/amq.default/publish",
                GUEST,
                Some(&json!({"routing_key": "jobs.b", "payload": format!("n{i}"),
                    "payload_encoding": "string", "properties": {}})),
            );
            serde_json::from_str::<Value>(&b).unwrap_or(Value::Null)["routed"].clone()
        })
        .collect();
    assert_eq!(routed, [json!(true), json!(true), json!(false)]);
    // only policymakers and administrators manage policies
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/users/mon",
            json!({"password": "pw", "tags": "monitoring"})
        ),
        201
    );
    assert_eq!(get(http, "/api/policies", Some(("mon", "pw"))).0, 401);

    broker.restart();
    let http = broker.http_addr();
    let (_, q) = get(http, "/api/queues/%2F/jobs.a", GUEST);
    assert_eq!((&q["policy"], &q["messages"]), (&json!("jobs"), &json!(2)));
    assert_eq!(
        call(http, "DELETE", "/api/policies/%2F/jobs", GUEST, None).0,
        204
    );
    assert_eq!(
        call(http, "DELETE", "/api/policies/%2F/jobs", GUEST, None).0,
        404
    );
    let (_, q) = get(http, "/api/queues/%2F/jobs.b", GUEST);
    assert_eq!(q["policy"], Value::Null);
    assert_eq!(q["effective_policy_definition"], json!({}));
    assert_eq!(get(http, "/api/policies", GUEST).1, json!([]));
}

#[test]
fn message_stats_count_and_rate_like_rabbitmq() {
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    assert_eq!(status(http, "PUT", "/api/queues/%2F/r", json!({})), 201);
    let publish = |n: usize| {
        for i in 0..n {
            assert_eq!(
                status(
                    http,
                    "POST",
                    "/api/exchanges/%2F/amq.default/publish",
                    json!({"routing_key": "r", "payload": format!("m{i}"),
                        "payload_encoding": "string", "properties": {}})
                ),
                200
            );
        }
    };
    // the first reading starts sampling
    let (_, q) = get(http, "/api/queues/%2F/r", GUEST);
    assert_eq!(q["message_stats"]["publish_details"]["rate"], 0.0);
    get(http, "/api/overview", GUEST);
    publish(6);
    assert_eq!(
        status(
            http,
            "POST",
            "/api/queues/%2F/r/get",
            json!({"count": 2, "ackmode": "ack_requeue_false", "encoding": "auto"})
        ),
        200
    );
    let mut last = Value::Null;
    eventually("a publish rate", || {
        last = get(http, "/api/queues/%2F/r", GUEST).1;
        last["message_stats"]["publish_details"]["rate"]
            .as_f64()
            .is_some_and(|r| r > 0.0)
    });
    let m = &last["message_stats"];
    assert_eq!(
        (&m["publish"], &m["get"], &m["ack"], &m["deliver_get"]),
        (&json!(6), &json!(2), &json!(2), &json!(2)),
        "{m}"
    );
    assert!(
        m["ack_details"]["rate"].as_f64().is_some_and(|r| r > 0.0),
        "{m}"
    );
    let mut overview = Value::Null;
    eventually("an overview publish rate", || {
        overview = get(http, "/api/overview", GUEST).1;
        overview["message_stats"]["publish_details"]["rate"]
            .as_f64()
            .is_some_and(|r| r > 0.0)
    });
    assert_eq!(overview["message_stats"]["publish"], 6);
    assert_eq!(overview["rates_mode"], "basic");
    let (_, vh) = get(http, "/api/vhosts/%2F", GUEST);
    assert_eq!(vh["message_stats"]["ack"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exchange_and_connection_stats_count_like_rabbitmq() {
    use lapin::options::BasicPublishOptions;
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/exchanges/%2F/fx",
            json!({"type": "fanout"})
        ),
        201
    );
    for q in ["fq1", "fq2"] {
        assert_eq!(
            status(http, "PUT", &format!("/api/queues/%2F/{q}"), json!({})),
            201
        );
        assert_eq!(
            status(
                http,
                "POST",
                &format!("/api/bindings/%2F/e/fx/q/{q}"),
                json!({"routing_key": ""})
            ),
            201
        );
    }
    let stats =
        |x: &str| get(http, &format!("/api/exchanges/%2F/{x}"), GUEST).1["message_stats"].clone();
    // the first reading starts sampling; nothing published yet
    assert_eq!(
        stats("fx"),
        json!({"publish_in": 0, "publish_in_details": {"rate": 0.0},
            "publish_out": 0, "publish_out_details": {"rate": 0.0}})
    );
    let conn = common::amqp::connect(broker.amqp_addr())
        .await
        .expect("amqp");
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(Default::default())
        .await
        .expect("confirm");
    let publish = |x: &'static str, n: usize| {
        let ch = ch.clone();
        async move {
            for _ in 0..n {
                ch.basic_publish(
                    x.into(),
                    "k".into(),
                    BasicPublishOptions::default(),
                    &[b'x'; 100],
                    Default::default(),
                )
                .await
                .expect("publish")
                .await
                .expect("confirm");
            }
        }
    };
    publish("fx", 5).await;
    // unroutable: in, not out
    publish("amq.direct", 1).await;
    // publish_out counts one per queue, as RabbitMQ's
    let mut last = Value::Null;
    eventually("a publish_in rate", || {
        last = stats("fx");
        last["publish_in_details"]["rate"]
            .as_f64()
            .is_some_and(|r| r > 0.0)
    });
    assert_eq!(
        (&last["publish_in"], &last["publish_out"]),
        (&json!(5), &json!(10)),
        "{last}"
    );
    assert!(
        last["publish_out_details"]["rate"]
            .as_f64()
            .is_some_and(|r| r > 0.0),
        "{last}"
    );
    let (_, all) = get(http, "/api/exchanges/%2F", GUEST);
    let direct = all
        .as_array()
        .and_then(|a| a.iter().find(|x| x["name"] == "amq.direct"))
        .expect("amq.direct listed");
    assert_eq!(
        (
            &direct["message_stats"]["publish_in"],
            &direct["message_stats"]["publish_out"]
        ),
        (&json!(1), &json!(0))
    );
    // the connection's bytes, reads and writes
    let (_, conns) = get(http, "/api/connections", GUEST);
    let c = &conns[0];
    assert!(c["recv_oct"].as_u64().is_some_and(|n| n > 600), "{c}");
    assert!(c["recv_cnt"].as_u64().is_some_and(|n| n >= 1), "{c}");
    assert!(c["send_oct"].as_u64().is_some_and(|n| n > 0), "{c}");
    assert!(c["send_cnt"].as_u64().is_some_and(|n| n >= 1), "{c}");
    assert!(c["recv_oct_details"]["rate"].is_number(), "{c}");
    assert!(c["send_oct_details"]["rate"].is_number(), "{c}");
    let recv_before = c["recv_oct"].as_u64().unwrap_or(0);
    publish("fx", 1).await;
    eventually("the connection's bytes to grow", || {
        get(http, "/api/connections", GUEST).1[0]["recv_oct"]
            .as_u64()
            .is_some_and(|n| n > recv_before + 100)
    });
    // a closed connection's counts stay with the exchange
    conn.close(200, "bye".into()).await.expect("close");
    eventually("the connection to go", || {
        get(http, "/api/connections", GUEST).1 == json!([])
    });
    let after = stats("fx");
    assert_eq!(
        (&after["publish_in"], &after["publish_out"]),
        (&json!(6), &json!(12)),
        "{after}"
    );
    // deleted and declared again: from 0
    assert_eq!(
        call(http, "DELETE", "/api/exchanges/%2F/fx", GUEST, None).0,
        204
    );
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/exchanges/%2F/fx",
            json!({"type": "fanout"})
        ),
        201
    );
    assert_eq!(stats("fx")["publish_in"], 0);
    // without mqtt.index_topics, a query by topic is refused, not answered empty
    let (code, why) = get(http, "/api/messages/by-topic/%2F?topic=a/b", GUEST);
    assert_eq!(code, 400, "{why}");
    assert!(
        why["reason"]
            .as_str()
            .is_some_and(|r| r.contains("mqtt.index_topics")),
        "{why}"
    );
}

#[test]
fn prometheus_metrics_aggregated_and_per_object() {
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    for q in ["m1", "m\"2"] {
        let path = format!("/api/queues/%2F/{}", q.replace('"', "%22"));
        assert_eq!(status(http, "PUT", &path, json!({})), 201);
        assert_eq!(
            status(
                http,
                "POST",
                "/api/exchanges/%2F/amq.default/publish",
                json!({"routing_key": q, "payload": "x", "payload_encoding": "string", "properties": {}})
            ),
            200
        );
    }
    // no login needed, as RabbitMQ's Prometheus endpoint
    let (code, head, body) = call(http, "GET", "/metrics", None, None);
    assert_eq!(code, 200, "{body}");
    assert!(
        head.contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    let value = |name: &str| -> Option<f64> {
        body.lines()
            .find(|l| l.split([' ', '{']).next() == Some(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    assert_eq!(value("rabbitmq_queue_messages_ready"), Some(2.0), "{body}");
    assert_eq!(value("rabbitmq_queues"), Some(2.0));
    assert_eq!(value("rabbitmq_global_messages_received_total"), Some(2.0));
    assert_eq!(value("rabbitmq_alarms_memory_used_watermark"), Some(0.0));
    assert!(body.contains("# TYPE rabbitmq_global_messages_acknowledged_total counter"));
    assert!(value("triad_store_segments").is_some_and(|n| n >= 1.0));
    // Triad's own: store, flushes, MQTT
    assert!(value("triad_store_segment_bytes").is_some_and(|n| n > 0.0));
    assert!(value("triad_store_appends_total").is_some_and(|n| n >= 2.0));
    assert_eq!(value("triad_store_compactions_total"), Some(0.0));
    assert_eq!(value("triad_store_pass_waits_total"), Some(0.0));
    assert_eq!(value("triad_store_pass_wait_timeouts_total"), Some(0.0));
    assert!(body.contains("# TYPE triad_store_fsync_seconds histogram"));
    assert!(body.contains("triad_store_group_commit_bytes_bucket{le=\"+Inf\"}"));
    assert_eq!(value("triad_mqtt_persistent_sessions"), Some(0.0));
    let retained_before = value("triad_mqtt_retained_messages").expect("retained");
    // a persistent message waits for a flush: the histograms count it
    assert_eq!(
        status(
            http,
            "POST",
            "/api/exchanges/%2F/amq.default/publish",
            json!({"routing_key": "m1", "payload": "x", "payload_encoding": "string", "properties": {"delivery_mode": 2}})
        ),
        200
    );
    // an MQTT client with a persistent session (clean session 0) leaves a retained message
    let mut mqtt = TcpStream::connect(broker.mqtt_addr()).expect("mqtt");
    mqtt.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    mqtt.write_all(b"\x10\x0e\x00\x04MQTT\x04\x00\x00\x3c\x00\x02c1")
        .expect("CONNECT");
    let mut connack = [0u8; 4];
    mqtt.read_exact(&mut connack).expect("CONNACK");
    assert_eq!(connack, [0x20, 2, 0, 0]);
    mqtt.write_all(b"\x82\x08\x00\x01\x00\x03a/b\x01")
        .expect("SUBSCRIBE");
    let mut suback = [0u8; 5];
    mqtt.read_exact(&mut suback).expect("SUBACK");
    assert_eq!(suback, [0x90, 3, 0, 1, 1]);
    mqtt.write_all(b"\x31\x06\x00\x03a/bx\xe0\x00")
        .expect("PUBLISH retained, DISCONNECT");
    let last = std::cell::RefCell::new(String::new());
    eventually_with(
        "the retained message and the session counted",
        || last.borrow().clone(),
        || {
            *last.borrow_mut() = call(http, "GET", "/metrics", None, None).2;
            let scraped = last.borrow();
            let v = |name: &str| -> f64 {
                scraped
                    .lines()
                    .find(|l| l.split([' ', '{']).next() == Some(name))
                    .and_then(|l| l.rsplit(' ').next())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(-1.0)
            };
            v("triad_mqtt_retained_messages") >= retained_before + 1.0
                && v("triad_mqtt_persistent_sessions") == 1.0
                && v("triad_store_fsync_seconds_count") >= 1.0
        },
    );
    let scraped = last.into_inner();
    // the buckets are cumulative and end at the count
    let series = |prefix: &str| -> Vec<f64> {
        scraped
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect()
    };
    let buckets = series("triad_store_fsync_seconds_bucket");
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "{buckets:?}");
    assert_eq!(
        buckets.last().copied(),
        series("triad_store_fsync_seconds_count").first().copied()
    );
    // one series per queue on the per-object endpoint, label values escaped
    let (code, _, per) = call(http, "GET", "/metrics/per-object", None, None);
    assert_eq!(code, 200);
    assert!(
        per.contains("rabbitmq_queue_messages_ready{vhost=\"/\",queue=\"m1\"} 2"),
        "{per}"
    );
    assert!(
        per.contains("rabbitmq_queue_messages_ready{vhost=\"/\",queue=\"m\\\"2\"} 1"),
        "{per}"
    );
    assert_eq!(call(http, "POST", "/metrics", None, None).0, 405);
}

#[test]
fn messages_are_found_by_id_offset_and_time() {
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    let start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    assert_eq!(
        status(http, "PUT", "/api/queues/%2F/mq", json!({"durable": true})),
        201
    );
    for i in 0..3 {
        assert_eq!(
            status(
                http,
                "POST",
                "/api/exchanges/%2F/amq.default/publish",
                json!({"routing_key": "mq", "payload": format!("body-{i}-{}", "x".repeat(2000)),
                    "payload_encoding": "string",
                    "properties": {"message_id": format!("id-{i}"), "delivery_mode": 2}})
            ),
            200
        );
    }
    let (code, found) = get(http, "/api/messages/by-id/id-1", GUEST);
    assert_eq!(code, 200, "{found}");
    let m = &found[0];
    assert_eq!(found.as_array().map(Vec::len), Some(1));
    assert_eq!(m["properties"]["message_id"], "id-1");
    assert_eq!(
        (&m["routing_key"], &m["payload_bytes"]),
        (&json!("mq"), &json!(2007))
    );
    // truncated unless asked for
    assert_eq!(m["payload_truncated"], true);
    assert_eq!(m["payload"].as_str().map(str::len), Some(1024));
    assert!(m["store_time"].as_u64().is_some_and(|t| t >= start));
    assert_eq!(
        m["queues"],
        json!([{"vhost": "/", "name": "mq", "offset": 1, "held": true}])
    );
    let (_, full) = get(http, "/api/messages/by-id/id-1?body=full", GUEST);
    assert_eq!(full[0]["payload_truncated"], false);
    assert_eq!(full[0]["payload"].as_str().map(str::len), Some(2007));
    assert_eq!(get(http, "/api/messages/by-id/nope", GUEST).1, json!([]));
    // by offset; a consumed message is no longer held
    assert_eq!(
        status(
            http,
            "POST",
            "/api/queues/%2F/mq/get",
            json!({"count": 1, "ackmode": "ack_requeue_false", "encoding": "auto"})
        ),
        200
    );
    let (_, by_off) = get(
        http,
        "/api/messages/%2F/mq/offset/0?count=2&truncate=6",
        GUEST,
    );
    // the consumed entry is below the queue's first kept offset now: the answer starts
    // at offset 1
    assert_eq!(by_off.as_array().map(Vec::len), Some(2), "{by_off}");
    assert_eq!(by_off[0]["payload"], "body-1");
    assert_eq!(by_off[0]["payload_truncated"], true);
    assert_eq!(by_off[0]["queues"][0]["held"], true);
    // the record itself is still in the commitlog, found by id, held by no queue
    let (_, gone) = get(http, "/api/messages/by-id/id-0", GUEST);
    assert_eq!(
        gone[0]["queues"],
        json!([{"vhost": "/", "name": "mq", "offset": 0, "held": false}])
    );
    // by time range
    let (_, by_time) = get(
        http,
        &format!("/api/messages/%2F/mq/time?from={start}"),
        GUEST,
    );
    assert_eq!(by_time.as_array().map(Vec::len), Some(2));
    assert_eq!(by_time[0]["properties"]["message_id"], "id-1");
    let later = start + 3_600_000;
    let (_, none) = get(
        http,
        &format!("/api/messages/%2F/mq/time?from={later}"),
        GUEST,
    );
    assert_eq!(none, json!([]));
    // bounded and checked
    assert_eq!(
        get(http, "/api/messages/by-id/id-1?count=1000", GUEST).0,
        400
    );
    assert_eq!(get(http, "/api/messages/%2F/nope/offset/0", GUEST).0, 404);
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/users/peek",
            json!({"password": "pw", "tags": "management"})
        ),
        201
    );
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/permissions/%2F/peek",
            json!({"configure": "", "write": "", "read": "^other$"})
        ),
        201
    );
    let peek = Some(("peek", "pw"));
    assert_eq!(get(http, "/api/messages/%2F/mq/offset/0", peek).0, 401);
    assert_eq!(get(http, "/api/messages/by-id/id-1", peek).0, 401);
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
}

#[test]
fn mqtt_publishes_are_found_by_topic_and_time() {
    use common::raw::MqttClient;
    let broker =
        TestBroker::start_with_config(&format!("{}\n[mqtt]\nindex_topics = true\n", config()));
    let http = broker.http_addr();
    // a queue bound to the topics, so the publishes are stored
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/queues/%2F/sensors",
            json!({"durable": true})
        ),
        201
    );
    assert_eq!(
        status(
            http,
            "POST",
            "/api/bindings/%2F/e/amq.topic/q/sensors",
            json!({"routing_key": "s.*.t"})
        ),
        201
    );
    let timeout = Duration::from_secs(10);
    let mut c = MqttClient::connect(broker.mqtt_addr(), "pub-1", true, timeout).expect("mqtt");
    c.publish("s/1/t", 1, 1, b"one").expect("publish");
    assert_eq!(c.read_until(4).expect("PUBACK").0.pkid(), Some(1));
    c.publish("s/2/t", 1, 2, b"two").expect("publish");
    assert_eq!(c.read_until(4).expect("PUBACK").0.pkid(), Some(2));
    // both are stored: a later publish gets a later store time
    let mid = now_ms();
    eventually("the clock to move", || now_ms() > mid);
    c.publish("s/1/t", 0, 0, b"three").expect("publish");
    let query = |q: &str| get(http, &format!("/api/messages/by-topic/%2F?{q}"), GUEST);
    let payloads = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|m| m["payload"].as_str().unwrap_or("?").to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    eventually_with(
        "the QoS 0 publish to be stored",
        || query("topic=s/1/t").1.to_string(),
        || payloads(&query("topic=s/1/t").1).len() == 2,
    );
    let (code, all) = query("topic=s%2F1%2Ft");
    assert_eq!(code, 200, "{all}");
    // newest first, only that topic
    assert_eq!(payloads(&all), ["three", "one"]);
    assert_eq!(all[0]["exchange"], "amq.topic");
    assert_eq!(all[0]["routing_key"], "s.1.t");
    assert_eq!(all[1]["properties"]["delivery_mode"], 2);
    assert_eq!(
        all[1]["queues"],
        json!([{"vhost": "/", "name": "sensors", "offset": 0, "held": true}])
    );
    // the time range, both ends inclusive
    assert_eq!(
        payloads(&query(&format!("topic=s/1/t&to={mid}")).1),
        ["one"]
    );
    assert_eq!(
        payloads(&query(&format!("topic=s/1/t&from={}", mid + 1)).1),
        ["three"]
    );
    assert_eq!(
        payloads(
            &query(&format!(
                "topic=s/1/t&from={}&to={}",
                mid + 1,
                mid + 3_600_000
            ))
            .1
        ),
        ["three"]
    );
    assert_eq!(payloads(&query("topic=s/2/t&count=1").1), ["two"]);
    assert_eq!(query("topic=s/3/t").1, json!([]));
    // an AMQP message whose message-id is the topic is not an MQTT publish to it, and
    // the topic's messages are not found by that id
    assert_eq!(
        status(
            http,
            "POST",
            "/api/exchanges/%2F/amq.default/publish",
            json!({"routing_key": "sensors", "payload": "amqp", "payload_encoding": "string",
                "properties": {"message_id": "s/1/t"}})
        ),
        200
    );
    assert_eq!(payloads(&query("topic=s/1/t").1), ["three", "one"]);
    assert_eq!(
        payloads(&get(http, "/api/messages/by-id/s%2F1%2Ft", GUEST).1),
        ["amqp"]
    );
    // checked
    assert_eq!(
        query("topic=s/%2B/t").0,
        400,
        "a filter is not a topic name"
    );
    assert_eq!(query("topic=s/%23").0, 400);
    assert_eq!(query("from=1").0, 400, "topic is required");
    assert_eq!(query("topic=s/1/t&from=5&to=4").0, 400);
    assert_eq!(query("topic=s/1/t&from=soon").0, 400);
    assert_eq!(
        get(http, "/api/messages/by-topic/nope?topic=s/1/t", GUEST).0,
        404
    );
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/users/mon",
            json!({"password": "pw", "tags": "monitoring"})
        ),
        201
    );
    assert_eq!(
        get(
            http,
            "/api/messages/by-topic/%2F?topic=s/1/t",
            Some(("mon", "pw"))
        )
        .0,
        401,
        "administrators only, as by-id"
    );
}

#[test]
fn the_dashboard_is_served_from_the_binary() {
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    let (code, head, body) = call(http, "GET", "/", None, None);
    assert_eq!(code, 200);
    assert!(head.contains("content-type: text/html"), "{head}");
    assert!(
        head.contains("content-security-policy: default-src 'self'"),
        "{head}"
    );
    assert!(body.contains("<script src=\"/ui/app.js\""), "{body}");
    let (code, head, js) = call(http, "GET", "/ui/app.js", None, None);
    assert_eq!(code, 200);
    assert!(head.contains("content-type: text/javascript"), "{head}");
    assert!(js.contains("/api"));
    assert_eq!(call(http, "GET", "/ui/style.css", None, None).0, 200);
    assert_eq!(call(http, "POST", "/", None, None).0, 405);
    assert_eq!(call(http, "GET", "/ui/nope.js", None, None).0, 404);
    // the dashboard's requests get no WWW-Authenticate (no browser login dialog); others do
    let mut s = std::net::TcpStream::connect(http).expect("connect");
    s.write_all(b"GET /api/whoami HTTP/1.1\r\nHost: x\r\nX-Requested-With: XMLHttpRequest\r\nAuthorization: Basic Z3Vlc3Q6bm9wZQ==\r\nConnection: close\r\n\r\n")
        .expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    assert!(out.starts_with("HTTP/1.1 401"), "{out}");
    assert!(
        !out.to_ascii_lowercase().contains("www-authenticate"),
        "{out}"
    );
    let (code, head, _) = call(http, "GET", "/api/whoami", Some(("guest", "nope")), None);
    assert_eq!(code, 401);
    assert!(head.contains("www-authenticate: basic"), "{head}");
}

/// Review finding: `POST .../get` with a large `count` held count × message size at
/// once; the shown payload bytes per request are bounded now (16 MiB, then one more
/// message at most), and `truncate` shows more messages per request.
#[test]
fn get_bounds_the_bytes_of_one_answer() {
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    assert_eq!(status(http, "PUT", "/api/queues/%2F/big", json!({})), 201);
    let payload = "a".repeat(1_000_000);
    for _ in 0..18 {
        assert_eq!(
            status(
                http,
                "POST",
                "/api/exchanges/%2F/amq.default/publish",
                json!({"routing_key": "big", "payload": payload, "payload_encoding": "string", "properties": {}})
            ),
            200
        );
    }
    let get = |body: Value| -> Vec<Value> {
        let (code, _, text) = call(http, "POST", "/api/queues/%2F/big/get", GUEST, Some(&body));
        assert_eq!(code, 200, "{text}");
        serde_json::from_str::<Value>(&text)
            .expect("json")
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    // 16 MiB is 16.8 MB: the 17th message takes the answer past it, the 18th stays
    let got = get(json!({"count": 100, "ackmode": "ack_requeue_true", "encoding": "auto"}));
    assert_eq!(got.len(), 17);
    assert!(got.iter().all(|m| m["payload_bytes"] == 1_000_000));
    let got = get(
        json!({"count": 100, "ackmode": "ack_requeue_true", "encoding": "auto", "truncate": 10}),
    );
    assert_eq!(got.len(), 18);
    assert!(got.iter().all(|m| m["payload"] == "aaaaaaaaaa"));
    assert_eq!(get_json(http, "/api/queues/%2F/big")["messages"], 18);
}

fn get_json(http: SocketAddr, path: &str) -> Value {
    let (code, v) = get(http, path, GUEST);
    assert_eq!(code, 200, "{path}");
    v
}

/// Review finding: PUT and POST bodies were parsed before the permission check; a user
/// who may not make the change is refused first, whatever the body.
#[test]
fn changes_are_refused_before_their_body_is_read() {
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/users/mon",
            json!({"password": "pw", "tags": "management"})
        ),
        201
    );
    let mon = Some(("mon", "pw"));
    let raw = |method: &str, path: &str| -> u16 {
        // a body that is not JSON: a 400 if it were parsed first
        let mut s = TcpStream::connect(http).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let cred = base64::engine::general_purpose::STANDARD.encode("mon:pw");
        let body = "{not json";
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Basic {cred}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .expect("send");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read");
        out.split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .expect("status")
    };
    // no permissions in "/", not an administrator, not a policymaker
    assert_eq!(raw("PUT", "/api/queues/%2F/q"), 401);
    assert_eq!(raw("PUT", "/api/exchanges/%2F/x"), 401);
    assert_eq!(raw("POST", "/api/exchanges/%2F/amq.default/publish"), 401);
    assert_eq!(raw("POST", "/api/queues/%2F/q/get"), 401);
    assert_eq!(raw("POST", "/api/bindings/%2F/e/amq.direct/q/q"), 401);
    assert_eq!(raw("PUT", "/api/users/other"), 401);
    assert_eq!(raw("PUT", "/api/vhosts/v2"), 401);
    assert_eq!(raw("PUT", "/api/permissions/%2F/mon"), 401);
    assert_eq!(raw("POST", "/api/definitions"), 401);
    assert_eq!(raw("PUT", "/api/policies/%2F/p"), 401);
    // a vhost that does not exist is a 404, still before the body
    assert_eq!(raw("PUT", "/api/queues/nope/q"), 404);
    // with the permission, the body is read (and this one is refused as invalid)
    assert_eq!(
        status(
            http,
            "PUT",
            "/api/permissions/%2F/mon",
            json!({"configure": ".*", "write": ".*", "read": ".*"})
        ),
        201
    );
    assert_eq!(raw("PUT", "/api/queues/%2F/q"), 400);
    assert_eq!(get(http, "/api/queues/%2F", mon).0, 200);
}

/// Review findings: users, permissions and policies listings take the listing
/// parameters; a definitions file with limits is refused, not half-imported; a policy
/// body naming another policy or vhost than its URL is refused.
#[test]
fn listings_page_and_imports_refuse_what_they_would_drop() {
    let broker = TestBroker::start_with_config(&config());
    let http = broker.http_addr();
    for u in ["u1", "u2", "u3"] {
        assert_eq!(
            status(
                http,
                "PUT",
                &format!("/api/users/{u}"),
                json!({"password": "p", "tags": ""})
            ),
            201
        );
        assert_eq!(
            status(
                http,
                "PUT",
                &format!("/api/permissions/%2F/{u}"),
                json!({"configure": "", "write": "", "read": ".*"})
            ),
            201
        );
    }
    for p in ["pa", "pb"] {
        assert_eq!(
            status(
                http,
                "PUT",
                &format!("/api/policies/%2F/{p}"),
                json!({"pattern": "^none$", "definition": {"max-length": 1}})
            ),
            201
        );
    }
    let page = get_json(http, "/api/users?page=2&page_size=2");
    assert_eq!(page["total_count"], 4, "{page}"); // guest too
    assert_eq!(page["items"].as_array().map(Vec::len), Some(2));
    assert_eq!(page["items"][0]["name"], "u2");
    let names = get_json(
        http,
        "/api/users?name=%5Eu&use_regex=true&sort_reverse=true&columns=name",
    );
    assert_eq!(
        names,
        json!([{"name": "u3"}, {"name": "u2"}, {"name": "u1"}])
    );
    let perms = get_json(http, "/api/permissions?name=u1");
    assert_eq!(perms.as_array().map(Vec::len), Some(1));
    assert_eq!(perms[0]["user"], "u1");
    let pols = get_json(http, "/api/policies?page=1&page_size=1&sort_reverse=true");
    assert_eq!(pols["items"][0]["name"], "pb", "{pols}");
    assert_eq!(pols["filtered_count"], 2);
    assert_eq!(get(http, "/api/permissions?sort=user", GUEST).0, 400);

    // limits in definitions: refused before anything changes
    let (code, _, text) = call(
        http,
        "POST",
        "/api/definitions",
        GUEST,
        Some(&json!({"vhosts": [{"name": "lv", "limits": {"max-queues": 3}}]})),
    );
    assert_eq!(code, 400, "{text}");
    assert!(text.contains("limits"), "{text}");
    assert_eq!(get(http, "/api/vhosts/lv", GUEST).0, 404);
    let (code, _, text) = call(
        http,
        "POST",
        "/api/definitions",
        GUEST,
        Some(
            &json!({"users": [{"name": "lu", "password": "lu-secret", "tags": "", "limits": {"max-connections": 1}}]}),
        ),
    );
    // user limits are imported (`/api/user-limits`)
    assert_eq!(code, 204, "{text}");
    let (code, limits) = get(http, "/api/user-limits/lu", GUEST);
    assert_eq!(code, 200, "{limits}");
    assert!(limits.to_string().contains("max-connections"), "{limits}");
    // empty limits, as every RabbitMQ export has them, are fine
    assert_eq!(
        status(
            http,
            "POST",
            "/api/definitions",
            json!({"vhosts": [{"name": "lv", "limits": []}]})
        ),
        204
    );

    // a policy body must name the URL's policy and vhost
    let body = |name: &str, vhost: &str| json!({"name": name, "vhost": vhost, "pattern": "^x", "definition": {"max-length": 5}});
    let (code, _, text) = call(
        http,
        "PUT",
        "/api/policies/%2F/pc",
        GUEST,
        Some(&body("other", "/")),
    );
    assert_eq!(code, 400, "{text}");
    assert!(text.contains("name"), "{text}");
    assert_eq!(
        status(http, "PUT", "/api/policies/%2F/pc", body("pc", "lv")),
        400
    );
    assert_eq!(get(http, "/api/policies/%2F/pc", GUEST).0, 404);
    assert_eq!(
        status(http, "PUT", "/api/policies/%2F/pc", body("pc", "/")),
        201
    );
}

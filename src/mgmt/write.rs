//! PUT, POST and DELETE handlers: declare and delete queues, exchanges and bindings;
//! purge; publish; get; close connections; users, vhosts, permissions; definitions.
//! Each change is checked against the user's permissions in the vhost, as the
//! protocols' declares are, and answered once it is on disk.

use bytes::Bytes;
use serde_json::{json, Value};
use triad_core::auth::{PermissionEntry, TopicPermissionEntry};
use triad_core::{
    ExchangeDef, ExchangeKind, FieldTable, PasswordHash, Publish, QueueDeclare, UserConfig,
};

use super::json::{
    boolean, json_properties, json_table, payload, properties_json, string, tags, uint,
};
use super::read::{binding_between, check_ends, properties_key, vhost_bindings};
use super::{no_content, ok_json, Api, ApiError, ApiResult};

/// The management API's connection id for exclusive-queue checks: no client
/// connection has it (theirs start at 1), so an exclusive queue is locked to it.
const API_CONN: triad_core::ConnectionId = 0;

/// Most messages one `POST .../get` takes (each is held until the answer is built).
const MAX_GET: u64 = 10_000;
/// Payload bytes one `POST /api/queues/{vhost}/{name}/get` answers with (after
/// `truncate`): no further message is taken once the ones taken reach it, so a request
/// holds at most this plus one message (`limits.max_message_size`), whatever its
/// `count`. The answer then has fewer than `count` messages, as when the queue runs
/// out; `truncate` shows more messages per request.
pub const MAX_GET_BYTES: usize = 16 << 20;

/// RabbitMQ's accepted password hashing algorithm names for what Triad stores.
pub const SHA256: &str = "rabbit_password_hashing_sha256";

fn bad(e: String) -> ApiError {
    ApiError::bad_request(e)
}

fn table_field(body: &Value, key: &str) -> Result<FieldTable, ApiError> {
    json_table(body.get(key).unwrap_or(&Value::Null)).map_err(|e| bad(format!("{key}: {e}")))
}

fn flag(body: &Value, key: &str, default: bool) -> Result<bool, ApiError> {
    boolean(body.get(key), default).map_err(|e| bad(format!("{key}: {e}")))
}

/// Declares a queue (`PUT /api/queues/{vhost}/{name}`).
pub fn declare_queue(api: &Api, vhost: &str, name: &str, body: &Value) -> ApiResult {
    let (vh, access) = api.vhost_write(vhost)?;
    if name.is_empty() {
        return Err(bad("queue name must not be empty".into()));
    }
    let existed = vh.queue(name).is_some();
    let d = QueueDeclare {
        name: name.to_owned(),
        passive: false,
        durable: flag(body, "durable", false)?,
        exclusive: false,
        auto_delete: flag(body, "auto_delete", false)?,
        arguments: table_field(body, "arguments")?,
        conn: API_CONN,
        access: Some(access),
    };
    vh.declare_queue(d)?;
    no_content(!existed)
}

/// Declares an exchange (`PUT /api/exchanges/{vhost}/{name}`).
pub fn declare_exchange(api: &Api, vhost: &str, name: &str, body: &Value) -> ApiResult {
    let (vh, access) = api.vhost_write(vhost)?;
    if name.is_empty() || name == "amq.default" {
        return Err(ApiError::not_authorised(
            "the default exchange cannot be declared",
        ));
    }
    let kind: ExchangeKind = string(body, "type")
        .map_err(bad)?
        .ok_or_else(|| bad("exchange type is required".into()))?
        .parse()?;
    let arguments = table_field(body, "arguments")?;
    access.exchange_declare(name, &arguments)?;
    if name.starts_with("amq.") && !vh.has_exchange(name) {
        return Err(ApiError::not_authorised(format!(
            "exchange name '{name}' contains reserved prefix 'amq.*'"
        )));
    }
    let existed = vh.has_exchange(name);
    let mut def = ExchangeDef::new(name, kind);
    def.durable = flag(body, "durable", true)?;
    def.auto_delete = flag(body, "auto_delete", false)?;
    def.internal = flag(body, "internal", false)?;
    def.arguments = arguments;
    vh.declare_exchange(def, false)?;
    no_content(!existed)
}

fn delete_queue(api: &Api, vhost: &str, name: &str) -> ApiResult {
    let (vh, access) = api.vhost_write(vhost)?;
    if vh.queue(name).is_none() {
        return Err(ApiError::not_found());
    }
    access.queue_delete(name)?;
    let if_unused = api.param("if-unused") == Some("true");
    let if_empty = api.param("if-empty") == Some("true");
    vh.delete_queue(name, if_unused, if_empty, API_CONN)?;
    no_content(false)
}

fn delete_exchange(api: &Api, vhost: &str, name: &str) -> ApiResult {
    let (vh, access) = api.vhost_write(vhost)?;
    if name.is_empty() || name == "amq.default" || !vh.has_exchange(name) {
        return Err(ApiError::not_found());
    }
    if name.starts_with("amq.") {
        return Err(ApiError::not_authorised(format!(
            "deletion of system exchange '{name}' is not allowed"
        )));
    }
    access.exchange_delete(name)?;
    vh.delete_exchange(name, api.param("if-unused") == Some("true"))?;
    no_content(false)
}

fn purge(api: &Api, vhost: &str, name: &str) -> ApiResult {
    let (vh, access) = api.vhost_write(vhost)?;
    if vh.queue(name).is_none() {
        return Err(ApiError::not_found());
    }
    access.consume(name)?;
    vh.purge_queue(name, API_CONN)?;
    no_content(false)
}

/// `POST /api/bindings/{vhost}/e/{source}/{q|e}/{destination}`: 201 with the new
/// binding's `Location`.
fn bind(api: &Api, vhost: &str, src: &str, kind: &str, dst: &str, body: &Value) -> ApiResult {
    let (vh, access) = api.vhost_write(vhost)?;
    check_ends(&vh, src, kind, dst)?;
    if src.is_empty() || src == "amq.default" {
        return Err(ApiError::not_authorised(
            "operation not permitted on the default exchange",
        ));
    }
    let key = string(body, "routing_key").map_err(bad)?.unwrap_or("");
    let args = table_field(body, "arguments")?;
    if kind == "q" {
        access.queue_bind_key(&vh, dst, src, key)?;
        vh.bind_queue(dst, src, key, &args, API_CONN)?;
    } else {
        access.exchange_bind_key(&vh, dst, src, key)?;
        vh.bind_exchange(dst, src, key, &args)?;
    }
    let b = triad_core::routing::Binding {
        source: src.to_owned(),
        destination: if kind == "q" {
            triad_core::Destination::queue(dst)
        } else {
            triad_core::Destination::exchange(dst)
        },
        routing_key: key.to_owned(),
        arguments: args,
    };
    let enc = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    let mut r = crate::http::json_response(hyper::StatusCode::CREATED, Bytes::new());
    let location = format!(
        "/api/bindings/{}/e/{}/{kind}/{}/{}",
        enc(vhost),
        enc(src),
        enc(dst),
        enc(&properties_key(&b))
    );
    if let Ok(v) = hyper::header::HeaderValue::from_str(&location) {
        r.headers_mut().insert(hyper::header::LOCATION, v);
    }
    Ok(r)
}

fn unbind(api: &Api, vhost: &str, src: &str, kind: &str, dst: &str, props: &str) -> ApiResult {
    let (vh, access) = api.vhost_write(vhost)?;
    let b = vhost_bindings(&vh)
        .into_iter()
        .find(|b| binding_between(b, src, kind, dst) && properties_key(b) == props)
        .ok_or_else(ApiError::not_found)?;
    if b.source.is_empty() {
        return Err(ApiError::not_authorised(
            "operation not permitted on the default exchange",
        ));
    }
    if kind == "q" {
        access.queue_bind_key(&vh, dst, src, &b.routing_key)?;
        vh.unbind_queue(dst, src, &b.routing_key, &b.arguments, API_CONN)?;
    } else {
        access.exchange_bind_key(&vh, dst, src, &b.routing_key)?;
        vh.unbind_exchange(dst, src, &b.routing_key, &b.arguments)?;
    }
    no_content(false)
}

/// `POST /api/exchanges/{vhost}/{name}/publish`: `{"routed": bool}` once the message
/// is where a publisher confirm would have waited for (on disk when persistent).
fn publish(api: &Api, vhost: &str, exchange: &str, body: &Value) -> ApiResult {
    let (vh, access) = api.vhost_write(vhost)?;
    let exchange = if exchange == "amq.default" {
        ""
    } else {
        exchange
    };
    // amq.triad.txn is not an exchange but takes x-txn commits and rollbacks
    let txn_exchange = exchange == triad_core::txn::TXN_EXCHANGE;
    if !txn_exchange && !vh.has_exchange(exchange) {
        return Err(ApiError::not_found());
    }
    let key = string(body, "routing_key")
        .map_err(bad)?
        .ok_or_else(|| bad("routing_key is required".into()))?;
    let properties =
        json_properties(body.get("properties").unwrap_or(&Value::Null)).map_err(bad)?;
    if properties
        .user_id
        .as_deref()
        .is_some_and(|u| u != api.user.name)
    {
        return Err(bad(format!(
            "user_id property set to '{}' but authenticated user was '{}'",
            properties.user_id.as_deref().unwrap_or(""),
            api.user.name
        )));
    }
    let text = string(body, "payload")
        .map_err(bad)?
        .ok_or_else(|| bad("payload is required".into()))?;
    let payload = match string(body, "payload_encoding")
        .map_err(bad)?
        .unwrap_or("string")
    {
        "string" => Bytes::copy_from_slice(text.as_bytes()),
        "base64" => {
            use base64::Engine;
            Bytes::from(
                base64::engine::general_purpose::STANDARD
                    .decode(text.trim())
                    .map_err(|_| bad("payload is not valid base64".into()))?,
            )
        }
        other => {
            return Err(bad(format!(
                "payload_encoding must be string or base64, not '{other}'"
            )))
        }
    };
    if !txn_exchange {
        access.publish_to(&vh, exchange, key)?;
    }
    // as a connection's publish: x-txn half / commit / rollback go to the half messages
    let published = triad_core::txn::publish(
        &vh,
        &access,
        Publish {
            exchange: exchange.to_owned(),
            routing_key: key.to_owned(),
            mandatory: false,
            properties,
            body: payload,
            conn: API_CONN,
        },
    )?;
    if let Some(d) = published.durable {
        d.wait().map_err(ApiError::from)?;
    }
    ok_json(&json!({"routed": published.routed && !published.rejected}))
}

/// `POST /api/queues/{vhost}/{name}/get`.
fn get_messages(api: &Api, vhost: &str, name: &str, body: &Value) -> ApiResult {
    let (vh, access) = api.vhost_write(vhost)?;
    if vh.queue(name).is_none() {
        return Err(ApiError::not_found());
    }
    access.consume(name)?;
    let count = body
        .get("count")
        .map_or(Some(1), uint)
        .ok_or_else(|| bad("count must be a number".into()))?;
    let requeue = match string(body, "ackmode").map_err(bad)? {
        Some("ack_requeue_true") | Some("reject_requeue_true") => true,
        Some("ack_requeue_false") | Some("reject_requeue_false") => false,
        Some(other) => return Err(bad(format!("unknown ackmode '{other}'"))),
        None => return Err(bad("ackmode is required".into())),
    };
    let force_base64 = match string(body, "encoding").map_err(bad)?.unwrap_or("auto") {
        "auto" => false,
        "base64" => true,
        other => {
            return Err(bad(format!(
                "encoding must be auto or base64, not '{other}'"
            )))
        }
    };
    let truncate = match body.get("truncate") {
        None | Some(Value::Null) => None,
        Some(v) => Some(uint(v).ok_or_else(|| bad("truncate must be a number".into()))?),
    };
    if count > MAX_GET {
        return Err(bad(format!("count must be at most {MAX_GET}")));
    }
    let shown_len =
        |len: usize| truncate.map_or(len, |n| len.min(usize::try_from(n).unwrap_or(usize::MAX)));
    let mut got = Vec::new();
    let mut shown_bytes = 0usize;
    for _ in 0..count {
        if shown_bytes >= MAX_GET_BYTES {
            break;
        }
        match vh.get(name, false, API_CONN)? {
            Some(d) => {
                shown_bytes = shown_bytes.saturating_add(shown_len(d.body.len()));
                got.push(d);
            }
            None => break,
        }
    }
    let out: Vec<Value> = got
        .iter()
        .map(|d| {
            let full = &d.body[..];
            let shown = full.get(..shown_len(full.len())).unwrap_or(full);
            let (text, enc) = payload(shown, force_base64);
            json!({
                "payload_bytes": d.body.len(),
                "redelivered": d.redelivered,
                "exchange": &*d.exchange,
                "routing_key": &*d.routing_key,
                "message_count": d.message_count,
                "properties": properties_json(&d.properties),
                "payload": text,
                "payload_encoding": enc,
            })
        })
        .collect();
    for d in &got {
        if requeue {
            d.queue.nack(&[d.offset], true);
        } else {
            d.queue.ack(&[d.offset]);
        }
    }
    ok_json(&json!(out))
}

fn put_user(api: &Api, name: &str, body: &Value) -> ApiResult {
    api.require_admin()?;
    let tags = tags(body.get("tags")).map_err(bad)?;
    let existed = api.broker().auth().user(name).is_some();
    let hash = match (
        string(body, "password").map_err(bad)?,
        string(body, "password_hash").map_err(bad)?,
    ) {
        (Some(p), _) => PasswordHash::new(p).map_err(|e| ApiError::bad_request(e.to_string()))?,
        (None, Some(h)) => {
            match string(body, "hashing_algorithm").map_err(bad)? {
                None | Some(SHA256) => {}
                Some(other) => {
                    return Err(bad(format!(
                        "hashing_algorithm '{other}' is not supported: Triad stores {SHA256} hashes"
                    )))
                }
            }
            if h.is_empty() {
                return Err(bad(
                    "an empty password_hash (a user who cannot log in with a password) is not supported".into(),
                ));
            }
            PasswordHash::parse(h).map_err(|e| bad(format!("password_hash: {e}")))?
        }
        // as RabbitMQ: without either, the user can no longer log in with a password
        // (a client certificate still works): the hash of a random secret nobody knows
        (None, None) => PasswordHash::new(&unusable_password()?)
            .map_err(|e| ApiError::bad_request(e.to_string()))?,
    };
    api.broker().auth().put_user(UserConfig {
        name: name.to_owned(),
        password_hash: hash,
        tags,
    })?;
    no_content(!existed)
}

/// 32 random bytes from the kernel, hex: a password no one can know.
fn unusable_password() -> Result<String, ApiError> {
    use std::io::Read;
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| ApiError {
            status: hyper::StatusCode::INTERNAL_SERVER_ERROR,
            error: "internal_error".into(),
            reason: format!("no randomness for a password hash: {e}"),
        })?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn delete_user(api: &Api, name: &str) -> Result<bool, ApiError> {
    let deleted = api.broker().auth().delete_user(name)?;
    if deleted {
        api.broker().clear_user_limits(name)?;
        let closed = api.broker().connections().close_user(name);
        tracing::info!(user = name, closed, by = %api.user.name, "user deleted through the management API");
    }
    Ok(deleted)
}

fn set_permission(api: &Api, vhost: &str, user: &str, body: &Value) -> ApiResult {
    api.require_admin()?;
    if !api.broker().has_vhost(vhost) {
        return Err(ApiError::not_found());
    }
    let field = |k: &str| -> Result<String, ApiError> {
        string(body, k)
            .map_err(bad)?
            .map(str::to_owned)
            .ok_or_else(|| bad(format!("{k} is required")))
    };
    let existed = api.broker().auth().access(user, vhost).is_some();
    api.broker().auth().set_permission(PermissionEntry {
        user: user.to_owned(),
        vhost: vhost.to_owned(),
        configure: field("configure")?,
        write: field("write")?,
        read: field("read")?,
    })?;
    no_content(!existed)
}

fn set_topic_permission(api: &Api, vhost: &str, user: &str, body: &Value) -> ApiResult {
    api.require_admin()?;
    if !api.broker().has_vhost(vhost) {
        return Err(ApiError::not_found());
    }
    let field = |k: &str| -> Result<String, ApiError> {
        string(body, k)
            .map_err(bad)?
            .map(str::to_owned)
            .ok_or_else(|| bad(format!("{k} is required")))
    };
    api.broker()
        .auth()
        .set_topic_permission(TopicPermissionEntry {
            user: user.to_owned(),
            vhost: vhost.to_owned(),
            exchange: field("exchange")?,
            write: field("write")?,
            read: field("read")?,
        })?;
    no_content(true)
}

/// Every PUT.
pub fn put(api: &Api, path: &[&str], body: &Value) -> ApiResult {
    match path {
        ["queues", v, q] => declare_queue(api, v, q, body),
        ["stream-offsets", v, q, c] => super::streams::reset(api, v, q, c, body),
        ["exchanges", v, x] => declare_exchange(api, v, x, body),
        ["vhosts", v] => {
            api.require_admin()?;
            if v.is_empty() {
                return Err(bad("vhost name must not be empty".into()));
            }
            let unsupported = |k: &str| match body.get(k) {
                None | Some(Value::Null) => false,
                Some(Value::String(s)) => !s.is_empty(),
                Some(Value::Array(a)) => !a.is_empty(),
                Some(Value::Bool(b)) => *b,
                Some(_) => true,
            };
            for k in ["description", "tags", "tracing", "default_queue_type"] {
                if unsupported(k) {
                    return Err(ApiError::not_implemented(format!(
                        "vhost {k} is not stored by Triad; leave it out"
                    )));
                }
            }
            let existed = api.broker().has_vhost(v);
            api.broker().add_vhost(v)?;
            if !existed {
                // as RabbitMQ: whoever creates a vhost gets full permissions in it
                api.broker().auth().set_permission(PermissionEntry {
                    user: api.user.name.clone(),
                    vhost: (*v).to_owned(),
                    configure: ".*".into(),
                    write: ".*".into(),
                    read: ".*".into(),
                })?;
            }
            no_content(!existed)
        }
        ["users", u] => put_user(api, u, body),
        ["permissions", v, u] => set_permission(api, v, u, body),
        ["topic-permissions", v, u] => set_topic_permission(api, v, u, body),
        ["policies", v, name] => super::policies::put(api, v, name, body),
        ["operator-policies", ..] => Err(ApiError::not_implemented(
            "operator policies are not implemented: use policies",
        )),
        ["user-limits", u, name] => super::user_limits::put(api, u, name, body),
        ["parameters", ..] | ["global-parameters", ..] | ["vhost-limits", ..] => Err(
            ApiError::not_implemented("runtime parameters and limits are not implemented"),
        ),
        _ => Err(ApiError::not_found()),
    }
}

/// Every DELETE.
pub fn delete(api: &Api, path: &[&str]) -> ApiResult {
    let auth = api.broker().auth();
    match path {
        ["queues", v, q] => delete_queue(api, v, q),
        ["queues", v, q, "contents"] => purge(api, v, q),
        ["exchanges", v, x] => delete_exchange(api, v, x),
        ["bindings", v, "e", src, kind @ ("q" | "e"), dst, props] => {
            unbind(api, v, src, kind, dst, props)
        }
        ["connections", name] => {
            let c = super::read::visible_connection(api, name)?;
            tracing::info!(connection = %name, by = %api.user.name, "closing connection through the management API");
            c.close();
            no_content(false)
        }
        ["vhosts", v] => {
            api.require_admin()?;
            if api.broker().delete_vhost(v)? {
                tracing::info!(vhost = v, by = %api.user.name, "vhost deleted through the management API");
                no_content(false)
            } else {
                Err(ApiError::not_found())
            }
        }
        ["users", u] => {
            api.require_admin()?;
            if delete_user(api, u)? {
                no_content(false)
            } else {
                Err(ApiError::not_found())
            }
        }
        ["permissions", v, u] => {
            api.require_admin()?;
            if auth.clear_permission(u, v)? {
                no_content(false)
            } else {
                Err(ApiError::not_found())
            }
        }
        ["topic-permissions", v, u] => {
            api.require_admin()?;
            if auth.clear_topic_permissions(u, v, None)? {
                no_content(false)
            } else {
                Err(ApiError::not_found())
            }
        }
        ["policies", v, name] => super::policies::delete(api, v, name),
        ["user-limits", u, name] => super::user_limits::delete(api, u, name),
        _ => Err(ApiError::not_found()),
    }
}

/// What a PUT or POST needs of its user that the path alone tells (a tag, access to
/// the vhost), checked before its body (up to `http.max_body_size`) is parsed, so that
/// a request that will be refused costs no parse. The handlers then check what the
/// body names (queue, exchange, routing key permissions) as before.
pub fn authorize(api: &Api, method: &hyper::Method, path: &[&str]) -> Result<(), ApiError> {
    use hyper::Method;
    match (method, path) {
        (&Method::PUT, ["queues", v, _] | ["exchanges", v, _])
        | (
            &Method::POST,
            ["bindings", v, "e", ..] | ["exchanges", v, _, "publish"] | ["queues", v, _, "get"],
        ) => api.vhost_write(v).map(drop),
        (
            &Method::PUT,
            ["vhosts", _]
            | ["users", _]
            | ["permissions", ..]
            | ["topic-permissions", ..]
            | ["user-limits", ..],
        )
        | (&Method::POST, ["users", "bulk-delete"] | ["definitions", ..]) => api.require_admin(),
        (&Method::PUT, ["policies", v, _]) => super::policies::authorize(api, v),
        _ => Ok(()),
    }
}

/// Every POST.
pub fn post(api: &Api, path: &[&str], body: &Value) -> ApiResult {
    match path {
        ["bindings", v, "e", src, kind @ ("q" | "e"), dst] => bind(api, v, src, kind, dst, body),
        ["exchanges", v, x, "publish"] => publish(api, v, x, body),
        ["queues", v, q, "get"] => get_messages(api, v, q, body),
        ["queues", _, _, "actions"] => Err(ApiError::not_implemented(
            "queue actions (mirror synchronisation) do not apply to Triad",
        )),
        ["users", "bulk-delete"] => {
            api.require_admin()?;
            let users = body
                .get("users")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("users must be a list of names".into()))?;
            for u in users {
                let name = u
                    .as_str()
                    .ok_or_else(|| bad("users must be a list of names".into()))?;
                delete_user(api, name)?;
            }
            no_content(false)
        }
        ["definitions"] => {
            api.require_admin()?;
            super::defs::import(api, None, body)?;
            no_content(false)
        }
        ["definitions", v] => {
            api.require_admin()?;
            api.vhost_read(v)?;
            super::defs::import(api, Some(v), body)?;
            no_content(false)
        }
        _ => Err(ApiError::not_found()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::listener::{test_ctx, Proto};
    use http_body_util::BodyExt;
    use hyper::{Method, StatusCode};
    use tokio_util::sync::CancellationToken;

    fn api(tags: &[&str]) -> Api {
        Api {
            ctx: test_ctx(Proto::Http, Config::default(), &CancellationToken::new()),
            user: triad_core::User {
                name: "guest".into(),
                tags: tags.iter().map(|t| t.to_string()).collect(),
            },
            peer: "127.0.0.1:1".parse().expect("addr"),
            params: Vec::new(),
        }
    }

    fn call(api: &Api, method: Method, path: &[&str], body: Value) -> (StatusCode, Value) {
        let bytes = Bytes::from(body.to_string());
        let r = match api.route(&method, path, &bytes) {
            Ok(r) => r,
            Err(e) => e.response(),
        };
        let status = r.status();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let body = rt
            .block_on(r.into_body().collect())
            .expect("body")
            .to_bytes();
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    #[test]
    fn declare_publish_get_and_delete_through_the_handlers() {
        let a = api(&["administrator"]);
        let q = ["queues", "/", "jobs"];
        assert_eq!(
            call(&a, Method::PUT, &q, json!({"durable": true})).0,
            StatusCode::CREATED
        );
        assert_eq!(
            call(&a, Method::PUT, &q, json!({"durable": true})).0,
            StatusCode::NO_CONTENT
        );
        let publish = ["exchanges", "/", "amq.default", "publish"];
        let (s, v) = call(
            &a,
            Method::POST,
            &publish,
            json!({"routing_key": "jobs", "payload": "aGk=", "payload_encoding": "base64", "properties": {"delivery_mode": 2}}),
        );
        assert_eq!((s, v), (StatusCode::OK, json!({"routed": true})));
        let (s, v) = call(
            &a,
            Method::POST,
            &["queues", "/", "jobs", "get"],
            json!({"count": 5, "ackmode": "ack_requeue_false", "encoding": "auto"}),
        );
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v[0]["payload"], "hi");
        assert_eq!(v.as_array().map(Vec::len), Some(1));
        let (s, _) = call(
            &a,
            Method::POST,
            &["queues", "/", "jobs", "get"],
            json!({"count": 1, "ackmode": "bogus"}),
        );
        assert_eq!(s, StatusCode::BAD_REQUEST);
        let (s, _) = call(
            &a,
            Method::POST,
            &publish,
            json!({"routing_key": "jobs", "payload": "x", "properties": {"colour": 1}}),
        );
        assert_eq!(s, StatusCode::BAD_REQUEST, "unknown properties are refused");
        assert_eq!(
            call(&a, Method::DELETE, &q, json!({})).0,
            StatusCode::NO_CONTENT
        );
        assert_eq!(
            call(&a, Method::DELETE, &q, json!({})).0,
            StatusCode::NOT_FOUND
        );
        // the broker's own queues are not reachable
        let (s, _) = call(
            &a,
            Method::GET,
            &["queues", "/", "amq.triad.mqtt.sessions"],
            json!({}),
        );
        assert_eq!(s, StatusCode::NOT_FOUND);
        let (s, _) = call(
            &a,
            Method::DELETE,
            &["queues", "/", "amq.triad.mqtt.sessions", "contents"],
            json!({}),
        );
        assert_eq!(s, StatusCode::UNAUTHORIZED);
    }

    #[test]
    fn tags_and_unimplemented_features_are_answered_not_ignored() {
        let m = api(&["management"]);
        let (s, v) = call(
            &m,
            Method::PUT,
            &["users", "x"],
            json!({"password": "p", "tags": ""}),
        );
        assert_eq!(
            (s, v["reason"].as_str()),
            (StatusCode::UNAUTHORIZED, Some("Not administrator user"))
        );
        assert_eq!(
            call(&m, Method::GET, &["nodes"], json!({})).0,
            StatusCode::UNAUTHORIZED
        );
        let a = api(&["administrator"]);
        let (s, v) = call(
            &a,
            Method::PUT,
            &["policies", "/", "p"],
            json!({"pattern": ".*", "definition": {}}),
        );
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert!(v["reason"]
            .as_str()
            .is_some_and(|r| r.contains("no policy provided")));
        assert_eq!(
            call(&a, Method::PUT, &["vhosts", "v"], json!({"tracing": true})).0,
            StatusCode::NOT_IMPLEMENTED
        );
        let (s, _) = call(
            &a,
            Method::PUT,
            &["users", "y"],
            json!({"password_hash": "abc", "hashing_algorithm": "rabbit_password_hashing_md5"}),
        );
        assert_eq!(s, StatusCode::BAD_REQUEST);
        // as RabbitMQ: a PUT without a password leaves the user unable to log in with one
        assert_eq!(
            call(
                &a,
                Method::PUT,
                &["users", "z"],
                json!({"password": "pw", "tags": ""})
            )
            .0,
            StatusCode::CREATED
        );
        assert_eq!(
            call(
                &a,
                Method::PUT,
                &["users", "z"],
                json!({"tags": "monitoring"})
            )
            .0,
            StatusCode::NO_CONTENT
        );
        let z = a.broker().auth().user("z").expect("z");
        assert!(!z.password_hash.verify("pw"));
        assert!(!z.password_hash.verify(""));
        assert_eq!(z.tags, ["monitoring"]);
    }
}

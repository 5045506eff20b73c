//! Per-user limits under `/api/user-limits`, in RabbitMQ's shapes (administrators only):
//! `GET /api/user-limits[/{user}]` lists `[{"user", "value": {"max-connections": n,
//! "max-channels": n}}]`; `PUT /api/user-limits/{user}/{name}` with `{"value": n}`
//! (negative = unlimited, 0 = none allowed) and `DELETE /api/user-limits/{user}/{name}`
//! set and clear one limit, persisted in the metadata journal
//! ([`triad_core::user_limits`]). A limit applies to connections and channels opened
//! after the change, as in RabbitMQ.

use serde_json::{json, Value};
use triad_core::user_limits::{from_wire, to_json, MAX_CHANNELS, MAX_CONNECTIONS};

use super::{no_content, ok_json, Api, ApiError, ApiResult};

/// `GET /api/user-limits[/{user}]`.
pub fn get(api: &Api, user: Option<&str>) -> ApiResult {
    api.require_admin()?;
    let items: Vec<Value> = api
        .broker()
        .user_limits()
        .iter()
        .filter(|(u, _)| user.is_none_or(|w| w == u))
        .map(|(u, l)| json!({"user": u, "value": Value::Object(to_json(l))}))
        .collect();
    ok_json(&json!(items))
}

fn limit_name(name: &str) -> Result<&str, ApiError> {
    match name {
        MAX_CONNECTIONS | MAX_CHANNELS => Ok(name),
        other => Err(ApiError::bad_request(format!(
            "unknown user limit '{other}': max-connections or max-channels"
        ))),
    }
}

/// `PUT /api/user-limits/{user}/{name}` with `{"value": n}`.
pub fn put(api: &Api, user: &str, name: &str, body: &Value) -> ApiResult {
    api.require_admin()?;
    let name = limit_name(name)?;
    if api.broker().auth().user(user).is_none() {
        // RabbitMQ: 400 no_such_user
        return Err(ApiError::bad_request(format!("no such user '{user}'")));
    }
    let n = match body.get("value") {
        Some(Value::Number(n)) => n.as_i64(),
        Some(Value::String(s)) => s.trim().parse().ok(),
        _ => None,
    }
    .ok_or_else(|| ApiError::bad_request("value is required (an integer)"))?;
    let v = from_wire(n).map_err(|e| ApiError::bad_request(e.to_string()))?;
    api.broker().set_user_limit(user, name, Some(v))?;
    tracing::info!(user, limit = name, value = n, by = %api.user.name, "user limit set through the management API");
    no_content(false)
}

/// `DELETE /api/user-limits/{user}/{name}`.
pub fn delete(api: &Api, user: &str, name: &str) -> ApiResult {
    api.require_admin()?;
    let name = limit_name(name)?;
    api.broker().set_user_limit(user, name, None)?;
    tracing::info!(user, limit = name, by = %api.user.name, "user limit cleared through the management API");
    no_content(false)
}

/// A user's limits as definitions export them (`"limits"` in each user entry, as
/// RabbitMQ's).
pub fn export(api: &Api) -> std::collections::HashMap<String, Value> {
    api.broker()
        .user_limits()
        .into_iter()
        .map(|(u, l)| (u, Value::Object(to_json(&l))))
        .collect()
}

/// The `"limits"` of a definitions file's user entry, checked: what to set.
pub fn parse(user: &str, limits: Option<&Value>) -> Result<Vec<(&'static str, u32)>, ApiError> {
    let bad = |m: String| ApiError::bad_request(format!("user '{user}': limits: {m}"));
    let obj = match limits {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(o)) => o,
        // RabbitMQ exports an empty list where a user has none
        Some(Value::Array(a)) if a.is_empty() => return Ok(Vec::new()),
        Some(other) => return Err(bad(format!("{other} is not an object"))),
    };
    let mut out = Vec::new();
    for (k, v) in obj {
        let name = match k.as_str() {
            MAX_CONNECTIONS => MAX_CONNECTIONS,
            MAX_CHANNELS => MAX_CHANNELS,
            other => return Err(bad(format!("unknown limit '{other}'"))),
        };
        let n = v
            .as_i64()
            .ok_or_else(|| bad(format!("{k}: {v} is not an integer")))?;
        out.push((name, from_wire(n).map_err(|e| bad(e.to_string()))?));
    }
    Ok(out)
}

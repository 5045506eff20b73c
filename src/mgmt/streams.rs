//! Stored stream consumer offsets ([`triad_core::stream`]):
//!
//! - `GET /api/stream-offsets/{vhost}/{queue}`: the stream's retained range and every
//!   stored consumer name with its offset (the next offset that consumer reads):
//!   `{"first": 0, "next": 120, "consumers": [{"name": "app", "offset": 42}]}`.
//! - `PUT /api/stream-offsets/{vhost}/{queue}/{consumer}` with `{"offset": n}` or
//!   `{"timestamp": ms}`: sets that consumer's stored offset (to `n`, or to the first
//!   entry stored at or after the time, clamped to the retained range), durable before
//!   the answer (`200 {"offset": n}`). A consumer of that name that starts later without
//!   an explicit `x-stream-offset` begins there; one reading now keeps its position
//!   (its next ack commits over the reset).
//!
//! Both need the user's read permission on the queue (what consuming it needs); a
//! queue that is not a stream is a 400.

use serde_json::{json, Value};
use triad_core::stream::OffsetReset;

use super::{ok_json, Api, ApiError, ApiResult};

fn stream_queue(
    api: &Api,
    vhost: &str,
    queue: &str,
) -> Result<std::sync::Arc<triad_core::Queue>, ApiError> {
    let (vh, access) = api.vhost_write(vhost)?;
    access.consume(queue)?;
    let q = vh.queue(queue).ok_or_else(ApiError::not_found)?;
    if !q.is_stream() {
        return Err(ApiError::bad_request(format!(
            "queue '{queue}' in vhost '{vhost}' is not a stream queue"
        )));
    }
    Ok(q)
}

/// `GET /api/stream-offsets/{vhost}/{queue}`.
pub fn list(api: &Api, vhost: &str, queue: &str) -> ApiResult {
    let q = stream_queue(api, vhost, queue)?;
    let Some(s) = q.stream() else {
        return Err(ApiError::not_found());
    };
    let (first, next) = s.range();
    let consumers: Vec<Value> = s
        .stored_offsets()
        .into_iter()
        .map(|(name, offset)| json!({"name": name, "offset": offset}))
        .collect();
    ok_json(&json!({"first": first, "next": next, "consumers": consumers}))
}

/// `PUT /api/stream-offsets/{vhost}/{queue}/{consumer}`.
pub fn reset(api: &Api, vhost: &str, queue: &str, consumer: &str, body: &Value) -> ApiResult {
    let q = stream_queue(api, vhost, queue)?;
    let num = |k: &str| -> Result<Option<u64>, ApiError> {
        match body.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                ApiError::bad_request(format!("'{k}' must be a non-negative integer"))
            }),
        }
    };
    if let Some(obj) = body.as_object() {
        if let Some(k) = obj.keys().find(|k| *k != "offset" && *k != "timestamp") {
            return Err(ApiError::bad_request(format!(
                "unknown field '{k}': give either 'offset' or 'timestamp' (ms)"
            )));
        }
    }
    let to = match (num("offset")?, num("timestamp")?) {
        (Some(o), None) => OffsetReset::Offset(o),
        (None, Some(t)) => OffsetReset::Timestamp(t),
        _ => {
            return Err(ApiError::bad_request(
                "give exactly one of 'offset' or 'timestamp' (ms since the epoch)",
            ))
        }
    };
    let Some(s) = q.stream() else {
        return Err(ApiError::not_found());
    };
    let (offset, done) = s.reset_offset(consumer, to)?;
    done.wait()?;
    ok_json(&json!({"offset": offset}))
}

//! Message queries from the store, as RocketMQ's `mqadmin queryMsgById` /
//! `queryMsgByKey` / `queryMsgByOffset` (and a time-range query):
//!
//! | request | answer |
//! |---|---|
//! | `GET /api/messages/by-id/{message-id}` | messages whose `message-id` property is that id, newest first, through the store's IndexFile (administrators only: it spans vhosts) |
//! | `GET /api/messages/by-topic/{vhost}?topic=T&from=MS&to=MS` | MQTT publishes to topic `T` (a topic name, no wildcards) in that vhost stored in that time range (ms since the epoch, both optional), newest first, through the IndexFile (administrators only, as by-id; needs `mqtt.index_topics`, else 400) |
//! | `GET /api/messages/{vhost}/{queue}/offset/{n}` | the queue's entries from offset `n` on |
//! | `GET /api/messages/{vhost}/{queue}/time?from=MS&to=MS` | the queue's entries stored in that time range (ms since the epoch), found by binary search over the consume queue |
//!
//! Query parameters: `count` (at most [`MAX_COUNT`], default 10), `truncate` (body bytes
//! shown, default [`DEFAULT_TRUNCATE`]), `body=full` (the whole body; then `count` at most
//! [`MAX_FULL`]), `encoding=base64`. Each message: commit offset, store and born time,
//! body size, exchange, routing key, properties, the body (shown truncated unless asked
//! for) and every queue it was stored for, with whether that queue still holds it.
//!
//! The queue queries need the `read` permission on the queue (as a get does) or the
//! `administrator` tag. Reading a message here changes nothing (no delivery, no ack).

use serde_json::{json, Value};
use triad_store::commitlog::StoredRecord;

use super::json::{payload, properties_json};
use super::{ok_json, Api, ApiError, ApiResult};

/// Most messages one query answers.
pub const MAX_COUNT: u64 = 100;
/// Most messages one query answers with whole bodies.
pub const MAX_FULL: u64 = 10;
/// Body bytes shown unless `truncate` or `body=full` says otherwise.
pub const DEFAULT_TRUNCATE: u64 = 1024;

struct Shape {
    count: u64,
    truncate: Option<u64>,
    base64: bool,
}

fn shape(api: &Api) -> Result<Shape, ApiError> {
    let num = |k: &str| -> Result<Option<u64>, ApiError> {
        api.param(k)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| ApiError::bad_request(format!("{k} must be a number")))
            })
            .transpose()
    };
    let full = match api.param("body") {
        None => false,
        Some("full") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "body must be 'full', not '{other}'"
            )))
        }
    };
    let count = num("count")?.unwrap_or(10);
    let limit = if full { MAX_FULL } else { MAX_COUNT };
    if count == 0 || count > limit {
        return Err(ApiError::bad_request(format!(
            "count must be 1 to {limit}{}",
            if full { " with body=full" } else { "" }
        )));
    }
    let truncate = num("truncate")?;
    if full && truncate.is_some() {
        return Err(ApiError::bad_request(
            "body=full and truncate exclude each other",
        ));
    }
    let base64 = match api.param("encoding") {
        None | Some("auto") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "encoding must be auto or base64, not '{other}'"
            )))
        }
    };
    Ok(Shape {
        count,
        truncate: if full {
            None
        } else {
            Some(truncate.unwrap_or(DEFAULT_TRUNCATE))
        },
        base64,
    })
}

fn message_json(api: &Api, r: &StoredRecord, sh: &Shape) -> Value {
    let store = api.broker().store();
    let (exchange, routing_key, props) = match triad_core::envelope::decode(&r.properties) {
        Ok((x, k, p)) => (x, k, properties_json(&p)),
        Err(_) => (String::new(), String::new(), Value::Null),
    };
    let full = &r.body[..];
    let shown_len = sh.truncate.map_or(full.len(), |t| {
        usize::try_from(t).unwrap_or(usize::MAX).min(full.len())
    });
    let (text, enc) = payload(full.get(..shown_len).unwrap_or(full), sh.base64);
    let queues: Vec<Value> = r
        .queues()
        .into_iter()
        .map(|(id, off)| match store.queue_info(id) {
            Ok(q) => {
                let held = off >= q.min_offset
                    && off < q.next_offset
                    && !store.is_acked(id, off).unwrap_or(true);
                json!({"vhost": q.vhost, "name": q.name, "offset": off, "held": held})
            }
            Err(_) => json!({"vhost": null, "name": null, "offset": off, "held": false}),
        })
        .collect();
    json!({
        "commit_offset": r.commit_offset,
        "store_time": r.store_ts_ms,
        "born_time": r.born_ts_ms,
        "payload_bytes": r.body.len(),
        "payload": text,
        "payload_encoding": enc,
        "payload_truncated": shown_len < full.len(),
        "exchange": exchange,
        "routing_key": routing_key,
        "properties": props,
        "queues": queues,
    })
}

/// The store queue behind `vhost`/`queue`, checked for the user's read permission.
fn queue_id(api: &Api, vhost: &str, queue: &str) -> Result<triad_store::store::QueueId, ApiError> {
    if !api.is_admin() {
        let (_, access) = api.vhost_write(vhost)?;
        access.consume(queue)?;
    } else {
        api.vhost_read(vhost)?;
    }
    api.broker()
        .store()
        .find_queue(vhost, queue)
        .ok_or_else(ApiError::not_found)
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError {
        status: hyper::StatusCode::INTERNAL_SERVER_ERROR,
        error: "internal_error".into(),
        reason: format!("the store could not be read: {e}"),
    }
}

/// The `from` and `to` parameters (ms since the epoch), `0` and `u64::MAX` when absent.
fn time_range(api: &Api) -> Result<(u64, u64), ApiError> {
    let ms = |k: &str| -> Result<Option<u64>, ApiError> {
        api.param(k)
            .map(|v| {
                v.parse::<u64>().map_err(|_| {
                    ApiError::bad_request(format!("{k} must be milliseconds since the epoch"))
                })
            })
            .transpose()
    };
    let from = ms("from")?.unwrap_or(0);
    let to = ms("to")?.unwrap_or(u64::MAX);
    if from > to {
        return Err(ApiError::bad_request("from is after to"));
    }
    Ok((from, to))
}

/// The GETs under `/api/messages`.
pub fn get(api: &Api, path: &[&str]) -> ApiResult {
    let sh = shape(api)?;
    let store = api.broker().store();
    match path {
        ["by-id", id] => {
            api.require_admin()?;
            if id.is_empty() || id.len() > 1024 {
                return Err(ApiError::bad_request("message-id must be 1 to 1024 bytes"));
            }
            let found = store
                .lookup_key(id.as_bytes(), usize::try_from(sh.count).unwrap_or(10))
                .map_err(internal)?;
            ok_json(&json!(found
                .iter()
                .map(|r| message_json(api, r, &sh))
                .collect::<Vec<_>>()))
        }
        ["by-topic", vhost] => by_topic(api, vhost, &sh),
        [vhost, queue, "offset", n] => {
            let id = queue_id(api, vhost, queue)?;
            let from: u64 = n
                .parse()
                .map_err(|_| ApiError::bad_request("offset must be a number"))?;
            let from = from.max(store.queue_info(id).map_err(internal)?.min_offset);
            let mut out = Vec::new();
            for off in from..from.saturating_add(sh.count) {
                match store.read_queue(id, off) {
                    Ok(Some((_, r))) => out.push(message_json(api, &r, &sh)),
                    // below the queue's first kept entry, or a record gone: skip it
                    Ok(None) => break,
                    Err(_) => continue,
                }
            }
            ok_json(&json!(out))
        }
        [vhost, queue, "time"] => by_time(api, vhost, queue, &sh),
        _ => Err(ApiError::not_found()),
    }
}

/// `by-topic/{vhost}?topic=`: an MQTT topic's publishes (with `mqtt.index_topics`).
fn by_topic(api: &Api, vhost: &str, sh: &Shape) -> ApiResult {
    let store = api.broker().store();
    api.require_admin()?;
    api.vhost_read(vhost)?;
    if !api.ctx.config.mqtt.index_topics {
        return Err(ApiError::bad_request(
            "MQTT publishes are not indexed by topic: set mqtt.index_topics = true",
        ));
    }
    let topic = api
        .param("topic")
        .ok_or_else(|| ApiError::bad_request("topic is required"))?;
    if topic.is_empty() || topic.len() > 255 {
        return Err(ApiError::bad_request("topic must be 1 to 255 bytes"));
    }
    if topic.contains(['+', '#']) {
        return Err(ApiError::bad_request(
            "topic must be a topic name, not a filter (no + or #)",
        ));
    }
    let (from, to) = time_range(api)?;
    let key = triad_core::vhost::topic_key(vhost, &triad_mqtt::topic::topic_to_routing_key(topic));
    let found = store
        .lookup_key_between(&key, usize::try_from(sh.count).unwrap_or(10), from, to)
        .map_err(internal)?;
    ok_json(&json!(found
        .iter()
        .map(|r| message_json(api, r, sh))
        .collect::<Vec<_>>()))
}

/// `{vhost}/{queue}/time?from=&to=`: a queue's entries stored in a time range.
fn by_time(api: &Api, vhost: &str, queue: &str, sh: &Shape) -> ApiResult {
    let store = api.broker().store();
    let id = queue_id(api, vhost, queue)?;
    let (from, to) = time_range(api)?;
    let info = store.queue_info(id).map_err(internal)?;
    let ts = |off: u64| -> Option<u64> {
        store
            .read_queue(id, off)
            .ok()
            .flatten()
            .map(|(_, r)| r.store_ts_ms)
    };
    // first entry stored at or after `from` (store times rise with the offset);
    // an unreadable entry counts as earlier
    let (mut lo, mut hi) = (info.min_offset, info.next_offset);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if ts(mid).is_none_or(|t| t < from) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let mut out = Vec::new();
    let mut off = lo;
    while off < info.next_offset && (out.len() as u64) < sh.count {
        if let Ok(Some((_, r))) = store.read_queue(id, off) {
            if r.store_ts_ms > to {
                break;
            }
            out.push(message_json(api, &r, sh));
        }
        off += 1;
    }
    ok_json(&json!(out))
}

//! The adapter's translation tables: STOMP headers ⇄ core [`Properties`], and core
//! errors → ERROR frame texts.
//!
//! | STOMP header | core property |
//! |---|---|
//! | `content-type` | `content_type` |
//! | `content-encoding` | `content_encoding` |
//! | `persistent:true` | `delivery_mode = 2` |
//! | `priority` | `priority` (0-255) |
//! | `reply-to` | `reply_to` (on MESSAGE, a value that is no destination, such as an AMQP queue or direct reply-to name, as `/reply-queue/<value>`: RabbitMQ's STOMP plugin's rule, so the header is a destination to SEND the reply to) |
//! | `correlation-id` | `correlation_id` |
//! | `expiration` | `expiration` (ms, decimal) |
//! | `message-id` on SEND / `amqp-message-id` on MESSAGE | `message_id` |
//! | `type` | `message_type` |
//! | `user-id` | `user_id` (must be the logged-in user) |
//! | `app-id` | `app_id` |
//! | `timestamp` | `timestamp` (seconds) |
//! | any other header | `headers` entry (long string) |
//!
//! Frame-level headers (`destination`, `receipt`, `transaction`, `content-length`) and
//! SUBSCRIBE options are not copied.

use std::fmt::Write;

use triad_core::{CoreError, Delivery, FieldTable, FieldValue, Properties};

use crate::destination::Destination;
use crate::frame::{Command, Frame};

/// Headers that steer the frame itself and are never stored with a message.
const FRAME_HEADERS: &[&str] = &[
    "destination",
    "receipt",
    "transaction",
    "content-length",
    "persistent",
];

/// A header the adapter refuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadHeader {
    /// Which header.
    pub name: &'static str,
    /// Why.
    pub reason: String,
}

fn number<T: std::str::FromStr>(frame: &Frame, name: &'static str) -> Result<Option<T>, BadHeader> {
    match frame.header(name) {
        None => Ok(None),
        Some(v) => v.trim().parse::<T>().map(Some).map_err(|_| BadHeader {
            name,
            reason: format!("'{v}' is not a valid {name}"),
        }),
    }
}

/// Reads boolean header `name`: `true` / `false` in any case (stomp.py writes Python's
/// `True` / `False`, which RabbitMQ takes), `None` when absent. Any other value is
/// refused, naming the header, rather than read as the default: `durable:yes` must not
/// quietly make a non-durable subscription. The one parser for every boolean header the
/// adapter reads (`durable`, `persistent`, `auto-delete`, `exclusive`, `requeue`).
pub fn bool_header(frame: &Frame, name: &'static str) -> Result<Option<bool>, BadHeader> {
    match frame.header(name) {
        None => Ok(None),
        Some(v) if v.eq_ignore_ascii_case("true") => Ok(Some(true)),
        Some(v) if v.eq_ignore_ascii_case("false") => Ok(Some(false)),
        Some(v) => Err(BadHeader {
            name,
            reason: format!("'{v}' is not a boolean: {name} must be true or false (in any case)"),
        }),
    }
}

/// Builds the properties of a SEND frame. `user` is the logged-in user (a `user-id`
/// header must match it, as in RabbitMQ).
pub fn properties_from_send(frame: &Frame, user: &str) -> Result<Properties, BadHeader> {
    let owned = |n: &str| frame.header(n).map(str::to_string);
    let mut p = Properties {
        content_type: owned("content-type"),
        content_encoding: owned("content-encoding"),
        reply_to: owned("reply-to"),
        correlation_id: owned("correlation-id"),
        message_id: owned("message-id").or_else(|| owned("amqp-message-id")),
        message_type: owned("type"),
        user_id: owned("user-id"),
        app_id: owned("app-id"),
        priority: number::<u8>(frame, "priority")?,
        timestamp: number::<u64>(frame, "timestamp")?,
        ..Properties::default()
    };
    if let Some(e) = frame.header("expiration") {
        if e.is_empty() || !e.bytes().all(|b| b.is_ascii_digit()) {
            return Err(BadHeader {
                name: "expiration",
                reason: format!("'{e}' is not a non-negative number of milliseconds"),
            });
        }
        p.expiration = Some(e.to_string());
    }
    if bool_header(frame, "persistent")? == Some(true) {
        p.delivery_mode = Some(2);
    }
    if let Some(u) = &p.user_id {
        if u != user {
            return Err(BadHeader {
                name: "user-id",
                reason: format!("user-id '{u}' is not the logged-in user '{user}'"),
            });
        }
    }
    let mut headers = FieldTable::new();
    for (n, v) in &frame.headers {
        if FRAME_HEADERS.contains(&n.as_str()) || is_property(n) || headers.contains(n) {
            continue;
        }
        headers.push(n.clone(), FieldValue::from(v.as_str()));
    }
    if !headers.is_empty() {
        p.headers = Some(headers);
    }
    Ok(p)
}

fn is_property(n: &str) -> bool {
    matches!(
        n,
        "content-type"
            | "content-encoding"
            | "reply-to"
            | "correlation-id"
            | "message-id"
            | "amqp-message-id"
            | "type"
            | "user-id"
            | "app-id"
            | "priority"
            | "timestamp"
            | "expiration"
    )
}

/// A header table value as STOMP text; `None` for values STOMP cannot carry (tables,
/// arrays, byte arrays, void).
fn value_text(v: &FieldValue) -> Option<String> {
    Some(match v {
        FieldValue::Bool(b) => b.to_string(),
        FieldValue::ShortString(_) | FieldValue::LongString(_) => v.as_str()?.to_string(),
        FieldValue::F32(f) => f.to_string(),
        FieldValue::F64(f) => f.to_string(),
        FieldValue::Timestamp(t) => t.to_string(),
        FieldValue::Decimal(d) => {
            let mut s = d.value.to_string();
            let scale = usize::from(d.scale);
            if scale > 0 {
                while s.len() <= scale {
                    s.insert(0, '0');
                }
                s.insert(s.len() - scale, '.');
            }
            s
        }
        other => other.as_i64()?.to_string(),
    })
}

/// What a MESSAGE frame needs beyond the delivery.
#[derive(Debug, Clone)]
pub struct MessageMeta<'a> {
    /// The subscription id.
    pub subscription: &'a str,
    /// Unique per delivery on this connection; the ack handle.
    pub message_id: &'a str,
    /// Add the 1.2 `ack` header (client ack modes).
    pub ack_header: bool,
    /// Overrides the reconstructed destination (temp-queue replies).
    pub destination: Option<&'a str>,
}

/// Builds the MESSAGE frame for a delivery.
pub fn message_frame(d: &Delivery, meta: &MessageMeta<'_>) -> Frame {
    let mut f = Frame::new(Command::Message);
    f.push("subscription", meta.subscription);
    f.push(
        "destination",
        meta.destination
            .map(str::to_string)
            .unwrap_or_else(|| Destination::for_delivery(&d.exchange, &d.routing_key)),
    );
    f.push("message-id", meta.message_id);
    if meta.ack_header {
        f.push("ack", meta.message_id);
    }
    f.push("redelivered", if d.redelivered { "true" } else { "false" });
    let p = &d.properties;
    match p.reply_to.as_deref() {
        Some(r) if !r.starts_with('/') => f.push("reply-to", format!("/reply-queue/{r}")),
        Some(r) => f.push("reply-to", r),
        None => {}
    }
    let mut opt = |name: &str, v: &Option<String>| {
        if let Some(v) = v {
            f.push(name, v.as_str());
        }
    };
    opt("content-type", &p.content_type);
    opt("content-encoding", &p.content_encoding);
    opt("correlation-id", &p.correlation_id);
    opt("expiration", &p.expiration);
    opt("amqp-message-id", &p.message_id);
    opt("type", &p.message_type);
    opt("user-id", &p.user_id);
    opt("app-id", &p.app_id);
    if p.delivery_mode == Some(2) {
        f.push("persistent", "true");
    }
    if let Some(v) = p.priority {
        f.push("priority", v.to_string());
    }
    if let Some(v) = p.timestamp {
        f.push("timestamp", v.to_string());
    }
    if let Some(h) = &p.headers {
        for (n, v) in h.iter() {
            if f.has(n) || n == "content-length" {
                continue;
            }
            if let Some(t) = value_text(v) {
                f.push(n, t);
            }
        }
    }
    f.body = d.body.clone();
    f
}

/// The `message` header and body of an ERROR frame for a core error.
pub fn core_error_text(e: &CoreError) -> (String, String) {
    let short = match e {
        CoreError::NotFound { .. } => "not_found",
        CoreError::PreconditionFailed(_) => "precondition_failed",
        CoreError::AccessRefused(_) => "access_refused",
        CoreError::ResourceLocked(_) => "resource_locked",
        CoreError::CommandInvalid(_) => "command_invalid",
        CoreError::NotAllowed(_) => "not_allowed",
        CoreError::NotImplemented(_) => "not_implemented",
        CoreError::InvalidEncoding(_) => "internal_error",
        CoreError::LimitExceeded(_) => "limit_exceeded",
        CoreError::Internal(_) => "internal_error",
    };
    (short.to_string(), e.to_string())
}

/// An ERROR frame. `receipt` echoes the offending frame's `receipt` as `receipt-id`.
pub fn error_frame(message: &str, detail: &str, receipt: Option<&str>) -> Frame {
    let mut f = Frame::new(Command::Error)
        .with("message", message)
        .with("content-type", "text/plain");
    if let Some(r) = receipt {
        f.push("receipt-id", r);
    }
    let mut body = String::with_capacity(detail.len() + 1);
    let _ = writeln!(body, "{detail}");
    f.with_body(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_headers_become_properties_and_back() {
        let f = Frame::new(Command::Send)
            .with("destination", "/queue/a")
            .with("persistent", "true")
            .with("priority", "5")
            .with("content-type", "text/plain")
            .with("message-id", "m1")
            .with("x-custom", "v")
            .with("x-custom", "second");
        let p = properties_from_send(&f, "guest").unwrap();
        assert_eq!(p.delivery_mode, Some(2));
        assert_eq!(p.priority, Some(5));
        assert_eq!(p.message_id.as_deref(), Some("m1"));
        let h = p.headers.clone().unwrap();
        assert_eq!(h.get_str("x-custom"), Some("v"));
        assert_eq!(h.len(), 1);
        assert!(properties_from_send(&f.clone().with("user-id", "bob"), "guest").is_err());
        assert!(
            properties_from_send(&Frame::new(Command::Send).with("priority", "x"), "guest")
                .is_err()
        );
    }

    #[test]
    fn booleans_in_any_case_and_nothing_else() {
        let f = |v: &str| Frame::new(Command::Send).with("persistent", v);
        for (v, want) in [
            ("true", true),
            ("True", true),
            ("TRUE", true),
            ("false", false),
            ("False", false),
            ("fAlSe", false),
        ] {
            assert_eq!(bool_header(&f(v), "persistent"), Ok(Some(want)), "{v}");
        }
        assert_eq!(
            bool_header(&Frame::new(Command::Send), "persistent"),
            Ok(None)
        );
        for v in ["yes", "1", "", " true", "truee"] {
            let e = bool_header(&f(v), "persistent").unwrap_err();
            assert_eq!(e.name, "persistent");
            assert!(e.reason.contains(&format!("'{v}'")), "{}", e.reason);
        }
        // SEND: `persistent:True` is delivery mode 2, `persistent:yes` refused
        let p = properties_from_send(&f("True").with("destination", "/queue/a"), "guest").unwrap();
        assert_eq!(p.delivery_mode, Some(2));
        let p = properties_from_send(&f("FALSE"), "guest").unwrap();
        assert_eq!(p.delivery_mode, None);
        assert_eq!(
            properties_from_send(&f("yes"), "guest").unwrap_err().name,
            "persistent"
        );
    }

    #[test]
    fn decimals_render() {
        let d = triad_core::value::Decimal { scale: 2, value: 5 };
        assert_eq!(value_text(&FieldValue::Decimal(d)).unwrap(), "0.05");
        assert_eq!(value_text(&FieldValue::I32(-3)).unwrap(), "-3");
        assert_eq!(value_text(&FieldValue::Void), None);
    }
}

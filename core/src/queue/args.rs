//! A queue's `x-` arguments, parsed and validated (`QueueArgs` and its limits).

use std::sync::Arc;

use crate::error::CoreError;
use crate::value::FieldTable;

/// What happens when a queue is full.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Overflow {
    /// Drop (or dead-letter) the oldest messages.
    #[default]
    DropHead,
    /// Refuse new messages (publisher confirms nack them).
    RejectPublish,
    /// Refuse new messages and dead-letter them.
    RejectPublishDlx,
}

/// The `x-` arguments a queue understands, validated.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueueArgs {
    /// `x-message-ttl`, ms.
    pub message_ttl: Option<u64>,
    /// `x-expires`, ms.
    pub expires: Option<u64>,
    /// `x-max-length`, messages.
    pub max_length: Option<u64>,
    /// `x-max-length-bytes`, body bytes.
    pub max_length_bytes: Option<u64>,
    /// `x-overflow`.
    pub overflow: Overflow,
    /// `x-dead-letter-exchange`.
    pub dead_letter_exchange: Option<String>,
    /// `x-dead-letter-routing-key`.
    pub dead_letter_routing_key: Option<String>,
    /// `x-max-priority` (1-255).
    pub max_priority: Option<u8>,
    /// `x-single-active-consumer`: only the earliest registered consumer gets messages;
    /// when it goes, the next one takes over.
    pub single_active_consumer: bool,
    /// `x-delivery-limit`: a message returned more often than this (nacked or rejected
    /// with requeue, or left unacked by a consumer that went) is dead-lettered with
    /// reason `delivery_limit`, or dropped without a dead-letter exchange. `None`: no
    /// limit (also what `-1` declares, as in RabbitMQ 4).
    pub delivery_limit: Option<u64>,
    /// `x-retry-backoff` (e.g. `1s,5s,10s,30s,1m,2m`): a returned message waits the
    /// step for its return count (the last step from then on) before it is ready again.
    /// With it, `x-delivery-limit` defaults to [`DEFAULT_BACKOFF_LIMIT`].
    pub retry_backoff: Option<Arc<[u64]>>,
}

/// The highest `x-delivery-limit`: delivery counts stop at 65,535, so a higher limit
/// could never be passed.
pub const MAX_DELIVERY_LIMIT: u64 = u16::MAX as u64 - 1;

/// `x-delivery-limit` when `x-retry-backoff` is set and the limit is not.
pub const DEFAULT_BACKOFF_LIMIT: u64 = 16;
/// Most steps in an `x-retry-backoff`.
pub const MAX_BACKOFF_STEPS: usize = 64;

/// Parses `x-retry-backoff`: comma-separated durations (`500ms`, `1s`, `2m`, `1h`; a
/// bare number is ms), 1 to [`MAX_BACKOFF_STEPS`] of them, each at most
/// [`crate::delayed::MAX_DELAY_MS`].
pub fn parse_backoff(v: &str) -> Result<Arc<[u64]>, String> {
    let mut out = Vec::new();
    for step in v.split(',') {
        let step = step.trim();
        let (num, unit) = match step.find(|c: char| !c.is_ascii_digit()) {
            Some(i) => step.split_at(i),
            None => (step, "ms"),
        };
        let mult = match unit.trim() {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            other => return Err(format!("'{step}': unknown unit '{other}' (ms, s, m, h)")),
        };
        let ms = num
            .parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(mult))
            .filter(|ms| *ms <= crate::delayed::MAX_DELAY_MS)
            .ok_or_else(|| format!("'{step}' is not a duration up to 49 days"))?;
        out.push(ms);
        if out.len() > MAX_BACKOFF_STEPS {
            return Err(format!("more than {MAX_BACKOFF_STEPS} steps"));
        }
    }
    Ok(out.into())
}

fn non_negative(args: &FieldTable, name: &str) -> Result<Option<u64>, CoreError> {
    match args.get(name) {
        None => Ok(None),
        Some(v) => match v.as_i64() {
            Some(n) if n >= 0 => Ok(Some(n as u64)),
            _ => Err(CoreError::PreconditionFailed(format!(
                "invalid arg '{name}' for queue: {v:?} is not a non-negative integer"
            ))),
        },
    }
}

fn string_arg(args: &FieldTable, name: &str) -> Result<Option<String>, CoreError> {
    match args.get(name) {
        None => Ok(None),
        Some(v) => v.as_str().map(|s| Some(s.to_string())).ok_or_else(|| {
            CoreError::PreconditionFailed(format!("invalid arg '{name}' for queue: not a string"))
        }),
    }
}

impl QueueArgs {
    /// [`QueueArgs::parse`] for a queue read back from the metadata at start. Arguments
    /// that an earlier version accepted and ignored but declare now refuses (a
    /// non-boolean `x-single-active-consumer`) stay ignored for that queue, with a
    /// warning, so that the broker still starts. (`x-delivery-limit`, which earlier
    /// versions ignored, is now in force for such a queue.)
    pub fn parse_stored(queue: &str, args: &FieldTable) -> Result<QueueArgs, CoreError> {
        match Self::parse(args) {
            Ok(a) => Ok(a),
            Err(first) => {
                let mut t = args.clone();
                if t.get("x-single-active-consumer")
                    .is_some_and(|v| v.as_bool().is_none())
                {
                    t.remove("x-single-active-consumer");
                }
                let a = Self::parse(&t).map_err(|_| first.clone())?;
                tracing::warn!(queue, error = %first, "stored queue has an argument declare now refuses; it stays ignored for this queue");
                Ok(a)
            }
        }
    }

    /// Parses and validates a queue's arguments as RabbitMQ does (unknown `x-` arguments
    /// are kept but ignored).
    pub fn parse(args: &FieldTable) -> Result<QueueArgs, CoreError> {
        let expires = non_negative(args, "x-expires")?;
        if expires == Some(0) {
            return Err(CoreError::PreconditionFailed(
                "invalid arg 'x-expires' for queue: must be positive".into(),
            ));
        }
        let overflow = match string_arg(args, "x-overflow")?.as_deref() {
            None | Some("drop-head") => Overflow::DropHead,
            Some("reject-publish") => Overflow::RejectPublish,
            Some("reject-publish-dlx") => Overflow::RejectPublishDlx,
            Some(other) => {
                return Err(CoreError::PreconditionFailed(format!(
                    "invalid arg 'x-overflow' for queue: '{other}'"
                )))
            }
        };
        let max_priority = match non_negative(args, "x-max-priority")? {
            None => None,
            Some(n @ 1..=255) => Some(n as u8),
            Some(n) => {
                return Err(CoreError::PreconditionFailed(format!(
                    "invalid arg 'x-max-priority' for queue: {n} is not in 1..255"
                )))
            }
        };
        match string_arg(args, "x-queue-type")?.as_deref() {
            None | Some("classic") => {}
            Some("stream") => {
                crate::stream::StreamArgs::parse(args)?;
            }
            Some(other) => {
                return Err(CoreError::PreconditionFailed(format!(
                    "invalid arg 'x-queue-type' for queue: '{other}' is not supported"
                )))
            }
        }
        // RabbitMQ has it for quorum queues only (where -1 means no limit); every
        // queue keeps its messages' delivery counts here
        let delivery_limit = match args.get("x-delivery-limit") {
            None => None,
            Some(v) => match v.as_i64() {
                Some(-1) => None,
                Some(n) if n >= 0 && n as u64 <= MAX_DELIVERY_LIMIT => Some(n as u64),
                Some(n) if n >= 0 => {
                    return Err(CoreError::PreconditionFailed(format!(
                        "invalid arg 'x-delivery-limit' for queue: {n} is above {MAX_DELIVERY_LIMIT} (delivery counts stop at 65535)"
                    )))
                }
                _ => {
                    return Err(CoreError::PreconditionFailed(format!(
                        "invalid arg 'x-delivery-limit' for queue: {v:?} is not a non-negative integer (or -1 for no limit)"
                    )))
                }
            },
        };
        let single_active_consumer = match args.get("x-single-active-consumer") {
            None => false,
            Some(v) => v.as_bool().ok_or_else(|| {
                CoreError::PreconditionFailed(format!(
                    "invalid arg 'x-single-active-consumer' for queue: {v:?} is not a boolean"
                ))
            })?,
        };
        let retry_backoff = match string_arg(args, "x-retry-backoff")? {
            None => None,
            Some(v) => Some(parse_backoff(&v).map_err(|why| {
                CoreError::PreconditionFailed(format!(
                    "invalid arg 'x-retry-backoff' for queue: {why}"
                ))
            })?),
        };
        let delivery_limit = match (delivery_limit, &retry_backoff) {
            (None, Some(_)) if !args.contains("x-delivery-limit") => Some(DEFAULT_BACKOFF_LIMIT),
            (l, _) => l,
        };
        Ok(QueueArgs {
            single_active_consumer,
            delivery_limit,
            retry_backoff,
            message_ttl: non_negative(args, "x-message-ttl")?,
            expires,
            max_length: non_negative(args, "x-max-length")?,
            max_length_bytes: non_negative(args, "x-max-length-bytes")?,
            overflow,
            dead_letter_exchange: string_arg(args, "x-dead-letter-exchange")?,
            dead_letter_routing_key: string_arg(args, "x-dead-letter-routing-key")?,
            max_priority,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    use crate::value::FieldValue;

    #[test]
    fn args_are_validated() {
        let mut t = FieldTable::default();
        t.insert("x-message-ttl", FieldValue::I32(100));
        t.insert(
            "x-overflow",
            FieldValue::LongString(Bytes::from_static(b"reject-publish")),
        );
        t.insert("x-max-priority", FieldValue::U8(10));
        let a = QueueArgs::parse(&t).unwrap();
        assert_eq!(a.message_ttl, Some(100));
        assert_eq!(a.overflow, Overflow::RejectPublish);
        assert_eq!(a.max_priority, Some(10));
        let mut bad = FieldTable::default();
        bad.insert("x-message-ttl", FieldValue::I32(-1));
        assert!(QueueArgs::parse(&bad).is_err());
        let mut bad = FieldTable::default();
        bad.insert(
            "x-overflow",
            FieldValue::LongString(Bytes::from_static(b"nope")),
        );
        assert!(QueueArgs::parse(&bad).is_err());
        let mut bad = FieldTable::default();
        bad.insert("x-expires", FieldValue::I32(0));
        assert!(QueueArgs::parse(&bad).is_err());
    }

    #[test]
    fn delivery_limit_is_parsed() {
        let limit = |v: FieldValue| {
            let mut t = FieldTable::default();
            t.insert("x-delivery-limit", v);
            QueueArgs::parse(&t).map(|a| a.delivery_limit)
        };
        assert_eq!(limit(FieldValue::I32(3)).unwrap(), Some(3));
        assert_eq!(limit(FieldValue::I64(0)).unwrap(), Some(0));
        assert_eq!(limit(FieldValue::I32(-1)).unwrap(), None);
        assert_eq!(
            limit(FieldValue::I32(65_534)).unwrap(),
            Some(MAX_DELIVERY_LIMIT)
        );
        for bad in [
            FieldValue::I32(-2),
            // counts stop at 65535: a higher limit could never be reached
            FieldValue::I32(65_535),
            FieldValue::I64(1 << 40),
            FieldValue::LongString(Bytes::from_static(b"3")),
        ] {
            match limit(bad) {
                Err(CoreError::PreconditionFailed(m)) => {
                    assert!(m.contains("x-delivery-limit"), "{m}")
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(
            QueueArgs::parse(&FieldTable::default())
                .unwrap()
                .delivery_limit,
            None
        );
    }

    #[test]
    fn a_stored_queue_with_a_refused_argument_still_opens() {
        let mut t = FieldTable::default();
        t.insert("x-delivery-limit", FieldValue::I32(3));
        t.insert(
            "x-single-active-consumer",
            FieldValue::LongString(Bytes::from_static(b"yes")),
        );
        t.insert("x-max-length", FieldValue::I32(5));
        assert!(QueueArgs::parse(&t).is_err());
        // declared by an earlier version that ignored it: ignored still, the rest kept
        // (the delivery limit, now implemented, in force)
        let a = QueueArgs::parse_stored("q", &t).unwrap();
        assert_eq!(a.max_length, Some(5));
        assert_eq!(a.delivery_limit, Some(3));
        assert!(!a.single_active_consumer);
        // anything else that is wrong stays an error
        t.insert("x-max-priority", FieldValue::I32(1000));
        assert!(QueueArgs::parse_stored("q", &t).is_err());
    }
}

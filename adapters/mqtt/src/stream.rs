//! Stream subscriptions: `$stream/<start>/<filter>` replays what was published on
//! `<filter>`'s topics from a position, then follows new messages (Kafka's model over
//! MQTT 3.1.1; the core's stream queues, [`triad_core::stream`]).
//!
//! - `<start>`: `first`, `last`, `next`, an offset (`1200`), an interval back from now
//!   (`1h`, `30m`, `7D`), or `time:<RFC 3339>` (`time:2026-12-01T09:00:00Z`) or
//!   `time:<ms since the epoch>`.
//! - The stream is the durable stream queue `mqtt-stream/<filter>`, bound to
//!   `amq.topic` with the filter's routing key. The first such subscription declares and
//!   binds it, with the retention of `[mqtt] stream_max_age` and `stream_max_bytes`
//!   (default 7 days and 1 GiB: a subscription never keeps every publish forever), so it
//!   holds what is published from then on; an operator who wants history from earlier,
//!   or other retention (`x-max-age`, `x-max-length-bytes`), declares and binds that
//!   queue beforehand (AMQP, STOMP or the management API). Later subscriptions, with any
//!   start, read the same stream. The queue stays when its subscribers go (its
//!   retention bounds it); deleting it is the operator's.
//! - Permissions are a plain subscription's, on that queue: configure and read on it,
//!   write on it and read on `amq.topic` (with the topic permission) for the binding.
//! - In a clean session the subscription lives as long as the connection. In a
//!   persistent session (clean session 0) it is stored with the session's other
//!   subscriptions and its position is the stream's stored offset of a consumer name
//!   of its own ([`consumer_name`]): set to the start when it subscribes, moved past
//!   each acknowledged message (PUBACK or PUBCOMP; coalesced, written at most a second
//!   later and when the connection ends), so after a reconnect or a broker restart it
//!   resumes where it was acknowledged, not from the start it was made with (what
//!   was sent but not acknowledged comes again: at least once). UNSUBSCRIBE, a clean
//!   CONNECT over the session and the session's expiry forget the position.
//! - Deliveries carry the QoS granted (at most the message's), each stream
//!   subscription reads at most the session's in-flight window ahead of its acks.

use std::time::Duration;

use triad_core::stream::{StreamConsume, StreamOffset};
use triad_core::{FieldTable, FieldValue};

use crate::topic::valid_filter;

/// Where a stream subscription's syntax starts.
pub const STREAM_PREFIX: &str = "$stream/";

/// A parsed `$stream/<start>/<filter>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamFilter<'a> {
    /// Where reading starts.
    pub start: StreamOffset,
    /// The filter matched against topics.
    pub filter: &'a str,
}

/// Whether `f` is written as a stream subscription (`$stream` or `$stream/...`): such a
/// filter is a valid [`StreamFilter`] or refused, never taken as a plain filter.
pub fn is_stream(f: &str) -> bool {
    f == "$stream" || f.starts_with(STREAM_PREFIX)
}

/// Parses `$stream/<start>/<filter>`: `None` for a filter not written so;
/// `Some(Err(()))` when the start or the filter is invalid.
pub fn parse_stream(f: &str, now_ms: u64) -> Option<Result<StreamFilter<'_>, ()>> {
    if !is_stream(f) {
        return None;
    }
    let rest = f.strip_prefix(STREAM_PREFIX).unwrap_or("");
    let Some((start, filter)) = rest.split_once('/') else {
        return Some(Err(()));
    };
    let Some(start) = StreamOffset::parse_str(start, now_ms) else {
        return Some(Err(()));
    };
    if !valid_filter(filter) || filter.starts_with('$') {
        return Some(Err(()));
    }
    Some(Ok(StreamFilter { start, filter }))
}

/// The stream queue a filter reads.
pub fn stream_queue_name(filter: &str) -> String {
    format!("mqtt-stream/{filter}")
}

/// The arguments of a stream queue a `$stream` subscription declares: a stream with
/// retention `max_age` (whole seconds, at least 1) and `max_bytes`.
pub fn auto_declare_arguments(max_age: Duration, max_bytes: u64) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert("x-queue-type", FieldValue::from("stream"));
    t.insert(
        "x-max-age",
        FieldValue::from(format!("{}s", max_age.as_secs().max(1)).as_str()),
    );
    t.insert(
        "x-max-length-bytes",
        FieldValue::I64(i64::try_from(max_bytes).unwrap_or(i64::MAX)),
    );
    t
}

/// The stream consumer name that holds the position of a persistent session's
/// subscription `full` (`$stream/<start>/<filter>`): `mqtt/<client id>/<start>` (the
/// stream is the filter's own, so the client and the start tell its subscriptions
/// apart), or, past the core's 255 bytes, `mqtt/~` and a 64-bit FNV-1a hash of both.
pub fn consumer_name(client_id: &str, full: &str) -> String {
    let start = full
        .strip_prefix(STREAM_PREFIX)
        .and_then(|r| r.split_once('/'))
        .map_or("", |(s, _)| s);
    let name = format!("mqtt/{client_id}/{start}");
    if name.len() <= triad_core::stream::spec::MAX_CONSUMER_NAME {
        return name;
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("mqtt/~{h:016x}")
}

/// The core's consume options for a parsed filter: a clean session's subscription
/// (`name` `None`) starts at its start; a persistent session's has its position stored
/// under `name`: a new subscription stores its start there first, a restored one
/// resumes from it (or from its start if nothing is stored, e.g. the stream was
/// deleted and declared again since).
pub fn consume_options(
    s: &StreamFilter<'_>,
    name: Option<String>,
    stream: Option<&triad_core::stream::Stream>,
    restored: bool,
) -> Result<StreamConsume, triad_core::CoreError> {
    let (Some(n), Some(st)) = (name, stream) else {
        return Ok(StreamConsume {
            offset: Some(s.start),
            name: None,
        });
    };
    if restored && st.stored_offset(&n).is_some() {
        return Ok(StreamConsume {
            offset: None,
            name: Some(n),
        });
    }
    if !restored {
        drop(st.start_offset(&n, s.start)?);
    }
    Ok(StreamConsume {
        offset: Some(s.start),
        name: Some(n),
    })
}

/// Forgets the stored position of a persistent session's stream subscription `full`
/// (it ended: UNSUBSCRIBE, or the session was discarded or expired).
pub fn forget_position(vhost: &triad_core::Vhost, client_id: &str, full: &str) {
    let Some((_, filter)) = full
        .strip_prefix(STREAM_PREFIX)
        .and_then(|r| r.split_once('/'))
    else {
        return;
    };
    let Some(q) = vhost.queue(&stream_queue_name(filter)) else {
        return;
    };
    if let Some(st) = q.stream() {
        if let Err(e) = st.forget_offset(&consumer_name(client_id, full)) {
            tracing::warn!(filter = full, error = %e, "forgetting a stream position failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_filters_parse() {
        let now = 10_000_000;
        assert_eq!(parse_stream("a/b", now), None);
        assert_eq!(
            parse_stream("$stream/first/sensors/#", now),
            Some(Ok(StreamFilter {
                start: StreamOffset::First,
                filter: "sensors/#"
            }))
        );
        assert_eq!(
            parse_stream("$stream/1h/a/+/c", now),
            Some(Ok(StreamFilter {
                start: StreamOffset::Timestamp(now - 3_600_000),
                filter: "a/+/c"
            }))
        );
        assert_eq!(
            parse_stream("$stream/time:2026-12-01T09:00:00Z/a", now),
            Some(Ok(StreamFilter {
                start: StreamOffset::Timestamp(1_796_115_600_000),
                filter: "a"
            }))
        );
        assert_eq!(
            parse_stream("$stream/42/a", now).unwrap().unwrap().start,
            StreamOffset::Offset(42)
        );
        for bad in [
            "$stream",
            "$stream/",
            "$stream/first",
            "$stream/first/",
            "$stream/soon/a",
            "$stream/first/a/#/b",
            "$stream/first/$SYS/#",
        ] {
            assert_eq!(parse_stream(bad, now), Some(Err(())), "{bad}");
        }
        assert_eq!(stream_queue_name("a/+"), "mqtt-stream/a/+");
    }

    #[test]
    fn consumer_names_tell_clients_and_starts_apart_and_stay_short() {
        assert_eq!(consumer_name("c1", "$stream/first/a/#"), "mqtt/c1/first");
        assert_eq!(consumer_name("c1", "$stream/1h/a/#"), "mqtt/c1/1h");
        assert_ne!(
            consumer_name("c1", "$stream/first/a"),
            consumer_name("c2", "$stream/first/a")
        );
        let long = "x".repeat(300);
        let a = consumer_name(&long, "$stream/first/a");
        let b = consumer_name(&long, "$stream/last/a");
        assert!(a.len() <= triad_core::stream::spec::MAX_CONSUMER_NAME);
        assert!(a.starts_with("mqtt/~"));
        assert_ne!(a, b);
        assert_eq!(a, consumer_name(&long, "$stream/first/a"), "stable");
    }

    #[test]
    fn auto_declared_streams_have_retention() {
        let t = auto_declare_arguments(Duration::from_secs(3600), 1 << 20);
        let a = triad_core::stream::StreamArgs::parse(&t).unwrap();
        assert_eq!(a.max_age_ms, Some(3_600_000));
        assert_eq!(a.max_bytes, Some(1 << 20));
    }
}

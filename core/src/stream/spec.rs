//! What streams read from the outside: the queue arguments (`x-max-age`,
//! `x-max-length-bytes`), a consumer's start position (`x-stream-offset`) and RabbitMQ's
//! interval strings (`1h`, `7D`). Pure parsing, no state.

use crate::error::CoreError;
use crate::value::{FieldTable, FieldValue};

/// Longest consumer name (`x-stream-consumer-name`), bytes.
pub const MAX_CONSUMER_NAME: usize = 255;

/// Queue arguments RabbitMQ refuses on a stream (they make no sense on a log).
const REFUSED_ARGS: &[&str] = &[
    "x-message-ttl",
    "x-expires",
    "x-max-length",
    "x-overflow",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-priority",
    "x-delivery-limit",
    "x-single-active-consumer",
    // RabbitMQ sizes its own per-stream segment files with it; here a stream's entries
    // live in the store's shared commitlog, so there is no per-stream segment to size
    "x-stream-max-segment-size-bytes",
    // cluster placement: Triad is one node
    "x-initial-cluster-size",
    "x-queue-leader-locator",
];

/// A stream's retention settings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamArgs {
    /// `x-max-age`, ms: entries older than this (by store time) are dropped.
    pub max_age_ms: Option<u64>,
    /// `x-max-length-bytes`: the oldest entries are dropped while the stream's body
    /// bytes exceed this.
    pub max_bytes: Option<u64>,
}

/// Whether `args` declare a stream (`x-queue-type=stream`).
pub fn is_stream(args: &FieldTable) -> bool {
    args.get("x-queue-type")
        .and_then(FieldValue::as_str)
        .is_some_and(|s| s == "stream")
}

impl StreamArgs {
    /// Validates a stream's arguments as RabbitMQ does: the queue-type specific ones it
    /// refuses are refused with its message.
    pub fn parse(args: &FieldTable) -> Result<StreamArgs, CoreError> {
        for k in REFUSED_ARGS {
            if args.contains(k) {
                return Err(CoreError::PreconditionFailed(format!(
                    "invalid arg '{k}' for queue of queue type stream"
                )));
            }
        }
        let max_age_ms = match args.get("x-max-age") {
            None => None,
            Some(v) => Some(
                v.as_str()
                    .and_then(parse_interval_ms)
                    .filter(|ms| *ms > 0)
                    .ok_or_else(|| {
                        CoreError::PreconditionFailed(format!(
                            "invalid arg 'x-max-age' for queue: {v:?} is not an age such as 7D, 12h or 30m (units Y M D h m s)"
                        ))
                    })?,
            ),
        };
        let max_bytes = match args.get("x-max-length-bytes") {
            None => None,
            Some(v) => match v.as_i64() {
                Some(n) if n >= 0 => Some(n as u64),
                _ => {
                    return Err(CoreError::PreconditionFailed(format!(
                        "invalid arg 'x-max-length-bytes' for queue: {v:?} is not a non-negative integer"
                    )))
                }
            },
        };
        Ok(StreamArgs {
            max_age_ms,
            max_bytes,
        })
    }
}

/// RabbitMQ's refusals for a stream's queue properties (a stream is durable, never
/// exclusive, never auto-deleted).
pub fn check_properties(
    queue: &str,
    vhost: &str,
    durable: bool,
    exclusive: bool,
    auto_delete: bool,
) -> Result<(), CoreError> {
    let bad = if !durable {
        "non-durable"
    } else if exclusive {
        "exclusive-owner"
    } else if auto_delete {
        "auto-delete"
    } else {
        return Ok(());
    };
    Err(CoreError::PreconditionFailed(format!(
        "invalid property '{bad}' for queue '{queue}' in vhost '{vhost}'"
    )))
}

/// Where a stream consumer starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamOffset {
    /// The oldest retained entry.
    First,
    /// The newest entry (or, in an empty stream, the next one).
    Last,
    /// The next entry published after the consumer starts (the default).
    Next,
    /// This offset (clamped to the retained range).
    Offset(u64),
    /// The first entry stored at or after this time, ms since the epoch.
    Timestamp(u64),
}

fn bad_offset(v: impl std::fmt::Debug) -> CoreError {
    CoreError::PreconditionFailed(format!(
        "invalid arg 'x-stream-offset': {v:?} is not first, last, next, an offset, a timestamp or an interval such as 1h"
    ))
}

impl StreamOffset {
    /// `x-stream-offset` as an AMQP consume argument: `first` / `last` / `next`, an
    /// integer offset (a negative one means `first`, as RabbitMQ), a timestamp (AMQP
    /// `T`, seconds), or an interval string (`1h`: that long before `now_ms`).
    pub fn from_field(v: &FieldValue, now_ms: u64) -> Result<StreamOffset, CoreError> {
        if let FieldValue::Timestamp(s) = v {
            return Ok(StreamOffset::Timestamp(s.saturating_mul(1000)));
        }
        if let Some(n) = v.as_i64() {
            return Ok(if n < 0 {
                StreamOffset::First
            } else {
                StreamOffset::Offset(n as u64)
            });
        }
        match v.as_str() {
            Some(s) => Self::parse_str(s, now_ms).ok_or_else(|| bad_offset(v)),
            None => Err(bad_offset(v)),
        }
    }

    /// A textual start position, as STOMP headers and MQTT topic levels carry it:
    /// `first`, `last`, `next`, a non-negative integer offset, an interval (`1h`, `30m`),
    /// or `time:<RFC 3339>` / `time:<ms since the epoch>`.
    pub fn parse_str(s: &str, now_ms: u64) -> Option<StreamOffset> {
        match s {
            "first" => return Some(StreamOffset::First),
            "last" => return Some(StreamOffset::Last),
            "next" => return Some(StreamOffset::Next),
            _ => {}
        }
        if let Some(t) = s.strip_prefix("time:") {
            if let Ok(ms) = t.parse::<u64>() {
                return Some(StreamOffset::Timestamp(ms));
            }
            return parse_rfc3339_ms(t).map(StreamOffset::Timestamp);
        }
        if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
            return s.parse::<u64>().ok().map(StreamOffset::Offset);
        }
        parse_interval_ms(s).map(|ms| StreamOffset::Timestamp(now_ms.saturating_sub(ms)))
    }
}

/// RabbitMQ's age / interval strings: a positive integer and one unit of `Y` (365
/// days), `M` (30 days), `D`, `h`, `m`, `s`. `None` for anything else.
pub fn parse_interval_ms(s: &str) -> Option<u64> {
    let unit = s.chars().last()?;
    let digits = s.get(..s.len().checked_sub(unit.len_utf8())?)?;
    if digits.is_empty() || digits.len() > 12 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    let secs: u64 = match unit {
        'Y' => 365 * 86_400,
        'M' => 30 * 86_400,
        'D' => 86_400,
        'h' => 3_600,
        'm' => 60,
        's' => 1,
        _ => return None,
    };
    n.checked_mul(secs)?.checked_mul(1000)
}

/// An RFC 3339 time (`2026-12-01T09:00:00Z`, `2026-12-01T09:00:00.250+01:00`) as ms
/// since the epoch; `None` when malformed or before 1970.
pub fn parse_rfc3339_ms(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    let num = |from: usize, len: usize| -> Option<i64> {
        let d = b.get(from..from + len)?;
        if !d.iter().all(u8::is_ascii_digit) {
            return None;
        }
        std::str::from_utf8(d).ok()?.parse().ok()
    };
    let sep = |i: usize, c: &[u8]| b.get(i).is_some_and(|x| c.contains(x));
    if !(sep(4, b"-") && sep(7, b"-") && sep(10, b"Tt ") && sep(13, b":") && sep(16, b":")) {
        return None;
    }
    let (y, mo, d) = (num(0, 4)?, num(5, 2)?, num(8, 2)?);
    let (h, mi, sec) = (num(11, 2)?, num(14, 2)?, num(17, 2)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let mut i = 19;
    let mut ms = 0i64;
    if sep(i, b".") {
        i += 1;
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        let frac = b.get(start..i)?;
        if frac.is_empty() || frac.len() > 9 {
            return None;
        }
        let mut scaled = 0i64;
        for k in 0..3 {
            scaled = scaled * 10 + frac.get(k).map_or(0, |c| i64::from(c - b'0'));
        }
        ms = scaled;
    }
    let offset_min = match b.get(i) {
        Some(b'Z' | b'z') if i + 1 == b.len() => 0,
        Some(c @ (b'+' | b'-')) if i + 6 == b.len() && sep(i + 3, b":") => {
            let m = num(i + 1, 2)? * 60 + num(i + 4, 2)?;
            if *c == b'+' {
                m
            } else {
                -m
            }
        }
        _ => return None,
    };
    // days from civil (Howard Hinnant's algorithm)
    let yy = if mo <= 2 { y - 1 } else { y };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3_600 + mi * 60 + sec - offset_min * 60;
    let total = secs.checked_mul(1000)?.checked_add(ms)?;
    u64::try_from(total).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn s(v: &str) -> FieldValue {
        FieldValue::LongString(Bytes::from(v.to_string()))
    }

    #[test]
    fn intervals_use_rabbitmq_units() {
        assert_eq!(parse_interval_ms("10s"), Some(10_000));
        assert_eq!(parse_interval_ms("1h"), Some(3_600_000));
        assert_eq!(parse_interval_ms("7D"), Some(7 * 86_400_000));
        assert_eq!(parse_interval_ms("2M"), Some(60 * 86_400_000));
        assert_eq!(parse_interval_ms("1Y"), Some(365 * 86_400_000));
        for bad in [
            "",
            "h",
            "1x",
            "-1h",
            "1.5h",
            "10",
            "99999999999999999h",
            "1é",
        ] {
            assert_eq!(parse_interval_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn rfc3339_times() {
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_rfc3339_ms("2026-12-01T09:00:00Z"),
            Some(1_796_115_600_000)
        );
        assert_eq!(
            parse_rfc3339_ms("2026-12-01T10:00:00.250+01:00"),
            Some(1_796_115_600_250)
        );
        for bad in [
            "2026-12-01",
            "2026-13-01T00:00:00Z",
            "2026-12-01T09:00:00",
            "2026-12-01T09:00:00+0100",
            "1969-12-31T23:59:59Z",
            "2026-12-01T09:00:00.Z",
        ] {
            assert_eq!(parse_rfc3339_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn offsets_from_amqp_arguments() {
        let now = 10_000_000;
        let f = |v| StreamOffset::from_field(&v, now);
        assert_eq!(f(s("first")), Ok(StreamOffset::First));
        assert_eq!(f(s("last")), Ok(StreamOffset::Last));
        assert_eq!(f(s("next")), Ok(StreamOffset::Next));
        assert_eq!(f(FieldValue::I64(5)), Ok(StreamOffset::Offset(5)));
        assert_eq!(f(FieldValue::I32(-1)), Ok(StreamOffset::First));
        assert_eq!(
            f(FieldValue::Timestamp(1_000)),
            Ok(StreamOffset::Timestamp(1_000_000))
        );
        assert_eq!(f(s("1h")), Ok(StreamOffset::Timestamp(now - 3_600_000)));
        assert!(f(s("1x")).is_err());
        assert!(f(s("abc")).is_err());
        assert!(f(FieldValue::Bool(true)).is_err());
        assert_eq!(
            StreamOffset::parse_str("time:2026-12-01T09:00:00Z", now),
            Some(StreamOffset::Timestamp(1_796_115_600_000))
        );
        assert_eq!(
            StreamOffset::parse_str("time:1234", now),
            Some(StreamOffset::Timestamp(1234))
        );
        assert_eq!(
            StreamOffset::parse_str("42", now),
            Some(StreamOffset::Offset(42))
        );
        assert_eq!(StreamOffset::parse_str("time:yesterday", now), None);
    }

    #[test]
    fn arguments_and_properties() {
        let mut t = FieldTable::default();
        t.insert("x-queue-type", s("stream"));
        t.insert("x-max-age", s("7D"));
        t.insert("x-max-length-bytes", FieldValue::I64(1 << 30));
        assert!(is_stream(&t));
        assert_eq!(
            StreamArgs::parse(&t),
            Ok(StreamArgs {
                max_age_ms: Some(7 * 86_400_000),
                max_bytes: Some(1 << 30)
            })
        );
        t.insert("x-max-age", s("10x"));
        assert!(StreamArgs::parse(&t).is_err());
        let mut t = FieldTable::default();
        t.insert("x-message-ttl", FieldValue::I32(5));
        match StreamArgs::parse(&t) {
            Err(CoreError::PreconditionFailed(m)) => assert!(m.contains("x-message-ttl")),
            other => panic!("{other:?}"),
        }
        assert!(check_properties("q", "/", true, false, false).is_ok());
        for (d, e, a, word) in [
            (false, false, false, "non-durable"),
            (true, true, false, "exclusive-owner"),
            (true, false, true, "auto-delete"),
        ] {
            match check_properties("q", "/", d, e, a) {
                Err(CoreError::PreconditionFailed(m)) => assert!(m.contains(word), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    }
}

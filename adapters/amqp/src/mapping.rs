//! Converters between amq-protocol's wire types and the core's value model.
//!
//! - Wire → core is lossless except for order: amq-protocol keeps a table in a
//!   `BTreeMap`, so entries arrive sorted by name and duplicates collapse.
//! - Core → wire: a core `ShortString` value becomes a long string (`S`), because the
//!   wire has no short-string letter RabbitMQ clients read; a table entry whose name
//!   exceeds 255 bytes and a property string over 255 bytes (possible only from STOMP
//!   headers) are left out, since no valid 0-9-1 frame can carry them.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable as WireTable, LongString,
    ShortString,
};
use bytes::Bytes;
use triad_core::value::Decimal;
use triad_core::{FieldTable, FieldValue, Properties};

/// A short string for an outbound method field: cut at a character boundary to 255
/// bytes if longer (names that long can only come from other protocols).
pub fn short(s: &str) -> ShortString {
    let mut end = s.len().min(255);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    ShortString::try_new(s.get(..end).unwrap_or_default()).unwrap_or_default()
}

/// A property string if it fits a short string.
fn short_opt(s: &Option<String>) -> Option<ShortString> {
    s.as_ref()
        .and_then(|s| ShortString::try_new(s.as_str()).ok())
}

/// Wire value → core value.
pub fn value_from_wire(v: &AMQPValue) -> FieldValue {
    match v {
        AMQPValue::Boolean(b) => FieldValue::Bool(*b),
        AMQPValue::ShortShortInt(v) => FieldValue::I8(*v),
        AMQPValue::ShortShortUInt(v) => FieldValue::U8(*v),
        AMQPValue::ShortInt(v) => FieldValue::I16(*v),
        AMQPValue::ShortUInt(v) => FieldValue::U16(*v),
        AMQPValue::LongInt(v) => FieldValue::I32(*v),
        AMQPValue::LongUInt(v) => FieldValue::U32(*v),
        AMQPValue::LongLongInt(v) => FieldValue::I64(*v),
        AMQPValue::Float(v) => FieldValue::F32(*v),
        AMQPValue::Double(v) => FieldValue::F64(*v),
        AMQPValue::DecimalValue(d) => FieldValue::Decimal(Decimal {
            scale: d.scale,
            value: d.value,
        }),
        AMQPValue::ShortString(s) => {
            FieldValue::ShortString(Bytes::copy_from_slice(s.as_str().as_bytes()))
        }
        AMQPValue::LongString(s) => FieldValue::LongString(Bytes::copy_from_slice(s.as_bytes())),
        AMQPValue::FieldArray(a) => {
            FieldValue::Array(a.as_slice().iter().map(value_from_wire).collect())
        }
        AMQPValue::Timestamp(t) => FieldValue::Timestamp(*t),
        AMQPValue::FieldTable(t) => FieldValue::Table(table_from_wire(t)),
        AMQPValue::ByteArray(b) => FieldValue::ByteArray(Bytes::copy_from_slice(b.as_slice())),
        AMQPValue::Void => FieldValue::Void,
    }
}

/// Wire table → core table.
pub fn table_from_wire(t: &WireTable) -> FieldTable {
    let mut out = FieldTable::new();
    for (k, v) in t {
        out.push(k.as_str(), value_from_wire(v));
    }
    out
}

/// Core value → wire value.
pub fn value_to_wire(v: &FieldValue) -> AMQPValue {
    match v {
        FieldValue::Bool(b) => AMQPValue::Boolean(*b),
        FieldValue::I8(v) => AMQPValue::ShortShortInt(*v),
        FieldValue::U8(v) => AMQPValue::ShortShortUInt(*v),
        FieldValue::I16(v) => AMQPValue::ShortInt(*v),
        FieldValue::U16(v) => AMQPValue::ShortUInt(*v),
        FieldValue::I32(v) => AMQPValue::LongInt(*v),
        FieldValue::U32(v) => AMQPValue::LongUInt(*v),
        FieldValue::I64(v) => AMQPValue::LongLongInt(*v),
        FieldValue::F32(v) => AMQPValue::Float(*v),
        FieldValue::F64(v) => AMQPValue::Double(*v),
        FieldValue::Decimal(d) => AMQPValue::DecimalValue(DecimalValue {
            scale: d.scale,
            value: d.value,
        }),
        FieldValue::ShortString(b) | FieldValue::LongString(b) => {
            AMQPValue::LongString(LongString::from(b.to_vec()))
        }
        FieldValue::Timestamp(t) => AMQPValue::Timestamp(*t),
        FieldValue::Table(t) => AMQPValue::FieldTable(table_to_wire(t)),
        FieldValue::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.iter().map(value_to_wire).collect::<Vec<_>>(),
        )),
        FieldValue::ByteArray(b) => AMQPValue::ByteArray(ByteArray::from(b.to_vec())),
        FieldValue::Void => AMQPValue::Void,
    }
}

/// Core table → wire table (entries with names over 255 bytes are left out).
pub fn table_to_wire(t: &FieldTable) -> WireTable {
    let mut out = WireTable::default();
    for (k, v) in t.iter() {
        if let Ok(k) = ShortString::try_new(k) {
            out.insert(k, value_to_wire(v));
        }
    }
    out
}

/// Wire basic properties → core properties.
pub fn properties_from_wire(p: &BasicProperties) -> Properties {
    let s = |v: &Option<ShortString>| v.as_ref().map(|s| s.as_str().to_owned());
    Properties {
        content_type: s(p.content_type()),
        content_encoding: s(p.content_encoding()),
        headers: p.headers().as_ref().map(table_from_wire),
        delivery_mode: *p.delivery_mode(),
        priority: *p.priority(),
        correlation_id: s(p.correlation_id()),
        reply_to: s(p.reply_to()),
        expiration: s(p.expiration()),
        message_id: s(p.message_id()),
        timestamp: *p.timestamp(),
        message_type: s(p.kind()),
        user_id: s(p.user_id()),
        app_id: s(p.app_id()),
        cluster_id: s(p.cluster_id()),
    }
}

/// Core properties → wire basic properties.
pub fn properties_to_wire(p: &Properties) -> BasicProperties {
    let mut w = BasicProperties::default();
    if let Some(v) = short_opt(&p.content_type) {
        w = w.with_content_type(v);
    }
    if let Some(v) = short_opt(&p.content_encoding) {
        w = w.with_content_encoding(v);
    }
    if let Some(h) = &p.headers {
        w = w.with_headers(table_to_wire(h));
    }
    if let Some(v) = p.delivery_mode {
        w = w.with_delivery_mode(v);
    }
    if let Some(v) = p.priority {
        w = w.with_priority(v);
    }
    if let Some(v) = short_opt(&p.correlation_id) {
        w = w.with_correlation_id(v);
    }
    if let Some(v) = short_opt(&p.reply_to) {
        w = w.with_reply_to(v);
    }
    if let Some(v) = short_opt(&p.expiration) {
        w = w.with_expiration(v);
    }
    if let Some(v) = short_opt(&p.message_id) {
        w = w.with_message_id(v);
    }
    if let Some(v) = p.timestamp {
        w = w.with_timestamp(v);
    }
    if let Some(v) = short_opt(&p.message_type) {
        w = w.with_type(v);
    }
    if let Some(v) = short_opt(&p.user_id) {
        w = w.with_user_id(v);
    }
    if let Some(v) = short_opt(&p.app_id) {
        w = w.with_app_id(v);
    }
    if let Some(v) = short_opt(&p.cluster_id) {
        w = w.with_cluster_id(v);
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_table() -> FieldTable {
        let inner: FieldTable = [("n", FieldValue::I64(-5))].into_iter().collect();
        [
            ("a", FieldValue::Bool(true)),
            ("b", FieldValue::I8(-1)),
            ("c", FieldValue::U8(1)),
            ("d", FieldValue::I16(-2)),
            ("e", FieldValue::U16(2)),
            ("f", FieldValue::I32(-3)),
            ("g", FieldValue::U32(3)),
            ("h", FieldValue::I64(-4)),
            ("i", FieldValue::F32(0.5)),
            ("j", FieldValue::F64(0.25)),
            (
                "k",
                FieldValue::Decimal(Decimal {
                    scale: 2,
                    value: 314,
                }),
            ),
            ("l", FieldValue::from("long")),
            ("m", FieldValue::Timestamp(7)),
            ("n", FieldValue::Table(inner)),
            (
                "o",
                FieldValue::Array(vec![FieldValue::I32(1), FieldValue::from("x")]),
            ),
            ("p", FieldValue::ByteArray(Bytes::from_static(b"\x00\xff"))),
            ("q", FieldValue::Void),
        ]
        .into_iter()
        .collect()
    }

    #[test]
    fn table_round_trips() {
        let t = sample_table();
        assert_eq!(table_from_wire(&table_to_wire(&t)), t);
        let w = table_to_wire(&t);
        assert_eq!(table_to_wire(&table_from_wire(&w)), w);
    }

    #[test]
    fn short_string_values_become_long_strings() {
        let t: FieldTable = [("s", FieldValue::ShortString(Bytes::from_static(b"v")))]
            .into_iter()
            .collect();
        let back = table_from_wire(&table_to_wire(&t));
        assert_eq!(back.get("s"), Some(&FieldValue::from("v")));
    }

    #[test]
    fn long_names_are_left_out() {
        let t: FieldTable = [
            ("x".repeat(300), FieldValue::I8(1)),
            ("ok".into(), FieldValue::I8(2)),
        ]
        .into_iter()
        .collect();
        let w = table_to_wire(&t);
        assert_eq!(w.inner().len(), 1);
    }

    #[test]
    fn properties_round_trip() {
        let p = Properties {
            content_type: Some("text/plain".into()),
            content_encoding: Some("gzip".into()),
            headers: Some(sample_table()),
            delivery_mode: Some(2),
            priority: Some(5),
            correlation_id: Some("c".into()),
            reply_to: Some("r".into()),
            expiration: Some("1000".into()),
            message_id: Some("m".into()),
            timestamp: Some(12),
            message_type: Some("t".into()),
            user_id: Some("guest".into()),
            app_id: Some("app".into()),
            cluster_id: Some("cl".into()),
        };
        assert_eq!(properties_from_wire(&properties_to_wire(&p)), p);
        assert_eq!(
            properties_from_wire(&properties_to_wire(&Properties::default())),
            Properties::default()
        );
        let long = Properties {
            reply_to: Some("r".repeat(256)),
            ..Properties::default()
        };
        assert_eq!(
            properties_from_wire(&properties_to_wire(&long)).reply_to,
            None
        );
    }

    #[test]
    fn short_cuts_at_char_boundary() {
        let s = "é".repeat(200);
        let cut = short(&s);
        assert!(cut.as_str().len() <= 255);
        assert_eq!(cut.as_str().len() % 2, 0);
        assert_eq!(short("abc").as_str(), "abc");
    }
}

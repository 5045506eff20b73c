//! Message properties, and their compact encoding stored in a
//! commitlog record.
//!
//! [`Properties`] are AMQP 0-9-1's basic properties, the canonical model: STOMP headers
//! and MQTT flags are translated into them by the adapters.
//!
//! # Stored encoding (version 1)
//!
//! ```text
//! u8   version = 1
//! u16  presence flags, big-endian, bit i set = field i present (order as declared)
//! ...  each present field in order:
//!        strings:   varint length + UTF-8 bytes
//!        headers:   varint count + (name, tagged value)*   (see `encoding`)
//!        u8 fields: 1 byte; timestamp: u64 big-endian
//! ```
//!
//! Decoding checks every length against the remaining input before allocating, bounds
//! table nesting by [`crate::value::MAX_DEPTH`], rejects unknown versions, unknown flag
//! bits and trailing bytes, and never panics.

use crate::encoding::{put_bytes, put_table, Reader};
use crate::error::CoreError;
use crate::value::FieldTable;

/// The current version of the stored properties encoding.
pub const PROPERTIES_VERSION: u8 = 1;

/// AMQP 0-9-1 basic properties. Every field is optional, as on the wire.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Properties {
    /// MIME content type.
    pub content_type: Option<String>,
    /// MIME content encoding.
    pub content_encoding: Option<String>,
    /// Application headers. `Some(empty)` and `None` are kept distinct.
    pub headers: Option<FieldTable>,
    /// 1 = transient, 2 = persistent.
    pub delivery_mode: Option<u8>,
    /// Message priority, 0 to 9 by convention (up to the queue's `x-max-priority`).
    pub priority: Option<u8>,
    /// Application correlation identifier.
    pub correlation_id: Option<String>,
    /// Address to reply to.
    pub reply_to: Option<String>,
    /// Per-message TTL in milliseconds, as a decimal string (RabbitMQ's convention).
    pub expiration: Option<String>,
    /// Application message identifier.
    pub message_id: Option<String>,
    /// Message timestamp, seconds since the Unix epoch.
    pub timestamp: Option<u64>,
    /// Message type name (AMQP `type`).
    pub message_type: Option<String>,
    /// Creating user id (validated against the connection's user by the broker).
    pub user_id: Option<String>,
    /// Creating application id.
    pub app_id: Option<String>,
    /// Deprecated AMQP cluster id.
    pub cluster_id: Option<String>,
}

const F_CONTENT_TYPE: u16 = 1 << 0;
const F_CONTENT_ENCODING: u16 = 1 << 1;
const F_HEADERS: u16 = 1 << 2;
const F_DELIVERY_MODE: u16 = 1 << 3;
const F_PRIORITY: u16 = 1 << 4;
const F_CORRELATION_ID: u16 = 1 << 5;
const F_REPLY_TO: u16 = 1 << 6;
const F_EXPIRATION: u16 = 1 << 7;
const F_MESSAGE_ID: u16 = 1 << 8;
const F_TIMESTAMP: u16 = 1 << 9;
const F_TYPE: u16 = 1 << 10;
const F_USER_ID: u16 = 1 << 11;
const F_APP_ID: u16 = 1 << 12;
const F_CLUSTER_ID: u16 = 1 << 13;
const F_ALL: u16 = (1 << 14) - 1;

impl Properties {
    /// Whether the message asks to be persisted (`delivery_mode == 2`).
    pub fn is_persistent(&self) -> bool {
        self.delivery_mode == Some(2)
    }

    /// Appends the stored encoding of these properties to `out`.
    ///
    /// Fails with [`CoreError::LimitExceeded`] if the headers nest deeper than
    /// [`crate::value::MAX_DEPTH`]; `out` is then left as it was.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), CoreError> {
        let start = out.len();
        let result = self.encode_inner(out);
        if result.is_err() {
            out.truncate(start);
        }
        result
    }

    fn encode_inner(&self, out: &mut Vec<u8>) -> Result<(), CoreError> {
        let strings = [
            (F_CONTENT_TYPE, &self.content_type),
            (F_CONTENT_ENCODING, &self.content_encoding),
            (F_CORRELATION_ID, &self.correlation_id),
            (F_REPLY_TO, &self.reply_to),
            (F_EXPIRATION, &self.expiration),
            (F_MESSAGE_ID, &self.message_id),
            (F_TYPE, &self.message_type),
            (F_USER_ID, &self.user_id),
            (F_APP_ID, &self.app_id),
            (F_CLUSTER_ID, &self.cluster_id),
        ];
        let mut flags = 0u16;
        for (flag, value) in &strings {
            if value.is_some() {
                flags |= flag;
            }
        }
        if self.headers.is_some() {
            flags |= F_HEADERS;
        }
        if self.delivery_mode.is_some() {
            flags |= F_DELIVERY_MODE;
        }
        if self.priority.is_some() {
            flags |= F_PRIORITY;
        }
        if self.timestamp.is_some() {
            flags |= F_TIMESTAMP;
        }
        out.push(PROPERTIES_VERSION);
        out.extend_from_slice(&flags.to_be_bytes());

        let put_str = |out: &mut Vec<u8>, s: &Option<String>| {
            if let Some(s) = s {
                put_bytes(out, s.as_bytes());
            }
        };
        put_str(out, &self.content_type);
        put_str(out, &self.content_encoding);
        if let Some(h) = &self.headers {
            put_table(out, h, 0)?;
        }
        if let Some(v) = self.delivery_mode {
            out.push(v);
        }
        if let Some(v) = self.priority {
            out.push(v);
        }
        put_str(out, &self.correlation_id);
        put_str(out, &self.reply_to);
        put_str(out, &self.expiration);
        put_str(out, &self.message_id);
        if let Some(v) = self.timestamp {
            out.extend_from_slice(&v.to_be_bytes());
        }
        put_str(out, &self.message_type);
        put_str(out, &self.user_id);
        put_str(out, &self.app_id);
        put_str(out, &self.cluster_id);
        Ok(())
    }

    /// Decodes properties encoded by [`Properties::encode`]; the whole input must be
    /// consumed.
    pub fn decode(input: &[u8]) -> Result<Properties, CoreError> {
        let mut r = Reader::new(input);
        if r.u8()? != PROPERTIES_VERSION {
            return Err(CoreError::InvalidEncoding("unknown properties version"));
        }
        let flags = r.u16()?;
        if flags & !F_ALL != 0 {
            return Err(CoreError::InvalidEncoding("unknown properties flag"));
        }
        let has = |f: u16| flags & f != 0;
        let mut p = Properties::default();
        let opt_str = |r: &mut Reader<'_>, f: u16| -> Result<Option<String>, CoreError> {
            if has(f) {
                r.string().map(Some)
            } else {
                Ok(None)
            }
        };
        p.content_type = opt_str(&mut r, F_CONTENT_TYPE)?;
        p.content_encoding = opt_str(&mut r, F_CONTENT_ENCODING)?;
        if has(F_HEADERS) {
            p.headers = Some(r.table(0)?);
        }
        if has(F_DELIVERY_MODE) {
            p.delivery_mode = Some(r.u8()?);
        }
        if has(F_PRIORITY) {
            p.priority = Some(r.u8()?);
        }
        p.correlation_id = opt_str(&mut r, F_CORRELATION_ID)?;
        p.reply_to = opt_str(&mut r, F_REPLY_TO)?;
        p.expiration = opt_str(&mut r, F_EXPIRATION)?;
        p.message_id = opt_str(&mut r, F_MESSAGE_ID)?;
        if has(F_TIMESTAMP) {
            p.timestamp = Some(r.u64()?);
        }
        p.message_type = opt_str(&mut r, F_TYPE)?;
        p.user_id = opt_str(&mut r, F_USER_ID)?;
        p.app_id = opt_str(&mut r, F_APP_ID)?;
        p.cluster_id = opt_str(&mut r, F_CLUSTER_ID)?;
        if r.remaining() != 0 {
            return Err(CoreError::InvalidEncoding(
                "trailing bytes after properties",
            ));
        }
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::{Decimal, FieldValue};
    use bytes::Bytes;
    use proptest::prelude::*;

    fn arb_bytes() -> impl Strategy<Value = Bytes> {
        proptest::collection::vec(any::<u8>(), 0..8).prop_map(Bytes::from)
    }

    fn arb_value() -> impl Strategy<Value = FieldValue> {
        let leaf = prop_oneof![
            any::<bool>().prop_map(FieldValue::Bool),
            any::<i8>().prop_map(FieldValue::I8),
            any::<u8>().prop_map(FieldValue::U8),
            any::<i16>().prop_map(FieldValue::I16),
            any::<u16>().prop_map(FieldValue::U16),
            any::<i32>().prop_map(FieldValue::I32),
            any::<u32>().prop_map(FieldValue::U32),
            any::<i64>().prop_map(FieldValue::I64),
            any::<f32>().prop_map(FieldValue::F32),
            any::<f64>().prop_map(FieldValue::F64),
            (any::<u8>(), any::<u32>())
                .prop_map(|(scale, value)| FieldValue::Decimal(Decimal { scale, value })),
            arb_bytes().prop_map(FieldValue::ShortString),
            arb_bytes().prop_map(FieldValue::LongString),
            any::<u64>().prop_map(FieldValue::Timestamp),
            arb_bytes().prop_map(FieldValue::ByteArray),
            Just(FieldValue::Void),
        ];
        leaf.prop_recursive(4, 32, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(FieldValue::Array),
                proptest::collection::vec((".{0,6}", inner), 0..4)
                    .prop_map(|v| FieldValue::Table(v.into_iter().collect())),
            ]
        })
    }

    fn arb_table() -> impl Strategy<Value = FieldTable> {
        proptest::collection::vec(("[a-z-]{0,8}", arb_value()), 0..6)
            .prop_map(|v| v.into_iter().collect())
    }

    prop_compose! {
        fn arb_properties()(
            content_type in proptest::option::of(".{0,12}"),
            content_encoding in proptest::option::of(".{0,12}"),
            headers in proptest::option::of(arb_table()),
            delivery_mode in proptest::option::of(any::<u8>()),
            priority in proptest::option::of(any::<u8>()),
            correlation_id in proptest::option::of(".{0,12}"),
            reply_to in proptest::option::of(".{0,12}"),
            expiration in proptest::option::of("[0-9]{0,6}"),
            message_id in proptest::option::of(".{0,12}"),
            timestamp in proptest::option::of(any::<u64>()),
            message_type in proptest::option::of(".{0,12}"),
            user_id in proptest::option::of(".{0,12}"),
            app_id in proptest::option::of(".{0,12}"),
            cluster_id in proptest::option::of(".{0,12}"),
        ) -> Properties {
            Properties {
                content_type, content_encoding, headers, delivery_mode, priority,
                correlation_id, reply_to, expiration, message_id, timestamp,
                message_type, user_id, app_id, cluster_id,
            }
        }
    }

    proptest! {
        #[test]
        fn round_trip(p in arb_properties()) {
            let mut out = vec![0xAA];
            p.encode(&mut out).unwrap();
            prop_assert_eq!(out[0], 0xAA);
            prop_assert_eq!(Properties::decode(&out[1..]).unwrap(), p);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Properties::decode(&bytes);
        }

        #[test]
        fn mutated_encodings_never_panic(p in arb_properties(), pos in any::<usize>(), byte in any::<u8>()) {
            let mut out = Vec::new();
            p.encode(&mut out).unwrap();
            let i = pos % out.len();
            out[i] = byte;
            let _ = Properties::decode(&out);
            let _ = Properties::decode(&out[..i]);
        }
    }

    #[test]
    fn empty_properties_are_three_bytes() {
        let mut out = Vec::new();
        Properties::default().encode(&mut out).unwrap();
        assert_eq!(out, [PROPERTIES_VERSION, 0, 0]);
        assert_eq!(Properties::decode(&out).unwrap(), Properties::default());
    }

    #[test]
    fn rejects_bad_version_flags_truncation_and_trailing_bytes() {
        let p = Properties {
            content_type: Some("text/plain".into()),
            headers: Some([("a", 1i32)].into_iter().collect()),
            delivery_mode: Some(2),
            timestamp: Some(7),
            ..Default::default()
        };
        let mut out = Vec::new();
        p.encode(&mut out).unwrap();
        assert!(p.is_persistent());
        for cut in 0..out.len() {
            assert!(Properties::decode(&out[..cut]).is_err(), "cut at {cut}");
        }
        let mut trailing = out.clone();
        trailing.push(0);
        assert!(Properties::decode(&trailing).is_err());
        let mut version = out.clone();
        version[0] = 2;
        assert_eq!(
            Properties::decode(&version),
            Err(CoreError::InvalidEncoding("unknown properties version"))
        );
        assert!(Properties::decode(&[1, 0x80, 0]).is_err());
    }

    #[test]
    fn too_deep_headers_fail_to_encode_and_leave_output_alone() {
        let mut v = FieldValue::Void;
        for _ in 0..crate::value::MAX_DEPTH {
            v = FieldValue::Array(vec![v]);
        }
        let p = Properties {
            headers: Some([("deep", v)].into_iter().collect()),
            ..Default::default()
        };
        let mut out = vec![9];
        assert!(matches!(
            p.encode(&mut out),
            Err(CoreError::LimitExceeded(_))
        ));
        assert_eq!(out, [9]);
    }

    #[test]
    fn invalid_utf8_string_is_an_error() {
        // version, flags = content_type, len 1, 0xff
        assert!(Properties::decode(&[1, 0, 1, 1, 0xff]).is_err());
    }
}

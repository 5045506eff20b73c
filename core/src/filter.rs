//! A consumer's message filter: an SQL92 [`Selector`] (STOMP `selector`, AMQP
//! `x-selector`) and/or a tag filter (`x-tag-filter: a || b`, RocketMQ's tag
//! subscription) over the `x-tag` header a publisher sets.
//!
//! Tags: a message's `x-tag` is hashed into bits 42-63 of its consume-queue entry's tag
//! word ([`tag_bits`]), so a queue decides "not this consumer's tag" from the entry
//! alone, without reading the commitlog. A hash that matches is confirmed against the
//! message's real `x-tag` header once the record is read (hash collisions, as RocketMQ
//! resolves them on the consumer side), so a collision never delivers a wrong tag.
//!
//! Cost: a filter is compiled once per subscription and kept by its consumer (the
//! selector's tree, at most [`selector::MAX_LEN`](crate::selector::MAX_LEN) bytes of
//! text; a tag filter at most [`MAX_TAGS`] tags of [`MAX_TAG_LEN`] bytes).

use std::sync::Arc;

use crate::error::CoreError;
use crate::message::Properties;
use crate::selector::{Fields, Selector, Value};
use crate::value::FieldValue;

/// The header that carries a message's tag.
pub const TAG_HEADER: &str = "x-tag";
/// Most tags in one `x-tag-filter`.
pub const MAX_TAGS: usize = 64;
/// Longest tag, in bytes.
pub const MAX_TAG_LEN: usize = 255;

const TAG_HASH_SHIFT: u32 = 42;
const TAG_HASH_BITS: u32 = 22;
const TAG_HASH_MASK: u64 = (1 << TAG_HASH_BITS) - 1;

/// FNV-1a, 64 bits: stable across versions and platforms (the result is stored).
fn fnv1a(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in b {
        h ^= u64::from(*x);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A tag's 22-bit hash, never 0 (0 means "no tag").
fn tag_hash(tag: &[u8]) -> u64 {
    fnv1a(tag) % TAG_HASH_MASK + 1
}

/// The message's tag: its `x-tag` header, when that is a string.
fn message_tag(props: &Properties) -> Option<&[u8]> {
    match props.headers.as_ref()?.get(TAG_HEADER)? {
        FieldValue::LongString(b) | FieldValue::ShortString(b) => Some(b),
        _ => None,
    }
}

/// The consume-queue tag bits (42-63) for a message: its `x-tag`'s hash, or 0.
pub(crate) fn tag_bits(props: &Properties) -> u64 {
    message_tag(props).map_or(0, |t| tag_hash(t) << TAG_HASH_SHIFT)
}

/// The tag hash stored in a consume-queue tag word (0: no tag).
fn stored_hash(tag_word: u64) -> u64 {
    (tag_word >> TAG_HASH_SHIFT) & TAG_HASH_MASK
}

/// `x-tag-filter`: tags separated by `||` (RocketMQ's syntax); `*` alone selects all.
#[derive(Debug, Clone, PartialEq)]
pub struct TagFilter {
    tags: Vec<(u64, Box<[u8]>)>,
}

impl TagFilter {
    /// Parses `a || b || c`. `Ok(None)`: `*`, which selects every message.
    pub fn parse(text: &str) -> Result<Option<TagFilter>, String> {
        let text = text.trim();
        if text == "*" {
            return Ok(None);
        }
        let mut tags: Vec<(u64, Box<[u8]>)> = Vec::new();
        for t in text.split("||").map(str::trim) {
            if t.is_empty() {
                return Err(format!("empty tag in tag filter '{text}'"));
            }
            if t.len() > MAX_TAG_LEN {
                return Err(format!("a tag is longer than {MAX_TAG_LEN} bytes"));
            }
            if t == "*" {
                return Err("'*' selects all tags and cannot be combined with others".into());
            }
            if tags.len() >= MAX_TAGS {
                return Err(format!("more than {MAX_TAGS} tags in a tag filter"));
            }
            if !tags.iter().any(|(_, x)| **x == *t.as_bytes()) {
                tags.push((tag_hash(t.as_bytes()), t.as_bytes().into()));
            }
        }
        Ok(Some(TagFilter { tags }))
    }

    /// From the consume-queue tag word alone: `false` when the message surely has none
    /// of the tags; `true` when its tag's hash is one of theirs (confirm with
    /// [`TagFilter::matches`]).
    pub fn may_match(&self, tag_word: u64) -> bool {
        let h = stored_hash(tag_word);
        h != 0 && self.tags.iter().any(|(x, _)| *x == h)
    }

    /// Whether the message's real `x-tag` is one of the tags.
    pub fn matches(&self, props: &Properties) -> bool {
        message_tag(props).is_some_and(|t| self.tags.iter().any(|(_, x)| **x == *t))
    }
}

/// What a consumer takes from its queue: messages that pass both parts.
#[derive(Debug, Clone, PartialEq)]
pub struct MessageFilter {
    /// The SQL92 selector, if any.
    pub selector: Option<Selector>,
    /// The tag filter, if any.
    pub tags: Option<TagFilter>,
}

impl MessageFilter {
    /// Builds a consumer's filter from a selector and a tag filter text (either may be
    /// absent). `Ok(None)`: nothing to filter. Errors are `PreconditionFailed` naming
    /// what is wrong (AMQP 406; STOMP maps them to an ERROR frame).
    pub fn compile(
        selector: Option<&str>,
        tag_filter: Option<&str>,
    ) -> Result<Option<Arc<MessageFilter>>, CoreError> {
        let selector = match selector.map(str::trim) {
            None | Some("") => None,
            Some(s) => {
                Some(Selector::parse(s).map_err(|e| CoreError::PreconditionFailed(e.to_string()))?)
            }
        };
        let tags = match tag_filter {
            None => None,
            Some(t) => TagFilter::parse(t)
                .map_err(|e| CoreError::PreconditionFailed(format!("invalid x-tag-filter: {e}")))?,
        };
        if selector.is_none() && tags.is_none() {
            return Ok(None);
        }
        Ok(Some(Arc::new(MessageFilter { selector, tags })))
    }

    /// Whether the entry may pass, from its consume-queue tag word alone.
    pub fn may_match(&self, tag_word: u64) -> bool {
        self.tags.as_ref().is_none_or(|t| t.may_match(tag_word))
    }

    /// Whether the message passes (after [`MessageFilter::may_match`]).
    pub fn matches(&self, props: &Properties) -> bool {
        if !self.tags.as_ref().is_none_or(|t| t.matches(props)) {
            return false;
        }
        match &self.selector {
            None => true,
            Some(s) => s.matches(&MessageFields { props }),
        }
    }
}

/// A message seen by a selector: its headers, plus JMS names for the standard
/// properties.
pub struct MessageFields<'a> {
    /// Its properties.
    pub props: &'a Properties,
}

fn field_value(v: &FieldValue) -> Option<Value> {
    Some(match v {
        FieldValue::Bool(b) => Value::Bool(*b),
        FieldValue::I8(n) => Value::Int(i64::from(*n)),
        FieldValue::U8(n) => Value::Int(i64::from(*n)),
        FieldValue::I16(n) => Value::Int(i64::from(*n)),
        FieldValue::U16(n) => Value::Int(i64::from(*n)),
        FieldValue::I32(n) => Value::Int(i64::from(*n)),
        FieldValue::U32(n) => Value::Int(i64::from(*n)),
        FieldValue::I64(n) => Value::Int(*n),
        FieldValue::F32(f) => Value::Float(f64::from(*f)),
        FieldValue::F64(f) => Value::Float(*f),
        FieldValue::Timestamp(t) => Value::Int(i64::try_from(*t).ok()?),
        FieldValue::ShortString(b) | FieldValue::LongString(b) => {
            Value::Str(std::str::from_utf8(b).ok()?.to_string())
        }
        _ => return None,
    })
}

impl Fields for MessageFields<'_> {
    fn field(&self, name: &str) -> Option<Value> {
        let p = self.props;
        let s = |o: &Option<String>| o.as_ref().map(|v| Value::Str(v.clone()));
        match name {
            // JMS's default priority is 4
            "JMSPriority" => Some(Value::Int(i64::from(p.priority.unwrap_or(4)))),
            "JMSMessageID" => s(&p.message_id),
            "JMSCorrelationID" => s(&p.correlation_id),
            "JMSType" => s(&p.message_type),
            "JMSReplyTo" => s(&p.reply_to),
            // AMQP's timestamp is in seconds, JMS's in milliseconds
            "JMSTimestamp" => p
                .timestamp
                .and_then(|t| i64::try_from(t).ok()?.checked_mul(1000))
                .map(Value::Int),
            "JMSDeliveryMode" => Some(Value::Str(
                if p.delivery_mode == Some(2) {
                    "PERSISTENT"
                } else {
                    "NON_PERSISTENT"
                }
                .into(),
            )),
            "JMSExpiration" => None,
            _ => p
                .headers
                .as_ref()
                .and_then(|h| h.get(name))
                .and_then(field_value),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::FieldTable;
    use bytes::Bytes;

    fn props(tag: Option<&str>) -> Properties {
        let mut h = FieldTable::default();
        if let Some(t) = tag {
            h.insert(
                TAG_HEADER,
                FieldValue::LongString(Bytes::from(t.to_string())),
            );
        }
        h.insert("n", FieldValue::I32(7));
        h.insert("s", FieldValue::LongString(Bytes::from_static(b"12")));
        Properties {
            headers: Some(h),
            priority: Some(6),
            delivery_mode: Some(2),
            message_id: Some("m-1".into()),
            timestamp: Some(1_700_000_000),
            ..Default::default()
        }
    }

    #[test]
    fn tag_bits_stay_out_of_the_queue_bits() {
        let t = tag_bits(&props(Some("a")));
        assert_ne!(t, 0);
        assert_eq!(t & ((1 << 42) - 1), 0);
        assert_eq!(tag_bits(&props(None)), 0);
        let word = crate::queue::make_tag(100, 9, true, true) | t;
        assert_eq!(word & 0xffff_ffff, 100);
        assert_eq!(stored_hash(word), stored_hash(t));
    }

    #[test]
    fn tag_filters() {
        let f = TagFilter::parse(" a || b ").unwrap().unwrap();
        let (a, b, c) = (props(Some("a")), props(Some("b")), props(Some("c")));
        assert!(f.may_match(tag_bits(&a)) && f.matches(&a));
        assert!(f.may_match(tag_bits(&b)) && f.matches(&b));
        assert!(!f.matches(&c));
        assert!(!f.may_match(0));
        assert!(!f.matches(&props(None)));
        assert_eq!(TagFilter::parse("*").unwrap(), None);
        assert!(TagFilter::parse("a ||").is_err());
        assert!(TagFilter::parse("a || *").is_err());
        let many: Vec<String> = (0..=MAX_TAGS).map(|i| i.to_string()).collect();
        assert!(TagFilter::parse(&many.join("||")).is_err());
    }

    #[test]
    fn a_hash_collision_is_resolved_by_the_real_tag() {
        // find two tags whose 22-bit hashes collide
        let mut seen = std::collections::HashMap::new();
        let (x, y) = (0..10_000_000u32)
            .find_map(|i| {
                let t = format!("t{i}");
                let h = tag_hash(t.as_bytes());
                seen.insert(h, t.clone()).map(|prev| (prev, t))
            })
            .unwrap();
        let f = TagFilter::parse(&x).unwrap().unwrap();
        let other = props(Some(&y));
        assert!(f.may_match(tag_bits(&other)), "the hashes collide");
        assert!(!f.matches(&other), "the real tag decides");
    }

    #[test]
    fn jms_names_and_headers() {
        let p = props(Some("a"));
        let m = MessageFields { props: &p };
        assert_eq!(m.field("JMSPriority"), Some(Value::Int(6)));
        assert_eq!(m.field("JMSMessageID"), Some(Value::Str("m-1".into())));
        assert_eq!(
            m.field("JMSDeliveryMode"),
            Some(Value::Str("PERSISTENT".into()))
        );
        assert_eq!(m.field("JMSTimestamp"), Some(Value::Int(1_700_000_000_000)));
        assert_eq!(m.field("n"), Some(Value::Int(7)));
        assert_eq!(m.field("JMSCorrelationID"), None);
        let f = MessageFilter::compile(Some("n = 7 AND s > 10 AND JMSPriority > 5"), Some("a"))
            .unwrap()
            .unwrap();
        assert!(f.may_match(tag_bits(&p)) && f.matches(&p));
        let e = MessageFilter::compile(Some("n = "), None).unwrap_err();
        assert!(e.to_string().contains("invalid selector"), "{e}");
        assert_eq!(MessageFilter::compile(Some(" "), None).unwrap(), None);
    }
}

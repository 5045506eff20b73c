//! The consistent-hash exchange (`x-consistent-hash`), compatible with RabbitMQ's
//! plugin: a binding's key is its weight (a positive integer: its share of the keys; a
//! destination bound more than once has the sum), and a message goes to exactly one
//! bound destination, picked from a hash of its routing key, of the header named by the
//! exchange argument `hash-header`, or of the property named by `hash-property`
//! (`message_id`, `correlation_id` or `timestamp`). A message without that header or
//! property hashes as empty, so such messages all go to one destination, as in the
//! plugin.
//!
//! The pick is weighted rendezvous hashing: each destination scores `w / -ln(u)`, `u`
//! uniform in (0, 1) from a hash of the message's input and the destination's name, and
//! the highest score wins. So the choice depends only on the set of destinations and
//! their weights, not on binding order or sort order: the same key reaches the same
//! queue after a restart or a re-declare in another order, and adding, removing or
//! re-weighting a destination moves only the keys that go to or come from it (the
//! plugin numbers buckets in binding order and renumbers on unbind, so removing a
//! binding other than the last moves more). Hashes are FNV-1a with a 64-bit finaliser:
//! stable across versions and platforms.
//!
//! Cost: one entry (destination, name hash, weight) per bound destination; routing is
//! one hash of the input and one score (a multiply and a logarithm) per destination: no
//! per-bucket memory, so a binding of weight 1,000,000 costs what one of weight 1 does.

use std::borrow::Cow;

use super::Destination;
use crate::error::CoreError;
use crate::message::Properties;
use crate::value::{FieldTable, FieldValue};

/// The exchange argument naming the header to hash.
pub const HASH_HEADER: &str = "hash-header";
/// The exchange argument naming the property to hash.
pub const HASH_PROPERTY: &str = "hash-property";
/// The properties `hash-property` may name (the plugin's list).
pub const PROPERTIES: [&str; 3] = ["correlation_id", "message_id", "timestamp"];
/// Largest weight one binding may have.
pub const MAX_WEIGHT: u64 = u32::MAX as u64;

/// What an exchange hashes on, from its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashOn {
    /// The routing key.
    RoutingKey,
    /// A header.
    Header(String),
    /// `correlation_id`, `message_id` or `timestamp`.
    Property(String),
}

impl HashOn {
    /// Reads and validates the exchange's arguments (406 for what the plugin refuses).
    pub fn from_args(exchange: &str, args: &FieldTable) -> Result<HashOn, CoreError> {
        let text = |name: &str| match args.get(name) {
            None => Ok(None),
            Some(v) => v.as_str().map(|s| Some(s.to_string())).ok_or_else(|| {
                CoreError::PreconditionFailed(format!(
                    "invalid arg '{name}' for exchange '{exchange}': expected a string"
                ))
            }),
        };
        match (text(HASH_HEADER)?, text(HASH_PROPERTY)?) {
            (None, None) => Ok(HashOn::RoutingKey),
            (Some(h), None) => Ok(HashOn::Header(h)),
            (None, Some(p)) if PROPERTIES.contains(&p.as_str()) => Ok(HashOn::Property(p)),
            (None, Some(p)) => Err(CoreError::PreconditionFailed(format!(
                "Unsupported property: {p} (hash-property takes correlation_id, message_id or timestamp)"
            ))),
            (Some(_), Some(_)) => Err(CoreError::PreconditionFailed(
                "hash-header and hash-property are mutually exclusive".into(),
            )),
        }
    }

    /// The bytes hashed for a message (empty when it lacks the header or property):
    /// borrowed from the message, except a number's text.
    pub fn input<'a>(
        &self,
        routing_key: &'a str,
        headers: Option<&'a FieldTable>,
        props: Option<&'a Properties>,
    ) -> Cow<'a, [u8]> {
        match self {
            HashOn::RoutingKey => Cow::Borrowed(routing_key.as_bytes()),
            HashOn::Header(h) => headers
                .and_then(|t| t.get(h))
                .map_or(Cow::Borrowed(&[][..]), value_bytes),
            HashOn::Property(p) => {
                let Some(props) = props else {
                    return Cow::Borrowed(&[]);
                };
                match p.as_str() {
                    "correlation_id" => props.correlation_id.as_deref().map(str::as_bytes),
                    "message_id" => props.message_id.as_deref().map(str::as_bytes),
                    _ => {
                        return props.timestamp.map_or(Cow::Borrowed(&[][..]), |t| {
                            Cow::Owned(t.to_string().into_bytes())
                        })
                    }
                }
                .map_or(Cow::Borrowed(&[][..]), Cow::Borrowed)
            }
        }
    }
}

/// A header value as hashed: strings as their bytes, numbers and booleans as their
/// decimal text (so `1` and `"1"` from different clients hash alike); other types as
/// their debug form.
fn value_bytes(v: &FieldValue) -> Cow<'_, [u8]> {
    if let Some(b) = v.as_bytes() {
        return Cow::Borrowed(b);
    }
    if let Some(n) = v.as_i64() {
        return Cow::Owned(n.to_string().into_bytes());
    }
    Cow::Owned(match v {
        FieldValue::Bool(b) => b.to_string().into_bytes(),
        FieldValue::F32(f) => f.to_string().into_bytes(),
        FieldValue::F64(f) => f.to_string().into_bytes(),
        FieldValue::Void => Vec::new(),
        other => format!("{other:?}").into_bytes(),
    })
}

/// Parses a binding key as a weight: a positive integer (the plugin's rule).
pub fn weight(key: &str) -> Result<u64, CoreError> {
    match key.trim().parse::<u64>() {
        Ok(w @ 1..=MAX_WEIGHT) => Ok(w),
        Ok(0) => Err(CoreError::PreconditionFailed(
            "The binding key must be greater than 0".into(),
        )),
        _ => Err(CoreError::PreconditionFailed(format!(
            "The binding key must be an integer (the destination's weight on the hash ring), got '{key}'"
        ))),
    }
}

/// 64-bit hash of a key: FNV-1a, then splitmix64's finaliser to spread the low bits.
pub fn hash(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in b {
        h ^= u64::from(*x);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    mix(h)
}

/// splitmix64's finaliser.
fn mix(mut h: u64) -> u64 {
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// A destination's identity on the ring: the hash of its kind and name.
fn salt(d: &Destination) -> u64 {
    let (kind, name) = match d {
        Destination::Queue(n) => (b'q', n),
        Destination::Exchange(n) => (b'x', n),
    };
    let mut b = Vec::with_capacity(name.len() + 1);
    b.push(kind);
    b.extend_from_slice(name.as_bytes());
    hash(&b)
}

/// Weighted rendezvous score of a destination (identity `salt`, weight `w`) for a key
/// hashed to `h`: `w / -ln(u)` with `u` uniform in (0, 1) from `h` and `salt`. The
/// destination with the highest score wins; its chance is its share of the weights.
fn score(h: u64, salt: u64, w: u64) -> f64 {
    let x = mix(h ^ salt);
    let u = ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    w as f64 / -u.ln()
}

/// One destination on an exchange's ring: the sum of its bindings' weights.
#[derive(Debug)]
struct Entry {
    destination: Destination,
    salt: u64,
    weight: u64,
}

/// One exchange's ring: each bound destination with its total weight, sorted by
/// destination (so that ties, astronomically rare, break the same way everywhere).
#[derive(Debug, Default)]
pub struct Ring {
    entries: Vec<Entry>,
}

impl Ring {
    fn find(&self, destination: &Destination) -> Result<usize, usize> {
        self.entries
            .binary_search_by(|e| e.destination.cmp(destination))
    }

    /// Adds a binding (its key already validated by [`weight`]): its weight adds to its
    /// destination's.
    pub fn insert(&mut self, destination: Destination, key: &str) {
        let Ok(w) = weight(key) else {
            return;
        };
        match self.find(&destination) {
            Ok(i) => {
                if let Some(e) = self.entries.get_mut(i) {
                    e.weight = e.weight.saturating_add(w);
                }
            }
            Err(i) => self.entries.insert(
                i,
                Entry {
                    salt: salt(&destination),
                    destination,
                    weight: w,
                },
            ),
        }
    }

    /// Removes one binding: its weight comes off its destination's (another binding with
    /// the same destination and key, other arguments, keeps its share).
    pub fn remove(&mut self, destination: &Destination, key: &str) {
        let Ok(w) = weight(key) else {
            return;
        };
        let Ok(i) = self.find(destination) else {
            return;
        };
        if let Some(e) = self.entries.get_mut(i) {
            e.weight = e.weight.saturating_sub(w);
            if e.weight == 0 {
                self.entries.remove(i);
                self.entries.shrink_to_fit();
            }
        }
    }

    /// Removes every binding of `destination`.
    pub fn remove_destination(&mut self, destination: &Destination) {
        if let Ok(i) = self.find(destination) {
            self.entries.remove(i);
            self.entries.shrink_to_fit();
        }
    }

    /// The destination for a message whose hash input is `input`, if any is bound.
    pub fn route(&self, input: &[u8]) -> Option<&Destination> {
        let h = hash(input);
        let mut best: Option<(f64, &Destination)> = None;
        for e in &self.entries {
            let s = score(h, e.salt, e.weight);
            if best.is_none_or(|(b, _)| s > b) {
                best = Some((s, &e.destination));
            }
        }
        best.map(|(_, d)| d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn q(n: &str) -> Destination {
        Destination::queue(n)
    }

    fn spread(r: &Ring, n: usize) -> HashMap<String, usize> {
        let mut m = HashMap::new();
        for i in 0..n {
            let d = r.route(format!("key-{i}").as_bytes()).unwrap();
            *m.entry(d.name().to_string()).or_default() += 1;
        }
        m
    }

    #[test]
    fn weights_are_positive_integers() {
        assert_eq!(weight("3").unwrap(), 3);
        assert_eq!(weight(" 10 ").unwrap(), 10);
        for bad in ["0", "-1", "x", "", "1.5", "99999999999"] {
            assert!(weight(bad).is_err(), "{bad}");
        }
    }

    fn routes(r: &Ring, n: usize) -> Vec<Destination> {
        (0..n)
            .map(|i| r.route(format!("key-{i}").as_bytes()).unwrap().clone())
            .collect()
    }

    #[test]
    fn a_binding_in_the_middle_moves_only_its_share() {
        // q10 sorts between q1 and q2: with buckets numbered in sorted order this moved
        // ~8/9 of the keys; rendezvous hashing moves only those q10 takes (~1/10)
        let mut r = Ring::default();
        for i in 1..=9 {
            r.insert(q(&format!("q{i}")), "1");
        }
        let before = routes(&r, 20_000);
        r.insert(q("q10"), "1");
        let after = routes(&r, 20_000);
        let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
        assert!((1_500..2_500).contains(&moved), "{moved}");
        for (a, b) in before.iter().zip(&after) {
            assert!(a == b || *b == q("q10"), "{a:?} -> {b:?}");
        }
        // and removing it again puts every key back
        r.remove(&q("q10"), "1");
        assert_eq!(routes(&r, 20_000), before);
        // removing one in the middle moves only its keys
        r.remove_destination(&q("q3"));
        let without = routes(&r, 20_000);
        for (a, b) in before.iter().zip(&without) {
            assert!(a == b || *a == q("q3"), "{a:?} -> {b:?}");
        }
    }

    #[test]
    fn two_bindings_with_the_same_key_are_two_weights() {
        // (q, "10", {}) and (q, "10", {a: 1}): unbinding one keeps the other's share
        let mut r = Ring::default();
        r.insert(q("a"), "10");
        r.insert(q("a"), "10");
        r.insert(q("b"), "20");
        let s = spread(&r, 40_000);
        assert!((18_000..22_000).contains(&s["a"]), "{s:?}");
        r.remove(&q("a"), "10");
        let s = spread(&r, 30_000);
        assert!((8_000..12_000).contains(&s["a"]), "{s:?}");
        r.remove(&q("a"), "10");
        assert_eq!(spread(&r, 1_000).get("a"), None);
    }

    #[test]
    fn weights_share_the_keys() {
        let mut r = Ring::default();
        assert!(r.route(b"k").is_none());
        r.insert(q("a"), "1");
        r.insert(q("b"), "1");
        r.insert(q("c"), "2");
        let s = spread(&r, 40_000);
        let (a, b, c) = (s["a"], s["b"], s["c"]);
        assert!((8_000..12_000).contains(&a), "{s:?}");
        assert!((8_000..12_000).contains(&b), "{s:?}");
        assert!((18_000..22_000).contains(&c), "{s:?}");
        // the same key always goes to the same destination
        for i in 0..100 {
            let k = format!("k{i}");
            assert_eq!(r.route(k.as_bytes()), r.route(k.as_bytes()));
        }
    }

    #[test]
    fn the_ring_depends_on_the_bindings_not_their_order() {
        let mut r1 = Ring::default();
        let mut r2 = Ring::default();
        for (d, k) in [("a", "1"), ("b", "3"), ("c", "2")] {
            r1.insert(q(d), k);
        }
        for (d, k) in [("c", "2"), ("a", "1"), ("b", "3")] {
            r2.insert(q(d), k);
        }
        for i in 0..1000 {
            let k = format!("k{i}");
            assert_eq!(r1.route(k.as_bytes()), r2.route(k.as_bytes()));
        }
        // removing the last destination moves only its keys
        let before: Vec<_> = (0..1000)
            .map(|i| r1.route(format!("k{i}").as_bytes()).cloned())
            .collect();
        r1.remove_destination(&q("c"));
        for (i, was) in before.iter().enumerate() {
            let now = r1.route(format!("k{i}").as_bytes()).cloned();
            if was.as_ref() != Some(&q("c")) {
                assert_eq!(&now, was);
            }
        }
        r1.remove(&q("a"), "1");
        r1.remove(&q("b"), "3");
        assert!(r1.route(b"k").is_none());
    }

    #[test]
    fn arguments_pick_what_is_hashed() {
        let mut args = FieldTable::new();
        assert_eq!(HashOn::from_args("x", &args).unwrap(), HashOn::RoutingKey);
        args.insert(HASH_HEADER, "user");
        let on = HashOn::from_args("x", &args).unwrap();
        let h: FieldTable = [("user", 42i32)].into_iter().collect();
        assert_eq!(&*on.input("rk", Some(&h), None), b"42");
        assert_eq!(&*on.input("rk", None, None), b"");
        args.insert(HASH_PROPERTY, "message_id");
        assert!(HashOn::from_args("x", &args)
            .unwrap_err()
            .to_string()
            .contains("mutually exclusive"));
        let mut p = FieldTable::new();
        p.insert(HASH_PROPERTY, "message_id");
        let on = HashOn::from_args("x", &p).unwrap();
        let props = Properties {
            message_id: Some("m1".into()),
            ..Default::default()
        };
        assert_eq!(&*on.input("rk", None, Some(&props)), b"m1");
        p.insert(HASH_PROPERTY, "app_id");
        assert!(HashOn::from_args("x", &p)
            .unwrap_err()
            .to_string()
            .contains("Unsupported property"));
    }
}

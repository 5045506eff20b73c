//! One exchange's bindings and the index its kind routes with.

use std::collections::{HashMap, HashSet};

use super::consistent_hash::Ring;
use super::exchange::ExchangeKind;
use super::headers::headers_match;
use super::topic::TopicTrie;
use super::Destination;
use crate::value::FieldTable;

/// Up to this many bindings of one destination are kept in a vector searched linearly.
const SMALL: usize = 16;

/// The (key, arguments) pairs binding one destination: a vector sized to what it holds
/// while small (most destinations have a few bindings), a map from key once large.
///
/// Memory per binding (a fleet has one to ten per queue): the key's allocation plus a
/// 40-byte entry in the small vector (the old map of maps cost about 220 bytes).
#[derive(Debug)]
enum DestBindings {
    Small(Vec<(Box<str>, FieldTable)>),
    Big(HashMap<Box<str>, Vec<FieldTable>>),
}

impl DestBindings {
    fn contains(&self, key: &str, args: &FieldTable) -> bool {
        match self {
            DestBindings::Small(v) => v.iter().any(|(k, a)| &**k == key && a == args),
            DestBindings::Big(m) => m.get(key).is_some_and(|vs| vs.contains(args)),
        }
    }

    fn has_key(&self, key: &str) -> bool {
        match self {
            DestBindings::Small(v) => v.iter().any(|(k, _)| &**k == key),
            DestBindings::Big(m) => m.contains_key(key),
        }
    }

    /// Adds (key, args) if missing; returns (added, first binding with this key).
    fn insert(&mut self, key: &str, args: FieldTable) -> (bool, bool) {
        if self.contains(key, &args) {
            return (false, false);
        }
        let first = !self.has_key(key);
        match self {
            DestBindings::Small(v) if v.len() < SMALL => {
                // grown one at a time: no spare capacity held by the many small ones
                v.reserve_exact(1);
                v.push((key.into(), args));
            }
            DestBindings::Small(v) => {
                let mut m: HashMap<Box<str>, Vec<FieldTable>> = HashMap::new();
                for (k, a) in v.drain(..) {
                    m.entry(k).or_default().push(a);
                }
                m.entry(key.into()).or_default().push(args);
                *self = DestBindings::Big(m);
            }
            DestBindings::Big(m) => m.entry(key.into()).or_default().push(args),
        }
        (true, first)
    }

    /// Removes (key, args); returns (removed, it was the last binding with this key).
    fn remove(&mut self, key: &str, args: &FieldTable) -> (bool, bool) {
        match self {
            DestBindings::Small(v) => {
                let Some(i) = v.iter().position(|(k, a)| &**k == key && a == args) else {
                    return (false, false);
                };
                v.swap_remove(i);
                v.shrink_to_fit();
                (true, !v.iter().any(|(k, _)| &**k == key))
            }
            DestBindings::Big(m) => {
                let Some(vs) = m.get_mut(key) else {
                    return (false, false);
                };
                let Some(i) = vs.iter().position(|a| a == args) else {
                    return (false, false);
                };
                vs.swap_remove(i);
                let last = vs.is_empty();
                if last {
                    m.remove(key);
                }
                (true, last)
            }
        }
    }

    fn len(&self) -> usize {
        match self {
            DestBindings::Small(v) => v.len(),
            DestBindings::Big(m) => m.values().map(Vec::len).sum(),
        }
    }

    fn iter(&self) -> Box<dyn Iterator<Item = (&str, &FieldTable)> + '_> {
        match self {
            DestBindings::Small(v) => Box::new(v.iter().map(|(k, a)| (&**k, a))),
            DestBindings::Big(m) => Box::new(
                m.iter()
                    .flat_map(|(k, vs)| vs.iter().map(move |a| (&**k, a))),
            ),
        }
    }

    /// Each key once.
    fn keys(&self) -> Vec<&str> {
        match self {
            DestBindings::Small(v) => {
                let mut keys: Vec<&str> = v.iter().map(|(k, _)| &**k).collect();
                keys.sort_unstable();
                keys.dedup();
                keys
            }
            DestBindings::Big(m) => m.keys().map(|k| &**k).collect(),
        }
    }
}

/// The bindings whose source is one exchange.
///
/// A binding is identified, as in RabbitMQ, by (destination, key, arguments): the same
/// destination may be bound several times with different keys or arguments. The
/// authoritative set is kept per destination; direct and topic exchanges also keep an
/// index over (key, destination) pairs so routing never scans every binding. Headers
/// exchanges scan (as RabbitMQ does); fanout exchanges route to every destination;
/// consistent-hash exchanges keep their [`Ring`].
///
/// A destination's name is stored once: the indexes hold clones of the [`Destination`]
/// this table keeps as the key of its bindings (shared, not copied).
#[derive(Debug)]
pub struct BindingTable {
    kind: ExchangeKind,
    by_destination: HashMap<Destination, DestBindings>,
    len: usize,
    direct: HashMap<String, HashSet<Destination>>,
    topic: TopicTrie,
    ring: Ring,
}

impl BindingTable {
    /// An empty table for an exchange of this kind.
    pub fn new(kind: ExchangeKind) -> Self {
        BindingTable {
            kind,
            by_destination: HashMap::new(),
            len: 0,
            direct: HashMap::new(),
            topic: TopicTrie::new(),
            ring: Ring::default(),
        }
    }

    /// The exchange kind this table routes for.
    pub fn kind(&self) -> ExchangeKind {
        self.kind
    }

    /// Number of bindings.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no bindings.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether this exact binding exists.
    pub fn contains(&self, destination: &Destination, key: &str, args: &FieldTable) -> bool {
        self.by_destination
            .get(destination)
            .is_some_and(|b| b.contains(key, args))
    }

    /// Whether any binding leads to `destination`.
    pub fn has_destination(&self, destination: &Destination) -> bool {
        self.by_destination.contains_key(destination)
    }

    /// Adds a binding. Returns false if it already existed.
    pub fn insert(&mut self, destination: Destination, key: &str, args: FieldTable) -> bool {
        // the table's own copy of the name, if it has one
        let destination = match self.by_destination.get_key_value(&destination) {
            Some((d, _)) => d.clone(),
            None => destination,
        };
        let (added, first_for_key) = self
            .by_destination
            .entry(destination.clone())
            .or_insert_with(|| DestBindings::Small(Vec::new()))
            .insert(key, args);
        if !added {
            return false;
        }
        self.len += 1;
        if self.kind == ExchangeKind::ConsistentHash {
            self.ring.insert(destination.clone(), key);
        }
        if first_for_key {
            match self.kind {
                ExchangeKind::Direct => {
                    self.direct
                        .entry(key.to_owned())
                        .or_default()
                        .insert(destination);
                }
                ExchangeKind::Topic => {
                    self.topic.insert(key, destination);
                }
                ExchangeKind::Fanout | ExchangeKind::Headers | ExchangeKind::ConsistentHash => {}
            }
        }
        true
    }

    /// Removes a binding. Returns whether it existed.
    pub fn remove(&mut self, destination: &Destination, key: &str, args: &FieldTable) -> bool {
        let Some(bindings) = self.by_destination.get_mut(destination) else {
            return false;
        };
        let (removed, last_for_key) = bindings.remove(key, args);
        if !removed {
            return false;
        }
        self.len -= 1;
        if self.kind == ExchangeKind::ConsistentHash {
            self.ring.remove(destination, key);
        }
        if bindings.len() == 0 {
            self.by_destination.remove(destination);
        }
        if last_for_key {
            self.unindex(destination, key);
        }
        true
    }

    /// Removes every binding to `destination` (it was deleted). Returns how many.
    pub fn remove_destination(&mut self, destination: &Destination) -> usize {
        let Some(bindings) = self.by_destination.remove(destination) else {
            return 0;
        };
        for key in bindings.keys() {
            self.unindex(destination, key);
        }
        let removed = bindings.len();
        self.len -= removed;
        if self.kind == ExchangeKind::ConsistentHash {
            self.ring.remove_destination(destination);
        }
        removed
    }

    fn unindex(&mut self, destination: &Destination, key: &str) {
        match self.kind {
            ExchangeKind::Direct => {
                if let Some(set) = self.direct.get_mut(key) {
                    set.remove(destination);
                    if set.is_empty() {
                        self.direct.remove(key);
                    }
                }
            }
            ExchangeKind::Topic => {
                self.topic.remove(key, destination);
            }
            ExchangeKind::Fanout | ExchangeKind::Headers | ExchangeKind::ConsistentHash => {}
        }
    }

    /// Every binding as (destination, key, arguments), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&Destination, &str, &FieldTable)> {
        self.by_destination
            .iter()
            .flat_map(|(d, b)| b.iter().map(move |(k, a)| (d, k, a)))
    }

    /// The destination a consistent-hash exchange picks for a message whose hash input
    /// (routing key, header or property: [`super::consistent_hash::HashOn`]) is `input`.
    pub fn route_hashed(&self, input: &[u8]) -> Option<&Destination> {
        self.ring.route(input)
    }

    /// Calls `emit` for each destination a message with this key and headers goes to.
    /// A destination may be emitted more than once; callers de-duplicate.
    pub fn route<'a>(
        &'a self,
        key: &str,
        headers: Option<&FieldTable>,
        emit: &mut dyn FnMut(&'a Destination),
    ) {
        match self.kind {
            ExchangeKind::Direct => {
                if let Some(set) = self.direct.get(key) {
                    set.iter().for_each(emit);
                }
            }
            ExchangeKind::Fanout => self.by_destination.keys().for_each(emit),
            ExchangeKind::Topic => self.topic.route(key, emit),
            // routed by the topology through `route_hashed`, with what the exchange's
            // arguments say to hash (routing key, header or property)
            ExchangeKind::ConsistentHash => {}
            ExchangeKind::Headers => {
                for (destination, bindings) in &self.by_destination {
                    if bindings
                        .iter()
                        .any(|(_, args)| headers_match(args, headers))
                    {
                        emit(destination);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::FieldValue;
    use std::sync::Arc;

    fn q(name: &str) -> Destination {
        Destination::queue(name)
    }

    fn routed(t: &BindingTable, key: &str, headers: Option<&FieldTable>) -> Vec<Destination> {
        let mut out = Vec::new();
        t.route(key, headers, &mut |d| out.push(d.clone()));
        out.sort();
        out.dedup();
        out
    }

    #[test]
    fn identity_includes_arguments() {
        let mut t = BindingTable::new(ExchangeKind::Direct);
        let a: FieldTable = [("a", 1i32)].into_iter().collect();
        assert!(t.insert(q("q"), "k", FieldTable::new()));
        assert!(!t.insert(q("q"), "k", FieldTable::new()));
        assert!(t.insert(q("q"), "k", a.clone()));
        assert_eq!(t.len(), 2);
        assert_eq!(routed(&t, "k", None), [q("q")]);
        assert!(t.remove(&q("q"), "k", &FieldTable::new()));
        assert_eq!(
            routed(&t, "k", None),
            [q("q")],
            "still bound with the other arguments"
        );
        assert!(t.remove(&q("q"), "k", &a));
        assert!(!t.remove(&q("q"), "k", &a));
        assert!(routed(&t, "k", None).is_empty());
        assert!(t.is_empty());
    }

    #[test]
    fn remove_destination_clears_indexes() {
        for kind in [
            ExchangeKind::Direct,
            ExchangeKind::Fanout,
            ExchangeKind::Topic,
            ExchangeKind::Headers,
        ] {
            let mut t = BindingTable::new(kind);
            t.insert(q("a"), "k", FieldTable::new());
            t.insert(q("a"), "#", FieldTable::new());
            t.insert(q("b"), "k", FieldTable::new());
            assert_eq!(t.remove_destination(&q("a")), 2, "{kind}");
            assert_eq!(t.len(), 1);
            assert!(!t.has_destination(&q("a")));
            assert_eq!(routed(&t, "k", None), [q("b")], "{kind}");
            assert_eq!(t.iter().count(), 1);
        }
    }

    #[test]
    fn many_bindings_of_one_destination_switch_to_a_map() {
        for kind in [ExchangeKind::Direct, ExchangeKind::Topic] {
            let mut t = BindingTable::new(kind);
            let a: FieldTable = [("a", 1i32)].into_iter().collect();
            for i in 0..100 {
                assert!(t.insert(q("q"), &format!("k{i}"), FieldTable::new()));
                assert!(!t.insert(q("q"), &format!("k{i}"), FieldTable::new()));
            }
            assert!(t.insert(q("q"), "k7", a.clone()));
            assert_eq!(t.len(), 101);
            assert!(t.contains(&q("q"), "k7", &a));
            assert_eq!(routed(&t, "k42", None), [q("q")]);
            // k7 stays routed while one of its two bindings is left
            assert!(t.remove(&q("q"), "k7", &FieldTable::new()));
            assert_eq!(routed(&t, "k7", None), [q("q")]);
            assert!(t.remove(&q("q"), "k7", &a));
            assert!(routed(&t, "k7", None).is_empty());
            assert_eq!(t.iter().count(), 99);
            assert_eq!(t.remove_destination(&q("q")), 99);
            assert!(t.is_empty() && routed(&t, "k42", None).is_empty());
        }
    }

    #[test]
    fn a_destination_name_is_stored_once() {
        let mut t = BindingTable::new(ExchangeKind::Topic);
        let first = q("device-queue");
        t.insert(first.clone(), "a.b", FieldTable::new());
        // a new name with the same text: the table's copy is used for the trie
        t.insert(q("device-queue"), "a.*", FieldTable::new());
        let Destination::Queue(mine) = t.by_destination.keys().next().unwrap().clone() else {
            panic!("a queue")
        };
        let mut routed_names = Vec::new();
        t.route("a.b", None, &mut |d| {
            if let Destination::Queue(n) = d {
                routed_names.push(n.clone());
            }
        });
        assert_eq!(routed_names.len(), 2);
        assert!(routed_names.iter().all(|n| Arc::ptr_eq(n, &mine)));
    }

    #[test]
    fn headers_table_ignores_key() {
        let mut t = BindingTable::new(ExchangeKind::Headers);
        let args: FieldTable = [
            ("x-match", FieldValue::from("any")),
            ("a", FieldValue::Void),
        ]
        .into_iter()
        .collect();
        t.insert(q("q"), "ignored", args);
        let h: FieldTable = [("a", 1i32)].into_iter().collect();
        assert_eq!(routed(&t, "whatever", Some(&h)), [q("q")]);
        assert!(routed(&t, "ignored", None).is_empty());
    }
}

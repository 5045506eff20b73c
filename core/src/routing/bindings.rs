//! One exchange's bindings and the index its kind routes with.

use std::collections::{HashMap, HashSet};

use super::exchange::ExchangeKind;
use super::headers::headers_match;
use super::topic::TopicTrie;
use super::Destination;
use crate::value::FieldTable;

/// The bindings whose source is one exchange.
///
/// A binding is identified, as in RabbitMQ, by (destination, key, arguments): the same
/// destination may be bound several times with different keys or arguments. The
/// authoritative set is kept per destination; direct and topic exchanges also keep an
/// index over (key, destination) pairs so routing never scans every binding. Headers
/// exchanges scan (as RabbitMQ does); fanout exchanges route to every destination.
#[derive(Debug)]
pub struct BindingTable {
    kind: ExchangeKind,
    by_destination: HashMap<Destination, HashMap<String, Vec<FieldTable>>>,
    len: usize,
    direct: HashMap<String, HashSet<Destination>>,
    topic: TopicTrie,
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
            .and_then(|keys| keys.get(key))
            .is_some_and(|variants| variants.contains(args))
    }

    /// Whether any binding leads to `destination`.
    pub fn has_destination(&self, destination: &Destination) -> bool {
        self.by_destination.contains_key(destination)
    }

    /// Adds a binding. Returns false if it already existed.
    pub fn insert(&mut self, destination: Destination, key: &str, args: FieldTable) -> bool {
        let keys = self.by_destination.entry(destination.clone()).or_default();
        let variants = keys.entry(key.to_owned()).or_default();
        if variants.contains(&args) {
            return false;
        }
        let first_for_key = variants.is_empty();
        variants.push(args);
        self.len += 1;
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
                ExchangeKind::Fanout | ExchangeKind::Headers => {}
            }
        }
        true
    }

    /// Removes a binding. Returns whether it existed.
    pub fn remove(&mut self, destination: &Destination, key: &str, args: &FieldTable) -> bool {
        let Some(keys) = self.by_destination.get_mut(destination) else {
            return false;
        };
        let Some(variants) = keys.get_mut(key) else {
            return false;
        };
        let Some(pos) = variants.iter().position(|a| a == args) else {
            return false;
        };
        variants.swap_remove(pos);
        self.len -= 1;
        if variants.is_empty() {
            keys.remove(key);
            if keys.is_empty() {
                self.by_destination.remove(destination);
            }
            self.unindex(destination, key);
        }
        true
    }

    /// Removes every binding to `destination` (it was deleted). Returns how many.
    pub fn remove_destination(&mut self, destination: &Destination) -> usize {
        let Some(keys) = self.by_destination.remove(destination) else {
            return 0;
        };
        let mut removed = 0;
        for (key, variants) in keys {
            removed += variants.len();
            self.unindex(destination, &key);
        }
        self.len -= removed;
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
            ExchangeKind::Fanout | ExchangeKind::Headers => {}
        }
    }

    /// Every binding as (destination, key, arguments), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&Destination, &str, &FieldTable)> {
        self.by_destination.iter().flat_map(|(d, keys)| {
            keys.iter()
                .flat_map(move |(k, variants)| variants.iter().map(move |a| (d, k.as_str(), a)))
        })
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
            ExchangeKind::Headers => {
                for (destination, keys) in &self.by_destination {
                    if keys
                        .values()
                        .flatten()
                        .any(|args| headers_match(args, headers))
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

    fn q(name: &str) -> Destination {
        Destination::Queue(name.to_owned())
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

//! Retained messages: an in-memory topic trie for lookups by filter, over a
//! [`DurableLog`] that keeps them across restarts (rebuilt into the trie at start).
//!
//! A lookup walks only the trie nodes the filter can reach: a literal level follows one
//! child, `+` every child of one node, `#` one subtree; so the cost depends on the
//! matches, not on how many topics are retained (1M retained topics cost memory, not
//! lookup time). Walks are iterative: a topic of 30,000 empty levels cannot overflow the
//! stack.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use triad_core::Durability;
use triad_core::{ConnectionId, CoreError, Vhost};

use crate::durable::DurableLog;

/// A retained message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retained {
    /// Its topic.
    pub topic: Arc<str>,
    /// Its payload (never empty: an empty one clears the topic).
    pub payload: Bytes,
    /// The QoS it was published with.
    pub qos: u8,
}

#[derive(Debug, Default)]
struct Node {
    children: HashMap<Box<str>, Node>,
    value: Option<Retained>,
}

impl Drop for Node {
    /// Iterative, so a chain of 30,000 levels does not overflow the stack.
    fn drop(&mut self) {
        let mut stack: Vec<Node> = self.children.drain().map(|(_, n)| n).collect();
        while let Some(mut n) = stack.pop() {
            stack.extend(n.children.drain().map(|(_, c)| c));
        }
    }
}

/// Topic → retained message, searchable by filter.
#[derive(Debug, Default)]
pub struct RetainedTrie {
    root: Node,
    len: usize,
}

impl RetainedTrie {
    /// Topics held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sets the retained message of its topic.
    pub fn insert(&mut self, r: Retained) {
        let mut node = &mut self.root;
        for level in r.topic.split('/') {
            node = node.children.entry(Box::from(level)).or_default();
        }
        if node.value.replace(r).is_none() {
            self.len += 1;
        }
    }

    /// Clears a topic, pruning nodes left empty.
    pub fn remove(&mut self, topic: &str) -> Option<Retained> {
        let levels: Vec<&str> = topic.split('/').collect();
        // the deepest node on the path that must stay: its child on the path is where
        // an empty chain starts
        let mut cut = 0usize;
        let mut node = &mut self.root;
        for (i, level) in levels.iter().enumerate() {
            if node.value.is_some() || node.children.len() > 1 {
                cut = i;
            }
            node = node.children.get_mut(*level)?;
        }
        let v = node.value.take()?;
        self.len -= 1;
        if node.children.is_empty() {
            let mut n = &mut self.root;
            for level in levels.iter().take(cut) {
                match n.children.get_mut(*level) {
                    Some(c) => n = c,
                    None => return Some(v),
                }
            }
            if let Some(level) = levels.get(cut) {
                n.children.remove(*level);
            }
        }
        Some(v)
    }

    /// The retained message of exactly `topic`.
    pub fn get(&self, topic: &str) -> Option<&Retained> {
        let mut node = &self.root;
        for level in topic.split('/') {
            node = node.children.get(level)?;
        }
        node.value.as_ref()
    }

    /// Every retained message whose topic matches `filter` (a valid filter), with the
    /// `$` rule [MQTT-4.7.2-1].
    pub fn matching(&self, filter: &str) -> Vec<Retained> {
        let levels: Vec<&str> = filter.split('/').collect();
        let mut out = Vec::new();
        let mut stack: Vec<(&Node, usize)> = vec![(&self.root, 0)];
        let visible = |depth: usize, key: &str| depth > 0 || !key.starts_with('$');
        while let Some((node, i)) = stack.pop() {
            match levels.get(i).copied() {
                None => {
                    if let Some(v) = &node.value {
                        out.push(v.clone());
                    }
                }
                Some("#") => {
                    // "a/#" matches "a" too [MQTT-4.7.1-2]
                    if let Some(v) = &node.value {
                        out.push(v.clone());
                    }
                    let mut sub: Vec<&Node> = node
                        .children
                        .iter()
                        .filter(|(k, _)| visible(i, k))
                        .map(|(_, c)| c)
                        .collect();
                    while let Some(n) = sub.pop() {
                        if let Some(v) = &n.value {
                            out.push(v.clone());
                        }
                        sub.extend(n.children.values());
                    }
                }
                Some("+") => {
                    for (k, c) in &node.children {
                        if visible(i, k) {
                            stack.push((c, i + 1));
                        }
                    }
                }
                Some(lit) => {
                    if let Some(c) = node.children.get(lit) {
                        stack.push((c, i + 1));
                    }
                }
            }
        }
        out
    }
}

/// The retained messages one client is owed for its SUBSCRIBEs [MQTT-3.3.1-6], handed
/// out one at a time as its outbound window allows, so that a client that does not read
/// (or does not acknowledge) holds no more than that window: a filter's matches are
/// looked up only when the previous filter's have gone, and each is a shared handle on
/// the stored payload, not a copy. A filter already waiting is not queued twice (a
/// SUBSCRIBE repeating a filter, or subscribing again before the first is served, gets
/// its retained messages once, at the QoS granted last).
#[derive(Debug, Default)]
pub struct RetainedFeed {
    filters: VecDeque<Box<str>>,
    granted: HashMap<Box<str>, u8>,
    /// Matches of the filter being served, last first.
    current: Vec<Retained>,
    /// The QoS granted to that filter.
    current_qos: u8,
}

impl RetainedFeed {
    /// Owes the client the retained messages matching `filter`, granted `qos`.
    pub fn push(&mut self, filter: &str, qos: u8) {
        match self.granted.get_mut(filter) {
            Some(q) => *q = qos,
            None => {
                self.granted.insert(Box::from(filter), qos);
                self.filters.push_back(Box::from(filter));
            }
        }
    }

    /// Stops owing the retained messages of `filter` (UNSUBSCRIBE) if they have not
    /// started going out [MQTT-3.10.4-2].
    pub fn remove(&mut self, filter: &str) {
        self.granted.remove(filter);
    }

    /// Whether nothing is owed.
    pub fn is_empty(&self) -> bool {
        self.current.is_empty() && self.filters.is_empty()
    }

    /// Whether [`RetainedFeed::next`] would hand something out now; `id_free`: whether
    /// a packet identifier may be taken (the outbound window is not full).
    pub fn ready(&self, id_free: bool) -> bool {
        match self.current.last() {
            Some(r) => id_free || r.qos.min(self.current_qos) == 0,
            None => !self.filters.is_empty(),
        }
    }

    /// The next retained message owed, its `qos` lowered to the one to send it with;
    /// `None` when nothing is owed, or when the next one needs a packet identifier and
    /// `id_free` is false. `lookup` gives the retained messages matching a filter.
    pub fn next(
        &mut self,
        lookup: impl Fn(&str) -> Vec<Retained>,
        id_free: bool,
    ) -> Option<Retained> {
        loop {
            if let Some(r) = self.current.last() {
                let qos = r.qos.min(self.current_qos);
                if qos > 0 && !id_free {
                    return None;
                }
                let mut r = self.current.pop()?;
                r.qos = qos;
                return Some(r);
            }
            let filter = self.filters.pop_front()?;
            // no longer owed: unsubscribed before its turn
            let Some(qos) = self.granted.remove(&filter) else {
                continue;
            };
            self.current_qos = qos;
            self.current = lookup(&filter);
            self.current.reverse();
        }
    }
}

/// The retained messages of one vhost.
#[derive(Debug)]
pub struct RetainedStore {
    trie: RwLock<RetainedTrie>,
    log: DurableLog,
}

/// The queue that holds a vhost's retained messages (a name reserved to the broker).
pub const RETAINED_QUEUE: &str = "amq.triad.mqtt.retained";
/// Where versions before issue 14 kept them (taken over once at start).
pub const LEGACY_RETAINED_QUEUE: &str = "mqtt-retained";

impl RetainedStore {
    /// Opens the store of `vhost`, rebuilding the trie from the durable log.
    pub fn open(vhost: Arc<Vhost>, conn: ConnectionId) -> Result<RetainedStore, CoreError> {
        let (log, entries) = DurableLog::open(vhost, RETAINED_QUEUE, LEGACY_RETAINED_QUEUE, conn)?;
        let mut trie = RetainedTrie::default();
        for e in entries {
            trie.insert(Retained {
                topic: Arc::from(e.key.as_str()),
                payload: e.value,
                qos: u8::try_from(e.meta).unwrap_or(0).min(2),
            });
        }
        Ok(RetainedStore {
            trie: RwLock::new(trie),
            log,
        })
    }

    /// Retains `payload` on `topic` (an empty payload clears it). `durable = false`
    /// keeps it in memory only (`$SYS` topics). The result completes once on disk.
    pub fn set(
        &self,
        topic: &str,
        payload: Bytes,
        qos: u8,
        durable: bool,
    ) -> Result<Option<Durability>, CoreError> {
        let mut trie = self.trie.write().unwrap_or_else(|e| e.into_inner());
        if payload.is_empty() {
            trie.remove(topic);
            self.log.delete(topic);
            return Ok(None);
        }
        let d = if durable {
            self.log.put(topic, payload.clone(), i64::from(qos))?
        } else {
            if trie.get(topic).is_some() {
                self.log.delete(topic);
            }
            None
        };
        trie.insert(Retained {
            topic: Arc::from(topic),
            payload,
            qos,
        });
        Ok(d)
    }

    /// Retained messages matching `filter`.
    pub fn matching(&self, filter: &str) -> Vec<Retained> {
        self.trie
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .matching(filter)
    }

    /// Topics retained.
    pub fn len(&self) -> usize {
        self.trie.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether nothing is retained.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(t: &str) -> Retained {
        Retained {
            topic: Arc::from(t),
            payload: Bytes::from(t.to_string()),
            qos: 1,
        }
    }

    fn topics(mut v: Vec<Retained>) -> Vec<String> {
        v.sort_by(|a, b| a.topic.cmp(&b.topic));
        v.into_iter().map(|r| r.topic.to_string()).collect()
    }

    #[test]
    fn lookup_by_filter() {
        let mut t = RetainedTrie::default();
        for x in ["a", "a/b", "a/c", "a/b/c", "x/b", "$SYS/up", "/lead"] {
            t.insert(r(x));
        }
        assert_eq!(t.len(), 7);
        assert_eq!(topics(t.matching("a/b")), ["a/b"]);
        assert_eq!(topics(t.matching("a/+")), ["a/b", "a/c"]);
        assert_eq!(topics(t.matching("+/b")), ["a/b", "x/b"]);
        assert_eq!(topics(t.matching("a/#")), ["a", "a/b", "a/b/c", "a/c"]);
        assert_eq!(
            topics(t.matching("#")),
            ["/lead", "a", "a/b", "a/b/c", "a/c", "x/b"]
        );
        assert_eq!(topics(t.matching("$SYS/#")), ["$SYS/up"]);
        assert_eq!(topics(t.matching("+/up")), Vec::<String>::new());
        assert_eq!(topics(t.matching("+/lead")), ["/lead"]);
    }

    #[test]
    fn remove_prunes_and_keeps_siblings() {
        let mut t = RetainedTrie::default();
        t.insert(r("a/b/c"));
        t.insert(r("a"));
        t.insert(r("a/x"));
        assert!(t.remove("a/b").is_none());
        assert_eq!(t.remove("a/b/c").unwrap().topic.as_ref(), "a/b/c");
        assert_eq!(t.len(), 2);
        assert!(!t.root.children["a"].children.contains_key("b"), "pruned");
        assert_eq!(topics(t.matching("#")), ["a", "a/x"]);
        t.remove("a");
        t.remove("a/x");
        assert!(t.root.children.is_empty());
        assert!(t.is_empty());
    }

    #[test]
    fn deep_topics_do_not_recurse() {
        let mut t = RetainedTrie::default();
        let deep = "/".repeat(30_000);
        t.insert(r(&deep));
        assert_eq!(t.matching("#").len(), 1);
        assert!(t.remove(&deep).is_some());
    }

    #[test]
    fn many_topics_lookup_touches_only_matches() {
        let mut t = RetainedTrie::default();
        for i in 0..100_000 {
            t.insert(r(&format!("dev/{}/temp", i)));
        }
        let start = std::time::Instant::now();
        for i in 0..1000 {
            assert_eq!(t.matching(&format!("dev/{i}/+")).len(), 1);
        }
        assert!(start.elapsed() < std::time::Duration::from_secs(2));
    }

    #[test]
    fn feed_hands_out_once_per_filter_and_waits_for_the_window() {
        let mut t = RetainedTrie::default();
        t.insert(r("a/b"));
        t.insert(Retained { qos: 0, ..r("a/c") });
        let mut feed = RetainedFeed::default();
        for _ in 0..300 {
            feed.push("a/b", 1);
        }
        feed.push("a/c", 2);
        feed.push("a/b", 2); // still waiting: not queued again, granted QoS updated
        assert!(feed.ready(false), "a filter waits: it can be looked up");
        // the window is full: a QoS 1 message cannot go, and nothing is lost
        assert_eq!(feed.next(|f| t.matching(f), false), None);
        assert!(!feed.ready(false));
        let got = feed.next(|f| t.matching(f), true).unwrap();
        assert_eq!((got.topic.as_ref(), got.qos), ("a/b", 1));
        // QoS 0 needs no packet id
        let got = feed.next(|f| t.matching(f), false).unwrap();
        assert_eq!((got.topic.as_ref(), got.qos), ("a/c", 0));
        assert_eq!(feed.next(|f| t.matching(f), true), None);
        assert!(feed.is_empty());
        // unsubscribed before its turn: nothing
        feed.push("a/b", 1);
        feed.remove("a/b");
        assert_eq!(feed.next(|f| t.matching(f), true), None);
        assert!(feed.is_empty());
    }
}

//! The topic exchange's index: a trie over dot-separated words.
//!
//! Semantics are RabbitMQ's:
//! - a routing key or pattern is split on `.` into words; the empty string is zero
//!   words, and empty words are kept (`a..b` is `a`, ``, `b`; `.a` is ``, `a`);
//! - in a pattern, a word that is exactly `*` matches exactly one word, a word that is
//!   exactly `#` matches zero or more words, and any other word (including `a*` or the
//!   empty word) matches itself literally;
//! - so `#` matches every key including the empty one, `a.#` matches `a`, and the
//!   empty pattern matches only the empty key.
//!
//! Matching walks the trie with an explicit stack of (node, word index) states. Each
//! literal step is a hash lookup, so the cost is proportional to the key length and the
//! number of branches that match, not to the number of bindings. A `#` can reach the
//! same state along many paths (`#.#.#.a`); states below a `#` are memoised, so no
//! state is expanded twice and the walk stays polynomial (at most nodes × words).
//!
//! Memory (a fleet binds one or more patterns per device, so a node's size is per
//! binding): a node keeps its own word (the edge from its parent), inline when it is
//! short (up to [`SHORT_WORD`] bytes, which covers device ids and most topic levels),
//! allocated otherwise; the parent indexes its word children by node id alone: one id
//! inline, then a short vector, then a hash table of ids (hashed by the child's word),
//! so a word is stored once. Destinations are one inline, then a short vector, then a
//! hash set once a pattern has many; a destination's name is shared with the binding
//! table (an `Arc<str>`). A node is [`NODE_BYTES`] bytes, and the common node (one
//! short word, at most one word child, at most one destination) allocates nothing else.

use std::collections::HashSet;
use std::hash::BuildHasher;
use std::num::NonZeroU32;

use super::Destination;

type NodeId = u32;

const ROOT: NodeId = 0;

/// Words up to this many bytes are stored in the node itself.
pub const SHORT_WORD: usize = 22;

/// The size of a trie node (checked by a test; it is paid per binding).
pub const NODE_BYTES: usize = 88;

/// How a node hangs off its parent.
#[derive(Debug, Clone)]
enum Edge {
    Root,
    Short { len: u8, bytes: [u8; SHORT_WORD] },
    Word(Box<str>),
    Star,
    Hash,
}

impl Edge {
    fn word(w: &str) -> Edge {
        match w.len() {
            n if n <= SHORT_WORD => {
                let mut bytes = [0u8; SHORT_WORD];
                if let Some(dst) = bytes.get_mut(..n) {
                    dst.copy_from_slice(w.as_bytes());
                }
                Edge::Short {
                    len: n as u8,
                    bytes,
                }
            }
            _ => Edge::Word(w.into()),
        }
    }

    /// The word's bytes (always UTF-8: they were copied from a `str`).
    fn word_bytes(&self) -> Option<&[u8]> {
        match self {
            Edge::Short { len, bytes } => bytes.get(..*len as usize),
            Edge::Word(w) => Some(w.as_bytes()),
            _ => None,
        }
    }
}

/// A node's word children, by id: one inline, a short vector searched linearly, or a
/// hash table of ids hashed by the child's word once there are more than [`SMALL`].
#[derive(Debug, Default)]
enum Children {
    #[default]
    None,
    One(NodeId),
    Small(Vec<NodeId>),
    Big(Box<hashbrown::HashTable<NodeId>>),
}

/// Up to this many word children (or destinations) are kept in a vector.
const SMALL: usize = 8;

/// A pattern's destinations: one inline (the common case), else a short vector or, once
/// there are many, a set, behind one box (so the node holds 24 bytes for them).
#[derive(Debug, Default)]
enum Dests {
    #[default]
    None,
    One(Destination),
    Many(Box<Many>),
}

#[derive(Debug)]
enum Many {
    Small(Vec<Destination>),
    Big(HashSet<Destination>),
}

impl Dests {
    fn insert(&mut self, d: Destination) -> bool {
        match self {
            Dests::None => {
                *self = Dests::One(d);
                true
            }
            Dests::One(x) if *x == d => false,
            Dests::One(_) => {
                let Dests::One(x) = std::mem::take(self) else {
                    return false;
                };
                *self = Dests::Many(Box::new(Many::Small(vec![x, d])));
                true
            }
            Dests::Many(m) => match &mut **m {
                Many::Small(v) if v.contains(&d) => false,
                Many::Small(v) if v.len() < SMALL => {
                    v.push(d);
                    true
                }
                Many::Small(v) => {
                    let mut set: HashSet<Destination> = v.drain(..).collect();
                    set.insert(d);
                    **m = Many::Big(set);
                    true
                }
                Many::Big(set) => set.insert(d),
            },
        }
    }

    fn remove(&mut self, d: &Destination) -> bool {
        let removed = match self {
            Dests::None => false,
            Dests::One(x) if x == d => {
                *self = Dests::None;
                true
            }
            Dests::One(_) => false,
            Dests::Many(m) => match &mut **m {
                Many::Small(v) => match v.iter().position(|x| x == d) {
                    Some(i) => {
                        v.swap_remove(i);
                        true
                    }
                    None => false,
                },
                Many::Big(set) => set.remove(d),
            },
        };
        if self.is_empty() {
            *self = Dests::None;
        }
        removed
    }

    fn is_empty(&self) -> bool {
        match self {
            Dests::None => true,
            Dests::One(_) => false,
            Dests::Many(m) => match &**m {
                Many::Small(v) => v.is_empty(),
                Many::Big(set) => set.is_empty(),
            },
        }
    }

    fn iter(&self) -> Box<dyn Iterator<Item = &Destination> + '_> {
        match self {
            Dests::None => Box::new(std::iter::empty()),
            Dests::One(d) => Box::new(std::iter::once(d)),
            Dests::Many(m) => match &**m {
                Many::Small(v) => Box::new(v.iter()),
                Many::Big(set) => Box::new(set.iter()),
            },
        }
    }
}

/// A child's id: never the root's, so never 0 (and an `Option` of it is 4 bytes).
type ChildId = NonZeroU32;

#[derive(Debug)]
struct Node {
    parent: NodeId,
    /// Whether this node or an ancestor is a `#` (states below need memoising).
    below_hash: bool,
    star: Option<ChildId>,
    hash: Option<ChildId>,
    edge: Edge,
    words: Children,
    destinations: Dests,
}

impl Node {
    fn new(parent: NodeId, edge: Edge, below_hash: bool) -> Self {
        Node {
            parent,
            below_hash,
            star: None,
            hash: None,
            edge,
            words: Children::None,
            destinations: Dests::None,
        }
    }

    fn is_hash(&self) -> bool {
        matches!(self.edge, Edge::Hash)
    }

    fn word(&self) -> Option<&[u8]> {
        self.edge.word_bytes()
    }

    fn star(&self) -> Option<NodeId> {
        self.star.map(NonZeroU32::get)
    }

    fn hash(&self) -> Option<NodeId> {
        self.hash.map(NonZeroU32::get)
    }

    fn is_empty(&self) -> bool {
        matches!(self.words, Children::None)
            && self.star.is_none()
            && self.hash.is_none()
            && self.destinations.is_empty()
    }
}

/// Splits a routing key or pattern into words, RabbitMQ's way (see the module docs).
pub fn split_words(key: &str) -> Vec<&str> {
    if key.is_empty() {
        Vec::new()
    } else {
        key.split('.').collect()
    }
}

/// A trie of topic patterns, each leading to a set of destinations.
#[derive(Debug)]
pub struct TopicTrie {
    /// Arena of nodes; freed slots are `None` and listed in `free`.
    nodes: Vec<Option<Node>>,
    free: Vec<NodeId>,
    /// Number of (pattern, destination) pairs.
    len: usize,
    /// Hashes words for the children tables.
    hasher: foldhash::fast::RandomState,
}

impl Default for TopicTrie {
    fn default() -> Self {
        Self::new()
    }
}

impl TopicTrie {
    /// An empty trie.
    pub fn new() -> Self {
        TopicTrie {
            nodes: vec![Some(Node::new(ROOT, Edge::Root, false))],
            free: Vec::new(),
            len: 0,
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    /// Number of (pattern, destination) pairs.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the trie holds no pattern.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of live trie nodes, root included (for tests and metrics).
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    fn node(&self, id: NodeId) -> Option<&Node> {
        self.nodes.get(id as usize).and_then(Option::as_ref)
    }

    fn node_mut(&mut self, id: NodeId) -> Option<&mut Node> {
        self.nodes.get_mut(id as usize).and_then(Option::as_mut)
    }

    fn alloc(&mut self, node: Node) -> NodeId {
        match self.free.pop() {
            Some(id) => {
                if let Some(slot) = self.nodes.get_mut(id as usize) {
                    *slot = Some(node);
                }
                id
            }
            None => {
                self.nodes.push(Some(node));
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    fn word_of(&self, id: NodeId) -> Option<&[u8]> {
        self.node(id).and_then(Node::word)
    }

    fn hash_word(&self, word: &[u8]) -> u64 {
        self.hasher.hash_one(word)
    }

    /// The word child `word` of `node`.
    fn word_child(&self, node: &Node, word: &str) -> Option<NodeId> {
        let word = word.as_bytes();
        match &node.words {
            Children::None => None,
            Children::One(id) => (self.word_of(*id) == Some(word)).then_some(*id),
            Children::Small(ids) => ids
                .iter()
                .copied()
                .find(|&id| self.word_of(id) == Some(word)),
            Children::Big(table) => table
                .find(self.hash_word(word), |&id| self.word_of(id) == Some(word))
                .copied(),
        }
    }

    /// Adds `child` (whose edge is its word) to `parent`'s word children.
    fn add_word_child(&mut self, parent: NodeId, child: NodeId) {
        let Some(p) = self.node_mut(parent) else {
            return;
        };
        let mut words = std::mem::take(&mut p.words);
        words = match words {
            Children::None => Children::One(child),
            Children::One(first) => Children::Small(vec![first, child]),
            Children::Small(mut ids) if ids.len() < SMALL => {
                ids.push(child);
                Children::Small(ids)
            }
            Children::Small(ids) => {
                let mut table = hashbrown::HashTable::with_capacity(ids.len() * 2);
                for id in ids.into_iter().chain(std::iter::once(child)) {
                    let h = self.hash_word(self.word_of(id).unwrap_or_default());
                    table.insert_unique(h, id, |&x| {
                        self.hash_word(self.word_of(x).unwrap_or_default())
                    });
                }
                Children::Big(Box::new(table))
            }
            Children::Big(mut table) => {
                let h = self.hash_word(self.word_of(child).unwrap_or_default());
                table.insert_unique(h, child, |&x| {
                    self.hash_word(self.word_of(x).unwrap_or_default())
                });
                Children::Big(table)
            }
        };
        if let Some(p) = self.node_mut(parent) {
            p.words = words;
        }
    }

    /// Removes `child` (with word `word`) from `parent`'s word children.
    fn remove_word_child(&mut self, parent: NodeId, child: NodeId, word: &[u8]) {
        let h = self.hash_word(word);
        let Some(p) = self.node_mut(parent) else {
            return;
        };
        let empty = match &mut p.words {
            Children::None => true,
            Children::One(id) => *id == child,
            Children::Small(ids) => {
                ids.retain(|&id| id != child);
                ids.is_empty()
            }
            Children::Big(table) => {
                if let Ok(e) = table.find_entry(h, |&id| id == child) {
                    e.remove();
                }
                table.is_empty()
            }
        };
        if empty {
            p.words = Children::None;
        }
    }

    /// Follows or creates the edge for `word` below `parent`.
    fn child_or_insert(&mut self, parent: NodeId, word: &str) -> NodeId {
        let Some(p) = self.node(parent) else {
            return ROOT;
        };
        let existing = match word {
            "*" => p.star(),
            "#" => p.hash(),
            w => self.word_child(p, w),
        };
        if let Some(id) = existing {
            return id;
        }
        let edge = match word {
            "*" => Edge::Star,
            "#" => Edge::Hash,
            w => Edge::word(w),
        };
        let below_hash = p.below_hash || matches!(edge, Edge::Hash);
        let (star, hash) = (matches!(edge, Edge::Star), matches!(edge, Edge::Hash));
        let id = self.alloc(Node::new(parent, edge, below_hash));
        // the root is never a child: a child's id is not 0
        let child = NonZeroU32::new(id);
        if star {
            if let Some(p) = self.node_mut(parent) {
                p.star = child;
            }
        } else if hash {
            if let Some(p) = self.node_mut(parent) {
                p.hash = child;
            }
        } else {
            self.add_word_child(parent, id);
        }
        id
    }

    fn find(&self, pattern: &str) -> Option<NodeId> {
        let mut id = ROOT;
        for word in split_words(pattern) {
            let n = self.node(id)?;
            id = match word {
                "*" => n.star()?,
                "#" => n.hash()?,
                w => self.word_child(n, w)?,
            };
        }
        Some(id)
    }

    /// Adds `destination` under `pattern`. Returns false if it was already there.
    pub fn insert(&mut self, pattern: &str, destination: Destination) -> bool {
        let mut id = ROOT;
        for word in split_words(pattern) {
            id = self.child_or_insert(id, word);
        }
        let added = self
            .node_mut(id)
            .is_some_and(|n| n.destinations.insert(destination));
        if added {
            self.len += 1;
        }
        added
    }

    /// Removes `destination` from `pattern`, pruning nodes left empty. Returns whether
    /// it was there.
    pub fn remove(&mut self, pattern: &str, destination: &Destination) -> bool {
        let Some(mut id) = self.find(pattern) else {
            return false;
        };
        if !self
            .node_mut(id)
            .is_some_and(|n| n.destinations.remove(destination))
        {
            return false;
        }
        self.len -= 1;
        // Prune empty nodes up towards the root.
        while id != ROOT {
            let Some(n) = self.node(id) else { break };
            if !n.is_empty() {
                break;
            }
            let parent = n.parent;
            let edge = n.edge.clone();
            match edge {
                Edge::Star => {
                    if let Some(p) = self.node_mut(parent) {
                        p.star = None;
                    }
                }
                Edge::Hash => {
                    if let Some(p) = self.node_mut(parent) {
                        p.hash = None;
                    }
                }
                Edge::Word(_) | Edge::Short { .. } => {
                    let word = edge.word_bytes().unwrap_or_default().to_vec();
                    self.remove_word_child(parent, id, &word)
                }
                Edge::Root => {}
            }
            if let Some(slot) = self.nodes.get_mut(id as usize) {
                *slot = None;
            }
            self.free.push(id);
            id = parent;
        }
        true
    }

    /// Calls `emit` for the destinations of every pattern matching `key`. A destination
    /// bound under several matching patterns is emitted once per pattern; callers
    /// de-duplicate.
    pub fn route<'a>(&'a self, key: &str, emit: &mut dyn FnMut(&'a Destination)) {
        let words = split_words(key);
        let n_words = words.len();
        let mut stack: Vec<(NodeId, usize)> = vec![(ROOT, 0)];
        let mut seen: HashSet<(NodeId, usize)> = HashSet::new();
        while let Some((id, i)) = stack.pop() {
            let Some(node) = self.node(id) else { continue };
            if node.below_hash && !seen.insert((id, i)) {
                continue;
            }
            match words.get(i) {
                None => {
                    node.destinations.iter().for_each(&mut *emit);
                    // A trailing `#` matches zero words.
                    if let Some(h) = node.hash() {
                        stack.push((h, i));
                    }
                }
                Some(word) => {
                    if let Some(c) = self.word_child(node, word) {
                        stack.push((c, i + 1));
                    }
                    if let Some(s) = node.star() {
                        stack.push((s, i + 1));
                    }
                    // `#` below here matching zero words.
                    if let Some(h) = node.hash() {
                        stack.push((h, i));
                    }
                    // This `#` swallowing one more word.
                    if node.is_hash() && i < n_words {
                        stack.push((id, i + 1));
                    }
                }
            }
        }
    }

    /// Every (pattern, destination) pair, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (String, &Destination)> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(id, n)| n.as_ref().map(|n| (id, n)))
            .flat_map(move |(id, n)| {
                let pattern = self.pattern_of(id as NodeId);
                n.destinations.iter().map(move |d| (pattern.clone(), d))
            })
    }

    fn pattern_of(&self, mut id: NodeId) -> String {
        let mut words: Vec<&str> = Vec::new();
        while let Some(n) = self.node(id) {
            match &n.edge {
                Edge::Root => break,
                Edge::Word(_) | Edge::Short { .. } => {
                    words.push(std::str::from_utf8(n.word().unwrap_or_default()).unwrap_or(""))
                }
                Edge::Star => words.push("*"),
                Edge::Hash => words.push("#"),
            }
            id = n.parent;
        }
        words.reverse();
        words.join(".")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(name: &str) -> Destination {
        Destination::queue(name)
    }

    fn matches(trie: &TopicTrie, key: &str) -> Vec<String> {
        let mut out = Vec::new();
        trie.route(key, &mut |d| {
            if let Destination::Queue(n) = d {
                out.push(n.to_string());
            }
        });
        out.sort();
        out.dedup();
        out
    }

    fn single(pattern: &str, key: &str) -> bool {
        let mut t = TopicTrie::new();
        t.insert(pattern, q("q"));
        !matches(&t, key).is_empty()
    }

    #[test]
    fn split_follows_rabbitmq() {
        assert!(split_words("").is_empty());
        assert_eq!(split_words("."), ["", ""]);
        assert_eq!(split_words("a..b"), ["a", "", "b"]);
        assert_eq!(split_words(".a"), ["", "a"]);
    }

    #[test]
    fn basic_patterns() {
        assert!(single("a.b.c", "a.b.c"));
        assert!(!single("a.b.c", "a.b"));
        assert!(single("a.*.c", "a.x.c"));
        assert!(!single("a.*.c", "a.c"));
        assert!(single("#", ""));
        assert!(single("#", "a.b"));
        assert!(single("a.#", "a"));
        assert!(single("a.#", "a.b.c"));
        assert!(!single("a.#", "b"));
        assert!(single("#.a", "a"));
        assert!(single("a.#.b", "a.b"));
        assert!(single("a.#.b", "a.x.y.b"));
        assert!(!single("*", ""));
        assert!(single("*", "a"));
        assert!(single("", ""));
        assert!(!single("", "a"));
        assert!(single("a..b", "a..b"));
        assert!(single("a.*.b", "a..b"));
        assert!(single("*.*", "."));
        assert!(single("#.#.#", ""));
        assert!(single("a*", "a*"));
        assert!(!single("a*", "ab"));
    }

    #[test]
    fn remove_prunes_nodes() {
        let mut t = TopicTrie::new();
        assert!(t.insert("a.*.#.b", q("x")));
        assert!(!t.insert("a.*.#.b", q("x")));
        assert!(t.insert("a.*", q("y")));
        assert_eq!(t.len(), 2);
        assert!(t.remove("a.*.#.b", &q("x")));
        assert!(!t.remove("a.*.#.b", &q("x")));
        assert_eq!(t.node_count(), 3);
        assert!(t.remove("a.*", &q("y")));
        assert_eq!(t.node_count(), 1);
        assert!(t.is_empty());
        assert!(t.insert("z", q("z")));
        assert_eq!(matches(&t, "z"), ["z"]);
    }

    #[test]
    fn many_hashes_do_not_blow_up() {
        let mut t = TopicTrie::new();
        let pattern = vec!["#"; 30].join(".") + ".x";
        t.insert(&pattern, q("q"));
        let key = vec!["a"; 200].join(".");
        assert!(matches(&t, &key).is_empty());
        assert_eq!(matches(&t, &(key + ".x")), ["q"]);
    }

    #[test]
    fn wide_nodes_and_many_destinations_use_their_tables() {
        let mut t = TopicTrie::new();
        // 1,000 word children under `dev` (a hash table of ids), each with its own queue
        for i in 0..1000 {
            assert!(t.insert(&format!("dev.{i}.cmd"), q(&format!("d{i}"))));
        }
        // 40 destinations on one pattern (a set), 3 on another (a vector)
        for i in 0..40 {
            assert!(t.insert("dev.*.cmd", q(&format!("all{i}"))));
        }
        assert!(!t.insert("dev.*.cmd", q("all7")));
        for i in 0..3 {
            t.insert("dev.7.#", q(&format!("seven{i}")));
        }
        let got = matches(&t, "dev.7.cmd");
        assert_eq!(got.len(), 1 + 40 + 3);
        assert!(got.contains(&"d7".to_string()) && !got.contains(&"d8".to_string()));
        assert!(matches(&t, "dev.1000.cmd").len() == 40);
        // remove every odd device and most of the set: routing and pruning still right
        for i in (1..1000).step_by(2) {
            assert!(t.remove(&format!("dev.{i}.cmd"), &q(&format!("d{i}"))));
        }
        for i in 0..39 {
            assert!(t.remove("dev.*.cmd", &q(&format!("all{i}"))));
        }
        assert_eq!(matches(&t, "dev.8.cmd"), ["all39", "d8"]);
        assert_eq!(matches(&t, "dev.9.cmd"), ["all39"]);
        for i in (0..1000).step_by(2) {
            assert!(t.remove(&format!("dev.{i}.cmd"), &q(&format!("d{i}"))));
        }
        assert!(t.remove("dev.*.cmd", &q("all39")));
        for i in 0..3 {
            assert!(t.remove("dev.7.#", &q(&format!("seven{i}"))));
        }
        assert!(t.is_empty());
        assert_eq!(t.node_count(), 1);
        let mut got: Vec<String> = t.iter().map(|(p, _)| p).collect();
        got.sort();
        assert!(got.is_empty());
    }

    #[test]
    fn a_node_is_small_and_long_words_still_work() {
        assert_eq!(std::mem::size_of::<Option<Node>>(), NODE_BYTES);
        let mut t = TopicTrie::new();
        let long = "w".repeat(SHORT_WORD + 1);
        let edge = "e".repeat(SHORT_WORD);
        for p in [
            format!("a.{long}.b"),
            format!("a.{edge}.b"),
            format!("{long}.#"),
            "a.é.b".to_string(),
        ] {
            assert!(t.insert(&p, q(&p)));
        }
        assert_eq!(matches(&t, &format!("a.{long}.b")), [format!("a.{long}.b")]);
        assert_eq!(matches(&t, &format!("a.{edge}.b")), [format!("a.{edge}.b")]);
        assert_eq!(matches(&t, &format!("{long}.x.y")), [format!("{long}.#")]);
        assert_eq!(matches(&t, "a.é.b"), ["a.é.b"]);
        let mut got: Vec<String> = t.iter().map(|(p, _)| p).collect();
        got.sort();
        assert_eq!(got.len(), 4);
        assert!(got.contains(&format!("a.{long}.b")) && got.contains(&"a.é.b".to_string()));
        for p in got {
            assert!(t.remove(&p, &q(&p)), "{p}");
        }
        assert_eq!(t.node_count(), 1);
    }

    #[test]
    fn one_then_two_then_many_children_and_destinations() {
        let mut t = TopicTrie::new();
        assert!(t.insert("a.b", q("1")));
        assert!(t.insert("a.c", q("2")));
        assert!(t.insert("a.b", q("3")));
        assert!(!t.insert("a.b", q("1")));
        assert_eq!(matches(&t, "a.b"), ["1", "3"]);
        assert!(t.remove("a.b", &q("1")));
        assert!(!t.remove("a.b", &q("1")));
        assert_eq!(matches(&t, "a.b"), ["3"]);
        assert!(t.remove("a.c", &q("2")));
        assert_eq!(matches(&t, "a.c"), Vec::<String>::new());
        assert_eq!(matches(&t, "a.b"), ["3"]);
        assert!(t.remove("a.b", &q("3")));
        assert_eq!(t.node_count(), 1);
    }

    #[test]
    fn iter_rebuilds_patterns() {
        let mut t = TopicTrie::new();
        for p in ["", "a.#", "*.b", "a..c", "#"] {
            t.insert(p, q(p));
        }
        let mut got: Vec<String> = t.iter().map(|(p, _)| p).collect();
        got.sort();
        assert_eq!(got, ["", "#", "*.b", "a.#", "a..c"]);
    }
}

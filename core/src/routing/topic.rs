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

use std::collections::{HashMap, HashSet};

use super::Destination;

type NodeId = u32;

const ROOT: NodeId = 0;

/// How a node hangs off its parent.
#[derive(Debug, Clone)]
enum Edge {
    Root,
    Word(Box<str>),
    Star,
    Hash,
}

#[derive(Debug)]
struct Node {
    parent: NodeId,
    edge: Edge,
    /// Whether this node or an ancestor is a `#` (states below need memoising).
    below_hash: bool,
    words: HashMap<Box<str>, NodeId>,
    star: Option<NodeId>,
    hash: Option<NodeId>,
    destinations: HashSet<Destination>,
}

impl Node {
    fn new(parent: NodeId, edge: Edge, below_hash: bool) -> Self {
        Node {
            parent,
            edge,
            below_hash,
            words: HashMap::new(),
            star: None,
            hash: None,
            destinations: HashSet::new(),
        }
    }

    fn is_hash(&self) -> bool {
        matches!(self.edge, Edge::Hash)
    }

    fn is_empty(&self) -> bool {
        self.words.is_empty()
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

    /// Follows or creates the edge for `word` below `parent`.
    fn child_or_insert(&mut self, parent: NodeId, word: &str) -> NodeId {
        let Some(p) = self.node(parent) else {
            return ROOT;
        };
        let existing = match word {
            "*" => p.star,
            "#" => p.hash,
            w => p.words.get(w).copied(),
        };
        if let Some(id) = existing {
            return id;
        }
        let edge = match word {
            "*" => Edge::Star,
            "#" => Edge::Hash,
            w => Edge::Word(w.into()),
        };
        let below_hash = p.below_hash || matches!(edge, Edge::Hash);
        let id = self.alloc(Node::new(parent, edge.clone(), below_hash));
        if let Some(p) = self.node_mut(parent) {
            match edge {
                Edge::Star => p.star = Some(id),
                Edge::Hash => p.hash = Some(id),
                Edge::Word(w) => {
                    p.words.insert(w, id);
                }
                Edge::Root => {}
            }
        }
        id
    }

    fn find(&self, pattern: &str) -> Option<NodeId> {
        let mut id = ROOT;
        for word in split_words(pattern) {
            let n = self.node(id)?;
            id = match word {
                "*" => n.star?,
                "#" => n.hash?,
                w => *n.words.get(w)?,
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
            if let Some(p) = self.node_mut(parent) {
                match edge {
                    Edge::Star => p.star = None,
                    Edge::Hash => p.hash = None,
                    Edge::Word(w) => {
                        p.words.remove(&w);
                    }
                    Edge::Root => {}
                }
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
                    if let Some(h) = node.hash {
                        stack.push((h, i));
                    }
                }
                Some(word) => {
                    if let Some(&c) = node.words.get(*word) {
                        stack.push((c, i + 1));
                    }
                    if let Some(s) = node.star {
                        stack.push((s, i + 1));
                    }
                    // `#` below here matching zero words.
                    if let Some(h) = node.hash {
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
                Edge::Word(w) => words.push(w),
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
        Destination::Queue(name.to_owned())
    }

    fn matches(trie: &TopicTrie, key: &str) -> Vec<String> {
        let mut out = Vec::new();
        trie.route(key, &mut |d| {
            if let Destination::Queue(n) = d {
                out.push(n.clone());
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

//! Routing contract suite: what every exchange kind must do, as RabbitMQ documents
//! and implements it. Table-driven through the public [`Topology`] API, plus property
//! tests comparing the topic trie with a naive reference matcher.

#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use std::collections::{BTreeSet, HashSet};

use proptest::prelude::*;
use triad_core::routing::exchange::ALTERNATE_EXCHANGE;
use triad_core::routing::topic::split_words;
use triad_core::{
    CoreError, Destination, ExchangeDef, ExchangeKind, FieldTable, FieldValue, Topology,
};

fn all_queues(_: &str) -> bool {
    true
}

fn q(name: &str) -> Destination {
    Destination::queue(name)
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn route(t: &Topology, x: &str, key: &str, headers: Option<&FieldTable>) -> BTreeSet<String> {
    let out = t.route(x, key, headers, &all_queues).unwrap();
    let unique: BTreeSet<String> = out.iter().cloned().collect();
    assert_eq!(unique.len(), out.len(), "each queue once: {out:?}");
    unique
}

fn declare(t: &mut Topology, name: &str, kind: ExchangeKind) {
    t.declare_exchange(ExchangeDef::new(name, kind)).unwrap();
}

fn bind(t: &mut Topology, x: &str, d: Destination, key: &str) {
    t.bind(x, d, key, FieldTable::new(), &all_queues).unwrap();
}

/// The obvious recursive topic matcher, RabbitMQ's semantics (exponential in the
/// number of `#`, fine for tests).
fn reference_match(pattern: &[&str], key: &[&str]) -> bool {
    match pattern.split_first() {
        None => key.is_empty(),
        Some((&"#", rest)) => {
            (0..=key.len()).any(|i| reference_match(rest, key.get(i..).unwrap_or(&[])))
        }
        Some((&"*", rest)) => !key.is_empty() && reference_match(rest, key.get(1..).unwrap_or(&[])),
        Some((word, rest)) => {
            key.first() == Some(word) && reference_match(rest, key.get(1..).unwrap_or(&[]))
        }
    }
}

fn topic_matches(pattern: &str, key: &str) -> bool {
    reference_match(&split_words(pattern), &split_words(key))
}

// ---------------------------------------------------------------------------- direct

#[test]
fn direct_routes_on_exact_key() {
    let mut t = Topology::new();
    bind(&mut t, "amq.direct", q("q1"), "k");
    bind(&mut t, "amq.direct", q("q2"), "k");
    bind(&mut t, "amq.direct", q("q3"), "K");
    bind(&mut t, "amq.direct", q("q4"), "");
    bind(&mut t, "amq.direct", q("q5"), "a.*");
    let cases: &[(&str, &[&str])] = &[
        ("k", &["q1", "q2"]),
        ("K", &["q3"]),
        ("", &["q4"]),
        ("k ", &[]),
        ("a.b", &[]),
        ("a.*", &["q5"]),
    ];
    for (key, want) in cases {
        assert_eq!(route(&t, "amq.direct", key, None), set(want), "key {key:?}");
    }
}

#[test]
fn default_exchange_routes_to_the_queue_named_by_the_key() {
    let t = Topology::new();
    let exists = |name: &str| name == "orders";
    assert_eq!(t.route("", "orders", None, &exists).unwrap(), ["orders"]);
    assert!(t.route("", "missing", None, &exists).unwrap().is_empty());
    assert!(t.route("", "", None, &exists).unwrap().is_empty());
}

#[test]
fn deleted_queues_are_skipped() {
    let mut t = Topology::new();
    bind(&mut t, "amq.fanout", q("alive"), "");
    bind(&mut t, "amq.fanout", q("dead"), "");
    let exists = |name: &str| name == "alive";
    assert_eq!(t.route("amq.fanout", "", None, &exists).unwrap(), ["alive"]);
    t.remove_destination(&q("dead"));
    assert_eq!(t.bindings().len(), 1);
}

// ---------------------------------------------------------------------------- fanout

#[test]
fn fanout_ignores_the_key() {
    let mut t = Topology::new();
    bind(&mut t, "amq.fanout", q("q1"), "x");
    bind(&mut t, "amq.fanout", q("q1"), "y");
    bind(&mut t, "amq.fanout", q("q2"), "");
    for key in ["", "x", "anything.at.all"] {
        assert_eq!(
            route(&t, "amq.fanout", key, None),
            set(&["q1", "q2"]),
            "key {key:?}"
        );
    }
}

#[test]
fn empty_exchanges_route_nowhere() {
    let t = Topology::new();
    for x in [
        "amq.direct",
        "amq.fanout",
        "amq.topic",
        "amq.headers",
        "amq.match",
    ] {
        assert!(route(&t, x, "k", None).is_empty(), "{x}");
    }
}

// ---------------------------------------------------------------------------- topic

/// (pattern, key, matches), from RabbitMQ's topic exchange tests and docs.
const TOPIC_CASES: &[(&str, &str, bool)] = &[
    // literal
    ("a.b.c", "a.b.c", true),
    ("a.b.c", "a.b", false),
    ("a.b", "a.b.c", false),
    ("a.b.c", "a.B.c", false),
    // `*` is exactly one word
    ("*.b.c", "a.b.c", true),
    ("a.*.c", "a.b.c", true),
    ("a.*.c", "a.c", false),
    ("a.*.c", "a.b.b.c", false),
    ("*", "a", true),
    ("*", "", false),
    ("*", "a.b", false),
    ("*.*", "a.b", true),
    ("*.*", "a", false),
    ("*.*.*", "a.b", false),
    // `#` is zero or more words
    ("#", "", true),
    ("#", "a", true),
    ("#", "a.b.c", true),
    ("#", ".", true),
    ("a.#", "a", true),
    ("a.#", "a.b", true),
    ("a.#", "a.b.c", true),
    ("a.#", "b.a", false),
    ("#.a", "a", true),
    ("#.a", "b.a", true),
    ("#.a", "a.b", false),
    ("a.#.b", "a.b", true),
    ("a.#.b", "a.x.b", true),
    ("a.#.b", "a.x.y.z.b", true),
    ("a.#.b", "a.x.y.z", false),
    ("#.b.#", "b", true),
    ("#.b.#", "a.b.c", true),
    ("#.b.#", "a.c", false),
    ("#.#", "", true),
    ("#.#", "a.b", true),
    ("#.*", "", false),
    ("#.*", "a", true),
    ("#.*", "a.b.c", true),
    ("*.#", "", false),
    ("*.#", "a", true),
    ("*.#.*", "a", false),
    ("*.#.*", "a.b", true),
    ("a.#.#.b", "a.b", true),
    ("a.#.*.#.b", "a.b", false),
    ("a.#.*.#.b", "a.x.b", true),
    ("#.a.#.a.#", "a.a", true),
    ("#.a.#.a.#", "b.a.b.b.a.b", true),
    ("#.a.#.a.#", "b.a.b.b", false),
    // empty pattern and empty words
    ("", "", true),
    ("", "a", false),
    ("a..b", "a..b", true),
    ("a..b", "a.b", false),
    ("a.*.b", "a..b", true),
    ("*", ".", false),
    ("*.*", ".", true),
    (".", ".", true),
    ("a.", "a.", true),
    ("a.", "a", false),
    ("a.*", "a.", true),
    (".a", ".a", true),
    ("*.a", ".a", true),
    ("#.a", ".a", true),
    ("a.#", "a.", true),
    // `*` and `#` only as whole words
    ("a*", "a*", true),
    ("a*", "ab", false),
    ("a#", "a", false),
    ("a#", "a#", true),
    ("*a", "ba", false),
];

#[test]
fn topic_cases_one_binding_each() {
    for &(pattern, key, want) in TOPIC_CASES {
        assert_eq!(
            topic_matches(pattern, key),
            want,
            "reference disagrees: {pattern:?} vs {key:?}"
        );
        let mut t = Topology::new();
        bind(&mut t, "amq.topic", q("q"), pattern);
        let got = !route(&t, "amq.topic", key, None).is_empty();
        assert_eq!(got, want, "pattern {pattern:?} key {key:?}");
    }
}

#[test]
fn topic_cases_all_bindings_together() {
    let mut t = Topology::new();
    let patterns: BTreeSet<&str> = TOPIC_CASES.iter().map(|c| c.0).collect();
    for p in &patterns {
        bind(&mut t, "amq.topic", q(&format!("q[{p}]")), p);
    }
    let keys: BTreeSet<&str> = TOPIC_CASES.iter().map(|c| c.1).collect();
    for key in keys {
        let want: BTreeSet<String> = patterns
            .iter()
            .filter(|p| topic_matches(p, key))
            .map(|p| format!("q[{p}]"))
            .collect();
        assert_eq!(route(&t, "amq.topic", key, None), want, "key {key:?}");
    }
}

#[test]
fn topic_queue_bound_by_several_matching_patterns_gets_one_copy() {
    let mut t = Topology::new();
    for p in ["#", "a.#", "a.*", "*.b", "a.b"] {
        bind(&mut t, "amq.topic", q("q"), p);
    }
    assert_eq!(
        t.route("amq.topic", "a.b", None, &all_queues).unwrap(),
        ["q"]
    );
}

#[test]
fn topic_unbind_keeps_other_patterns() {
    let mut t = Topology::new();
    bind(&mut t, "amq.topic", q("q"), "a.#");
    bind(&mut t, "amq.topic", q("q"), "a.b");
    bind(&mut t, "amq.topic", q("r"), "a.b");
    t.unbind("amq.topic", &q("q"), "a.#", &FieldTable::new(), &all_queues)
        .unwrap();
    assert_eq!(route(&t, "amq.topic", "a.b", None), set(&["q", "r"]));
    assert!(route(&t, "amq.topic", "a.c", None).is_empty());
    t.unbind("amq.topic", &q("q"), "a.b", &FieldTable::new(), &all_queues)
        .unwrap();
    assert_eq!(route(&t, "amq.topic", "a.b", None), set(&["r"]));
}

// ---------------------------------------------------------------------------- headers

fn table(entries: &[(&str, FieldValue)]) -> FieldTable {
    entries.iter().cloned().collect()
}

#[test]
fn headers_cases() {
    use FieldValue as V;
    let s = |v: &str| V::from(v);
    // (binding arguments, message headers, matches)
    let cases: Vec<(FieldTable, Option<FieldTable>, bool)> = vec![
        // all (the default)
        (table(&[("a", s("1"))]), Some(table(&[("a", s("1"))])), true),
        (
            table(&[("a", s("1")), ("b", s("2"))]),
            Some(table(&[("a", s("1"))])),
            false,
        ),
        (
            table(&[("x-match", s("all")), ("a", s("1")), ("b", s("2"))]),
            Some(table(&[("b", s("2")), ("a", s("1"))])),
            true,
        ),
        (
            table(&[("a", s("1"))]),
            Some(table(&[("a", s("2"))])),
            false,
        ),
        (table(&[("a", s("1"))]), None, false),
        (table(&[]), None, true),
        (
            table(&[("x-match", s("all"))]),
            Some(table(&[("z", s("z"))])),
            true,
        ),
        // any
        (
            table(&[("x-match", s("any")), ("a", s("1")), ("b", s("2"))]),
            Some(table(&[("b", s("2"))])),
            true,
        ),
        (
            table(&[("x-match", s("any")), ("a", s("1")), ("b", s("2"))]),
            Some(table(&[("b", s("3"))])),
            false,
        ),
        (
            table(&[("x-match", s("any"))]),
            Some(table(&[("a", s("1"))])),
            false,
        ),
        (table(&[("x-match", s("any")), ("a", s("1"))]), None, false),
        // x- arguments are ignored by all/any, used by *-with-x
        (table(&[("x-foo", s("1"))]), Some(table(&[])), true),
        (
            table(&[("x-match", s("any")), ("x-foo", s("1"))]),
            Some(table(&[("x-foo", s("1"))])),
            false,
        ),
        (
            table(&[("x-match", s("any-with-x")), ("x-foo", s("1"))]),
            Some(table(&[("x-foo", s("1"))])),
            true,
        ),
        (
            table(&[
                ("x-match", s("all-with-x")),
                ("x-foo", s("1")),
                ("a", s("1")),
            ]),
            Some(table(&[("a", s("1"))])),
            false,
        ),
        (
            table(&[
                ("x-match", s("all-with-x")),
                ("x-foo", s("1")),
                ("a", s("1")),
            ]),
            Some(table(&[("a", s("1")), ("x-foo", s("1"))])),
            true,
        ),
        // void = presence
        (
            table(&[("a", V::Void)]),
            Some(table(&[("a", V::I64(42))])),
            true,
        ),
        (
            table(&[("a", V::Void)]),
            Some(table(&[("b", V::I64(42))])),
            false,
        ),
        (
            table(&[("x-match", s("any")), ("a", V::Void), ("b", s("no"))]),
            Some(table(&[("a", V::Bool(false))])),
            true,
        ),
        // types: integers compare across widths, not with floats or strings
        (
            table(&[("n", V::I32(5))]),
            Some(table(&[("n", V::I64(5))])),
            true,
        ),
        (
            table(&[("n", V::U8(5))]),
            Some(table(&[("n", V::I16(5))])),
            true,
        ),
        (
            table(&[("n", V::I32(5))]),
            Some(table(&[("n", V::F64(5.0))])),
            false,
        ),
        (
            table(&[("n", V::I32(5))]),
            Some(table(&[("n", s("5"))])),
            false,
        ),
        (
            table(&[("f", V::F32(1.5))]),
            Some(table(&[("f", V::F64(1.5))])),
            true,
        ),
        (
            table(&[("b", V::Bool(true))]),
            Some(table(&[("b", V::Bool(true))])),
            true,
        ),
        (
            table(&[("b", V::Bool(true))]),
            Some(table(&[("b", V::I8(1))])),
            false,
        ),
    ];
    for (i, (args, headers, want)) in cases.into_iter().enumerate() {
        for x in ["amq.headers", "amq.match"] {
            let mut t = Topology::new();
            t.bind(x, q("q"), "ignored-key", args.clone(), &all_queues)
                .unwrap();
            let got = !route(&t, x, "any-key", headers.as_ref()).is_empty();
            assert_eq!(got, want, "case {i} on {x}: {args:?} vs {headers:?}");
        }
    }
}

#[test]
fn headers_invalid_x_match_is_refused_at_bind() {
    let mut t = Topology::new();
    for bad in [
        FieldValue::from("some"),
        FieldValue::I32(1),
        FieldValue::from("ALL"),
    ] {
        let args = table(&[("x-match", bad)]);
        assert!(matches!(
            t.bind("amq.headers", q("q"), "", args, &all_queues),
            Err(CoreError::PreconditionFailed(_))
        ));
    }
}

// ---------------------------------------------------------------------------- topology

#[test]
fn exchange_to_exchange_bindings_are_followed_and_deduplicated() {
    let mut t = Topology::new();
    declare(&mut t, "src", ExchangeKind::Topic);
    declare(&mut t, "mid", ExchangeKind::Direct);
    declare(&mut t, "all", ExchangeKind::Fanout);
    bind(&mut t, "src", Destination::exchange("mid"), "a.*");
    bind(&mut t, "src", Destination::exchange("all"), "#");
    bind(&mut t, "src", q("q0"), "a.b");
    bind(&mut t, "mid", q("q1"), "a.b");
    bind(&mut t, "mid", q("q0"), "a.b");
    bind(&mut t, "all", q("q2"), "");
    bind(&mut t, "all", q("q1"), "");
    assert_eq!(route(&t, "src", "a.b", None), set(&["q0", "q1", "q2"]));
    assert_eq!(route(&t, "src", "a.c", None), set(&["q1", "q2"]));
    assert_eq!(route(&t, "src", "z", None), set(&["q1", "q2"]));
}

#[test]
fn exchange_cycles_terminate() {
    let mut t = Topology::new();
    declare(&mut t, "x", ExchangeKind::Fanout);
    declare(&mut t, "y", ExchangeKind::Fanout);
    bind(&mut t, "x", Destination::exchange("y"), "");
    bind(&mut t, "y", Destination::exchange("x"), "");
    bind(&mut t, "x", Destination::exchange("x"), "");
    assert!(route(&t, "x", "k", None).is_empty());
    bind(&mut t, "y", q("q"), "");
    assert_eq!(route(&t, "x", "k", None), set(&["q"]));
    assert_eq!(route(&t, "y", "k", None), set(&["q"]));
}

#[test]
fn internal_exchanges_are_reachable_only_through_bindings() {
    let mut t = Topology::new();
    let mut internal = ExchangeDef::new("internal", ExchangeKind::Fanout);
    internal.internal = true;
    t.declare_exchange(internal).unwrap();
    bind(&mut t, "internal", q("q"), "");
    bind(&mut t, "amq.direct", Destination::exchange("internal"), "k");
    assert!(matches!(
        t.route("internal", "k", None, &all_queues),
        Err(CoreError::AccessRefused(_))
    ));
    assert_eq!(route(&t, "amq.direct", "k", None), set(&["q"]));
}

fn declare_with_ae(t: &mut Topology, name: &str, kind: ExchangeKind, ae: &str) {
    let mut def = ExchangeDef::new(name, kind);
    def.arguments.insert(ALTERNATE_EXCHANGE, ae);
    t.declare_exchange(def).unwrap();
}

#[test]
fn alternate_exchange_takes_what_routes_nowhere() {
    let mut t = Topology::new();
    declare(&mut t, "ae", ExchangeKind::Fanout);
    declare_with_ae(&mut t, "x", ExchangeKind::Direct, "ae");
    bind(&mut t, "ae", q("unrouted"), "");
    bind(&mut t, "x", q("q"), "k");
    assert_eq!(route(&t, "x", "k", None), set(&["q"]));
    assert_eq!(route(&t, "x", "other", None), set(&["unrouted"]));
}

#[test]
fn alternate_exchange_not_used_when_bindings_match_but_lead_nowhere() {
    // RabbitMQ asks "did this exchange's own bindings match?", not "did a queue get it".
    let mut t = Topology::new();
    declare(&mut t, "ae", ExchangeKind::Fanout);
    declare(&mut t, "empty", ExchangeKind::Fanout);
    declare_with_ae(&mut t, "x", ExchangeKind::Direct, "ae");
    bind(&mut t, "ae", q("unrouted"), "");
    bind(&mut t, "x", Destination::exchange("empty"), "k");
    assert!(route(&t, "x", "k", None).is_empty());
}

#[test]
fn alternate_exchange_of_a_downstream_exchange_applies() {
    let mut t = Topology::new();
    declare(&mut t, "ae", ExchangeKind::Fanout);
    declare_with_ae(&mut t, "down", ExchangeKind::Direct, "ae");
    bind(&mut t, "ae", q("unrouted"), "");
    bind(&mut t, "amq.fanout", Destination::exchange("down"), "");
    assert_eq!(route(&t, "amq.fanout", "nomatch", None), set(&["unrouted"]));
}

#[test]
fn alternate_exchange_chains_cycles_and_missing_targets() {
    let mut t = Topology::new();
    // a -> b -> a (cycle of AEs), none bound: terminates, routes nowhere.
    declare_with_ae(&mut t, "a", ExchangeKind::Direct, "b");
    declare_with_ae(&mut t, "b", ExchangeKind::Direct, "a");
    assert!(route(&t, "a", "k", None).is_empty());
    // Self-reference.
    declare_with_ae(&mut t, "self", ExchangeKind::Direct, "self");
    assert!(route(&t, "self", "k", None).is_empty());
    // Missing AE is ignored.
    declare_with_ae(&mut t, "lost", ExchangeKind::Direct, "does-not-exist");
    assert!(route(&t, "lost", "k", None).is_empty());
    // Chains: c -> d -> amq.fanout.
    declare_with_ae(&mut t, "c", ExchangeKind::Direct, "d");
    declare_with_ae(&mut t, "d", ExchangeKind::Topic, "amq.fanout");
    bind(&mut t, "amq.fanout", q("last"), "");
    bind(&mut t, "d", q("d-hit"), "hit.#");
    assert_eq!(route(&t, "c", "miss", None), set(&["last"]));
    assert_eq!(route(&t, "c", "hit.me", None), set(&["d-hit"]));
    // An internal AE is fine.
    let mut internal = ExchangeDef::new("iae", ExchangeKind::Fanout);
    internal.internal = true;
    t.declare_exchange(internal).unwrap();
    bind(&mut t, "iae", q("caught"), "");
    declare_with_ae(&mut t, "e", ExchangeKind::Direct, "iae");
    assert_eq!(route(&t, "e", "k", None), set(&["caught"]));
}

#[test]
fn alternate_exchange_can_be_the_default_exchange() {
    let mut t = Topology::new();
    declare_with_ae(&mut t, "x", ExchangeKind::Direct, "");
    let exists = |name: &str| name == "k";
    assert_eq!(t.route("x", "k", None, &exists).unwrap(), ["k"]);
    assert!(t.route("x", "other", None, &exists).unwrap().is_empty());
}

// ---------------------------------------------------------------------------- topic vs reference

fn word() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("a"), Just("b"), Just("c"), Just("")]
}

fn pattern_word() -> impl Strategy<Value = &'static str> {
    prop_oneof![3 => word(), 2 => Just("*"), 2 => Just("#")]
}

fn pattern() -> impl Strategy<Value = String> {
    proptest::collection::vec(pattern_word(), 0..6).prop_map(|w| w.join("."))
}

fn key() -> impl Strategy<Value = String> {
    proptest::collection::vec(word(), 0..7).prop_map(|w| w.join("."))
}

fn expected(patterns: &[String], removed: &HashSet<usize>, key: &str) -> BTreeSet<String> {
    patterns
        .iter()
        .enumerate()
        .filter(|(i, p)| !removed.contains(i) && topic_matches(p, key))
        .map(|(i, _)| format!("q{i}"))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn topic_trie_agrees_with_reference(
        patterns in proptest::collection::vec(pattern(), 1..24),
        keys in proptest::collection::vec(key(), 1..24),
        remove_mask in any::<u32>(),
    ) {
        let mut t = Topology::new();
        for (i, p) in patterns.iter().enumerate() {
            t.bind("amq.topic", q(&format!("q{i}")), p, FieldTable::new(), &all_queues).unwrap();
        }
        let mut removed = HashSet::new();
        for key in &keys {
            prop_assert_eq!(route(&t, "amq.topic", key, None), expected(&patterns, &removed, key), "key {:?}", key);
        }
        for (i, p) in patterns.iter().enumerate() {
            if remove_mask & (1 << (i % 32)) != 0 {
                let (was, _) = t.unbind("amq.topic", &q(&format!("q{i}")), p, &FieldTable::new(), &all_queues).unwrap();
                prop_assert!(was);
                removed.insert(i);
            }
        }
        for key in &keys {
            prop_assert_eq!(route(&t, "amq.topic", key, None), expected(&patterns, &removed, key), "after removal, key {:?}", key);
        }
    }
}

/// xorshift64*: deterministic randomness without another dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn many_topic_bindings_route_correctly() {
    const BINDINGS: usize = 50_000;
    const KEYS: usize = 3_000;
    const CHECKED: usize = 300;
    // Patterns look like real ones: a literal first word (a tenant, a device class)
    // from a vocabulary of 100, then mostly literal words with some `*` and a few `#`.
    let words: Vec<String> = (0..100).map(|i| format!("w{i}")).collect();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut patterns = Vec::with_capacity(BINDINGS);
    let mut t = Topology::new();
    for i in 0..BINDINGS {
        let len = 1 + rng.below(5);
        let mut p: Vec<&str> = vec![words[rng.below(words.len())].as_str()];
        p.extend((1..len).map(|_| match rng.below(100) {
            0..=4 => "#",
            5..=19 => "*",
            _ => words[rng.below(words.len())].as_str(),
        }));
        let p = p.join(".");
        t.bind(
            "amq.topic",
            q(&format!("q{i}")),
            &p,
            FieldTable::new(),
            &all_queues,
        )
        .unwrap();
        patterns.push(p);
    }
    let split: Vec<Vec<&str>> = patterns.iter().map(|p| split_words(p)).collect();
    let mut routed_somewhere = 0;
    for k in 0..KEYS {
        let len = rng.below(6);
        // The tail of a key draws from 10 words so that literal patterns hit too.
        let key: Vec<&str> = (0..len)
            .map(|j| words[rng.below(if j == 0 { words.len() } else { 10 })].as_str())
            .collect();
        let got = route(&t, "amq.topic", &key.join("."), None);
        if !got.is_empty() {
            routed_somewhere += 1;
        }
        if k % (KEYS / CHECKED) == 0 {
            let want: BTreeSet<String> = split
                .iter()
                .enumerate()
                .filter(|(_, p)| reference_match(p, &key))
                .map(|(i, _)| format!("q{i}"))
                .collect();
            assert_eq!(got, want, "key {key:?}");
        }
    }
    assert!(
        routed_somewhere > KEYS / 2,
        "the sample exercises matches: {routed_somewhere}"
    );
}

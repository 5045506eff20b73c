//! A vhost's exchanges and bindings, and routing a publish to its final set of queues.
//!
//! Queues themselves live elsewhere (one owner per queue); the topology only needs to
//! know whether a queue exists, which the caller supplies through [`QueueLookup`].

use std::collections::{HashMap, HashSet, VecDeque};

use super::bindings::BindingTable;
use super::consistent_hash::{self, HashOn};
use super::exchange::{ExchangeDef, ExchangeKind, ALTERNATE_EXCHANGE};
use super::headers::validate_binding_args;
use super::{Binding, Destination};
use crate::error::CoreError;
use crate::message::Properties;
use crate::value::FieldTable;

/// The default exchange's name.
pub const DEFAULT_EXCHANGE: &str = "";

/// The exchanges every vhost starts with, besides the default one.
pub const PREDECLARED: [(&str, ExchangeKind); 5] = [
    ("amq.direct", ExchangeKind::Direct),
    ("amq.fanout", ExchangeKind::Fanout),
    ("amq.topic", ExchangeKind::Topic),
    ("amq.headers", ExchangeKind::Headers),
    ("amq.match", ExchangeKind::Headers),
];

const RESERVED_PREFIX: &str = "amq.";

/// Tells the topology which queues exist (the default exchange routes to them by name,
/// and bindings may only target existing queues).
pub trait QueueLookup {
    /// Whether a queue with this name exists in the vhost.
    fn queue_exists(&self, name: &str) -> bool;
}

impl<F: Fn(&str) -> bool> QueueLookup for F {
    fn queue_exists(&self, name: &str) -> bool {
        self(name)
    }
}

impl QueueLookup for HashSet<String> {
    fn queue_exists(&self, name: &str) -> bool {
        self.contains(name)
    }
}

#[derive(Debug)]
struct Exchange {
    def: ExchangeDef,
    bindings: BindingTable,
    /// What a consistent-hash exchange hashes, read from its arguments once at declare
    /// (not per publish); [`HashOn::RoutingKey`] for the other kinds.
    hash_on: HashOn,
}

/// What declaring an exchange did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Declared {
    /// A new exchange was created.
    Created,
    /// An equivalent exchange already existed.
    Existing,
}

/// A vhost's exchanges and bindings.
#[derive(Debug)]
pub struct Topology {
    exchanges: HashMap<String, Exchange, foldhash::fast::RandomState>,
}

impl Default for Topology {
    fn default() -> Self {
        Self::new()
    }
}

impl Topology {
    /// A topology holding the default exchange and the predeclared `amq.*` exchanges,
    /// all durable.
    pub fn new() -> Self {
        let mut exchanges = HashMap::default();
        let all = std::iter::once((DEFAULT_EXCHANGE, ExchangeKind::Direct)).chain(PREDECLARED);
        for (name, kind) in all {
            exchanges.insert(
                name.to_owned(),
                Exchange {
                    def: ExchangeDef::new(name, kind),
                    bindings: BindingTable::new(kind),
                    hash_on: HashOn::RoutingKey,
                },
            );
        }
        Topology { exchanges }
    }

    fn is_predeclared(name: &str) -> bool {
        name == DEFAULT_EXCHANGE || PREDECLARED.iter().any(|(n, _)| *n == name)
    }

    /// The definition of an exchange, if it exists.
    pub fn exchange(&self, name: &str) -> Option<&ExchangeDef> {
        self.exchanges.get(name).map(|x| &x.def)
    }

    /// A passive declare: the exchange's definition or [`CoreError::NotFound`].
    pub fn check_exchange(&self, name: &str) -> Result<&ExchangeDef, CoreError> {
        self.exchange(name)
            .ok_or_else(|| CoreError::exchange_not_found(name))
    }

    /// Every exchange's definition, in no particular order.
    pub fn exchanges(&self) -> impl Iterator<Item = &ExchangeDef> {
        self.exchanges.values().map(|x| &x.def)
    }

    /// Declares an exchange, RabbitMQ's way.
    ///
    /// - the default exchange cannot be declared: [`CoreError::AccessRefused`];
    /// - an existing exchange must be equivalent (kind, durable, auto-delete, internal
    ///   and the `alternate-exchange` argument; other arguments are not compared),
    ///   else [`CoreError::PreconditionFailed`];
    /// - a new name may not start with `amq.`: [`CoreError::AccessRefused`];
    /// - `alternate-exchange`, if given, must be a string: [`CoreError::PreconditionFailed`].
    ///
    /// Unknown kinds are refused earlier, when parsing [`ExchangeKind`].
    pub fn declare_exchange(&mut self, def: ExchangeDef) -> Result<Declared, CoreError> {
        if def.name == DEFAULT_EXCHANGE {
            return Err(default_exchange_refused());
        }
        if let Some(v) = def.arguments.get(ALTERNATE_EXCHANGE) {
            if v.as_str().is_none() {
                return Err(CoreError::PreconditionFailed(format!(
                    "invalid arg '{ALTERNATE_EXCHANGE}' for exchange '{}': expected a string, got {v:?}",
                    def.name
                )));
            }
        }
        let hash_on = if def.kind == ExchangeKind::ConsistentHash {
            HashOn::from_args(&def.name, &def.arguments)?
        } else {
            HashOn::RoutingKey
        };
        if let Some(existing) = self.exchanges.get(&def.name) {
            assert_equivalent(&existing.def, &def)?;
            return Ok(Declared::Existing);
        }
        if def.name.starts_with(RESERVED_PREFIX) {
            return Err(CoreError::AccessRefused(format!(
                "exchange name '{}' contains reserved prefix '{RESERVED_PREFIX}*'",
                def.name
            )));
        }
        let kind = def.kind;
        self.exchanges.insert(
            def.name.clone(),
            Exchange {
                def,
                bindings: BindingTable::new(kind),
                hash_on,
            },
        );
        Ok(Declared::Created)
    }

    /// Deletes an exchange with its bindings, both those it is the source of and those
    /// leading to it. Returns the names of every exchange deleted: this one first, then
    /// any auto-delete exchange that lost its last binding as a result.
    ///
    /// - default or predeclared exchange: [`CoreError::AccessRefused`];
    /// - missing: [`CoreError::NotFound`] (RabbitMQ's AMQP `exchange.delete` treats
    ///   this as success; that is the adapter's call);
    /// - `if_unused` and it is the source of a binding: [`CoreError::PreconditionFailed`].
    pub fn delete_exchange(
        &mut self,
        name: &str,
        if_unused: bool,
    ) -> Result<Vec<String>, CoreError> {
        if name == DEFAULT_EXCHANGE {
            return Err(default_exchange_refused());
        }
        if Self::is_predeclared(name) {
            return Err(CoreError::AccessRefused(format!(
                "deletion of system exchange '{name}' not allowed"
            )));
        }
        let x = self
            .exchanges
            .get(name)
            .ok_or_else(|| CoreError::exchange_not_found(name))?;
        if if_unused && !x.bindings.is_empty() {
            return Err(CoreError::PreconditionFailed(format!(
                "exchange '{name}' in use"
            )));
        }
        let mut deleted = Vec::new();
        self.delete_cascade(name.to_owned(), &mut deleted);
        Ok(deleted)
    }

    /// Removes every binding leading to `destination` (a queue was deleted, or an
    /// exchange). Returns the auto-delete exchanges deleted as a result.
    pub fn remove_destination(&mut self, destination: &Destination) -> Vec<String> {
        let mut emptied = Vec::new();
        for x in self.exchanges.values_mut() {
            if x.bindings.remove_destination(destination) > 0
                && x.bindings.is_empty()
                && x.def.auto_delete
            {
                emptied.push(x.def.name.clone());
            }
        }
        let mut deleted = Vec::new();
        for name in emptied {
            self.delete_cascade(name, &mut deleted);
        }
        deleted
    }

    /// Deletes `first` and then every auto-delete exchange left without bindings,
    /// iteratively (no recursion, no revisits).
    fn delete_cascade(&mut self, first: String, deleted: &mut Vec<String>) {
        let mut work = vec![first];
        while let Some(name) = work.pop() {
            if Self::is_predeclared(&name) || self.exchanges.remove(&name).is_none() {
                continue;
            }
            let gone = Destination::exchange(name.as_str());
            deleted.push(name);
            for x in self.exchanges.values_mut() {
                if x.bindings.remove_destination(&gone) > 0
                    && x.bindings.is_empty()
                    && x.def.auto_delete
                {
                    work.push(x.def.name.clone());
                }
            }
        }
    }

    fn check_bindable(
        &self,
        source: &str,
        destination: &Destination,
        queues: &dyn QueueLookup,
    ) -> Result<(), CoreError> {
        if source == DEFAULT_EXCHANGE
            || matches!(destination, Destination::Exchange(x) if &**x == DEFAULT_EXCHANGE)
        {
            return Err(default_exchange_refused());
        }
        if !self.exchanges.contains_key(source) {
            return Err(CoreError::exchange_not_found(source));
        }
        match destination {
            Destination::Queue(q) if !queues.queue_exists(q) => Err(CoreError::queue_not_found(q)),
            Destination::Exchange(x) if !self.exchanges.contains_key(&**x) => {
                Err(CoreError::exchange_not_found(x))
            }
            _ => Ok(()),
        }
    }

    /// Binds `destination` to `source` with a key and arguments. Returns whether the
    /// binding is new (binding twice is not an error).
    ///
    /// - the default exchange as source or destination: [`CoreError::AccessRefused`];
    /// - missing source, destination exchange or queue: [`CoreError::NotFound`];
    /// - a headers exchange with an invalid `x-match`: [`CoreError::PreconditionFailed`].
    pub fn bind(
        &mut self,
        source: &str,
        destination: Destination,
        key: &str,
        args: FieldTable,
        queues: &dyn QueueLookup,
    ) -> Result<bool, CoreError> {
        self.check_bindable(source, &destination, queues)?;
        let x = self
            .exchanges
            .get_mut(source)
            .ok_or_else(|| CoreError::exchange_not_found(source))?;
        if x.def.kind == ExchangeKind::Headers {
            validate_binding_args(&args)?;
        }
        if x.def.kind == ExchangeKind::ConsistentHash {
            consistent_hash::weight(key)?;
        }
        Ok(x.bindings.insert(destination, key, args))
    }

    /// Removes a binding. Returns whether it existed (RabbitMQ treats unbinding a
    /// missing binding as success) and the auto-delete exchanges deleted as a result.
    ///
    /// Errors as [`Topology::bind`], except that x-match is not validated.
    pub fn unbind(
        &mut self,
        source: &str,
        destination: &Destination,
        key: &str,
        args: &FieldTable,
        queues: &dyn QueueLookup,
    ) -> Result<(bool, Vec<String>), CoreError> {
        self.check_bindable(source, destination, queues)?;
        let x = self
            .exchanges
            .get_mut(source)
            .ok_or_else(|| CoreError::exchange_not_found(source))?;
        let removed = x.bindings.remove(destination, key, args);
        let mut deleted = Vec::new();
        if removed && x.bindings.is_empty() && x.def.auto_delete {
            self.delete_cascade(source.to_owned(), &mut deleted);
        }
        Ok((removed, deleted))
    }

    /// Every binding in the vhost, in no particular order (the default exchange's
    /// implicit bindings are not listed).
    pub fn bindings(&self) -> Vec<Binding> {
        self.exchanges
            .values()
            .flat_map(|x| {
                x.bindings.iter().map(|(d, k, a)| Binding {
                    source: x.def.name.clone(),
                    destination: d.clone(),
                    routing_key: k.to_owned(),
                    arguments: a.clone(),
                })
            })
            .collect()
    }

    /// Whether this exact binding exists (false when the exchange does not).
    pub fn has_binding(
        &self,
        exchange: &str,
        destination: &Destination,
        key: &str,
        args: &FieldTable,
    ) -> bool {
        self.exchanges
            .get(exchange)
            .is_some_and(|x| x.bindings.contains(destination, key, args))
    }

    /// The bindings whose source is `exchange`.
    pub fn bindings_from(&self, exchange: &str) -> Result<Vec<Binding>, CoreError> {
        let x = self
            .exchanges
            .get(exchange)
            .ok_or_else(|| CoreError::exchange_not_found(exchange))?;
        Ok(x.bindings
            .iter()
            .map(|(d, k, a)| Binding {
                source: exchange.to_owned(),
                destination: d.clone(),
                routing_key: k.to_owned(),
                arguments: a.clone(),
            })
            .collect())
    }

    /// The bindings leading to `destination`.
    pub fn bindings_to(&self, destination: &Destination) -> Vec<Binding> {
        self.bindings()
            .into_iter()
            .filter(|b| b.destination == *destination)
            .collect()
    }

    /// Routes a publish to `exchange` with `routing_key` and `headers` to the final set
    /// of queue names, each once, in the order first reached.
    ///
    /// Follows exchange-to-exchange bindings breadth-first, visiting each exchange at
    /// most once (cycles are harmless). An exchange whose own bindings lead nowhere
    /// hands the message to its `alternate-exchange`, if that exists, under the same
    /// rule. The default exchange routes key `Q` to queue `Q` if it exists. Queues that
    /// no longer exist are skipped. An empty result means unroutable (the adapter
    /// handles `mandatory`).
    ///
    /// - missing exchange: [`CoreError::NotFound`];
    /// - internal exchange: [`CoreError::AccessRefused`].
    pub fn route(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: Option<&FieldTable>,
        queues: &dyn QueueLookup,
    ) -> Result<Vec<String>, CoreError> {
        self.route_with(exchange, routing_key, headers, None, queues)
    }

    /// [`Topology::route`] for a message with these properties (a consistent-hash
    /// exchange's `hash-property` reads them; headers are `props.headers`).
    pub fn route_message(
        &self,
        exchange: &str,
        routing_key: &str,
        props: &Properties,
        queues: &dyn QueueLookup,
    ) -> Result<Vec<String>, CoreError> {
        self.route_with(
            exchange,
            routing_key,
            props.headers.as_ref(),
            Some(props),
            queues,
        )
    }

    fn route_with(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: Option<&FieldTable>,
        props: Option<&Properties>,
        queues: &dyn QueueLookup,
    ) -> Result<Vec<String>, CoreError> {
        let x = self
            .exchanges
            .get(exchange)
            .ok_or_else(|| CoreError::exchange_not_found(exchange))?;
        if x.def.internal {
            return Err(CoreError::AccessRefused(format!(
                "cannot publish to internal exchange '{exchange}'"
            )));
        }
        if x.def.name == DEFAULT_EXCHANGE {
            // The common case, without the bookkeeping of the general walk below.
            return Ok(if queues.queue_exists(routing_key) {
                vec![routing_key.to_owned()]
            } else {
                Vec::new()
            });
        }
        let mut out: Vec<String> = Vec::new();
        let mut out_seen = Seen::default();
        let mut seen = Seen::default();
        seen.insert(exchange);
        let mut work: VecDeque<&Exchange> = VecDeque::new();
        let mut next_exchange = Some(x);
        let mut targets: Vec<&Destination> = Vec::new();
        while let Some(x) = next_exchange.take().or_else(|| work.pop_front()) {
            if x.def.name == DEFAULT_EXCHANGE {
                if queues.queue_exists(routing_key) && out_seen.insert(routing_key) {
                    out.push(routing_key.to_owned());
                }
                continue;
            }
            targets.clear();
            match x.def.kind {
                ExchangeKind::ConsistentHash => {
                    let input = x.hash_on.input(routing_key, headers, props);
                    targets.extend(x.bindings.route_hashed(&input));
                }
                _ => x
                    .bindings
                    .route(routing_key, headers, &mut |d| targets.push(d)),
            }
            if targets.is_empty() {
                if let Some(ae) = x.def.alternate_exchange() {
                    if let Some((name, next)) = self.exchanges.get_key_value(ae) {
                        if seen.insert(name.as_str()) {
                            work.push_back(next);
                        }
                    }
                }
                continue;
            }
            for d in targets.drain(..) {
                match d {
                    Destination::Queue(q) => {
                        if !out_seen.contains(q) && queues.queue_exists(q) {
                            out_seen.insert(q);
                            out.push(q.to_string());
                        }
                    }
                    Destination::Exchange(name) => {
                        if let Some((name, next)) = self.exchanges.get_key_value(&**name) {
                            if seen.insert(name.as_str()) {
                                work.push_back(next);
                            }
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}

/// A set of names that stays a small vector (no hashing, one allocation at most) until it
/// grows past [`Seen::SMALL`] entries: most routes reach one or a few queues.
#[derive(Default)]
struct Seen<'a> {
    small: Vec<&'a str>,
    large: HashSet<&'a str>,
}

impl<'a> Seen<'a> {
    const SMALL: usize = 16;

    fn contains(&self, name: &str) -> bool {
        self.small.contains(&name) || self.large.contains(name)
    }

    /// Adds `name`; false if it was there already.
    fn insert(&mut self, name: &'a str) -> bool {
        if self.contains(name) {
            return false;
        }
        if self.small.len() < Self::SMALL {
            self.small.push(name);
        } else {
            self.large.insert(name);
        }
        true
    }
}

fn default_exchange_refused() -> CoreError {
    CoreError::AccessRefused("operation not permitted on the default exchange".to_owned())
}

fn assert_equivalent(current: &ExchangeDef, requested: &ExchangeDef) -> Result<(), CoreError> {
    let name = &current.name;
    let check = |field: &str, received: String, current: String| {
        if received == current {
            Ok(())
        } else {
            Err(CoreError::PreconditionFailed(format!(
                "inequivalent arg '{field}' for exchange '{name}': received '{received}' but current is '{current}'"
            )))
        }
    };
    check("type", requested.kind.to_string(), current.kind.to_string())?;
    check(
        "durable",
        requested.durable.to_string(),
        current.durable.to_string(),
    )?;
    check(
        "auto_delete",
        requested.auto_delete.to_string(),
        current.auto_delete.to_string(),
    )?;
    check(
        "internal",
        requested.internal.to_string(),
        current.internal.to_string(),
    )?;
    let received = requested.alternate_exchange();
    let existing = current.alternate_exchange();
    if received != existing {
        return Err(CoreError::PreconditionFailed(format!(
            "inequivalent arg '{ALTERNATE_EXCHANGE}' for exchange '{name}': received {received:?} but current is {existing:?}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queues(names: &[&str]) -> HashSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn def(name: &str, kind: ExchangeKind) -> ExchangeDef {
        ExchangeDef::new(name, kind)
    }

    #[test]
    fn predeclared_exchanges() {
        let t = Topology::new();
        for (name, kind) in PREDECLARED {
            assert_eq!(t.check_exchange(name).unwrap().kind, kind);
        }
        assert_eq!(t.check_exchange("").unwrap().kind, ExchangeKind::Direct);
        assert_eq!(t.exchanges().count(), 6);
        assert!(matches!(
            t.check_exchange("nope"),
            Err(CoreError::NotFound { .. })
        ));
    }

    #[test]
    fn declare_rules() {
        let mut t = Topology::new();
        assert_eq!(
            t.declare_exchange(def("x", ExchangeKind::Topic)),
            Ok(Declared::Created)
        );
        assert_eq!(
            t.declare_exchange(def("x", ExchangeKind::Topic)),
            Ok(Declared::Existing)
        );
        assert!(matches!(
            t.declare_exchange(def("x", ExchangeKind::Direct)),
            Err(CoreError::PreconditionFailed(_))
        ));
        let mut transient = def("x", ExchangeKind::Topic);
        transient.durable = false;
        assert!(matches!(
            t.declare_exchange(transient),
            Err(CoreError::PreconditionFailed(_))
        ));
        let mut with_ae = def("x", ExchangeKind::Topic);
        with_ae.arguments.insert(ALTERNATE_EXCHANGE, "ae");
        assert!(matches!(
            t.declare_exchange(with_ae),
            Err(CoreError::PreconditionFailed(_))
        ));
        let mut other_args = def("x", ExchangeKind::Topic);
        other_args.arguments.insert("x-whatever", 1i32);
        assert_eq!(
            t.declare_exchange(other_args),
            Ok(Declared::Existing),
            "only AE is compared"
        );

        assert!(matches!(
            t.declare_exchange(def("", ExchangeKind::Direct)),
            Err(CoreError::AccessRefused(_))
        ));
        assert!(matches!(
            t.declare_exchange(def("amq.new", ExchangeKind::Direct)),
            Err(CoreError::AccessRefused(_))
        ));
        assert_eq!(
            t.declare_exchange(def("amq.topic", ExchangeKind::Topic)),
            Ok(Declared::Existing)
        );
        assert!(matches!(
            t.declare_exchange(def("amq.topic", ExchangeKind::Fanout)),
            Err(CoreError::PreconditionFailed(_))
        ));
        let mut bad_ae = def("y", ExchangeKind::Direct);
        bad_ae.arguments.insert(ALTERNATE_EXCHANGE, 5i32);
        assert!(matches!(
            t.declare_exchange(bad_ae),
            Err(CoreError::PreconditionFailed(_))
        ));
    }

    #[test]
    fn delete_rules() {
        let mut t = Topology::new();
        let qs = queues(&["q"]);
        assert!(matches!(
            t.delete_exchange("", false),
            Err(CoreError::AccessRefused(_))
        ));
        assert!(matches!(
            t.delete_exchange("amq.direct", false),
            Err(CoreError::AccessRefused(_))
        ));
        assert!(matches!(
            t.delete_exchange("nope", false),
            Err(CoreError::NotFound { .. })
        ));
        t.declare_exchange(def("x", ExchangeKind::Fanout)).unwrap();
        t.bind("x", Destination::queue("q"), "", FieldTable::new(), &qs)
            .unwrap();
        t.bind(
            "amq.fanout",
            Destination::exchange("x"),
            "",
            FieldTable::new(),
            &qs,
        )
        .unwrap();
        assert!(matches!(
            t.delete_exchange("x", true),
            Err(CoreError::PreconditionFailed(_))
        ));
        assert_eq!(t.delete_exchange("x", false), Ok(vec!["x".to_owned()]));
        assert!(t.bindings().is_empty(), "bindings from and to x are gone");
    }

    #[test]
    fn bind_rules() {
        let mut t = Topology::new();
        let qs = queues(&["q"]);
        let none = FieldTable::new;
        assert!(matches!(
            t.bind("", Destination::queue("q"), "q", none(), &qs),
            Err(CoreError::AccessRefused(_))
        ));
        assert!(matches!(
            t.bind("amq.direct", Destination::exchange(""), "k", none(), &qs),
            Err(CoreError::AccessRefused(_))
        ));
        assert!(matches!(
            t.bind("nope", Destination::queue("q"), "k", none(), &qs),
            Err(CoreError::NotFound {
                kind: crate::error::ResourceKind::Exchange,
                ..
            })
        ));
        assert!(matches!(
            t.bind(
                "amq.direct",
                Destination::queue("missing"),
                "k",
                none(),
                &qs
            ),
            Err(CoreError::NotFound {
                kind: crate::error::ResourceKind::Queue,
                ..
            })
        ));
        assert!(matches!(
            t.bind(
                "amq.direct",
                Destination::exchange("missing"),
                "k",
                none(),
                &qs
            ),
            Err(CoreError::NotFound {
                kind: crate::error::ResourceKind::Exchange,
                ..
            })
        ));
        let bad: FieldTable = [("x-match", "most")].into_iter().collect();
        assert!(matches!(
            t.bind("amq.match", Destination::queue("q"), "", bad.clone(), &qs),
            Err(CoreError::PreconditionFailed(_))
        ));
        assert_eq!(
            t.bind("amq.direct", Destination::queue("q"), "", bad, &qs),
            Ok(true),
            "only headers validate"
        );
        assert_eq!(
            t.bind("amq.direct", Destination::queue("q"), "k", none(), &qs),
            Ok(true)
        );
        assert_eq!(
            t.bind("amq.direct", Destination::queue("q"), "k", none(), &qs),
            Ok(false)
        );
        assert_eq!(t.bindings_from("amq.direct").unwrap().len(), 2);
        assert_eq!(t.bindings_to(&Destination::queue("q")).len(), 2);
        let q = Destination::queue("q");
        assert!(t.has_binding("amq.direct", &q, "k", &none()));
        assert!(!t.has_binding("amq.direct", &q, "other", &none()));
        assert!(!t.has_binding("amq.topic", &q, "k", &none()));
        assert!(!t.has_binding("nope", &q, "k", &none()));
        let (removed, deleted) = t
            .unbind("amq.direct", &Destination::queue("q"), "k", &none(), &qs)
            .unwrap();
        assert!(removed && deleted.is_empty());
        let (removed, _) = t
            .unbind("amq.direct", &Destination::queue("q"), "k", &none(), &qs)
            .unwrap();
        assert!(!removed);
    }

    #[test]
    fn auto_delete_cascades() {
        let mut t = Topology::new();
        let qs = queues(&["q"]);
        let mut a = def("a", ExchangeKind::Fanout);
        a.auto_delete = true;
        let mut b = def("b", ExchangeKind::Fanout);
        b.auto_delete = true;
        t.declare_exchange(a).unwrap();
        t.declare_exchange(b).unwrap();
        // a -> b -> q; deleting q empties b (auto-deleted), which empties a.
        t.bind("b", Destination::queue("q"), "", FieldTable::new(), &qs)
            .unwrap();
        t.bind("a", Destination::exchange("b"), "", FieldTable::new(), &qs)
            .unwrap();
        let mut deleted = t.remove_destination(&Destination::queue("q"));
        deleted.sort();
        assert_eq!(deleted, ["a", "b"]);
        assert!(t.exchange("a").is_none() && t.exchange("b").is_none());

        let mut c = def("c", ExchangeKind::Direct);
        c.auto_delete = true;
        t.declare_exchange(c).unwrap();
        t.bind("c", Destination::queue("q"), "k", FieldTable::new(), &qs)
            .unwrap();
        let (_, deleted) = t
            .unbind("c", &Destination::queue("q"), "k", &FieldTable::new(), &qs)
            .unwrap();
        assert_eq!(deleted, ["c"]);
    }

    #[test]
    fn route_refuses_internal_and_missing() {
        let mut t = Topology::new();
        let mut i = def("i", ExchangeKind::Fanout);
        i.internal = true;
        t.declare_exchange(i).unwrap();
        let qs = queues(&[]);
        assert!(matches!(
            t.route("i", "", None, &qs),
            Err(CoreError::AccessRefused(_))
        ));
        assert!(matches!(
            t.route("nope", "", None, &qs),
            Err(CoreError::NotFound { .. })
        ));
    }

    #[test]
    fn consistent_hash_exchange() {
        let mut t = Topology::new();
        let qs = queues(&["a", "b", "c"]);
        let mut bad = def("bad", ExchangeKind::ConsistentHash);
        bad.arguments.insert("hash-header", "h");
        bad.arguments.insert("hash-property", "message_id");
        assert!(matches!(
            t.declare_exchange(bad),
            Err(CoreError::PreconditionFailed(m)) if m.contains("mutually exclusive")
        ));
        let mut x = def("x", ExchangeKind::ConsistentHash);
        x.arguments.insert("hash-header", "user");
        t.declare_exchange(x).unwrap();
        for bad_key in ["0", "w", ""] {
            assert!(matches!(
                t.bind(
                    "x",
                    Destination::queue("a"),
                    bad_key,
                    FieldTable::new(),
                    &qs
                ),
                Err(CoreError::PreconditionFailed(_))
            ));
        }
        for q in ["a", "b", "c"] {
            t.bind("x", Destination::queue(q), "10", FieldTable::new(), &qs)
                .unwrap();
        }
        // one queue per message, the same one for the same header, whatever the key
        let mut hit = HashSet::new();
        for u in 0..300 {
            let props = Properties {
                headers: Some([("user", format!("u{u}"))].into_iter().collect()),
                ..Default::default()
            };
            let r1 = t.route_message("x", "k1", &props, &qs).unwrap();
            let r2 = t.route_message("x", "k2", &props, &qs).unwrap();
            assert_eq!(r1.len(), 1);
            assert_eq!(r1, r2);
            hit.insert(r1[0].clone());
        }
        assert_eq!(hit.len(), 3, "every queue gets some keys");
    }
}

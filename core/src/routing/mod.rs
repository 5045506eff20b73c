//! Exchanges, bindings and routing: pure data structures, no I/O, no async.
//!
//! - [`exchange`]: [`ExchangeKind`] and [`ExchangeDef`].
//! - [`topic`]: the topic trie ([`TopicTrie`]) with RabbitMQ's `*`/`#` semantics.
//! - [`headers`]: the headers exchange's `x-match` rule.
//! - [`bindings`]: one exchange's [`BindingTable`], indexed for its kind.
//! - [`consistent_hash`]: the `x-consistent-hash` exchange's ring (RabbitMQ's plugin).
//! - [`topology`]: a vhost's exchanges and bindings ([`Topology`]) and
//!   [`Topology::route`], which resolves a publish to the final set of queues.

pub mod bindings;
pub mod consistent_hash;
pub mod exchange;
pub mod headers;
pub mod topic;
pub mod topology;

pub use bindings::BindingTable;
pub use exchange::{ExchangeDef, ExchangeKind};
pub use headers::XMatch;
pub use topic::TopicTrie;
pub use topology::{Declared, QueueLookup, Topology};

use std::sync::Arc;

use crate::value::FieldTable;

/// Where a binding leads. The name is shared: a binding table keeps one copy of each
/// destination's name however many bindings lead to it (see [`BindingTable`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Destination {
    /// A queue, by name.
    Queue(Arc<str>),
    /// An exchange, by name (exchange-to-exchange binding).
    Exchange(Arc<str>),
}

impl Destination {
    /// A queue destination.
    pub fn queue(name: impl Into<Arc<str>>) -> Self {
        Destination::Queue(name.into())
    }

    /// An exchange destination.
    pub fn exchange(name: impl Into<Arc<str>>) -> Self {
        Destination::Exchange(name.into())
    }

    /// The queue's or exchange's name.
    pub fn name(&self) -> &str {
        match self {
            Destination::Queue(n) | Destination::Exchange(n) => n,
        }
    }
}

/// A binding as listed: source exchange, destination, key and arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// The exchange messages come from.
    pub source: String,
    /// Where they go.
    pub destination: Destination,
    /// The binding key (a pattern for topic exchanges; ignored by fanout and headers).
    pub routing_key: String,
    /// The binding arguments (the pattern for headers exchanges).
    pub arguments: FieldTable,
}

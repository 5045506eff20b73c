//! The core's error type.
//!
//! The core knows no wire format, so these variants name *conditions*, not reply codes.
//! Each adapter owns the table that maps them to its protocol (AMQP reply codes, STOMP
//! ERROR frames, MQTT return codes). The AMQP 0-9-1 reply code RabbitMQ uses for each
//! condition is noted on the variant only as a hint for that table.

use std::fmt;

use thiserror::Error;

/// The kind of named resource an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResourceKind {
    /// A virtual host.
    Vhost,
    /// An exchange.
    Exchange,
    /// A queue.
    Queue,
    /// A binding between an exchange and a queue or exchange.
    Binding,
    /// A half message ([`crate::txn`]), by message-id.
    HalfMessage,
}

impl fmt::Display for ResourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ResourceKind::Vhost => "vhost",
            ResourceKind::Exchange => "exchange",
            ResourceKind::Queue => "queue",
            ResourceKind::Binding => "binding",
            ResourceKind::HalfMessage => "half message",
        })
    }
}

/// Everything that can go wrong in the core that a caller is expected to handle.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CoreError {
    /// A named resource does not exist: publishing to, binding, passively declaring or
    /// deleting a missing exchange or queue. (AMQP: 404 NOT_FOUND.)
    #[error("no {kind} '{name}'")]
    NotFound {
        /// What was looked up.
        kind: ResourceKind,
        /// Its name.
        name: String,
    },

    /// The request contradicts the resource's current state: redeclaring with
    /// inequivalent properties or arguments, deleting an exchange that is still in use
    /// with `if-unused`, an invalid binding argument such as a bad `x-match`.
    /// (AMQP: 406 PRECONDITION_FAILED.)
    #[error("precondition failed: {0}")]
    PreconditionFailed(String),

    /// The operation is never permitted on this resource: declaring a name with the
    /// reserved `amq.` prefix, deleting or binding the default exchange, deleting a
    /// predeclared exchange, publishing directly to an internal exchange, or a
    /// permission check failed. (AMQP: 403 ACCESS_REFUSED.)
    #[error("access refused: {0}")]
    AccessRefused(String),

    /// The resource is held exclusively by another connection (an exclusive queue).
    /// (AMQP: 405 RESOURCE_LOCKED.)
    #[error("resource locked: {0}")]
    ResourceLocked(String),

    /// The request names something the broker does not implement, such as an unknown
    /// exchange type. (AMQP: 503 COMMAND_INVALID.)
    #[error("command invalid: {0}")]
    CommandInvalid(String),

    /// The operation exists in the protocol but not for this resource: `basic.get`,
    /// `queue.purge` or an auto-ack consumer on a stream queue. (AMQP: 540
    /// NOT_IMPLEMENTED, as RabbitMQ.)
    #[error("not implemented: {0}")]
    NotImplemented(String),

    /// The user may not use this vhost, or the vhost does not exist at connection
    /// time. (AMQP: 530 NOT_ALLOWED.)
    #[error("not allowed: {0}")]
    NotAllowed(String),

    /// A stored encoding (for example [`crate::message::Properties`] in a commitlog
    /// record) is malformed, truncated, too deeply nested or of an unknown version.
    /// Never caused by a peer directly: it means a corrupt or foreign record.
    #[error("invalid encoding: {0}")]
    InvalidEncoding(&'static str),

    /// A value is too large or too deeply nested to be stored (for example a header
    /// table nested deeper than [`crate::value::MAX_DEPTH`]). Adapters should refuse
    /// such input earlier; this is the core's own bound. (AMQP: 406 or a frame error.)
    #[error("limit exceeded: {0}")]
    LimitExceeded(&'static str),

    /// The store failed underneath an operation (I/O error, disk full, a fatal flush
    /// failure). Adapters close the connection (AMQP 541 INTERNAL_ERROR).
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<triad_store::StoreError> for CoreError {
    fn from(e: triad_store::StoreError) -> Self {
        match e {
            triad_store::StoreError::TooLarge { .. } => {
                CoreError::LimitExceeded("message too large for the store")
            }
            other => CoreError::Internal(other.to_string()),
        }
    }
}

impl CoreError {
    /// Shorthand for [`CoreError::NotFound`] on an exchange.
    pub fn exchange_not_found(name: &str) -> Self {
        CoreError::NotFound {
            kind: ResourceKind::Exchange,
            name: name.to_owned(),
        }
    }

    /// Shorthand for [`CoreError::NotFound`] on a queue.
    pub fn queue_not_found(name: &str) -> Self {
        CoreError::NotFound {
            kind: ResourceKind::Queue,
            name: name.to_owned(),
        }
    }
}

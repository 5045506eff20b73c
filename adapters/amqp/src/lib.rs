//! AMQP 0-9-1 adapter: lets unmodified 0-9-1 clients (pika, lapin, amqplib, kombu)
//! talk to the Triad core the way they talk to RabbitMQ.
//!
//! Modules, from the socket inwards:
//! - [`codec`]: pure framing, bytes ⇄ [`codec::Frame`] (amq-protocol's method and
//!   property parsers behind our own size, frame-end and table-depth checks).
//! - [`mapping`]: amq-protocol field tables and basic properties ⇄ the core's
//!   [`triad_core::FieldTable`] and [`triad_core::Properties`].
//! - [`errors`]: reply codes and the table mapping [`triad_core::CoreError`] to them.
//! - [`session`]: the sans-IO connection state machine (handshake, connection
//!   class, error handling, teardown); [`channel`] holds the channel-level methods
//!   and content assembly; [`confirms`] the in-order publisher-confirm FIFO.
//! - [`driver`]: [`serve`], the one task per connection: the protocol header, then the
//!   session under the core's connection driver (`triad_core::driver`), which does the
//!   socket I/O and the timers.
//! - [`config`]: [`AmqpConfig`] limits and timeouts.

#![deny(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
#![cfg_attr(
    test,
    allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)
)]

pub mod channel;
pub mod codec;
pub mod config;
pub mod confirms;
pub mod driver;
pub mod errors;
pub mod mapping;
pub mod session;

pub use config::AmqpConfig;
pub use driver::{serve, AmqpContext, ServeError};

//! STOMP 1.0/1.1/1.2 adapter: lets stomp.py, stompjs and ActiveMQ-era STOMP clients
//! use the Triad core, with RabbitMQ's STOMP plugin conventions (destinations, ack
//! modes, durable topic subscriptions, temp queues, header mapping).
//!
//! Modules, bottom up:
//! - [`frame`]: [`Frame`] and [`Command`].
//! - [`codec`]: pure framing, `decode(&mut BytesMut, &Limits)` /
//!   `encode(&Frame, &mut BytesMut)`: escaping, `content-length`, heart-beat EOLs,
//!   limits checked before buffering.
//! - [`destination`]: `/queue/`, `/topic/`, `/exchange/`, `/amq/queue/`, `/temp-queue/`,
//!   `/reply-queue/` ⇄ exchange and routing key.
//! - [`queue_name`]: durable subscription queue names, as RabbitMQ's plugin makes them.
//! - [`mapping`]: STOMP headers ⇄ core `Properties`, core errors → ERROR frames.
//! - [`session`]: the sans-IO protocol state machine ([`Session`]): frames and core
//!   deliveries in, [`Action`]s out.
//! - [`driver`]: [`serve`], the one task per connection: the session under the core's
//!   connection driver (`triad_core::driver`), which does the I/O, timers and
//!   durability waits.

#![deny(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
#![cfg_attr(
    test,
    allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)
)]
#![warn(missing_docs)]

pub mod codec;
pub mod destination;
pub mod driver;
pub mod frame;
pub mod mapping;
pub mod queue_name;
pub mod session;

pub use codec::{decode, encode, DecodeError, Dialect, Limits};
pub use driver::{serve, ServeError, StompContext};
pub use frame::{Command, Frame};
pub use session::{Action, Caps, Session, SessionConfig, Version};
